"""``python -m streamckpt ...``: the ``streamckpt`` command line where the console script is
not installed (a source checkout on PYTHONPATH, a venv without ``pip install``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
