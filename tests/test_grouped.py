"""The blocked grouped GEMM (moejax.model.moe.grouped) equals fp32 references: values and all gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.kernel_choice import chosen
from moejax.model.moe.experts import routed_local
from moejax.model.moe.grouped import default_block, grouped_matmul, grouped_swiglu, make_layout
from moejax.model.moe.reference import routed_reference

RTOL_FP32 = 1e-5
ATOL_FP32 = 1e-5
# bf16 inputs and weights against the fp32 reference on the same (bf16-rounded) values, per tensor:
# max |got - ref| <= BF16_NORMWISE_RTOL * max |ref|. A rounded dot's error is bounded by its terms' sizes
# (sum |a_i b_i|), not by its result, so an element that cancels to near 0 can carry a large relative error:
# the element-wise form (rtol = atol = 3e-2) failed one element of 480 on seed 2 of 0-7. The chain rounds to
# bf16 (unit roundoff u = 2^-8 = 3.9e-3) at the gate/up outputs, h and the down output (and as often
# backward): seeds 0-7 measure at most 9.1e-3 (2.3 u) with XLA's excess precision on or off. 2e-2 is ~5 u.
BF16_NORMWISE_RTOL = 2e-2
# No excess precision: XLA may otherwise keep a bf16 intermediate in fp32 inside one jit, as no GPU does.
NO_EXCESS_PRECISION = {"xla_allow_excess_precision": False}
HP = jax.lax.Precision.HIGHEST


def per_row_reference(x_AZ, expert_A, wg, wu, wd):
    """fp32 SwiGLU of each row with its own expert's weights, gathered per row: [A, Z, F] weights, exact."""
    f32 = lambda a: a.astype(jnp.float32)
    x, wg, wu, wd = f32(x_AZ), f32(wg)[expert_A], f32(wu)[expert_A], f32(wd)[expert_A]
    h = jax.nn.silu(jnp.einsum("az,azf->af", x, wg, precision=HP)) * jnp.einsum("az,azf->af", x, wu, precision=HP)
    return jnp.einsum("af,afz->az", h, wd, precision=HP)


def _problem(seed, sizes, Z=6, F=10, dtype=jnp.float32):
    """Rows of len(sizes) experts in shuffled order; sizes[e] rows choose expert e."""
    rng = np.random.default_rng(seed)
    expert_A = jnp.asarray(rng.permutation(np.repeat(np.arange(len(sizes)), sizes)), jnp.int32)
    a, e = int(np.sum(sizes)), len(sizes)
    x = jnp.asarray(rng.normal(size=(a, Z)), dtype)
    ws = [jnp.asarray(0.4 * rng.normal(size=s), dtype) for s in [(e, Z, F), (e, Z, F), (e, F, Z)]]
    ct = jnp.asarray(rng.normal(size=(a, Z)), jnp.float32)
    return x, expert_A, ws, ct


def _value_and_grads(fn, x, expert_A, ws, ct):
    loss = lambda x, *w: jnp.sum(fn(x, expert_A, *w).astype(jnp.float32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, *ws)


def _assert_matches_reference(x, expert_A, ws, ct, block, rtol, atol):
    y = jax.jit(grouped_swiglu, static_argnames="block_size")(x, expert_A, *ws, block_size=block)
    y_ref = jax.jit(per_row_reference)(x, expert_A, *ws)
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, rtol=rtol, atol=atol, err_msg="forward")
    (_, g), (_, g_ref) = (_value_and_grads(f, x, expert_A, ws, ct) for f in
                          (lambda *a: grouped_swiglu(*a, block_size=block), per_row_reference))
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], g, g_ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=rtol, atol=atol, err_msg=f"grad {name}")


UNALIGNED = [5, 0, 13, 1, 29, 0, 6, 17]  # empty experts, odd sizes, one group longer than a block


