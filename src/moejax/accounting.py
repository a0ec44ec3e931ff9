"""Parameter and FLOP accounting (SPEC §1).

- `total_params` / `active_params`: the run's headline formulas (matrices only; active excludes
  embedding and LM head and counts K of E routed experts).
- `exact_params`: every leaf of the model's own pytree (norms, gates, biases, conv taps included), from
  `jax.eval_shape` of the initialiser (`model.transformer.param_count`, passed into `summary`), so it works
  for the 535B hero without allocating it.
- `fwd_flops_per_token`: 2 * MACs of routed experts at latent width, shared experts, router, QKV/O
  projections (G KV heads on local layers, G_global on global ones), attention scores and values with the
  effective context (seq on global layers, min(seq, window) on local ones), the latent projections and
  the LM head, plus the attention softmax: SOFTMAX_FLOPS_PER_SCORE per score element (mask, exp,
  normalise; Levanter's `lm_flops_per_token` counts the same 3). Training FLOPs = 3 x forward
  (backward = 2 x forward); the 6*N_active*D rule is reported beside it, labelled. Norms, gates, SConv
  and the loss's softmax are left out: each is O(d) or O(V) per token, below the printed precision.
"""

from __future__ import annotations

from moejax.config import ModelConfig, RunConfig

SOFTMAX_FLOPS_PER_SCORE = 3  # per attention score: mask/scale, exp, normalise (hero: +9.6e20 of 2.695e24)


def layer_terms(m: ModelConfig) -> dict[str, int]:
    """One layer's parameters by SPEC §1's terms (what `moejax count` prints per layer): attention
    d*H*h + 2*d*kv*h + H*h*d, router d*E, latent projections 2*d*l, shared n_shared*3*d*shared_width, all
    routed experts E*3*l*I, and the K of them a token uses."""
    d = m.d_model
    per_expert = 3 * m.latent_width * m.expert_width
    return {"attention": d * m.q_dim + 2 * d * m.kv_dim + m.q_dim * d, "router": d * m.n_experts,
            "latent": 2 * d * m.latent_width, "shared": m.n_shared * 3 * d * m.shared_width,
            "routed": m.n_experts * per_expert, "routed_active": m.top_k * per_expert}


def _layer_params(m: ModelConfig, routed: str) -> int:
    """One layer's parameters with the routed experts' term `routed` ("routed": all E, "routed_active": K)."""
    t = layer_terms(m)
    return t["attention"] + t["router"] + t["latent"] + t["shared"] + t[routed]


def total_params(m: ModelConfig) -> int:
    return m.n_layers * _layer_params(m, "routed") + 2 * m.vocab_size * m.d_model


def active_params(m: ModelConfig) -> int:
    return m.n_layers * _layer_params(m, "routed_active")


def fwd_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    d, hd = m.d_model, m.head_dim
    flops = 0.0
    for layer in range(m.n_layers):
        glob = m.is_global(layer)
        kv_heads = m.n_kv_heads_global if glob else m.n_kv_heads
        ctx = seq_len if glob else min(seq_len, m.window)
        flops += 2 * (d * m.q_dim + 2 * d * kv_heads * hd + m.q_dim * d)  # QKV + O projections
        flops += 2 * 2 * m.n_heads * hd * ctx  # scores + weighted values
        flops += SOFTMAX_FLOPS_PER_SCORE * m.n_heads * ctx  # the softmax over the scores
        flops += 2 * d * m.n_experts  # router
        flops += 2 * 2 * d * m.latent_width  # latent down + up
        flops += 2 * m.top_k * 3 * m.latent_width * m.expert_width  # routed experts at latent width
        flops += 2 * m.n_shared * 3 * d * m.shared_width  # shared experts
    return flops + 2 * d * m.vocab_size  # LM head


def train_flops(m: ModelConfig, seq_len: int, tokens: float) -> float:
    """Model FLOPs of training on `tokens` tokens at `seq_len`: forward plus a backward of twice its FLOPs (SPEC §1),
    the count every MFU and the ladder's compute use (remat's recomputed forward is not model work)."""
    return 3.0 * fwd_flops_per_token(m, seq_len) * tokens


def summary(cfg: RunConfig, exact_params: int | None = None) -> dict:
    """The accounting of a run. `exact_params` (the model pytree's size, `model.transformer.param_count`)
    is passed in: this module is analytic and imports no model code."""
    m, t = cfg.model, cfg.train
    fwd = fwd_flops_per_token(m, t.seq_len)
    out = {
        "preset": cfg.name,
        "layer_params": layer_terms(m),
        "total_params": total_params(m),
        "active_params": active_params(m),
        "exact_params": exact_params,
        "tokens_per_step": t.tokens_per_step,
        "steps": t.steps,
        "tokens": t.total_tokens,
        "fwd_flops_per_token": fwd,
        "train_flops": train_flops(m, t.seq_len, t.total_tokens),
        "train_flops_6nd": 6.0 * active_params(m) * t.total_tokens,
    }
    return out


LAYER_LABELS = {
    "attention": "attention (d*H*h + 2*d*kv*h + H*h*d)",
    "router": "router (d*E)",
    "latent": "latent projections (2*d*latent)",
    "shared": "shared experts (n_shared*3*d*shared width)",
    "routed": "routed experts, all (E*3*latent*I)",
    "routed_active": "routed experts, active (K*3*latent*I)",
}
LABELS = {
    "total_params": "total parameters (L*(attn+router+latent+shared+all routed) + 2*V*d)",
    "active_params": "active parameters (L*(attn+router+latent+shared+K routed); no embedding/head)",
    "exact_params": "exact parameters of the model pytree (jax.eval_shape; norms, gates, convs incl.)",
    "tokens_per_step": "tokens per step (batch * seq)",
    "steps": "steps",
    "tokens": "tokens (tokens per step * steps)",
    "fwd_flops_per_token": "forward FLOPs per token (latent experts, eff. context, softmax, LM head)",
    "train_flops": "training FLOPs = 3 x forward FLOPs/token x tokens  [the rule we use]",
    "train_flops_6nd": "6 * N_active * D (for comparison only)",
}


def format_summary(s: dict) -> str:
    lines = [f"moejax count: preset {s['preset']}", "  per layer:"]
    lines += [f"    {label:<80} {s['layer_params'][key]:,}" for key, label in LAYER_LABELS.items()]
    for key, label in LABELS.items():
        v = s[key]
        txt = f"{v:,}" if isinstance(v, int) else f"{v:.4g}"
        lines.append(f"  {label:<82} {txt}")
    return "\n".join(lines)
