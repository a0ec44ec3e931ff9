"""SConv (causal, document-local, identity at init), GatedNorm formula, router combine weights, loss, router
metrics."""

import contextlib
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model import kernel_choice
from moejax.model.layers import (Norm, init_conv, matmul_tokens, rms_norm, rms_normalize, scale_channels, sconv,
                                 shared_swiglu, swiglu, swiglu_act)
from moejax.model.moe.router import logits_bf16_matmul, route, router_logits
from moejax.model.transformer import (CPU_HEAD_CHUNK, MIN_HEAD_CHUNKS, Transformer, chunked_lse, head_chunk, lm_loss,
                                     lse_reference)
from moejax.presets import TINY
from moejax.train.optimizer import make_optimizer
from moejax.train.state import compute_copy, differentiated_copy, init_state
from moejax.train.step import make_train_step, moe_metrics
from tests.helpers import all_eqns, toy_batch, toy_model

FP32_ATOL = 1e-5
FP32_RTOL = 1e-5


def test_sconv_matches_naive_and_respects_documents():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 3)).astype(np.float32)
    taps = rng.normal(size=(4, 3)).astype(np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    got = np.asarray(sconv(jnp.asarray(x), jnp.asarray(taps), jnp.asarray(seg)))
    want = np.zeros_like(x)
    for b in range(2):
        for t in range(9):
            for j in range(4):
                if t - j >= 0 and seg[b, t - j] == seg[b, t]:
                    want[b, t] += taps[j] * x[b, t - j]
    np.testing.assert_allclose(got, want, atol=FP32_ATOL)


# scale_channels sums its weight gradient over tokens as a dot with ones, autodiff as a reduce: fp32 order.
CHANNEL_SUM_RTOL = 1e-5
CHANNEL_SUM_ATOL = 1e-5


def test_scale_channels_equals_the_broadcast_product_in_value_and_gradients():
    """`scale_channels` (norm gains, SConv taps): x * w and its (x, w) gradients as autodiff gives them for
    the plain product, fp32 and bf16 activations (the weight stays fp32; its gradient is an fp32 sum)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 50, 7)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7,)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(3, 50, 7)), jnp.float32)
    for dt in (jnp.float32, jnp.bfloat16):
        run = lambda f: jax.value_and_grad(lambda x, w: jnp.sum(f(x.astype(dt), w).astype(jnp.float32) * probe),
                                           argnums=(0, 1))(x, w)
        (v_ref, (dx_ref, dw_ref)), (v, (dx, dw)) = run(lambda x, w: x * w.astype(x.dtype)), run(scale_channels)
        np.testing.assert_allclose(v, v_ref, rtol=CHANNEL_SUM_RTOL)
        np.testing.assert_allclose(dx, dx_ref, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)
        # the bf16 reference rounds each g * x to bf16; ours stays fp32: both against the fp32 sum of the
        # bf16 operands (g is the bf16 cotangent of the bf16 output)
        as_dt = lambda a: a.astype(dt).astype(jnp.float32)
        dw_f32 = jnp.einsum("bsc,bsc->c", as_dt(probe), as_dt(x))
        np.testing.assert_allclose(dw, dw_f32, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)
        if dt == jnp.float32:  # in bf16 autodiff's own gradient is a bf16 sum, ~1% off the fp32 one
            np.testing.assert_allclose(dw, dw_ref, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)


def test_sconv_tap_gradients_match_the_naive_conv():
    """SConv's taps and input gradients (through `scale_channels`) equal autodiff of a plain-product conv."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 9, 3)), jnp.float32)
    taps = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    probe = jnp.asarray(rng.normal(size=(2, 9, 3)), jnp.float32)

    def naive(x, taps):
        y = x * taps[0]
        for j in range(1, 4):
            shifted = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :9]
            same = (jnp.pad(seg, ((0, 0), (j, 0)), constant_values=-1)[:, :9] == seg)[..., None]
            y = y + jnp.where(same, shifted, 0) * taps[j]
        return y

    grads = lambda f: jax.grad(lambda x, t: jnp.sum(f(x, t) * probe), argnums=(0, 1))(x, taps)
    for a, b in zip(grads(lambda x, t: sconv(x, t, seg)), grads(naive)):
        np.testing.assert_allclose(a, b, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)


