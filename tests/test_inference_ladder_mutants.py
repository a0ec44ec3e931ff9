"""Inference, export and scaling-ladder mutation audit: each test here fails on one realistic bug that the rest of
the suite let through, and passes on the real code.

Decode (SPEC §2 at inference): the KV cache reproduces the full forward pass on a model whose widths all differ
(global layers reading a head map of their own), a prompt that ends exactly on a prefill chunk, and the sampling
contract (temperature, the per-position key, the end-of-document stop). `moejax generate` streams whole UTF-8
characters and never samples padding ids. Weights/export: a checkpoint of another model config is refused, an
unusable newest one falls back to an older one, compute weights keep the compute dtype; the export's derived
head maps, sharding, name/shape checks and --init-from dtype. Ladder (SPEC §5): the fit's flags and numbers, the
micro-ladder's result rows, the plan's memory terms as printed, and the default lowering phase."""

import dataclasses
import json
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.attention import kv_head_map
from moejax.model.decode import generate_tokens, sample_next
from moejax.model.transformer import Transformer
from tests.helpers import toy_model
from tests.test_generate import LOGITS_ATOL_FP32, LOGITS_RTOL_FP32, full_forward_logits, toy_params
from tests.test_ladder_fit import clean_rows

# ---------------------------------------------------------------------------------------------- decode

N_NEW = 6
CHUNK = 5


@pytest.fixture(scope="module")
def wide():
    """Every width differs (d 40, q 48, kv 24, latent 12, expert 20, shared 28, vocab 56) and the global layer
    reads 2 of 4 KV heads with 8 query heads, so its head map [0,0,0,0,1,1,1,1] is not the local one
    [0,0,1,1,2,2,3,3] (with one global head an out-of-range index clamps back to head 0 and hides it). Layers 0
    and 1 local (window 3 < chunk 5), layer 2 global. The prompt is two whole prefill chunks: the last prefill
    call is a chunk, not a single token."""
    cfg = toy_model(vocab_size=56, d_model=40, n_layers=3, n_heads=8, head_dim=6, n_kv_heads=4, n_kv_heads_global=2,
                    window=3, rope_dim=4, gated_norm_rank=5, n_experts=6, top_k=2, expert_width=20, latent_width=12,
                    shared_width=28)
    return cfg, toy_params(cfg, seed=1), [7, 50, 3, 31, 22, 9, 41, 8, 30, 2]


def test_decode_equals_forward_when_the_prompt_ends_on_a_chunk_and_global_heads_differ(wide):
    """SPEC §2: a global layer reads the first G_global KV heads through its own head map, and the logits a
    prefill chunk returns are its *last* token's. A step that used the local head map, or the chunk's first
    token, passes the toy of test_generate (one global head; a prompt ending in single-token calls)."""
    cfg, params, prompt = wide
    ids = list(prompt)
    for tok, logits in generate_tokens(params, cfg, prompt, N_NEW, prefill_chunk=CHUNK):
        ref = full_forward_logits(params, cfg, ids, len(prompt) + N_NEW)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=LOGITS_RTOL_FP32, atol=LOGITS_ATOL_FP32)
        assert tok == int(jnp.argmax(ref))
        ids.append(tok)


SAMPLING_SEEDS = 4
HOT = 2.0  # a flat distribution: two different keys rarely draw the same token


def test_the_token_at_position_p_is_drawn_with_the_key_of_p(wide):
    """`generate_tokens`: 'the token at position p is drawn with key fold_in(key(seed), p)', whatever the
    prefill chunking. A key folded with the last call's *start* gives the first new token another key after a
    chunked prefill (start 5) than after a token-by-token one (start 9)."""
    cfg, params, prompt = wide
    for seed in range(SAMPLING_SEEDS):
        for chunk in (CHUNK, 1):
            tok, logits = next(generate_tokens(params, cfg, prompt, 1, temperature=HOT, seed=seed,
                                               prefill_chunk=chunk))
            key = jax.random.fold_in(jax.random.key(seed), len(prompt))
            assert tok == int(sample_next(logits[None], key, HOT, 1.0, cfg.vocab_size)[0]), (seed, chunk)


