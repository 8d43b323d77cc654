#!/usr/bin/env bash
# Every GPU check of gradoverride in one call, on one GPU, in under 8 minutes: the test
# suite's CUDA tests (`pytest -k cuda`), then each benchmark with `--device cuda`, then one
# table of what each step gave (every timed case with its ratio, or the step's summary).
#
#     bash benchmarks/gpu.sh            # from anywhere; PYTHON=... picks the interpreter
#
# It needs a torch build that sees a GPU (and the test extras: pytest, hypothesis, ...);
# without one it exits with status 2 and says why, before running anything. Each step has a
# time limit (the limits add up to 7.5 minutes); a step that fails or runs out of time
# is marked so in the table, the others still run, and the script exits non-zero. A
# benchmark that cannot run there (TensorFlow without GPU support) exits with status 3 and
# is marked skipped.
# Full logs go to $OUT/gpu-logs when $OUT is set (a device machine's output folder), else to
# a temporary folder; the table says where.
#
# To check the script itself on a machine without a GPU: GPU_SH_DEVICE=cpu GPU_SH_QUICK=1
# runs the same steps on the CPU, each benchmark in its quick mode.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEVICE=${GPU_SH_DEVICE:-cuda}
QUICK=${GPU_SH_QUICK:+--quick}

if [ "$DEVICE" = cuda ] && ! "$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"benchmarks/gpu.sh: torch does not import with {sys.executable}: {exc}")
if not torch.cuda.is_available():
    sys.exit(
        f"benchmarks/gpu.sh: CUDA is not available to torch {torch.__version__} "
        f"({sys.executable}): this script needs a GPU and a CUDA build of torch. "
        "Run it on a machine with a GPU (PYTHON=... selects another interpreter); the CPU "
        "figures come from the benchmarks themselves: python benchmarks/<name>.py."
    )
print(f"benchmarks/gpu.sh: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF
then
    exit 2
fi

LOGS=${OUT:+$OUT/gpu-logs}
LOGS=${LOGS:-$(mktemp -d -t gradoverride-gpu-XXXXXX)}
mkdir -p "$LOGS"
export KERAS_BACKEND=${KERAS_BACKEND:-tensorflow} TF_CPP_MIN_LOG_LEVEL=2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND, its output in $LOGS/NAME.log, and
# "status seconds" in $LOGS/NAME.status.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS rc
    timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    local took=$((SECONDS - start)) status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=timeout
    elif [ "$rc" -eq 3 ]; then
        status=skipped  # the benchmark cannot run here, and said why (exit status 3)
    elif [ "$rc" -ne 0 ]; then
        status="failed($rc)"
    fi
    case $status in ok | skipped) ;; *) failed=1 ;; esac
    echo "$status $took" >"$LOGS/$name.status"
    echo "   $status in ${took}s"
}

step tests 90 "$PYTHON" -m pytest -q -p no:cacheprovider -k "$DEVICE" tests
step overhead 45 "$PYTHON" benchmarks/overhead.py --device "$DEVICE" $QUICK
step modules 85 "$PYTHON" benchmarks/modules.py --device "$DEVICE" --rounds 21 $QUICK
step flow 40 "$PYTHON" benchmarks/flow.py --device "$DEVICE" $QUICK
step ste 75 "$PYTHON" benchmarks/ste.py --device "$DEVICE" $QUICK
step tf_overhead 25 "$PYTHON" benchmarks/tf_overhead.py --device "$DEVICE" $QUICK
step keras_layers 30 "$PYTHON" benchmarks/keras_layers.py --device "$DEVICE" $QUICK
step override_cycles 25 "$PYTHON" benchmarks/override_cycles.py --device "$DEVICE" $QUICK
step import_cost 35 "$PYTHON" benchmarks/import_cost.py --device "$DEVICE" --rounds 3 $QUICK

"$PYTHON" benchmarks/_gpu_table.py "$LOGS" tests overhead modules flow ste tf_overhead \
    keras_layers override_cycles import_cost
exit "$failed"
