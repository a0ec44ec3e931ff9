"""The training loop's one entry point to data: `make_data(run_cfg) -> DataBundle`.

    data = make_data(cfg, process_index=jax.process_index(), process_count=jax.process_count())
    batch = data.train.batch(step)   # numpy tokens/targets/segment_ids/positions/loss_mask, this process's rows
    data.eval.batch(i); data.bytes_per_token; data.describe(); data.close()

`cfg.data.store == ""` is the embedded KJV corpus with a BPE trained at `model.vocab_size` (the demo),
prepared into the cache on first use (`kjv_store`); otherwise a store written by `moejax data prepare`.
Eval batches use the first-phase weights at the base sequence length and `train.eval_rows` sequences (SPEC §5:
64 per rack), so eval numbers stay comparable across context-length phases.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from moejax.config import ConfigError, RunConfig
from moejax.data.corpus import bible_documents
from moejax.data.loader import MixtureLoader, chunk_rows
from moejax.data.mixture import Span, build_plan, integer_weights
from moejax.data.prepare import prepare
from moejax.data.schedule import ContextSchedule
from moejax.data.store import Store, StoreError, open_store
from moejax.data.tokenizer import cache_dir, corpus_key


class Prefetcher:
    """Computes the next `depth` batches on one background thread; a request for any other step (a resume,
    an eval index) is computed in the caller's thread, so results never depend on timing."""

    def __init__(self, loader, depth: int):
        self.loader, self.depth = loader, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"moejax-data-{loader.split}")
        self.pending: dict[int, object] = {}
        self.lock = threading.Lock()
        self.stall_s, self.batches, self.hits = 0.0, 0, 0

    def batch(self, step: int) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        with self.lock:
            fut = self.pending.pop(step, None)
            for s in [s for s in self.pending if not step < s <= step + self.depth]:
                self.pending.pop(s).cancel()
            for s in range(step + 1, step + 1 + self.depth):
                if s not in self.pending:
                    self.pending[s] = self.pool.submit(self.loader.batch, s)
        out = fut.result() if fut is not None else self.loader.batch(step)
        self.stall_s += time.perf_counter() - t0
        self.batches, self.hits = self.batches + 1, self.hits + (fut is not None)
        return out

    def stats(self) -> dict:
        """Time the caller spent waiting for batches (the loader's stall on the step) and prefetch hits."""
        return {"stall_s": self.stall_s, "batches": self.batches, "prefetch_hits": self.hits}

    def __getattr__(self, name):  # seq_len_at, batch_size_at, span_at ... of the wrapped loader
        return getattr(self.loader, name)

    def close(self) -> None:
        with self.lock:
            for f in self.pending.values():
                f.cancel()
            self.pending.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class ChunkedLoader:
    """The train loader with context parallelism: each step's rows cut into the phase's `context` chunks
    (`chunk_rows`) after packing, so segment ids, positions and targets are the whole sequence's."""

    loader: MixtureLoader
    schedule: ContextSchedule

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return chunk_rows(self.loader.batch(step), self.schedule.phase_at(step).context)

    def __getattr__(self, name):  # seq_len_at, batch_size_at, span_at, split ... of the wrapped loader
        return getattr(self.loader, name)


@dataclass
class DataBundle:
    train: object  # ChunkedLoader or a Prefetcher of it: .batch(step), .seq_len_at(step), .batch_size_at(step)
    eval: MixtureLoader
    bytes_per_token: np.ndarray  # int32 [model.vocab_size] (ids past the tokenizer's vocab count 0)
    vocab_size: int  # the tokenizer's
    schedule: ContextSchedule
    store: Store
    info: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {**self.store.describe(), **self.info, "context_schedule": self.schedule.describe()}

    def stats(self) -> dict:
        """Loader stall so far (seconds the caller waited in `train.batch`), e.g. for a `data/stall_s` metric."""
        return self.train.stats() if isinstance(self.train, Prefetcher) else {}

    def close(self) -> None:
        if isinstance(self.train, Prefetcher):
            self.train.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_data(run_cfg: RunConfig, *, process_index: int = 0, process_count: int = 1,
              store: Store | None = None) -> DataBundle:
    """The run's data; `store` overrides `run_cfg.data.store` (tests build small ones in memory)."""
    d, t, m = run_cfg.data, run_cfg.train, run_cfg.model
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index ({process_index}) must be in [0, process_count={process_count})")
    if store is None:
        store = open_store(d.store) if d.store else kjv_store(m.vocab_size)
    if store.vocab_size > m.vocab_size:
        raise ConfigError(f"data store {store.path or '(in memory)'} was tokenised with {store.tokenizer_spec} "
                          f"({store.vocab_size} ids) but model.vocab_size is {m.vocab_size}: add "
                          f"--set model.vocab_size={store.vocab_size}")
    names = list(store.sources)
    sources = tuple(store.sources[n] for n in names)
    cuts = [s.heldout_cut(d.heldout_fraction) for s in sources]
    schedule = ContextSchedule.from_config(t, d, process_count, run_cfg.parallel)
    if t.eval_batches and t.eval_rows % process_count:  # each process reads its own equal share of the rows
        raise ConfigError(f"train.eval_batch_size: {t.eval_rows} eval rows are not divisible by the process count "
                          f"({process_count}); set it to a multiple")
    phases = _phases(d, t.steps, names, [c - 1 for c in cuts])
    caps = {names.index(n): c for n, c in _caps(d, names).items()}
    used = sorted({k for _, w in phases for k in w})
    for k in used:
        for _, length, _ in schedule.boundaries:
            _need_tokens(names[k], "train", cuts[k], length)
        if t.eval_batches:  # the held-out split stays cut off either way: the train data doesn't change
            _need_tokens(names[k], "eval", sources[k].n_tokens - cuts[k], t.seq_len)

    def n_windows(k, seq_len):
        return (cuts[k] - 1) // seq_len

    spans = build_plan(n_windows, phases, caps, list(schedule.boundaries), t.steps, names)
    common = dict(sources=sources, seed=t.seed, vocab_size=store.vocab_size, process_index=process_index,
                  process_count=process_count)
    train = MixtureLoader(ranges=tuple((0, c) for c in cuts), spans=tuple(spans), split="train", **common)
    first = phases[0][1]
    eval_span = Span(0, 1, t.seq_len, t.eval_rows, tuple(sorted(first)),
                     tuple(integer_weights([first[k] for k in sorted(first)])), tuple(0 for _ in first))
    evals = MixtureLoader(ranges=tuple((c, s.n_tokens) for c, s in zip(cuts, sources)), spans=(eval_span,),
                          split="eval", **common)
    bpt = np.zeros((m.vocab_size,), np.int32)
    bpt[:store.vocab_size] = store.bytes_per_token
    info = {"mixture": _describe_plan(spans, names, n_windows), "heldout_fraction": d.heldout_fraction,
            "process_index": process_index, "process_count": process_count, "prefetch": d.prefetch}
    train = ChunkedLoader(train, schedule)
    return DataBundle(Prefetcher(train, d.prefetch) if d.prefetch else train, evals, bpt, store.vocab_size,
                      schedule, store, info)


