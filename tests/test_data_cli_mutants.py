"""SPEC §5 data pipeline and the CLI's bad-input handling, mutation audit: each test here fails on one realistic
bug that the rest of the suite let through, and passes on the real code.

Data: a source keeps its place in its epoch across a change of mixture phase, a capped source reads its whole
budget, the held-out split has the documented size, phases start at round(fraction x steps), unknown or bad
mixture names and too-short sources are one-line ConfigErrors. CLI: a bad value is refused (never silently
replaced), the message names it, and the console script hands the exit code on."""

import os
from dataclasses import replace

import numpy as np
import pytest

from moejax.cli import main
from moejax.config import ConfigError, apply_overrides
from moejax.data.mixture import build_plan
from moejax.data.pipeline import make_data
from moejax.data.prepare import prepare
from moejax.data.sources import ReadOptions, SourceError, read_documents
from moejax.data.store import SourceTokens
from moejax.presets import preset
from tests.test_data import _prepare_cli, corpus  # noqa: F401 -- corpus is a fixture
from tests.test_data_loader import EOS, VOCAB, cfg, source_of_rows, synthetic_store
from tests.test_recipe_infra_mutants import one_source_store

# ---------------------------------------------------------------------------------------------- mixture plan


def _window_keys(b, k):
    """One key per row of source k naming the window it read: its first two tokens (a row starting on an EOS is
    named by the next document's token) and the first token's position inside its document."""
    src = source_of_rows(b)
    tok, pos = b["tokens"], b["positions"]
    return [(int(tok[r, 0]), int(tok[r, 1]), int(pos[r, 0])) for r in np.flatnonzero(src == k)]


C_STEPS, C_BATCH, C_SEQ = 40, 4, 64


def test_a_source_keeps_its_place_in_the_epoch_across_every_change_of_phase():
    """SPEC §5: data order is a pure function of (seed, step), and a source that stays in the mixture carries on
    through its epoch when the weights change. Source c is read in three spans here (a leaves at its epoch cap,
    then the cooldown gives c every row); c reads fewer rows than it has windows, so no window may repeat. A
    plan that restarted c's window counter (or forgot the windows of an earlier span) at a switch re-reads them."""
    store = synthetic_store((60, 300, 300))
    data = make_data(cfg(steps=C_STEPS, seq_len=C_SEQ, batch=C_BATCH, weights="a=0.5,c=0.5", cooldown_weights="c=1",
                         max_epochs="a=1", heldout_fraction=0.1), store=store)
    assert len(data.describe()["mixture"]) == 3  # [0, a gone), [a gone, cooldown), [cooldown, end)
    seen = [key for s in range(C_STEPS) for key in _window_keys(data.train.batch(s), 2)]
    assert len(seen) < (store.sources["c"].heldout_cut(0.1) - 1) // C_SEQ  # within c's first epoch
    assert len(seen) == len(set(seen))


CAP_WINDOWS = 10  # windows per epoch of the capped source


def test_a_capped_source_reads_its_whole_budget_before_it_leaves():
    """data.max_epochs: a source leaves the mixture when its next step would take it *past* its cap. Two equal
    weights and two rows a step give source 0 one window a step, so a cap of one epoch (10 windows) ends exactly
    after step 9: it leaves at step 10, not a step early with a window of its budget unread."""
    spans = build_plan(lambda k, seq_len: CAP_WINDOWS, [(0, {0: 1.0, 1: 1.0})], {0: 1.0}, [(0, 64, 2)], 20, ["a", "b"])
    assert [(sp.start, sp.stop, sp.sources) for sp in spans] == [(0, CAP_WINDOWS, (0, 1)), (CAP_WINDOWS, 20, (1,))]


def test_one_row_a_step_over_equal_weights_gives_each_source_its_turn():
    """Rows are apportioned (Sainte-Laguë, ties by source index): the rows of step s are apportion(T + B) minus
    apportion(T), which is one row only if ties are broken the same way when seats are added and removed. With
    one row a step and three equal weights, every step has exactly one row and every 3 steps each source one."""
    data = make_data(cfg(steps=12, seq_len=C_SEQ, batch=1, weights="a=1,b=1,c=1"), store=synthetic_store())
    rows = [source_of_rows(data.train.batch(s)) for s in range(12)]
    assert all(len(r) == 1 for r in rows)
    assert np.bincount(np.concatenate(rows), minlength=3).tolist() == [4, 4, 4]


