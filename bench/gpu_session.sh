#!/usr/bin/env bash
# Everything issue 11 needs from one GPU session, in one unattended call (~9 minutes at most):
#   1. bench_grouped.py: the grouped GEMM alone at E = 64 and 384 (>= 60% of dense target) and a tile sweep;
#   2. bench_gpu.py: shapes G and d1024, capacity and local paths, with the top kernels of a profile;
#   3. bench_gpu.py --paths local,local-xla on G: the grouped-GEMM kernel against the XLA einsums in the step.
# Each part has its own time limit, so a crash or hang (a Triton compile, an OOM) costs only that part.
# Output: the console, and one log per part under $OUT (the device tool's folder) or ./bench_out.
# Usage, from the repository root on the GPU machine:  bash bench/gpu_session.sh
# CPU check of the script itself (small shapes, a few minutes):  SMOKE=1 bash bench/gpu_session.sh
set -u
out="${OUT:-bench_out}"
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # peak-memory figures from the allocator, not a 75% preallocation

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"; } \
  2>&1 | tee "$out/env.log"
if [ -n "${SMOKE:-}" ]; then
  grouped_args=(--rows 2048 --z 64 --f 64 --experts 8 --block-sizes 64 --reps 2 --no-kernel)
  step_args=(--smoke --steps 2)
else
  grouped_args=(--reps 5)
  step_args=()
fi
part grouped 120 python bench/bench_grouped.py "${grouped_args[@]}"
part step 330 python bench/bench_gpu.py --budget-s 240 "${step_args[@]}"
part step_kernel_ab 130 python bench/bench_gpu.py --shapes G --paths local,local-xla --no-profile --steps 4 \
  --budget-s 60 "${step_args[@]}"
