"""SPEC §2 details that a mutation audit of the model block found untested: each test below fails on one or
more realistic single-line slips (mutants) that the rest of the suite let through. Most compare against an
independent float64 formula written from the SPEC; the wiring test composes the block from its own parts,
each tied to float64 elsewhere, and the loss test checks the sum of the loss's own parts. Covered: GatedNorm
reading the *gained* RMSNorm output; norm internals in fp32 (one rounding to bf16 at the end); the norm sites
and residuals of the whole model (embedding, attention, MoE, LM head); the MoE block's output SConv; fp32
router logits from bf16 activations; the logged router metrics; the optimised loss being exactly
ce + 1e-4 z; QB's histogram with in-bin interpolation and padding excluded from its range; the SPEC constants
of the hero preset; sigma = 0.5 / sqrt(d) also for matrices whose fan-in is not d."""

import inspect
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.attention import Attention, attention
from moejax.model.layers import Norm, rms_norm
from moejax.model.moe import balance
from moejax.model.moe.layer import MoE, moe_block, moe_mix
from moejax.model.moe.router import route, router_stats
from moejax.model.transformer import Transformer, forward, model_loss
from moejax.presets import HERO_MODEL
from tests.helpers import toy_batch, toy_model
from tests.test_recipe_formulas import TRUNC, ref_sconv, truncated_normal_moments

# SPEC §2 constants, written here rather than read from the config, so a changed default fails the tests.
SPEC_NORM_EPS = 1e-5
SPEC_QK_NORM_EPS = 1e-6
SPEC_Z_LOSS = 1e-4
SPEC_COMBINE_SCALE = 2.5
SPEC_QB_BINS = 10_000
SPEC_INIT_SCALE = 0.5