def test_sconv_identity_at_init_and_causal():
    x = jax.random.normal(jax.random.key(0), (1, 7, 5))
    seg = jnp.ones((1, 7), jnp.int32)
    np.testing.assert_array_equal(sconv(x, init_conv(4, 5), seg), x)
    taps = jax.random.normal(jax.random.key(1), (4, 5))
    y = sconv(x, taps, seg)
    y2 = sconv(x.at[0, 4].add(1.0), taps, seg)
    changed = np.any(np.asarray(y2 != y), axis=-1)[0]
    np.testing.assert_array_equal(changed, [False] * 4 + [True] * 3)


def test_gated_norm_formula():
    d, r = 6, 3
    n = Norm.init(d, r, 0.5, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4, d))
    h = rms_norm(x, n.gain, 1e-5)
    want = h * jax.nn.sigmoid(jax.nn.silu(h @ n.down) @ n.up)
    np.testing.assert_allclose(n(x, 1e-5), want, atol=FP32_ATOL)
    ms = np.mean(np.asarray(h) ** 2, -1)
    np.testing.assert_allclose(ms, 1.0, rtol=1e-3)  # gains are 1 at init: plain RMS-normalised


def test_matmul_tokens_matches_plain_matmul_values_and_gradients():
    """The custom VJP only reorders the weight gradient's dot ((g^T x)^T instead of x^T g)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 37, 24))  # [B, S, D], S unaligned
    w = jax.random.normal(kw, (24, 5))
    g = jax.random.normal(kg, (3, 37, 5))
    y, vjp = jax.vjp(matmul_tokens, x, w)
    y_ref, vjp_ref = jax.vjp(lambda a, b: a @ b, x, w)
    np.testing.assert_allclose(y, y_ref, rtol=FP32_RTOL, atol=FP32_ATOL)
    for got, want in zip(vjp(g), vjp_ref(g)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=FP32_RTOL, atol=FP32_ATOL)
    dx16, dw16 = jax.vjp(matmul_tokens, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))[1](g.astype(jnp.bfloat16))
    assert dx16.dtype == dw16.dtype == jnp.bfloat16  # cotangents keep the primal dtypes


def test_router_topk_threshold_and_combine_weights():
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.normal(size=(10, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(8,)) * 2, jnp.float32)
    r = route(m, w, bias, top_k=3, combine_scale=2.5)
    logits = np.asarray(m) @ np.asarray(w)
    biased = logits + np.asarray(bias)
    order = np.argsort(-biased, axis=-1)
    np.testing.assert_array_equal(np.sort(r.expert_TK, -1), np.sort(order[:, :3], -1))
    np.testing.assert_allclose(r.threshold_T, biased[np.arange(10), order[:, 3]], rtol=FP32_RTOL)
    np.testing.assert_allclose(np.sum(r.weight_TK, -1), 2.5, rtol=FP32_RTOL)
    s = 1 / (1 + np.exp(-np.take_along_axis(logits, np.asarray(r.expert_TK), -1)))  # unbiased logits
    np.testing.assert_allclose(r.weight_TK, 2.5 * s / s.sum(-1, keepdims=True), rtol=1e-4)


def _loss_inputs(scale, V=50, T=12, D=8):
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(1, T, D)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(D, V)) * scale, jnp.float32)
    t = jnp.asarray(rng.integers(0, V, (1, T)))
    mask = jnp.asarray(np.arange(T) < 10)[None]
    return h, head, t, mask


def test_z_loss_and_cross_entropy_values():
    h, head, t, mask = _loss_inputs(1.0)
    out = lm_loss(h, head, t, mask, 1e-4)
    logits = np.asarray(h[0], np.float64) @ np.asarray(head, np.float64)
    lse = np.log(np.sum(np.exp(logits), -1))
    ce = (lse - logits[np.arange(12), np.asarray(t[0])])[:10].mean()
    z = (lse**2)[:10].mean()
    np.testing.assert_allclose(out["cross_entropy_loss"], ce, rtol=FP32_RTOL)
    np.testing.assert_allclose(out["z_loss"], z, rtol=FP32_RTOL)
    np.testing.assert_allclose(out["loss"], ce + 1e-4 * z, rtol=FP32_RTOL)


def test_loss_at_large_logit_scale_matches_fp32_oracle_and_streamed_path():
    """SPEC §6: bf16 activations with logits ~ +-100 must still give an fp32-accurate loss and grads."""
    h, head, t, mask = _loss_inputs(30.0)
    oracle = jax.value_and_grad(lambda h, w: lm_loss(h, w, t, mask, 1e-4)["loss"], argnums=(0, 1))
    v_ref, g_ref = oracle(h, head)
    streamed = jax.value_and_grad(lambda h, w: lm_loss(h, w, t, mask, 1e-4, vocab_block=16)["loss"], argnums=(0, 1))
    v_s, g_s = streamed(h, head)
    np.testing.assert_allclose(v_s, v_ref, rtol=FP32_RTOL)
    for a, b in zip(g_s, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # bf16 compute path: logits still accumulate in fp32, so the loss matches within bf16 input rounding.
    hb = h.astype(jnp.bfloat16)
    v_b = lm_loss(hb, head, t, mask, 1e-4)["loss"]
    v_oracle_b = lm_loss(hb.astype(jnp.float32), head.astype(jnp.bfloat16).astype(jnp.float32), t, mask, 1e-4)["loss"]
    np.testing.assert_allclose(v_b, v_oracle_b, rtol=1e-3)


# SPEC §6 at |logit| up to ~240 (head scale 30, the test above's): a bf16 logit there is off by up to 0.5 nats
# (spacing 1 between 128 and 256), an fp32 one by ~1e-5 (observed 1.5e-5).
LARGE_LOGIT_CE_ATOL = 1e-3
# dh comes back in h's dtype, bf16: one rounding of the fp32 gradient is at most 2^-8 relative; twice that for
# the fp32 sums before it. A softmax of bf16-rounded logits moves dh entries by tens of percent at this scale.
LARGE_LOGIT_DH_RTOL = 2.0**-7
LARGE_LOGIT_DH_ATOL = 1e-5  # fp32 noise on entries that cancel to ~0 (and the masked tokens' exact zeros)


def _float64_loss_oracle(h, head, t, mask, z_weight):
    """Per-token cross-entropy and d(loss)/dh of lm_loss's formula in float64, on the given (rounded) inputs."""
    h64, w64, m = (np.asarray(x, np.float64) for x in (h[0], head, mask[0]))
    tt = np.asarray(t[0])
    logits = h64 @ w64
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    p = np.exp(logits - lse[:, None])
    # loss = sum_t m_t (ce_t + z_weight lse_t^2) / sum(m): d/dlogits = m_t / sum(m) ((1 + 2 z_weight lse_t) p - onehot)
    dlogits = (m / m.sum())[:, None] * ((1 + 2 * z_weight * lse)[:, None] * p - np.eye(w64.shape[1])[tt])
    return lse - logits[np.arange(len(tt)), tt], dlogits @ w64.T