@pytest.mark.parametrize("block", [8, 16, None], ids=["b8", "b16", "default"])
def test_unaligned_groups_with_empty_experts(block):
    _assert_matches_reference(*_problem(0, UNALIGNED), block, RTOL_FP32, ATOL_FP32)


def test_all_rows_in_one_expert():
    _assert_matches_reference(*_problem(1, [0, 0, 37, 0]), 8, RTOL_FP32, ATOL_FP32)


def test_384_experts_tiny_widths():
    sizes = np.random.default_rng(2).multinomial(700, np.full(384, 1 / 384))  # many empty, a few > 4
    assert (sizes == 0).any() and sizes.max() > 4
    _assert_matches_reference(*_problem(2, sizes, Z=4, F=6), None, RTOL_FP32, ATOL_FP32)


@pytest.mark.parametrize("seed", [2, 3])  # 2 failed the element-wise form, 3 failed it without excess precision
def test_bf16_close_to_fp32_reference(seed):
    x, expert_A, ws, ct = _problem(seed, UNALIGNED, dtype=jnp.bfloat16)
    fn = lambda *a: grouped_swiglu(*a, block_size=8)
    y = jax.jit(fn, compiler_options=NO_EXCESS_PRECISION)(x, expert_A, *ws)
    assert y.dtype == jnp.bfloat16
    loss = lambda x, *w: jnp.sum(fn(x, expert_A, *w).astype(jnp.float32) * ct)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), compiler_options=NO_EXCESS_PRECISION)(x, *ws)
    y_ref = jax.jit(per_row_reference)(x, expert_A, *ws)
    grads_ref = _value_and_grads(per_row_reference, x, expert_A, ws, ct)[1]
    for name, got, ref in zip(["forward", "x", "w_gate", "w_up", "w_down"], (y, *grads), (y_ref, *grads_ref)):
        err = np.abs(np.asarray(got, np.float32) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
        assert err <= BF16_NORMWISE_RTOL, f"{name}: max error / max |ref| = {err:.2e}"


# Max |dw - dw_ref| / max |dw_ref| of bf16 weight gradients summed over ~250 blocks of one expert, against the
# fp32 reference on the same bf16 values. Rounding the fp32 inputs to bf16 alone moves these gradients by
# 0.26-0.77% (seeds 0-5); the kernel, which keeps its per-block partials in fp32, measures 0.25-0.48% (seed 0:
# 0.28-0.40%). Partials rounded to bf16 and summed in bf16 measured 1.8-5.8%, the worst of the three gradients
# >= 2.9% on every seed (seed 0: 2.6-5.8%). 1.5e-2 is twice what input rounding alone gives.
DW_RTOL_BF16_MANY_BLOCKS = 1.5e-2


def test_bf16_weight_gradients_sum_many_blocks_in_fp32():
    # 2003 rows of one expert in blocks of 8: each dw sums 251 per-block partials.
    x, expert_A, ws, ct = _problem(0, [2003, 1, 997], Z=16, F=16, dtype=jnp.bfloat16)
    loss = lambda x, *w: jnp.sum(grouped_swiglu(x, expert_A, *w, block_size=8).astype(jnp.float32) * ct)
    loss_ref = lambda x, *w: jnp.sum(per_row_reference(x, expert_A, *w) * ct)
    grads = jax.jit(jax.grad(loss, argnums=(1, 2, 3)))(x, *ws)
    f32 = [a.astype(jnp.float32) for a in (x, *ws)]
    grads_ref = jax.jit(jax.grad(loss_ref, argnums=(1, 2, 3)))(*f32)
    for name, g, g_ref in zip(["w_gate", "w_up", "w_down"], grads, grads_ref):
        assert g.dtype == jnp.bfloat16
        err = np.abs(np.asarray(g, np.float32) - g_ref).max() / np.abs(g_ref).max()
        assert err <= DW_RTOL_BF16_MANY_BLOCKS, f"grad {name}: relative error {err:.2e}"


def test_equals_ragged_dot_and_per_group_loop():
    """Rows sorted by expert: the same numbers as the old `jax.lax.ragged_dot` path and a per-group fp32 loop."""
    sizes = np.array([0, 13, 1, 29, 6])
    x, _, ws, ct = _problem(4, sizes)
    expert_A = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)
    groups_E = jnp.asarray(sizes, jnp.int32)

    def ragged(x, e, wg, wu, wd):
        h = jax.nn.silu(jax.lax.ragged_dot(x, wg, groups_E, precision=HP)) * jax.lax.ragged_dot(x, wu, groups_E, precision=HP)
        return jax.lax.ragged_dot(h, wd, groups_E, precision=HP)

    def per_group(x, e, wg, wu, wd):
        outs, start = [], 0
        for g, n in enumerate(sizes):
            xs = x[start:start + n]
            outs.append((jax.nn.silu(xs @ wg[g]) * (xs @ wu[g])) @ wd[g])
            start += n
        return jnp.concatenate(outs)

    v, g = _value_and_grads(lambda *a: grouped_swiglu(*a, block_size=8), x, expert_A, ws, ct)
    for ref in (ragged, per_group):
        v_ref, g_ref = _value_and_grads(ref, x, expert_A, ws, ct)
        np.testing.assert_allclose(v, v_ref, rtol=RTOL_FP32, atol=ATOL_FP32)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32)