ODD_FRACTION, ODD_STEPS = 0.29, 100  # 0.29 * 100 = 28.999999999999996: round gives 29, int() gives 28


def test_the_cooldown_and_context_phases_start_at_the_rounded_step():
    """A phase from fraction f starts at step round(f * steps) (schedule.py); a float product just under an
    integer must not move it a step early."""
    data = make_data(cfg(steps=ODD_STEPS, seq_len=C_SEQ, batch=C_BATCH, weights="a=1", cooldown_weights="b=1",
                         cooldown_start=ODD_FRACTION), store=synthetic_store())
    at = round(ODD_FRACTION * ODD_STEPS)
    assert set(source_of_rows(data.train.batch(at - 1))) == {0} and set(source_of_rows(data.train.batch(at))) == {1}
    c = apply_overrides(preset("tiny"), [f"train.steps={ODD_STEPS}", f"data.context_schedule={ODD_FRACTION}:256"])
    assert [(ph.start, ph.seq_len) for ph in c.phases] == [(0, 128), (at, 256)]


def test_default_weights_follow_each_sources_train_tokens():
    """data.weights = "": every source of the store, in proportion to its (train) tokens, not equally."""
    store = synthetic_store((60, 300, 300))
    data = make_data(cfg(steps=50, batch=16, heldout_fraction=0.1), store=store)
    counts = np.bincount(np.concatenate([source_of_rows(data.train.batch(s)) for s in range(10)]), minlength=3)
    train = np.array([store.sources[n].heldout_cut(0.1) for n in "abc"], float)
    np.testing.assert_allclose(counts / counts.sum(), train / train.sum(), atol=0.01)


def test_a_per_source_epoch_cap_wins_over_the_cap_for_every_source():
    """data.max_epochs="10,a=1": a is capped at one epoch (it leaves the mixture), the others at ten."""
    data = make_data(cfg(steps=100, max_epochs="10,a=1", heldout_fraction=0.1), store=synthetic_store((60, 300, 300)))
    assert any("a" not in span["weights"] for span in data.describe()["mixture"])


@pytest.mark.parametrize("field", ["max_epochs", "cooldown_weights"])
def test_an_unknown_source_in_caps_or_cooldown_weights_is_named(field):
    with pytest.raises(ConfigError, match=rf"data.{field} names 'zzz', not in the store \(sources: a, b, c\)"):
        make_data(cfg(**{field: "zzz=1"}), store=synthetic_store())


# ---------------------------------------------------------------------------------------------- processes


def test_a_batch_that_does_not_split_over_the_processes_is_refused():
    """Rows are split into process_count equal slices; 6 sequences over 4 processes would drop rows silently."""
    with pytest.raises(ConfigError, match=r"6 sequences per step .* not divisible by the process count \(4\)"):
        make_data(cfg(seq_len=C_SEQ, batch=6), store=synthetic_store(), process_count=4)


def test_each_process_is_told_its_own_share_of_the_rows():
    """`data.train.batch_size_at(step)` is this process's row count (a pipeline's DataBundle contract), the
    global batch over process_count, as its batches have."""
    data = make_data(cfg(seq_len=C_SEQ, batch=16), store=synthetic_store(), process_index=1, process_count=4)
    assert data.train.batch_size_at(0) == len(data.train.batch(0)["tokens"]) == 4


def test_a_process_index_past_the_last_process_is_refused():
    with pytest.raises(ConfigError, match=r"process_index \(2\) must be in \[0, process_count=2\)"):
        make_data(cfg(), store=synthetic_store(), process_index=2, process_count=2)


# ---------------------------------------------------------------------------------------------- too little data


SHORT = 16  # base seq_len; the schedule's later phase reads windows of 2 x SHORT


def test_a_source_too_short_for_a_later_context_phase_is_one_config_error():
    """Every phase's sequence length needs seq_len + 2 train tokens in every source: 30 train tokens hold a
    window of 16 but none of 32, which must be a ConfigError naming the numbers, not a crash at that phase."""
    store = one_source_store([[1] * 14, [2] * 14, [3] * 40])  # train: 2 documents = 30 tokens
    with pytest.raises(ConfigError, match=r"source 'a' has 30 train tokens, fewer than seq_len \+ 2 \(34\)"):
        make_data(cfg(steps=4, seq_len=SHORT, batch=4, heldout_fraction=0.3, context_schedule="0.5:32"), store=store)


