#!/usr/bin/env bash
# The prepared GPU check (issue 12), unattended, under 8 minutes on one GPU:
#
#   bash benchmarks/gpu_check.sh          # report: ${OUT:-.}/gpu_check.txt
#
# 1. the GPU tests (tests/test_gpu.py, -m gpu): single-GPU loads behind pending init kernels,
#    2 gloo ranks with CUDA targets on the one GPU, CUDA saves, pinned device-to-host blocks;
# 2. tests/test_multirank.py -k cuda (a moto S3 server, 2 gloo ranks; its NCCL case needs 2 GPUs);
# 3. benchmarks/gpu_check.py: pinned memcpy, the DeviceStage pipeline (goal >= 0.8 x memcpy),
#    sc.load / sc.save with CUDA tensors from/to local files.
# Uses the repo's .venv when there is one, else $PYTHON or python3, and installs nothing:
# whatever torch is there runs, and the report says so plainly when it cannot see a GPU.
set -u
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$PWD}"
mkdir -p "$OUTDIR"
REPORT="$OUTDIR/gpu_check.txt"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
say() { echo "$*" | tee -a "$REPORT"; }
: > "$REPORT"
say "# streamckpt GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$REPORT"
else
  say "nvidia-smi: not on PATH"
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
  say "torch is not importable by $PY: NOTHING RAN (make venv, or set PYTHON to a Python with torch)."
  exit 2
fi
"$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, cuda available={torch.cuda.is_available()}, GPUs={torch.cuda.device_count()}")' 2>&1 | tee -a "$REPORT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  say "CUDA IS NOT AVAILABLE to this Python's torch: NOTHING GPU-SIDE RAN (a CPU-only torch wheel, or no driver)."
  exit 2
fi
status=0
say "## 1. pytest -m gpu tests/test_gpu.py"
timeout 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -40 | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
say "## 2. pytest -m gpu tests/test_multirank.py -k cuda"
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_multirank.py -k cuda 2>&1 | tail -40 | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
say "## 3. python -m benchmarks.gpu_check"
timeout 150 "$PY" -m benchmarks.gpu_check --gib 2 2>&1 | sed -n '/--- report ---/,$p' | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
say "# exit status $status (0: every part passed)"
exit $status
