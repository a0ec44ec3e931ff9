"""Numerics of the compiled GPU kernels against fp32 references, on the GPU itself (not a test: `make test`
checks the same kernels through the Pallas interpreter on CPU; this checks what Triton compiled).

- grouped GEMM: `grouped_swiglu` (the kernels' forward, dx and dw; gate and up as one matmul, the down
  projection's dx with the activation's derivative) vs an fp32 per-row SwiGLU, values and the
  gradients of x and the three weights; unaligned groups with empty experts at E = 64 and 384, bf16 and fp32;
  and bf16 with the rows read and written inside the kernels (MOEJAX_GROUPED_ROWS=gpu_kernel); the
  transport's kept-rows entry (`swiglu_kept_rows`, MOEJAX_EP_GROUPED), skipped rows exactly 0.
- flash attention: the kernel vs the dense fp32 core, values and q/k/v gradients; local (window) and
  global (GQA on 1 KV head) layers, packed documents, bf16 and fp32; and keys extended in front (context
  parallelism: 256 earlier keys, -1 padding on one row).
- the optimizer's Newton-Schulz kernels (`train.ns_gpu`): the Gram X X^T and both polynomial GEMMs + adds vs
  fp32.
The error is the relative Frobenius norm ||got - ref|| / ||ref||. Tolerances: four unit roundings of the
precision the kernels' dots run at — bf16 (2^-8 each: the CPU tests' RTOL_BF16_NORM) and, for fp32 inputs,
TF32 (2^-11 each: Triton's fp32 dots use TF32, as XLA's default-precision fp32 matmuls on this GPU do).
Exit status 1 if any check fails.

Usage (GPU): PYTHONPATH=src python bench/check_gpu_kernels.py
CPU check of the script (kernels interpreted, small shapes): PYTHONPATH=src python bench/check_gpu_kernels.py --smoke
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench_gpu import packed_segments  # bench/ is sys.path[0] when run as a script
from moejax.model.attention import _softmax_av, block_mask
from moejax.model.flash_gpu import FlashBlocks, flash_attention
from moejax.model.kernel_choice import GROUPED, GROUPED_ROWS, chosen, run_interpreted
from moejax.model.moe.grouped import grouped_swiglu, swiglu_kept_rows

TOLERANCE = {"bfloat16": 4 * 2.0 ** -8, "float32": 4 * 2.0 ** -11}
HP = jax.lax.Precision.HIGHEST


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def value_and_grads(fn, args, ct, kernels: int = 0):
    """fn's value and the gradients of sum(fn * ct); `kernels`: how many Pallas calls the gradient must
    hold (forward + backward kernels), so that a fallback to XLA can't pass as the kernel."""
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    found = str(jax.make_jaxpr(grad)(*args)).count("pallas_call[")
    if found != kernels:
        raise AssertionError(f"expected {kernels} kernel calls in the gradient, found {found}")
    return jax.jit(fn)(*args), jax.jit(grad)(*args)


def swiglu_reference(x, expert_A, wg, wu, wd):
    f32 = lambda a: a.astype(jnp.float32)
    x, wg, wu, wd = f32(x), f32(wg)[expert_A], f32(wu)[expert_A], f32(wd)[expert_A]
    h = jax.nn.silu(jnp.einsum("az,azf->af", x, wg, precision=HP)) * jnp.einsum("az,azf->af", x, wu, precision=HP)
    return jnp.einsum("af,afz->az", h, wd, precision=HP)


def check_grouped(n_exp: int, rows: int, width: int, dtype: str, rows_in_kernels: str = "xla") -> dict:
    """rows_in_kernels: "xla" (XLA gathers rows into blocks), "gpu_kernel" (MOEJAX_GROUPED_ROWS: the kernels
    read and write the rows), "kept" (`swiglu_kept_rows`, the transport's experts under MOEJAX_EP_GROUPED:
    ~15% of the rows are no expert's and must come out, with their input gradient, exactly 0)."""
    rng = np.random.default_rng(n_exp)
    probs = rng.dirichlet(np.full(n_exp, 0.3))  # uneven loads, some experts empty
    expert_A = jnp.asarray(rng.choice(n_exp, size=rows, p=probs), jnp.int32)
    if rows_in_kernels == "kept":
        return _check_kept(n_exp, expert_A, width, dtype, rng)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.normal(size=(rows, width)), dt)
    ws = [jnp.asarray(rng.normal(size=s) / np.sqrt(width), dt)
          for s in [(n_exp, width, width), (n_exp, width, width), (n_exp, width, width)]]
    ct = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    # traced inside: the kernels (fwd, dx, dw) of gate-and-up and of the down projection (its dx with the
    # activation's derivative)
    with chosen(GROUPED[0], "gpu_kernel"), chosen(GROUPED_ROWS[0], rows_in_kernels):
        got = value_and_grads(lambda x, *w: grouped_swiglu(x, expert_A, *w), (x, *ws), ct, kernels=2 * 3)
    ref = value_and_grads(lambda x, *w: swiglu_reference(x, expert_A, *w),
                          (x.astype(jnp.float32), *(w.astype(jnp.float32) for w in ws)), ct)
    names = ["y", "dx", "dw_gate", "dw_up", "dw_down"]
    errs = [rel_err(got[0], ref[0])] + [rel_err(a, b) for a, b in zip(got[1], ref[1])]
    empty = int(np.sum(np.bincount(np.asarray(expert_A), minlength=n_exp) == 0))
    rows_note = ", rows in the kernels" if rows_in_kernels == "gpu_kernel" else ""
    return {"what": f"grouped SwiGLU E={n_exp} ({empty} empty), {rows} rows x {width}, {dtype}{rows_note}",
            "errors": dict(zip(names, errs)), "tol": TOLERANCE[dtype]}


