"""``python -m fp4sense`` (and ``torchrun ... -m fp4sense``): the same as ``fp4sense``."""

import sys

from fp4sense.cli import main

if __name__ == "__main__":
    sys.exit(main())