def test_generation_stops_after_the_end_of_document_token(wide):
    """`generate_tokens` 'stops after eos_id': the eos token is yielded and nothing after it."""
    cfg, params, prompt = wide
    first = [t for t, _ in generate_tokens(params, cfg, prompt, N_NEW)]
    assert len(first) == N_NEW
    assert [t for t, _ in generate_tokens(params, cfg, prompt, N_NEW, eos_id=first[1])] == first[:2]


N_KEYS = 64


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_temperature_divides_the_logits(top_p):
    """softmax(logits / temperature): with the same key, temperature T on logits L draws what temperature 1 draws
    on L / T (nucleus included). Multiplying by T instead inverts hot and cold, and no other test samples at a
    temperature other than 1 except to check reproducibility."""
    t = 2.5
    logits = jnp.asarray(np.random.default_rng(0).normal(0.0, 3.0, (1, 16)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), N_KEYS)
    draw = jax.vmap(lambda k, lg, temp: sample_next(lg, k, temp, top_p, 16)[0], in_axes=(0, None, None))
    np.testing.assert_array_equal(np.asarray(draw(keys, logits, t)), np.asarray(draw(keys, logits / t, 1.0)))


# ---------------------------------------------------------------------------------------------- generate CLI


class ByteTokenizer:
    """Token i is byte i: a UTF-8 character of two bytes spans two tokens, as in a byte-level BPE."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_waits_for_the_rest_of_a_character():
    """A token that ends inside a UTF-8 character decodes to U+FFFD: the stream must print nothing and wait,
    or it prints the replacement character and then loses the real one (its text offset already counted)."""
    from moejax.generate import TextStream

    s = TextStream(ByteTokenizer())
    e_acute = "é".encode()
    assert [s.push(b) for b in b"ab"] == ["a", "b"]
    assert s.push(e_acute[0]) == ""
    assert s.push(e_acute[1]) == "é"
    assert s.flush() == ""


def test_generate_never_samples_ids_the_tokenizer_lacks(monkeypatch, tmp_path):
    """`moejax generate` draws only ids < the tokenizer's vocabulary (a model vocab padded past it has ids that
    decode to nothing). Everything around the sampler is stubbed: only the wiring is under test."""
    import moejax.compile_cache
    import moejax.data.pipeline
    import moejax.model.decode
    import moejax.weights
    from moejax.generate import generate
    from moejax.presets import TINY

    class Tok:
        vocab_size, eos_id = 1000, 999  # the model's vocab is TINY's 2048

        def encode_batch(self, texts):
            return [[1, 2]]

        def decode(self, ids):
            return "x" * len(ids)

    seen = {}

    def fake_generate_tokens(params, cfg, ids, max_new, **kw):
        seen.update(kw)
        yield Tok.eos_id, None

    monkeypatch.setattr(moejax.weights, "run_config", lambda run_dir: TINY)
    monkeypatch.setattr(moejax.weights, "choose_checkpoints", lambda run_dir, step: [])
    monkeypatch.setattr(moejax.weights, "load_run", lambda *a: moejax.weights.Loaded(TINY, None, 1, tmp_path))
    monkeypatch.setattr(moejax.data.pipeline, "run_tokenizer", lambda cfg: Tok())
    monkeypatch.setattr(moejax.compile_cache, "enable_compile_cache", lambda: None)
    monkeypatch.setattr(moejax.model.decode, "generate_tokens", fake_generate_tokens)
    generate(tmp_path, "hi", out=open(tmp_path / "out.txt", "w"))
    assert seen["n_valid"] == Tok.vocab_size and seen["eos_id"] == Tok.eos_id


# ---------------------------------------------------------------------------------------------- weights, export


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run dir (config.json + complete checkpoints at steps 1 and 2) of a 2-layer toy model computing in
    bf16 (so the compute copy's dtype differs from the master's)."""
    from moejax.checkpoint import CheckpointManager
    from moejax.presets import TINY
    from moejax.train.loop import make_optimizer
    from moejax.train.state import init_state

    cfg = dataclasses.replace(TINY, model=toy_model(n_layers=2, compute_dtype="bfloat16"))
    run = tmp_path_factory.mktemp("saved") / "run"
    run.mkdir()
    (run / "config.json").write_text(cfg.to_json())
    state = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0))
    with CheckpointManager(run, permanent_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state, extra_metadata={"model_config": dataclasses.asdict(cfg.model)})
            mgr.wait()
    return cfg, state, run


