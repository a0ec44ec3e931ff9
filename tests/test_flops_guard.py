"""CPU guard against a dense emulation of the grouped GEMM coming back (issue 11 item 6).

`jax.lax.ragged_dot` is lowered to a dense masked matmul on CPU and GPU: E x the FLOPs and memory of the
routed experts. These checks read XLA's own numbers for the compiled programs — `cost_analysis()["flops"]`
and `memory_analysis().temp_size_in_bytes` — so they run without an accelerator:
- the default train step (TINY preset as `moejax train` runs it: hero optimizer, QB, unrolled layers, local
  dropless path) compiles to at most FLOPS_RATIO_MAX x the analytic count (3 x
  accounting.fwd_flops_per_token x tokens, plus the optimizer's Newton-Schulz FLOPs);
- the routed experts alone, fwd+bwd, compile to about their analytic FLOPs at E=16 and E=64, and their
  temporary memory does not grow with E;
- the old ragged_dot path (kept here as the thing to catch) fails both, so the guard can fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from moejax import accounting
from moejax.presets import TINY
from moejax.model.moe.experts import routed_local
from moejax.model.moe.grouped import MAX_PAD_FRACTION
from moejax.train.optimizer import make_optimizer, newton_schulz_flops
from moejax.train.state import init_state
from moejax.train.step import make_train_step

# Compiled train-step FLOPs / analytic FLOPs (issue 11: "~1.5x"). The excess over 1 is masked attention
# scores outside the window, elementwise ops (norms, softmax, the optimizer's) and block padding. XLA's cost
# analysis counts a while loop's body once, so the step is measured with its layers unrolled (TINY's
# default): a scanned step read 1.26x here while really 1.73x (remat on, Newton-Schulz not in the count).
FLOPS_RATIO_MAX = 1.5
# Routed experts alone: up to MAX_PAD_FRACTION of padding rows, times the elementwise SwiGLU and combine
# ops XLA also counts (~20% at these narrow widths).
ROUTED_FLOPS_RATIO_MAX = (1 + MAX_PAD_FRACTION) * 1.25
# Temp bytes of the routed fwd+bwd at E=64 over E=16 (same T, K, Z, F). What may grow with E: the weight
# gradients (3*E*Z*F) and the per-block weights (N*Z*F, N <= A/b + E; b halves from 128 to 64 here, so N
# doubles): measured 1.27x with jax 0.10.2; an E x emulation grows ~4x (3.9x).
TEMP_GROWTH_MAX = 1.5
# These programs are compiled for their numbers only, never run: skipping LLVM's optimisations halves the
# compile time and changes neither (both are read from the optimised HLO, before code generation).
NO_CODEGEN_OPT = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# The ragged_dot path must exceed each bound by at least this factor, or the guard proves nothing.
EMULATION_MARGIN = 2.0


def ragged_routed_local(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ):
    """The previous dropless path (sort + jax.lax.ragged_dot): the dense emulation the guard must catch."""
    n_tok, k = expert_TK.shape
    expert_A = expert_TK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)
    sizes_E = jnp.bincount(expert_A, length=w_gate_EZF.shape[0]).astype(jnp.int32)
    x_AZ = z_TZ[order_A // k]
    h_AF = jax.nn.silu(jax.lax.ragged_dot(x_AZ, w_gate_EZF, sizes_E)) * jax.lax.ragged_dot(x_AZ, w_up_EZF, sizes_E)
    out_TKZ = jax.lax.ragged_dot(h_AF, w_down_EFZ, sizes_E)[jnp.argsort(order_A)].reshape(n_tok, k, -1)
    w_TK = jnp.where(mask_T[:, None], weight_TK.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkz->tz", w_TK, out_TKZ.astype(jnp.float32))


def _guard_config():
    """TINY (hero optimizer, QB, bf16, full batch) cut to 2 layers to compile faster, with the 32 experts of
    issue 11's CPU shape."""
    model = dataclasses.replace(TINY.model, n_layers=2, n_experts=32)
    return dataclasses.replace(TINY, model=model)


