"""Three recipe details tied to independent formulas written from the SPEC: the MoE block's latent transport
(§2, a float64 reference of the whole block), quantile balancing across real train steps (§2: the bias of the
next step is b = -beta centred, and it replaces the old one), and the MuonH update chain (§4: Nesterov momentum,
quintic Newton-Schulz, shape scale, hyperball step, learning-rate schedule) over a few optimizer steps."""

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import RunConfig, TrainConfig
from moejax.model.moe.balance import qb_bias
from moejax.model.moe.layer import MoE, moe_mix
from moejax.model.transformer import model_loss
from moejax.train.optimizer import make_optimizer
from moejax.train.state import differentiated_copy, init_state
from moejax.train.step import make_train_step, with_router_bias
from tests.helpers import toy_batch, toy_model

# --- 1. the MoE block against a float64 reference ---------------------------------------------------------
# The layer computes in fp32 with HIGHEST-precision matmuls (conftest); against float64 only fp32 rounding
# remains: a few ulps of O(1) values through ~5 chained matmuls of width <= 32.
FP32_VS_FP64_RTOL = 2e-5
FP32_VS_FP64_ATOL = 2e-6
# The reference picks the experts in float64; fp32 logits differ by ~1e-7, so a token whose K-th and
# (K+1)-th biased logits lie closer than this could be routed differently: the inputs must keep clear of it.
SELECTION_GAP = 1e-4
SPEC_COMBINE_SCALE, SPEC_COMBINE_EPS = 2.5, 1e-9  # w = 2.5 s / (sum s + 1e-9)
SPEC_NORM_EPS = 1e-5  # RMSNorm eps (SPEC §2 Norms)


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


def _swiglu_ref(xp, x, w_gate, w_up, w_down, spec):
    """W2 (silu(x Wg) * (x Wu)) for the matrices picked by `spec` (an einsum over leading dims)."""
    gate, up = xp.einsum(spec[0], x, w_gate), xp.einsum(spec[0], x, w_up)
    return xp.einsum(spec[1], gate * _sigmoid(xp, gate) * up, w_down)


def _moe_reference(xp, p: dict, m_TD, expert_TK):
    """SPEC §2 MoE block (before the output SConv), written with `xp` = numpy or jax.numpy. The expert choice
    (a discrete top-K, no gradient) is an input; everything downstream of it is computed here."""
    logits_TE = m_TD @ p["router"]
    s_TK = _sigmoid(xp, xp.take_along_axis(logits_TE, expert_TK, axis=1))  # the *unbiased* logits
    w_TK = SPEC_COMBINE_SCALE * s_TK / (xp.sum(s_TK, axis=1, keepdims=True) + SPEC_COMBINE_EPS)
    h_TZ = m_TD @ p["lat_down"]
    z_TZ = h_TZ / xp.sqrt(xp.mean(h_TZ * h_TZ, axis=1, keepdims=True) + SPEC_NORM_EPS) * p["lat_norm"]
    out_TKZ = _swiglu_ref(xp, z_TZ, p["w_gate"][expert_TK], p["w_up"][expert_TK], p["w_down"][expert_TK],
                          ("tz,tkzf->tkf", "tkf,tkfz->tkz"))
    y_TD = xp.einsum("tk,tkz->tz", w_TK, out_TKZ) @ p["lat_up"]  # combined in latent space, then up
    shared_TD = _swiglu_ref(xp, m_TD, p["shared_gate"], p["shared_up"], p["shared_down"],
                            ("td,udf->tuf", "tuf,ufd->td"))
    return y_TD + shared_TD


def _spec_choice(p: dict, m_TD: np.ndarray, top_k: int) -> np.ndarray:
    """The K experts of each token: the largest biased logits (float64), with the selection gap checked."""
    biased_TE = m_TD @ p["router"] + p["router_bias"]
    order_TE = np.argsort(-biased_TE, axis=1, kind="stable")
    ranked_TE = np.take_along_axis(biased_TE, order_TE, axis=1)
    assert np.min(ranked_TE[:, top_k - 1] - ranked_TE[:, top_k]) > SELECTION_GAP, "a near tie: pick another seed"
    return order_TE[:, :top_k]


