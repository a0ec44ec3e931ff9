"""SPEC §4 (optimizer, heuristic, schedule, pinned-host state) mutation audit: each test here fails on one or more
realistic bugs that the rest of the suite let through, and passes on the real code.

Adam constants: the run's optimizer feeds the heuristic's beta2 and eps (not train.b2 / train.eps) to both Adam
and AdamH, and plain `adam` feeds train.eps. AdamH's direction is Adam's (bias-corrected, no Nesterov), not the
raw gradient. The heuristic accepts a one-step run. The warmup lasts round(1% of steps), at least one step, and
the run's schedules read train.warmup_fraction and train.min_lr_fraction.
The loop's step: the fp32 master and the optimizer state live in pinned_host memory and are back there after
each step, the compute copy stays in device memory in bf16, the state is donated, the step counter advances and
`train/loss` includes the z-loss. Newton-Schulz iterates in bf16 and its direction carries the shape scale.
"""

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax.config import RunConfig, TrainConfig
from moejax.parallel.mesh import make_mesh
from moejax.train.loop import step_functions
from moejax.train.optimizer import make_optimizer, newton_schulz, scale_by_newton_schulz
from moejax.train.schedule import warmup_linear_decay
from moejax.train.state import init_state, place_state
from tests.helpers import all_eqns, toy_batch, toy_model

# fp32 Adam vs a float64 reference of the same formula. Not a few ulps: near beta2 = 0.9999 the fp32 bias correction
# 1 - beta2^t keeps only ~3 significant digits (fp32 spacing at 1 is 6e-8, against 1e-4), so the step is off by up
# to ~1e-4 relative (measured 8.9e-5). The mutants this is for move it by >= 1% (beta2 0.95 or 0.9062 instead of
# 0.9999 after two steps of growing gradients, Nesterov Adam) or by orders of magnitude (eps 1e-8 against
# gradients of 1e-12, the raw gradient's direction).
ADAM_RTOL = 1e-3
# AdamH: the Adam direction's fp32 error above, through the hyperball step (whose own fp32 error is ~1e-6).
HYPERBALL_RTOL = ADAM_RTOL
# Gradients far below the train config's default eps (1e-8) and far above the heuristic's (~1e-16 here): the
# Adam update m / (sqrt(v) + eps) is a unit-scale step only with the right eps.
TINY_GRAD = 1e-12
ADAM_STEPS = 3  # beta2 shows from the second step on (its first bias-corrected v is g^2 whatever beta2)
SPEC_B1 = 0.9062


def _spec_adam_consts(total_tokens: float, batch_tokens: float) -> tuple[float, float]:
    """SPEC §4: beta2 = clip(0.999^(B/131072), 0.95, 0.9999), eps = 9.676e-18 sqrt(T/B)."""
    return (min(max(0.999 ** (batch_tokens / 131072), 0.95), 0.9999),
            9.676e-18 * math.sqrt(total_tokens / batch_tokens))


def _adam_ref(grads: list, b1: float, b2: float, eps: float, lrs: list) -> list:
    """Float64 bias-corrected Adam directions per step (optax.scale_by_adam's formula) times -lr; the update only."""
    m = v = 0.0
    out = []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        out.append(-lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps))
    return out


def _hero_cfg(**train) -> RunConfig:
    # 16 x 16 = 256 tokens a step: the heuristic's beta2 clips to 0.9999, far from train.b2 (0.95); no warmup, so
    # every step moves. train.b2 / train.eps are left at their defaults: the hero optimizer must not read them.
    train = {"steps": 200, **train}
    return RunConfig(model=toy_model(), train=TrainConfig(seq_len=16, batch_size=16, optimizer="hero",
                                                          warmup_fraction=0.0, **train))


