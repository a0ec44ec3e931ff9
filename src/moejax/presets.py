"""The named presets and the ladder rule: tiny (the CPU demo), the ladder rungs d768…d2048, hero.

Everything here is a `RunConfig` built from the dataclasses in `moejax.config`; nothing else in the
package defines a preset. `preset(name)` is what the CLI calls.

Sources: SPEC §1 (hero table), §5 (ladder rule, context extension).
"""

from __future__ import annotations

from dataclasses import replace

from moejax.accounting import active_params
from moejax.config import ConfigError, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig

HERO_MODEL = ModelConfig()  # the dataclass defaults are the hero (SPEC §1)
# Memory settings of the hero (moejax plan hero): stream the LM head over 16K-wide vocab blocks and
# attention over 512-query blocks, remat every block. They change no value, only what is live at once.
HERO_MEMORY = dict(loss_vocab_block=16_384, attn_q_block=512)
# The hero's remat keeps nothing of the transport: kept, its all-to-all results take 356 GB per device (both
# directions; 178 GB the dispatch ones alone) over the 48 layers at 65,536 tokens per device — more than a
# GB200 has (XLA's memory plan, docs/LOG.md 2026-12-01, fourth session). The backward then reruns the
# forward's 2W all-to-alls per layer (18 per layer instead of 12). d2048, the one rung with remat, keeps them.
HERO_REMAT_SAVES = "nothing"
# The seed's context extension (SPEC §5): 4K (twice the sequences per batch, for expert balancing) -> 8K
# at 50%, -> 65K at 95%, a 262K phase near the end, tokens per step fixed. The 262K phase has 176
# sequences for 704 devices: it runs with context parallelism 4 (RunConfig.phases).
HERO_CONTEXT_SCHEDULE = "0.5:8192,0.95:65536,0.99:262144"

# ---- racks and evaluation (SPEC §5) ----------------------------------------------------------------
SEQUENCES_PER_RACK = 1024  # training batch: 1024 sequences of 4096 per rack (4.19M tokens), on every rung
EVAL_SEQUENCES_PER_RACK = 64  # eval batch: 64 sequences per rack
EXPERT_SHARDS = 64  # EP64 inside a rack (16 nodes x 4 GPUs)
HERO_RACKS = 11
HERO_EVAL_EVERY = 3000  # the hero evaluates every 3,000 steps, and at step 0
RUNG_EVAL_FRACTION = 0.05  # the rungs evaluate every 5% of the run

HERO = RunConfig(
    name="hero",
    model=replace(HERO_MODEL, **HERO_MEMORY),
    train=TrainConfig(seq_len=4096, batch_size=SEQUENCES_PER_RACK * HERO_RACKS, steps=390_139, optimizer="hero",
                      opt_state_memory="pinned_host", remat=True, remat_saves=HERO_REMAT_SAVES,
                      scan_layers=True,  # 48 layers on 704 devices: a compile time independent of depth
                      eval_every=HERO_EVAL_EVERY, eval_at_start=True,
                      eval_batch_size=EVAL_SEQUENCES_PER_RACK * HERO_RACKS),
    parallel=ParallelConfig(replica_dcn=HERO_RACKS, data=1, expert=EXPERT_SHARDS, model=1),
    data=DataConfig(context_schedule=HERO_CONTEXT_SCHEDULE),
)

# ---- the ladder rule (SPEC §5) ----------------------------------------------------------------------
# Width -> (layers, heads); head dim 128. 6144 is the hero itself.
LADDER_SHAPES = {768: (8, 6), 1024: (12, 8), 1536: (16, 12), 2048: (22, 16), 6144: (48, 48)}
TOKENS_PER_ACTIVE_PARAM = 791  # steps = round(791 * active params / tokens per step)
# Racks (data-parallel replicas over the data-centre network) per width: the batch is 1024 sequences per
# rack, so every rack carries the same 4.19M tokens and drop dynamics stay comparable across rungs; d2048
# runs the hero's 11 racks (11,264 sequences).
LADDER_RACKS = {768: 1, 1024: 2, 1536: 6, 2048: 11, 6144: HERO_RACKS}
# Rungs that need block remat to fit their cluster: without it d2048's activations come to 224 GB a device by
# `moejax plan` (a B200 has 186). The narrower rungs fit without it (d1536: 124 GB) and take the faster
# remat-free step, unrolled (train.scan_layers).
LADDER_REMAT = {768: False, 1024: False, 1536: False, 2048: True, 6144: True}


def ladder_shape(base: ModelConfig, d_model: int, n_layers: int, n_heads: int) -> ModelConfig:
    """`base` at another width: KV heads local H//4, global max(1, H//8); expert = latent = shared width d/2.
    The one place this rule is written; the ladder rungs and the CPU micro-ladder both call it."""
    return replace(base, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=max(1, n_heads // 4), n_kv_heads_global=max(1, n_heads // 8),
                   expert_width=d_model // 2, latent_width=d_model // 2, shared_width=d_model // 2)


def ladder_rung(d_model: int) -> RunConfig:
    """The ladder rung at this width: shapes from LADDER_SHAPES, 1024 sequences x LADDER_RACKS racks per step
    on a (racks, 1, 64, 1) mesh, steps from 791 tokens/active param, an eval every 5% of the run, block remat
    where LADDER_REMAT says it is needed."""
    if d_model not in LADDER_SHAPES:
        raise ConfigError(f"no ladder rung at width {d_model} (known: {sorted(LADDER_SHAPES)})")
    model = ladder_shape(replace(HERO_MODEL, **HERO_MEMORY), d_model, *LADDER_SHAPES[d_model])
    racks = LADDER_RACKS[d_model]
    train = TrainConfig(seq_len=4096, batch_size=SEQUENCES_PER_RACK * racks, steps=1, optimizer="hero",
                        eval_batch_size=EVAL_SEQUENCES_PER_RACK * racks, remat=LADDER_REMAT[d_model])
    steps = round(TOKENS_PER_ACTIVE_PARAM * active_params(model) / train.tokens_per_step)
    train = replace(train, steps=steps, eval_every=max(1, round(RUNG_EVAL_FRACTION * steps)))
    return RunConfig(name=f"d{d_model}", model=model, train=train,
                     parallel=ParallelConfig(replica_dcn=racks, expert=EXPERT_SHARDS))


# The CPU demo: every hero feature at toy size (local + global layers, split KV heads, window < seq,
# 16 experts top-2 divisible by 8, 2 shared experts, latent narrower than the width).
TINY = RunConfig(
    name="tiny",
    model=replace(HERO_MODEL, vocab_size=2048, d_model=128, n_layers=4, n_heads=8, head_dim=16,
                  n_kv_heads=2, n_kv_heads_global=1, window=64, rope_dim=8, gated_norm_rank=16,
                  n_experts=16, top_k=2, expert_width=64, latent_width=64, n_shared=2, shared_width=64),
    train=TrainConfig(seq_len=128, batch_size=16, steps=300, optimizer="hero", warmup_fraction=0.05,
                      eval_every=100, checkpoint_every=100, temp_checkpoint_minutes=2.0,
                      load_log_every=5),  # [4 x 16] loads are small: a 60-column heat map in `moejax report`
    parallel=ParallelConfig(),
)

PRESET_NAMES = ("tiny", "d768", "d1024", "d1536", "d2048", "hero")


def preset(name: str) -> RunConfig:
    if name == "tiny":
        return TINY
    if name == "hero":
        return HERO
    if name in PRESET_NAMES:
        return ladder_rung(int(name[1:]))
    raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESET_NAMES)})")
