"""Contracts of the MoE and attention fast paths that a mutation audit (model/moe/*, attention.py,
kernel_choice.py, layers.py) found untested: each test below fails on one or more realistic single-line slips
that the rest of the suite let through. Tiny shapes; fp32 references with named tolerances."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.attention import attend_context, block_mask, attend_dense, attend_window, attend_xla, query_head_map
from moejax.model.moe import balance
from moejax.model.moe.experts import routed_local
from moejax.model.moe.grouped import grouped_matmul
from moejax.model.moe.layer import MoE, moe_mix, routed_local_with_stats
from moejax.model.moe.reference import routed_reference
from moejax.model.moe.router import logits_bf16_matmul, router_logits
from tests.helpers import all_eqns, toy_model
from tests.test_attention_fast import ATOL_FP32, RTOL_FP32, SCALE
from tests.test_grouped import BF16_NORMWISE_RTOL
from tests.test_layers import ROUTER_F32_RTOL

# Tolerances from the files that test these paths: the bf16 expert path norm-wise against its fp32 reference
# (test_grouped), the router's fp32 logits against float64 (test_layers), windowed vs dense attention
# (test_attention_fast).


# ---- grouped GEMM / routed experts ---------------------------------------------------------------------

def test_presorted_grouped_matmul_skips_the_sort():
    """`grouped_matmul(..., presorted=True)` passes the flag on: no sort in its jaxpr (the plain call sorts)."""
    expert_A = jnp.asarray(np.repeat(np.arange(4), [3, 0, 5, 2]), jnp.int32)
    x, w = jnp.ones((10, 4)), jnp.ones((4, 4, 6))
    jaxpr = lambda presorted: str(jax.make_jaxpr(lambda x, e, w: grouped_matmul(x, e, w, 8, presorted))(x, expert_A, w))
    assert " sort[" in jaxpr(False)
    assert " sort[" not in jaxpr(True)


def test_routed_local_combines_bf16_expert_outputs_in_fp32():
    """experts.py: both routed paths return the combined latent output in fp32, also for bf16 activations and
    weights (the weighted sum over the K choices is accumulated in fp32, SPEC §3 step 5)."""
    rng = np.random.default_rng(0)
    T, K, E, Z, F = 24, 3, 4, 8, 8
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    z = bf(rng.normal(size=(T, Z)))
    ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
    w = jnp.asarray(rng.uniform(size=(T, K)), jnp.float32)
    wg, wu, wd = (bf(0.4 * rng.normal(size=s)) for s in [(E, Z, F), (E, Z, F), (E, F, Z)])
    mask = jnp.asarray(np.arange(T) < T - 4)
    y = jax.jit(routed_local)(z, ids, w, mask, wg, wu, wd)
    assert y.dtype == jnp.float32
    ref = np.asarray(jax.jit(routed_reference)(z, ids, w, mask, wg, wu, wd))
    assert np.abs(np.asarray(y) - ref).max() / np.abs(ref).max() <= BF16_NORMWISE_RTOL


def test_local_path_stats_follow_the_transport_contract():
    """DropStats of the dropless local path: valid = real tokens * K, all kept, and the padding tokens' K
    assignments in padding_skipped, so that valid + padding_skipped = T * K (as the EP transport's)."""
    T, K, E, Z, F = 12, 2, 4, 4, 4
    ids = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
    mask = jnp.asarray(np.arange(T) < 9)  # 3 padding tokens
    ws = [jnp.ones(s) for s in [(E, Z, F), (E, Z, F), (E, F, Z)]]
    _, st = jax.jit(routed_local_with_stats)(jnp.ones((T, Z)), ids, jnp.ones((T, K)), mask, *ws)
    assert int(st.valid) == int(st.kept) == 9 * K
    assert int(st.sender_dropped) == int(st.receiver_dropped) == 0
    assert int(st.padding_skipped) == 3 * K
    assert int(st.valid) + int(st.padding_skipped) == T * K


def test_moe_block_masks_padding_tokens_out_of_routing_and_its_stats():
    """moe_mix: padding (segment id 0) is no token: it is out of the token mask that QB and the router stats
    read, its routed output is zero (only the shared experts act on it), and the load counts real tokens only."""
    cfg = toy_model()
    p = MoE.init(cfg, jax.random.key(1))
    m = jax.random.normal(jax.random.key(2), (2, 8, cfg.d_model))
    seg = jnp.asarray([[1] * 5 + [0] * 3, [1] * 3 + [2] * 5], jnp.int32)
    mix = jax.jit(moe_mix, static_argnums=3)
    _, stats = mix(p, m, seg, cfg)
    np.testing.assert_array_equal(stats["token_mask"], np.asarray(seg).reshape(-1) > 0)
    assert float(jnp.sum(stats["load"])) == 13 * cfg.top_k
    assert int(stats["valid"]) == 13 * cfg.top_k and int(stats["padding_skipped"]) == 3 * cfg.top_k
    # no routed output on padding: with the shared experts removed, padding rows are exactly zero
    p0 = replace(p, shared_gate=p.shared_gate[:0], shared_up=p.shared_up[:0], shared_down=p.shared_down[:0])
    y0, _ = mix(p0, m, seg, replace(cfg, n_shared=0))
    assert np.all(np.asarray(y0[0, 5:]) == 0.0) and np.abs(np.asarray(y0[0, :5])).max() > 0


# ---- router --------------------------------------------------------------------------------------------

def test_router_fp32_logits_ask_for_full_precision():
    """The fp32 router matmul (CPUs, and fp32 activations on GPUs) requests Precision.HIGHEST explicitly: under
    a lower default matmul precision a GPU would otherwise run it in TF32 (SPEC §2: router logits in fp32)."""
    m, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with jax.default_matmul_precision("default"):
        eqns = [e for e in all_eqns(jax.make_jaxpr(router_logits)(m, w).jaxpr) if e.primitive.name == "dot_general"]
    assert eqns
    for e in eqns:
        assert e.params["precision"] is not None and all(
            p == jax.lax.Precision.HIGHEST for p in e.params["precision"]), e.params["precision"]


def test_router_bf16_matmul_rounds_a_wider_weight_to_bf16():
    """`logits_bf16_matmul` takes W rounded to bf16 (as the model reads every other weight): with a W of full
    fp32 values its logits are m @ bf16(W) to fp32 accuracy, not m @ W."""
    rng = np.random.default_rng(5)
    m = jnp.asarray(rng.normal(size=(16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(32, 6)), jnp.float32)
    assert not np.array_equal(np.asarray(w), np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32)))
    want = np.asarray(m, np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
    got = np.asarray(jax.jit(logits_bf16_matmul)(m, w), np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() <= ROUTER_F32_RTOL


# ---- quantile balancing --------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [0, 4])
def test_qb_refuses_a_top_k_outside_one_to_e_minus_one(top_k):
    """top_k = E leaves no (K+1)-th logit (no threshold); the balancing share must be refused, not computed."""
    mu, mask = jnp.zeros((8, 4)), jnp.ones(8, bool)
    for fn in (balance.qb_threshold, balance.qb_threshold_exact):
        with pytest.raises(ValueError, match="top_k"):
            fn(mu, mask, top_k=top_k)


def test_qb_exact_bias_of_an_all_padding_batch_is_zero():
    """No valid token: both biases are 0 (not NaN from the -inf of an empty sort)."""
    mu = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)
    mask = jnp.zeros(16, bool)
    for fn in (balance.qb_bias, balance.qb_bias_exact):
        np.testing.assert_array_equal(np.asarray(jax.jit(fn, static_argnames="top_k")(mu, mask, top_k=1)), np.zeros(4))


def test_qb_exact_threshold_is_the_ceil_n_th_largest_margin_for_a_fractional_share():
    """n = T_valid K / E = 2.5 here: beta_e is the ceil(n) = 3rd largest valid margin (2 lie strictly above,
    <= n <= 3 at or above), from a float64 sort of the valid rows."""
    rng = np.random.default_rng(2)
    mu = rng.normal(size=(12, 4)).astype(np.float32)
    mask = np.arange(12) < 10  # T_valid = 10, K = 1, E = 4
    got = np.asarray(balance.qb_threshold_exact(jnp.asarray(mu), jnp.asarray(mask), top_k=1))
    want = -np.sort(-mu[mask], axis=0)[2]
    np.testing.assert_array_equal(got, want)


# ---- attention -----------------------------------------------------------------------------------------

def test_window_path_with_a_row_starting_in_padding_equals_dense():
    """attend_window's front padding (window - 1 keys before position 0) has segment id -1 and must match
    nothing, not a row's leading padding (segment 0): a row that starts with padding still gives the dense
    core's values (as tests/test_attention_fast.py checks for the band)."""
    seg = jnp.asarray([[0] * 3 + [1] * 9 + [2] * 4, [3] * 16], jnp.int32)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 2, 8)) for key in (kq, kk, kv))
    want = jax.jit(lambda q, k, v: attend_dense(q, k, v, seg, 5, SCALE))(q, k, v)
    got = jax.jit(lambda q, k, v: attend_window(q, k, v, seg, 5, SCALE, 4))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=RTOL_FP32, atol=ATOL_FP32)


