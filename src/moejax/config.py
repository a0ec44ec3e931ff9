"""Frozen, self-validating configuration: the dataclasses and nothing else.

A run is `RunConfig(model, train, parallel, data, alarms)`. Every dataclass validates itself in `__post_init__` and
raises `ConfigError` (a `ValueError`) naming the field and the numbers involved. Derived quantities are
properties. The named presets (tiny, ladder rungs, hero) and the ladder rule live in `moejax.presets`;
mesh axis names and PartitionSpecs in `moejax.parallel.mesh`. This module imports nothing from moejax.

Sources: SPEC §1 (hero table), §2 (block recipe), §3 (transport), §5 (ladder rule).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the field and the values."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's text (libraries raise multi-line ones; a user error is one line), or its
    type's name where it has no text."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


MAX_INT = 2**31  # every int field: sizes, steps and seeds reach jax as int32 (a larger one crashed mid-run)
MAX_PREFETCH = 64  # batches the loader computes ahead: more only holds memory


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _finite_floats(obj: Any) -> None:
    """Every float field is a finite number: inf/nan (which `float()` parses) would reach the run silently."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.type in ("float", float) and isinstance(v, float):
            _require(math.isfinite(v), f"{f.name} ({v}) must be a finite number")


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
        _finite_floats(self)
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "n_kv_heads",
                  "n_kv_heads_global", "window", "global_every", "gated_norm_rank", "conv_taps",
                  "n_experts", "top_k", "expert_width", "latent_width", "shared_width", "qb_bins")
        # a zero or negative eps, RoPE base, scale or init std gives NaN or a dead model at step 0, after the
        # run dir is written
        _positive(self, "rope_theta", "qk_mult", "combine_scale", "norm_eps", "qk_norm_eps", "init_scale")
        _require(self.z_loss_weight >= 0, f"z_loss_weight ({self.z_loss_weight}) must be >= 0")
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


# What block remat may keep of the EP transport (TrainConfig.remat_saves), and the all-to-alls per wave and
# layer of a training step with each: forward dispatch + return, their backward transposes, and the
# re-forward's collectives that are not kept.
REMAT_SAVES = ("transport", "dispatch", "nothing")
ALL_TO_ALLS_PER_WAVE = {"transport": 4, "dispatch": 5, "nothing": 6}