def _random_moe(cfg, key) -> MoE:
    """MoE.init's shapes with every leaf random: matrices N(0, 1/fan_in) so that every stage carries O(1)
    values, and the zero / one initialised leaves (router bias, latent RMSNorm gain) non-trivial."""
    p = MoE.init(cfg, key)
    leaves, treedef = jax.tree.flatten(p)
    keys = jax.random.split(key, len(leaves))
    p = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) / math.sqrt(x.shape[-2]) if x.ndim >= 2 else x
                                     for k, x in zip(keys, leaves)])
    k_bias, k_gain = jax.random.split(keys[0])
    return replace(p, router_bias=0.5 * jax.random.normal(k_bias, (cfg.n_experts,)),
                   lat_norm=1.0 + 0.5 * jax.random.normal(k_gain, (cfg.latent_width,)))


def test_moe_block_matches_float64_spec_reference_values_and_grads():
    """SPEC §2: router logits m W + b, top-K on the biased logits, sigmoid weights of the unbiased logits summing
    to 2.5, z = RMSNorm(m W_down_lat), SwiGLU experts in latent space, latent combine, W_up_lat, plus the shared
    SwiGLUs. Forward on the dropless local path, and gradients w.r.t. the input, W_down_lat and W_router."""
    cfg = toy_model(top_k=3)
    p = _random_moe(cfg, jax.random.key(3))
    m = jax.random.normal(jax.random.key(4), (2, 12, cfg.d_model))
    seg = jnp.ones((2, 12), jnp.int32)
    cot = jax.random.normal(jax.random.key(5), m.shape)
    p64 = {f: np.asarray(getattr(p, f), np.float64) for f in ("router", "router_bias", "lat_down", "lat_norm",
                                                                 "lat_up", "w_gate", "w_up", "w_down",
                                                                 "shared_gate", "shared_up", "shared_down")}
    m64 = np.asarray(m, np.float64).reshape(-1, cfg.d_model)
    expert_TK = _spec_choice(p64, m64, cfg.top_k)

    def loss(m, lat_down, router):
        y, _ = moe_mix(replace(p, lat_down=lat_down, router=router), m, seg, cfg)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(m, p.lat_down, p.router)
    y_ref = _moe_reference(np, p64, m64, expert_TK)
    np.testing.assert_allclose(np.asarray(y).reshape(y_ref.shape), y_ref, rtol=FP32_VS_FP64_RTOL,
                               atol=FP32_VS_FP64_ATOL)
    routed_only = _moe_reference(np, {**p64, "shared_down": 0 * p64["shared_down"]}, m64, expert_TK)
    assert np.std(routed_only) > 0.3 and np.std(y_ref - routed_only) > 0.3  # both paths carry O(1) values

    with jax.enable_x64(True):
        pj = {f: jnp.asarray(v) for f, v in p64.items()}
        cot64 = jnp.asarray(np.asarray(cot, np.float64).reshape(m64.shape))

        def loss_ref(m_TD, lat_down, router):
            return jnp.sum(_moe_reference(jnp, {**pj, "lat_down": lat_down, "router": router}, m_TD,
                                          jnp.asarray(expert_TK)) * cot64)

        grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(jnp.asarray(m64), pj["lat_down"], pj["router"])
        grads_ref = [np.asarray(g) for g in grads_ref]
    for name, g, g_ref in zip(("input", "lat_down", "router"), grads, grads_ref):
        scale = np.max(np.abs(g_ref))
        np.testing.assert_allclose(np.asarray(g).reshape(g_ref.shape), g_ref, rtol=FP32_VS_FP64_RTOL,
                                   atol=FP32_VS_FP64_ATOL * scale, err_msg=f"d loss / d {name}")