def test_bf16_loss_at_large_logit_scale_per_token_and_hidden_grad_match_fp32_oracle():
    """SPEC §6, bf16 activations with logits ~ +-100 on the default (one-dot) head: each token's cross-entropy
    and the gradient w.r.t. the hidden states against a float64 oracle of the same bf16-rounded inputs. The mean
    loss alone (the test above) averages away logits rounded to bf16 in the forward; these do not."""
    h, head, t, mask = _loss_inputs(30.0)
    hb = h.astype(jnp.bfloat16)
    ce_ref, dh_ref = _float64_loss_oracle(hb, head.astype(jnp.bfloat16), t, mask, 1e-4)
    one_token = jnp.eye(t.shape[1], dtype=bool)[:, None]  # a mask per token: lm_loss's mean is that token's
    # Op by op, not under jit: jitted, XLA's excess precision (xla_allow_excess_precision, on by default) drops a
    # bf16 rounding that a convert back to fp32 follows, so bf16 logits would pass here and still round on a GPU.
    ce = jax.vmap(lambda m: lm_loss(hb, head, t, m, 1e-4)["cross_entropy_loss"])(one_token)
    dh = jax.grad(lambda h: lm_loss(h, head, t, mask, 1e-4)["loss"])(hb)
    assert dh.dtype == jnp.bfloat16
    np.testing.assert_allclose(ce, ce_ref, rtol=0, atol=LARGE_LOGIT_CE_ATOL)
    np.testing.assert_allclose(np.asarray(dh[0], np.float64), dh_ref, rtol=LARGE_LOGIT_DH_RTOL,
                               atol=LARGE_LOGIT_DH_ATOL)


