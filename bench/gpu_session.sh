#!/usr/bin/env bash
# Everything issue 11 needs from one GPU session, unattended, each part time-limited (~32 minutes of limits
# in all, so with a 10-minute limit per command and 15 minutes of device time, run the parts that matter as
# calls on one warm machine, back to back: it is given back after 30 s idle). Next session (after the
# twenty-fourth, 2026-12-04): PARTS="check grouped" (~410 s: check took 131 s for 13 checks on the H200 last
# time, 17 now; grouped up to 240 s; by the deviceless roofline the rows-in-the-kernels grouped GEMM is at
# 0.88 / 0.79 of the dense dot at E = 64 / 384, against 0.55 / 0.47 for the default path), then PARTS="fast"
# (up to 330 s), then,
# with device time left, PARTS="torch" (up to 240 s: the PyTorch baseline of the ">= 5x" target at G,
# beside moejax in the same call; never run on a GPU yet), PARTS="d1024" (the rung in the run's default layout, unrolled without remat: 86 GB,
# roofline 255 ms against 305 ms scanned with remat, never timed), PARTS="ep" (the capacity path's experts on
# the grouped kernels, never timed) or PARTS="step" (d1024 scanned with remat,
# both paths; its capacity path runs since the twenty-third session). On an H100 (80 GB; `device`'s default kind
# since 2026-12-05) run the same parts: each times its own baselines (the dense dot, the default path) in the same
# call, so its ratios stand on their own; its absolute figures don't compare with the H200's.
#   check    check_gpu_kernels.py: the compiled kernels' values and gradients against fp32 references (the
#            grouped kernels also with the rows read and written in place: MOEJAX_GROUPED_ROWS);
#   grouped  bench_grouped.py: the grouped GEMM alone at E = 64 and 384 (>= 60% of dense target): the default
#            path, the dense dot, the rows-in-the-kernels path and the kernels alone first; then the tile /
#            pipeline-stage / warp sweep;
#   flash    bench_flash.py: the attention core, flash kernel block sizes (and the default without document
#            skipping) vs the XLA path (and cuDNN);
#   fast     bench_gpu.py on G laid out as its roofline says is fastest: layers unrolled, no remat (49 GB):
#            the local path, the local path with the rows in the kernels (the A/B that decides
#            MOEJAX_GROUPED_ROWS's default), then the capacity path;
#   d1024    bench_gpu.py: the d1024 rung's local path in the run's default layout (unrolled, no remat; with remat
#            on a GPU under 100 GB, e.g. an 80 GB H100, where 86 GB doesn't fit);
#   ep       bench_gpu.py --paths capacity,capacity-grouped on G, fast layout: the transport's expert MLPs on
#            einsums over its capacity buffers or on the grouped kernels, kept rows only (decides MOEJAX_EP_GROUPED);
#   torch    bench_torch_moe.py --shape G: a plain PyTorch MoE stack of G's sizes (bf16 autocast, grouped_mm
#            experts, fused AdamW: the issue's ~30,000 tokens/s baseline) beside moejax's step, alternating;
#   step     bench_gpu.py: shapes G and d1024, capacity and local paths, top kernels of a profile (d1024's capacity
#            path runs since the twenty-third session: two-digit expert ids in the transport header);
#   ab       bench_gpu.py --paths local,local-rows on G in the default layout (scanned, remat).
# A crash or hang (a Triton compile, an OOM) costs only its part. Output: the console, and one log per part
# under $OUT (the device tool's folder) or ./bench_out.
# Usage, from the repository root on the GPU machine:  bash bench/gpu_session.sh
#   PARTS="fast step" bash bench/gpu_session.sh   runs a subset (e.g. to split a session into calls)
# CPU check of the script itself (small shapes, ~2 minutes):  SMOKE=1 bash bench/gpu_session.sh
set -u
out="${OUT:-bench_out}"
parts="${PARTS:-check fast d1024 ep torch step grouped flash ab}"
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # peak-memory figures from the allocator, not a 75% preallocation

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " $parts " in *" $name "*) ;; *) return ;; esac
  echo "=== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"; } \
  2>&1 | tee "$out/env.log"
if [ -n "${SMOKE:-}" ]; then
  check_args=(--smoke)
  grouped_args=(--rows 2048 --z 64 --f 64 --experts 8 --block-sizes 64 --reps 2 --no-kernel)
  flash_args=(--smoke)
  step_args=(--smoke --steps 2)
  torch_args=(--smoke)
else
  check_args=()
  grouped_args=(--reps 5 --block-sizes 128 256 --tiles 128x64 64x64 128x64:3 128x128:3 64x128)
  flash_args=(--no-xla --blocks 128x64,128x64 128x64,128x64:2:1:8 128x64,128x64:3:2:8 128x64,128x64:3:2:4
              128x128,128x64:3:1:8)
  step_args=()
  torch_args=()
fi
# 240 s: the 17 checks (4 more since the last GPU run) took ~10 s each there; each prints as it finishes
part check 240 python bench/check_gpu_kernels.py "${check_args[@]}"
part grouped 240 python bench/bench_grouped.py "${grouped_args[@]}"
part flash 120 python bench/bench_flash.py "${flash_args[@]}"
# local first (90 s on the H200), then with the rows in the kernels, then the capacity path in the same
# layout (never timed there: it started after the local case and ran out of the part's limit before)
part fast 330 python bench/bench_gpu.py --shapes G --paths local,local-rows,capacity --unrolled --no-remat \
  --steps 4 --budget-s 200 "${step_args[@]}"
# d1024 without remat needs ~86 GB (XLA's compiled peak): on a smaller GPU (an 80 GB H100) the part keeps block
# remat (~55 GB), so it times a step instead of running out of memory after its compile
d1024_remat=(--no-remat)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
if [ -n "$gpu_mib" ] && [ "$gpu_mib" -lt 100000 ] 2>/dev/null; then d1024_remat=(); fi
part d1024 240 python bench/bench_gpu.py --shapes d1024 --paths local --unrolled \
  ${d1024_remat[@]+"${d1024_remat[@]}"} --steps 4 --budget-s 120 "${step_args[@]}"
# the capacity path's expert MLPs on batched einsums over its buffers, then on the grouped kernels computing
# only the kept rows (MOEJAX_EP_GROUPED, never timed), in G's fast layout
part ep 240 python bench/bench_gpu.py --shapes G --paths capacity,capacity-grouped --unrolled --no-remat \
  --no-profile --steps 4 --budget-s 150 "${step_args[@]}"
# the PyTorch stack issue 11 compares against (~30,000 tokens/s there, target >= 5x): its expert paths checked in
# bf16, then timed at G beside moejax's fast layout in the same call, each stack in its own process, one after the
# other (together ~115-130 GB by estimate; a dedicated GPU's speed doesn't drift as a shared CPU's does)
part torch 240 bash -c 'python bench/bench_torch_moe.py --check && \
  python bench/bench_torch_moe.py --shape G --steps 4 --warmup 2 --sequential "$@"' torch "${torch_args[@]}"
part step 300 python bench/bench_gpu.py --budget-s 220 "${step_args[@]}"
part ab 240 python bench/bench_gpu.py --shapes G --paths local,local-rows --no-profile --steps 4 --budget-s 120 \
  "${step_args[@]}"