def _train_step_flops(cfg) -> tuple[float, float]:
    """(compiled FLOPs, analytic FLOPs) of one default train step, from shapes only (nothing allocated)."""
    optimizer, lr_fns = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, optimizer, jax.random.key(0)))
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32) for name in ("tokens", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(shape, jnp.bool_)
    step = make_train_step(cfg.model, optimizer, lr_fns, remat=cfg.train.remat, scan_layers=cfg.train.scan_layers)
    compiled = jax.jit(step).lower(state, batch).compile(NO_CODEGEN_OPT)
    analytic = (3.0 * accounting.fwd_flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.tokens_per_step
                + newton_schulz_flops(state.params))
    return compiled.cost_analysis()["flops"], analytic


def _routed_compiled(fn, n_exp, T=4096, K=2, Z=16, F=16):
    """fwd+bwd of a routed-experts function, compiled; its analytic FLOPs (3 x 2 x T*K x 3 x Z*F)."""
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (f32(T, Z), jax.ShapeDtypeStruct((T, K), jnp.int32), f32(T, K), jax.ShapeDtypeStruct((T,), jnp.bool_),
            f32(n_exp, Z, F), f32(n_exp, Z, F), f32(n_exp, F, Z))
    loss = lambda z, e, w, m, *ws: jnp.sum(fn(z, e, w, m, *ws))
    grads = jax.value_and_grad(loss, argnums=(0, 2, 4, 5, 6))
    return jax.jit(grads).lower(*args).compile(NO_CODEGEN_OPT), 3 * 2 * T * K * 3 * Z * F


def test_train_step_flops_near_analytic():
    cfg = _guard_config()
    assert not cfg.train.scan_layers, "a scanned step's cost analysis counts one layer: the guard would see too little"
    flops, analytic = _train_step_flops(cfg)
    print(f"train step: {flops / analytic:.3f} x analytic")
    assert flops <= FLOPS_RATIO_MAX * analytic, (
        f"compiled train step: {flops:.4g} FLOPs = {flops / analytic:.2f} x the analytic {analytic:.4g} "
        f"(max {FLOPS_RATIO_MAX}); a dense emulation of the grouped GEMM?")
    # The guard can fail: swapping in the ragged_dot path adds its per-layer excess in every layer.
    extra = sum(_routed_compiled(fn, cfg.model.n_experts, T=cfg.train.tokens_per_step, K=cfg.model.top_k,
                                 Z=cfg.model.latent_width, F=cfg.model.expert_width)[0].cost_analysis()["flops"] * sign
                for fn, sign in ((ragged_routed_local, 1), (routed_local, -1)))
    emulated = flops + cfg.model.n_layers * extra
    assert emulated > EMULATION_MARGIN * FLOPS_RATIO_MAX * analytic, (
        f"with ragged_dot the step would be only {emulated / analytic:.2f} x analytic: the guard is too weak")


@pytest.mark.parametrize("n_exp", [16, 64])
def test_routed_flops_near_analytic(n_exp):
    compiled, analytic = _routed_compiled(routed_local, n_exp)
    ratio = compiled.cost_analysis()["flops"] / analytic
    assert ratio <= ROUTED_FLOPS_RATIO_MAX, f"routed_local fwd+bwd at E={n_exp}: {ratio:.2f} x analytic"
    emulated, _ = _routed_compiled(ragged_routed_local, n_exp)
    emulated_ratio = emulated.cost_analysis()["flops"] / analytic
    assert emulated_ratio > EMULATION_MARGIN * ROUTED_FLOPS_RATIO_MAX, (
        f"ragged_dot at E={n_exp} is only {emulated_ratio:.2f} x analytic: the guard could not catch it")


def test_routed_temp_memory_does_not_grow_with_experts():
    def growth(fn):
        small, large = (_routed_compiled(fn, e)[0].memory_analysis().temp_size_in_bytes for e in (16, 64))
        return large / small, small, large

    ratio, small, large = growth(routed_local)
    assert ratio <= TEMP_GROWTH_MAX, f"routed_local temp bytes E=16 {small:,} -> E=64 {large:,} ({ratio:.2f} x)"
    emulated, small, large = growth(ragged_routed_local)
    assert emulated > EMULATION_MARGIN * TEMP_GROWTH_MAX, f"ragged_dot temp E=16 {small:,} -> E=64 {large:,}: guard too weak"
