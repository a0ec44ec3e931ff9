"""Decoding with the KV cache against the full forward pass, sampling, and `moejax generate` end to end."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.cli import main
from moejax.model.decode import generate_tokens, init_cache, sample_next
from moejax.model.transformer import Transformer, forward, lm_logits
from tests.helpers import toy_model
from tests.tiny_run import tiny_run_dir

# fp32 compute, "highest" matmul precision (conftest): cache and recompute differ only by summation order.
LOGITS_ATOL_FP32 = 2e-4
LOGITS_RTOL_FP32 = 1e-4
N_NEW = 10  # one cache length for every test here: one compile
CHUNK = 5


def toy_params(cfg, seed=0):
    """Random weights drawn in numpy (no XLA compile). Not the init: identity SConv taps, zero head gates
    and zero router bias would hide a wrong conv state, gate or bias."""
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0))

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        std = 0.1 if x.ndim < 2 else 0.5 / np.sqrt(x.shape[-2])
        a = rng.normal(0.0, std, x.shape).astype(np.float32)
        if name.endswith((".gain", ".lat_norm")):
            a += 1.0
        if ".conv_" in name:
            a[..., 0, :] += 1.0
        return jnp.asarray(a)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@functools.partial(jax.jit, static_argnames="cfg")
def _next_logits(params, tokens_S, n, cfg):
    """Training forward pass over a fixed-length row (one compile); causality makes the padding after
    position n-1 irrelevant to the logits there."""
    tokens = tokens_S[None]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    h, _ = forward(params, tokens, jnp.ones_like(tokens), positions, cfg, remat=False)
    return lm_logits(h[0, n - 1], params.lm_head)


def full_forward_logits(params, cfg, ids, length):
    return _next_logits(params, jnp.asarray(ids + [0] * (length - len(ids)), jnp.int32), len(ids), cfg)


@pytest.fixture(scope="module")
def toy():
    # window 4 < prefill chunk 5 < prompt 11 (two chunks, then one token); layer 0 local, layer 1 global
    # (reads one KV head of two)
    cfg = toy_model(window=4, n_layers=2)
    return cfg, toy_params(cfg), [5, 17, 3, 60, 22, 9, 41, 8, 30, 2, 11]


def test_greedy_with_cache_equals_full_recompute(toy):
    cfg, params, prompt = toy
    ids = list(prompt)
    steps = list(generate_tokens(params, cfg, prompt, N_NEW, prefill_chunk=CHUNK))
    assert len(steps) == N_NEW
    for tok, logits in steps:
        ref = full_forward_logits(params, cfg, ids, len(prompt) + N_NEW)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=LOGITS_RTOL_FP32, atol=LOGITS_ATOL_FP32)
        assert tok == int(jnp.argmax(ref))
        ids.append(tok)
    assert len(set(ids[len(prompt):])) > 2, "a near-constant continuation would not test much"
    one_by_one = list(generate_tokens(params, cfg, prompt, N_NEW, prefill_chunk=1))  # no chunked prefill
    assert [t for t, _ in one_by_one] == ids[len(prompt):]
    np.testing.assert_allclose(np.asarray(one_by_one[0][1]), np.asarray(steps[0][1]), rtol=LOGITS_RTOL_FP32,
                               atol=LOGITS_ATOL_FP32)


def test_cache_shapes():
    cfg = toy_model(window=4, n_layers=2)
    local, glob = init_cache(cfg, 1, 12)
    assert local["k"].shape == (1, cfg.window, cfg.n_kv_heads, cfg.head_dim)  # a ring of `window` slots
    assert glob["k"].shape == (1, 12, cfg.n_kv_heads_global, cfg.head_dim)  # the whole prefix, G_global heads
    assert local["conv_k"].shape == (1, cfg.conv_taps - 1, cfg.kv_dim)


def test_seed_makes_sampling_reproducible(toy):
    cfg, params, prompt = toy
    run = lambda seed, **kw: [t for t, _ in generate_tokens(params, cfg, prompt, N_NEW, seed=seed, **kw)]
    a = run(3, temperature=1.5, top_p=0.95)
    assert a == run(3, temperature=1.5, top_p=0.95)
    assert a != run(4, temperature=1.5, top_p=0.95)
    greedy = run(0)
    assert run(5, temperature=1.0, top_p=1e-6) == greedy  # the nucleus of a tiny top_p is the argmax


def test_sample_next_stays_in_the_nucleus_and_valid_vocab():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    draw = jax.vmap(lambda k, p, n: sample_next(logits, k, 1.0, p, n)[0], in_axes=(0, None, None))
    assert set(np.asarray(draw(keys, 0.7, 4)).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(np.asarray(draw(keys, 1.0, 4)).tolist()) == {0, 1, 2, 3}
    assert set(np.asarray(draw(keys, 1.0, 2)).tolist()) == {0, 1}  # ids >= n_valid never drawn


# ---- the CLI on a trained run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory)


def test_cli_generates_after_training(run_dir, capsys):
    argv = ["generate", str(run_dir), "--prompt", "In the beginning", "--max-new-tokens", "6", "--seed", "7"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.out.strip() and "step 2 weights; 4 prompt + " in first.err
    assert main(argv) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text
    assert main([*argv, "--checkpoint", "1", "--temperature", "0"]) == 0
    assert "step 1 weights" in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--prompt", ""], "--prompt '' has no tokens"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens (0) must be from 1 to 1,048,576"),
    # found by a fuzzer (docs/LOG.md thirty-fifth session): the cache filled the host's memory; tracebacks
    (["--prompt", "x", "--max-new-tokens", "1000000000000"], "--max-new-tokens (1000000000000) must be from 1 to"),
    (["--prompt", "x", "--seed", str(10 ** 23)], "--seed (100000000000000000000000) must fit in 64 bits"),
    (["--prompt", "ok \udcff"], "--prompt is not valid UTF-8 text (at character 3)"),
    (["--prompt", "x", "--temperature", "-0.5"], "--temperature (-0.5) must be a finite number >= 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p (0.0) must be in (0, 1]"),
    (["--prompt", "x", "--checkpoint", "99"], "no complete checkpoint at step 99"),
])
def test_cli_bad_input_is_one_line_exit_2(run_dir, extra, words, capsys):
    assert main(["generate", str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_run_dir_without_checkpoints(run_dir, tmp_path, capsys):
    (tmp_path / "config.json").write_text((run_dir / "config.json").read_text())
    (tmp_path / "checkpoints").mkdir()
    assert main(["generate", str(tmp_path), "--prompt", "In the beginning"]) == 2
    err = capsys.readouterr().err
    assert f"no complete checkpoint in {tmp_path / 'checkpoints'}" in err and err.count("\n") == 1
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "is not a run directory (no config.json)" in capsys.readouterr().err