# The chunked LM head sums dh over vocab chunks in another order than one dot: fp32 rounding only.
CHUNKED_HEAD_RTOL = 1e-5
CHUNKED_HEAD_ATOL = 1e-6
# Lowered for a GPU with bf16 activations, the head's backward dots take the logits' gradient in bf16 (fp32
# accumulation), where the autodiff reference keeps it fp32: one bf16 rounding of each gradient entry
# (relative 2^-9), and dh is rounded to bf16 at the end by both (at |dh| <= 0.5 one bf16 step is 2^-9).
BF16_HEAD_GRAD_RTOL = 2e-2
BF16_HEAD_GRAD_ATOL = 2e-3


def _reference_loss(h, w, t, mask, z_weight=1e-4):
    """lm_loss's formula on `lse_reference` (the plain autodiff one dot)."""
    lse, target = lse_reference(h.reshape(-1, h.shape[-1]), w.astype(h.dtype), t.reshape(-1))
    m = mask.reshape(-1).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    return jnp.sum((lse - target) * m) / n + z_weight * jnp.sum(lse * lse * m) / n


def test_chunked_lm_head_equals_one_dot_in_value_and_gradients():
    """`chunked_lse` (the CPU train step's LM head in column chunks, a GPU's in one): the same logsumexp and
    target logit, and (h, W) gradients through `lm_loss`, as autodiff of the one dot (`lse_reference`), with
    a last chunk shorter than the others (50 = 3 x 16 + 2) and targets on every chunk's first and last
    column; in bf16 (off GPU: fp32 dots in the backward) too."""
    h, head, _, mask = _loss_inputs(3.0)
    t = jnp.asarray([[0, 15, 16, 31, 32, 47, 48, 49, 7, 20, 40, 49]])  # T = 12
    for dt in (jnp.float32, jnp.bfloat16):
        hd = h.astype(dt)
        ref = lse_reference(hd[0], head.astype(dt), t[0])
        for chunk in (16, 50):
            for a, b in zip(chunked_lse(hd[0], head, t[0], chunk), ref):
                np.testing.assert_allclose(a, b, rtol=CHUNKED_HEAD_RTOL)
        parts = lambda chunk: lm_loss(hd, head, t, mask, 1e-4, vocab_chunk=chunk)
        for name in ("loss", "cross_entropy_loss", "z_loss"):
            np.testing.assert_allclose(parts(16)[name], parts(0)[name], rtol=CHUNKED_HEAD_RTOL)
        run = lambda chunk: jax.value_and_grad(lambda h, w: lm_loss(h.astype(dt), w, t, mask, 1e-4,
                                                                    vocab_chunk=chunk)["loss"], argnums=(0, 1))(h, head)
        (v_ref, g_ref), (v_c, g_c) = run(0), run(16)
        np.testing.assert_allclose(v_c, v_ref, rtol=CHUNKED_HEAD_RTOL)
        for a, b in zip(g_c, g_ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=CHUNKED_HEAD_RTOL, atol=CHUNKED_HEAD_ATOL)