# --- 2. quantile balancing across real train steps --------------------------------------------------------
# The step's own margins and the ones recomputed here come from two compilations of the same fp32 forward
# (with and without the backward), so they may differ in the last ulp, which could move a token across an edge
# of QB's 10,000-bin histogram (bin width range / 10,000 ~ 1e-4 here). Measured: identical biases, and
# |(K+1)-th largest of mu + b| <= 3e-8; the biases compared are O(0.1) and the differences asserted >= 1e-2.
QB_ATOL = 1e-5
# Shifting every expert's incoming bias by the same constant shifts all biased logits and every token's alpha by
# it, so the margins move by -c, beta by -c, and the centring removes it: the same bias up to fp32 rounding of
# the shifted sums (not exactly: the bin edges move with the extrema). Measured: 3e-8.
SHIFT_ATOL = 1e-5
BIAS_SHIFT = 0.375
# How far apart two genuinely different QB biases must be to count as different (>> QB_ATOL).
DIFFERENT_MIN = 1e-2


def _qb_setup():
    cfg = RunConfig(model=toy_model(n_layers=2),
                    train=TrainConfig(seq_len=16, batch_size=4, steps=10, optimizer="adam", learning_rate=1e-2))
    tx, lr_fns = make_optimizer(cfg)
    state = init_state(cfg, tx, jax.random.key(0))
    step = jax.jit(make_train_step(cfg.model, tx, lr_fns, remat=False, scan_layers=False))
    # Some padding (row 0 ends 3 tokens early): QB counts only real tokens.
    batches = [toy_batch(cfg.model, batch=4, seq=16, seed=s, doc_lens=((5, 8), (16,))) for s in (1, 2)]
    return cfg, state, step, batches


def _set_bias(state, bias_LE):
    """The state with its router bias (master and compute copy: the forward reads the latter) replaced."""
    return replace(state, params=with_router_bias(state.params, bias_LE),
                   compute=with_router_bias(state.compute, bias_LE))


def _routing_of(cfg, state, batch) -> dict:
    """The forward of the train step on `state`'s compute copy, keeping each layer's raw routing (the margins
    mu = logit - alpha and the token mask, which the train step hands to QB, and the load)."""
    keep = lambda stats: {k: stats[k] for k in ("margins", "token_mask", "load")}
    fwd = jax.jit(lambda c, b: model_loss(c, b, cfg.model, layer_hook=keep, remat=False, scan_layers=False)[1])
    return fwd(differentiated_copy(state.compute), batch)["layers"]


def _qb_of(cfg, routing) -> np.ndarray:
    """[L, E] next-step bias from each layer's margins (SPEC §2: b = -beta, centred)."""
    return np.stack([np.asarray(qb_bias(routing["margins"][i], routing["token_mask"][i], cfg.model.top_k,
                                        cfg.model.qb_bins)) for i in range(cfg.model.n_layers)])


def _check_margins_use_bias(cfg, routing, bias_LE):
    """SPEC §2: alpha_t is the (K+1)-th *biased* logit, mu = unbiased logit - alpha. So mu + b (= biased - alpha)
    has, per token, its (K+1)-th largest value at 0 — with b the bias this step routed with, and only then."""
    k = cfg.model.top_k
    for i in range(cfg.model.n_layers):
        shifted = np.sort(np.asarray(routing["margins"][i]) + np.asarray(bias_LE[i])[None, :], axis=1)[:, ::-1]
        np.testing.assert_allclose(shifted[:, k], 0.0, atol=QB_ATOL, err_msg=f"layer {i}: alpha is not b-biased")
        assert np.all(shifted[:, k - 1] >= -QB_ATOL)  # the K choices lie at or above the threshold


