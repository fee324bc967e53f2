"""Fixed locations for tests in any folder: the tests root (helpers, ``module:factory`` policies for
server subprocesses) and the repository root (docs, pyproject)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