def test_gpu_lm_head_backward_runs_bf16_dots_within_one_rounding_of_the_fp32_reference():
    """Lowered for a GPU with bf16 activations, `lm_loss`'s one-dot head is `chunked_lse` in one chunk whose two
    backward dots take bf16 operands (the bf16 GEMM rate, where autodiff runs them in fp32 over the fp32
    [T, V] gradient); the loss is the reference's and the gradients within one bf16 rounding of it."""
    h, head, t, mask = _loss_inputs(3.0, V=64, T=32, D=16)
    mask = jnp.ones_like(t, bool)
    hb = h.astype(jnp.bfloat16)
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))(hb, head)
    v_ref, g_ref = grad(lambda h, w: _reference_loss(h, w, t, mask))
    with kernel_choice.targeting_gpu():  # traced as for a GPU; nothing in it needs one to run
        v, g = grad(lambda h, w: lm_loss(h, w, t, mask, 1e-4)["loss"])
        bwd = jax.make_jaxpr(jax.vjp(lambda h, w: chunked_lse(h, w, t[0], 64), hb[0], head)[1])(
            (jnp.ones(32, jnp.float32), jnp.ones(32, jnp.float32)))
    np.testing.assert_allclose(v, v_ref, rtol=CHUNKED_HEAD_RTOL)
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=BF16_HEAD_GRAD_RTOL, atol=BF16_HEAD_GRAD_ATOL)
    dots = [e for e in bwd.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    for e in dots:  # bf16 x bf16 -> fp32: no dot over the fp32 [T, V] gradient
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16], e
        assert e.outvars[0].aval.dtype == jnp.float32


def test_streamed_lm_head_backward_recomputes_blocks_with_bf16_dots_on_gpu():
    """`loss_vocab_block` (the ladder's and hero's LM head): value and (h, W) gradients equal autodiff's one dot
    with a padded last block (64 = 2 x 24 + 16), in fp32 on CPU; lowered for a GPU with bf16 activations its
    backward's dots all take bf16 operands (each block's recomputed logits and both gradient dots) and its
    gradients stay within one bf16 rounding of the fp32-gradient reference."""
    h, head, t, mask = _loss_inputs(3.0, V=64, T=32, D=16)
    mask = jnp.ones_like(t, bool)
    streamed = lambda h, w: lm_loss(h, w, t, mask, 1e-4, vocab_block=24)["loss"]
    grad = lambda f, h: jax.value_and_grad(f, argnums=(0, 1))(h, head)
    (v, g), (v_ref, g_ref) = grad(streamed, h), grad(lambda h, w: _reference_loss(h, w, t, mask), h)
    np.testing.assert_allclose(v, v_ref, rtol=CHUNKED_HEAD_RTOL)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=CHUNKED_HEAD_RTOL, atol=CHUNKED_HEAD_ATOL)
    hb = h.astype(jnp.bfloat16)
    v_ref, g_ref = grad(lambda h, w: _reference_loss(h, w, t, mask), hb)
    with kernel_choice.targeting_gpu():
        v, g = grad(lambda h, w: lm_loss(h, w, t, mask, 1e-4, vocab_block=24)["loss"], hb)
        bwd = jax.make_jaxpr(jax.vjp(lambda h, w: lm_loss(h, w, t, mask, 1e-4, vocab_block=24)["loss"], hb, head)[1])(
            jnp.ones((), jnp.float32))
    np.testing.assert_allclose(v, v_ref, rtol=CHUNKED_HEAD_RTOL)
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=BF16_HEAD_GRAD_RTOL, atol=BF16_HEAD_GRAD_ATOL)
    dots = [e for e in all_eqns(bwd.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # in the backward scan's body: the block's logits, dh and dW
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16], e


# One U*F-wide dot sums over the U shared experts inside its accumulation, the loop adds U outputs: fp32
# rounding only; in bf16 the loop also rounds each expert's output to bf16 before adding.
SHARED_RTOL = 1e-5
SHARED_ATOL = 1e-6
SHARED_BF16_RTOL = 2e-2
SHARED_BF16_ATOL = 2e-2


def test_shared_experts_as_one_wide_swiglu_equal_the_sum_of_each():
    """`shared_swiglu` (the MoE layer's shared experts): the same output and (x, gate, up, down) gradients as
    U separate SwiGLUs added up, for U = 1, 2, 3 and an odd width."""
    rng = np.random.default_rng(3)
    for n_exp in (1, 2, 3):
        x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
        ws = [jnp.asarray(rng.normal(size=shape) / 3, jnp.float32) for shape in
              [(n_exp, 8, 7), (n_exp, 8, 7), (n_exp, 7, 8)]]
        loop = lambda x, g, u, d: sum(swiglu(x, g[i], u[i], d[i]) for i in range(n_exp))
        probe = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)  # a loss whose gradient isn't all ones
        run = lambda f: jax.value_and_grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2, 3))(x, *ws)
        (v_ref, g_ref), (v, g) = run(loop), run(shared_swiglu)
        np.testing.assert_allclose(shared_swiglu(x, *ws), loop(x, *ws), rtol=SHARED_RTOL, atol=SHARED_ATOL)
        np.testing.assert_allclose(v, v_ref, rtol=SHARED_RTOL)
        for a, b in zip(g, g_ref):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=SHARED_RTOL, atol=SHARED_ATOL)


