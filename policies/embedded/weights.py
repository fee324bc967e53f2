"""Deterministic dummy weights for the embedded policies, and their ``.npz`` file format.

Like vLLM's ``dummy`` load format, nothing is downloaded: every parameter is drawn from a
numpy generator seeded by ``(seed, crc32(name))``, so a parameter does not change when
another one is added, and the same seed gives the same bits on every machine.

The file is a plain ``.npz``: one float32 array per parameter plus ``__chunkline__``, a uint8
array holding a UTF-8 JSON header (format, version, config, seed). It is read with
``allow_pickle=False``: object arrays are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from chunkline.client.wire.fingerprint import weights_digest

from ..exceptions import PolicyConfigError, WeightsFormatError
from .config import ComputeConfig, EmbeddedConfig, LoadtestConfig, config_from_dict, config_to_dict

__all__ = [
    "EmbeddedWeights",
    "HEADER_KEY",
    "FORMAT",
    "FORMAT_VERSION",
    "generate_weights",
    "default_weights",
    "save_weights",
    "load_weights",
]

HEADER_KEY = "__chunkline__"
FORMAT = "chunkline.embedded"
FORMAT_VERSION = 1
_MAX_HEADER_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class EmbeddedWeights:
    """An embedded policy's architecture and parameters.

    Args:
        config: the architecture.
        arrays: parameter name to float32 array, exactly the names and shapes of
            ``config.param_shapes()``.
        seed: the seed the arrays were generated from, if they were generated.
    """

    config: EmbeddedConfig
    arrays: Mapping[str, np.ndarray]
    seed: int | None = None

    @property
    def kind(self) -> str:
        """``"loadtest"`` or ``"loadtest-compute"``."""
        return self.config.kind

    @property
    def num_params(self) -> int:
        return sum(a.size for a in self.arrays.values())

    def digest(self) -> str:
        """:func:`~chunkline.client.wire.fingerprint.weights_digest` of the arrays, prefixed by the config
        (two architectures never share a digest)."""
        return f"{self.kind}:{weights_digest(self.arrays)}"


def _init_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a parameter's initial distribution, from its role in the name."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "w":  # linear weight [in, out]: unit-variance outputs for unit-variance inputs
        std = 1.0 / math.sqrt(shape[0])
        return 0.0, (0.5 * std if name.startswith("head.") else std)  # head: keep tanh unsaturated
    if leaf == "g":  # LayerNorm gain
        return 1.0, 0.1
    if leaf == "b":  # biases and LayerNorm shifts: small but non-zero, so a dropped bias shows
        return 0.0, 0.02
    return 0.0, 0.1  # token, position and query embeddings


def generate_weights(config: EmbeddedConfig, seed: int = 0) -> EmbeddedWeights:
    """Draw every parameter of ``config`` from generators seeded by ``(seed, crc32(name))``.

    Args:
        config: the architecture.
        seed: a non-negative integer.
    """
    arrays: dict[str, np.ndarray] = {}
    for name, shape in config.param_shapes().items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        mean, std = _init_scale(name, shape)
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(std)
        if mean:
            a += np.float32(mean)
        arrays[name] = a
    return EmbeddedWeights(config=config, arrays=arrays, seed=seed)


@functools.lru_cache(maxsize=4)
def default_weights(kind: str, seed: int = 0) -> EmbeddedWeights:
    """The default-config weights of ``kind``, generated once per process and shared.

    The arrays are read-only, since every caller shares them (backends copy what they move to
    a device; the numpy backend computes on them in place of a copy).

    Args:
        kind: ``"loadtest"`` or ``"loadtest-compute"``.
        seed: the generator seed.

    Raises:
        PolicyConfigError: unknown kind.
    """
    configs: dict[str, EmbeddedConfig] = {LoadtestConfig.kind: LoadtestConfig(), ComputeConfig.kind: ComputeConfig()}
    if kind not in configs:
        raise PolicyConfigError(f"no embedded weights of kind {kind!r}; choose one of {sorted(configs)}")
    weights = generate_weights(configs[kind], seed)
    for a in weights.arrays.values():
        a.flags.writeable = False
    return weights


def save_weights(path: str | os.PathLike[str], weights: EmbeddedWeights) -> None:
    """Write ``weights`` to an uncompressed ``.npz`` with its JSON header.

    Args:
        path: the file to write (numpy appends ``.npz`` if missing).
        weights: what to save.
    """
    header = {"format": FORMAT, "version": FORMAT_VERSION, "config": config_to_dict(weights.config),
              "seed": weights.seed}
    blob = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    arrays: dict[str, np.ndarray] = {HEADER_KEY: blob, **{k: np.asarray(v, np.float32) for k, v in weights.arrays.items()}}
    np.savez(path, allow_pickle=False, **arrays)


def _entry(npz: Any, key: str) -> np.ndarray:
    value = npz[key]  # raises ValueError for an object (pickled) array
    if not isinstance(value, np.ndarray):  # a zip member that is not .npy comes back as bytes
        raise WeightsFormatError(f"entry {key!r} is not an array")
    return value


def _read_header(npz: Any) -> dict[str, Any]:
    if HEADER_KEY not in npz.files:
        raise WeightsFormatError(f"not a chunkline weights file: no {HEADER_KEY!r} entry")
    blob = _entry(npz, HEADER_KEY)
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size > _MAX_HEADER_BYTES:
        raise WeightsFormatError("malformed header entry")
    try:
        header = json.loads(blob.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsFormatError(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise WeightsFormatError(f"header format must be {FORMAT!r}")
    if header.get("version") != FORMAT_VERSION:
        raise WeightsFormatError(f"unsupported format version {header.get('version')!r}")
    return header


def _read_entries(npz: Any) -> tuple[EmbeddedConfig, dict[str, np.ndarray], int | None]:
    header = _read_header(npz)
    try:
        config = config_from_dict(header.get("config"))
    except PolicyConfigError as exc:
        raise WeightsFormatError(str(exc)) from None
    seed = header.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise WeightsFormatError("header seed must be an integer or null")
    shapes = config.param_shapes()
    extra = sorted(set(npz.files) - set(shapes) - {HEADER_KEY})
    if extra:
        raise WeightsFormatError(f"unexpected entries: {extra[:5]}")
    arrays: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name not in npz.files:
            raise WeightsFormatError(f"missing parameter {name!r}")
        a = _entry(npz, name)
        if a.dtype != np.float32 or a.shape != shape:
            raise WeightsFormatError(f"parameter {name!r} is {a.dtype.name}{list(a.shape)}, expected float32{list(shape)}")
        arrays[name] = a
    return config, arrays, seed


def load_weights(path: str | os.PathLike[str]) -> EmbeddedWeights:
    """Read weights written by :func:`save_weights`, checking every name, shape and dtype.

    Args:
        path: the ``.npz`` file.

    Raises:
        WeightsFormatError: unreadable file, missing or malformed header, an object array
            (refused, never unpickled), missing, extra or misshapen parameters.
    """
    where = os.fspath(path)
    try:
        # We own the file handle: numpy leaks its own when the zip turns out to be corrupt.
        fh = open(path, "rb")
    except OSError as exc:
        raise WeightsFormatError(f"cannot open {where!r}: {exc}") from None
    with fh:
        try:
            npz = np.load(fh, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise WeightsFormatError(f"cannot read {where!r} as .npz: {exc}") from None
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise WeightsFormatError(f"{where!r} is a single array, not an .npz archive")
        with npz:
            try:
                config, arrays, seed = _read_entries(npz)
            except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                if isinstance(exc, WeightsFormatError):
                    raise
                raise WeightsFormatError(f"corrupt entry in {where!r}: {exc}") from None
    return EmbeddedWeights(config=config, arrays=arrays, seed=seed)
