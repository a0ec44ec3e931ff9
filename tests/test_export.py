"""`moejax export`: safetensors shards + index + config + tokenizer that reproduce the checkpoint's logits,
a refused --out, and `--init-from` an export."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

from moejax.checkpoint import list_checkpoints, restore
from moejax.cli import main
from moejax.export import INDEX, export_run, from_tensors, load_export, to_tensors
from moejax.model.transformer import Transformer, forward, lm_logits
from moejax.train.loop import _initial_state, make_optimizer
from moejax.train.state import init_state
from moejax.weights import load_run, run_config
from tests.helpers import toy_model
from tests.tiny_run import TRAIN_ARGS, tiny_run_dir

# The export holds the very values the checkpoint's forward reads (bf16 = the compute copy, fp32 = the
# master, router bias fp32 in both), so logits must agree bit for bit.
EXPORT_LOGITS_ATOL = 0.0
SMALL_SHARD = 256 * 1024  # bytes: forces several shard files for the tiny model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory)


@functools.partial(jax.jit, static_argnames="cfg")
def _logits(params, tokens, cfg):
    h, _ = forward(params, tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
                   cfg, remat=False)
    return lm_logits(h, params.lm_head)


def test_tensor_names_round_trip():
    cfg = toy_model(n_layers=3)
    params = jax.tree.map(lambda s: np.arange(np.prod(s.shape), dtype=np.float32).reshape(s.shape),
                          jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0)))
    tensors = to_tensors(params)
    assert list(tensors)[:2] == ["embed", "embed_norm.gain"] and list(tensors)[-1] == "lm_head"
    assert tensors["layers.2.moe.w_gate"].shape == (cfg.n_experts, cfg.latent_width, cfg.expert_width)
    np.testing.assert_array_equal(tensors["layers.1.attn.wq"], np.asarray(params.blocks.attn.wq[1]))
    back = from_tensors(tensors, cfg)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="export has no tensor 'layers.2.attn.wo'"):
        from_tensors({k: v for k, v in tensors.items() if k != "layers.2.attn.wo"}, cfg)


def test_weights_of_a_model_without_shared_experts_export_and_load(tmp_path):
    """`model.n_shared=0`: the [L, 0, D, Fs] shared stacks were never saved (orbax takes no zero-size arrays), and
    `restore_weights` gave None for them, so an export lacked their tensors and would not load again. They come
    back as zero-size arrays of the target's shape and dtype."""
    from moejax.checkpoint import CheckpointManager
    from moejax.presets import TINY
    from moejax.weights import restore_weights

    cfg = dataclasses.replace(TINY, model=toy_model(n_shared=0, n_layers=2))
    state = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0))
    with CheckpointManager(tmp_path, permanent_every=1) as mgr:
        mgr.save(1, state, extra_metadata={"model_config": dataclasses.asdict(cfg.model)})
        mgr.wait()
    for which, want in (("params", state.params), ("compute", state.compute)):
        got = restore_weights(list_checkpoints(tmp_path)[-1].path, cfg, which)
        assert got.blocks.moe.shared_gate.shape == (2, 0, cfg.model.d_model, cfg.model.shared_width)
        tensors = to_tensors(got)
        assert tensors["layers.1.moe.shared_down"].shape == (0, cfg.model.shared_width, cfg.model.d_model)
        for a, b in zip(jax.tree.leaves(from_tensors(tensors, cfg.model)), jax.tree.leaves(want)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_reproduces_the_checkpoints_logits(run_dir, tmp_path):
    out = tmp_path / "export"
    s = export_run(run_dir, out, "fp32", shard_bytes=SMALL_SHARD)
    assert s["step"] == 2 and len(s["files"]) > 1
    master = load_run(run_dir, which="params").params
    cfg, fp32, config = load_export(out)
    for a, b in zip(jax.tree.leaves(fp32), jax.tree.leaves(master)):  # the fp32 master, tensor for tensor
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    export_run(run_dir, out, "bf16", shard_bytes=SMALL_SHARD)  # replaces the earlier export in place
    index = json.loads((out / INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
    with safe_open(out / index["weight_map"]["layers.1.moe.router_bias"], "flax") as f:
        assert f.get_tensor("layers.1.moe.router_bias").dtype == jnp.float32  # fp32 at any --dtype
    assert config["model"] == dataclasses.asdict(run_config(run_dir).model)
    assert (out / "tokenizer.json").is_file() and config["tokenizer"]["vocab_size"] == 2048
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary dirs left behind"

    cfg, bf16, config = load_export(out)
    assert config["dtype"] == "bfloat16" and bf16.blocks.attn.wq.dtype == jnp.bfloat16
    compute = load_run(run_dir, which="compute").params  # what training's forward reads
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    np.testing.assert_allclose(np.asarray(_logits(bf16, tokens, cfg)), np.asarray(_logits(compute, tokens, cfg)),
                               rtol=0, atol=EXPORT_LOGITS_ATOL)


def test_export_refuses_a_foreign_non_empty_dir(run_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["export", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a non-empty directory that is not an earlier export" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_export_never_replaces_a_dir_holding_more_than_an_export(run_dir, tmp_path, capsys):
    """An earlier export is replaced whole; one that also holds a user's file, or a run copied into it (which
    could be the very run being exported), is refused, nothing touched (found by a fuzzer, docs/LOG.md
    thirty-fifth session: both were deleted). An --out that can't be written is one line too."""
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tokenizer"]["encode_special_tokens"] is True  # what tokenizer.json can't record
    (out / "NOTES.md").write_text("keep me")
    shutil.copytree(run_dir, out / "myrun")
    capsys.readouterr()
    assert main(["export", str(out / "myrun"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is an earlier export that also holds what no export writes (NOTES.md, myrun)" in err, err
    assert err.count("\n") == 1 and (out / "NOTES.md").read_text() == "keep me"
    assert list_checkpoints(out / "myrun")
    (tmp_path / "file").write_text("x")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the export to" in err and err.count("\n") == 1, err


def test_an_export_removes_what_killed_exports_here_left_and_nothing_else(run_dir, tmp_path):
    """kill -9 mid-export leaves a hidden half-written dir beside --out; the next export to it removes those of
    this host's dead processes, and leaves a live one's, another host's and anything else alone."""
    import os
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a PID no process has now
    left = {name: tmp_path / name for name in (f".export.tmp-{host}-{gone}-0123abcd",  # killed here: removed
                                               f".export.tmp-{host}-{os.getpid()}-4567cdef",  # alive: kept
                                               f".export.tmp-otherhost-{gone}-89ab0123",  # another host's: kept
                                               f".other.tmp-{host}-{gone}-0123abcd")}  # another --out's: kept
    for d in left.values():
        d.mkdir()
        (d / "model-00001-of-00002.safetensors").write_bytes(b"half")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", *list(left)[1:]])


def test_a_damaged_export_is_refused_by_every_reader(run_dir, tmp_path, capsys):
    """A bit flipped in a tensor's bytes loaded silently (found by a fuzzer, docs/LOG.md thirty-sixth session):
    config.json now keeps each tensor's checksums, and loading checks them."""
    from moejax.export import ExportError, load_export

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "fp32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert set(config["checksums"]) == set(json.loads((out / "model.safetensors.index.json").read_text())
                                           ["weight_map"])
    load_export(out)
    shard = sorted(out.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's last element
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"is damaged: tensor .* changed on disk since it was exported"):
        load_export(out)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "new"), "--init-from", str(out), *TRAIN_ARGS]) == 2
    err = capsys.readouterr().err
    assert "changed on disk since it was exported" in err and err.count("\n") == 1, err
    config["checksums"] = []  # an edited config.json does not turn the check off
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="checksums are list, not a map of tensor to checksum"):
        load_export(out)
    del config["checksums"]  # an export made before checksums: loads unchecked
    (out / "config.json").write_text(json.dumps(config))
    load_export(out)


def test_init_from_is_checked_before_the_run_dir_is_touched(run_dir, tmp_path, capsys):
    """--init-from an export of another model shape, or with a truncated shard, is one line and leaves no run
    dir (it left config.json, run_info.json and checkpoints/, so the right command was then refused); and
    --init-from inside the --run-dir that --overwrite is about to delete is refused (it deleted its source)."""
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    new = tmp_path / "new"
    assert main(["train", "--run-dir", str(new), "--init-from", str(out), *TRAIN_ARGS,
                 "--set", "model.n_layers=3"]) == 2
    err = capsys.readouterr().err
    assert "--init-from" in err and "n_layers is 2 in the checkpoint but 3 now" in err and err.count("\n") == 1, err
    assert not new.exists()
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:8])
    assert main(["train", "--run-dir", str(new), "--init-from", str(out), *TRAIN_ARGS]) == 2
    err = capsys.readouterr().err
    assert f"--init-from {out}: {out} is damaged" in err and err.count("\n") == 1, err
    assert not new.exists()
    own = tmp_path / "own"
    shutil.copytree(run_dir, own)
    assert main(["train", "--run-dir", str(own), "--overwrite", "--init-from", str(own), *TRAIN_ARGS]) == 2
    err = capsys.readouterr().err
    assert "is inside --run-dir" in err and "--overwrite would delete" in err and err.count("\n") == 1, err
    assert [c.step for c in list_checkpoints(own) if c.complete] == [1, 2]


def test_init_from_a_source_whose_data_is_damaged_leaves_no_run_dir(run_dir, tmp_path, capsys):
    """A flipped bit in the --init-from source's data is found only when its weights load (the checksums),
    after the new run dir's config.json and run_info.json were written: they were left behind, and the same
    command without --init-from then trained from scratch in that dir. The start is now undone: no dir when the
    run created it, only the user's own files when it existed (found by the thirty-seventh session's README walk)."""
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "fp32"]) == 0
    shard = sorted(out.glob("*.safetensors"))[0]
    b = bytearray(shard.read_bytes())
    b[-100] ^= 0x10  # inside the last tensor's data
    shard.write_bytes(bytes(b))
    capsys.readouterr()
    new = tmp_path / "new"
    assert main(["train", "--run-dir", str(new), "--init-from", str(out), *TRAIN_ARGS]) == 2
    err = capsys.readouterr().err
    assert f"--init-from {out}" in err and "changed on disk" in err and err.count("\n") == 1, err
    assert not new.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["train", "--run-dir", str(mine), "--init-from", str(out), *TRAIN_ARGS]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_init_from_an_export_starts_from_its_weights(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "fp32", "--checkpoint", "1"]) == 0
    assert "exported step 1" in capsys.readouterr().out
    cfg = run_config(run_dir)
    abstract = jax.eval_shape(lambda: init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0)))
    state, _ = restore(list_checkpoints(run_dir)[-1].path, abstract)  # step 2: not what the export holds
    zeroed = dataclasses.replace(state, params=jax.tree.map(jnp.zeros_like, state.params))
    new = _initial_state(zeroed, None, False, str(out), optax.set_to_zero(), dataclasses.asdict(cfg.model))
    step1 = load_run(run_dir, step=1, which="params").params
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(step1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(new.compute.blocks.moe.router_bias),  # fp32 in the compute copy
                                  np.asarray(step1.blocks.moe.router_bias))
    assert new.compute.embed.dtype == jnp.bfloat16 and int(new.step) == int(state.step)


