#!/usr/bin/env bash
# The prepared GPU check (issues 12, 26): one call on a lent nvidia-h200, under 8 minutes, full log kept.
#
# Here, first (the device has no registry):   make gpu-wheels        # .whl/, ~27 MiB, git-ignored
# Then the device tool's `run`, pasted as is:
#   command:   bash benchmarks/gpu_check.sh
#   carry:     [".whl"]
#   timeout_s: 540
# What comes back: $OUT/gpu_check.log (everything, tracebacks included), $OUT/gpu_summary.txt (one
# PASS/FAIL line per check, with its figure), $OUT/gpu.txt (the benchmark's report, for
# `benchmarks.run --gpu-results`), $OUT/pytest_gpu.xml.
#
# Parts, each run even when an earlier one failed; the exit status is 1 if any check failed:
# 0. install .whl/*.whl with `pip install --no-index --no-deps --target /tmp/site` (the image lacks
#    zstandard, crc32c, obstore, s3fs/botocore), PYTHONPATH=repo:/tmp/site, `import streamckpt`;
# 1. the GPU tests (tests/test_gpu.py, -m gpu), local files only: no S3 server, no moto;
# 2. python -m benchmarks.gpu: H2D pipeline ÷ pinned memcpy, D2H save staging ÷ its ceiling,
#    sc.load into CUDA vs CPU targets, async_save of CUDA tensors beside a GPU training loop.
# Work files go to /tmp (the device's 64 GiB disk), not /dev/shm, after a free-space check.
#
#   bash benchmarks/gpu_check.sh --install-only   # part 0 alone (tests/test_gpu_install.py runs this)
# Environment: PYTHON (python3), WHEELS (.whl), SITE (/tmp/site), WORK (/tmp/sc-gpucheck), OUT (./gpu-check-out),
# DEADLINE_S (470), TESTS_S (200), NEED_GIB (24).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$REPO/.whl}"
SITE="${SITE:-/tmp/site}"
WORK="${WORK:-/tmp/sc-gpucheck}"
OUTDIR="${OUT:-$REPO/gpu-check-out}"
NEED_GIB="${NEED_GIB:-24}"  # what part 2 writes at most (checkpoints and saves), with room to spare
DEADLINE_S="${DEADLINE_S:-470}"  # the whole script, under 8 minutes: the benchmark gets what is left
TESTS_S="${TESTS_S:-200}"  # the GPU tests at most (7 tests, one of them 2 gloo ranks)
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
SUMMARY="$OUTDIR/gpu_summary.txt"
: > "$LOG"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

SECONDS=0

check() {  # check PASS|FAIL NAME FIGURE...: one summary line
  local verdict=$1 name=$2; shift 2
  echo "$verdict $name: $*" >> "$SUMMARY"
  echo ">>> $verdict $name: $*"
}

part_install() {
  echo "## 0. install the carried wheels"
  local wheels=("$WHEELS"/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    check FAIL install "no wheels in $WHEELS (run 'make gpu-wheels' here and carry .whl)"
    return 1
  fi
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${wheels[@]}"; then
    check PASS install "${#wheels[@]} wheels into $SITE"
  else
    check FAIL install "pip install --target $SITE exited non-zero (see the log)"
    return 1
  fi
}

part_import() {
  local line
  if line=$("$PY" -c 'import sys, streamckpt, zstandard, crc32c, obstore, s3fs, torch, numpy
print(f"streamckpt {streamckpt.__version__} from {streamckpt.__file__}; zstandard, crc32c, obstore, s3fs import; "
      f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")'); then
    check PASS import "$line"
  else
    check FAIL import "import streamckpt or a carried wheel failed (traceback above)"
    return 1
  fi
}

part_env() {
  echo "## environment"
  date -u +%Y-%m-%dT%H:%M:%SZ
  git -C "$REPO" log -1 --format='commit %h %s' 2>/dev/null || echo "no git"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv,noheader 2>&1 || true
  nproc; free -g 2>&1 | head -2; df -h /tmp 2>&1
  local line
  if line=$("$PY" -c 'import torch; assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {n} x {name}")'); then
    check PASS cuda "$line"
  else
    check FAIL cuda "torch sees no CUDA device: the GPU parts cannot run"
    return 1
  fi
}

part_space() {
  mkdir -p "$WORK"
  local avail_kib
  avail_kib=$(df -Pk "$WORK" | awk 'NR==2 {print $4}')
  if [ "${avail_kib:-0}" -ge $((NEED_GIB * 1024 * 1024)) ]; then
    check PASS space "$((avail_kib / 1024 / 1024)) GiB free in $WORK (need $NEED_GIB)"
  else
    check FAIL space "$((${avail_kib:-0} / 1024 / 1024)) GiB free in $WORK, need $NEED_GIB: the benchmark is skipped"
    return 1
  fi
}

part_tests() {
  # The other test marked gpu, test_multirank.py::test_cuda_targets_multirank, needs the moto S3 fixture
  # (moto is not on the image); test_gpu.py's two-gloo-rank case covers it on local files.
  echo "## 1. GPU tests: pytest -m gpu tests/test_gpu.py (local files; no S3 server)"
  local rc
  timeout -k 15 "$TESTS_S" "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --timeout 150 \
    --junitxml="$OUTDIR/pytest_gpu.xml" tests/test_gpu.py
  rc=$?
  local tally
  tally=$(grep -oE '(tests|failures|errors|skipped)="[0-9]+"' "$OUTDIR/pytest_gpu.xml" 2>/dev/null | head -4 \
          | tr -d '"' | tr '\n' ' ')
  if [ $rc -eq 0 ]; then check PASS gpu-tests "pytest exit 0; $tally"
  else check FAIL gpu-tests "pytest exit $rc (124: timed out); $tally"; return 1; fi
}

part_bench() {
  echo "## 2. GPU benchmark: python -m benchmarks.gpu"
  local rc left=$((DEADLINE_S - SECONDS))
  [ $left -ge 90 ] || left=90
  echo "(${left} s left of the script's ${DEADLINE_S} s)"
  timeout -k 15 "$left" "$PY" -m benchmarks.gpu --work "$WORK" --summary "$SUMMARY" --out "$OUTDIR/gpu.txt" \
    --budget-s $((left - 20))
  rc=$?
  if [ $rc -ne 0 ]; then check FAIL benchmark "benchmarks.gpu exit $rc (124: timed out; see the log)"; return 1; fi
}

main() {
  local status=0
  echo "# streamckpt GPU check: python=$PY wheels=$WHEELS site=$SITE work=$WORK out=$OUTDIR"
  part_install || status=1
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  part_import || status=1
  if [ "${1:-}" = "--install-only" ]; then return $status; fi
  if part_env; then
    part_tests || status=1
    if part_space; then part_bench || status=1; else status=1; fi
  else
    status=1
  fi
  rm -rf "$WORK"
  return $status
}

main "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
grep -q '^FAIL' "$SUMMARY" && status=1
{ echo "## summary (exit status $status)"; cat "$SUMMARY"; } | tee -a "$LOG"
exit $status
