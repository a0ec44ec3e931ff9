"""Tests added by a mutation audit of the Pallas GPU kernels (grouped GEMM, flash attention, Newton-Schulz),
run by the Pallas interpreter on CPU. Each test kills a mutant that the existing kernel tests let through,
against an independent reference (plain XLA in fp32 or numpy):
- flash `document_bounds` with segment ids that are not ascending inside a block (padding id 0 after the last
  document, documents numbered downwards): the bounds must still cover every block holding a live pair;
- the flash kernel's dtypes: fp32 output for bf16 q/k/v, gradients in the inputs' dtypes;
- the grouped SwiGLU's weight gradients in the (bf16) weights' dtype on the kernel path;
- `ns_gpu.matmul_add`'s result in c's dtype when a/b are bf16 and c is fp32;
- the row-mapped kernels' scattered stores carry their mask (in the kernel's jaxpr: the interpreter drops the
  padding lanes' out-of-range writes either way, a GPU would write them past the output)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.flash_gpu import FlashBlocks, document_bounds, flash_attention
from moejax.model.kernel_choice import GROUPED, GROUPED_ROWS, chosen
from moejax.model.moe import grouped_gpu
from moejax.model.moe.grouped import grouped_swiglu, make_layout, row_maps
from moejax.train import ns_gpu
from tests.test_attention_fast import SCALE
from tests.test_grouped import UNALIGNED, _problem, per_row_reference
from tests.test_grouped_gpu import RTOL_BF16_NORM

# fp32 kernel against the fp32 dense reference: same math, different summation order (as test_attention_fast).
RTOL_FP32 = 1e-5
ATOL_FP32 = 2e-6
# bf16 operands against an fp32 reference on the same bf16-rounded values, relative Frobenius norm: the kernels
# round to bf16 a few times in a chain (attention: p before p @ v, dS before its dots; the grouped SwiGLU:
# gate/up, activation, down and their backward), each at most one unit roundoff 2^-8: test_grouped_gpu's four.

# Segment ids per key (S = 24), not ascending inside a block: row 0 is padded with id 0 from key 12 on
# (the padding starts mid query block of 8 and fills the key block of 4 at keys 12-15); row 1 numbers its
# documents downwards (3, 2, 1: the first query block holds ids 3 and 2, and keys 4-7 are all id 2).
SEG_UNSORTED = np.asarray([[1] * 5 + [2] * 7 + [0] * 12, [3] * 4 + [2] * 12 + [1] * 8], np.int32)
# Backward query blocks of 8 over key blocks of 4: a key block can lie wholly inside a query block.
BLOCKS = FlashBlocks(q=8, k=4, q_bwd=8, k_bwd=4)


def _dense_attention(q, k, v, seg, scale):
    """softmax(scale q k^T + causal & same-segment mask) v, fp32, K/V heads repeated per query head
    (query head h reads KV head h // (H/G)); plain XLA, written here independently of moejax.model.attention."""
    h, g = q.shape[2], k.shape[2]
    heads = np.arange(h) // (h // g)
    k, v = k[:, :, heads].astype(jnp.float32), v[:, :, heads].astype(jnp.float32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") * scale
    pos = np.arange(q.shape[1])
    mask = (pos[:, None] >= pos[None, :])[None] & (seg[:, :, None] == seg[:, None, :])  # [B, Q, K]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def _value_and_grads(f, q, k, v):
    """A non-trivial scalar of f's output and its gradients wrt q, k and v."""
    w = jax.random.normal(jax.random.key(7), q.shape)
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w), argnums=(0, 1, 2)))(q, k, v)


def _qkv(h, g, dtype, seed=3):
    b, s = SEG_UNSORTED.shape
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (b, s, n, 8)).astype(dtype) for key, n in ((kq, h), (kk, g), (kv, g)))


