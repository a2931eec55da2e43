#!/usr/bin/env bash
# The prepared GPU check (issues 12, 26, 36): one call on a lent nvidia-h200, done within 300 s by its
# own deadline, so that a lease (15 minutes in all, 1-2 of them to start the machine) leaves time to fix
# what broke and run it again.
#
# Here, first (the device has no registry):   make gpu-wheels        # .whl/, ~27 MiB, git-ignored
# Then the device tool's `run`, pasted as is:
#   command:   bash benchmarks/gpu_check.sh
#   carry:     [".whl"]
#   timeout_s: 360
# What comes back: $OUT/gpu_check.log (everything, tracebacks included), $OUT/gpu_summary.txt (one
# PASS/FAIL/WARN/SKIP line per check, with its figure; `TIMEOUT <part> after N s` for a part out of time,
# which is not a failure; after a failed set-up step, a last STOP line), $OUT/gpu.txt
# (the benchmark's report, for `benchmarks.run --gpu-results`), $OUT/pytest_gpu.xml.
#
# Set-up steps; the script stops at the first that fails (every later part would fail on it), its
# reason in the summary:
#   install  .whl/*.whl with `pip install --no-index --no-deps --target /tmp/site` (the image lacks
#            zstandard, crc32c, obstore, s3fs/botocore); PYTHONPATH=repo:/tmp/site;
#   import   streamckpt and the carried wheels (the reason: the exception's last line);
#   cuda     torch sees a CUDA device (where a machine without one stops: `--no-install` here is a dry run);
# Then the parts, each run even when an earlier one failed; the exit status is 1 if any check failed:
#   pin      pin and unpin 1 MiB with CudaApi.pin (cudaHostRegister), the kernel and the driver; a
#            refusal is WARN: staging then falls back to torch's pinned allocator (issue 36);
#   tests    pytest -m gpu tests/test_gpu.py tests/test_gpu_save.py tests/test_gpu_nccl.py, local files only
#            (no S3 server, no moto); the NCCL one needs 2 GPUs;
#   bench    python -m benchmarks.gpu, the most informative first: H2D and D2H ceilings and the pipeline
#            (2 GiB), sc.load into / sc.save from CUDA (1 GiB), SKIP nccl-exchange on 1 GPU (on 2-4: relays
#            and message parts, benchmarks/gpu_nccl.py) and a world-1 NCCL load, async_save beside a
#            training loop (0.5 GiB). The plan in time: docs/TESTING.md.
# Every step runs under benchmarks/timelimit.py: a session of its own, its whole process group killed at its
# limit (a grandchild holding the log pipe cannot outlive it). Work files go to /tmp (the device's 64 GiB
# disk), not /dev/shm, after a free-space check.
#
#   bash benchmarks/gpu_check.sh --install-only   # install and import alone (tests/test_gpu_install.py runs this)
#   bash benchmarks/gpu_check.sh --no-install     # this Python as it is: here, a dry run that stops at `cuda`
# Environment: PYTHON (python3), WHEELS (.whl), SITE (/tmp/site), WORK (/tmp/sc-gpucheck), OUT (./gpu-check-out),
# DEADLINE_S (300), TESTS_S (100), NEED_GIB (12).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$REPO/.whl}"
SITE="${SITE:-/tmp/site}"
WORK="${WORK:-/tmp/sc-gpucheck}"
OUTDIR="${OUT:-$REPO/gpu-check-out}"
NEED_GIB="${NEED_GIB:-12}"  # what the benchmark writes at most (checkpoints and saves), with room to spare
DEADLINE_S="${DEADLINE_S:-300}"  # the whole script; the benchmark gets what is left
TESTS_S="${TESTS_S:-100}"  # the GPU tests at most (one of them 2 gloo ranks)
LIMIT=("$PY" "$REPO/benchmarks/timelimit.py")  # LIMIT SECONDS CMD...: standard library only
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
SUMMARY="$OUTDIR/gpu_summary.txt"
: > "$LOG"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

SECONDS=0

check() {  # check PASS|FAIL|WARN|SKIP|TIMEOUT NAME FIGURE...: one summary line
  local verdict=$1 name=$2; shift 2
  echo "$verdict $name: $*" >> "$SUMMARY"
  echo ">>> $verdict $name: $*"
}

stop() {  # stop NAME: the last summary line after a failed set-up step
  check STOP "$1" "the later parts need it, so none was run ($SECONDS s in)"
}

left() {  # left CAP: seconds to give a step, at most CAP, within the deadline (at least 10)
  local n=$((DEADLINE_S - SECONDS))
  [ "$n" -gt "$1" ] && n=$1
  [ "$n" -ge 10 ] || n=10
  echo "$n"
}

reason() {  # reason FILE: the last non-empty line of a captured stderr (the exception), one line
  grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -1 | cut -c1-300
}

