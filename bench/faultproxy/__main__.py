"""``python -m chunkline.bench.faultproxy``: the proxy process (started by :class:`FaultProxy`)."""

from __future__ import annotations

import sys

from .relay import main

if __name__ == "__main__":
    sys.exit(main())