MODES = [("xla", "xla"), ("gpu_kernel", "xla"), ("gpu_kernel", "gpu_kernel")]  # MOEJAX_GROUPED, _ROWS


@pytest.mark.parametrize("grouped,rows", MODES, ids=["xla", "kernels", "rows_in_kernels"])
def test_no_rows_give_empty_results_and_zero_weight_gradients(grouped, rows):
    """A = 0 (as `jax.lax.ragged_dot` takes): [0, F] out, zero weight gradients, on every path. It was an
    error from gathering out of an empty axis."""
    x, e = jnp.zeros((0, 16)), jnp.zeros((0,), jnp.int32)
    ws = [jnp.ones((3, 16, 32)), jnp.ones((3, 16, 32)), jnp.ones((3, 32, 16))]
    with chosen("MOEJAX_GROUPED", grouped), chosen("MOEJAX_GROUPED_ROWS", rows):
        assert grouped_matmul(x, e, ws[0], 16).shape == (0, 32) and grouped_swiglu(x, e, *ws, 16).shape == (0, 16)
        gx, gw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, e, w, 16)), (0, 1))(x, ws[0])
        g = jax.grad(lambda x, ws: jnp.sum(grouped_swiglu(x, e, *ws, 16)), (0, 1))(x, ws)
    assert gx.shape == (0, 16) and not jnp.any(gw)
    assert g[0].shape == (0, 16) and not any(jnp.any(a) for a in g[1])


def test_bf16_rows_with_fp32_weights_get_a_bf16_gradient_on_the_xla_path():
    """dx in x's dtype, as plain autodiff and the kernels give it (the XLA backward returned fp32)."""
    x = jax.random.normal(jax.random.key(0), (20, 32)).astype(jnp.bfloat16)
    e = jax.random.randint(jax.random.key(1), (20,), 0, 4)
    w = jax.random.normal(jax.random.key(2), (4, 32, 48))
    with chosen("MOEJAX_GROUPED", "xla"):
        gx, gw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, e, w, 16)), argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32