def test_init_from_a_run_dir_takes_its_newest_checkpoints_weights_at_step_zero(run_dir):
    """`--init-from RUN_DIR` (the fast twin of test_resume's CLI test, which is `slow`): the newest complete
    checkpoint's weights (step 2 here), this run's own step counter and a fresh optimizer state."""
    from moejax.train.loop import resolve_init_from

    cfg = run_config(run_dir)
    src = resolve_init_from(str(run_dir), dataclasses.asdict(cfg.model))
    assert src == list_checkpoints(run_dir)[-1].path and src.name == "step_00000002"
    optimizer = make_optimizer(cfg)[0]
    abstract = jax.eval_shape(lambda: init_state(cfg, optimizer, jax.random.key(0)))
    state, _ = restore(src, abstract)
    fresh = dataclasses.replace(state, step=jnp.zeros_like(state.step),
                                params=jax.tree.map(jnp.zeros_like, state.params),
                                opt_state=jax.tree.map(jnp.zeros_like, state.opt_state))
    new = _initial_state(fresh, None, False, src, optimizer, dataclasses.asdict(cfg.model))
    assert int(new.step) == 0
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(optimizer.init(state.params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # Adam's moments start again at zero


def test_init_from_on_a_mesh_places_the_new_state_as_the_runs_own(run_dir):
    """On a data=2 x expert=4 mesh every leaf of the started state is placed as a fresh state of that run: the
    optimizer's step counts were on one device, and the first step failed (found by a fuzzer, docs/LOG.md
    thirty-sixth session)."""
    from moejax.parallel.mesh import make_mesh
    from moejax.train.loop import resolve_init_from

    cfg = run_config(run_dir)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data=2, expert=4))
    mesh, optimizer = make_mesh(cfg.parallel), make_optimizer(cfg)[0]
    fresh = init_state(cfg, optimizer, jax.random.key(0), mesh)
    src = resolve_init_from(str(run_dir), dataclasses.asdict(cfg.model))
    new = _initial_state(fresh, None, False, src, optimizer, dataclasses.asdict(cfg.model))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(fresh)):
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
