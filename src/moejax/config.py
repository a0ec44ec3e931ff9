"""Frozen, self-validating configuration and the named presets.

A run is `RunConfig(model, train, parallel, data)`. Every dataclass validates itself in `__post_init__` and
raises `ConfigError` (a `ValueError`) naming the field and the numbers involved. Derived quantities are
properties. Presets live in `PRESETS` (tiny, the ladder rungs d768…d2048, hero); the ladder rule that
maps a width to a rung is `ladder_rung` (SPEC §5).

Sources: SPEC §1 (hero table), §2 (block recipe), §3 (transport), §5 (ladder rule).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

MESH_AXES = ("replica_dcn", "data", "expert", "model")
BATCH_AXES = ("replica_dcn", "data", "expert")


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the field and the values."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(v > 0, f"{n} ({v}) must be positive")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and recipe constants of the MoE transformer (SPEC §2)."""

    vocab_size: int = 128_256
    d_model: int = 6144
    n_layers: int = 48
    n_heads: int = 48
    head_dim: int = 128
    n_kv_heads: int = 12  # projected; local layers use all of them
    n_kv_heads_global: int = 6  # global layers use the first this-many
    window: int = 2048  # sliding window of local layers
    global_every: int = 4  # layer i is global if (i+1) % global_every == 0, or it is the last
    rope_dim: int = 64  # rotary on the first rope_dim dims of each head (local layers only)
    rope_theta: float = 10_000.0
    qk_mult: float = 1.3
    gated_norm_rank: int = 128
    conv_taps: int = 4
    # MoE
    n_experts: int = 384
    top_k: int = 8
    expert_width: int = 3072
    latent_width: int = 3072
    n_shared: int = 2
    shared_width: int = 3072
    combine_scale: float = 2.5  # routed combine weights sum to this
    qb: bool = True  # quantile balancing of the router bias (SPEC §2); no auxiliary loss either way
    qb_bins: int = 10_000
    # numerics
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-6
    z_loss_weight: float = 1e-4
    init_scale: float = 0.5  # sigma = init_scale / sqrt(d_model)
    compute_dtype: str = "bfloat16"
    loss_vocab_block: int = 0  # >0: stream the LM head over vocab blocks of this size
    attn_q_block: int = 0  # >0: attention over query blocks of this size (no [S, S] scores at once)

    def __post_init__(self):
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "n_kv_heads",
                  "n_kv_heads_global", "window", "global_every", "gated_norm_rank", "conv_taps",
                  "n_experts", "top_k", "expert_width", "latent_width", "shared_width", "qb_bins")
        _require(self.n_shared >= 0, f"n_shared ({self.n_shared}) must be >= 0")
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"n_heads ({self.n_heads}) is not divisible by n_kv_heads ({self.n_kv_heads})")
        _require(self.n_kv_heads_global <= self.n_kv_heads,
                 f"n_kv_heads_global ({self.n_kv_heads_global}) exceeds n_kv_heads ({self.n_kv_heads})")
        _require(self.n_heads % self.n_kv_heads_global == 0,
                 f"n_heads ({self.n_heads}) is not divisible by n_kv_heads_global ({self.n_kv_heads_global})")
        _require(self.top_k < self.n_experts,
                 f"top_k ({self.top_k}) must be smaller than n_experts ({self.n_experts}): "
                 "routing picks top-(k+1) for the threshold")
        _require(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
                 f"rope_dim ({self.rope_dim}) must be even and in (0, head_dim={self.head_dim}]")
        _require(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even")
        _require(self.compute_dtype in ("bfloat16", "float32"),
                 f"compute_dtype ({self.compute_dtype!r}) must be 'bfloat16' or 'float32'")
        _require(self.loss_vocab_block >= 0, f"loss_vocab_block ({self.loss_vocab_block}) must be >= 0")
        _require(self.attn_q_block >= 0, f"attn_q_block ({self.attn_q_block}) must be >= 0")

    # ---- derived -------------------------------------------------------------------------------
    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.global_every == 0 or layer == self.n_layers - 1

    @property
    def global_layers(self) -> tuple[bool, ...]:
        return tuple(self.is_global(i) for i in range(self.n_layers))

    @property
    def n_global_layers(self) -> int:
        return sum(self.global_layers)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def init_std(self) -> float:
        return self.init_scale / math.sqrt(self.d_model)


@dataclass(frozen=True)
class TrainConfig:
    """Batch, schedule and run-loop settings."""

    seq_len: int = 4096
    batch_size: int = 11_264  # sequences per step (global)
    steps: int = 390_139
    seed: int = 0
    optimizer: str = "adam"  # "adam" (plain optax Adam on every parameter) or "hero" (MuonH/AdamH/Adam)
    learning_rate: float = 3e-3
    warmup_fraction: float = 0.01
    min_lr_fraction: float = 0.05
    b1: float = 0.9062
    b2: float = 0.95
    eps: float = 1e-8
    log_every: int = 1
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    opt_state_memory: str = "device"  # "device" | "pinned_host": where fp32 master + optimizer state live
    remat: bool = False  # rematerialise each block in the backward pass (the hero needs it for memory)
    checkpoint_every: int = 6000  # permanent checkpoints (SPEC §5: 6,000 on the hero)
    temp_checkpoint_minutes: float = 60.0  # rolling temporary checkpoint, only the newest kept

    def __post_init__(self):
        _positive(self, "seq_len", "batch_size", "steps", "learning_rate", "log_every", "eval_batches",
                  "checkpoint_every", "temp_checkpoint_minutes")
        _require(0.0 <= self.warmup_fraction < 1.0, f"warmup_fraction ({self.warmup_fraction}) must be in [0, 1)")
        _require(0.0 <= self.min_lr_fraction <= 1.0, f"min_lr_fraction ({self.min_lr_fraction}) must be in [0, 1]")
        _require(self.optimizer in ("adam", "hero"), f"optimizer ({self.optimizer!r}) must be 'adam' or 'hero'")
        _require(self.eval_every >= 0, f"eval_every ({self.eval_every}) must be >= 0")
        _require(self.opt_state_memory in ("device", "pinned_host"),
                 f"opt_state_memory ({self.opt_state_memory!r}) must be 'device' or 'pinned_host'")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.steps


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh shape and the expert-parallel transport (SPEC §3)."""

    replica_dcn: int = 1
    data: int = 1
    expert: int = 1
    model: int = 1
    moe_backend: str = "auto"  # "auto": pooled-wave EP when expert > 1, else the local dropless path
    waves: int = 3
    cf_send: float = 1.15
    cf_recv: float = 1.15

    def __post_init__(self):
        _positive(self, "replica_dcn", "data", "expert", "model", "waves", "cf_send", "cf_recv")
        _require(self.moe_backend in ("auto", "local", "ep"),
                 f"moe_backend ({self.moe_backend!r}) must be 'auto', 'local' or 'ep'")
        _require(self.model == 1, f"model axis ({self.model}) > 1 is not supported yet (tensor parallelism)")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.replica_dcn, self.data, self.expert, self.model)

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def batch_shards(self) -> int:
        return self.replica_dcn * self.data * self.expert

    @property
    def use_ep(self) -> bool:
        return self.moe_backend == "ep" or (self.moe_backend == "auto" and self.expert > 1)


def _parse_named(field_name: str, text: str, allow_bare: bool = False) -> dict[str, float]:
    """`a=0.7,b=0.3` -> {"a": 0.7, "b": 0.3}; with allow_bare a single number means "every source" ("*")."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, raw = item.rpartition("=") if "=" in item else ("*", "=", item)
        if (not sep or not name) or (name == "*" and not allow_bare):
            raise ConfigError(f"data.{field_name} item {item!r} is not SOURCE=NUMBER")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"data.{field_name} item {item!r}: {raw!r} is not a number") from None
        _require(value > 0 and math.isfinite(value),
                 f"data.{field_name}: {name!r} has {value}; every value must be a finite number > 0")
        _require(name not in out, f"data.{field_name}: source {name!r} is listed twice")
        out[name] = value
    return out


