"""The old name of the GPU benchmark: ``python -m benchmarks.gpu_check`` runs ``benchmarks.gpu``
(issue 26 folded the two into one; ``benchmarks/gpu_check.sh`` calls ``benchmarks.gpu``)."""

from __future__ import annotations

import sys

from .gpu import main

if __name__ == "__main__":
    sys.exit(main())