def test_a_heldout_split_too_short_to_evaluate_is_refused_unless_eval_is_off():
    """The held-out split (one document of 10 tokens) cannot fill a window of 16: a ConfigError naming it; with
    train.eval_batches=0 nothing reads it, so the same store is fine."""
    store = one_source_store([[1] * 40, [2] * 40, [3] * 9])
    c = cfg(steps=4, seq_len=SHORT, batch=4, heldout_fraction=0.3)
    with pytest.raises(ConfigError, match=r"source 'a' has 10 eval tokens, fewer than seq_len \+ 2 \(18\)"):
        make_data(c, store=store)
    no_eval = make_data(replace(c, train=replace(c.train, eval_batches=0)), store=store)
    assert no_eval.train.batch(0)["tokens"].shape == (4, SHORT)


def test_eval_batches_keep_the_base_sequence_length_across_context_phases():
    """Eval numbers stay comparable across the run: eval reads train.seq_len windows, whatever phase is last."""
    data = make_data(cfg(steps=10, seq_len=C_SEQ, batch=16, context_schedule="0.5:128"), store=synthetic_store())
    assert data.eval.batch(0)["tokens"].shape == (16, C_SEQ)


def test_ids_past_the_tokenizers_vocabulary_count_no_bytes():
    """bits per byte divides by the bytes each target id decodes to; a model vocabulary padded past the
    tokenizer's (model.vocab_size > the store's) has ids that decode to nothing: 0 bytes, never 1."""
    c = cfg()
    data = make_data(replace(c, model=replace(c.model, vocab_size=2 * VOCAB)), store=synthetic_store())
    assert (data.bytes_per_token[:VOCAB] == 1).all() and (data.bytes_per_token[VOCAB:] == 0).all()


# ---------------------------------------------------------------------------------------------- held-out split


@pytest.mark.parametrize("n_docs, fraction, held", [
    (10, 0.29, 3),  # round(2.9): the nearest count, not the floor
    (10, 0.01, 1),  # at least one document is held out
    (2, 0.9, 1),  # at least one document is left to train on
])
def test_the_heldout_split_is_the_rounded_share_of_documents(n_docs, fraction, held):
    src = SourceTokens.from_documents("a", [[d + 1] * 3 for d in range(n_docs)], EOS)
    assert src.heldout_cut(fraction) == src.doc_offsets[n_docs - held]


# ---------------------------------------------------------------------------------------------- prepare


def test_overwrite_refuses_a_store_with_a_user_file_inside_a_source_dir(corpus, tmp_path, capsys):  # noqa: F811
    """--overwrite replaces a store holding nothing but what prepare wrote; a file of the user's inside a
    source's directory makes it not a pure store: refused, the file kept."""
    out = tmp_path / "store"
    assert _prepare_cli(corpus, out) == 0
    (out / "a" / "notes.md").write_text("mine")
    assert _prepare_cli(corpus, out, "--overwrite") == 2
    assert "moejax did not write a);" in capsys.readouterr().err
    assert (out / "a" / "notes.md").read_text() == "mine"