# swiglu_act's backward is the closed form of silu's derivative in fp32, autodiff's the chain rule.
ACT_RTOL = 1e-5
ACT_ATOL = 1e-6
ACT_BF16_RTOL = 1e-2  # both cast their fp32 result to bf16; autodiff rounds between its steps too
ACT_BF16_ATOL = 1e-2


def test_swiglu_activation_equals_autodiff_of_silu_times_up():
    """`swiglu_act` (every expert MLP): silu(g) * u and its (g, u) gradients as autodiff gives them, over
    large negative and positive gates, in fp32 and bf16."""
    rng = np.random.default_rng(9)
    g = jnp.asarray(np.concatenate([rng.normal(size=(4, 8)) * 3, np.full((1, 8), -30.0), np.full((1, 8), 30.0)]),
                    jnp.float32)
    u = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    for dt, rtol, atol in ((jnp.float32, ACT_RTOL, ACT_ATOL), (jnp.bfloat16, ACT_BF16_RTOL, ACT_BF16_ATOL)):
        run = lambda f: jax.value_and_grad(lambda g, u: jnp.sum(f(g.astype(dt), u.astype(dt)).astype(jnp.float32)
                                                                * probe), argnums=(0, 1))(g, u)
        (v_ref, g_ref), (v, grads) = run(lambda g, u: jax.nn.silu(g) * u), run(swiglu_act)
        np.testing.assert_allclose(v, v_ref, rtol=rtol)
        for a, b in zip(grads, g_ref):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_shared_experts_in_bf16_match_the_sum_of_each_to_bf16_rounding():
    """The tiny preset computes in bf16: `shared_swiglu` there against the per-expert loop in bf16 and both
    against the fp32 sum."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=shape) / 4, jnp.float32) for shape in [(2, 16, 8), (2, 16, 8), (2, 8, 16)]]
    loop = lambda x, g, u, d: sum(swiglu(x, g[i], u[i], d[i]) for i in range(2))
    bf = lambda a: a.astype(jnp.bfloat16)
    want = loop(x, *ws)
    got = shared_swiglu(bf(x), *map(bf, ws))
    assert got.dtype == jnp.bfloat16
    for out in (got, loop(bf(x), *map(bf, ws))):
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=SHARED_BF16_RTOL, atol=SHARED_BF16_ATOL)


def test_rms_norm_gain_gradient_equals_the_plain_product():
    """`rms_norm` takes its gain through `scale_channels`: the same value and (x, gain) gradients as the
    normalised input times the gain under autodiff."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(3, 10, 16)), jnp.float32)
    gain = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(3, 10, 16)), jnp.float32)
    plain = lambda x, g: rms_normalize(x, 1e-6) * g
    run = lambda f: jax.value_and_grad(lambda x, g: jnp.sum(f(x, g) * probe), argnums=(0, 1))(x, gain)
    (v_ref, g_ref), (v, g) = run(plain), run(lambda x, g: rms_norm(x, g, 1e-6))
    np.testing.assert_allclose(v, v_ref, rtol=CHANNEL_SUM_RTOL)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)