# fp32 model against a float64 reference, relative to the reference's largest magnitude: a handful of fp32
# roundings through norms, small matmuls (width <= 32) and sigmoids, ~1e-6; the slips caught here move the
# values by 1e-3 or more.
FP32_VS_FP64_RTOL = 1e-5
# The model composed by hand from its own (separately tested) layer functions against `forward`: the same
# fp32 operations, possibly fused differently under jit.
SAME_OPS_RTOL = 1e-5


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _assert_rel_close(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    assert scale > 0, what
    err = np.max(np.abs(got - want)) / scale
    assert err <= rtol, f"{what}: max |got - want| / max |want| = {err:.3g} > {rtol:g}"


def _ref_norm(x, gain, down, up, eps=SPEC_NORM_EPS):
    """SPEC §2 Norms in float64: h = RMSNorm(x) * gain, y = h * sigmoid(W_up silu(W_down h))."""
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain
    low = h @ down
    return h * _sigmoid((low * _sigmoid(low)) @ up)


def _random_taps(key, shape):
    """SConv taps away from the identity init, so that a missing or misplaced conv shows."""
    return jnp.zeros(shape).at[0].set(1.0) + 0.5 * jax.random.normal(key, shape)


# ---- norms -----------------------------------------------------------------------------------------------

def test_gated_norm_reads_the_gained_rmsnorm_output_float64():
    """GatedNorm is applied to RMSNorm's output *with its learned gain* (SPEC §2: RMSNorm with learned gain,
    followed by GatedNorm). At init the gains are 1, which hides a gate computed from the un-gained
    normalisation; here the gain is random. One row of tiny values makes the eps (1e-5) matter."""
    cfg = toy_model()
    assert cfg.norm_eps == SPEC_NORM_EPS
    d, rank = cfg.d_model, cfg.gated_norm_rank
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    norm = replace(Norm.init(d, rank, 1.0 / math.sqrt(d), k1), gain=1.0 + 0.5 * jax.random.normal(k2, (d,)))
    x = jax.random.normal(k3, (2, 5, d)).at[1, 2].multiply(3e-3)  # rms 3e-3: mean square ~ eps
    got = norm(x, cfg.norm_eps)
    want = _ref_norm(*(np.asarray(a, np.float64) for a in (x, norm.gain, norm.down, norm.up)))
    _assert_rel_close(got, want, FP32_VS_FP64_RTOL, "Norm")
    tiny = np.asarray(got[1, 2], np.float64)
    _assert_rel_close(tiny, want[1, 2], FP32_VS_FP64_RTOL, "Norm of a row with mean square ~ eps")


# A bf16 result of fp32 internals is the float64 value rounded once: within half a bf16 spacing (2^-8 relative
# to the binade, so 2^-9 of |value| at worst) plus fp32 noise. Rounding inside (bf16 mean square, rsqrt or
# product) adds further half-spacings on some elements.
BF16_HALF_ULP_REL = 2.0 ** -8  # half the spacing 2^-7 of bf16 values in [1, 2), relative to the binade's base
# In units of the half-ulp: the fp32 internals are a few fp32 ulps (~6e-7 relative) off float64, and bf16's
# half-ulp is >= 2^-9 ~ 2e-3 relative, so <= 3e-4; a second bf16 rounding adds up to a whole half-ulp
# (measured: fp32 internals 0.99994, an all-bf16 norm 5.1).
FP32_SLACK = 1e-3


def test_rms_norm_of_bf16_activations_rounds_once_from_fp32_internals():
    """SPEC §2: norm internals in fp32 (bf16 compute). `rms_norm` on bf16 activations must equal the float64
    formula rounded once to bf16, i.e. lie within half a bf16 spacing of it on every element. Op by op, not
    jitted: under jit XLA's excess precision could drop an internal bf16 rounding on CPU (conftest)."""
    d = 256
    x = jax.random.normal(jax.random.key(1), (64, d)).astype(jnp.bfloat16)
    gain = (1.0 + 0.3 * jax.random.normal(jax.random.key(2), (d,))).astype(jnp.float32)
    got = np.asarray(rms_norm(x, gain, SPEC_NORM_EPS).astype(jnp.float32), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + SPEC_NORM_EPS) * np.asarray(gain, np.float64)
    half_ulp = BF16_HALF_ULP_REL * 2.0 ** np.floor(np.log2(np.abs(want)))  # half a spacing in want's binade
    excess = np.abs(got - want) / half_ulp
    assert excess.max() <= 1.0 + FP32_SLACK, f"worst error {excess.max():.3f} half-ulps: rounded more than once"


# ---- the whole model's wiring ----------------------------------------------------------------------------

def _with_random_taps(params: Transformer, key) -> Transformer:
    ka, kb, kc = jax.random.split(key, 3)
    b = params.blocks
    attn = replace(b.attn, conv_k=_random_taps(ka, b.attn.conv_k.shape), conv_out=_random_taps(kb, b.attn.conv_out.shape))
    moe = replace(b.moe, conv_out=_random_taps(kc, b.moe.conv_out.shape))
    return replace(params, blocks=replace(b, attn=attn, moe=moe))


def test_norm_sites_and_residuals_of_the_whole_model():
    """SPEC §2: a norm (RMSNorm + GatedNorm) after the embedding, before attention, before the MoE and before
    the LM head, each with its own weights; pre-norm residual blocks; the MoE block's output SConv. `forward`
    (one local and one global layer) against the chain composed by hand from the block's parts (attention and
    the MoE mix are tied to float64 references elsewhere), with the MoE output SConv written out here."""
    cfg = toy_model(n_layers=2)
    assert cfg.global_layers == (False, True)
    params = _with_random_taps(Transformer.init(cfg, jax.random.key(3)), jax.random.key(4))
    batch = toy_batch(cfg, batch=2, seq=16, doc_lens=((7, 9), (16,)))
    seg, pos = batch["segment_ids"], batch["positions"]
    got, _ = jax.jit(lambda p: forward(p, batch["tokens"], seg, pos, cfg, remat=False, scan_layers=False))(params)

    eps = SPEC_NORM_EPS
    x = params.embed_norm(params.embed[batch["tokens"]], eps)
    for i, is_global in enumerate(cfg.global_layers):
        blk = jax.tree.map(lambda a: a[i], params.blocks)
        x = x + attention(blk.attn, blk.attn_norm(x, eps), seg, pos, is_global, cfg)
        y, _ = moe_mix(blk.moe, blk.moe_norm(x, eps), seg, cfg)
        x = x + ref_sconv(np, np.asarray(y, np.float64), np.asarray(blk.moe.conv_out, np.float64), np.asarray(seg))
    want = params.final_norm(jnp.asarray(x, jnp.float32), eps)
    _assert_rel_close(got, want, SAME_OPS_RTOL, "forward vs the hand-wired block chain")


def test_moe_block_applies_its_output_sconv_within_documents():
    """SPEC §2 SConv on the MoE-block output: `moe_block` = causal depthwise conv (4 taps, document-local) of
    the routed + shared mix. The conv is written out here in float64; taps random (the identity init would
    hide a missing conv)."""
    cfg = toy_model()
    p = replace(MoE.init(cfg, jax.random.key(5)), conv_out=_random_taps(jax.random.key(6), (cfg.conv_taps, cfg.d_model)))
    m = jax.random.normal(jax.random.key(7), (2, 10, cfg.d_model))
    seg = jnp.asarray([[1] * 4 + [2] * 6, [1] * 7 + [0] * 3])
    got, _ = moe_block(p, m, seg, cfg)
    mix, _ = moe_mix(p, m, seg, cfg)
    want = ref_sconv(np, np.asarray(mix, np.float64), np.asarray(p.conv_out, np.float64), np.asarray(seg))
    _assert_rel_close(got, want, FP32_VS_FP64_RTOL, "moe_block vs SConv(moe_mix)")


# ---- router ---------------------------------------------------------------------------------------------

def test_router_logits_are_fp32_from_bf16_activations():
    """SPEC §2: router logits m W_router in fp32 even with bf16 compute. On bf16 activations (and W holding
    bf16 values, as the compute copy does) every product is exact in fp32, so the logits equal the float64
    product to fp32 accuracy; bf16 logits would be off by ~2^-9 relative."""
    rng = np.random.default_rng(3)
    m = jnp.asarray(rng.normal(size=(32, 48)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(48, 12)), jnp.bfloat16).astype(jnp.float32)
    r = route(m, w, jnp.zeros((12,)), top_k=2, combine_scale=SPEC_COMBINE_SCALE)
    assert r.logits_TE.dtype == jnp.float32
    want = np.asarray(m.astype(jnp.float32), np.float64) @ np.asarray(w, np.float64)
    _assert_rel_close(r.logits_TE, want, FP32_VS_FP64_RTOL, "router logits")


# router_stats sums over <= 40 tokens in fp32.
STATS_RTOL = 1e-5


def test_router_metrics_match_their_formulas():
    """SPEC §2: the router load-balancing loss and router z-loss are computed (and logged). Against float64:
    Switch-style LB loss E * sum_e f_e P_e (f_e the fraction of the valid tokens' K assignments to e, P_e the
    mean softmax probability of e) and router z-loss mean_t logsumexp(logits_t)^2, over valid tokens only."""
    rng = np.random.default_rng(4)
    n_tok, d, n_exp, k = 40, 16, 8, 2
    m = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, n_exp)), jnp.float32)
    r = route(m, w, jnp.zeros((n_exp,)), top_k=k, combine_scale=SPEC_COMBINE_SCALE)
    mask = np.arange(n_tok) < 30
    stats = router_stats(r, jnp.asarray(mask))

    logits = (np.asarray(m, np.float64) @ np.asarray(w, np.float64))[mask]
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    frac = np.bincount(chosen.ravel(), minlength=n_exp) / (mask.sum() * k)
    lse = np.log(np.sum(np.exp(logits), axis=1))
    probs = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(stats["load_balancing_loss"], n_exp * np.sum(frac * probs.mean(axis=0)), rtol=STATS_RTOL)
    np.testing.assert_allclose(stats["router_z_loss"], np.mean(lse ** 2), rtol=STATS_RTOL)


