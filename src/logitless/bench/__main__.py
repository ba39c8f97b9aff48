"""``python -m logitless.bench`` and the ``logitless`` console script (see cli.py)."""

import sys

from logitless.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
