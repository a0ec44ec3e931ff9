"""Attention masks, RoPE convention, local/global behaviour, XSA and the head gate against naive references."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.attention import Attention, attention, attention_mask, kv_head_map, rope
from tests.helpers import toy_model

FP32_ATOL = 1e-5


def test_mask_matches_naive_loops():
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    window = 3
    for is_global in (False, True):
        got = np.asarray(attention_mask(jnp.asarray(seg), window, is_global))[0, 0]
        for q in range(seg.shape[1]):
            for k in range(seg.shape[1]):
                want = k <= q and seg[0, q] == seg[0, k] and (is_global or q - k < window)
                assert got[q, k] == want, (is_global, q, k)


def test_rope_adjacent_pairs_first_dims_only():
    hd, rope_dim, theta = 8, 4, 10_000.0
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 1, hd)), jnp.float32)
    pos = jnp.asarray([[0, 1, 5]])
    y = np.asarray(rope(x, pos, rope_dim, theta))
    xn = np.asarray(x)
    np.testing.assert_allclose(y[0, 0], xn[0, 0], atol=FP32_ATOL)  # position 0: identity
    np.testing.assert_array_equal(y[..., rope_dim:], xn[..., rope_dim:])  # untouched half
    for t, p in enumerate([0, 1, 5]):
        for i in range(rope_dim // 2):
            ang = p * theta ** (-2 * i / rope_dim)
            a, b = xn[0, t, 0, 2 * i], xn[0, t, 0, 2 * i + 1]
            np.testing.assert_allclose(y[0, t, 0, 2 * i], a * np.cos(ang) - b * np.sin(ang), atol=FP32_ATOL)
            np.testing.assert_allclose(y[0, t, 0, 2 * i + 1], a * np.sin(ang) + b * np.cos(ang), atol=FP32_ATOL)


def test_rope_is_relative():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    dots = [float(jnp.sum(rope(q, jnp.asarray([[p + 3]]), 8, 1e4) * rope(k, jnp.asarray([[p]]), 8, 1e4))) for p in (0, 7)]
    np.testing.assert_allclose(dots[0], dots[1], rtol=1e-5)


def _attn_setup(seed=0, seq=12):
    cfg = toy_model(window=4)
    p = Attention.init(cfg, jax.random.key(seed))
    p = Attention(**{**p.__dict__, "head_gate": 0.2 * jax.random.normal(jax.random.key(9), p.head_gate.shape)})
    x = jax.random.normal(jax.random.key(seed + 1), (1, seq, cfg.d_model))
    return cfg, p, x


def test_global_layers_ignore_positions_local_layers_do_not():
    cfg, p, x = _attn_setup()
    seg = jnp.ones((1, 12), jnp.int32)
    pos_a = jnp.arange(12)[None]
    pos_b = pos_a + 17
    g_a, g_b = (attention(p, x, seg, pos, True, cfg) for pos in (pos_a, pos_b))
    np.testing.assert_allclose(g_a, g_b, atol=FP32_ATOL)  # no RoPE on global layers
    # Local layers: RoPE is relative, so a uniform shift is also invisible ...
    l_a, l_b = (attention(p, x, seg, pos, False, cfg) for pos in (pos_a, pos_b))
    np.testing.assert_allclose(l_a, l_b, atol=1e-4)
    # ... but non-uniform positions change local outputs and never global ones.
    pos_c = pos_a * 3
    assert not np.allclose(attention(p, x, seg, pos_c, False, cfg), l_a, atol=1e-4)
    np.testing.assert_allclose(attention(p, x, seg, pos_c, True, cfg), g_a, atol=FP32_ATOL)


def test_window_and_documents_limit_what_a_token_sees():
    cfg, p, x = _attn_setup()
    seg = jnp.asarray([[1] * 6 + [2] * 6])
    pos = jnp.asarray([list(range(6)) * 2])
    base = attention(p, x, seg, pos, False, cfg)
    # Perturb token 0: only tokens 0..3 of doc 1 may change on a local layer (window 4, SConv on k reaches 3 back
    # inside the window), nothing in doc 2.
    x2 = x.at[0, 0].add(1.0)
    out = attention(p, x2, seg, pos, False, cfg)
    changed = np.any(np.abs(np.asarray(out - base)) > 1e-6, axis=-1)[0]
    # (token 0 attends only to itself and XSA removes all of it, so its output is 0 either way)
    assert changed[1:4].all() and not changed[4:].any(), changed
    out_g = attention(p, x2, seg, pos, True, cfg)
    changed_g = np.any(np.abs(np.asarray(out_g - attention(p, x, seg, pos, True, cfg))) > 1e-6, axis=-1)[0]
    assert changed_g[1:6].all() and not changed_g[6:].any(), changed_g


def test_kv_head_split():
    cfg = toy_model(n_heads=8, n_kv_heads=4, n_kv_heads_global=2)
    np.testing.assert_array_equal(kv_head_map(cfg, False), [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(kv_head_map(cfg, True), [0, 0, 0, 0, 1, 1, 1, 1])


def test_head_gate_scales_each_head_by_two_sigmoid():
    """Behaviour, not the formula: with W_o = identity and SConv identity the output is the heads side by
    side. Setting column 2 of W_gate (zero at init) to w must scale head 2 alone, per token, by exactly
    2*sigmoid(x w) relative to the zero gate, which therefore multiplies by 1; a gate from the wrong column,
    on the wrong head, or without the factor 2 fails."""
    cfg, p, x = _attn_setup()
    assert np.all(np.asarray(Attention.init(cfg, jax.random.key(0)).head_gate) == 0.0)
    assert cfg.q_dim == cfg.d_model
    probe = Attention(**{**p.__dict__, "wo": jnp.eye(cfg.q_dim), "head_gate": jnp.zeros_like(p.head_gate),
                         "conv_out": p.conv_out.at[0].set(1.0).at[1:].set(0.0)})
    seg, pos = jnp.ones((1, 12), jnp.int32), jnp.arange(12)[None]
    heads = lambda q: np.asarray(attention(q, x, seg, pos, False, cfg)).reshape(12, cfg.n_heads, cfg.head_dim)
    base = heads(probe)
    w = jax.random.normal(jax.random.key(5), (cfg.d_model,))
    gated = heads(Attention(**{**probe.__dict__, "head_gate": probe.head_gate.at[:, 2].set(w)}))
    factor = 2 * np.asarray(jax.nn.sigmoid(x[0] @ w))  # [S], spans roughly (0, 2)
    assert factor.min() < 0.7 and factor.max() > 1.3
    np.testing.assert_allclose(gated[:, 2], factor[:, None] * base[:, 2], rtol=1e-5, atol=FP32_ATOL)
    others = [h for h in range(cfg.n_heads) if h != 2]
    np.testing.assert_allclose(gated[:, others], base[:, others], atol=FP32_ATOL)
    assert np.linalg.norm(base[1:, 2], axis=-1).min() > 1e-3  # informative ratio (token 0 is 0 after XSA)


def test_xsa_output_is_orthogonal_to_own_value():
    """Before the head gate and W_o, each head's output has no component along its own value vector."""
    cfg, p, x = _attn_setup()
    eye = jnp.eye(cfg.q_dim)
    probe = Attention(**{**p.__dict__, "wo": eye[:, : cfg.d_model] if cfg.q_dim == cfg.d_model else eye,
                         "head_gate": jnp.zeros_like(p.head_gate), "conv_out": p.conv_out.at[1:].set(0.0)})
    seg, pos = jnp.ones((1, 12), jnp.int32), jnp.arange(12)[None]
    out = attention(probe, x, seg, pos, False, cfg).reshape(1, 12, cfg.n_heads, cfg.head_dim)
    v = (x @ p.wv).reshape(1, 12, cfg.n_kv_heads, cfg.head_dim)[:, :, kv_head_map(cfg, False)]
    # Token 0 sees only itself, so its output is its own value vector and XSA removes all of it.
    assert float(jnp.max(jnp.abs(out[:, 0]))) < 1e-5
    cos = jnp.sum(out * v, -1)[:, 1:] / (jnp.linalg.norm(out, axis=-1) * jnp.linalg.norm(v, axis=-1))[:, 1:]
    assert float(jnp.max(jnp.abs(cos))) < 1e-4


def test_blockwise_attention_equals_dense_values_and_grads():
    from dataclasses import replace

    cfg, p, x = _attn_setup(seq=16)
    seg = jnp.asarray([[1] * 5 + [2] * 9 + [0] * 2])
    pos = jnp.asarray([list(range(5)) + list(range(9)) + [0, 0]])
    blk = replace(cfg, attn_q_block=4)
    for is_global in (False, True):
        f = lambda c, x: jnp.sum(jnp.sin(attention(p, x, seg, pos, is_global, c)))
        (v_d, g_d), (v_b, g_b) = (jax.value_and_grad(f, argnums=1)(c, x) for c in (cfg, blk))
        np.testing.assert_allclose(v_b, v_d, rtol=1e-5)
        np.testing.assert_allclose(g_b, g_d, rtol=1e-5, atol=FP32_ATOL)
