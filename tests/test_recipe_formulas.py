"""Two recipe details of SPEC §2 against independent formulas: the attention chain (values and gradients
against a float64 re-implementation written from the spec, sharing no helper with the model) and the
initialisation (per parameter role: truncated-normal matrices, unit gains, zero gate and bias, identity
SConv taps)."""

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.attention import Attention, attention
from moejax.model.transformer import Transformer
from moejax.presets import TINY
from tests.helpers import toy_model

# SPEC §2 constants, written here rather than read from the config, so a changed default fails the test.
QK_MULT = 1.3
QK_NORM_EPS = 1e-6
ROPE_THETA = 10_000.0
XSA_EPS = 1e-6  # the code's guard in XSA's denominator (the spec names no epsilon)
CONV_TAPS = 4
INIT_SCALE = 0.5  # sigma = 0.5 / sqrt(d)
TRUNC = 3.0  # truncated_normal(-3, 3)

# fp32 (the model) against float64 (the reference), relative to the largest reference magnitude of each
# array: measured <= 6e-7 for values and all gradients (fp32 rounding through ~10 ops and sums over <= 128
# terms); a wrong formula (scale, norm, mask, head map, conv, gate) moves them by 1e-3 or more.
FP32_VS_FP64_RTOL = 1e-5
# Statistical checks of the initialisation: a leaf's sample std and mean within this many standard errors.
N_SE = 5.0
MIN_STAT_ELEMENTS = 1024  # leaves with fewer elements get the bound and the pooled checks only
ROUNDING_SLACK = 1e-6  # |w| <= 3 sigma up to fp32 rounding of sigma * x

# Attention shapes: TINY's heads (8 query, 2 KV projected, 1 KV on global layers: 4 and 8 queries per KV
# head), head dim 16 with RoPE on the first 8; a window (6) well inside the documents; two rows of several
# documents each, positions restarting per document as the data pipeline gives them.
ATTN_CFG = replace(TINY.model, d_model=64, window=6, compute_dtype="float32")
DOC_LENS = ((7, 10, 7), (13, 11))
SEQ = 24  # 4 windows: local layers take the band path with attn_q_block 0


# ---- the float64 reference (numpy, or jax.numpy under x64 for gradients) -------------------------------

def _documents(doc_lens=DOC_LENS):
    seg = np.stack([np.concatenate([np.full(n, i + 1) for i, n in enumerate(row)]) for row in doc_lens])
    pos = np.stack([np.concatenate([np.arange(n) for n in row]) for row in doc_lens])
    return seg.astype(np.int32), pos.astype(np.int32)


def ref_sconv(xp, x, taps, seg):
    """y[t] = sum_j taps[j] x[t-j], x[t-j] taken only when t-j >= 0 lies in t's document."""
    seq = x.shape[1]
    y = 0.0
    for j in range(taps.shape[0]):
        shifted = xp.concatenate([xp.zeros_like(x[:, :j]), x[:, :seq - j]], axis=1)
        seg_shifted = np.concatenate([np.full_like(seg[:, :j], -1), seg[:, :seq - j]], axis=1)
        y = y + xp.where((seg_shifted == seg)[..., None], shifted, 0.0) * taps[j]
    return y


def ref_rms(xp, x):
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)


