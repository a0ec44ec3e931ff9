"""Packing, mixture, phases, epoch caps, determinism across restarts and process counts, context schedule.

Synthetic in-memory stores make every row checkable: in source k, document d is made of the token
k * 600 + d (repeated), so a token names its source and document; EOS is 2047.
"""

from dataclasses import replace

import numpy as np
import pytest

from moejax.config import ConfigError, DataConfig
from moejax.presets import HERO, TINY
from moejax.data.pipeline import make_data
from moejax.data.schedule import ContextSchedule
from moejax.presets import HERO_CONTEXT_SCHEDULE
from moejax.data.store import SourceTokens, Store

EOS, VOCAB = 2047, 2048


def synthetic_store(docs_per_source=(300, 300, 300), seed=0) -> Store:
    rng = np.random.default_rng(seed)
    sources = {}
    for k, n_docs in enumerate(docs_per_source):
        docs = [[k * 600 + d] * int(rng.integers(3, 90)) for d in range(n_docs)]
        sources["abc"[k]] = SourceTokens.from_documents("abc"[k], docs, EOS)
    return Store("", "synthetic", VOCAB, EOS, np.ones(VOCAB, np.int32), sources)


def cfg(steps=100, seq_len=64, batch=16, **data) -> object:
    return replace(TINY, train=replace(TINY.train, steps=steps, seq_len=seq_len, batch_size=batch),
                   data=DataConfig(prefetch=0, **data))


def source_of_rows(b):
    """Source index of each row (a row may start on an EOS; its next token then names the source)."""
    return np.where(b["tokens"][:, 0] == EOS, b["tokens"][:, 1], b["tokens"][:, 0]) // 600


def test_packing_never_crosses_a_document():
    data = make_data(cfg(), store=synthetic_store())
    for step in (0, 7, 99):
        b = data.train.batch(step)
        tok, tgt, seg, pos, mask = (b[k] for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask"))
        assert tok.dtype == tgt.dtype == seg.dtype == pos.dtype == np.int32 and mask.dtype == bool
        assert (seg[:, 0] == 1).all() and set(np.unique(np.diff(seg, axis=1))) <= {0, 1}
        new_doc = np.diff(seg, axis=1) == 1
        assert (pos[:, 1:][new_doc] == 0).all() and (np.diff(pos, axis=1)[~new_doc] == 1).all()
        # a segment starts right after an EOS and only there; every segment is one document
        assert ((tok[:, :-1] == EOS) == new_doc).all()
        doc = np.where(tok == EOS, -1, tok)
        for r in range(len(tok)):
            for s in np.unique(seg[r]):
                ids = set(doc[r][seg[r] == s]) - {-1}
                assert len(ids) <= 1
        # loss only where the target is in the token's document: EOS is predicted, the next doc's first token not
        assert (mask[:, :-1] == ~new_doc).all()
        assert not mask[tok == EOS].any() and mask[tgt == EOS].all()
        assert (tgt[:, :-1] == tok[:, 1:]).all()


def test_mixture_proportions_and_cooldown_switch():
    data = make_data(cfg(steps=200, weights="a=0.5,b=0.3,c=0.2", cooldown_weights="c=1", cooldown_start=0.75),
                     store=synthetic_store())
    counts = np.zeros(3)
    for step in range(150):
        counts += np.bincount(source_of_rows(data.train.batch(step)), minlength=3)
        assert abs(counts[0] - 0.5 * 16 * (step + 1)) <= 1.0  # apportioned: within a row at every step
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=1e-3)
    assert set(source_of_rows(data.train.batch(149))) != {2}
    for step in (150, 151, 199):  # round(0.75 * 200) = 150: the cooldown weights take over exactly here
        assert set(source_of_rows(data.train.batch(step))) == {2}


SPEC_COOLDOWN_START = 0.8  # SPEC §5: "cooldown weights take over at ~80% of steps"