def test_document_bounds_cover_every_live_block_whatever_the_ids_order():
    """`document_bounds` claims exactness "whatever the ids' order": against a numpy brute force over every
    (query, key) pair, each query block's first key block is at or before its first live key block, and each
    key block's [first_q, end_q) holds every query block with a live pair in it. Kills a block's id range
    taken from its first (or last) row instead of its min (max): with padding id 0 after a document, or
    documents numbered downwards, a key block wholly inside a query block was dropped from its range."""
    seg = SEG_UNSORTED
    rows, s = seg.shape
    for bq, bk in ((8, 4), (4, 4), (8, 8), (4, 8)):
        first_k, first_q, end_q = (np.asarray(a).reshape(rows, -1) for a in document_bounds(jnp.asarray(seg), s, bq, bk))
        pos = np.arange(s)
        for r in range(rows):
            live = (pos[:, None] >= pos[None, :]) & (seg[r][:, None] == seg[r][None, :])  # [S, S] pairs
            live = live.reshape(s // bq, bq, s // bk, bk).any(axis=(1, 3))  # [query block, key block]
            for i in range(s // bq):
                assert first_k[r, i] <= np.flatnonzero(live[i]).min(), (bq, bk, r, i)  # the diagonal is live
            for j in range(s // bk):
                need = np.flatnonzero(live[:, j])
                if need.size:
                    assert first_q[r, j] <= need.min() and end_q[r, j] > need.max(), (bq, bk, r, j, need)


@pytest.mark.parametrize("h,g", [(2, 1), (4, 2)], ids=["gqa2on1", "gqa4on2"])
def test_flash_kernel_with_unsorted_segment_ids_equals_dense(h, g):
    """The kernel (interpreted) on SEG_UNSORTED against the dense fp32 reference: values and q/k/v gradients.
    The dK/dV kernel loops over [first_q, end_q) of `document_bounds`; a bound from a block's first row
    skipped the query block that holds the padding's (or the lower-numbered document's) first queries."""
    q, k, v = _qkv(h, g, jnp.float32)
    seg = jnp.asarray(SEG_UNSORTED)
    dense = lambda q, k, v: _dense_attention(q, k, v, seg, SCALE)
    flash = lambda q, k, v: flash_attention(q, k, v, seg, SCALE, None, BLOCKS, True)
    # The outputs element by element (not the scalar below: a sum of ~1,500 terms, whose fp32 rounding
    # relative to its own small value is no measure of the kernel's).
    np.testing.assert_allclose(jax.jit(flash)(q, k, v), dense(q, k, v), rtol=RTOL_FP32, atol=ATOL_FP32)
    want, got = _value_and_grads(dense, q, k, v), _value_and_grads(flash, q, k, v)
    for a, b, name in zip(got[1], want[1], "qkv"):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"d{name}")


def test_flash_kernel_bf16_inputs_give_fp32_output_and_gradients_in_the_inputs_dtype():
    """bf16 q/k/v: the output is fp32 (the XLA path's dtype, documented in flash_gpu) and dq/dk/dv are bf16
    (a bf16 parameter's gradient stays bf16); values within four bf16 roundings of the fp32 dense reference
    on the same bf16 values. Kills the forward written in q's dtype and dk/dv written in fp32."""
    q, k, v = _qkv(4, 2, jnp.bfloat16)
    seg = jnp.asarray(SEG_UNSORTED)
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, seg, SCALE, None, BLOCKS, True))(q, k, v)
    assert out.dtype == jnp.float32
    got = _value_and_grads(lambda q, k, v: flash_attention(q, k, v, seg, SCALE, None, BLOCKS, True), q, k, v)
    want = _value_and_grads(lambda q, k, v: _dense_attention(q, k, v, seg, SCALE), q, k, v)
    assert [a.dtype for a in got[1]] == [jnp.bfloat16] * 3, [a.dtype for a in got[1]]
    ref = np.asarray(_dense_attention(q, k, v, seg, SCALE))
    assert np.linalg.norm(np.asarray(out) - ref) <= RTOL_BF16_NORM * np.linalg.norm(ref)
    for a, b, name in zip(got[1], want[1], "qkv"):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= RTOL_BF16_NORM * np.linalg.norm(b), f"d{name}"