def _parse_schedule(text: str) -> tuple[tuple[float, int], ...]:
    """`0.5:8192,0.95:65536` -> ((0.5, 8192), (0.95, 65536)): from that fraction of steps, that length."""
    points = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        frac, sep, length = item.partition(":")
        try:
            point = (float(frac), int(length))
        except ValueError:
            raise ConfigError(f"data.context_schedule item {item!r} is not FRACTION:SEQ_LEN") from None
        _require(bool(sep) and 0.0 < point[0] < 1.0 and point[1] > 0,
                 f"data.context_schedule item {item!r}: need 0 < fraction < 1 and seq_len > 0")
        _require(not points or point[0] > points[-1][0],
                 f"data.context_schedule fractions must increase ({points[-1][0] if points else 0} then {point[0]})")
        points.append(point)
    return tuple(points)


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are mixed (SPEC §5). String-valued specs keep `--set` and the
    config.json round trip trivial; parsed forms are properties. Defaults: the embedded KJV corpus."""

    store: str = ""  # a `moejax data prepare` output dir; "" = the embedded KJV (BPE at model.vocab_size)
    weights: str = ""  # "web=0.7,code=0.3"; "" = every source of the store, in proportion to its tokens
    cooldown_weights: str = ""  # second-phase weights; "" = no second phase
    cooldown_start: float = 0.8  # fraction of train.steps where cooldown_weights take over (SPEC §5: ~80%)
    max_epochs: str = ""  # "4" (every source) or "code=4,web=1"; a source leaves the mixture at its cap
    heldout_fraction: float = 0.02  # last fraction of each source's documents: eval only, never trained on
    context_schedule: str = ""  # "0.5:8192,0.95:65536": seq_len from that fraction on, tokens/step fixed
    prefetch: int = 2  # batches computed ahead by a background thread; 0 = synchronous

    def __post_init__(self):
        self.weight_map, self.cooldown_weight_map, self.epoch_caps, self.schedule_points  # validate
        _require(0.0 < self.cooldown_start < 1.0, f"data.cooldown_start ({self.cooldown_start}) must be in (0, 1)")
        _require(0.0 < self.heldout_fraction < 1.0,
                 f"data.heldout_fraction ({self.heldout_fraction}) must be in (0, 1)")
        _require(self.prefetch >= 0, f"data.prefetch ({self.prefetch}) must be >= 0")

    @property
    def weight_map(self) -> dict[str, float]:
        return _parse_named("weights", self.weights)

    @property
    def cooldown_weight_map(self) -> dict[str, float]:
        return _parse_named("cooldown_weights", self.cooldown_weights)

    @property
    def epoch_caps(self) -> dict[str, float]:
        return _parse_named("max_epochs", self.max_epochs, allow_bare=True)

    @property
    def schedule_points(self) -> tuple[tuple[float, int], ...]:
        return _parse_schedule(self.context_schedule)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = "custom"
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        m, t, p = self.model, self.train, self.parallel
        _require(not m.attn_q_block or t.seq_len % m.attn_q_block == 0,
                 f"seq_len ({t.seq_len}) is not divisible by model.attn_q_block ({m.attn_q_block})")
        _require(m.n_experts % p.expert == 0,
                 f"n_experts ({m.n_experts}) is not divisible by the expert axis ({p.expert})")
        _require(t.batch_size % p.batch_shards == 0,
                 f"batch_size ({t.batch_size}) is not divisible by the batch shards "
                 f"(replica_dcn*data*expert = {p.batch_shards})")
        # Expert ids ride in the activation payload (SPEC §3): bf16 holds integers exactly only up to 256,
        # and the header stores local expert + 1 (0 = empty slot).
        e_loc = m.n_experts // p.expert
        if p.use_ep and m.compute_dtype == "bfloat16":
            _require(e_loc + 1 <= 256, f"local experts per device ({e_loc}) + 1 exceeds 256, the largest "
                                       "integer bf16 holds exactly in the transport header")

    def to_dict(self) -> dict:
        return {"name": self.name, "model": dataclasses.asdict(self.model),
                "train": dataclasses.asdict(self.train), "parallel": dataclasses.asdict(self.parallel),
                "data": dataclasses.asdict(self.data)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "RunConfig":
        return RunConfig(model=ModelConfig(**d["model"]), train=TrainConfig(**d["train"]),
                         parallel=ParallelConfig(**d["parallel"]), name=d.get("name", "custom"),
                         data=DataConfig(**d.get("data", {})))


def parse_mesh(text: str) -> dict[str, int]:
    """`replica_dcn=1,data=2,expert=4,model=1` -> dict; omitted axes are 1."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh item {item!r} is not AXIS=N with AXIS one of {', '.join(MESH_AXES)} and N >= 1")
        out[name] = int(value)
    return out