part_install() {
  echo "## install the carried wheels"
  local wheels=("$WHEELS"/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    check FAIL install "no wheels in $WHEELS (run 'make gpu-wheels' here and carry .whl)"
    return 1
  fi
  local err="$OUTDIR/.install.err" rc
  "${LIMIT[@]}" "$(left 120)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" 2>"$err"
  rc=$?
  cat "$err" >&2
  if [ $rc -eq 0 ]; then
    check PASS install "${#wheels[@]} wheels into $SITE"
  else
    check FAIL install "pip install --target $SITE exited $rc (124: timed out): $(reason "$err")"
    return 1
  fi
}

part_import() {
  echo "## import"
  local line err="$OUTDIR/.import.err"
  if line=$("${LIMIT[@]}" "$(left 90)" "$PY" -c 'import sys, streamckpt, zstandard, crc32c, obstore, s3fs, torch, numpy
print(f"streamckpt {streamckpt.__version__} from {streamckpt.__file__}; zstandard, crc32c, obstore, s3fs import; "
      f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")' 2>"$err"); then
    cat "$err" >&2
    check PASS import "${line##*$'\n'}"
  else
    cat "$err" >&2
    check FAIL import "$(reason "$err")"
    return 1
  fi
}

part_cuda() {
  echo "## environment"
  date -u +%Y-%m-%dT%H:%M:%SZ
  git -C "$REPO" log -1 --format='commit %h %s' 2>/dev/null || echo "no git"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv,noheader 2>&1 || true
  nproc; free -g 2>&1 | head -2; df -h /tmp 2>&1
  local line err="$OUTDIR/.cuda.err"
  if line=$("${LIMIT[@]}" "$(left 90)" "$PY" -c 'import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {n} x {name}")' 2>"$err"); then
    cat "$err" >&2
    check PASS cuda "${line##*$'\n'}"
  else
    cat "$err" >&2
    check FAIL cuda "$(reason "$err")"
    return 1
  fi
}

part_pin() {
  echo "## pin: CudaApi.pin of 1 MiB (cudaHostRegister) and unpin"
  local line rc limit
  limit=$(left 60)
  line=$("${LIMIT[@]}" "$limit" "$PY" -m benchmarks.gpu --probe-pin)
  rc=$?
  line=${line##*$'\n'}
  if [ $rc -eq 124 ]; then
    check TIMEOUT "pin after $limit s" "benchmarks.gpu --probe-pin ran out of time (see the log)"
    return 0
  fi
  if [ -z "$line" ]; then
    check FAIL pin "benchmarks.gpu --probe-pin exit $rc (see the log)"
    return 1
  fi
  check "${line%% *}" pin "${line#* }"
  [ "${line%% *}" != FAIL ]
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
  echo "## GPU tests: pytest -m gpu tests/test_gpu.py tests/test_gpu_save.py tests/test_gpu_nccl.py (local files; no S3 server)"
  local rc limit
  limit=$(left "$TESTS_S")
  "${LIMIT[@]}" "$limit" "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --timeout 90 \
    --junitxml="$OUTDIR/pytest_gpu.xml" tests/test_gpu.py tests/test_gpu_save.py tests/test_gpu_nccl.py
  rc=$?
  local tally
  tally=$(grep -oE '(tests|failures|errors|skipped)="[0-9]+"' "$OUTDIR/pytest_gpu.xml" 2>/dev/null | head -4 \
          | tr -d '"' | tr '\n' ' ')
  if [ $rc -eq 0 ]; then check PASS gpu-tests "pytest exit 0; $tally"
  elif [ $rc -eq 124 ]; then check TIMEOUT "gpu-tests after $limit s" "pytest ran out of time; so far $tally"
  else check FAIL gpu-tests "pytest exit $rc; $tally"; return 1; fi
}

part_bench() {
  echo "## GPU benchmark: python -m benchmarks.gpu"
  local rc limit
  limit=$(left 100000)
  limit=$((limit - 5))  # rm -rf and the summary
  echo "($limit s left of the script's $DEADLINE_S s)"
  "${LIMIT[@]}" "$limit" "$PY" -m benchmarks.gpu --work "$WORK" --summary "$SUMMARY" --out "$OUTDIR/gpu.txt" \
    --budget-s $((limit - 60))
  rc=$?
  if [ $rc -eq 124 ]; then check TIMEOUT "benchmark after $limit s" "its parts out of time say TIMEOUT above"
  elif [ $rc -ne 0 ]; then check FAIL benchmark "benchmarks.gpu exit $rc (see the log)"; return 1; fi
}

main() {
  local status=0
  echo "# streamckpt GPU check: python=$PY wheels=$WHEELS site=$SITE work=$WORK out=$OUTDIR deadline=${DEADLINE_S}s"
  if [ "${1:-}" != "--no-install" ]; then
    part_install || { stop install; return 1; }
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  fi
  part_import || { stop import; return 1; }
  if [ "${1:-}" = "--install-only" ]; then return $status; fi
  part_cuda || { stop cuda; return 1; }
  part_pin || status=1
  part_tests || status=1
  if part_space; then part_bench || status=1; else status=1; fi
  rm -rf "$WORK"
  return $status
}

main "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
grep -q '^FAIL' "$SUMMARY" && status=1
rm -f "$OUTDIR"/.*.err
{ echo "## summary (exit status $status, $SECONDS s)"; cat "$SUMMARY"; } | tee -a "$LOG"
exit $status