@dataclass(frozen=True)
class TrainConfig:
    """Batch, schedule and run-loop settings."""

    seq_len: int = 4096
    batch_size: int = 11_264  # sequences per step (global)
    steps: int = 390_139
    seed: int = 0
    optimizer: str = "hero"  # "hero" (MuonH/AdamH/Adam, SPEC §4) or "adam" (plain optax Adam on every parameter)
    learning_rate: float = 3e-3
    warmup_fraction: float = 0.01
    min_lr_fraction: float = 0.05
    b1: float = 0.9062
    b2: float = 0.95
    eps: float = 1e-8
    log_every: int = 1
    # Per-expert loads ([L, E] train/router/load) go to metrics.jsonl only every this many steps (and at the
    # last step): at hero shape they are ~230 KB of JSON per row. 0 = never. Scalars follow log_every.
    load_log_every: int = 100
    eval_every: int = 0  # also evaluate after every this-many steps; 0: only at the end
    eval_at_start: bool = False  # also evaluate the initial weights (logged with step 0) on a fresh run
    eval_batches: int = 4  # held-out batches per evaluation; 0: no evaluation at all (whatever the two above say)
    eval_batch_size: int = 0  # sequences per eval batch (SPEC §5: 64 per rack); 0: train.batch_size
    weight_decay: float = 0.0  # decoupled decay on head gate and router only (SPEC §4: optional 0.02)
    opt_state_memory: str = "device"  # "device" | "pinned_host": where fp32 master + optimizer state live
    remat: bool = False  # rematerialise each block in the backward pass (the hero needs it for memory)
    # What block remat keeps of the EP transport for the backward pass: "transport", both all-to-all results
    # of every wave and layer (the backward reruns no collective: 4 x W all-to-alls per layer, and
    # L x 2W waves of memory per device); "dispatch", the dispatch results only (SPEC §3.6; 5 x W); or
    # "nothing" (6 x W). At the hero the first two need 356 / 178 GB per device (docs/LOG.md 2026-12-01).
    remat_saves: str = "transport"
    # True: lax.scan over the layers, whose compile time is independent of depth (the hero: 48 layers on 704
    # devices). False: unrolled, the default. Unrolled is faster in every layout measured and needs no more
    # memory, because a scan writes each layer's saved activations into per-layer stacks. At issue 11's shape
    # G on one H200 (XLA's compiled roofline): 119 vs 207 ms and 49 vs 76 GB without remat, 148 vs 161 ms with
    # it; d1024 with remat 289 vs 305 ms at 55 GB both; CPU 1.2-1.3x at 4 layers. The cost is compile time
    # (~3x at 12 layers). Changes values only by float rounding (~1e-5 in the tiny model's loss: XLA fuses a
    # scanned body otherwise), so a restart that switches it is not bitwise (transformer.run_layers).
    scan_layers: bool = False
    checkpoint_every: int = 6000  # permanent checkpoints (SPEC §5: 6,000 on the hero)
    temp_checkpoint_minutes: float = 60.0  # rolling temporary checkpoint, only the newest kept

    def __post_init__(self):
        _finite_floats(self)
        _positive(self, "seq_len", "batch_size", "steps", "learning_rate", "log_every", "checkpoint_every",
                  "temp_checkpoint_minutes")
        # jax.random.key takes a non-negative int64, numpy's Generator (the data order) a non-negative int.
        # jax (without x64) keeps a seed's low 32 bits: seed 2**32 made the same weights as seed 0
        _require(0 <= self.seed < 2**32, f"seed ({self.seed}) must be in [0, 2**32)")
        _require(0.0 <= self.warmup_fraction < 1.0, f"warmup_fraction ({self.warmup_fraction}) must be in [0, 1)")
        _require(0.0 <= self.min_lr_fraction <= 1.0, f"min_lr_fraction ({self.min_lr_fraction}) must be in [0, 1]")
        _require(self.optimizer in ("adam", "hero"), f"optimizer ({self.optimizer!r}) must be 'adam' or 'hero'")
        for n in ("b1", "b2"):  # Adam's decay rates: b2 = 1 divides by zero in the bias correction
            _require(0.0 <= getattr(self, n) < 1.0, f"{n} ({getattr(self, n)}) must be in [0, 1)")
        _positive(self, "eps")
        _require(self.eval_every >= 0, f"eval_every ({self.eval_every}) must be >= 0")
        _require(self.eval_batches >= 0, f"eval_batches ({self.eval_batches}) must be >= 0")
        _require(self.eval_batch_size >= 0, f"eval_batch_size ({self.eval_batch_size}) must be >= 0")
        _require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                 f"weight_decay ({self.weight_decay}) must be a finite number >= 0")
        _require(self.load_log_every >= 0, f"load_log_every ({self.load_log_every}) must be >= 0")
        _require(self.opt_state_memory in ("device", "pinned_host"),
                 f"opt_state_memory ({self.opt_state_memory!r}) must be 'device' or 'pinned_host'")
        _require(self.remat_saves in REMAT_SAVES,
                 f"remat_saves ({self.remat_saves!r}) must be one of {', '.join(REMAT_SAVES)}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.steps

    @property
    def eval_rows(self) -> int:
        """Sequences per eval batch: eval_batch_size, or the training batch size when it is 0."""
        return self.eval_batch_size or self.batch_size


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh shape and the expert-parallel transport (SPEC §3)."""

    # Mesh axis sizes, in the order of parallel.mesh.MESH_AXES.
    replica_dcn: int = 1  # data-parallel replicas across racks (data-centre network)
    data: int = 1  # data-parallel (FSDP) shards inside a rack
    expert: int = 1  # expert-parallel shards: routed experts split over them, tokens exchanged all-to-all
    model: int = 1  # tensor parallelism (not supported yet: must be 1)
    # Which routed-expert implementation runs; names are resolved by parallel.backends ("auto": the
    # pooled-wave transport when expert > 1, else the dropless local path).
    moe_backend: str = "auto"
    waves: int = 3  # W: all-to-all rounds per MoE layer; assignments are striped over them round-robin
    cf_send: float = 1.15  # sender capacity factor: pool rows per destination per wave = cf_send*A/(X*W)
    cf_recv: float = 1.15  # receiver capacity factor: rows per local expert per wave = cf_recv*A/(E_loc*W)
    # Context parallelism: each sequence split into this many consecutive rows (chunks) over the batch
    # shards. 0 = automatic per context phase: batch shards / sequences when a phase has fewer sequences
    # than batch shards, else 1. A phase's `cp=` in data.context_schedule wins (RunConfig.phases).
    context: int = 0

    def __post_init__(self):
        _finite_floats(self)
        _positive(self, "replica_dcn", "data", "expert", "model", "waves", "cf_send", "cf_recv")
        _require(self.context >= 0, f"parallel.context ({self.context}) must be >= 0 (0 = automatic)")
        _require(self.model == 1, f"model axis ({self.model}) > 1 is not supported yet (tensor parallelism)")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Axis sizes in MESH_AXES order (replica_dcn, data, expert, model)."""
        return (self.replica_dcn, self.data, self.expert, self.model)

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def batch_shards(self) -> int:
        return self.replica_dcn * self.data * self.expert

    @property
    def resolved_backend(self) -> str:
        """The backend name with "auto" resolved: "ep" when the expert axis is used, else "local"."""
        if self.moe_backend == "auto":
            return "ep" if self.expert > 1 else "local"
        return self.moe_backend

    @property
    def use_ep(self) -> bool:
        """True when tokens cross devices through the pooled-wave transport (capacity, drops)."""
        return self.resolved_backend == "ep"


# Mixture weights are relative and caps count epochs: anything larger is a typo, and 1e303 overflowed to inf in
# the integer apportionment (an OverflowError mid-run, not a config error).
MAX_NAMED_VALUE = 1e15


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
        _require(0 < value <= MAX_NAMED_VALUE, f"data.{field_name}: {name!r} has {value}; every value must be a "
                                               f"number > 0 and <= {MAX_NAMED_VALUE:g}")
        _require(name not in out, f"data.{field_name}: source {name!r} is listed twice")
        out[name] = value
    return out


SCHEDULE_OPTIONS = {"cf": float, "cf_send": float, "cf_recv": float, "cp": int}


def _parse_schedule(text: str) -> tuple[tuple[float, int, dict], ...]:
    """`0.5:8192,0.95:65536:cf=1.5,0.99:262144:cp=4` -> ((0.5, 8192, {}), (0.95, 65536, {"cf_send": 1.5,
    "cf_recv": 1.5}), ...): from that fraction of steps, that length, and optionally that phase's capacity
    factors (cf = both, or cf_send / cf_recv) and context-parallel degree (cp)."""
    points = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        frac, sep, rest = item.partition(":")
        length, *opts = rest.split(":")
        try:
            point = (float(frac), int(length))
        except ValueError:
            raise ConfigError(f"data.context_schedule item {item!r} is not FRACTION:SEQ_LEN[:cf=X][:cp=N]") from None
        _require(bool(sep) and 0.0 < point[0] < 1.0 and point[1] > 0,
                 f"data.context_schedule item {item!r}: need 0 < fraction < 1 and seq_len > 0")
        _require(not points or point[0] > points[-1][0],
                 f"data.context_schedule fractions must increase ({points[-1][0] if points else 0} then {point[0]})")
        points.append((*point, _parse_phase_options(item, opts)))
    return tuple(points)


def _parse_phase_options(item: str, opts: list[str]) -> dict:
    out: dict[str, Any] = {}
    for opt in opts:
        key, sep, raw = opt.partition("=")
        _require(bool(sep) and key in SCHEDULE_OPTIONS, f"data.context_schedule item {item!r}: {opt!r} is not one "
                                                        f"of {', '.join(k + '=' for k in SCHEDULE_OPTIONS)}")
        try:
            value = SCHEDULE_OPTIONS[key](raw)
        except ValueError:
            raise ConfigError(f"data.context_schedule item {item!r}: {key}={raw!r} is not a number") from None
        _require(value > 0 and math.isfinite(value), f"data.context_schedule item {item!r}: {key} ({value}) must be > 0")
        for k in (("cf_send", "cf_recv") if key == "cf" else (key,)):
            _require(k not in out, f"data.context_schedule item {item!r}: {k} is given twice")
            out[k] = value
    return out


@dataclass(frozen=True)
class ContextPhase:
    """One phase of the context schedule as it runs: `sequences` of `seq_len` per step, each split into
    `context` consecutive rows of `chunk` positions (context parallelism), with its capacity factors."""

    start: int  # first step
    seq_len: int
    sequences: int  # per step (global)
    context: int  # context-parallel degree: rows per sequence
    cf_send: float
    cf_recv: float

    @property
    def chunk(self) -> int:
        return self.seq_len // self.context

    @property
    def rows(self) -> int:
        return self.sequences * self.context


def context_phases(train: "TrainConfig", data: "DataConfig", parallel: "ParallelConfig") -> tuple[ContextPhase, ...]:
    """The schedule's phases, ascending, validated: tokens per step divide by every seq_len; the context degree
    (the phase's `cp=`, else parallel.context, else automatic: batch shards / sequences when a phase has fewer
    sequences than batch shards, 1 otherwise) divides the seq_len and the batch shards, and sequences x
    context rows divide over the batch shards."""
    tps, shards = train.tokens_per_step, parallel.batch_shards
    points = {0: (train.seq_len, {})}
    for frac, length, opts in data.schedule_spec:
        points[round(frac * train.steps)] = (length, opts)  # a later phase on the same step wins
    phases = []
    for step, (length, opts) in sorted(points.items()):
        where = f"context schedule: seq_len {length} (from step {step})"
        _require(tps % length == 0, f"context schedule: tokens per step ({tps} = {train.seq_len} x "
                                    f"{train.batch_size}) is not divisible by seq_len {length} (from step {step})")
        n = tps // length
        c = opts.get("cp") or parallel.context
        if not c:  # automatic: only when the phase has fewer sequences than batch shards
            c = 1 if n >= shards else shards // n
        _require(length % c == 0, f"{where}: context-parallel degree {c} does not divide the sequence length {length}")
        _require(shards % c == 0, f"{where}: context-parallel degree {c} does not divide the batch shards "
                                  f"(replica_dcn*data*expert = {shards})")
        if step == 0 and c == 1:
            _require(n % shards == 0, f"batch_size ({n}) is not divisible by the batch shards "
                                      f"(replica_dcn*data*expert = {shards})")
        _require((n * c) % shards == 0, f"{where}: {n} sequences x context-parallel degree {c} = {n * c} rows "
                                        f"is not divisible by the batch shards (replica_dcn*data*expert = {shards}); "
                                        f"set cp=N on the phase or parallel.context")
        phases.append(ContextPhase(step, length, n, c, opts.get("cf_send", parallel.cf_send),
                                   opts.get("cf_recv", parallel.cf_recv)))
    return tuple(phases)


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
    # "0.5:8192,0.95:65536:cf=1.5,0.99:262144:cp=4": seq_len from that fraction on, tokens/step fixed; a
    # phase may set its capacity factors (cf = both, cf_send, cf_recv) and context-parallel degree (cp)
    context_schedule: str = ""
    prefetch: int = 2  # batches computed ahead by a background thread; 0 = synchronous

    def __post_init__(self):
        _finite_floats(self)
        self.weight_map, self.cooldown_weight_map, self.epoch_caps, self.schedule_points  # validate
        _require(0.0 < self.cooldown_start < 1.0, f"data.cooldown_start ({self.cooldown_start}) must be in (0, 1)")
        _require(0.0 < self.heldout_fraction < 1.0,
                 f"data.heldout_fraction ({self.heldout_fraction}) must be in (0, 1)")
        _require(0 <= self.prefetch <= MAX_PREFETCH, f"data.prefetch ({self.prefetch}) must be in [0, {MAX_PREFETCH}]")

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
        return tuple((frac, length) for frac, length, _ in self.schedule_spec)

    @property
    def schedule_spec(self) -> tuple[tuple[float, int, dict], ...]:
        """(fraction, seq_len, {cf_send, cf_recv, cp: the phase's overrides})."""
        return _parse_schedule(self.context_schedule)


@dataclass(frozen=True)
class AlarmConfig:
    """Routing-health alarms (moejax.train.alarms): thresholds over metrics the train step already returns.
    Routing checks run every `every` steps and count in checks; the grad-norm check runs every step (a
    spike lasts one step). Monitoring only: changing these between restarts of a run is allowed."""

    enabled: bool = True
    every: int = 10  # steps between routing checks (collapse, dead experts, drops, bias drift)
    patience: int = 3  # consecutive bad checks before collapse / dead-expert / high-drop alarms
    window: int = 50  # checks in the drop and bias trend windows; steps in the grad-norm median
    collapse_ratio: float = 4.0  # a layer's max / mean expert load at or above this is collapsing
    dead_load: float = 0.01  # an expert's load / mean load at or below this is dead
    drop_max: float = 0.10  # drop fraction at or above this (hero at 4K: ~3%, SPEC §5)
    drop_rise: float = 0.03  # drop fraction rising by this much across a full window (fitted line)
    bias_range_max: float = 20.0  # max over layers of the router bias range (max - min over experts)
    bias_growth: float = 1.0  # bias range rising across a full window by this fraction of its mean
    grad_spike: float = 10.0  # grad norm at or above this many times the median of the last `window` steps

    def __post_init__(self):
        _finite_floats(self)  # an infinite threshold would switch its alarm off quietly (alarms.enabled does that)
        _positive(self, "every", "patience", "collapse_ratio", "drop_max", "drop_rise", "bias_range_max",
                  "bias_growth", "grad_spike")
        _require(self.window >= 3, f"alarms.window ({self.window}) must be >= 3 (a trend needs three points)")
        _require(self.collapse_ratio > 1.0, f"alarms.collapse_ratio ({self.collapse_ratio}) must be > 1 "
                                            "(max / mean load is 1 when balanced)")
        _require(0.0 <= self.dead_load < 1.0, f"alarms.dead_load ({self.dead_load}) must be in [0, 1)")
        _require(self.grad_spike > 1.0, f"alarms.grad_spike ({self.grad_spike}) must be > 1")
        _require(self.drop_max <= 1.0, f"alarms.drop_max ({self.drop_max}) must be <= 1")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = "custom"
    data: DataConfig = field(default_factory=DataConfig)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)

    def __post_init__(self):
        for section in ("model", "train", "parallel", "data", "alarms"):  # sizes, steps, seeds: jax's int32
            for f in fields(getattr(self, section)):
                v = getattr(getattr(self, section), f.name)
                _require(f.name == "seed" or not isinstance(v, int) or isinstance(v, bool) or abs(v) < MAX_INT,
                         f"{section}.{f.name} ({v}) must be below 2**31")
        m, t, p = self.model, self.train, self.parallel
        _require(not m.attn_q_block or t.seq_len % m.attn_q_block == 0,
                 f"seq_len ({t.seq_len}) is not divisible by model.attn_q_block ({m.attn_q_block})")
        _require(m.n_experts % p.expert == 0,
                 f"n_experts ({m.n_experts}) is not divisible by the expert axis ({p.expert})")
        for ph in self.phases:  # batch over the shards at every context phase, with its CP degree
            _require(not m.attn_q_block or ph.chunk <= m.attn_q_block or ph.chunk % m.attn_q_block == 0,
                     f"context schedule: seq_len {ph.seq_len} / context-parallel degree {ph.context} = chunk "
                     f"{ph.chunk} is not divisible by model.attn_q_block ({m.attn_q_block})")
        _require(not t.eval_batches or t.eval_rows % p.batch_shards == 0,
                 f"eval_batch_size ({t.eval_rows}) is not divisible by the batch shards "
                 f"(replica_dcn*data*expert = {p.batch_shards})")

    @property
    def phases(self) -> tuple[ContextPhase, ...]:
        return context_phases(self.train, self.data, self.parallel)

    def to_dict(self) -> dict:
        return {"name": self.name, "model": dataclasses.asdict(self.model),
                "train": dataclasses.asdict(self.train), "parallel": dataclasses.asdict(self.parallel),
                "data": dataclasses.asdict(self.data), "alarms": dataclasses.asdict(self.alarms)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @staticmethod
    def from_dict(d: dict) -> "RunConfig":
        return RunConfig(model=ModelConfig(**d["model"]), train=TrainConfig(**d["train"]),
                         parallel=ParallelConfig(**d["parallel"]), name=d.get("name", "custom"),
                         data=DataConfig(**d.get("data", {})), alarms=AlarmConfig(**d.get("alarms", {})))


# ---- overrides ---------------------------------------------------------------------------------
_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig, "data": DataConfig,
             "alarms": AlarmConfig}
# Read only by the `adam` optimizer; `hero` derives its lrs, betas and eps from the fitted heuristic (SPEC §4).
ADAM_ONLY = ("learning_rate", "b1", "b2", "eps")


def _coerce(cls: type, section: str, name: str, raw: str) -> Any:
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
        raise ConfigError(f"override {section}.{name}={raw!r} is not a valid {ftype}") from None
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
        changes.setdefault(section, {})[name] = _coerce(cls, section, name, raw)
    out = replace(cfg, **{s: replace(getattr(cfg, s), **kw) for s, kw in changes.items()})
    ignored = [f"train.{n}" for n in ADAM_ONLY if n in changes.get("train", {})]
    _require(out.train.optimizer != "hero" or not ignored,
             f"{', '.join(ignored)} would have no effect: train.optimizer=hero takes its learning rates, betas "
             "and eps from the fitted heuristic (SPEC §4); drop the override or add --set train.optimizer=adam")
    return out
