"""The optimizers: `make_optimizer(cfg)` builds the run's, and the hero optimizer (SPEC §4) is defined here:
MuonH for weight matrices, AdamH for the LM head, Adam for the rest.

Groups are chosen by the parameter's field name (the last key of its pytree path), never by shape:
  muonh  Nesterov momentum -> quintic Newton-Schulz (bf16) -> sqrt(max(1, fan_out/fan_in)) -> hyperball
  adamh  Adam direction -> hyperball, at the MuonH learning rate (SPEC §4: a relative step, like MuonH's)
  adam   plain Adam at the Adam rate (optional decoupled weight decay on `head_gate` and `router` only)
  frozen the QB router bias: set by quantile balancing each step (train/step.py), never by the
         optimizer, so it gets zero updates and no optimizer state
The hyperball step (Wen et al. 2025, "Hyperball optimization"; used by the public run) moves each
matrix by a *relative* amount and keeps its Frobenius norm fixed:
  W' = W - lr * u * ||W|| / ||u||,   then  W' <- W' * ||W|| / ||W'||
with one norm per matrix: every [..., fan_in, fan_out] leaf is normed over its last two dims, so a
stacked [L, E, Z, F] expert weight has one norm per layer and per expert. It needs the current params,
so the transformation returns `new_params - params` as the update (optax.apply_updates then lands on
the new params). All math is fp32 on global arrays; under jit, GSPMD partitions the norms correctly for
any sharding (SPEC §6: "norms of sharded matrices computed wrongly" -- tests/test_optimizer.py checks
sharded vs unsharded parity). No shard_map here on purpose: meshes have Auto axes
(`moejax.parallel.mesh`), so GSPMD lays out the per-matrix math and the result is sharded like the
parameter.

Notes:
- Because the hyperball step divides by ||u||, any per-matrix scale of u (momentum normalisation, the
  Muon shape factor) cancels; we keep the shape factor anyway so the direction matches plain Muon.
- `optax.trace(nesterov=True)` is Keller Jordan's Nesterov momentum up to a constant factor
  ((1-b) * (g + b * m)), which Newton-Schulz's normalisation removes.
- A matrix with ||W|| = 0 cannot move under the hyperball step; the recipe never zero-initialises one
  (SPEC §2 Init: only the head gate, an Adam leaf, starts at zero).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from moejax.config import RunConfig
from moejax.model import kernel_choice
from moejax.train import ns_gpu
from moejax.train.heuristic import optimizer_heuristic
from moejax.train.schedule import warmup_linear_decay

MUONH_FIELDS = frozenset({
    "wq", "wk", "wv", "wo",  # attention [L, in, out]
    "down", "up",  # GatedNorm [D, R] / [R, D] (or stacked [L, ...])
    "lat_down", "lat_up",  # latent transport [L, D, Z] / [L, Z, D]
    "w_gate", "w_up", "w_down",  # routed experts [L, E, Z, F] / [L, E, F, Z]
    "shared_gate", "shared_up", "shared_down",  # shared experts [L, S, D, F] / [L, S, F, D]
})
ADAMH_FIELDS = frozenset({"lm_head"})
ADAM_FIELDS = frozenset({"embed", "router", "head_gate", "gain", "lat_norm", "conv_k", "conv_out"})
FROZEN_FIELDS = frozenset({"router_bias"})  # owned by quantile balancing, not by the optimizer
# SPEC §4: "optional 0.02 decay on head gate and router".
WEIGHT_DECAY_FIELDS = frozenset({"head_gate", "router"})

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon; optax.contrib's default).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
_NS_EPS = 1e-7
_TINY = 1e-30


def leaf_name(path: tuple) -> str:
    """Field name of a parameter: the last key of its pytree path (dataclass field or string dict key)."""
    key = path[-1] if path else None
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
        return key.key
    raise ValueError(f"parameter at {jax.tree_util.keystr(tuple(path))!r} has no field name as its last path key")


def param_group(path: tuple) -> str:
    """'muonh' | 'adamh' | 'adam' | 'frozen' for the parameter at `path`, by its field name."""
    name = leaf_name(path)
    if name in FROZEN_FIELDS:
        return "frozen"
    if name in MUONH_FIELDS:
        return "muonh"
    if name in ADAMH_FIELDS:
        return "adamh"
    if name in ADAM_FIELDS:
        return "adam"
    known = sorted(MUONH_FIELDS | ADAMH_FIELDS | ADAM_FIELDS | FROZEN_FIELDS)
    raise ValueError(f"parameter {jax.tree_util.keystr(tuple(path))!r} has unknown field name {name!r}; "
                     f"add it to a group in moejax.train.optimizer (known: {', '.join(known)})")


def param_labels(params: Any) -> Any:
    """Tree of group labels with the structure of `params`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_group(path), params)