def _check_is_centred_quantile(cfg, routing, bias_LE):
    """SPEC §2, independently of the histogram: b_e = -(beta_e - c) with one c per layer (the centring), where
    beta_e is exceeded by T_valid*K/E of the valid tokens' margins for expert e. With a fractional share n,
    floor(n) or ceil(n) tokens lie above beta_e, so it lies between the (ceil(n)+1)-th and the floor(n)-th
    largest margin, give or take one histogram bin: such a c must exist."""
    k, n_exp = cfg.model.top_k, cfg.model.n_experts
    for i in range(cfg.model.n_layers):
        mu_TE = np.asarray(routing["margins"][i])[np.asarray(routing["token_mask"][i])]
        share = mu_TE.shape[0] * k / n_exp
        desc_TE = -np.sort(-mu_TE, axis=0)
        lo_E, hi_E = desc_TE[math.ceil(share)], desc_TE[math.floor(share) - 1]
        width = (mu_TE.max() - mu_TE.min()) / cfg.model.qb_bins
        b_E = np.asarray(bias_LE[i])
        assert np.max(lo_E + b_E) - width <= np.min(hi_E + b_E) + width, f"layer {i}: not the centred quantile"


def test_qb_bias_replaces_and_the_next_step_routes_with_it():
    """Two real train steps from a state whose router bias is arbitrary (SPEC §2 QB): after step 1 the bias is
    qb_bias of step 1's own margins (computed with the bias step 1 routed with), whatever constant the incoming
    bias carried (it replaces, not accumulates; centred); a differently shaped incoming bias routes differently
    and so gives a different new bias; and step 2 routes with step 1's bias."""
    cfg, state, step, (batch1, batch2) = _qb_setup()
    n_layers, n_exp = cfg.model.n_layers, cfg.model.n_experts
    b0 = 0.3 * jax.random.normal(jax.random.key(7), (n_layers, n_exp)) + 0.2  # not centred, not zero
    s0 = _set_bias(state, b0)

    # (a) step 1's new bias is QB of step 1's margins, which are taken with the incoming bias b0.
    routing1 = _routing_of(cfg, s0, batch1)
    _check_margins_use_bias(cfg, routing1, b0)
    s1, _ = step(s0, batch1)
    b1 = np.asarray(s1.params.blocks.moe.router_bias)
    np.testing.assert_allclose(b1, _qb_of(cfg, routing1), atol=QB_ATOL)
    _check_is_centred_quantile(cfg, routing1, b1)
    np.testing.assert_array_equal(np.asarray(s1.compute.blocks.moe.router_bias), b1)  # what step 2 reads
    np.testing.assert_allclose(b1.mean(axis=1), 0.0, atol=QB_ATOL)

    # ... and replaces b0: a constant shift of b0 routes identically and leaves the same new bias (accumulating,
    # or leaving it uncentred, would carry the shift along).
    s1_shift, _ = step(_set_bias(state, b0 + BIAS_SHIFT), batch1)
    np.testing.assert_allclose(np.asarray(s1_shift.params.blocks.moe.router_bias), b1, atol=SHIFT_ATOL)
    # A differently shaped incoming bias moves the thresholds alpha, hence the margins, hence the new bias.
    b0_other = b0[:, ::-1]
    s1_other, _ = step(_set_bias(state, b0_other), batch1)
    b1_other = np.asarray(s1_other.params.blocks.moe.router_bias)
    np.testing.assert_allclose(b1_other, _qb_of(cfg, _routing_of(cfg, _set_bias(state, b0_other), batch1)),
                               atol=QB_ATOL)
    assert np.max(np.abs(b1_other - b1)) > DIFFERENT_MIN

    # (b) step 2 routes with b1: its load and its new bias are those of routing s1's weights with b1, which
    # differ from routing them with the stale b0.
    routing2 = _routing_of(cfg, s1, batch2)
    _check_margins_use_bias(cfg, routing2, b1)
    s2, metrics2 = step(s1, batch2)
    np.testing.assert_array_equal(np.asarray(metrics2["train/router/load"]), np.asarray(routing2["load"]))
    b2 = np.asarray(s2.params.blocks.moe.router_bias)
    np.testing.assert_allclose(b2, _qb_of(cfg, routing2), atol=QB_ATOL)
    _check_is_centred_quantile(cfg, routing2, b2)
    stale = _routing_of(cfg, _set_bias(s1, b0), batch2)
    assert np.any(np.asarray(stale["load"]) != np.asarray(routing2["load"]))
    assert np.max(np.abs(_qb_of(cfg, stale) - b2)) > DIFFERENT_MIN


