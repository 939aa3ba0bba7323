"""``python -m lightning_mgpu.cli ARGS``: the same as the ``lightning-mgpu ARGS`` console script."""

import sys

from lightning_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
