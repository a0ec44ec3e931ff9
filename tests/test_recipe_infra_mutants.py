"""SPEC §5 (checkpoints, resume, data pipeline) mutation audit: each test here fails on one realistic bug that the
rest of the suite let through, and passes on the real code.

Checkpoints: the newest *complete* one is resumed, a crashed save never counts as complete, a damaged or
superseded one is never left looking complete, a permanent one is never demoted. Data: the held-out split is
never read by training, bad token ids and bad store files are one-line errors, eval mixes are fixed, mixture
weights follow source names. Resume: a restart with another data mixture is refused."""

import json
import os
import shutil
import threading

import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax.config import apply_overrides
from moejax.data.pipeline import make_data
from moejax.data.prepare import prepare
from moejax.data.store import SourceTokens, Store, StoreError, open_store, sha256_file
from moejax.fsio import atomic_write_chunks
from moejax.presets import preset
from moejax.train.run_dir import RunError, prepare_run_dir
from tests.test_checkpoint import steps_on_disk, tiny_state
from tests.test_data_loader import EOS, VOCAB, cfg, source_of_rows, synthetic_store


# ---------------------------------------------------------------------------------------------- checkpoints


def test_a_run_whose_only_save_crashed_starts_fresh(tmp_path):
    """SPEC §5: resume from the newest *complete* checkpoint. A first save killed before its marker leaves only
    an incomplete dir: that is no checkpoint at all, so the restart starts fresh (None), not a hard error that
    would keep the run from ever starting again."""
    with ck.CheckpointManager(tmp_path, permanent_every=10) as mgr:
        mgr.save(10, tiny_state(10))
    (tmp_path / "checkpoints" / "step_00000010" / ck.MARKER).unlink()  # as if killed before the marker
    assert ck.restore_latest(tmp_path, tiny_state(0)) is None


def _gate_the_commit(monkeypatch, mgr):
    """Hold the commit thread where orbax's background array write may still be running (before the marker)."""
    entered, release = threading.Event(), threading.Event()
    real = mgr._ckptr.wait_until_finished

    def gated():
        if threading.current_thread().name.startswith("ckpt-commit"):
            entered.set()
            assert release.wait(timeout=30)
        return real()

    monkeypatch.setattr(mgr._ckptr, "wait_until_finished", gated)
    return entered, release


SAVED_STEP = 4


def _save_held_before_its_marker(tmp_path, monkeypatch):
    """Save SAVED_STEP with its commit held before the marker: no step may look complete meanwhile."""
    mgr = ck.CheckpointManager(tmp_path, permanent_every=SAVED_STEP)
    entered, release = _gate_the_commit(monkeypatch, mgr)
    mgr.save(SAVED_STEP, tiny_state(SAVED_STEP))
    assert entered.wait(timeout=30)
    try:
        assert steps_on_disk(tmp_path) == []
    finally:
        release.set()
    mgr.wait()
    mgr.close()


def test_a_checkpoint_is_not_complete_while_its_arrays_are_being_written(tmp_path, monkeypatch):
    """SPEC §5 'written atomically': until the array write has finished, the step dir must not look complete
    (a kill -9 then would leave a torn checkpoint that a resume trusts). The marker comes strictly after."""
    _save_held_before_its_marker(tmp_path, monkeypatch)
    assert steps_on_disk(tmp_path) == [SAVED_STEP]


def test_a_save_over_a_broken_checkpoint_of_that_step_is_not_complete_until_written(tmp_path, monkeypatch):
    """A complete-looking but damaged checkpoint at step 4 (left behind after a fallback restore) is replaced
    by the new save of step 4: its old marker must be gone before the new arrays are written, or the half
    written dir looks complete."""
    with ck.CheckpointManager(tmp_path, permanent_every=SAVED_STEP) as old:
        old.save(SAVED_STEP, tiny_state(99))
    broken = tmp_path / "checkpoints" / ck.step_dir_name(SAVED_STEP)
    for f in (broken / ck.STATE).rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    _save_held_before_its_marker(tmp_path, monkeypatch)
    state, _ = ck.restore(broken, tiny_state(0))
    assert float(state["x"][0]) == SAVED_STEP


class SimulatedCrash(BaseException):
    pass


