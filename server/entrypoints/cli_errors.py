"""The one error type a ``chunkline`` command raises for an expected failure, and how ``main`` reports it.

An expected failure (a missing file, a typo in a setting, a busy port, a server that is not
running) is the user's to fix, not a bug: ``main`` prints it as one line on stderr, saying what is
wrong and what to do, and exits with :data:`USAGE_EXIT`. ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable
from typing import Any

__all__ = ["UsageError", "USAGE_EXIT", "one_line_validation_error", "port_in_use_error"]

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


def one_line_validation_error(exc: Any, known: Iterable[str] = ()) -> str:
    """A pydantic ``ValidationError`` as one line: the first problem's location and message,
    a close match for an unknown key, and how many more problems there are.

    Args:
        exc: the ``pydantic.ValidationError``.
        known: the valid top-level keys (for "did you mean").
    """
    errs = exc.errors(include_url=False, include_input=False)
    first = errs[0]
    where = ".".join(str(x) for x in first["loc"]) or "the file"
    if first["type"] == "extra_forbidden":
        guess = difflib.get_close_matches(str(first["loc"][-1]), list(known), n=1)
        text = f"unknown setting {where!r}" + (f" (did you mean {guess[0]!r}?)" if guess else "")
    else:
        text = f"{where}: {first['msg']}"
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
