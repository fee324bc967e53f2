"""Which processor steps a LeRobot checkpoint may name: only LeRobot's registered ones.

LeRobot's pipeline file lists each step either by ``registry_name`` (a class registered with
``ProcessorStepRegistry``) or by ``class`` (a dotted path LeRobot imports and calls with the
file's ``config``). A checkpoint comes from a hub, so a dotted path would let it run anything as
the server's user. :func:`check_processor_files` reads the files as JSON before LeRobot does and
refuses any step without a registered name, and any ``state_file`` that leaves the checkpoint.
Reading needs no LeRobot; the registered names are given by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path, PurePosixPath
from typing import Any

from .exceptions import PolicyLoadError, UnregisteredProcessorStep

__all__ = ["PROCESSOR_FILES", "check_processor_files", "registered_step_names"]

#: the processor files ``make_pre_post_processors`` reads from a checkpoint directory.
PROCESSOR_FILES = ("policy_preprocessor.json", "policy_postprocessor.json")


def registered_step_names() -> frozenset[str]:
    """LeRobot's registered processor steps (its public ``ProcessorStepRegistry.list()``)."""
    from lerobot.processor import ProcessorStepRegistry

    return frozenset(ProcessorStepRegistry.list())


def _step_label(entry: Any) -> str:
    if isinstance(entry, dict):
        for key in ("registry_name", "class"):
            if isinstance(entry.get(key), str):
                return str(entry[key])
    return repr(entry)[:80]


def _check_step(file: str, index: int, entry: Any, registered: Collection[str] | None) -> None:
    label = _step_label(entry)
    if not isinstance(entry, dict) or not isinstance(entry.get("registry_name"), str):
        raise UnregisteredProcessorStep(file, index, label, "a step must name one of LeRobot's registered processor "
                                        "steps (registry_name); class paths are never imported")
    if registered is not None and entry["registry_name"] not in registered:
        raise UnregisteredProcessorStep(file, index, label, "not one of LeRobot's registered processor steps")
    state = entry.get("state_file")
    if state is not None:
        parts = PurePosixPath(state).parts if isinstance(state, str) else ()
        if len(parts) != 1 or parts[0] in (".", "..") or "\\" in parts[0]:
            raise UnregisteredProcessorStep(file, index, label, f"state_file {state!r} is not a file name inside the checkpoint")


def check_processor_files(ckpt: Path, registered: Collection[str] | None = None) -> None:
    """Check every step of the checkpoint's processor files (those present).

    Args:
        ckpt: the checkpoint directory.
        registered: LeRobot's registered step names; ``None`` checks only that each step names one.

    Raises:
        UnregisteredProcessorStep: a step that is not a registered name, or a state file elsewhere.
        PolicyLoadError: a processor file that is not the JSON LeRobot writes.
    """
    for name in PROCESSOR_FILES:
        path = ckpt / name
        if not path.is_file():
            continue
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PolicyLoadError(f"{name}: not readable JSON: {type(exc).__name__}: {exc}") from exc
        steps = document.get("steps") if isinstance(document, dict) else None
        if not isinstance(steps, list):
            raise PolicyLoadError(f"{name}: no list of steps")
        for index, entry in enumerate(steps):
            _check_step(name, index, entry, registered)
