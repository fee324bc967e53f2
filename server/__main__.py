import sys

from chunkline.server.entrypoints.launch import main

sys.exit(main())