def test_a_crash_while_deleting_a_superseded_temporary_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    """A superseded temporary is deleted marker first (SPEC §5: resume from the newest *complete* checkpoint):
    a crash right after the first deletion of its files must not leave a complete-looking dir without state."""
    clock = [0.0]
    mgr = ck.CheckpointManager(tmp_path, permanent_every=1000, temporary_every_s=10, clock=lambda: clock[0])
    mgr.save(5, tiny_state(5), kind="temporary")
    mgr.wait()
    old = tmp_path / "checkpoints" / ck.step_dir_name(5)
    real_rmtree = ck.shutil.rmtree

    def crash_after_first_removal(path, *a, **kw):
        real_rmtree(path, *a, **kw)
        if str(path).startswith(str(old)):
            raise SimulatedCrash
    monkeypatch.setattr(ck.shutil, "rmtree", crash_after_first_removal)
    mgr.save(9, tiny_state(9), kind="temporary")
    with pytest.raises(ck.CheckpointError):
        mgr.wait()
    monkeypatch.undo()
    mgr.close()
    for info in ck.list_checkpoints(tmp_path):
        if info.complete:  # whatever still claims to be complete must restore
            state, meta = ck.restore(info.path, tiny_state(0))
            assert int(state["step"]) == meta["step"] == info.step


PERMANENT_EVERY = 10


def test_a_temporary_save_never_demotes_a_permanent_checkpoint(tmp_path):
    """SPEC §5: permanent checkpoints are kept; only temporaries roll. A temporary save at a step already saved
    permanent must not relabel it temporary, or the next checkpoint deletes it."""
    with ck.CheckpointManager(tmp_path, permanent_every=PERMANENT_EVERY) as mgr:
        mgr.save(PERMANENT_EVERY, tiny_state(PERMANENT_EVERY), kind="permanent")
        mgr.wait()
        mgr.save(PERMANENT_EVERY, tiny_state(PERMANENT_EVERY), kind="temporary")
        mgr.wait()
        mgr.save(PERMANENT_EVERY + 2, tiny_state(PERMANENT_EVERY + 2), kind="temporary")
    assert steps_on_disk(tmp_path) == [PERMANENT_EVERY, PERMANENT_EVERY + 2]
    meta = json.loads((tmp_path / "checkpoints" / ck.step_dir_name(PERMANENT_EVERY) / ck.METADATA).read_text())
    assert meta["temporary"] is False


def test_a_checkpoint_with_unreadable_metadata_is_never_deleted(tmp_path):
    """A permanent checkpoint whose metadata.json got damaged cannot say whether it is temporary: the garbage
    collection after a newer save must keep it (its arrays are the user's), never delete what it cannot identify."""
    with ck.CheckpointManager(tmp_path, permanent_every=PERMANENT_EVERY) as mgr:
        mgr.save(PERMANENT_EVERY, tiny_state(PERMANENT_EVERY))
        mgr.wait()
        damaged = tmp_path / "checkpoints" / ck.step_dir_name(PERMANENT_EVERY)
        (damaged / ck.METADATA).write_text("{not json")
        mgr.save(PERMANENT_EVERY + 1, tiny_state(PERMANENT_EVERY + 1), kind="temporary")
    assert (damaged / ck.STATE).is_dir() and steps_on_disk(tmp_path) == [PERMANENT_EVERY, PERMANENT_EVERY + 1]


def test_every_process_falls_back_when_another_could_not_restore_the_newest(tmp_path, monkeypatch):
    """Multi-process resume: when another process failed to restore the newest checkpoint, this one must fall
    back with it (every host resumes from the same step), even though its own restore worked."""
    with ck.CheckpointManager(tmp_path, permanent_every=10) as mgr:
        mgr.save(10, tiny_state(10))
        mgr.save(20, tiny_state(20))
    calls = []

    def any_process(flag):  # the first restore (step 20) failed on another process; the second worked everywhere
        calls.append(flag)
        return True if len(calls) == 1 else flag

    monkeypatch.setattr(ck, "any_process", any_process)
    state, meta = ck.restore_latest(tmp_path, tiny_state(0))
    assert meta["step"] == 10 and int(state["step"]) == 10


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    """SPEC §5: an error never overwrites or half-writes a file. A write that fails midway (a full disk) leaves
    the old content and no temp file beside it."""
    path = tmp_path / "summary.json"
    path.write_text("old")

    def chunks():
        yield b"new, half of it"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write_chunks(path, chunks())
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


# ---------------------------------------------------------------------------------------------- resume


BASE = apply_overrides(preset("tiny"), ["model.n_layers=2", "train.steps=6"])


@pytest.mark.parametrize("change", ["data.weights=kjv=1", "data.cooldown_start=0.5", "data.cooldown_weights=kjv=1"])
def test_a_restart_with_another_data_mixture_is_refused(tmp_path, change):
    """SPEC §5: data order is a pure function of (seed, step) and resume is exact; another mixture or cooldown
    on restart would change which data every later step reads, so it is a different run."""
    run = tmp_path / "run"
    assert prepare_run_dir(run, BASE, overwrite=False) is False
    with pytest.raises(RunError, match="different run"):
        prepare_run_dir(run, apply_overrides(BASE, [change]), overwrite=False)


