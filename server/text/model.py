"""The embedded text model: a small decoder-only transformer in torch with a slot-based KV cache.

A load-test model, as vLLM's ``--load-format dummy`` is: the architecture of a real decoder
(pre-norm blocks, causal multi-head attention, GELU MLP, learned positions) with deterministic
weights drawn from a seeded generator, so that every replica computes the same tokens and a
fingerprint names them. Outputs are not meaningful text; costs and behaviour under load are.

The KV cache holds ``max_slots`` sequences of up to ``context`` tokens. :meth:`TinyLM.prefill`
runs one sequence's prompt and fills its slot; :meth:`TinyLM.decode` advances any set of slots
by one token in one forward pass (that is what lets sequences join and leave the running batch
between steps). This module imports torch at import time: import it lazily (the engine does).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from chunkline.policies.base import weights_digest

from .tokenizer import VOCAB_SIZE

__all__ = ["TinyLMConfig", "dummy_weights", "TinyLM"]


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    """Architecture of the embedded model.

    Args:
        vocab_size: embedding rows (bytes + special tokens).
        d_model: width.
        n_layers: transformer blocks.
        n_heads: attention heads (``d_model`` must divide evenly).
        d_ff: MLP hidden width.
        context: longest sequence (prompt + output) in tokens.
        seed: seed of the dummy weights.
        logit_scale: scale of the output projection; larger gives peakier next-token distributions.
    """

    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    context: int = 512
    seed: int = 0
    logit_scale: float = 4.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        if min(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.d_ff, self.context) < 1:
            raise ValueError("every size must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def dummy_weights(cfg: TinyLMConfig) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``cfg`` (same seed, same arrays, on every machine).

    Args:
        cfg: the architecture (its ``seed`` picks the weights).
    """
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    d, f, v, c = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.context
    depth = 1.0 / math.sqrt(2.0 * cfg.n_layers)  # residual branches scaled as in GPT-2

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "tok_emb": normal((v, d), 1.0),
        "pos_emb": normal((c, d), 0.1),
        "ln_f.g": np.ones(d, np.float32),
        "ln_f.b": np.zeros(d, np.float32),
        "unembed": normal((v, d), cfg.logit_scale / math.sqrt(d)),
        "unembed.b": np.zeros(v, np.float32),
    }
    # Favour printable ASCII and newlines, so that the dummy output reads as (random) text
    # rather than mostly invalid UTF-8.
    w["unembed.b"][32:127] = 2.5
    w["unembed.b"][10] = 2.5
    for i in range(cfg.n_layers):
        p = f"layer{i}."
        w[p + "ln1.g"] = np.ones(d, np.float32)
        w[p + "ln1.b"] = np.zeros(d, np.float32)
        w[p + "qkv.w"] = normal((3 * d, d), 1.0 / math.sqrt(d))
        w[p + "qkv.b"] = np.zeros(3 * d, np.float32)
        w[p + "out.w"] = normal((d, d), depth / math.sqrt(d))
        w[p + "out.b"] = np.zeros(d, np.float32)
        w[p + "ln2.g"] = np.ones(d, np.float32)
        w[p + "ln2.b"] = np.zeros(d, np.float32)
        w[p + "fc1.w"] = normal((f, d), 1.0 / math.sqrt(d))
        w[p + "fc1.b"] = np.zeros(f, np.float32)
        w[p + "fc2.w"] = normal((d, f), depth / math.sqrt(f))
        w[p + "fc2.b"] = np.zeros(d, np.float32)
    return w