def rope_matrices(pos, head_dim, rope_dim):
    """[B, S, Hd, Hd] rotations: pair (2i, 2i+1) of the first rope_dim dims by pos * theta^(-2i/rope_dim);
    the other dims untouched."""
    rot = np.broadcast_to(np.eye(head_dim), (*pos.shape, head_dim, head_dim)).copy()
    for i in range(rope_dim // 2):
        ang = pos * ROPE_THETA ** (-2.0 * i / rope_dim)
        c, s = np.cos(ang), np.sin(ang)
        rot[..., 2 * i, 2 * i], rot[..., 2 * i, 2 * i + 1] = c, -s
        rot[..., 2 * i + 1, 2 * i], rot[..., 2 * i + 1, 2 * i + 1] = s, c
    return rot


def ref_attention(xp, w, x, seg, pos, is_global, cfg):
    """SPEC §2 attention on float64 arrays; `w` the Attention fields as a dict of arrays of `xp`."""
    bsz, seq, _ = x.shape
    n_h, hd = cfg.n_heads, cfg.head_dim
    g_used = cfg.n_kv_heads_global if is_global else cfg.n_kv_heads
    heads = lambda a, n: a.reshape(bsz, seq, n, hd)
    q = ref_rms(xp, heads(x @ w["wq"], n_h))
    k = ref_rms(xp, heads(ref_sconv(xp, x @ w["wk"], w["conv_k"], seg), cfg.n_kv_heads))[:, :, :g_used]
    v = heads(x @ w["wv"], cfg.n_kv_heads)[:, :, :g_used]
    if not is_global:
        rot = rope_matrices(pos, hd, cfg.rope_dim)
        q, k = (xp.einsum("bsij,bshj->bshi", rot, a) for a in (q, k))
    q = q * QK_MULT
    kv_of = [h // (n_h // g_used) for h in range(n_h)]
    k, v = k[:, :, kv_of], v[:, :, kv_of]
    scores = xp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    tq, tk = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (tk <= tq)[None] & (seg[:, :, None] == seg[:, None, :])
    if not is_global:
        allowed &= (tq - tk < cfg.window)[None]
    allowed = allowed[:, None]  # [B, 1, Q, K]
    top = xp.max(xp.where(allowed, scores, -1e300), axis=-1, keepdims=True)
    e = xp.where(allowed, xp.exp(scores - top), 0.0)
    out = xp.einsum("bhqk,bkhd->bqhd", e / xp.sum(e, axis=-1, keepdims=True), v)
    coef = xp.sum(out * v, -1, keepdims=True) / (xp.sum(v * v, -1, keepdims=True) + XSA_EPS)
    out = out - coef * v  # XSA: v is the token's own value vector for its head
    gate = 2.0 / (1.0 + xp.exp(-(x @ w["head_gate"])))  # [B, S, H]
    y = (out * gate[..., None]).reshape(bsz, seq, n_h * hd) @ w["wo"]
    return ref_sconv(xp, y, w["conv_out"], seg)


# ---- attention -----------------------------------------------------------------------------------------

def _attn_params(cfg, seed=0) -> Attention:
    """Init weights, with the zero head gate and identity SConv taps replaced by random ones so they matter."""
    p = Attention.init(cfg, jax.random.key(seed))
    k1, k2, k3 = jax.random.split(jax.random.key(seed + 100), 3)
    taps = lambda k, c: jnp.zeros((cfg.conv_taps, c)).at[0].set(1.0) + 0.4 * jax.random.normal(k, (cfg.conv_taps, c))
    return replace(p, head_gate=jax.random.normal(k1, p.head_gate.shape) / math.sqrt(cfg.d_model),
                   conv_k=taps(k2, cfg.kv_dim), conv_out=taps(k3, cfg.d_model))


def _assert_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    assert scale > 0, what
    err = np.max(np.abs(got - want)) / scale
    assert err <= FP32_VS_FP64_RTOL, f"{what}: max |got - want| / max |want| = {err:.3g}"


def _case(attn_q_block):
    cfg = replace(ATTN_CFG, attn_q_block=attn_q_block)
    recipe = (cfg.conv_taps, cfg.qk_mult, cfg.qk_norm_eps, cfg.rope_theta)
    assert recipe == (CONV_TAPS, QK_MULT, QK_NORM_EPS, ROPE_THETA), recipe
    seg, pos = _documents()
    x = jax.random.normal(jax.random.key(7), (len(DOC_LENS), SEQ, cfg.d_model))
    cot = jax.random.normal(jax.random.key(8), (len(DOC_LENS), SEQ, cfg.d_model))  # d loss / d output
    return cfg, _attn_params(cfg), x, cot, seg, pos


# attn_q_block 0: local layers run the band (S = 4 windows), global layers the dense core; 8: query blocks
# (local layers slice a window of keys per block).
@pytest.mark.parametrize("attn_q_block", [0, 8])
@pytest.mark.parametrize("is_global", [False, True])
def test_attention_matches_float64_spec_formula(is_global, attn_q_block):
    """Values, and gradients w.r.t. x and every weight (jax.grad of the fp32 model vs jax.grad of the
    float64 reference under x64), for a local and a global layer."""
    cfg, p, x, cot, seg, pos = _case(attn_q_block)
    loss = lambda p, x: jnp.sum(attention(p, x, jnp.asarray(seg), jnp.asarray(pos), is_global, cfg) * cot)
    out = jax.jit(lambda p, x: attention(p, x, jnp.asarray(seg), jnp.asarray(pos), is_global, cfg))(p, x)
    g_p, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)

    w64 = {k: np.asarray(v, np.float64) for k, v in p.__dict__.items()}
    want = ref_attention(np, w64, np.asarray(x, np.float64), seg, pos, is_global, cfg)
    _assert_close(out, want, "output")
    with jax.enable_x64(True):
        cot64 = np.asarray(cot, np.float64)
        ref_loss = lambda w, x: jnp.sum(ref_attention(jnp, w, x, seg, pos, is_global, cfg) * cot64)
        w_grad, x_grad = jax.grad(ref_loss, argnums=(0, 1))(
            {k: jnp.asarray(v) for k, v in w64.items()}, jnp.asarray(np.asarray(x, np.float64)))
    _assert_close(g_x, x_grad, "d/dx")
    for name, g in g_p.__dict__.items():
        _assert_close(g, w_grad[name], f"d/d{name}")


def test_attention_traced_layer_flag_matches_float64_spec_formula():
    """The scanned layer body's path: `is_global` a traced flag (lax.cond), one compiled function for both."""
    cfg, p, x, _, seg, pos = _case(0)
    run = jax.jit(lambda p, x, flag: attention(p, x, jnp.asarray(seg), jnp.asarray(pos), flag, cfg))
    w64 = {k: np.asarray(v, np.float64) for k, v in p.__dict__.items()}
    for is_global in (False, True):
        want = ref_attention(np, w64, np.asarray(x, np.float64), seg, pos, is_global, cfg)
        _assert_close(run(p, x, jnp.asarray(is_global)), want, f"output, is_global={is_global}")


# ---- initialisation ------------------------------------------------------------------------------------

def truncated_normal_moments(a: float) -> tuple[float, float]:
    """(std, kurtosis) of a standard normal truncated to [-a, a]: with Z = P(|X| <= a) and phi the density,
    E[X^2] = 1 - 2 a phi(a) / Z and E[X^4] = 3 - 2 (a^3 + 3 a) phi(a) / Z (integration by parts). At a = 3
    the std is 0.98658 (0.87963 would be the truncation at +-2)."""
    phi = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    z = math.erf(a / math.sqrt(2))
    var = 1 - 2 * a * phi / z
    return math.sqrt(var), (3 - 2 * (a ** 3 + 3 * a) * phi / z) / var ** 2


# Every parameter leaf by its role (the last field name). A leaf without a role fails the test.
MATRICES = {"embed", "lm_head", "down", "up", "wq", "wk", "wv", "wo", "router", "lat_down", "lat_up", "w_gate",
            "w_up", "w_down", "shared_gate", "shared_up", "shared_down"}
GAINS = {"gain", "lat_norm"}  # RMSNorm gains, the latent norm's included
ZEROS = {"head_gate", "router_bias"}
CONVS = {"conv_k", "conv_out"}  # SConv taps [(L,) J, C]


def _leaves_by_name(params) -> dict[str, np.ndarray]:
    return {".".join(k.name for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _check_sample(name, w, sigma_t, kurt):
    n = w.size
    mean_se = sigma_t / math.sqrt(n)
    assert abs(w.mean()) <= N_SE * mean_se, f"{name}: mean {w.mean():.3g}, {N_SE} SE = {N_SE * mean_se:.3g}"
    std_rel_se = math.sqrt((kurt - 1) / (4 * n))  # standard error of a sample std, relative
    assert abs(w.std() / sigma_t - 1) <= N_SE * std_rel_se, (
        f"{name}: std {w.std():.5g}, want {sigma_t:.5g} within {N_SE * std_rel_se:.3g} (relative)")


def test_init_follows_spec_per_parameter_role():
    """Transformer.init, every leaf by role: matrices sigma * truncated_normal(-3, 3), sigma = 0.5 / sqrt(d)
    (bound, mean and std per leaf, std pooled over all matrices, independent draws); gains 1; head gate and
    router bias 0; SConv taps identity."""
    cfg = toy_model()
    assert cfg.init_scale == INIT_SCALE and cfg.conv_taps == CONV_TAPS
    sigma = INIT_SCALE / math.sqrt(cfg.d_model)
    std_t, kurt = truncated_normal_moments(TRUNC)
    sigma_t = sigma * std_t
    leaves = _leaves_by_name(Transformer.init(cfg, jax.random.key(0)))

    pooled, matrices = [], {}
    for name, w in leaves.items():
        role = name.split(".")[-1]
        assert w.dtype == np.float32, (name, w.dtype)
        if role in MATRICES:
            assert np.abs(w).max() <= TRUNC * sigma * (1 + ROUNDING_SLACK), (name, np.abs(w).max() / sigma)
            if w.size >= MIN_STAT_ELEMENTS:
                _check_sample(name, w, sigma_t, kurt)
            pooled.append(w.ravel())
            matrices[name] = w
        elif role in GAINS:
            np.testing.assert_array_equal(w, 1.0, err_msg=name)
        elif role in ZEROS:
            np.testing.assert_array_equal(w, 0.0, err_msg=name)
        elif role in CONVS:
            assert w.shape[-2] == CONV_TAPS, (name, w.shape)
            np.testing.assert_array_equal(w[..., 0, :], 1.0, err_msg=name)  # tap 0: the current token
            np.testing.assert_array_equal(w[..., 1:, :], 0.0, err_msg=name)
        else:
            pytest.fail(f"parameter {name} has no init role in this test")
    assert {n.split(".")[-1] for n in leaves} == MATRICES | GAINS | ZEROS | CONVS  # every role present

    # All matrix elements in units of sigma: a tight check of the std (~1% at 5 SE) and of the full +-3 range.
    z = np.concatenate(pooled) / sigma
    _check_sample("all matrices / sigma", z, std_t, kurt)
    assert np.abs(z).max() > 0.9 * TRUNC, np.abs(z).max()  # the tails reach out to ~3 sigma
    # Independent draws: no two same-shaped matrices, and no two layers of a stack, are equal.
    names = sorted(matrices)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if matrices[a].shape == matrices[b].shape:
                assert not np.array_equal(matrices[a], matrices[b]), (a, b)
    for name, w in matrices.items():
        if name.startswith("blocks."):
            assert not np.array_equal(w[0], w[1]), name
