"""The scaling ladder: one dial (the width) -> a full, printed rung config (SPEC §5, STYLE rule 5).

`rung_plan(d)` derives every number of the rung at width d with its formula; `ladder_plan()` lists the
production rungs d768…d2048 and the hero, with their compute as a share of the hero's. The shapes come
from `config.LADDER_SHAPES` / `config.ladder_rung` (the single source of the rule); this module only
explains them.

Sources:
- layers, heads: the run plan table (SPEC §5): d768 (8, 6), d1024 (12, 8), d1536 (16, 12), d2048 (22, 16),
  hero d6144 (48, 48); head dim 128 throughout.
- KV split: local layers use H/4 projected KV heads, global layers the first max(1, H/8) (hero: 12 / 6).
- expert width = latent width = shared-expert width = d/2 (hero: 3072 at d 6144); 384 experts top-8.
- batch: 1024 sequences of 4096 per rack, racks d768 1, d1024 2, d1536 6, d2048 11 (`presets.LADDER_RACKS`), so
  every rack carries the same 4.19M tokens; the hero runs 11 racks at 11,264 sequences. Mesh (racks, 1, 64, 1).
- steps = round(791 * active params / tokens per step) (SPEC §5; the hero's 18.0T tokens / 22.76B active):
  d768 11,420; d1024 15,276; d1536 15,128; d2048 20,072.
- eval: every 5% of a rung's run (every 3,000 steps and at step 0 on the hero), 64 sequences per rack.
- learning rates / beta2 / eps: the fitted heuristic of SPEC §4 (`train.heuristic.optimizer_heuristic`).
- FLOPs: 3 x forward FLOPs/token x tokens (`accounting.fwd_flops_per_token`); 6*N_active*D beside it.

The ladder rungs sum to ~0.42% of the hero's training compute (the run plan's "~1% of compute" budget
leaves room for reruns and ablations).
"""

from __future__ import annotations

from moejax import accounting
from moejax.config import ConfigError, RunConfig
from moejax.presets import HERO, LADDER_SHAPES, SEQUENCES_PER_RACK, TOKENS_PER_ACTIVE_PARAM, ladder_rung
from moejax.train.heuristic import optimizer_heuristic

LADDER_WIDTHS = tuple(sorted(d for d in LADDER_SHAPES if d != HERO.model.d_model))


def hero_train_flops() -> float:
    return accounting.train_flops(HERO.model, HERO.train.seq_len, HERO.train.total_tokens)


def config_numbers(cfg: RunConfig, hero_flops: float | None = None) -> dict:
    """Every derived number of a run config (shapes, params, tokens, lrs, FLOPs, share of the hero)."""
    m, t = cfg.model, cfg.train
    hp = optimizer_heuristic(total_tokens=t.total_tokens, width=m.d_model, batch_tokens=t.tokens_per_step)
    fwd = accounting.fwd_flops_per_token(m, t.seq_len)
    flops = accounting.train_flops(m, t.seq_len, t.total_tokens)
    hero = hero_train_flops() if hero_flops is None else hero_flops
    return {
        "name": cfg.name, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
        "head_dim": m.head_dim, "n_kv_heads": m.n_kv_heads, "n_kv_heads_global": m.n_kv_heads_global,
        "n_global_layers": m.n_global_layers, "n_experts": m.n_experts, "top_k": m.top_k,
        "expert_width": m.expert_width, "latent_width": m.latent_width, "shared_width": m.shared_width,
        "seq_len": t.seq_len, "batch_size": t.batch_size, "tokens_per_step": t.tokens_per_step,
        "racks": cfg.parallel.replica_dcn, "eval_every": t.eval_every, "eval_batch_size": t.eval_rows,
        "active_params": accounting.active_params(m), "total_params": accounting.total_params(m),
        "steps": t.steps, "tokens": t.total_tokens,
        "tokens_per_active_param": t.total_tokens / accounting.active_params(m),
        "adam_lr": hp.adam_lr, "muonh_lr": hp.muonh_lr, "beta1": hp.beta1, "beta2": hp.beta2, "eps": hp.eps,
        "fwd_flops_per_token": fwd, "train_flops": flops,
        "train_flops_6nd": 6.0 * accounting.active_params(m) * t.total_tokens,
        "share_of_hero": flops / hero,
    }


def rung_plan(d_model: int) -> dict:
    """The numbers of the production ladder rung at width d (SPEC §5)."""
    if d_model not in LADDER_WIDTHS:
        raise ConfigError(f"no ladder rung at width {d_model} (rungs: {', '.join(map(str, LADDER_WIDTHS))}; "
                          f"the hero is width {HERO.model.d_model})")
    return config_numbers(ladder_rung(d_model))


