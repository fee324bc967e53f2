"""The one error type a ``chunkline`` command raises for an expected failure, and how ``main`` reports it.

An expected failure (a missing file, a typo in a setting, a busy port, a server that is not
running) is the user's to fix, not a bug: ``main`` prints it as one line on stderr, saying what is
wrong and what to do, and exits with :data:`USAGE_EXIT`. ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import difflib
import errno
import typing
from collections.abc import Iterable
from typing import Any

__all__ = ["UsageError", "USAGE_EXIT", "error_line", "one_line_validation_error", "port_in_use_error"]

#: the exit status of every expected failure (argparse uses 2 for bad flags too).
USAGE_EXIT = 2


class UsageError(Exception):
    """An expected failure of a command, reported as one line.

    Args:
        problem: what is wrong (one line, no traceback).
        fix: what to do about it, appended after a semicolon.
    """

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = " ".join(problem.split())  # one line, whatever the cause's message held
        self.fix = fix
        super().__init__(self.problem if fix is None else f"{self.problem}; {fix}")


#: how long an :func:`error_line` may be
ERROR_LINE_CHARS = 300


def error_line(error: BaseException | str) -> str:
    """An error as one line for a status table or an event: a message that carries a traceback
    (Ray's task and actor errors do, after a header naming the task) is told by its last line, the
    exception that ended it; any other message by its first line; at most :data:`ERROR_LINE_CHARS`."""
    if isinstance(error, BaseException):
        text = str(error).strip()
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    else:
        text = error.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    traceback = any(line.startswith(("Traceback (most recent call last)", 'File "')) for line in lines)
    line = lines[-1] if traceback else lines[0]
    if isinstance(error, BaseException) and traceback and not line.startswith(type(error).__name__):
        line = f"{type(error).__name__}: {line}"
    return line if len(line) <= ERROR_LINE_CHARS else line[:ERROR_LINE_CHARS - 3] + "..."


def _fields_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (pydantic) model that ``loc`` ends in: ``policies.0.max_batch`` ends in
    a policy's settings. Empty when the path leaves the models (a free-form table)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        nested = [t for t in _model_types(field.annotation)]
        if not nested:
            return []
        model = nested[0]
    return list(getattr(model, "model_fields", {}))


def _model_types(annotation: Any) -> Iterable[Any]:
    if hasattr(annotation, "model_fields"):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _model_types(arg)


def one_line_validation_error(exc: Any, known: Iterable[str] = (), model: Any = None) -> str:
    """A pydantic ``ValidationError`` as one line: the first problem's location and message,
    a close match for an unknown key (at any depth when ``model`` is given), and how many more
    problems there are.

    Args:
        exc: the ``pydantic.ValidationError``.
        known: the valid top-level keys (for "did you mean").
        model: the model validated: the keys of nested tables come from its fields.
    """
    errs = exc.errors(include_url=False, include_input=False)
    first = errs[0]
    where = ".".join(str(x) for x in first["loc"]) or "the file"
    if first["type"] == "extra_forbidden":
        loc = tuple(first["loc"])
        candidates = _fields_at(model, loc[:-1]) if model is not None else list(known) if len(loc) == 1 else []
        guess = difflib.get_close_matches(str(loc[-1]), candidates, n=1)
        text = f"unknown setting {where!r}" + (f" (did you mean {guess[0]!r}?)" if guess else "")
    else:
        # a validator's own sentence, without pydantic's prefix; a whole-document one needs no place
        msg = str(first["msg"]).removeprefix("Value error, ")
        text = f"{where}: {msg}" if first["loc"] else msg
    return text + (f" (+{len(errs) - 1} more)" if len(errs) > 1 else "")


def port_in_use_error(exc: OSError, where: str, flag: str) -> UsageError | None:
    """A :class:`UsageError` for a bind that failed because the port is taken, else ``None``.

    Args:
        exc: the bind's error.
        where: which port, in words (``"the WebSocket port 8000"``).
        flag: the flag that sets it.
    """
    if exc.errno != errno.EADDRINUSE and "address already in use" not in str(exc):
        return None
    return UsageError(f"{where} is already in use", f"stop what listens there or pick another with {flag} (0: any free port)")