def _need_tokens(name: str, split: str, n: int, seq_len: int) -> None:
    if n < seq_len + 2:
        raise ConfigError(f"source {name!r} has {n} {split} tokens, fewer than seq_len + 2 ({seq_len + 2}); "
                          "add data or lower the sequence length / data.heldout_fraction")


def _check_names(field_name: str, given, names: list[str]) -> None:
    unknown = sorted(set(given) - set(names) - {"*"})
    if unknown:
        raise ConfigError(f"data.{field_name} names {', '.join(map(repr, unknown))}, not in the store "
                          f"(sources: {', '.join(names)})")


def _phases(d, steps: int, names: list[str], train_tokens: list[int]) -> list[tuple[int, dict[int, float]]]:
    """[(first step, {source index: weight})]: the main weights, then the cooldown weights if given."""
    main = d.weight_map or {n: float(max(tok, 1)) for n, tok in zip(names, train_tokens)}
    _check_names("weights", main, names)
    phases = [(0, {names.index(n): w for n, w in main.items()})]
    if d.cooldown_weights:
        _check_names("cooldown_weights", d.cooldown_weight_map, names)
        phases.append((round(d.cooldown_start * steps), {names.index(n): w for n, w in d.cooldown_weight_map.items()}))
    return phases


def _caps(d, names: list[str]) -> dict[str, float]:
    caps = d.epoch_caps
    _check_names("max_epochs", caps, names)
    if "*" in caps:
        return {n: caps.get(n, caps["*"]) for n in names}
    return caps


def _describe_plan(spans: list[Span], names: list[str], n_windows) -> list[dict]:
    out = []
    for s in spans:
        total = sum(s.weights)
        out.append({"steps": [s.start, s.stop], "seq_len": s.seq_len, "batch_size": s.batch_size,
                    "weights": {names[k]: round(w / total, 6) for k, w in zip(s.sources, s.weights)},
                    "epochs_at_start": {names[k]: round(f / n_windows(k, s.seq_len), 4)
                                        for k, f in zip(s.sources, s.first_window)}})
    return out


def kjv_store(vocab_size: int) -> Store:
    """The embedded default: KJV chapters with a BPE trained at `vocab_size`, prepared once into the cache
    (what `moejax data prepare --source kjv=builtin:kjv --tokenizer bpe:VOCAB` writes) and opened like any
    store. The store is built under a temporary name and renamed, so processes racing on the first use
    all open the one complete store."""
    path = cache_dir() / f"kjv-{corpus_key(bible_documents())}-bpe{vocab_size}.store"
    if not (path / "manifest.json").is_file():
        try:
            prepare({"kjv": ["builtin:kjv"]}, f"bpe:{vocab_size}", str(path), progress=False)
        except StoreError:
            if not (path / "manifest.json").is_file():  # not a race another process won: a real failure
                raise
    return open_store(str(path))


def run_tokenizer(run_cfg: RunConfig):
    """The tokenizer a run's data was built with (an `HFTokenizer` or `TiktokenTokenizer`: encode_batch,
    decode, eos_id, vocab_size, save): the store's (the embedded KJV default is a store in the cache too)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from moejax.data.tokenizer import HFTokenizer, TiktokenTokenizer, llama3_model_path

    d = run_cfg.data
    store = open_store(d.store) if d.store else kjv_store(run_cfg.model.vocab_size)
    spec, path = store.tokenizer_spec, Path(store.path) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(Tokenizer.from_file(str(path)), spec)
    if spec == "llama3":
        try:
            return TiktokenTokenizer(llama3_model_path(), spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    raise ConfigError(f"data store {store.path} has no tokenizer.json (tokenizer {spec!r})")