def _weight_decay_mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) in WEIGHT_DECAY_FIELDS, params)


def newton_schulz(x: jax.Array, ns_steps: int = 5, kernel: dict | None = None) -> jax.Array:
    """Approximate orthogonalisation U V^T of each matrix over the last two dims, iterated in bf16.

    Leading dims are stacks (one batch of matrices). Returns fp32. Singular values land roughly in
    [0.65, 1.15], not exactly 1 (the coefficients trade exactness for speed, Keller Jordan's Muon); singular
    values far below the largest (ill-conditioned inputs) grow by ~3.4x per step and may not reach that band.
    Each step is G = X X^T, B = c G G + b G, X' = B X + a X; `kernel`: keyword arguments of the `ns_gpu`
    kernels (`_ns_kernel` says when), which run all three with their adds fused, the two symmetric ones on
    their upper tiles only (`ns_gpu.gram_add`), else XLA.
    """
    if x.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {x.shape}")
    shape = x.shape
    if kernel is None:
        ns_step = _ns_step_xla
    else:  # the kernels take one stack axis. The leading dims stay as they are for XLA: merging them would
        # merge a sharded axis (experts) with others, and GSPMD would gather every expert stack to every
        # device (the hero's 8K step: 1.5 TB a device and 64 PFLOP of replicated Newton-Schulz, 2026-12-04).
        ns_step = functools.partial(_ns_step_kernels, **kernel)
        x = x.reshape(-1, *shape[-2:])
    x = x.astype(jnp.float32)
    x = (x / (_matrix_norm(x) + _NS_EPS)).astype(jnp.bfloat16)  # spectral norm <= 1 before iterating
    transposed = shape[-2] > shape[-1]  # iterate on the wide orientation: X X^T is the small Gram matrix
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    for _ in range(ns_steps):
        x = ns_step(x)
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    return x.astype(jnp.float32).reshape(shape)


def _ns_step_xla(x: jax.Array) -> jax.Array:
    a, b, c = NS_COEFFS
    gram = jnp.einsum("...ik,...jk->...ij", x, x)
    return _matmul_add_xla(_matmul_add_xla(gram, gram, gram, c, b), x, x, 1.0, a)


def _ns_step_kernels(x: jax.Array, **kernel) -> jax.Array:
    a, b, c = NS_COEFFS
    gram = ns_gpu.gram_add(x, None, 1.0, 0.0, **kernel)
    return ns_gpu.matmul_add(ns_gpu.gram_add(gram, gram, c, b, **kernel), x, x, 1.0, a, **kernel)  # G G = G G^T


def _matmul_add_xla(p: jax.Array, q: jax.Array, r: jax.Array, alpha: float, beta: float) -> jax.Array:
    """beta r + alpha (p @ q) per matrix of the stack (any leading dims), in the operands' dtype (XLA leaves
    the add a kernel of its own; `ns_gpu.matmul_add` is the fused form)."""
    return beta * r + alpha * jnp.einsum("...ij,...jk->...ik", p, q)


def _ns_kernel(u: jax.Array, one_device: bool) -> dict | None:
    """The `ns_gpu` kernels' keyword arguments when they run this matrix stack's Newton-Schulz, else None.
    MOEJAX_NS chooses by the `kernel_choice` rule; left to the default (the kernel on a GPU), only when the
    run has one device: the optimizer's arrays are global (GSPMD lays out their math), and a custom call left
    to GSPMD runs replicated, which on sharded expert stacks would gather every expert to every device. A
    shape the kernel can't take (a width with no power-of-two tile >= 16) keeps XLA, for that matrix only."""
    chosen = kernel_choice.kernel_impl(*kernel_choice.NEWTON_SCHULZ) == "gpu_kernel"
    explicit = kernel_choice.explicitly_chosen(kernel_choice.NEWTON_SCHULZ[0])
    m, n = sorted(u.shape[-2:])
    if not chosen or not (one_device or explicit) or ns_gpu.shape_problem(m, m, n):  # [m, m] @ [m, n], m <= n
        return None
    return dict(interpret=kernel_choice.run_interpreted())


