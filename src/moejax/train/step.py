"""The jitted train and eval steps.

One step: apply the pending QB bias to the router, loss and grads (single-device model math; the MoE
backend is injected), optimizer update, new pending QB bias, and the step's metrics as device scalars.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from moejax.config import ModelConfig
from moejax.model.moe.layer import RoutedFn, routed_local_with_stats
from moejax.model.moe.balance import qb_bias
from moejax.model.transformer import drop_token_stats, model_loss
from moejax.train.state import TrainState


def with_router_bias(params, bias_LE):
    moe = replace(params.blocks.moe, router_bias=bias_LE)
    return replace(params, blocks=replace(params.blocks, moe=moe))


def moe_metrics(layers: dict, n_layers: int, prefix: str = "") -> dict:
    """Scalars from the per-layer stats stacked along L."""
    valid = jnp.maximum(jnp.sum(layers["valid"]), 1).astype(jnp.float32)
    sender = jnp.sum(layers["sender_dropped"]).astype(jnp.float32)
    receiver = jnp.sum(layers["receiver_dropped"]).astype(jnp.float32)
    out = {
        f"{prefix}moe/drop_fraction": (sender + receiver) / valid,
        f"{prefix}moe/sender_drop_fraction": sender / valid,
        f"{prefix}moe/receiver_drop_fraction": receiver / valid,
        f"{prefix}train/router/entropy": jnp.mean(layers["entropy"]),
        f"{prefix}train/router/load_balancing_loss": jnp.mean(layers["load_balancing_loss"]),
        f"{prefix}train/router/router_z_loss": jnp.mean(layers["router_z_loss"]),
        f"{prefix}train/router/max_over_mean_load": jnp.max(layers["max_over_mean_load"]),
    }
    overflow = (layers["sender_dropped"] + layers["receiver_dropped"]) / jnp.maximum(layers["valid"], 1)
    for i in range(n_layers):
        out[f"{prefix}train/router/overflow/layer_{i}"] = overflow[i].astype(jnp.float32)
    return out


def qb_hook(cfg: ModelConfig):
    """Per layer inside the scan: turn the [T, E] margins into next step's router bias (SPEC §2)."""

    def hook(stats: dict) -> dict:
        bias = qb_bias(stats["margins"], stats["token_mask"], cfg.top_k, cfg.qb_bins)
        return {**drop_token_stats(stats), "qb_bias": bias}

    return hook


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation, lr_fn: Callable,
                    routed: RoutedFn = routed_local_with_stats, remat: bool = True):
    layer_hook = qb_hook(cfg) if cfg.qb else None

    def train_step(state: TrainState, batch: dict):
        params = with_router_bias(state.params, state.qb_bias)
        loss_fn = lambda p: model_loss(p, batch, cfg, routed, layer_hook, remat)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        layers = aux["layers"]
        qb_bias = layers.pop("qb_bias", state.qb_bias)
        metrics = {
            "train/loss": loss,
            "train/cross_entropy_loss": aux["cross_entropy_loss"],
            "train/z_loss": aux["z_loss"],
            "train/learning_rate": lr_fn(state.step),
            "train/grad_norm": optax.global_norm(grads),
            "train/update_norm": optax.global_norm(updates),
            "train/param_norm": optax.global_norm(new_params),
            "train/tokens": aux["tokens"],
            "train/router/load": layers["load"],
            **moe_metrics(layers, cfg.n_layers),
        }
        new_state = TrainState(step=state.step + 1, params=with_router_bias(new_params, qb_bias),
                               opt_state=opt_state, qb_bias=qb_bias, rng=state.rng)
        return new_state, metrics

    return train_step


def make_eval_step(cfg: ModelConfig, routed: RoutedFn = routed_local_with_stats):
    def eval_step(params, batch, bytes_per_token):
        _, aux = model_loss(params, batch, cfg, routed, remat=False)
        n_bytes = jnp.sum(jnp.where(batch["loss_mask"], bytes_per_token[batch["targets"]], 0))
        return {"ce_sum": aux["cross_entropy_loss"] * aux["tokens"], "tokens": aux["tokens"],
                "bytes": n_bytes.astype(jnp.float32), **moe_metrics(aux["layers"], cfg.n_layers)}

    return eval_step