class TinyLM:
    """The model and its KV cache (one thread uses it at a time: the engine's).

    Batch invariance: with ``fixed_shape`` (the default) every decode step runs the matrix
    products on all ``max_slots`` rows, whichever sequences are active, and attention over each
    row's own span rounded up to a multiple of :attr:`ATTN_BLOCK`. CPU kernels pick their blocking and reduction order from
    the tensor shapes (a ``[1, d]`` and a ``[16, d]`` matrix product round differently, and so
    does attention over a longer padded span), so only shapes that never depend on the other
    sequences make a sequence's logits bit-for-bit the same alone or in any batch, and with them
    its seeded samples. It costs a full batch's matrix products at low occupancy; ``False``
    trades that for shapes that follow the active rows (tokens then agree with high
    probability, not always).

    Args:
        cfg: the architecture.
        max_slots: sequences the KV cache holds at once (the engine's ``max_batch``).
        weights: the parameters (default :func:`dummy_weights`).
        device: torch device.
        fixed_shape: see above.
    """

    def __init__(
        self,
        cfg: TinyLMConfig,
        max_slots: int,
        weights: dict[str, np.ndarray] | None = None,
        device: str = "cpu",
        fixed_shape: bool = True,
    ) -> None:
        if max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        self.cfg = cfg
        self.max_slots = max_slots
        self.device = torch.device(device)
        arrays = weights if weights is not None else dummy_weights(cfg)
        self.weights_digest = weights_digest(arrays)
        self._w = {k: torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for k, a in arrays.items()}
        shape = (cfg.n_layers, max_slots, cfg.n_heads, cfg.context, cfg.head_dim)
        self._k = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self._v = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.fixed_shape = fixed_shape
        self._arange = torch.arange(cfg.context, device=self.device)

    #: Attention spans are rounded up to a multiple of this (see :meth:`decode`): a few calls
    #: per layer over only the cache in use, instead of one call per row (dispatch-bound) or one
    #: over the whole context (memory-bound).
    ATTN_BLOCK = 64

    @property
    def context(self) -> int:
        """Longest sequence in tokens."""
        return self.cfg.context

    # ------------------------------------------------------------------ blocks

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (self.cfg.d_model,), self._w[name + ".g"], self._w[name + ".b"], 1e-5)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, D] -> [B, H, T, hd]
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 2)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        h = F.gelu(F.linear(self._ln(x, p + "ln2"), self._w[p + "fc1.w"], self._w[p + "fc1.b"]), approximate="tanh")
        return F.linear(h, self._w[p + "fc2.w"], self._w[p + "fc2.b"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._ln(x, "ln_f"), self._w["unembed"], self._w["unembed.b"])

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """Run a prompt, store its keys and values in ``slot``, return the last position's logits.

        Args:
            slot: a free cache slot (its previous contents are overwritten).
            tokens: the prompt, ``1 <= len <= context``.

        Returns:
            ``[vocab]`` float32 logits for the next token.
        """
        t = len(tokens)
        if not 1 <= t <= self.cfg.context:
            raise ValueError(f"prompt of {t} tokens does not fit a context of {self.cfg.context}")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        x = self._w["tok_emb"][ids] + self._w["pos_emb"][:t]
        for i in range(self.cfg.n_layers):
            p = f"layer{i}."
            q, k, v = F.linear(self._ln(x, p + "ln1"), self._w[p + "qkv.w"], self._w[p + "qkv.b"]).split(self.cfg.d_model, dim=-1)
            q, k, v = self._split(q), self._split(k), self._split(v)
            self._k[i, slot, :, :t] = k[0]
            self._v[i, slot, :, :t] = v[0]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).reshape(1, t, self.cfg.d_model)
            x = x + F.linear(a, self._w[p + "out.w"], self._w[p + "out.b"])
            x = x + self._mlp(x, p)
        return self._logits(x[:, -1]).numpy()[0]

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Advance several sequences by one token each, in one forward pass.

        Args:
            slots: their cache slots (distinct).
            tokens: each one's latest token.
            positions: where each token sits (= tokens already in its cache), ``< context``.

        Returns:
            ``[len(slots), vocab]`` float32 logits.
        """
        n = len(slots)
        if not (n == len(tokens) == len(positions)) or n == 0:
            raise ValueError("slots, tokens and positions must be non-empty and of equal length")
        if max(positions) >= self.cfg.context or min(positions) < 0:
            raise ValueError("a position is outside the context")
        ctx, dev = self.cfg.context, self.device
        if self.fixed_shape:
            # Every slot gets a row. Idle rows write to the last cache position of their slot
            # (which a live sequence there only reads after writing it itself) and attend to their
            # first position only (finite garbage, never NaN).
            m = self.max_slots
            toks = [0] * m
            write = [ctx - 1] * m
            attend = [0] * m
            groups: dict[int, list[int]] = {}
            for s_, t_, p_ in zip(slots, tokens, positions):
                toks[s_], write[s_], attend[s_] = int(t_), int(p_), int(p_)
                # Spans are rounded up per row to a multiple of ATTN_BLOCK; rows sharing a rounded
                # span are computed in one call, whose shape ([max_slots, heads, 1, span]) does not
                # depend on who else is in it: a row's result depends on its own span only.
                groups.setdefault(min(ctx, -(-(int(p_) + 1) // self.ATTN_BLOCK) * self.ATTN_BLOCK), []).append(int(s_))
            rows_t = torch.arange(m, device=dev)
            write_t = torch.tensor(write, dtype=torch.long, device=dev)
            attend_t = torch.tensor(attend, dtype=torch.long, device=dev)
            spans, masks, keeps = [], [], []
            for span, members in sorted(groups.items()):
                keep = torch.zeros(m, dtype=torch.bool, device=dev)
                keep[members] = True
                spans.append(span)
                masks.append((self._arange[None, :span] <= attend_t[:, None])[:, None, None, :])
                keeps.append(keep[:, None, None, None])
            gather = False
        else:
            toks = [int(t) for t in tokens]
            rows_t = torch.tensor(list(slots), dtype=torch.long, device=dev)
            write_t = attend_t = torch.tensor(list(positions), dtype=torch.long, device=dev)
            span = int(max(positions)) + 1
            spans = [span]
            masks = [(self._arange[None, :span] <= attend_t[:, None])[:, None, None, :]]
            keeps = [torch.ones((n, 1, 1, 1), dtype=torch.bool, device=dev)]
            gather = True
        logits = _decode_graph(torch.tensor(toks, dtype=torch.long, device=dev), write_t, rows_t, self._w, self._k, self._v,
                               spans, masks, keeps, gather, self.cfg.n_layers, self.cfg.n_heads, self.cfg.d_model).numpy()
        return logits[list(slots)] if self.fixed_shape else logits


def _decode_step(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    w: dict[str, torch.Tensor],
    kc: torch.Tensor,
    vc: torch.Tensor,
    spans: list[int],
    masks: list[torch.Tensor],
    keeps: list[torch.Tensor],
    gather: bool,
    n_layers: int,
    n_heads: int,
    d: int,
) -> torch.Tensor:
    # One decode step as a TorchScript graph: its ~100 operations run without returning to the
    # Python interpreter between them, so the engine thread does not fight the event loop's
    # thread for the GIL at every operation (eager mode stalls badly when the loop is busy).
    m = tokens.shape[0]
    hd = d // n_heads
    x = (w["tok_emb"][tokens] + w["pos_emb"][positions])[:, None, :]
    for i in range(n_layers):
        p = "layer" + str(i) + "."
        h = F.layer_norm(x, [d], w[p + "ln1.g"], w[p + "ln1.b"], 1e-5)
        qkv = F.linear(h, w[p + "qkv.w"], w[p + "qkv.b"])
        q = qkv[:, :, :d].reshape(m, 1, n_heads, hd).transpose(1, 2)
        k = qkv[:, :, d : 2 * d].reshape(m, 1, n_heads, hd).transpose(1, 2)
        v = qkv[:, :, 2 * d :].reshape(m, 1, n_heads, hd).transpose(1, 2)
        kc[i, rows, :, positions] = k[:, :, 0]
        vc[i, rows, :, positions] = v[:, :, 0]
        a = q
        for j in range(len(spans)):
            if gather:
                keys = kc[i, rows, :, : spans[j]]
                values = vc[i, rows, :, : spans[j]]
            else:
                keys = kc[i, :, :, : spans[j]]
                values = vc[i, :, :, : spans[j]]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[j])
            a = out if j == 0 else torch.where(keeps[j], out, a)
        a = a.transpose(1, 2).reshape(m, 1, d)
        x = x + F.linear(a, w[p + "out.w"], w[p + "out.b"])
        h = F.layer_norm(x, [d], w[p + "ln2.g"], w[p + "ln2.b"], 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, w[p + "fc1.w"], w[p + "fc1.b"]), approximate="tanh"), w[p + "fc2.w"], w[p + "fc2.b"])
    x = F.layer_norm(x[:, 0], [d], w["ln_f.g"], w["ln_f.b"], 1e-5)
    return F.linear(x, w["unembed"], w["unembed.b"])


with warnings.catch_warnings():
    # torch.jit.script is deprecated in favour of torch.compile, which needs a C++ toolchain and
    # tens of seconds of compilation per shape: too heavy for a load-test model that must start in
    # a second. TorchScript still runs here, and it is what keeps the step off the GIL.
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=DeprecationWarning)
    _decode_graph = torch.jit.script(_decode_step)