# --- 3. the MuonH chain over a few optimizer steps ----------------------------------------------------------
SPEC_MOMENTUM = 0.95
# SPEC §4 names "5 quintic Newton-Schulz steps" but no coefficients: these are Keller Jordan's Muon's
# (a, b, c), the quintic's usual ones, taken from there (the code uses the same).
MUON_NS_COEFFS = (3.4445, -4.7750, 2.0315)
MUON_NS_EPS = 1e-7
# Warmup over 1% of the steps, then linear decay to 5% of the peak. The SPEC does not say where the warmup
# starts; this takes lr 0 at step 0 (so the first step makes no move), the code's documented convention.
SPEC_WARMUP, SPEC_FLOOR = 0.01, 0.05
# The code iterates Newton-Schulz in bf16 (SPEC: "(bf16)"), the reference in float64. bf16 keeps 8 significant
# bits (rounding 2^-9 ~ 2e-3 per op) and the quintic amplifies each rounding (slope up to a = 3.44) over 5
# iterations: the code's direction differs from the float64 one by 4-7% in Frobenius norm (40 random 16x32 and
# 32x16 matrices, worst 6.9%), and an elementwise bf16 emulation in numpy comes no closer (XLA's rounding points
# inside fused ops are its own); with the code's NS switched to fp32 (a one-off check) the whole chain agrees to
# 7e-6. So each step's move W' - W is compared at about twice the worst bf16 difference observed.
BF16_NS_RTOL = 0.15
NORM_RTOL = 1e-6  # the hyperball keeps ||W||: fp32 renormalisation
LR_RTOL = 1e-6  # the fp32 schedule against the float64 formula
# The last gradient cancels the spec's momentum up to this fraction, so the spec's update there points along a
# fresh random direction; any other momentum (0.9, plain heavy-ball) leaves most of the accumulated momentum in
# it. On generic gradients momentum 0.9 changes the update by only 4-8%, inside BF16_NS_RTOL.
CANCEL_RESIDUAL = 0.02
MUONH_STEPS = 4  # the schedule's lr: 0 (warmup starts at 0), peak/2, peak, and the first decay step


def _spec_lr(step: int, peak: float, total: int) -> float:
    """Linear warmup from 0 over 1% of the steps (2 of 200 here), then linear decay to 5% of the peak."""
    warmup = SPEC_WARMUP * total
    if step < warmup:
        return peak * step / warmup
    return peak * (1.0 - (1.0 - SPEC_FLOOR) * (step - warmup) / (total - warmup))


def _spec_muonh_peak(total_tokens: float, width: int, batch_tokens: float) -> float:
    adam_lr = min(0.05, 0.06602 * total_tokens ** -0.395 * width ** -0.150 * math.sqrt(batch_tokens))
    return min(0.05, 13.0 / 3.0 * adam_lr)


def _newton_schulz_ref(u: np.ndarray) -> np.ndarray:
    """Quintic Newton-Schulz in float64: X = u / ||u||_F (on the wide orientation), 5 x (X <- a X + (b A + c A^2) X,
    A = X X^T)."""
    a, b, c = MUON_NS_COEFFS
    x = u / (np.linalg.norm(u) + MUON_NS_EPS)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _muonh_reference(w0: np.ndarray, grads: list, lrs: list) -> list:
    """Weights after each MuonH step (SPEC §4), float64. Nesterov momentum as in Muon: buf <- b buf + (1-b) g,
    direction (1-b) g + b buf; then NS, the shape scale sqrt(max(1, fan_out / fan_in)) (weights are
    [fan_in, fan_out]), and the hyperball step W - lr u ||W|| / ||u|| renormalised to ||W||."""
    w, buf, out = w0.astype(np.float64), np.zeros(w0.shape), []
    for g, lr in zip(grads, lrs):
        buf = SPEC_MOMENTUM * buf + (1 - SPEC_MOMENTUM) * g
        u = _newton_schulz_ref((1 - SPEC_MOMENTUM) * g + SPEC_MOMENTUM * buf)
        u = u * math.sqrt(max(1.0, w.shape[1] / w.shape[0]))
        norm = np.linalg.norm(w)
        moved = w - lr * u * norm / np.linalg.norm(u)
        w = moved * norm / np.linalg.norm(moved)
        out.append(w)
    return out


