"""``python -m streamckpt.cli ...``: the command line, as ``python -m streamckpt``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
