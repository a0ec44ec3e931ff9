"""The jitted train and eval steps.

One step: loss and grads (single-device model math; the MoE backend is injected) with the router bias the
previous step's routing set, optimizer update, then this step's QB bias written into the router-bias
leaf for the next step, and the step's metrics as device scalars.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from moejax.config import ModelConfig
from moejax.model import kernel_choice
from moejax.model.attention import KernelFn, flash_kernel
from moejax.model.moe.layer import RoutedFn, routed_local_with_stats
from moejax.model.moe.balance import qb_bias
from moejax.model.transformer import Transformer, WeightsFn, drop_token_stats, head_chunk, model_loss
from moejax.train.state import Offload, TrainState, compute_copy, differentiated_copy


def with_router_bias(params: Transformer, bias_LE: jax.Array) -> Transformer:
    """`params` with the QB router bias leaf replaced (the one place the bias is written)."""
    moe = replace(params.blocks.moe, router_bias=bias_LE)
    return replace(params, blocks=replace(params.blocks, moe=moe))


ROUTING_ENTROPY_EPS = 1e-6  # inside the log of the reference's routing entropy (its value, for comparable curves)


def routing_entropy(load_LE: jax.Array) -> jax.Array:
    """[L] entropy of each layer's assignment distribution over experts (the reference dashboard's
    `routing_entropy`): log(E) when balanced, 0 when every assignment goes to one expert."""
    frac = load_LE / jnp.maximum(jnp.sum(load_LE, axis=-1, keepdims=True), 1.0)
    return -jnp.sum(frac * jnp.log(frac + ROUTING_ENTROPY_EPS), axis=-1)


def drop_counts(layers: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sender-dropped, receiver-dropped, valid) assignments summed over the layers, fp32: the drop fraction's
    parts (SPEC §3), which `evaluate` also pools over eval batches."""
    return tuple(jnp.sum(layers[k]).astype(jnp.float32) for k in ("sender_dropped", "receiver_dropped", "valid"))


def moe_metrics(layers: dict, n_layers: int, prefix: str = "") -> dict:
    """Scalars from the per-layer stats stacked along L, under the reference dashboard's names where it has
    one (README "Metric names"): `train/router/layer_{i}/{capacity_overflow_rate, routing_entropy,
    load_balancing_loss, router_z_loss}` and their layer means."""
    sender, receiver, valid = drop_counts(layers)
    valid = jnp.maximum(valid, 1.0)
    overflow_L = ((layers["sender_dropped"] + layers["receiver_dropped"])
                  / jnp.maximum(layers["valid"], 1)).astype(jnp.float32)
    entropy_L = routing_entropy(layers["load"])
    out = {
        f"{prefix}moe/drop_fraction": (sender + receiver) / valid,
        f"{prefix}moe/sender_drop_fraction": sender / valid,
        f"{prefix}moe/receiver_drop_fraction": receiver / valid,
        f"{prefix}train/router/capacity_overflow_rate_mean": jnp.mean(overflow_L),
        f"{prefix}train/router/routing_entropy_mean": jnp.mean(entropy_L),
        # Ours (no reference name): the mean per-token entropy of softmax(router logits), i.e. how sharp
        # the router is, which the load-spread entropy above cannot show.
        f"{prefix}train/router/token_entropy": jnp.mean(layers["entropy"]),
        f"{prefix}train/router/load_balancing_loss": jnp.mean(layers["load_balancing_loss"]),
        f"{prefix}train/router/router_z_loss": jnp.mean(layers["router_z_loss"]),
        f"{prefix}train/router/max_over_mean_load": jnp.max(layers["max_over_mean_load"]),
    }
    for i in range(n_layers):
        layer = f"{prefix}train/router/layer_{i}/"
        out[layer + "capacity_overflow_rate"] = overflow_L[i]
        out[layer + "routing_entropy"] = entropy_L[i]
        out[layer + "load_balancing_loss"] = layers["load_balancing_loss"][i]
        out[layer + "router_z_loss"] = layers["router_z_loss"][i]
    return out


def bias_range_metrics(bias_LE: jax.Array) -> dict:
    """Spread of the router bias the next step routes with (max - min over experts, per layer), as two
    scalars whatever L: the largest range and its layer. QB drift (moejax.train.alarms) shows here first."""
    range_L = jnp.max(bias_LE, axis=-1) - jnp.min(bias_LE, axis=-1)
    return {"train/router/bias_range": jnp.max(range_L).astype(jnp.float32),
            "train/router/bias_range_layer": jnp.argmax(range_L).astype(jnp.int32)}