def _cancelling_gradient(grads: list, rng) -> np.ndarray:
    """A gradient after `grads` whose spec Nesterov direction is CANCEL_RESIDUAL-small random noise: with buf the
    momentum after `grads`, the next direction is (1-b)(1+b) g + b^2 buf, so g = -b^2 buf / (1-b^2) + noise."""
    b = SPEC_MOMENTUM
    buf = np.zeros(grads[0].shape)
    for g in grads:
        buf = b * buf + (1 - b) * g
    cancel = -b * b * buf / (1 - b * b)
    noise = rng.normal(size=buf.shape)
    return cancel + CANCEL_RESIDUAL * np.linalg.norm(cancel) / np.linalg.norm(noise) * noise


def test_muonh_steps_match_spec_chain():
    """SPEC §4 MuonH on one wide (16x32) and one tall (32x16) matrix through the run's own optimizer
    (`make_optimizer`, recipe heuristic and schedule), against a float64 reference of the whole chain. (The shape
    scale cannot show: the hyperball step divides by ||u||, so any per-matrix factor of u cancels.)"""
    cfg = RunConfig(model=toy_model(), train=TrainConfig(seq_len=16, batch_size=16, steps=200, optimizer="hero"))
    opt, lr_fns = make_optimizer(cfg)
    t = cfg.train
    peak = _spec_muonh_peak(t.total_tokens, cfg.model.d_model, t.tokens_per_step)
    assert peak < 0.05  # below the cap: the 13/3 rule itself is in play
    lrs = [_spec_lr(s, peak, t.steps) for s in range(MUONH_STEPS)]
    np.testing.assert_allclose([float(lr_fns["muonh"](s)) for s in range(MUONH_STEPS)], lrs, rtol=LR_RTOL)

    rng = np.random.default_rng(0)
    w0 = {"wq": 0.2 * rng.normal(size=(16, 32)), "wo": 0.2 * rng.normal(size=(32, 16))}  # MuonH fields
    grads = {k: [rng.normal(size=w.shape) for _ in range(MUONH_STEPS - 1)] for k, w in w0.items()}
    for k in grads:
        grads[k].append(_cancelling_gradient(grads[k], rng))
    grads = {k: [np.float32(g).astype(np.float64) for g in gs] for k, gs in grads.items()}  # what the code sees

    params = {k: jnp.asarray(w, jnp.float32) for k, w in w0.items()}
    opt_state = opt.init(params)
    update = jax.jit(opt.update)
    code = {k: [np.asarray(w, np.float64)] for k, w in params.items()}
    for s in range(MUONH_STEPS):
        updates, opt_state = update({k: jnp.asarray(g[s], jnp.float32) for k, g in grads.items()}, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        for k in code:
            code[k].append(np.asarray(params[k], np.float64))

    for k, w in w0.items():
        ref = [code[k][0]] + _muonh_reference(code[k][0], grads[k], lrs)
        np.testing.assert_array_equal(code[k][1], code[k][0], err_msg=f"{k}: the first step has lr 0")
        np.testing.assert_allclose(np.linalg.norm(code[k][1:], axis=(1, 2)), np.linalg.norm(code[k][0]),
                                   rtol=NORM_RTOL, err_msg=f"{k}: the hyperball keeps ||W||")
        for s in range(2, MUONH_STEPS + 1):
            move, move_ref = code[k][s] - code[k][s - 1], ref[s] - ref[s - 1]
            rel = np.linalg.norm(move - move_ref) / np.linalg.norm(move_ref)
            assert rel < BF16_NS_RTOL, f"{k} step {s - 1}: move differs from the spec's by {rel:.3f} (relative)"