def check_flash(seq: int, heads: int, kv_heads: int, head_dim: int, window: int | None, earlier: int, dtype: str,
                blocks: FlashBlocks | None) -> dict:
    rng = np.random.default_rng(seq + kv_heads + earlier)
    batch, dt = 2, jnp.dtype(dtype)
    q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), dt)
    k, v = (jnp.asarray(rng.normal(size=(batch, earlier + seq, kv_heads, head_dim)), dt) for _ in range(2))
    seg_q = packed_segments(batch, seq, max(seq // 4, 1), rng)
    front = np.full((batch, earlier), -1, np.int32)
    if earlier:
        front[0, earlier // 2:] = seg_q[0, 0]  # row 0's first document began earlier; row 1 is padding there
    seg_k = jnp.asarray(np.concatenate([front, seg_q], axis=1))
    ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    scale = 1.3 / np.sqrt(head_dim)
    head_map = np.arange(heads) // (heads // kv_heads)
    mask = block_mask(jnp.asarray(seg_q), seg_k, earlier + jnp.arange(seq), jnp.arange(earlier + seq), window)
    kernel = lambda q, k, v: flash_attention(q, k, v, seg_k, scale, window, blocks, run_interpreted())
    dense = lambda q, k, v: _softmax_av(q, k[:, :, head_map], v[:, :, head_map], mask, scale)
    got = value_and_grads(kernel, (q, k, v), ct, kernels=3)
    with jax.default_matmul_precision("highest"):
        ref = value_and_grads(dense, tuple(a.astype(jnp.float32) for a in (q, k, v)), ct)
    names = ["out", "dq", "dk", "dv"]
    errs = [rel_err(got[0], ref[0])] + [rel_err(a, b) for a, b in zip(got[1], ref[1])]
    kind = "global" if window is None else f"local w={window}"
    return {"what": f"flash {kind}, S={seq}{f' +{earlier} earlier keys' if earlier else ''}, {heads} heads on "
                    f"{kv_heads}, Hd={head_dim}, {dtype}", "errors": dict(zip(names, errs)), "tol": TOLERANCE[dtype]}


def check_ns(n: int, width: int) -> dict:
    """The optimizer's Newton-Schulz kernels, X X^T, c G G + b G and B X + a X on a bf16 stack, vs fp32."""
    from moejax.train import ns_gpu
    from moejax.train.optimizer import NS_COEFFS

    a, b, c = NS_COEFFS
    kx, kb = jax.random.split(jax.random.key(3))
    x = (jax.random.normal(kx, (n, width, width)) / width ** 0.5).astype(jnp.bfloat16)
    g = jnp.einsum("nik,njk->nij", x, x)
    g = jnp.triu(g) + jnp.swapaxes(jnp.triu(g, 1), 1, 2)  # exactly symmetric, as gram_add's G^T reads G's rows
    interp = run_interpreted()
    got = [jax.jit(lambda x: ns_gpu.gram_add(x, None, 1.0, 0.0, interpret=interp))(x),
           jax.jit(lambda g: ns_gpu.gram_add(g, g, c, b, interpret=interp))(g),
           jax.jit(lambda m, x: ns_gpu.matmul_add(m, x, x, 1.0, a, interpret=interp))(g, x)]
    f32 = lambda t: t.astype(jnp.float32)
    ref = [jnp.einsum("nik,njk->nij", f32(x), f32(x), precision=HP),
           c * jnp.einsum("nij,njk->nik", f32(g), f32(g), precision=HP) + b * f32(g),
           jnp.einsum("nij,njk->nik", f32(g), f32(x), precision=HP) + a * f32(x)]
    return {"what": f"Newton-Schulz kernels, {n} x {width} x {width}, bfloat16",
            "errors": {"X X^T": rel_err(got[0], ref[0]), "c G G + b G": rel_err(got[1], ref[1]),
                       "B X + a X": rel_err(got[2], ref[2]),
                       # the next GEMM reads G's rows for G^T's columns: 0 unless the MMA broke the symmetry
                       "X X^T - (X X^T)^T": rel_err(got[0], jnp.swapaxes(got[0], 1, 2))},
            "tol": TOLERANCE["bfloat16"]}


def _check_kept(n_exp: int, expert_A, width: int, dtype: str, rng) -> dict:
    """`check_grouped` for the kept-rows entry: values and gradients against the fp32 reference with the
    skipped rows zeroed; `skipped` is the largest |y| or |dx| on a skipped row (its tolerance: exactly 0)."""
    rows = expert_A.shape[0]
    skip = rng.random(rows) < 0.15
    expert_A = jnp.where(jnp.asarray(skip), n_exp, expert_A)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.normal(size=(rows, width)), dt)
    ws = [jnp.asarray(rng.normal(size=(n_exp, width, width)) / np.sqrt(width), dt) for _ in range(3)]
    ct = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    got = value_and_grads(lambda x, *w: swiglu_kept_rows(x, expert_A, *w), (x, *ws), ct, kernels=2 * 3)
    ref_fn = lambda x, *w: jnp.where(jnp.asarray(skip)[:, None],
                                     0.0, swiglu_reference(x, jnp.minimum(expert_A, n_exp - 1), *w))
    ref = value_and_grads(ref_fn, (x.astype(jnp.float32), *(w.astype(jnp.float32) for w in ws)), ct)
    names = ["y", "dx", "dw_gate", "dw_up", "dw_down"]
    errs = [rel_err(got[0], ref[0])] + [rel_err(a, b) for a, b in zip(got[1], ref[1])]
    on_skipped = max(float(np.abs(np.asarray(a, np.float32)[skip]).max()) for a in (got[0], got[1][0]))
    errs.append(np.inf if on_skipped else 0.0)
    return {"what": f"kept-rows SwiGLU (MOEJAX_EP_GROUPED) E={n_exp}, {rows} rows ({int(skip.sum())} skipped) "
                    f"x {width}, {dtype}", "errors": dict(zip(names + ["skipped"], errs)), "tol": TOLERANCE[dtype]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes, kernels interpreted")
    a = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
          + ("; kernels interpreted (a check of the script)" if run_interpreted() else ""))
    if a.smoke:
        grouped = [(8, 300, 32, "float32"), (8, 300, 32, "bfloat16"), (8, 300, 32, "bfloat16", "gpu_kernel"),
                   (8, 300, 32, "bfloat16", "kept")]
        flash = [(64, 4, 2, 16, 24, 0), (64, 4, 1, 16, None, 0), (64, 4, 1, 16, None, 32)]
        blocks = FlashBlocks(q=16, k=16, q_bwd=16, k_bwd=16)
    else:
        grouped = [(e, 8192, 256, dt) for e in (64, 384) for dt in ("bfloat16", "float32")]
        grouped += [(e, 8192, 256, "bfloat16", "gpu_kernel") for e in (64, 384)]
        grouped += [(6, 8192, 256, "bfloat16", "kept"), (6, 8192, 256, "float32", "kept")]  # the hero's E_loc
        flash = [(1024, 8, 2, 128, 256, 0), (1024, 8, 1, 128, None, 0), (1024, 8, 1, 128, None, 256),
                 (1024, 8, 2, 128, 256, 256)]
        blocks = None  # the kernel's defaults for each dtype (FlashBlocks.for_dtype)
    # Each check is printed as it finishes: the session script runs this under a time limit (`timeout`), and a
    # check cut short must not take the finished ones' lines with it.
    checks = [functools.partial(check_grouped, *g) for g in grouped]
    checks.append(functools.partial(check_ns, *((4, 64) if a.smoke else (64, 512))))
    checks += [functools.partial(check_flash, *f[:5], f[5], dt, blocks) for dt in ("bfloat16", "float32")
               for f in flash]
    failed = 0
    for check in checks:
        r = check()
        ok = max(r["errors"].values()) <= r["tol"]
        failed += not ok
        detail = ", ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
        print(f"{'ok  ' if ok else 'FAIL'} {r['what']}: {detail} (tolerance {r['tol']:.1e})", flush=True)
    print(f"{len(checks) - failed} of {len(checks)} checks within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