def test_scale_channels_sums_plainly_when_lowering_for_a_gpu():
    """Built to lower for a GPU, `scale_channels`' weight gradient is a plain fp32 sum (XLA:GPU fuses it
    with the product), not the CPU's ones-GEMV, and it gives the same values."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2, 30, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    grad = lambda: jax.grad(lambda x, w: jnp.sum(jnp.sin(scale_channels(x, w))), argnums=(0, 1))
    on_cpu = grad()(x, w)
    with kernel_choice.targeting_gpu():
        jaxpr_gpu = str(jax.make_jaxpr(grad())(x, w))
        on_gpu = jax.jit(grad())(x, w)
    assert "dot_general" in str(jax.make_jaxpr(grad())(x, w)) and "dot_general" not in jaxpr_gpu
    for a, b in zip(on_gpu, on_cpu):
        np.testing.assert_allclose(a, b, rtol=CHANNEL_SUM_RTOL, atol=CHANNEL_SUM_ATOL)


def test_head_chunk_only_on_cpu_and_only_for_a_vocab_of_several_chunks():
    assert head_chunk(MIN_HEAD_CHUNKS * CPU_HEAD_CHUNK, on_cpu=True) == CPU_HEAD_CHUNK
    assert head_chunk(MIN_HEAD_CHUNKS * CPU_HEAD_CHUNK - 1, on_cpu=True) == 0
    assert head_chunk(2048, on_cpu=True) == 0  # the tiny preset: one dot
    assert head_chunk(128_256, on_cpu=False) == 0


def test_router_metrics_per_layer_under_the_reference_names():
    """`moe_metrics`: routing entropy of the assignment counts (log E balanced, 0 collapsed) and capacity
    overflow per layer; their means; the overflow mean equals moe/drop_fraction (same tokens per layer)."""
    layers = {"valid": np.array([100, 100]), "sender_dropped": np.array([3, 0]), "receiver_dropped": np.array([2, 10]),
              "load": np.array([[5.0, 5.0, 5.0, 5.0], [20.0, 0.0, 0.0, 0.0]]), "entropy": np.array([1.0, 2.0]),
              "load_balancing_loss": np.array([1.0, 4.0]), "router_z_loss": np.array([0.5, 1.5]),
              "max_over_mean_load": np.array([1.0, 4.0])}
    m = {k: float(v) for k, v in moe_metrics(layers, 2).items()}
    np.testing.assert_allclose([m["train/router/layer_0/routing_entropy"], m["train/router/layer_1/routing_entropy"]],
                               [np.log(4.0), 0.0], atol=FP32_ATOL)
    np.testing.assert_allclose([m["train/router/layer_0/capacity_overflow_rate"],
                                m["train/router/layer_1/capacity_overflow_rate"]], [0.05, 0.10], rtol=FP32_RTOL)
    np.testing.assert_allclose(m["train/router/capacity_overflow_rate_mean"], m["moe/drop_fraction"], rtol=FP32_RTOL)
    np.testing.assert_allclose(m["train/router/routing_entropy_mean"], np.log(4.0) / 2, rtol=FP32_RTOL)
    assert (m["train/router/layer_1/load_balancing_loss"], m["train/router/layer_1/router_z_loss"]) == (4.0, 1.5)
    assert m["train/router/token_entropy"] == 1.5  # ours: mean per-token router entropy


def _step_jaxpr(monkeypatch, targeting_gpu: bool) -> str:
    """The jaxpr of a one-layer train step (a vocab of MIN_HEAD_CHUNKS chunks) built on CPU, or built to
    lower for a GPU."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "xla")  # kernels aside: only the head's choice differs
    monkeypatch.setenv("MOEJAX_GROUPED", "xla")
    model = toy_model(vocab_size=MIN_HEAD_CHUNKS * CPU_HEAD_CHUNK, n_layers=1)
    cfg = replace(TINY, model=model, train=replace(TINY.train, batch_size=1, seq_len=16))
    optimizer, lr_fn = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, jax.random.key(0)))
    batch = toy_batch(model, batch=1, seq=16, doc_lens=((16,),))
    with kernel_choice.targeting_gpu() if targeting_gpu else contextlib.nullcontext():
        step = make_train_step(model, optimizer, lr_fn, remat=False, scan_layers=False)
    return str(jax.make_jaxpr(step)(state, batch))


def test_train_step_runs_the_lm_head_in_vocab_chunks_on_cpu_only(monkeypatch):
    """Built on CPU the step's LM head is `chunked_lse` (logits in [T, CPU_HEAD_CHUNK] pieces, never the
    whole [T, V]); built to lower for a GPU, the one dot."""
    tokens, vocab = 16, MIN_HEAD_CHUNKS * CPU_HEAD_CHUNK  # _step_jaxpr's batch and vocab
    on_cpu, on_gpu = (_step_jaxpr(monkeypatch, targeting_gpu=g) for g in (False, True))
    assert f"f32[{tokens},{CPU_HEAD_CHUNK}]" in on_cpu and f"f32[{tokens},{vocab}]" not in on_cpu
    assert f"f32[{tokens},{CPU_HEAD_CHUNK}]" not in on_gpu and f"f32[{tokens},{vocab}]" in on_gpu