def test_a_file_named_twice_under_two_spellings_is_refused(tmp_path):
    """The same file as `raw/t.txt` and `raw/./t.txt` is one file read twice: refused before anything is written."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "t.txt").write_text("one\n\ntwo")
    with pytest.raises(SourceError, match="is read twice"):
        prepare({"a": [str(raw / "t.txt")], "b": [os.path.join(raw, ".", "t.txt")]}, "bpe:300", str(tmp_path / "s"),
                progress=False)
    assert sorted(os.listdir(tmp_path)) == ["raw"]


def test_a_whitespace_only_line_separates_paragraphs(tmp_path):
    """--text-split paragraph: paragraphs are separated by a blank line, spaces or tabs on it included."""
    (tmp_path / "p.txt").write_text("first\n \t\nsecond\n\nthird")
    docs = list(read_documents(str(tmp_path / "p.txt"), ReadOptions(split="paragraph")))
    assert docs == ["first", "second", "third"]


@pytest.mark.parametrize("eol", ["\r\n", "\r"], ids=["crlf", "cr"])
def test_paragraphs_split_in_any_line_ending(eol, tmp_path):
    """A CRLF (or old-Mac CR) file splits at its blank lines as an LF file does (it was one document); one
    line break inside a paragraph stays one, its CR included."""
    text = f"first{eol}still first{eol}{eol}second{eol} \t{eol}third{eol}"
    (tmp_path / "p.txt").write_bytes(text.encode())
    docs = list(read_documents(str(tmp_path / "p.txt"), ReadOptions(split="paragraph")))
    assert docs == [f"first{eol}still first", "second", "third"]


def test_bytes_per_token_of_a_non_byte_level_tokenizer_counts_utf8_bytes():
    """Bits per byte needs each id's UTF-8 byte count; for a tokenizer.json that is not byte-level BPE it is the
    encoded length of the id's text (é is 2 bytes, not 1 character), specials 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moejax.data.tokenizer import EOS as EOS_TOKEN, HFTokenizer

    tok = Tokenizer(models.WordLevel({"é": 0, "ab": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS_TOKEN])
    bpt = HFTokenizer(tok, "word.json").bytes_per_token()
    assert bpt[0] == 2 and bpt[1] == 2 and bpt[tok.token_to_id(EOS_TOKEN)] == 0


# ---------------------------------------------------------------------------------------------- config values


@pytest.mark.parametrize("override, words", [
    ("data.context_schedule=0:256", "need 0 < fraction < 1 and seq_len > 0"),
    ("data.context_schedule=0.5:0", "need 0 < fraction < 1 and seq_len > 0"),
    ("data.context_schedule=0.5:256,0.5:512", "fractions must increase (0.5 then 0.5)"),
    ("data.weights=a=1,a=2", "data.weights: source 'a' is listed twice"),
    ("data.weights=0.5", "data.weights item '0.5' is not SOURCE=NUMBER"),
    ("data.heldout_fraction=0", "data.heldout_fraction (0.0) must be in (0, 1)"),
    ("data.cooldown_start=1", "data.cooldown_start (1.0) must be in (0, 1)"),
    ("train.steps=0", "steps (0) must be positive"),
    ("train.remat=yes", "override train.remat='yes' is not a valid bool"),
    ("model.n_layers=two", "override model.n_layers='two' is not a valid int"),
    # numpy's Generator (the data order) takes no negative seed: a traceback after the run dir was written
    ("train.seed=-1", "seed (-1) must be in [0, 2**32)"),
])
def test_a_bad_value_is_refused_in_one_line_naming_it(override, words):
    """README: every config validates itself; a bad value is one line naming the field and the value, never
    accepted (a bare number as weights, a duplicate source, seq_len 0 crashing later) or silently replaced."""
    with pytest.raises(ConfigError) as e:
        apply_overrides(preset("tiny"), [override])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_steps_zero_on_the_command_line_is_refused_not_ignored(tmp_path, capsys):
    """`--steps 0` is a bad value (steps must be positive), not "no --steps": it must not train the preset's 300."""
    run = tmp_path / "r"
    assert main(["train", "--run-dir", str(run), "--steps", "0", "--set", "train.batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "steps (0) must be positive" in err and err.count("\n") == 1
    assert not run.exists()


def test_the_console_script_returns_the_clis_exit_code(monkeypatch, capsys):
    """`moejax` is `moejax.entry:main`; its return value is the process's exit status, so a user error must
    come back as 2 through it, not 0."""
    from moejax import entry

    monkeypatch.setattr(entry, "exec_with_host_memory", lambda: None)  # no re-execution inside pytest
    monkeypatch.setattr("sys.argv", ["moejax", "count", "nope"])
    assert entry.main() == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("env, name", [
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_ID": "x"}, "JAX_PROCESS_ID='x'"),
])
def test_a_launcher_variable_that_is_not_an_integer_is_one_line(env, name, monkeypatch, tmp_path, capsys):
    """docs/LAUNCH.md: the process count and id come from the launcher's environment when a coordinator is named
    there. A value that is not an integer is a user error (one line naming the variable), not int()'s traceback."""
    for k in ("JAX_COORDINATOR_ADDRESS", "MASTER_ADDR", "MASTER_PORT", "JAX_NUM_PROCESSES", "SLURM_NTASKS",
              "WORLD_SIZE", "JAX_PROCESS_ID", "SLURM_PROCID", "RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "r"
    assert main(["train", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"environment variable {name} must be an integer" in err and err.count("\n") == 1
    assert not run.exists()


@pytest.mark.parametrize("name", ["manifest.json", "tokenizer.json", "bytes_per_token.npy"])
def test_a_source_named_like_a_store_file_is_refused(name):
    """A source's directory sits beside the store's own files: a source called tokenizer.json made `tokenizers`
    fail with a traceback ("Is a directory"), manifest.json an error that blamed the wrong thing."""
    from moejax.data.prepare import parse_source_args

    with pytest.raises(SourceError, match=f"--source name '{name}' is one of the store's own files"):
        parse_source_args([f"{name}=t.txt"])