def test_load_run_refuses_a_checkpoint_of_another_model(saved_run, tmp_path):
    """weights.py: 'the checkpoint's recorded model config must equal the run's config.json (else one line
    naming the field)'. A changed window keeps every shape, so only that check stands between an edited
    config.json and a model decoding with another attention than it was trained with."""
    from moejax.weights import WeightsError, load_run

    cfg, _, run = saved_run
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, window=cfg.model.window - 1))
    (tmp_path / "config.json").write_text(other.to_json())
    (tmp_path / "checkpoints").symlink_to(run / "checkpoints")
    with pytest.raises(WeightsError, match=f"window is {cfg.model.window} in the checkpoint"):
        load_run(tmp_path, which="params")


def test_load_run_falls_back_when_the_newest_checkpoint_does_not_restore(saved_run, capsys):
    """`weights.load_run`: 'older ones are tried after a one-line warning each (as training's resume does)'. A
    newest checkpoint whose arrays are damaged must not make `generate`/`export` unusable. The "compute" weights
    come back in the compute dtype (bf16), the router bias in fp32."""
    from moejax import checkpoint as ck
    from moejax.weights import load_run

    _, state, run = saved_run
    for f in (run / "checkpoints" / ck.step_dir_name(2) / ck.STATE).rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    loaded = load_run(run, which="params")
    assert loaded.step == 1 and "trying an older checkpoint" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(loaded.params.embed), np.asarray(state.params.embed))
    compute = load_run(run, which="compute").params
    assert compute.embed.dtype == jnp.bfloat16 and compute.blocks.moe.router_bias.dtype == jnp.float32


def test_load_run_of_a_damaged_chosen_or_last_checkpoint_says_so_once(saved_run, tmp_path, capsys):
    """`--checkpoint N` of a damaged step printed "...; trying an older checkpoint" and then tried nothing older;
    and the last candidate's warning repeated the error line that follows (the README walk, docs/LOG.md
    thirty-seventh session). Now: no warning for them, one error."""
    import shutil

    from moejax import checkpoint as ck
    from moejax.weights import WeightsError, load_run

    _, _, run = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for step in (1, 2):
        for f in (copy / "checkpoints" / ck.step_dir_name(step) / ck.STATE).rglob("*"):
            if f.is_file():
                f.write_bytes(b"garbage")
    with pytest.raises(WeightsError, match=f"{ck.step_dir_name(1)}: restore failed") as e:
        load_run(copy, step=1, which="params")
    assert "no usable checkpoint" not in str(e.value) and capsys.readouterr().err == ""
    with pytest.raises(WeightsError, match="no usable checkpoint"):
        load_run(copy, which="params")
    err = capsys.readouterr().err
    assert err.count("trying an older checkpoint") == 1 and ck.step_dir_name(2) in err, err


def test_exported_head_maps_are_the_models():
    """config.json's derived head maps are what the model reads (`attention.kv_head_map`): another framework
    builds its GQA from them. Local and global differ here (8 query heads, 4 local / 2 global KV heads)."""
    from moejax.export import derived

    cfg = toy_model(n_heads=8, n_kv_heads=4, n_kv_heads_global=2)
    d = derived(cfg)
    assert d["kv_head_of_query_head_local"] == kv_head_map(cfg, False).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert d["kv_head_of_query_head_global"] == kv_head_map(cfg, True).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


