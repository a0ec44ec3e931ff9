"""Where the train step's device time goes, by source line (not a test).

Traces `--steps` calls of the jitted train step with `jax.profiler` and adds up each XLA op's time under the
innermost frames of Python source that emitted it, read from the stack frames the compiled HLO carries
(FileNames/FunctionNames/FileLocations/StackFrames). A fusion is charged to the frame of its root op. XLA
kind names ("dot_general", "multiply_add_fusion") alone don't say which layer a cost belongs to; this does.
Ops without a frame (a few wrapped reductions and copies) are listed as "(no frame)".

The step is built as `bench_train_step.py` builds it (same shapes, XLA options, huge pages first). Times are
the traced ops' own durations summed over both CPU threads; on a busy machine they move like any timing, so
compare lines within one run. Caveat: XLA:CPU runs large dots asynchronously on its intra-op threads, so a
dot's trace event can be far shorter than its work (an LM-head slice dot, 2.1 GFLOP, showed 0.5-0.9 ms), and
elementwise ops that run beside it absorb the wait. Large dots are under-charged and concurrent elementwise
ops over-charged; confirm a line's cost by removing or rewriting it in a one-process A/B.

Usage: python bench/profile_step.py [--cpu-shape] [--optimizer hero|adam] [--steps 3] [--depth 1] [--top 30]
                                    [--trace-dir /tmp/moejax-profile]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shutil

import jax

from bench_train_step import bench_config, compiled_step
from moejax import hostmem, roofline
from moejax.data.pipeline import make_data
from moejax.presets import TINY

BENCH_FRAMES = ("profile_step.py", "bench_train_step.py")  # this script's own frames: not a cost's owner


def source_frames(hlo: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """`roofline.source_frames` without this script's own frames."""
    return roofline.source_frames(hlo, skip_files=BENCH_FRAMES)


def op_times(trace_dir: str) -> collections.Counter:
    """Microseconds per XLA op name, summed over the trace."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    times = collections.Counter()
    for e in json.load(gzip.open(path))["traceEvents"]:
        if e.get("ph") == "X":
            times[e["name"]] += e["dur"]
    return times


def main() -> None:
    hostmem.exec_with_host_memory()  # as the `moejax` command runs (moejax.hostmem); may re-execute
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-shape", action="store_true", help="issue 11's CPU shape instead of the tiny preset")
    ap.add_argument("--optimizer", choices=("hero", "adam"), default=TINY.train.optimizer)
    ap.add_argument("--steps", type=int, default=3, help="traced steps (after two untraced ones)")
    ap.add_argument("--depth", type=int, default=1, help="source frames per line, innermost first")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/moejax-profile")
    args = ap.parse_args()

    cfg = bench_config(args.cpu_shape, args.optimizer)
    with make_data(cfg) as data:
        batches = [jax.device_put(data.train.batch(i)) for i in range(args.steps + 3)]
    step_fn, state, _ = compiled_step(cfg, batches[0])
    for batch in batches[1:3]:
        state, _ = jax.block_until_ready(step_fn(state, batch))
    shutil.rmtree(args.trace_dir, ignore_errors=True)
    with jax.profiler.trace(args.trace_dir):
        for batch in batches[3:]:
            state, _ = jax.block_until_ready(step_fn(state, batch))
    frames, ops = source_frames(step_fn.lower(state, batches[0]).compile().as_text())

    by_line, kinds = collections.Counter(), collections.defaultdict(collections.Counter)
    for name, us in op_times(args.trace_dir).items():
        if name not in frames:
            continue  # runtime events (thunk executor, python), not instructions of the step
        key = " < ".join(frames[name][:args.depth]) or "(no frame)"
        ms = us / args.steps / 1e3
        by_line[key] += ms
        kinds[key][re.sub(r"\.\d+$", "", name)] += ms
    print(f"{sum(by_line.values()):.1f} ms of XLA ops per step, {args.steps} traced steps, "
          f"optimizer {args.optimizer}, GLIBC_TUNABLES={hostmem.tunables()!r}, allocator {hostmem.allocator()}")
    for key, ms in by_line.most_common(args.top):
        top = ", ".join(f"{k} {v:.1f}" for k, v in kinds[key].most_common(3))
        print(f"{ms:8.2f} ms  {key}   [{top}]")


if __name__ == "__main__":
    main()