# The router's bf16 matmul: every product exact, fp32 sums in another order than the one fp32 matmul's.
ROUTER_F32_RTOL = 1e-6  # max |a - b| / max |b| against float64, as the fp32 matmul itself reaches
BF16_ROUNDING = 2.0 ** -8  # dm comes back in bf16 (m's dtype), as the fp32 path's does


def _max_rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return np.abs(a - ref).max() / np.abs(ref).max()


def test_router_logits_from_one_bf16_matmul_equal_the_fp32_matmul_in_value_and_gradients():
    """`logits_bf16_matmul` (the GPU's router matmul) against float64, for a W of bf16 values as the model's
    compute copy holds: logits and the weight gradient to fp32 accuracy, the activation gradient to its bf16
    rounding. The fp32 matmul (the CPU's path) is held to the same bounds."""
    rng = np.random.default_rng(11)
    m = jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(96, 24)) * np.exp(rng.normal(size=(96, 24))), jnp.bfloat16).astype(jnp.float32)
    g = jnp.asarray(rng.normal(size=(64, 24)), jnp.float32)
    m64, w64, g64 = (np.asarray(x, np.float64) for x in (m, w, g))
    ref = (m64 @ w64, g64 @ w64.T, m64.T @ g64)  # logits, dm, dW
    fp32 = lambda m, w: jnp.einsum("td,de->te", m.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    for fn in (logits_bf16_matmul, fp32):
        logits, vjp = jax.vjp(jax.jit(fn), m, w)
        dm, dw = vjp(g)
        assert dm.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
        assert _max_rel(logits, ref[0]) <= ROUTER_F32_RTOL
        assert _max_rel(dw, ref[2]) <= ROUTER_F32_RTOL
        assert _max_rel(dm, ref[1]) <= BF16_ROUNDING


def test_router_bf16_matmul_gives_the_weight_gradient_in_the_weights_dtype():
    """A bf16 weight gets a bf16 gradient (a cotangent must match its primal's dtype: under a scan's grad an
    fp32 one raised), an fp32 weight an fp32 one."""
    m = jnp.ones((2, 8, 16), jnp.bfloat16)
    for dt in (jnp.bfloat16, jnp.float32):
        w = jnp.full((16, 4), 0.5, dt)
        loss = lambda w: jax.lax.scan(lambda c, mt: (c + jnp.sum(logits_bf16_matmul(mt, w)), None), 0.0, m)[0]
        dw = jax.grad(loss)(w)
        assert dw.dtype == dt
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.full((16, 4), 16.0))  # 2 x 8 ones per entry


def test_the_train_step_differentiates_a_router_of_bf16_values():
    """What `logits_bf16_matmul` relies on: the router matrix reaches `route` holding bf16 values (the bf16
    compute copy, upcast to fp32 by the train step), so rounding it to bf16 changes nothing."""
    params = Transformer.init(toy_model(compute_dtype="bfloat16"), jax.random.key(0))
    router = differentiated_copy(compute_copy(params, jnp.bfloat16)).blocks.moe.router
    assert router.dtype == jnp.float32
    np.testing.assert_array_equal(router, router.astype(jnp.bfloat16).astype(jnp.float32))


def test_router_logits_take_the_bf16_matmul_only_when_lowering_bf16_for_a_gpu():
    m16, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.float32)
    jaxpr = lambda m: str(jax.make_jaxpr(lambda m, w: router_logits(m, w))(m, w))  # a new function: no cached trace
    assert "logits_bf16_matmul" not in jaxpr(m16)  # CPU: one fp32 matmul
    with kernel_choice.targeting_gpu():
        assert "logits_bf16_matmul" in jaxpr(m16)
        assert "logits_bf16_matmul" not in jaxpr(m16.astype(jnp.float32))  # fp32 activations: the fp32 matmul