def qb_hook(cfg: ModelConfig):
    """Per layer inside the scan: turn the [T, E] margins into next step's router bias (SPEC §2)."""

    def hook(stats: dict) -> dict:
        bias = qb_bias(stats["margins"], stats["token_mask"], cfg.top_k, cfg.qb_bins)
        return {**drop_token_stats(stats), "qb_bias": bias}

    return hook


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, lr_fns: dict[str, Callable],
                    routed: RoutedFn = routed_local_with_stats, remat: bool | str = True,
                    offload: Offload | None = None,
                    context: int = 1, scan_layers: bool = True, attention_kernel: KernelFn = flash_kernel,
                    layer_weights: WeightsFn | None = None):
    """`remat`: False, True or a `TrainConfig.remat_saves` name (`transformer.forward`).
    `context`: the batch's rows per sequence (context parallelism, `data.loader.chunk_rows`).
    `scan_layers`: `lax.scan` over the layers, or unrolled (`transformer.run_layers`).
    `routed`, `attention_kernel`, `layer_weights`: bound to the run's mesh by `parallel.backends`
    (`moe_backend`, `attention_kernel`, `layer_weights`); the defaults are single-device. The GPU-kernel choices (`kernel_choice`) are fixed
    now, when the step is built, not when jit traces it."""
    layer_hook = qb_hook(cfg) if cfg.qb else None
    kernels = kernel_choice.current()
    # On CPU the LM head's matmuls run in vocab chunks (`transformer.head_chunk`: 1.07-1.10x the CPU-shape
    # step); a step built to lower for a GPU (`kernel_choice.targeting_gpu`) keeps the one dot.
    vocab_chunk = head_chunk(cfg.vocab_size, jax.default_backend() == "cpu" and not kernels["on_gpu"])

    @kernel_choice.pinned(kernels)
    def train_step(state: TrainState, batch: dict):
        # Forward and backward read the device-resident compute copy (upcast: fp32 leaves give fp32 grads
        # wherever the model computes in fp32 — router, norms — and FSDP grads reduce-scatter in fp32; the
        # routed experts are differentiated as they are: `differentiated_copy`); the fp32 master is only
        # needed below.
        # The router bias in it is the QB bias computed at the previous step.
        loss_fn = lambda p: model_loss(p, batch, cfg, routed, layer_hook, remat, context, scan_layers,
                                         attention_kernel, layer_weights, vocab_chunk)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(differentiated_copy(state.compute))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        master, opt_state = state.params, state.opt_state
        if offload is not None:  # host -> device, for the update only
            master = jax.device_put(master, offload.params_device)
            opt_state = jax.device_put(opt_state, offload.opt_device)
        updates, opt_state = optimizer.update(grads, opt_state, master)  # the router bias is frozen there
        new_master = optax.apply_updates(master, updates)
        layers = aux["layers"]
        # The barrier keeps the param norm's reduction out of the update's kernels: fused into one, a reduction
        # keeps XLA from writing the new master in place into the donated buffer, so each expert stack was
        # written to scratch and copied (shape G on an H200: 3 copies of 0.8 GB, roofline 121.2 -> 120.7 ms).
        metrics = {
            "train/loss": loss,
            "train/cross_entropy_loss": aux["cross_entropy_loss"],
            "train/z_loss": aux["z_loss"],
            "train/learning_rate": next(iter(lr_fns.values()))(state.step),  # the matrices' (first) group
            **{f"train/learning_rate/{g}": fn(state.step) for g, fn in lr_fns.items()},
            "train/grad_norm": optax.tree.norm(grads),
            "train/update_norm": optax.tree.norm(updates),
            "train/param_norm": optax.tree.norm(jax.lax.optimization_barrier(new_master)),
            "train/tokens": aux["tokens"],
            "train/router/load": layers["load"],
            **moe_metrics(layers, cfg.n_layers),
        }
        if "qb_bias" in layers:  # this step's routing sets the bias the next step routes with
            new_master = with_router_bias(new_master, layers.pop("qb_bias"))
        metrics.update(bias_range_metrics(new_master.blocks.moe.router_bias))
        new_compute = compute_copy(new_master, jnp.dtype(cfg.compute_dtype))
        if offload is not None:  # device -> host: only the compute copy stays on the accelerator
            new_master = jax.device_put(new_master, offload.params_host)
            opt_state = jax.device_put(opt_state, offload.opt_host)
        new_state = TrainState(step=state.step + 1, params=new_master, compute=new_compute, opt_state=opt_state,
                               rng=state.rng)
        return new_state, metrics

    return train_step


def make_eval_step(cfg: ModelConfig, routed: RoutedFn = routed_local_with_stats, scan_layers: bool = True,
                   attention_kernel: KernelFn = flash_kernel, layer_weights: WeightsFn | None = None):
    """The eval step (loss sums, bytes, MoE metrics); GPU-kernel choices fixed when built, as for training."""

    @kernel_choice.pinned(kernel_choice.current())
    def eval_step(params, batch, bytes_per_token):
        _, aux = model_loss(params, batch, cfg, routed, remat=False, scan_layers=scan_layers,
                            attention_kernel=attention_kernel, layer_weights=layer_weights)
        n_bytes = jnp.sum(jnp.where(batch["loss_mask"], bytes_per_token[batch["targets"]], 0))
        sender, receiver, valid = drop_counts(aux["layers"])
        return {"ce_sum": aux["cross_entropy_loss"] * aux["tokens"], "tokens": aux["tokens"],
                "bytes": n_bytes.astype(jnp.float32), "dropped": sender + receiver, "valid": valid,
                **moe_metrics(aux["layers"], cfg.n_layers)}

    return eval_step