# The loss against the fp32 sum of its own two parts: one or two fp32 roundings (~1e-7); a z-loss weight of
# 1e-3 instead of 1e-4 moves it by ~4e-3 relative, a router z-loss term added at 1e-3 by more than 2e-4.
LOSS_SUM_RTOL = 1e-6


def test_training_loss_is_cross_entropy_plus_the_spec_z_loss_only():
    """SPEC §2 Loss: the optimised loss is next-token cross-entropy + 1e-4 * mean logsumexp^2; the router's
    LB loss and z-loss are logged, not optimised. `model_loss` on the preset's defaults must return exactly
    ce + 1e-4 * z of its own parts (each part is tied to float64 elsewhere)."""
    cfg = toy_model(n_layers=1)
    params = Transformer.init(cfg, jax.random.key(8))
    loss, aux = jax.jit(lambda p: model_loss(p, toy_batch(cfg), cfg, remat=False))(params)
    assert float(aux["layers"]["router_z_loss"][0]) > 1.0  # an added router term would show
    np.testing.assert_allclose(loss, aux["cross_entropy_loss"] + SPEC_Z_LOSS * aux["z_loss"], rtol=LOSS_SUM_RTOL)


# ---- quantile balancing ---------------------------------------------------------------------------------

def _ref_qb_threshold(mu_TE: np.ndarray, mask_T: np.ndarray, top_k: int, n_bins: int) -> np.ndarray:
    """SPEC §2 beta_e in float64: an n_bins histogram of the valid margins between their global min and max;
    the crossing bin b is the one where the count at or above its lower edge reaches n = T_valid K / E while
    the count above it (bins > b) stays below n; beta = the point inside b above which, with b's tokens spread
    evenly, exactly n tokens lie: lower edge + (1 - (n - above) / in_bin) * width."""
    mu = mu_TE[mask_T]
    lo, hi = mu.min(), mu.max()
    width = (hi - lo) / n_bins
    n = mu.shape[0] * top_k / mu_TE.shape[1]
    beta = np.empty(mu.shape[1])
    for e in range(mu.shape[1]):
        counts, edges = np.histogram(mu[:, e], bins=n_bins, range=(lo, hi))  # the last bin is closed
        above = 0
        for b in range(n_bins - 1, -1, -1):
            if above + counts[b] >= n:
                beta[e] = edges[b] + (1.0 - (n - above) / counts[b]) * width
                break
            above += counts[b]
    return beta