@pytest.mark.parametrize("window,qb,context", [(6, 0, 2), (6, 4, 2), (None, 0, 2), (None, 4, 2), (11, 0, 4)],
                         ids=["local-dense", "local-qblocks", "global-dense", "global-qblocks", "local-3hops"])
def test_context_chunks_equal_the_whole_sequence(window, qb, context):
    """attend_context on a sequence cut into `context` chunks (rows) gives the whole sequence's dense values.
    One document spans every chunk, so each chunk's first queries read the farthest key their window allows
    (window - 1 back, across the boundary: the halo's oldest key), and global layers every earlier chunk, also
    in query blocks (attn_q_block 4 < chunk 8: the queries sit after the earlier chunks' keys)."""
    seq, h, g, hd = 16, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (1, seq, h, hd))
    k, v = (jax.random.normal(key, (1, seq, g, hd)) for key in (kk, kv))
    seg = jnp.asarray([[1] * 13 + [2] * 3], jnp.int32)
    head_map = query_head_map(h, g)
    want = attend_dense(q, k[:, :, head_map], v[:, :, head_map], seg, window, SCALE)
    chunks = lambda a: a.reshape(context, seq // context, *a.shape[2:])
    core = jax.jit(lambda q, k, v, s: attend_context(q, k, v, s, window, SCALE, qb, context, head_map))
    got = core(chunks(q), chunks(k), chunks(v), chunks(seg))
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=RTOL_FP32, atol=ATOL_FP32)


def test_attention_cores_return_fp32_for_bf16_inputs():
    """The XLA attention cores give fp32 outputs (the caller's XSA and head gate run on them in fp32, as the
    kernel's): bf16 q/k/v in, fp32 out, on the dense, band and window paths."""
    seg = jnp.ones((1, 16), jnp.int32)
    q = jax.random.normal(jax.random.key(4), (1, 16, 2, 8)).astype(jnp.bfloat16)
    for window, qb in ((None, 0), (4, 0), (4, 4)):  # dense, band (16 = 4 windows), window path
        out = jax.eval_shape(lambda q: attend_xla(q, q, q, seg, window, SCALE, qb), q)
        assert out.dtype == jnp.float32, (window, qb)


def test_block_mask_never_admits_a_negative_key_position():
    """block_mask: a key at a negative position (an empty decode-cache slot, front padding) is no key, even
    when its segment id matches (callers also give such keys a non-matching id; the mask must not rely on it)."""
    seg = jnp.ones((1, 3), jnp.int32)
    mask = np.asarray(block_mask(seg, seg, jnp.asarray([0, 1, 2]), jnp.asarray([-1, 0, 1]), None))[0]
    np.testing.assert_array_equal(mask, [[False, True, False], [False, True, True], [False, True, True]])