# ---------------------------------------------------------------------------------------------- data


def one_source_store(docs) -> Store:
    """An in-memory store of one source "a" holding `docs` (token lists), each closed by EOS."""
    sources = {"a": SourceTokens.from_documents("a", docs, EOS)}
    return Store("", "synthetic", VOCAB, EOS, np.ones(VOCAB, np.int32), sources)


SEQ = 16
N_TRAIN_DOCS = 9
HELDOUT_TOKEN = N_TRAIN_DOCS + 1  # the held-out document's token value


def test_training_never_reads_a_heldout_token_even_as_the_last_target():
    """The train split ends exactly on a window boundary (9 documents x 16 tokens = 9 x seq_len): a window reads
    seq_len + 1 tokens, so the last whole window must stop one short, or its final target is the first token of
    the held-out (eval) documents. Every train window is visited (20 rows > 8 windows)."""
    docs = [[d + 1] * (SEQ - 1) for d in range(N_TRAIN_DOCS)] + [[HELDOUT_TOKEN] * 40]
    store = one_source_store(docs)
    assert store.sources["a"].heldout_cut(0.1) == N_TRAIN_DOCS * SEQ  # the split ends on a window boundary
    data = make_data(cfg(steps=5, seq_len=SEQ, batch=4, heldout_fraction=0.1), store=store)
    for step in range(5):
        b = data.train.batch(step)
        assert HELDOUT_TOKEN not in b["tokens"] and HELDOUT_TOKEN not in b["targets"]


def test_a_token_id_equal_to_the_vocab_size_is_refused_by_the_loader():
    """Ids run 0..vocab_size-1; vocab_size itself is out of range (an embedding lookup would clamp it)."""
    docs = [[VOCAB] * 30 for _ in range(20)]
    store = one_source_store(docs)
    data = make_data(cfg(steps=5, seq_len=SEQ, batch=4), store=store)
    with pytest.raises(StoreError, match=f"token id {VOCAB} .*>= the tokenizer's vocab_size {VOCAB}"):
        data.train.batch(0)


MARKER_AT = SEQ  # the first token of window 1 is the last target of window 0
CLEAN_MARK = 5


def test_an_out_of_range_id_only_among_the_targets_is_refused():
    """A target id >= vocab_size is as bad as an input id (the loss would read a clamped logit). With one row a
    step, window 0 holds the damaged token only as its last target (the marker sits where window 1 starts):
    the step reading window 0 must be refused too. The clean twin (the marker a valid id) finds that step;
    the order of windows does not depend on token values."""
    def loader(mark):
        toks = [[1] * 47 for _ in range(2)] + [[1] * 40]
        store = one_source_store(toks)
        store.sources["a"].tokens[MARKER_AT] = mark
        return make_data(cfg(steps=6, seq_len=SEQ, batch=1, heldout_fraction=0.3), store=store).train

    clean, bad = loader(CLEAN_MARK), loader(VOCAB)
    target_only = [s for s in range(6) if CLEAN_MARK in clean.batch(s)["targets"]
                   and CLEAN_MARK not in clean.batch(s)["tokens"]]
    assert target_only  # window 0 is read in the first epoch
    for s in target_only:
        with pytest.raises(StoreError, match=f"token id {VOCAB}"):
            bad.batch(s)


def test_eval_batches_use_the_main_mixture_not_the_cooldown():
    """Eval numbers stay comparable over the run: eval reads the first-phase weights (sources a and b here),
    never the cooldown's (only c)."""
    data = make_data(cfg(steps=200, weights="a=0.5,b=0.5", cooldown_weights="c=1"), store=synthetic_store())
    seen = set()
    for i in range(4):
        seen |= set(source_of_rows(data.eval.batch(i)).tolist())
    assert seen == {0, 1}


def test_mixture_weights_follow_the_source_names_not_their_order():
    """data.weights names its sources; listed in another order than the store's, each weight still goes to the
    source it names (c=0.75 here: three rows of four from c)."""
    data = make_data(cfg(steps=50, batch=16, weights="c=0.75,a=0.25"), store=synthetic_store())
    counts = np.bincount(np.concatenate([source_of_rows(data.train.batch(s)) for s in range(10)]), minlength=3)
    np.testing.assert_allclose(counts / counts.sum(), [0.25, 0.0, 0.75], atol=1e-2)


BPE_VOCAB = 300