# fp32 bin edges (range ~8, width ~1e-3 at 10,000 bins) against float64: a margin within ~1e-6 of an edge may
# fall in the neighbouring bin, which moves beta by at most (1 token / in_bin) * width ~ 1e-4 in the
# interpolated estimate; the interpolation slips caught here move it by a sizeable fraction of a bin.
QB_BIN_ATOL_WIDTHS = 0.1


@pytest.mark.parametrize("n_bins", [7, 50, SPEC_QB_BINS])
def test_qb_threshold_is_the_interpolated_histogram_quantile(n_bins):
    """Quantile balancing's beta (SPEC §2): histogram between the global min and max of the valid margins,
    interpolated inside the crossing bin, against an independent float64 histogram (numpy's). The existing
    tests only bound the estimate within one bin of the exact quantile, which no-interpolation, reversed
    interpolation, rounded bins or the neighbouring bin also satisfy."""
    rng = np.random.default_rng(n_bins)
    n_tok, n_exp, k = 1000, 8, 2  # n = 250 tokens per expert
    mu = rng.normal(size=(n_tok, n_exp)) + rng.normal(size=n_exp)
    mask = rng.random(n_tok) < 0.9
    # Padding tokens' margins are whatever the router gave them: here far outside the valid range on both
    # sides, so that neither the histogram's range nor its counts may take them in.
    mu[~mask] = np.where(rng.random((int((~mask).sum()), 1)) < 0.5, -50.0, 50.0)
    got = jax.jit(balance.qb_threshold, static_argnames=("top_k", "n_bins"))(
        jnp.asarray(mu, jnp.float32), jnp.asarray(mask), top_k=k, n_bins=n_bins)
    want = _ref_qb_threshold(np.asarray(jnp.asarray(mu, jnp.float32), np.float64), mask, k, n_bins)
    width = (mu[mask].max() - mu[mask].min()) / n_bins
    np.testing.assert_allclose(got, want, rtol=0, atol=QB_BIN_ATOL_WIDTHS * width)


