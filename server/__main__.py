import sys

from chunkline.server.entrypoints.cli import main

sys.exit(main())