@pytest.mark.parametrize("rows", ["xla", "gpu_kernel"], ids=["xla_gathers", "rows_in_kernels"])
def test_grouped_swiglu_bf16_weight_gradients_keep_the_weights_dtype(rows):
    """On the grouped kernels, bf16 weights get bf16 gradients (the dw kernels write the weights' dtype: no
    [E, Z, F] fp32 array), close in norm to the fp32 per-row reference on the same bf16 values. Kills the
    down projection's dw (`_swiglu_down_to_bwd`) written in fp32: JAX passes a custom_vjp's fp32 cotangent
    for a bf16 primal through, and the value-only bf16 test did not look at the dtype."""
    x, expert_A, ws, ct = _problem(3, UNALIGNED, Z=32, F=32, dtype=jnp.bfloat16)
    loss = lambda f: lambda x, *w: jnp.sum(f(x, *w).astype(jnp.float32) * ct)
    with chosen(GROUPED[0], "gpu_kernel"), chosen(GROUPED_ROWS[0], rows):
        got = jax.jit(jax.grad(loss(lambda x, *w: grouped_swiglu(x, expert_A, *w, block_size=16)),
                               argnums=(0, 1, 2, 3)))(x, *ws)
    want = jax.grad(loss(lambda x, *w: per_row_reference(x, expert_A, *w)), argnums=(0, 1, 2, 3))(x, *ws)
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], got, want):
        assert a.dtype == jnp.bfloat16, (name, a.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= RTOL_BF16_NORM * np.linalg.norm(b), name


def test_matmul_add_result_in_c_dtype():
    """`ns_gpu.matmul_add` documents its result "in c's dtype": bf16 a, b with an fp32 c give fp32, the
    fp32-accumulated product plus c not rounded to bf16 (bf16 products of bf16 values are exact in fp32, so
    only the summation order differs from the float64 reference). Kills the output typed as a's."""
    ka, kb, kc = jax.random.split(jax.random.key(12), 3)
    a = jax.random.normal(ka, (2, 32, 48)).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (2, 48, 16)).astype(jnp.bfloat16)
    c = jax.random.normal(kc, (2, 32, 16), jnp.float32)
    tiles = ns_gpu.NsTiles(bm=16, bp=16, bk=16)  # several tiles and contraction chunks
    out = jax.jit(lambda a, b, c: ns_gpu.matmul_add(a, b, c, -4.775, 2.0315, tiles, interpret=True))(a, b, c)
    f64 = lambda t: np.asarray(t, np.float64)
    ref = -4.775 * np.einsum("nmk,nkp->nmp", f64(a), f64(b)) + 2.0315 * f64(c)
    assert out.dtype == jnp.float32
    # fp32 rounding of sums of 48 terms: a few fp32 ulps of the largest term (|ref| up to ~40), far below
    # one bf16 rounding (2^-8 relative) that the mutant adds.
    np.testing.assert_allclose(f64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _kernel_stores(closed_jaxpr):
    """(ref, indexers, value, mask) of every store (`swap` / `masked_swap`) in the Pallas kernels under a jaxpr."""
    stores = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("swap", "masked_swap"):
                stores.append(jax.tree_util.tree_unflatten(eqn.params["args_tree"], eqn.invars))
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    walk(inner)
    walk(closed_jaxpr.jaxpr)
    return stores


def test_row_mapped_stores_are_masked():
    """A kernel writing its result through a row map points the padding rows (-1 in the map) at row n_out,
    one past the output, and masks them off. The Pallas interpreter drops an out-of-range scatter, so values
    can't show a lost mask (a mutant without it passed every value test); on a GPU it would write past the
    output. So: every scattered store (array row indices) in the forward and dx kernels with rows_out carries
    a mask."""
    x, expert_A, (w, _, _), _ = _problem(7, UNALIGNED, Z=32, F=48)
    layout = make_layout(expert_A, len(UNALIGNED), 16)
    src, dst = row_maps(layout)
    n, e, c = x.shape[0], layout.expert_Bk, layout.blocks_E
    dy = jnp.zeros((n, 48))
    for name, f, args in (("forward", grouped_gpu.matmul, (x, w, e, c)), ("dx", grouped_gpu.matmul_dx, (dy, w, e, c))):
        rows_in = src if name == "forward" else dst
        jaxpr = jax.make_jaxpr(lambda *a: f(*a, rows_in=rows_in, rows_out=dst, n_out=n, interpret=True))(*args)
        scattered = [st for st in _kernel_stores(jaxpr)
                     if any(not isinstance(i, slice) and getattr(i, "aval", None) is not None and i.aval.ndim > 0
                            for ix in st[1] for i in ix.indices)]
        assert scattered, f"{name}: no scattered store found (the test would pass vacuously)"
        assert all(st[3] is not None for st in scattered), f"{name}: a row-mapped store without its mask"