def test_layout_blocks_are_single_expert_and_bounded():
    sizes = np.array(UNALIGNED)
    _, expert_A, _, _ = _problem(5, sizes)
    b, n_exp = 8, len(sizes)
    layout = make_layout(expert_A, n_exp, b)
    assert layout.block == b and layout.n_blocks == (sizes.sum() + n_exp * (b - 1)) // b
    row_P, slot_A, expert_N = map(np.asarray, (layout.row_Pd, layout.slot_A, layout.expert_Bk))
    assert np.all(row_P[slot_A] == np.arange(sizes.sum())), "slot and row are inverse maps"
    real_P = row_P < sizes.sum()
    assert real_P.sum() == sizes.sum()
    block_of_row = np.arange(row_P.size) // b
    assert np.all(expert_N[block_of_row[real_P]] == np.asarray(expert_A)[row_P[real_P]]), "row in a foreign block"
    assert np.all(np.diff(expert_N) >= 0), "blocks sorted by expert (segment_sum relies on it)"
    used = np.unique(block_of_row[real_P]).size
    assert used == np.sum(-(-sizes // b)), "each expert gets exactly ceil(n_e / b) blocks"
    np.testing.assert_array_equal(layout.blocks_E, -(-sizes // b))
    assert np.all(block_of_row[real_P] < used), "the used blocks come first, the static tail after them"


def test_presorted_layout_skips_the_sort_and_equals_the_sorted_one():
    """Rows already in expert order (ragged_dot's input): `presorted` gives the layout the sort would give,
    field by field, and `grouped_matmul` the same values."""
    _, expert_A, _, _ = _problem(6, UNALIGNED)
    expert_A = jnp.sort(expert_A)
    want, got = make_layout(expert_A, len(UNALIGNED), 8), make_layout(expert_A, len(UNALIGNED), 8, presorted=True)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
    assert " sort[" not in str(jax.make_jaxpr(lambda e: make_layout(e, len(UNALIGNED), 8, presorted=True))(expert_A))
    assert " sort[" in str(jax.make_jaxpr(lambda e: make_layout(e, len(UNALIGNED), 8))(expert_A))
    x = jax.random.normal(jax.random.key(0), (expert_A.shape[0], 6))
    w = jax.random.normal(jax.random.key(1), (len(UNALIGNED), 6, 10))
    np.testing.assert_array_equal(grouped_matmul(x, expert_A, w, 8, presorted=True), grouped_matmul(x, expert_A, w, 8))


def test_default_block_shrinks_for_small_inputs():
    assert default_block(16384, 32) == 128
    assert default_block(16384, 128) == 64
    assert default_block(700, 384) == 8


@pytest.mark.parametrize("n_exp,k,one_expert", [(64, 4, False), (6, 2, True)], ids=["E64", "all_in_one"])
def test_routed_local_equals_dense_reference(n_exp, k, one_expert):
    T, Z, F = 40, 8, 12
    rng = np.random.default_rng(n_exp)  # numpy inputs: eager jax.random ops would each compile
    z = jnp.asarray(rng.normal(size=(T, Z)), jnp.float32)
    # one_expert: every token's top-k picks expert 3 (K copies of it), the worst-case skew
    ids = jnp.asarray(np.full((T, k), 3) if one_expert else rng.integers(0, n_exp, (T, k)), jnp.int32)
    w = jnp.asarray(rng.uniform(size=(T, k)), jnp.float32)
    wg, wu = (jnp.asarray(0.3 * rng.normal(size=(n_exp, Z, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(0.3 * rng.normal(size=(n_exp, F, Z)), jnp.float32)
    mask = jnp.asarray(np.arange(T) < T - 5)
    ct = jnp.asarray(np.cos(np.arange(T * Z)).reshape(T, Z), jnp.float32)

    def vg(fn):
        loss = lambda z, w, *ws: jnp.sum(fn(z, ids, w, mask, *ws) * ct)
        return jax.jit(jax.value_and_grad(loss, argnums=range(5)))(z, w, wg, wu, wd)

    (v, g), (v_ref, g_ref) = vg(routed_local), vg(routed_reference)
    np.testing.assert_allclose(v, v_ref, rtol=RTOL_FP32, atol=ATOL_FP32)
    for name, a, b in zip(["z", "weight", "w_gate", "w_up", "w_down"], g, g_ref):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"grad {name}")