def newton_schulz_flops(params: Any, ns_steps: int = 5) -> float:
    """FLOPs of one step's Newton-Schulz over the MuonH matrices of `params` (arrays or shape structs): per
    [m, n] matrix with m <= n, each iteration is X X^T (2 m^2 n), gram @ gram (2 m^3) and (...) @ X (2 m^2 n).
    Not model FLOPs (MFU leaves them out); the CPU FLOPs guard counts them as the step's legitimate extra."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if param_group(path) == "muonh":
            m, n = sorted(leaf.shape[-2:])
            total += math.prod(leaf.shape[:-2]) * ns_steps * (4 * m * m * n + 2 * m ** 3)
    return total


def _shape_scale(u: jax.Array) -> float:
    fan_in, fan_out = u.shape[-2], u.shape[-1]
    return max(1.0, fan_out / fan_in) ** 0.5


def scale_by_newton_schulz(ns_steps: int = 5, one_device: bool = False) -> optax.GradientTransformation:
    """Stateless: u -> sqrt(max(1, fan_out/fan_in)) * NS(u) per matrix (MuonH direction). `one_device`: the
    run has a single device, so the GPU kernel may run by default (`_ns_kernel`; chosen when traced)."""

    def update_fn(updates, state, params=None):
        del params
        def direction(u):
            return _shape_scale(u) * newton_schulz(u, ns_steps, _ns_kernel(u, one_device))

        return jax.tree.map(direction, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _matrix_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(x, axis=(-2, -1), keepdims=True)


def _matrix_norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(_matrix_sum(jnp.square(x)))


def hyperball_delta(u: jax.Array, w: jax.Array, lr: jax.Array) -> jax.Array:
    """new_w - w for the norm-preserving step of `lr` (relative) along -u, one norm per matrix."""
    if w.ndim < 2:
        raise ValueError(f"hyperball step needs matrices [..., fan_in, fan_out], got shape {w.shape}")
    u = u.astype(jnp.float32)
    w32 = w.astype(jnp.float32)
    ww, uu, wu = _matrix_sum(jnp.square(w32)), _matrix_sum(jnp.square(u)), _matrix_sum(w32 * u)  # one pass
    w_norm = jnp.sqrt(ww)
    # A matrix with no direction (an expert no token reached: zero gradient, zero momentum, so NS gives 0)
    # stays put. Guarding ||u|| with _TINY alone made step ~1e29, step^2 inf and step^2 * ||u||^2 NaN.
    step = jnp.where(uu > 0, lr * w_norm / jnp.sqrt(jnp.maximum(uu, _TINY)), 0.0)
    # ||w - step u||^2 expanded, so that no pass over the moved matrix is needed to renormalise it (on a GPU
    # that pass read the fp32 stack once more: 0.8 GB per expert stack at issue 11's shape G). No cancellation
    # at the relative steps used (step ||u|| = lr ||w||: the result is >= (1 - lr)^2 ||w||^2).
    moved_sq = jnp.maximum(ww - 2.0 * step * wu + jnp.square(step) * uu, 0.0)
    new = (w32 - step * u) * (w_norm / jnp.maximum(jnp.sqrt(moved_sq), _TINY))
    return (new - w32).astype(w.dtype)


def scale_by_hyperball(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """Replace each direction u by the hyperball step delta (needs `params`); counts steps for the schedule."""
    schedule = learning_rate if callable(learning_rate) else (lambda count: learning_rate)

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("the hyperball step needs the current params: call update(grads, state, params)")
        lr = jnp.asarray(schedule(state.count), jnp.float32)
        deltas = jax.tree.map(lambda u, w: hyperball_delta(u, w, lr), updates, params)
        return deltas, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def hero_optimizer(*, adam_lr: optax.ScalarOrSchedule, muonh_lr: optax.ScalarOrSchedule, b1: float, b2: float,
                   eps: float, ns_steps: int = 5, nesterov_momentum: float = 0.95,
                   weight_decay: float = 0.0, one_device: bool = False) -> optax.GradientTransformation:
    """SPEC §4 optimizer: MuonH / AdamH / Adam partitioned by `param_group` (the router bias frozen).

    The learning rates are peaks or schedules (`make_optimizer` passes the warmup + linear-decay ones).
    AdamH (the LM head) runs at `muonh_lr`: both hyperball groups take relative steps of the same size
    (the reference recipe; on the hero 3.05e-3 per step, where adam_lr would give 7.04e-4).
    `weight_decay` > 0 adds decoupled (lr-scaled, optax.adamw) decay to `head_gate` and `router` only.
    `one_device`: a single-device run, where Newton-Schulz takes its GPU kernel by default (`_ns_kernel`).
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay ({weight_decay}) must be non-negative")
    return optax.partition(
        {
            "muonh": optax.chain(
                optax.trace(decay=nesterov_momentum, nesterov=True),
                scale_by_newton_schulz(ns_steps, one_device),
                scale_by_hyperball(muonh_lr),
            ),
            "adamh": optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), scale_by_hyperball(muonh_lr)),
            "adam": optax.adamw(adam_lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_weight_decay_mask),
            "frozen": optax.set_to_zero(),
        },
        param_labels,
    )