# ---- overrides ---------------------------------------------------------------------------------
_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig, "data": DataConfig}


def _coerce(cls: type, name: str, raw: str) -> Any:
    ftype = {f.name: f.type for f in fields(cls)}[name]
    try:
        if ftype in ("int", int):
            return int(raw)
        if ftype in ("float", float):
            return float(raw)
        if ftype in ("bool", bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
    except ValueError:
        raise ConfigError(f"override {name}={raw!r} is not a valid {ftype}") from None
    return raw


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.field=value` strings (e.g. `model.n_layers=2`); unknown names are errors."""
    changes: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        _require(sep == "=" and dot == ".", f"override {item!r} is not of the form section.field=value")
        _require(section in _SECTIONS, f"override {item!r}: unknown section {section!r} "
                                       f"(one of {', '.join(_SECTIONS)})")
        cls = _SECTIONS[section]
        _require(name in {f.name for f in fields(cls)}, f"override {item!r}: {cls.__name__} has no field {name!r}")
        changes.setdefault(section, {})[name] = _coerce(cls, name, raw)
    return replace(cfg, **{s: replace(getattr(cfg, s), **kw) for s, kw in changes.items()})


# ---- presets -----------------------------------------------------------------------------------
HERO_MODEL = ModelConfig()  # the defaults are the hero (SPEC §1)
# Memory settings of the hero (moejax plan hero): stream the LM head over 16K-wide vocab blocks and
# attention over 512-query blocks, remat every block. They change no value, only what is live at once.
HERO_MEMORY = dict(loss_vocab_block=16_384, attn_q_block=512)

HERO = RunConfig(
    name="hero",
    model=replace(HERO_MODEL, **HERO_MEMORY),
    train=TrainConfig(seq_len=4096, batch_size=11_264, steps=390_139, optimizer="hero", opt_state_memory="pinned_host",
                      remat=True),
    parallel=ParallelConfig(replica_dcn=11, data=1, expert=64, model=1),
    # Seed: 4K -> 8K at 50%, 8K -> 65K at 95%, a 262K phase near the end, tokens per step fixed. The 262K
    # phase has 176 sequences for 704 devices: it needs sequence parallelism, which moejax lacks so far.
    data=DataConfig(context_schedule="0.5:8192,0.95:65536,0.99:262144"),
)

# Ladder rule (SPEC §5): head dim 128; KV heads local H//4, global max(1, H//8); expert width = latent =
# shared width = d/2; 384 experts top-8; batch 1024 sequences per rack (one rack); seq 4096;
# steps = round(791 * active params / tokens per step).
LADDER_SHAPES = {768: (8, 6), 1024: (12, 8), 1536: (16, 12), 2048: (22, 16), 6144: (48, 48)}
TOKENS_PER_ACTIVE_PARAM = 791
LADDER_BATCH = 1024


def ladder_model(d_model: int, n_layers: int, n_heads: int) -> ModelConfig:
    return replace(HERO_MODEL, **HERO_MEMORY, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=max(1, n_heads // 4), n_kv_heads_global=max(1, n_heads // 8),
                   expert_width=d_model // 2, latent_width=d_model // 2, shared_width=d_model // 2)


def ladder_rung(d_model: int) -> RunConfig:
    """The ladder rung at this width: shapes from LADDER_SHAPES, steps from 791 tokens/active param."""
    if d_model not in LADDER_SHAPES:
        raise ConfigError(f"no ladder rung at width {d_model} (known: {sorted(LADDER_SHAPES)})")
    from moejax.accounting import active_params  # local import: accounting depends on config

    n_layers, n_heads = LADDER_SHAPES[d_model]
    model = ladder_model(d_model, n_layers, n_heads)
    train = TrainConfig(seq_len=4096, batch_size=LADDER_BATCH, steps=1, optimizer="hero")
    steps = round(TOKENS_PER_ACTIVE_PARAM * active_params(model) / train.tokens_per_step)
    return RunConfig(name=f"d{d_model}", model=model, train=replace(train, steps=steps),
                     parallel=ParallelConfig(expert=64))


# The CPU demo: every hero feature at toy size (local + global layers, split KV heads, window < seq,
# 16 experts top-2 divisible by 8, 2 shared experts, latent narrower than the width).
TINY = RunConfig(
    name="tiny",
    model=replace(HERO_MODEL, vocab_size=2048, d_model=128, n_layers=4, n_heads=8, head_dim=16,
                  n_kv_heads=2, n_kv_heads_global=1, window=64, rope_dim=8, gated_norm_rank=16,
                  n_experts=16, top_k=2, expert_width=64, latent_width=64, n_shared=2, shared_width=64),
    train=TrainConfig(seq_len=128, batch_size=16, steps=300, optimizer="hero", warmup_fraction=0.05,
                      eval_every=100, b2=0.99, checkpoint_every=100, temp_checkpoint_minutes=2.0),
    parallel=ParallelConfig(),
)


def preset(name: str) -> RunConfig:
    if name == "tiny":
        return TINY
    if name == "hero":
        return HERO
    if name.startswith("d") and name[1:].isdigit() and int(name[1:]) in LADDER_SHAPES and name != "d6144":
        return ladder_rung(int(name[1:]))
    raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESET_NAMES)})")


PRESET_NAMES = ("tiny", "d768", "d1024", "d1536", "d2048", "hero")
