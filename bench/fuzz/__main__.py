"""``python -m chunkline.bench.fuzz``: the fuzz command, or (``_atheris``) the libFuzzer child process it starts."""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import main
from .harness import run_atheris

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_atheris":  # the libFuzzer child process
        rest = sys.argv[2:]
        run_atheris([Path(a) for a in rest if not a.startswith("-")], [a for a in rest if a.startswith("-")])
    sys.exit(main())