def _frozen_or(name: str, path: tuple) -> str:
    return "frozen" if leaf_name(path) in FROZEN_FIELDS else name


def optimizer_settings(cfg: RunConfig) -> dict:
    """The optimizer's effective hyperparameters, for run_info.json: under `hero` the heuristic's (SPEC §4),
    not train.learning_rate / b1 / b2 / eps, which only `adam` reads (config.json still shows them)."""
    t = cfg.train
    if t.optimizer == "hero":
        hp = optimizer_heuristic(total_tokens=t.total_tokens, width=cfg.model.d_model, batch_tokens=t.tokens_per_step)
        return {"name": "hero", "source": "SPEC §4 heuristic", "muonh_lr": hp.muonh_lr, "adam_lr": hp.adam_lr,
                "b1": hp.beta1, "b2": hp.beta2, "eps": hp.eps, "weight_decay": t.weight_decay}
    return {"name": "adam", "source": "train config", "learning_rate": t.learning_rate, "b1": t.b1, "b2": t.b2,
            "eps": t.eps, "weight_decay": t.weight_decay}


def make_optimizer(cfg: RunConfig) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """(optimizer, {group: lr schedule}) of a run; each schedule is built once and shared with the metrics.

    `adam`: optax Adam on every trained leaf at train.learning_rate. `hero`: MuonH/AdamH/Adam (SPEC §4) with
    the fitted heuristic for the lrs, eps and beta2 from (total tokens, width, tokens per batch); its "muonh"
    schedule drives MuonH and AdamH, "adam" drives Adam. Both apply train.weight_decay (decoupled) to head
    gate and router only.
    """
    t = cfg.train
    sched = lambda peak: warmup_linear_decay(peak, t.steps, t.warmup_fraction, t.min_lr_fraction)
    if t.optimizer == "hero":
        hp = optimizer_settings(cfg)  # the one place the heuristic is read, so run_info.json says what ran
        lr_fns = {"muonh": sched(hp["muonh_lr"]), "adam": sched(hp["adam_lr"])}
        opt = hero_optimizer(adam_lr=lr_fns["adam"], muonh_lr=lr_fns["muonh"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                             weight_decay=t.weight_decay, one_device=cfg.parallel.n_devices == 1)
        return opt, lr_fns
    lr_fns = {"adam": sched(t.learning_rate)}
    labels = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: _frozen_or("adam", path), params)
    adam = optax.adam(lr_fns["adam"], b1=t.b1, b2=t.b2, eps=t.eps)
    if t.weight_decay:  # only then: plain Adam's state layout stays that of existing checkpoints
        adam = optax.adamw(lr_fns["adam"], b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                           mask=_weight_decay_mask)
    opt = optax.partition({"adam": adam, "frozen": optax.set_to_zero()}, labels)
    return opt, lr_fns