TENSOR_BYTES = 100


def test_shards_fill_up_to_the_limit():
    """'a new file whenever one would pass SHARD_BYTES': each file fills up to the limit again, not one tensor
    per file after the first (a size that is never reset)."""
    from moejax.export import shard_plan

    tensors = {n: np.zeros(TENSOR_BYTES, np.uint8) for n in "abcdef"}
    assert shard_plan(tensors, 2 * TENSOR_BYTES) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert shard_plan(tensors, 3 * TENSOR_BYTES - 1) == [["a", "b"], ["c", "d"], ["e", "f"]]


@pytest.fixture(scope="module")
def toy_tensors():
    cfg = toy_model(n_layers=2)
    abstract = jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0))
    params = jax.tree.map(lambda s: np.linspace(-1, 1, math.prod(s.shape), dtype=np.float32).reshape(s.shape),
                          abstract)
    return cfg, params


def test_an_export_with_wrong_or_extra_tensors_is_refused(toy_tensors):
    """`from_tensors` checks names and shapes against the config: a tensor of the right rank but the wrong
    shape (a transposed or mis-sized matrix) and a tensor the config does not explain are one-line errors."""
    from moejax.export import ExportError, from_tensors, to_tensors

    cfg, params = toy_tensors
    tensors = to_tensors(params)
    wk = tensors["layers.1.attn.wk"]  # [d 32, kv 16]: its transpose has the same rank, not the same shape
    with pytest.raises(ExportError, match=r"tensor 'layers.1.attn.wk' has shape \(16, 32\)"):
        from_tensors({**tensors, "layers.1.attn.wk": wk.T.copy()}, cfg)
    with pytest.raises(ExportError, match="config does not explain: layers.2.attn.wk"):
        from_tensors({**tensors, "layers.2.attn.wk": wk}, cfg)


def test_init_from_a_bf16_export_gives_fp32_weights(toy_tensors, tmp_path):
    """`init_params_from_export`: 'fp32 weights' for --init-from whatever the export's dtype: the fp32 master of
    the new run must not be bf16 (its optimizer would then run in bf16)."""
    from moejax.export import FORMAT, init_params_from_export, to_tensors, write_export

    cfg, params = toy_tensors
    bf16 = to_tensors(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    write_export(tmp_path, bf16, {"format": FORMAT, "model": dataclasses.asdict(cfg)}, None, 1 << 30)
    like = jax.tree.map(jnp.asarray, params)
    got = init_params_from_export(tmp_path, like, dataclasses.asdict(cfg))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jnp.bfloat16).astype(np.float32))


# ---------------------------------------------------------------------------------------------- ladder fit

FIT_ALPHA, FIT_E, FIT_A = 0.12, 1.8, 420.0  # tests.test_ladder_fit's clean law


RMSE_RTOL = 1e-9  # the same residuals up to rounding (the fit solves on C / its geometric mean)


def test_fit_rmse_is_the_root_mean_square_residual():
    """PowerLawFit.rmse is what its name says: sqrt(mean residual^2) of the fitted points."""
    from moejax.ladder.fit import fit_power_law

    rng = np.random.default_rng(0)
    c = np.geomspace(1e12, 1e16, 6)
    y = FIT_E + FIT_A * c ** -FIT_ALPHA + 0.01 * rng.standard_normal(c.size)
    fit = fit_power_law(c, y)
    assert fit.rmse == pytest.approx(math.sqrt(np.mean((fit(c) - y) ** 2)), rel=RMSE_RTOL)


def test_equal_loss_at_more_compute_is_flagged():
    """`not_decreasing`: 'a larger-compute rung has a higher (or equal) loss than a smaller one'."""
    from moejax.ladder.fit import anomalies

    rows = clean_rows()
    rows[3]["final_loss"] = rows[2]["final_loss"]
    assert any(f.startswith("not_decreasing: r3") for f in anomalies(rows))