def ladder_plan() -> dict:
    hero_flops = hero_train_flops()
    rungs = [config_numbers(ladder_rung(d), hero_flops) for d in LADDER_WIDTHS]
    return {"rungs": rungs, "hero": config_numbers(HERO, hero_flops),
            "ladder_share_of_hero": sum(r["share_of_hero"] for r in rungs),
            "ladder_flops": sum(r["train_flops"] for r in rungs)}


# ---- printing: every number with its formula --------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}"


def format_rung(r: dict) -> str:
    d, h = r["d_model"], r["n_heads"]
    rows = [
        ("layers, heads", f"{r['n_layers']}, {h}", "run-plan table (SPEC §5)"),
        ("head dim; q width", f"{r['head_dim']}; {h * r['head_dim']:,}", "128; H*128"),
        ("KV heads local / global", f"{r['n_kv_heads']} / {r['n_kv_heads_global']}", "H/4 / max(1, H/8)"),
        ("global layers", f"{r['n_global_layers']} of {r['n_layers']}", "(i+1)%4==0 or last"),
        ("experts, top-k", f"{r['n_experts']}, {r['top_k']}", "hero recipe"),
        ("expert / latent / shared width", f"{r['expert_width']} / {r['latent_width']} / {r['shared_width']}",
         f"d/2 = {d}/2"),
        ("batch", f"{r['batch_size']:,} x {r['seq_len']:,} = {r['tokens_per_step']:,} tok",
         f"{SEQUENCES_PER_RACK} seq/rack x {r['racks']} rack{'s' if r['racks'] > 1 else ''}"),
        ("active params N", _fmt(r["active_params"]), "L*(attn+router+latent+shared+K routed)"),
        ("total params", _fmt(r["total_params"]), "L*(...+E routed) + 2*V*d"),
        ("steps", _fmt(r["steps"]),
         "hero preset (= 791 tok/param)" if r["name"] == HERO.name
         else f"round({TOKENS_PER_ACTIVE_PARAM}*N/{r['tokens_per_step']:,})"),
        ("eval", f"every {r['eval_every']:,} steps, {r['eval_batch_size']:,} seq", "64 seq/rack; rungs every 5%"),
        ("tokens D", f"{r['tokens']:.4g} ({r['tokens_per_active_param']:.1f}/param)", "steps * tokens/step"),
        ("adam lr", f"{r['adam_lr']:.3e}", "min(.05, .06602 T^-.395 d^-.15 sqrt(B))"),
        ("muonh lr", f"{r['muonh_lr']:.3e}", "min(.05, 13/3 adam_lr)"),
        ("beta2; eps", f"{r['beta2']:.4f}; {r['eps']:.3e}", "clip(.999^(B/131072)); 9.676e-18 sqrt(T/B)"),
        ("fwd FLOPs/token", f"{r['fwd_flops_per_token']:.4g}", "accounting.fwd_flops_per_token"),
        ("train FLOPs C", f"{r['train_flops']:.4g}", f"3 x fwd x D  (6ND = {r['train_flops_6nd']:.4g})"),
        ("share of hero compute", f"{100 * r['share_of_hero']:.4f}%", "C / C_hero"),
    ]
    head = f"{r['name']} (d={d})"
    return "\n".join([head] + [f"  {k:<31} {v:<34} {why}" for k, v, why in rows])


def format_ladder_plan(plan: dict) -> str:
    parts = [format_rung(r) for r in plan["rungs"]] + [format_rung(plan["hero"])]
    table = [(f"{'rung':<7}{'d':>6}{'L':>4}{'H':>4}{'racks':>6}{'active':>16}{'total':>18}{'steps':>10}{'tokens':>11}"
              f"{'muonh lr':>10}{'FLOPs':>11}{'share':>10}")]
    for r in plan["rungs"] + [plan["hero"]]:
        table.append(f"{r['name']:<7}{r['d_model']:>6}{r['n_layers']:>4}{r['n_heads']:>4}{r['racks']:>6}"
                     f"{r['active_params']:>16,}{r['total_params']:>18,}{r['steps']:>10,}{r['tokens']:>11.3e}{r['muonh_lr']:>10.2e}"
                     f"{r['train_flops']:>11.3e}{100 * r['share_of_hero']:>9.4f}%")
    share = plan["ladder_share_of_hero"]
    total = (f"ladder total: {plan['ladder_flops']:.4g} FLOPs = {100 * share:.3f}% of the hero's "
             f"{plan['hero']['train_flops']:.4g} (the rungs sum to ~{100 * share:.2f}% of hero compute, inside "
             "the run plan's ~1% budget)")
    return "\n\n".join(parts + ["\n".join(table), total])