def test_qb_default_bins_are_the_spec_10000():
    """SPEC §2: a 10,000-bin histogram, as the hero's config and `qb_bias`'s default both say."""
    assert HERO_MODEL.qb_bins == SPEC_QB_BINS
    for fn in (balance.qb_bias, balance.qb_threshold):
        assert inspect.signature(fn).parameters["n_bins"].default == SPEC_QB_BINS


# ---- constants and init ---------------------------------------------------------------------------------

def test_hero_preset_carries_the_spec_block_constants():
    """SPEC §2 numbers of the hero block. Most of them only enter values (no parameter count, which
    test_accounting_config ties): a changed default would pass every test that builds its config from it."""
    m = HERO_MODEL
    assert (m.norm_eps, m.qk_norm_eps, m.z_loss_weight, m.combine_scale) == (
        SPEC_NORM_EPS, SPEC_QK_NORM_EPS, SPEC_Z_LOSS, SPEC_COMBINE_SCALE)
    assert (m.head_dim, m.rope_dim, m.rope_theta, m.qk_mult) == (128, 64, 10_000.0, 1.3)
    assert (m.gated_norm_rank, m.conv_taps, m.init_scale, m.qb) == (128, 4, SPEC_INIT_SCALE, True)
    assert (m.q_dim, m.kv_dim, m.n_experts, m.n_shared) == (6144, 1536, 384, 2)
    assert m.n_heads == 48 and m.n_heads // m.n_kv_heads_global == 8  # W_gate d x 48; 48 / 6 global KV heads


# Sample statistics of one matrix: its std within this many standard errors of sigma_t (the truncated normal's
# std at sigma); the wrong fan-in tested here changes the std by a factor sqrt(2).
N_SE = 5.0
TRUNC_STD = truncated_normal_moments(TRUNC)[0]  # std of a standard normal truncated to [-3, 3]: 0.98658


def test_init_sigma_uses_d_model_for_every_fan_in():
    """SPEC §2 Init: sigma = 0.5 / sqrt(d) for *all* matrices, also W_o (fan-in q_dim) and the expert W2 (fan-in
    the expert width), which a per-fan-in init would scale differently. The toy model of the other init test
    has q_dim == d; here q_dim = 2 d and the widths differ from d."""
    cfg = toy_model(n_heads=8, n_kv_heads=2, expert_width=64, latent_width=16, shared_width=64)
    assert cfg.q_dim == 2 * cfg.d_model and cfg.expert_width != cfg.d_model
    sigma_t = SPEC_INIT_SCALE / math.sqrt(cfg.d_model) * TRUNC_STD
    attn, moe = Attention.init(cfg, jax.random.key(9)), MoE.init(cfg, jax.random.key(10))
    for name, w in (("wo", attn.wo), ("wq", attn.wq), ("w_down", moe.w_down), ("shared_down", moe.shared_down),
                    ("lat_up", moe.lat_up)):
        w = np.asarray(w, np.float64)
        std_se = sigma_t / math.sqrt(2 * w.size)  # standard error of a sample std (kurtosis ~3)
        assert abs(w.std() - sigma_t) <= N_SE * std_se, f"{name}: std {w.std():.5g}, want {sigma_t:.5g}"