def test_cooldown_takes_over_at_80_percent_by_default():
    assert DataConfig().cooldown_start == SPEC_COOLDOWN_START
    data = make_data(cfg(steps=200, weights="a=0.5,b=0.5", cooldown_weights="c=1"), store=synthetic_store())
    assert set(source_of_rows(data.train.batch(159))) == {0, 1}  # round(0.8 * 200) = 160: the main mix before
    for step in (160, 199):
        assert set(source_of_rows(data.train.batch(step))) == {2}


def test_epoch_cap_and_epochs_visit_each_window_once():
    store = synthetic_store((60, 300, 300))
    data = make_data(cfg(steps=100, weights="a=0.5,b=0.5", max_epochs="a=1", heldout_fraction=0.1), store=store)
    rows = [source_of_rows(data.train.batch(s)) for s in range(100)]
    n_a = sum(int((r == 0).sum()) for r in rows)
    windows_a = (store.sources["a"].heldout_cut(0.1) - 1) // 64
    assert windows_a - 8 < n_a <= windows_a  # one epoch, less at most one step's share
    last_a = max(s for s, r in enumerate(rows) if (r == 0).any())
    assert last_a < 99 and all(set(r) == {1} for r in rows[last_a + 1:])  # a left; b took its share
    # within the epoch no window repeats: the (first token, position) pairs of a's rows are distinct
    seen = [tuple(b) for s in range(last_a + 1) for b in _row_keys(data.train.batch(s), 0)]
    assert len(seen) == len(set(seen)) == n_a
    with pytest.raises(ConfigError, match="max_epochs"):
        make_data(cfg(steps=400, max_epochs="1", heldout_fraction=0.1), store=store)


def _row_keys(b, k):
    src = source_of_rows(b)
    return [(int(b["tokens"][r, 0]), int(b["positions"][r, 0])) for r in np.flatnonzero(src == k)]


