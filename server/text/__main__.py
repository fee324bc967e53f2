"""``python -m chunkline.server.text``: see :mod:`chunkline.server.entrypoints.text_cli`."""

import sys

from chunkline.server.entrypoints.text_cli import main

__all__: list[str] = []

sys.exit(main())