def _grad_seq(shape, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [np.float32(TINY_GRAD * rng.normal(size=shape) * (1 + 3 * s)).astype(np.float64) for s in range(ADAM_STEPS)]


def test_hero_adam_and_adamh_use_the_heuristics_beta2_and_eps_and_adams_direction():
    """Through `make_optimizer`: the Adam group (router) takes optax-Adam steps with SPEC §4's beta1, beta2 and eps
    at the Adam rate, and the LM head (AdamH) moves along the same bias-corrected Adam direction by the hyperball
    step at the MuonH rate. Gradients of 1e-12 make eps matter, growing ones make beta2 matter. (Killed mutants:
    train.eps / train.b2 passed instead of the heuristic's, Adam's eps dropped, b2 = b1, AdamH on the raw gradient
    or with Nesterov Adam.)"""
    cfg = _hero_cfg()
    t = cfg.train
    b2, eps = _spec_adam_consts(t.total_tokens, t.tokens_per_step)
    assert b2 != t.b2 and eps < TINY_GRAD / 1e3 < t.eps  # discriminating: the config's own constants differ
    tx, lr_fns = make_optimizer(cfg)
    lrs = {g: [float(fn(s)) for s in range(ADAM_STEPS)] for g, fn in lr_fns.items()}
    rng = np.random.default_rng(0)
    w0 = {"router": rng.normal(size=(2, 8, 4)), "lm_head": rng.normal(size=(8, 16))}
    grads = {k: _grad_seq(w.shape, seed) for seed, (k, w) in enumerate(w0.items())}
    params = {k: jnp.asarray(w, jnp.float32) for k, w in w0.items()}
    state, update = tx.init(params), jax.jit(tx.update)
    moves = {k: [] for k in params}
    for s in range(ADAM_STEPS):
        updates, state = update({k: jnp.asarray(g[s], jnp.float32) for k, g in grads.items()}, state, params)
        new = optax.apply_updates(params, updates)
        for k in params:
            moves[k].append((np.asarray(params[k], np.float64), np.asarray(new[k], np.float64)))
        params = new

    router_ref = _adam_ref(grads["router"], SPEC_B1, b2, eps, lrs["adam"])
    for s, ((before, after), want) in enumerate(zip(moves["router"], router_ref)):
        np.testing.assert_allclose(after - before, want, rtol=ADAM_RTOL, atol=ADAM_RTOL * np.abs(want).max(),
                                   err_msg=f"Adam group, step {s}")
    head_dirs = _adam_ref(grads["lm_head"], SPEC_B1, b2, eps, [-1.0] * ADAM_STEPS)  # +direction, lr applied below
    for s, ((before, after), u) in enumerate(zip(moves["lm_head"], head_dirs)):
        norm = np.linalg.norm(before)
        moved = before - lrs["muonh"][s] * u * norm / np.linalg.norm(u)
        want = moved * norm / np.linalg.norm(moved) - before  # the move: a direction error shows in full
        np.testing.assert_allclose(after - before, want, rtol=HYPERBALL_RTOL,
                                   atol=HYPERBALL_RTOL * np.abs(want).max(), err_msg=f"AdamH (LM head), step {s}")


def test_plain_adam_reads_the_train_configs_eps():
    """`train.optimizer=adam`: optax Adam with train.b1 / b2 / eps. An eps of 1e-16 against gradients of 1e-12
    gives unit-scale steps; optax's default 1e-8 would give steps 1e-4 as large."""
    hero = _hero_cfg()
    cfg = dataclasses.replace(hero, train=dataclasses.replace(hero.train, optimizer="adam", learning_rate=1e-2,
                                                              eps=1e-16, b2=0.99))
    tx, lr_fns = make_optimizer(cfg)
    grads = _grad_seq((4, 8), seed=3)
    params = {"embed": jnp.ones((4, 8))}
    state, update = tx.init(params), jax.jit(tx.update)
    want = _adam_ref(grads, cfg.train.b1, 0.99, 1e-16, [float(lr_fns["adam"](s)) for s in range(ADAM_STEPS)])
    for s in range(ADAM_STEPS):
        updates, state = update({"embed": jnp.asarray(grads[s], jnp.float32)}, state, params)
        np.testing.assert_allclose(np.asarray(updates["embed"], np.float64), want[s], rtol=ADAM_RTOL,
                                   err_msg=f"step {s}")


def test_a_one_step_hero_run_gets_its_optimizer():
    """A run of one step has T = B (total tokens = one batch): the heuristic is defined there (eps = 9.676e-18),
    only B > T is an error."""
    cfg = _hero_cfg(steps=1)
    assert cfg.train.total_tokens == cfg.train.tokens_per_step
    _, lr_fns = make_optimizer(cfg)
    assert float(lr_fns["adam"](0)) > 0


SCHEDULE_RTOL = 1e-6


def test_warmup_is_the_rounded_percent_and_at_least_one_step():
    """Warmup over 1% of the steps, rounded to the nearest step (160 steps: 1.6 -> 2), and never less than one
    step when the fraction is positive (20 steps: 0.2 -> 1): the first step of a short run still starts at 0."""
    peak = 1.0
    short = warmup_linear_decay(peak, 20)
    assert float(short(0)) == 0.0
    np.testing.assert_allclose(float(short(1)), peak, rtol=SCHEDULE_RTOL)
    rounded = warmup_linear_decay(peak, 160)
    np.testing.assert_allclose([float(rounded(s)) for s in (1, 2)], [peak / 2, peak], rtol=SCHEDULE_RTOL)


def test_the_run_schedules_read_the_configs_warmup_and_floor():
    """`make_optimizer` builds each group's schedule from train.warmup_fraction and train.min_lr_fraction (both
    groups, both optimizers): a constant-lr run (floor 1.0) stays at the peak, a 10% warmup starts at 0. The
    defaults (0.01, 0.05) would hide a dropped argument, so neither value is a default here."""
    for optimizer in ("hero", "adam"):
        cfg = RunConfig(model=toy_model(), train=TrainConfig(seq_len=16, batch_size=16, steps=100, optimizer=optimizer,
                                                             warmup_fraction=0.1, min_lr_fraction=1.0))
        _, lr_fns = make_optimizer(cfg)
        for group, fn in lr_fns.items():
            peak = float(fn(10))
            assert float(fn(0)) == 0.0, (optimizer, group)
            np.testing.assert_allclose(float(fn(5)), peak / 2, rtol=SCHEDULE_RTOL)  # 10 warmup steps
            np.testing.assert_allclose([float(fn(s)) for s in (50, 100)], peak, rtol=SCHEDULE_RTOL,
                                       err_msg=f"{optimizer}/{group}: floor 1.0 keeps the peak")


# The Muon shape factor: the hyperball step divides by ||u||, so in training the factor cancels (a mutant that
# inverts it is equivalent there); the transform's own output still carries it (SPEC §4 names it), checked here
# directly since nothing else can see it.
SHAPE_RTOL = 1e-6


def test_newton_schulz_direction_carries_the_shape_scale():
    direction = scale_by_newton_schulz()
    for shape, scale in (((8, 32), 2.0), ((32, 8), 1.0)):  # [fan_in, fan_out]: sqrt(max(1, fan_out / fan_in))
        u = jax.random.normal(jax.random.key(0), shape)
        out, _ = direction.update(u, direction.init(u))
        np.testing.assert_allclose(np.asarray(out), scale * np.asarray(newton_schulz(u)), rtol=SHAPE_RTOL)


def test_newton_schulz_iterates_in_bf16():
    """SPEC §4: "5 quintic Newton-Schulz steps (bf16)". Every matmul of the iteration takes bf16 operands (15 of
    them: 3 a step); fp32 iterations give nearly the same direction (the chain test's tolerance admits them) at
    several times the cost, so only the program shows it."""
    jaxpr = jax.make_jaxpr(newton_schulz)(jnp.ones((8, 16), jnp.float32)).jaxpr
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 15
    assert {v.aval.dtype for e in dots for v in e.invars} == {jnp.dtype(jnp.bfloat16)}


# ---- the loop's train step: pinned-host state, compute copy, donation, counter, logged loss -----------------
LOSS_RTOL = 1e-6  # fp32 sum of two terms


def test_the_loops_step_keeps_master_and_optimizer_state_on_the_host_and_donates_them():
    """SPEC §4 through the loop's own jitted step (`loop.step_functions`, as `train` builds it): the fp32 master
    and the optimizer state live in `pinned_host` memory before and after each step; the compute copy lives in
    device memory in the compute dtype (bf16, the router bias fp32), also the one the step writes; the old state
    is donated (its buffers are gone after the call: the hero cannot hold two states). Values match a
    device-resident run exactly (tests/test_ep_training.py), which a state that silently stays on the device
    also does: only the memory kinds tell. The same step's counter (what the loop resumes from and saves the
    final checkpoint by) and its `train/loss` (the optimised loss: cross-entropy + z_loss_weight * z-loss,
    SPEC §2) are checked here too: no other test looks at either after a step."""
    cfg = RunConfig(model=toy_model(n_layers=1, compute_dtype="bfloat16"),
                    train=TrainConfig(seq_len=16, batch_size=2, steps=10, opt_state_memory="pinned_host"))
    mesh = make_mesh(cfg.parallel)
    tx, lr_fns = make_optimizer(cfg)
    state, offload = place_state(init_state(cfg, tx, jax.random.key(0), mesh), cfg.train.opt_state_memory)
    step_fn, _ = step_functions(cfg, mesh, tx, lr_fns, jax.tree.map(lambda x: x.sharding, state), offload,
                                remat=False)
    phase = SimpleNamespace(context=1, cf_send=cfg.parallel.cf_send, cf_recv=cfg.parallel.cf_recv)

    def kinds(tree) -> set:
        return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}

    def compute_dtypes(compute) -> dict:
        return {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_flatten_with_path(compute)[0]}

    for when in ("placed", "after a step"):
        assert kinds(state.params) == {"pinned_host"}, when
        assert kinds(state.opt_state) == {"pinned_host"}, when
        assert kinds(state.compute) == {"device"}, when
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}, when
        dtypes = compute_dtypes(state.compute)
        assert dtypes.pop(".blocks.moe.router_bias") == jnp.float32, when
        assert set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}, when
        if when == "placed":
            old = state
            state, metrics = step_fn(phase)(state, toy_batch(cfg.model))
            assert all(x.is_deleted() for x in jax.tree.leaves(old)), "the state was not donated"

    assert int(state.step) == 1
    m = {k: float(metrics[k]) for k in ("train/loss", "train/cross_entropy_loss", "train/z_loss")}
    z_term = cfg.model.z_loss_weight * m["train/z_loss"]
    assert z_term > 100 * LOSS_RTOL * m["train/loss"]  # discriminating: the z-loss term shows at this tolerance
    np.testing.assert_allclose(m["train/loss"], m["train/cross_entropy_loss"] + z_term, rtol=LOSS_RTOL)
