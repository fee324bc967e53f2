"""Fixed locations for tests in any folder: the tests root (helpers, ``module:factory`` policies for
server subprocesses) and the repository root (docs, pyproject)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def env_with_tests_on_path() -> dict[str, str]:
    """The ``PYTHONPATH`` for a server subprocess that loads a ``module:factory`` from the tests root:
    the current one (the code under test) followed by the tests root."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p)}
