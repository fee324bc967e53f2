"""The ``chunkline`` console entry point: SIGTERM and SIGINT are caught before anything else is
imported (:class:`.StopSignals`), so a signal during the imports (seconds on a busy machine) is never
met by the default action. The only moment it still is: the interpreter's own start-up, before
this module's first line.
"""

from __future__ import annotations

import sys

from chunkline.server.entrypoints.stop_signals import StopSignals, command_word

__all__ = ["main"]


def main() -> int:
    """``chunkline ...``: the signals first, then the command line (:func:`chunkline.server.entrypoints.cli.main`)."""
    stop_signals = StopSignals(exit_at_once=command_word(sys.argv[1:]) == "serve")
    from chunkline.server.entrypoints.cli import main as run_command

    return run_command(stop_signals=stop_signals)


if __name__ == "__main__":
    sys.exit(main())