@pytest.fixture(scope="module")
def disk_store(tmp_path_factory):
    """A small store written by `prepare` (two sources, several documents each); tests copy it to damage it."""
    raw = tmp_path_factory.mktemp("raw")
    for name in "ab":
        (raw / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} document {i}: " + "words " * (5 + i)})
                                                   + "\n" for i in range(6)))
    out = tmp_path_factory.mktemp("stores") / "store"
    prepare({n: [str(raw / f"{n}.jsonl")] for n in "ab"}, f"bpe:{BPE_VOCAB}", str(out), progress=False)
    return out


def _damaged(disk_store, tmp_path, name, edit, update_sha=True):
    out = tmp_path / "store"
    shutil.copytree(disk_store, out)
    path = out / "a" / name
    arr = np.load(path)
    edit(arr)
    np.save(path, arr)
    if update_sha:  # a consistent manifest: only the content check can tell
        m = json.loads((out / "manifest.json").read_text())
        m["sources"]["a"]["sha256"][name] = sha256_file(path)
        (out / "manifest.json").write_text(json.dumps(m))
    return out


def _set(i, v):
    def edit(a):
        a[i] = v
    return edit


def test_verify_refuses_a_token_file_that_does_not_match_its_sha256(disk_store, tmp_path):
    """`--verify` checks every file against the manifest's sha256: a changed token (still in range) is found."""
    first = int(np.load(disk_store / "a" / "tokens.npy")[0])
    out = _damaged(disk_store, tmp_path, "tokens.npy", _set(0, 1 if first != 1 else 2), update_sha=False)
    with pytest.raises(StoreError, match="sha256 .* does not match"):
        open_store(str(out), verify=True)


def test_verify_refuses_a_token_id_equal_to_the_vocab_size(disk_store, tmp_path):
    """Ids run 0..vocab_size-1 (the manifest's vocab_size: a BPE trained on little text has fewer than asked)."""
    vocab = json.loads((disk_store / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    out = _damaged(disk_store, tmp_path, "tokens.npy", _set(0, vocab))
    with pytest.raises(StoreError, match=f"token id {vocab} is out of range"):
        open_store(str(out), verify=True)


def test_doc_offsets_that_do_not_end_at_the_token_count_are_refused(disk_store, tmp_path):
    """A damaged doc_offsets file of the right shape (its last offset is not the token count) is refused when the
    store is opened, in one line, not trained on with wrong document boundaries."""
    n_tokens = int(np.load(disk_store / "a" / "doc_offsets.npy")[-1])
    out = _damaged(disk_store, tmp_path, "doc_offsets.npy", _set(-1, n_tokens - 1))
    with pytest.raises(StoreError, match="disagree with the manifest"):
        open_store(str(out))


def test_verify_refuses_doc_offsets_with_an_empty_document(disk_store, tmp_path):
    """Every document holds at least its EOS, so offsets rise strictly; a repeated offset is a damaged file."""
    out = _damaged(disk_store, tmp_path, "doc_offsets.npy", _set(1, 0))
    with pytest.raises(StoreError, match="strictly increasing"):
        open_store(str(out), verify=True)


class _OffByOneTokenizer:
    """A tokenizer bug: it emits the id vocab_size (one past its last id)."""

    spec, vocab_size, eos_id, eos_token = "fake", BPE_VOCAB, 0, "<eos>"

    def encode_batch(self, texts):
        return [[1, BPE_VOCAB] for _ in texts]


def test_prepare_refuses_a_tokenizer_id_equal_to_its_vocab_size_and_leaves_nothing(tmp_path, monkeypatch):
    from moejax.data import prepare as prepare_mod

    monkeypatch.setattr(prepare_mod, "tokenizer_from_spec", lambda spec, docs: _OffByOneTokenizer())
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    out = tmp_path / "store"
    with pytest.raises(StoreError, match=f"produced id {BPE_VOCAB} outside its vocabulary of {BPE_VOCAB}"):
        prepare({"a": [str(tmp_path / "a.jsonl")]}, "fake", str(out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


# ---------------------------------------------------------------------------------------------- the loop


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from tests.tiny_run import tiny_run_dir

    return tiny_run_dir(tmp_path_factory)


def test_each_checkpoint_records_the_data_position_it_resumes_at(run_dir):
    """SPEC §5: permanent checkpoints every N steps (tiny_run: N = 1, 2 steps, so after steps 1 and 2), and
    resume is exact, data position included: data order is a function of (seed, step), so the position a
    checkpoint after step N resumes at is step N, and its metadata must say so."""
    steps = steps_on_disk(run_dir)
    assert steps == [1, 2]
    for step in steps:
        meta = json.loads((run_dir / "checkpoints" / ck.step_dir_name(step) / ck.METADATA).read_text())
        assert meta["step"] == step and meta["data_step"] == step