def test_same_seed_step_same_batch_across_restarts_prefetch_and_processes():
    store, c = synthetic_store(), cfg(steps=50, weights="a=0.6,b=0.2,c=0.2")
    ref = make_data(c, store=store)
    with make_data(replace(c, data=replace(c.data, prefetch=3)), store=store) as pre:
        seq = {s: pre.train.batch(s) for s in range(20)}  # in order, through the background thread
        resumed = {s: pre.train.batch(s) for s in (13, 14, 15)}  # a "resume" mid-run jumps back
    for s in (19, 3, 13, 14):
        _same(ref.train.batch(s), seq[s])
    for s, b in resumed.items():
        _same(ref.train.batch(s), b)
    for procs in (2, 4):
        for s in (0, 11):
            parts = [make_data(c, store=store, process_index=p, process_count=procs).train.batch(s)
                     for p in range(procs)]
            _same(ref.train.batch(s), {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    other_seed = make_data(replace(c, train=replace(c.train, seed=1)), store=store)
    assert not np.array_equal(other_seed.train.batch(0)["tokens"], ref.train.batch(0)["tokens"])


@pytest.mark.parametrize("eval_rows", [6, 2])
def test_eval_rows_that_processes_cant_share_are_refused(eval_rows):
    """Train rows must divide over the processes; eval rows too: 6 over 4 processes read 4 rows between them,
    2 over 4 failed inside numpy."""
    c = cfg()
    c = replace(c, train=replace(c.train, eval_batch_size=eval_rows))
    with pytest.raises(ConfigError, match=f"{eval_rows} eval rows are not divisible by the process count \\(4\\)"):
        make_data(c, store=synthetic_store(), process_index=0, process_count=4)
    assert make_data(c, store=synthetic_store(), process_index=0, process_count=2).eval.batch(0)["tokens"].shape[0] \
        == eval_rows // 2


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_heldout_documents_are_never_trained_on():
    store = synthetic_store()
    data = make_data(cfg(steps=300, heldout_fraction=0.1), store=store)
    first_eval = {k: int(round(300 * 0.9)) for k in range(3)}  # 30 of 300 documents per source held out
    train, evals = [data.train.batch(s) for s in range(300)], [data.eval.batch(i) for i in range(20)]
    for batches, is_eval in ((train, False), (evals, True)):
        toks = np.concatenate([b["tokens"].ravel() for b in batches])
        toks = toks[toks != EOS]
        held = (toks % 600) >= np.vectorize(first_eval.get)(toks // 600)
        assert held.all() if is_eval else not held.any()


def test_context_schedule_keeps_tokens_per_step():
    data = make_data(cfg(steps=10, seq_len=64, batch=16, context_schedule="0.5:128,0.8:256"), store=synthetic_store())
    for step, (length, bsz) in {0: (64, 16), 4: (64, 16), 5: (128, 8), 7: (128, 8), 8: (256, 4), 9: (256, 4)}.items():
        b = data.train.batch(step)
        assert b["tokens"].shape == (bsz, length) and data.train.seq_len_at(step) == length
        assert data.schedule.batch_size_at(step) == bsz and bsz * length == 1024
    s = ContextSchedule.from_config(HERO.train, DataConfig(context_schedule=HERO_CONTEXT_SCHEDULE))
    n = HERO.train.steps
    assert [(b[1], b[2]) for b in s.boundaries] == [(4096, 11264), (8192, 5632), (65536, 704), (262144, 176)]
    assert s.seq_len_at(round(0.5 * n) - 1) == 4096 and s.seq_len_at(round(0.5 * n)) == 8192
    assert s.batch_size_at(n - 1) == 176
    with pytest.raises(ConfigError, match="not divisible by seq_len 100"):
        make_data(cfg(context_schedule="0.5:100"), store=synthetic_store())


def test_bad_mixture_configs_are_config_errors():
    store = synthetic_store()
    with pytest.raises(ConfigError, match=r"'zzz', not in the store \(sources: a, b, c\)"):
        make_data(cfg(weights="zzz=1"), store=store)
    with pytest.raises(ConfigError, match=r"data.weights: 'a' has -1.0"):
        cfg(weights="a=-1")
    with pytest.raises(ConfigError, match=r"2048 ids\) but model.vocab_size is 1000"):
        c = cfg()
        make_data(replace(c, model=replace(c.model, vocab_size=1000)), store=store)


def test_embedded_kjv_default():
    with make_data(TINY) as data:
        b = data.train.batch(0)
        assert b["tokens"].shape == (16, 128) and data.vocab_size == 2048
        assert data.bytes_per_token.shape == (2048,) and data.bytes_per_token.dtype == np.int32
        assert data.describe()["sources"]["kjv"]["documents"] == 1189
        e = data.eval.batch(0)
        assert e["tokens"].shape == (16, 128) and e["loss_mask"].any()


def test_plan_respects_caps_phases_and_schedule_at_hero_scale():
    """The plan alone (no tokens): a capped source leaves exactly when its budget would overflow, the
    cooldown and context phases start at their steps, and every step is covered once."""
    from moejax.data.mixture import apportion, build_plan

    s = ContextSchedule.from_config(HERO.train, DataConfig(context_schedule=HERO_CONTEXT_SCHEDULE))
    train_tokens = [10**13 // 4, 10**12, 10**11]
    n_windows = lambda k, L: (train_tokens[k] - 1) // L  # noqa: E731
    cool = round(0.8 * HERO.train.steps)
    spans = build_plan(n_windows, [(0, {0: 0.6, 1: 0.3, 2: 0.1}), (cool, {0: 0.3, 1: 0.3, 2: 0.4})], {2: 2.0},
                       list(s.boundaries), HERO.train.steps, ["web", "code", "math"])
    assert spans[0].start == 0 and spans[-1].stop == HERO.train.steps
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    starts = {sp.start for sp in spans}
    assert cool in starts and {b[0] for b in s.boundaries} <= starts
    math_span = spans[0]
    assert math_span.sources == (0, 1, 2) and all(2 not in sp.sources for sp in spans[1:])
    used = apportion((math_span.stop - math_span.start) * math_span.batch_size, list(math_span.weights))[2]
    budget = 2 * n_windows(2, 4096)
    assert used <= budget < used + apportion(math_span.batch_size, list(math_span.weights))[2] + 1