def test_two_off_trend_rungs_are_both_flagged():
    """Leave-one-out 'repeated while >= 4 remain': with 5 rungs and two bad ones, the second is found in a pool
    of 4 (the fit then made from 3). (Two bad *interior* rungs of 5 make the endpoints look worse instead: the
    procedure promises robustness to one bad rung only, so the pair here is an endpoint and the middle.)"""
    from moejax.ladder.fit import anomalies

    rows = clean_rows()
    rows[0]["final_loss"] *= 1.06
    rows[2]["final_loss"] *= 0.94
    flags = [f for f in anomalies(rows) if f.startswith("off_trend")]
    assert sorted(f.split()[1] for f in flags) == ["r0", "r2"]


def test_anomalies_order_rungs_by_compute_not_by_listing():
    """Rows come in any order (results.csv is in run order, a --widths list in the user's): a clean ladder listed
    shuffled has no flags, and growth flags still compare the smallest with the largest rung."""
    from moejax.ladder.fit import anomalies

    rows = clean_rows()
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != rows and anomalies(shuffled) == []
    for i, r in enumerate(rows):
        r["max_grad_norm"] = 2.0 ** i
    assert any(f.startswith("grad_norm_growth") and "16.0x" in f for f in anomalies(shuffled))


def test_a_fit_at_the_upper_alpha_bound_is_flagged_and_extrapolation_is_from_the_largest_rung():
    """fit_at_bound covers both edges of the alpha range: losses falling faster than any power law allowed
    (alpha >= 3) pin alpha to the top. `extrapolation` is the target over the *largest* fitted compute."""
    from moejax.ladder.fit import _ALPHA_RANGE, fit_ladder

    rows = [{"name": f"r{i}", "flops": 10.0 ** (12 + i), "final_loss": 2.0 + 5.0 * 10.0 ** (-6 * i), "status": "ok"}
            for i in range(4)]
    res = fit_ladder(rows, 1e20)
    assert res["alpha"] > 0.99 * _ALPHA_RANGE[1]
    assert any(f.startswith("fit_at_bound") for f in res["anomalies"]), res["anomalies"]
    assert res["extrapolation"] == pytest.approx(1e20 / 1e15)


# ---------------------------------------------------------------------------------------------- micro-ladder, rungs


