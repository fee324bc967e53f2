"""``python -m chunkline.server.text``: see :mod:`chunkline.server.text.cli`."""

import sys

from .cli import main

__all__: list[str] = []

sys.exit(main())
