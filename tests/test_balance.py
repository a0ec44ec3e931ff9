"""Quantile balancing: histogram estimator vs exact quantile, masking, sharding, and a balancing simulation."""


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from moejax.model.moe import balance
from moejax.model.moe.router import route

qb_bias = jax.jit(balance.qb_bias, static_argnames=("top_k", "n_bins"))
qb_bias_exact = jax.jit(balance.qb_bias_exact, static_argnames="top_k")
qb_threshold = jax.jit(balance.qb_threshold, static_argnames=("top_k", "n_bins"))
qb_threshold_exact = jax.jit(balance.qb_threshold_exact, static_argnames="top_k")

ROUNDING_ATOL = 1e-5  # fp32 rounding of bin edges on O(1) margins
MEAN_ATOL = 1e-5
SHARDED_ATOL = 1e-6
LOAD_RATIO_MAX = 1.3  # max / mean expert load after balancing
BALANCE_STEPS = 5


def _margins(key, tokens, experts, scale=1.0):
    k1, k2 = jax.random.split(key)
    # Per-expert offsets so that the experts' quantiles differ.
    return scale * jax.random.normal(k1, (tokens, experts)) + jax.random.normal(k2, (experts,))


def test_histogram_estimate_within_one_bin_of_exact():
    mu = _margins(jax.random.key(0), 2048, 16)
    mask = jnp.ones(2048, bool)
    for n_bins in (50, 10_000):
        width = float(mu.max() - mu.min()) / n_bins
        est = qb_threshold(mu, mask, top_k=2, n_bins=n_bins)
        exact = qb_threshold_exact(mu, mask, top_k=2)
        np.testing.assert_array_less(np.abs(np.asarray(est - exact)), width + ROUNDING_ATOL)
        # Definition: T*K/E = 256 tokens exceed beta, up to the tokens sharing its histogram bin.
        above = np.asarray(jnp.sum(mu > est[None, :], axis=0))
        in_reach = np.asarray(jnp.sum(jnp.abs(mu - est[None, :]) <= width, axis=0))
        assert np.all(np.abs(above - 256) <= in_reach), (above, in_reach)


def test_exact_threshold_counts_tokens():
    mu = _margins(jax.random.key(1), 1000, 8)
    beta = qb_threshold_exact(mu, jnp.ones(1000, bool), top_k=2)  # n = 250
    np.testing.assert_array_equal(np.asarray(jnp.sum(mu >= beta[None, :], axis=0)), 250)


def test_masked_tokens_are_excluded():
    tokens, experts = 1024, 8
    mu = _margins(jax.random.key(2), tokens, experts)
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (tokens,))
    poisoned = jnp.where(mask[:, None], mu, 1e6)  # padding must not move the range or the counts
    valid = np.asarray(mask)
    ref = qb_bias(mu[valid], jnp.ones(int(valid.sum()), bool), top_k=2)
    np.testing.assert_allclose(qb_bias(poisoned, mask, top_k=2), ref, rtol=0, atol=ROUNDING_ATOL)
    np.testing.assert_allclose(qb_bias_exact(poisoned, mask, top_k=2),
                               qb_bias_exact(mu[valid], jnp.ones(int(valid.sum()), bool), top_k=2), atol=0)


def test_bias_is_centred_and_opposes_beta():
    mu = _margins(jax.random.key(4), 512, 8)
    mask = jnp.ones(512, bool)
    b = qb_bias(mu, mask, top_k=2)
    assert abs(float(jnp.mean(b))) < MEAN_ATOL
    beta = qb_threshold(mu, mask, top_k=2)
    np.testing.assert_allclose(b, -(beta - beta.mean()), atol=MEAN_ATOL)
    assert np.all(np.asarray(qb_bias(mu, jnp.zeros(512, bool), top_k=2)) == 0)


def test_sharded_margins_match_unsharded():
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AxisType.Auto, AxisType.Auto))  # as moejax's
    mu = _margins(jax.random.key(5), 1024, 16)
    mask = jax.random.bernoulli(jax.random.key(6), 0.9, (1024,))
    mu_s = jax.device_put(mu, NamedSharding(mesh, P(("data", "expert"), None)))
    mask_s = jax.device_put(mask, NamedSharding(mesh, P(("data", "expert"))))
    expected = qb_bias(mu, mask, top_k=2)
    got = jax.jit(lambda m, k: qb_bias(m, k, top_k=2))(mu_s, mask_s)  # GSPMD partitions the histogram
    exact = qb_bias_exact(mu_s, mask_s, top_k=2)
    np.testing.assert_allclose(got, expected, atol=SHARDED_ATOL)
    np.testing.assert_allclose(exact, qb_bias_exact(mu, mask, top_k=2), atol=SHARDED_ATOL)


def test_memory_is_linear_in_tokens_times_experts():
    tokens, experts, n_bins = 256, 8, 1000
    jaxpr = jax.make_jaxpr(lambda m, k: balance.qb_bias(m, k, top_k=2, n_bins=n_bins))(
        jnp.zeros((tokens, experts)), jnp.ones(tokens, bool))
    largest = max(v.aval.size for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "size"))
    assert largest <= max(tokens * experts, experts * n_bins), largest


def _route(x_TD, router_DE, bias_E, top_k):
    """The model's router (`router.route`); margins against the threshold as `moe.layer.moe_block` feeds QB."""
    r = route(x_TD, router_DE, bias_E, top_k, combine_scale=2.5)
    margins_TE = r.logits_TE - r.threshold_T[:, None]
    load_E = jnp.zeros(router_DE.shape[1]).at[r.expert_TK.ravel()].add(1.0)
    return margins_TE, load_E


def test_qb_balances_a_skewed_router():
    tokens, width, experts, top_k = 2048, 32, 16, 2
    kx, kw = jax.random.split(jax.random.key(7))
    w = jax.random.normal(kw, (width, experts)) / width**0.5
    skew = jnp.zeros(experts).at[0].set(3.0).at[1].set(1.5)  # expert 0 would take almost every token
    # A constant input feature whose router row is the skew: logits = x @ w + skew through the real router.
    x = jnp.concatenate([jax.random.normal(kx, (tokens, width)), jnp.ones((tokens, 1))], axis=1)
    w = jnp.concatenate([w, skew[None]], axis=0)
    mask = jnp.ones(tokens, bool)
    bias = jnp.zeros(experts)
    margins, load = _route(x, w, bias, top_k)
    first_ratio = float(load.max() / load.mean())
    assert first_ratio > 3.0, first_ratio  # the skew really unbalances routing
    route_fn = jax.jit(_route, static_argnums=3)
    ratios = []
    for _ in range(BALANCE_STEPS):
        bias = qb_bias(margins, mask, top_k=top_k)
        margins, load = route_fn(x, w, bias, top_k)
        ratios.append(float(load.max() / load.mean()))
    assert ratios[-1] < LOAD_RATIO_MAX, (first_ratio, ratios, np.asarray(load))
