"""Grouped GEMM fwd+bwd throughput: the blocked grouped GEMM vs `jax.lax.ragged_dot` vs one dense dot (not a test).

One matmul y_AF = x_AZ @ w[expert_A] with random (uniform) expert choices, forward plus the backward to both
x and w, FLOPs counted as 3 x 2*A*Z*F (the useful FLOPs; padding and ragged_dot's dense emulation are not
credited). Rows:
- grouped, b=...: `moejax.model.moe.grouped.grouped_matmul` end to end (make_layout + gather into blocks +
  block matmul + gather back), per block size (the default block for this shape is always included); with
  `--kernel`, also with the row gathers inside the kernels (MOEJAX_GROUPED_ROWS=gpu_kernel: no block copies),
  and that again with the rows given sorted by expert, as ragged_dot takes them (the layout skips its sort);
- block matmul only: the default block, with the layout built and rows blocked outside the timed function,
  on the XLA einsums and (`--kernel`, default on GPU) on the Pallas kernels of `grouped_gpu`;
- kernels fwd + dx + dw only (`--kernel`): the three kernels on the same blocks at each of `--tiles`
  (output x contraction tile; the weight-gradient tile the same), to pick `GemmTiles` on a GPU, and beside
  each the SwiGLU down projection's dx kernel with the activation's derivative (`matmul_dx_act`, the step's
  slowest grouped kernel on an H200; with 128-column tiles it spills 12 B at the step's row counts, 64 doesn't);
- ragged_dot: rows pre-sorted by expert, group sizes given (E x emulated on CPU and GPU);
- dense: x_AZ @ w_ZF, the same useful FLOPs in one dot.
grouped / dense is the issue-11 target (>= 60% on GPU): per E, the default grouped path and the dense dot are
timed and printed first; then, with the dense dot again, the rows-in-the-kernels paths (rows unsorted and
pre-sorted) and the block matmul alone (the kernel on GPU); then the other rows. A time limit (or a slow compile) that cuts the sweep short
still leaves the headline. Times are the median of --reps after one warm-up call
(compile excluded); the paths of a group take turns rep by rep, so a busy machine slows them alike. A path
that fails (e.g. ragged_dot's allocation at E=384) prints its error.

Usage: python bench/bench_grouped.py [--rows 16384] [--z 256] [--f 256] [--experts 32 128] [--dtype float32]
       [--block-sizes 64 128 256] [--reps 5] [--no-ragged]
On a GPU the defaults are issue 11's shape: --rows 262144 --z 512 --f 512 --experts 64 384 --dtype bfloat16
--block-sizes 128 256 512, without ragged_dot (--ragged to add it: 5.7 TFLOP/s at E=64 and out of memory at
E=384 on an H200, issue 11; its dense emulation took most of the first session's 130 s limit).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import kernel_choice
from moejax.model.kernel_choice import GROUPED, GROUPED_ROWS, chosen
from moejax.model.moe import grouped_gpu
from moejax.model.moe.grouped import block_matmul, default_block, grouped_matmul, make_layout, to_blocks


DENSE = "dense dot (same FLOPs)"
DX_ACT = "dx_act kernel only (one matmul's FLOPs)"  # a row that does a third of the others' FLOPs

# Defaults on a GPU: issue 11's measurement (262,144 rows x 512 x 512, bf16, E=64 and 384).
GPU_DEFAULTS = dict(rows=262_144, z=512, f=512, experts=[64, 384], dtype="bfloat16", block_sizes=[128, 256, 512],
                    ragged=False)


def fwd_bwd(fn, grouped: str | None = None, rows: str = "xla"):
    """jit of (args...) -> <fn(x, w, ...), ct> and its grads with respect to x and w. The value is returned so
    the forward matmul is computed: the loss is linear in fn, whose grads alone would not need it.
    `grouped` ('xla' | 'gpu_kernel') fixes MOEJAX_GROUPED, and `rows` MOEJAX_GROUPED_ROWS, while the whole
    function, backward included, traces."""
    f = jax.value_and_grad(lambda x, w, ct, *rest: jnp.vdot(fn(x, w, *rest), ct).real, argnums=(0, 1))
    if grouped is None:
        return jax.jit(f)

    def under_choice(*args):
        with chosen(GROUPED[0], grouped), chosen(GROUPED_ROWS[0], rows):
            return f(*args)
    return jax.jit(under_choice)


def time_interleaved(runs: list[tuple[str, object, tuple]], reps: int) -> dict[str, float | str]:
    """Median seconds per path, the paths taking turns rep by rep so that load from other processes on a
    shared machine hits all of them alike. A path that fails to compile or run gets its error instead."""
    live, out = [], {}
    for label, f, args in runs:
        try:
            jax.block_until_ready(f(*args))  # compile + warm-up
            live.append((label, f, args))
        except Exception as e:  # noqa: BLE001 — a bench row, e.g. ragged_dot's allocation at E=384
            out[label] = f"failed: {str(e).splitlines()[0][:120]}"
    times = {label: [] for label, _, _ in live}
    for _ in range(reps):
        for label, f, args in live:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[label].append(time.perf_counter() - t0)
    return {label: out.get(label) or float(np.median(times[label])) for label, _, _ in runs}


def grouped_fn(block: int):
    return lambda x_AZ, w_EZF, expert_A: grouped_matmul(x_AZ, expert_A, w_EZF, block)


def cases(a, n_exp: int, key) -> list[list[tuple[str, object, tuple]]]:
    """Groups of (label, jitted fwd+bwd, args): first the headline (the default grouped path, the dense dot),
    then the kernels' own rows beside the dense dot (rows in the kernels, the block matmul alone), then the
    rest. Each group is compiled whole before it is timed, so the headline can't wait on the others'
    compiles."""
    dt = jnp.dtype(a.dtype)
    kx, kw, ke, kc = jax.random.split(key, 4)
    x_AZ = jax.random.normal(kx, (a.rows, a.z), dt)
    w_EZF = (jax.random.normal(kw, (n_exp, a.z, a.f)) / a.z ** 0.5).astype(dt)
    expert_A = jax.random.randint(ke, (a.rows,), 0, n_exp)
    ct_AF = jax.random.normal(kc, (a.rows, a.f), dt)
    b_def = default_block(a.rows, n_exp)
    grouped_args = (x_AZ, w_EZF, ct_AF, expert_A)
    dense = (DENSE, fwd_bwd(lambda x, w: x @ w), (x_AZ, w_EZF[0], ct_AF))
    headline = [(f"grouped, b={b_def} (default)", fwd_bwd(grouped_fn(b_def)), grouped_args), dense]
    kernels = []
    if a.kernel:  # the kernels reading and writing the rows in place: no gathers into blocks and back
        kernels.append((f"grouped, b={b_def}, rows in the kernels",
                        fwd_bwd(grouped_fn(b_def), grouped="gpu_kernel", rows="gpu_kernel"), grouped_args))
        # ragged_dot's contract: rows come sorted by expert, so the layout skips its sort
        order = jnp.argsort(expert_A)
        presorted = lambda x, w, e: grouped_matmul(x, e, w, b_def, presorted=True)
        kernels.append((f"grouped, b={b_def}, rows in the kernels, rows pre-sorted (as ragged_dot takes them)",
                        fwd_bwd(presorted, grouped="gpu_kernel", rows="gpu_kernel"),
                        (x_AZ[order], w_EZF, ct_AF[order], expert_A[order])))
    out = [(f"grouped, b={b}", fwd_bwd(grouped_fn(b)), grouped_args) for b in sorted(set(a.block_sizes) - {b_def})]
    layout = make_layout(expert_A, n_exp)
    x_NbZ = to_blocks(x_AZ, layout)
    ct_NbF = jax.random.normal(kc, x_NbZ.shape[:2] + (a.f,), dt)
    block_args = (x_NbZ, w_EZF, ct_NbF, layout.expert_Bk, layout.blocks_E)
    # The block matmul alone (rows already sorted and blocked, as ragged_dot's are): the kernel's own share of
    # the headline, timed beside the dense dot.
    impls = (("gpu_kernel",) if a.kernel else ()) + (("xla",) if a.block_xla else ())
    blocks_only = [(f"block matmul only, {impl}, b={layout.block}, {layout.n_blocks} blocks",
                    fwd_bwd(lambda x, w, e, c: block_matmul(x, w, e, c), grouped=impl), block_args) for impl in impls]
    kernels += blocks_only[:1]
    out += blocks_only[1:]
    # The SwiGLU down projection's dx with the activation's derivative: x as its cotangent (width Z), the
    # weights transposed ([E, F, Z]), a random gate/up pair (width F).
    gu_Nb2F = jax.random.normal(jax.random.fold_in(kc, 1), x_NbZ.shape[:2] + (2, a.f), dt)
    act_args = (x_NbZ, jnp.swapaxes(w_EZF, 1, 2), gu_Nb2F, layout.expert_Bk, layout.blocks_E)
    for t in a.tiles if a.kernel else ():
        launch = f"tiles {t.tn}x{t.tk}, {t.num_stages} stages, {t.num_warps} warps"

        def three_kernels(x, w, dy, e, c, t=t):
            kw = dict(tiles=t, interpret=kernel_choice.run_interpreted())
            return (grouped_gpu.matmul(x, w, e, c, **kw), grouped_gpu.matmul_dx(dy, w, e, c, **kw),
                    grouped_gpu.matmul_dw(x, dy, c, **kw))
        out.append((f"kernels fwd + dx + dw only, {launch}", jax.jit(three_kernels), block_args))
        dx_act = functools.partial(grouped_gpu.matmul_dx_act, tiles=t, interpret=kernel_choice.run_interpreted())
        out.append((f"{DX_ACT}, {launch}", jax.jit(dx_act), act_args))
    if a.ragged:
        sizes_E = jnp.bincount(expert_A, length=n_exp).astype(jnp.int32)  # rows count as sorted
        out.append(("ragged_dot", fwd_bwd(lambda x, w, s: jax.lax.ragged_dot(x, w, s)), (x_AZ, w_EZF, ct_AF, sizes_E)))
    return [headline, kernels + [dense] if kernels else [], out]


def parse_tiles(text: str) -> grouped_gpu.GemmTiles:
    """'128x64' / '128x64:3' / '128x64:3:4' -> GemmTiles (tn x tk, tz x tf the same; stages; warps)."""
    size, *launch = text.split(":")
    tn, tk = (int(v) for v in size.split("x"))
    stages, warps = ([int(v) for v in launch] + [None, None])[:2]
    base = grouped_gpu.GemmTiles()
    return grouped_gpu.GemmTiles(tn=tn, tk=tk, tz=tn, tf=tk, num_stages=stages or base.num_stages,
                                 num_warps=warps or base.num_warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384, help="A, rows (token-expert assignments)")
    ap.add_argument("--z", type=int, default=256, help="input width")
    ap.add_argument("--f", type=int, default=256, help="output width")
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ragged", action=argparse.BooleanOptionalAction, default=True,
                    help="also time ragged_dot (a dense emulation: slow; default off on GPU)")
    ap.add_argument("--kernel", action=argparse.BooleanOptionalAction, default=jax.default_backend() == "gpu",
                    help="also time the Pallas grouped-GEMM kernels (default on GPU; interpreted, slowly, on CPU)")
    ap.add_argument("--block-xla", action=argparse.BooleanOptionalAction, default=jax.default_backend() != "gpu",
                    help="also time the block matmul alone on the XLA einsums (default off on GPU: on an H200, "
                         "2026-12-04, XLA's compile of the rows after the headline stalled, most likely this one)")
    ap.add_argument("--tiles", nargs="*", type=parse_tiles,
                    default=[parse_tiles(s) for s in ("64x64", "128x64", "128x64:3", "128x64:3:4", "64x128", "128x128")],
                    help="with --kernel: also time the three kernels alone at these tiles: output x contraction "
                         "(the weight-gradient tile the same)[:pipeline stages[:warps]]")
    if jax.default_backend() == "gpu":  # issue 11's GPU shape
        ap.set_defaults(**GPU_DEFAULTS)
    a = ap.parse_args()

    flops = 3 * 2.0 * a.rows * a.z * a.f
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"A={a.rows:,} rows x Z={a.z} -> F={a.f}, {a.dtype}, fwd+bwd useful FLOPs {flops:.4g}, "
          f"median of {a.reps}\n")
    print("| E | path | ms | TFLOP/s | / dense |")
    print("|---|---|---|---|---|")
    for n_exp in a.experts:
        dense = None
        for group in cases(a, n_exp, jax.random.key(n_exp)):
            times = time_interleaved(group, a.reps)
            dense = times.get(DENSE, dense)
            for label, t in times.items():
                if isinstance(t, str):
                    print(f"| {n_exp} | {label} | {t} | | |", flush=True)
                else:
                    done = flops / 3 if label.startswith(DX_ACT) else flops
                    ratio = f"{done / t / (flops / dense):.2f}" if isinstance(dense, float) else ""  # rate / dense's
                    print(f"| {n_exp} | {label} | {1e3 * t:.1f} | {done / t / 1e12:.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