def test_micro_result_row_flops_and_grad_norms(tmp_path):
    """results.csv rows count FLOPs by the ladder's rule, 3 x forward FLOPs/token x tokens (the rung plan's
    `train_flops`, not 6*N*D), and final_grad_norm is the last step's (eval-only rows carry none)."""
    from moejax.ladder.micro import micro_rung, result_row
    from moejax.ladder.rungs import config_numbers

    cfg = micro_rung(32, steps=3)
    lines = [{"step": 0, "eval/loss": 6.0},  # eval at start: an eval-only row
             {"step": 1, "train/loss": 5.0, "train/grad_norm": 3.0}, {"step": 2, "train/loss": 4.0, "train/grad_norm": 2.0},
             {"step": 3, "train/loss": 3.5, "train/grad_norm": 1.5, "eval/loss": 3.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    row = result_row(cfg, tmp_path, "ok", 1.0)
    assert row["flops"] == pytest.approx(config_numbers(cfg)["train_flops"], rel=1e-12)
    assert (row["max_grad_norm"], row["final_grad_norm"], row["eval_loss"]) == (3.0, 1.5, 3.6)


def test_rung_6nd_flops_count_active_params():
    """The printed 6ND comparison is 6 x *active* params x tokens (SPEC §1: 2.46e24 for the hero)."""
    from moejax.ladder.rungs import ladder_plan

    hero = ladder_plan()["hero"]
    assert hero["train_flops_6nd"] == pytest.approx(6 * 22_762_487_808 * 46_137_344 * 390_139)
    assert hero["train_flops_6nd"] == pytest.approx(2.46e24, rel=0.01)


# ---------------------------------------------------------------------------------------------- plan, lower


@pytest.fixture(scope="module")
def hero_plan():
    from moejax.plan import CLUSTERS, plan
    from moejax.presets import HERO

    return plan(HERO, CLUSTERS["gb200-nvl72x11"])


HERO_T = 65_536  # tokens per device
BF16 = 2


def test_hero_activation_terms_as_printed(hero_plan):
    """Each memory term against the formula `format_plan` prints beside it (hero: d 6144, H 48 x 128 = q 6144,
    KV 12 x 128 = 1536, 384 experts, query block 512, loss vocab block 16,384, sequence 4096)."""
    r = hero_plan
    qkvo = HERO_T * (2 * 6144 + 2 * 1536) * BF16
    assert r["grads_fp32_bytes"] == 4 * r["params_per_device"]
    assert r["attention_qkvo_bytes"] == qkvo
    assert r["attention_bytes"] == 16 * 48 * 512 * 4096 * (4 + BF16) + qkvo  # 16 rows of 4096; no CP context
    assert r["router_bytes"] == HERO_T * 384 * 4 * 2
    assert r["lm_head_logits_bytes"] == HERO_T * 16_384 * 4
    lean = (r["hbm_needed"] - (r["attention_bytes"] - qkvo) - r["lm_head_logits_bytes"] + HERO_T * 16_384 * 4)
    assert r["hbm_needed_lean"] == lean
    # the 262K phase (CP 4, one row of 65,536 per device): + the 3 earlier chunks' K and V per query head
    last = r["phases"][-1]
    assert last["attention_bytes"] == 48 * 512 * 262_144 * (4 + BF16) + qkvo + (262_144 - 65_536) * 2 * 6144 * BF16


def test_optimizer_state_on_the_device_is_counted_in_hbm(hero_plan):
    """train.opt_state_memory=device: the fp32 master and optimizer state move into HBM."""
    from moejax.plan import CLUSTERS, plan
    from moejax.presets import HERO

    cfg = dataclasses.replace(HERO, train=dataclasses.replace(HERO.train, opt_state_memory="device"))
    r = plan(cfg, CLUSTERS["gb200-nvl72x11"])
    assert r["hbm_needed"] == hero_plan["hbm_needed"] + hero_plan["host_needed"] and not r["fits_hbm"]


def test_lowering_defaults_to_the_longest_context_phase(monkeypatch, capsys):
    """`lower_in_subprocess`: 'at the context phase of seq_len (default: the longest)'; the subprocess entry
    point picks it (the lowering itself is stubbed)."""
    from moejax.ladder import lower
    from moejax.presets import HERO

    monkeypatch.setattr(lower, "lower_train_step", lambda cfg, phase, **kw: {"ok": True, "seq_len": phase.seq_len})
    lower._main([HERO.to_json()])
    out = capsys.readouterr().out
    res = json.loads(out.split(lower.RESULT, 1)[1])
    assert res["seq_len"] == max(ph.seq_len for ph in HERO.phases) == 262_144


def test_a_device_holding_two_chunks_of_a_cp_sequence_counts_both():
    """A context phase whose device holds several CP chunks (131,072 tokens at CP 4: chunks of 32,768, two per
    device) has that many rows of scores and of earlier-chunk K/V. Counting rows as tokens per device / the whole
    sequence (0, then 1) agrees only when a device holds one chunk, as in every hero phase."""
    from moejax.config import apply_overrides
    from moejax.plan import CLUSTERS, plan
    from moejax.presets import HERO

    cfg = apply_overrides(HERO, ["data.context_schedule=0.9:131072:cp=4"])
    ph = plan(cfg, CLUSTERS["gb200-nvl72x11"])["phases"][-1]
    rows, seq, chunk = 2, 131_072, 32_768
    assert (ph["seq_len"], ph["context"], ph["chunk"]) == (seq, 4, chunk)
    qkvo = HERO_T * (2 * 6144 + 2 * 1536) * BF16
    assert ph["attention_bytes"] == rows * 48 * 512 * seq * (4 + BF16) + qkvo + rows * (seq - chunk) * 2 * 6144 * BF16
