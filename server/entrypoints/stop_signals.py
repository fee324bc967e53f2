"""SIGTERM and SIGINT from a ``chunkline`` command's first line: what they mean while the command
starts (:class:`StopSignals`). Imports nothing but the standard library's signal, threading and os,
so the console entry point (:mod:`.launch`) installs it before anything heavy is imported."""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["StopSignals", "command_word"]


class StopSignals:
    """SIGTERM and SIGINT from the first line on, noted rather than acted on until the command
    says what they mean. The handler raises nothing into the code it interrupts (an exception
    thrown into an import, a lock or a weakref callback is lost or leaves state half-built).

    ``serve`` (``exit_at_once``): until its settings are read and the server is about to be built,
    nothing has started, so a signal ends the process at once with status 0; after that a signal
    is only noted (``received``) and the server's life cycle drains on it at its first step.
    Every other command gets the default meaning back once its flags are parsed (:meth:`restore`
    raises a signal noted meanwhile again)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, exit_at_once: bool = False) -> None:
        self.received = threading.Event()
        self.exit_at_once = exit_at_once
        self._first: int | None = None
        self._previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS}

    def _note(self, sig: int, frame: object) -> None:
        if self.exit_at_once:
            os._exit(0)  # nothing has started: no file, socket or thread to finish
        if self._first is None:
            self._first = sig
        self.received.set()

    def restore(self, deliver: bool = True) -> None:
        """The previous handlers back; ``deliver``: raise a signal noted meanwhile again."""
        self.exit_at_once = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if deliver and self._first is not None:
            signal.raise_signal(self._first)


def command_word(words: list[str]) -> str | None:
    """The subcommand on a ``chunkline`` command line (its first word that is not a flag)."""
    return next((w for w in words if not w.startswith("-")), None)
