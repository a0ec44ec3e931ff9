"""The CLI as a user runs it: count, a short training run, and one-line errors with exit code 2."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from moejax import hostmem
from moejax.cli import main
from moejax.train.heuristic import optimizer_heuristic
from tests.helpers import subprocess_xla_flags

ENV = {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags()}


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moejax.cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


def test_count_json_hero(capsys):
    assert main(["count", "hero", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["total_params"] == 535_305_388_032 and s["exact_params"] == 535_477_106_688
    for key in ["active_params", "tokens_per_step", "steps", "tokens", "fwd_flops_per_token", "train_flops",
                "train_flops_6nd"]:
        assert key in s
    assert main(["count", "hero"]) == 0
    text = capsys.readouterr().out
    assert "2.695e+24" in text and "[the rule we use]" in text and "2.458e+24" in text  # SPEC §1: says which rule
    for term in ("94,371,840", "2,359,296", "37,748,736", "113,246,208", "10,871,635,968", "226,492,416"):
        assert term in text  # SPEC §1's per-layer terms: "a command prints these"


@pytest.mark.parametrize("argv, words", [
    (["count", "nope"], "unknown preset 'nope'"),
    (["train", "--preset", "tiny", "--run-dir", "RUN", "--set", "model.n_heads=5"], "n_heads (5)"),
    (["train", "--preset", "tiny", "--run-dir", "RUN", "--set", "model.top_k=16"], "top_k (16)"),
    (["train", "--preset", "tiny", "--run-dir", "RUN", "--init-from", "RUN-missing"], "no such checkpoint or run"),
    (["train", "--preset", "hero", "--run-dir", "RUN"], "needs 704 devices, but only 8 are present"),
    (["train", "--run-dir", "RUN", "--set", "train.learning_rate=1e-3"], "train.learning_rate would have no effect"),
    (["train", "--run-dir", "RUN", "--set", "train.optimizer=adam", "--set", "train.learning_rate=inf"],
     "learning_rate (inf) must be a finite number"),
    (["train", "--run-dir", "RUN", "--set", "train.batch_size=4"], "no --mesh: the default trains data-parallel on all 8"),
    (["train", "--run-dir", "RUN", "--mesh", "data=2,data=4"], "--mesh 'data=2,data=4' gives data twice (2 and 4)"),
    (["train", "--run-dir", "RUN", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id (2) must be in [0, --num-processes=2)"),
    (["train", "--run-dir", "RUN", "--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"],
     "--num-processes (0) must be >= 1"),
    (["train", "--run-dir", "RUN", "--profile", "5:3"], "--profile '5:3': expected START:STOP"),
    (["train", "--run-dir", "RUN", "--profile", ""], "--profile '': expected START:STOP"),
    (["train", "--run-dir", "RUN", "--steps", "4", "--profile", "4:6"], "starts at step 4, but the run has 4 steps"),
])
def test_user_errors_are_one_line_exit_2(argv, words, tmp_path, capsys):
    argv = [a.replace("RUN", str(tmp_path / "r")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("env_var", ["MOEJAX_ATTENTION", "MOEJAX_GROUPED", "MOEJAX_GROUPED_ROWS"])
def test_bad_kernel_choice_is_one_line_before_the_run_dir(env_var, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(env_var, "cuda")
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{env_var}='cuda' is not one of ('xla', 'gpu_kernel')" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_rows_in_kernels_without_the_kernels_is_one_line(tmp_path, capsys, monkeypatch):
    """MOEJAX_GROUPED_ROWS=gpu_kernel only means something with the grouped kernels: asked for alone (on CPU
    the grouped GEMM is XLA's by default) it is a one-line error, not silently ignored."""
    monkeypatch.delenv("MOEJAX_GROUPED", raising=False)
    monkeypatch.setenv("MOEJAX_GROUPED_ROWS", "gpu_kernel")
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "MOEJAX_GROUPED_ROWS=gpu_kernel moves the row gathers" in err and "MOEJAX_GROUPED is xla" in err
    assert err.count("\n") == 1 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("env_var, override, words", [
    ("MOEJAX_GROUPED", "model.latent_width=24", "MOEJAX_GROUPED=gpu_kernel: width 24 has no tile"),
    ("MOEJAX_ATTENTION", "model.head_dim=24", "MOEJAX_ATTENTION=gpu_kernel: head_dim (24) is not a power of two"),
])
def test_model_a_chosen_kernel_cannot_take_is_one_line(env_var, override, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(env_var, "gpu_kernel")
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--set", override]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_every_context_phase_is_checked_for_a_chosen_kernel(tmp_path, capsys, monkeypatch):
    """The first phase's rows (128) fit the flash kernel's blocks, the later phase's (192) do not."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    assert main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--mesh", "data=4",
                 "--set", "train.batch_size=12", "--set", "data.context_schedule=0.5:192"]) == 2
    err = capsys.readouterr().err
    assert "MOEJAX_ATTENTION=gpu_kernel: sequence length (192) not divisible by block q (128)" in err
    assert err.count("\n") == 1 and not (tmp_path / "r").exists()


def test_short_training_run_and_different_run_refused(tmp_path):
    run = tmp_path / "run"  # passed relative to the working directory, as `make demo` does
    args = ["train", "--preset", "tiny", "--run-dir", "run", "--steps", "6", "--no-progress",
            "--set", "model.n_layers=2", "--set", "train.batch_size=4", "--set", "train.eval_batches=1",
            "--set", "train.checkpoint_every=3", "--peak-flops", "1e11", "--profile", "4:9"]
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # --profile 4:9 of 6 steps: jax's trace per process, in TensorBoard's layout and Perfetto's, written when
    # the loop ends (its `close`), holding steps 4 and 5 and the end's evaluation
    traces = list((run / "profile" / "process_0" / "plugins" / "profile").glob("*/*"))
    assert all(any(p.name.endswith(f".{kind}") for p in traces) for kind in ("xplane.pb", "trace.json.gz"))
    events = json.loads(gzip.decompress(next(p for p in traces if p.name.endswith(".json.gz")).read_bytes()))
    events = [e for e in events["traceEvents"] if e.get("ph") == "X"]
    assert [e["args"]["step_num"] for e in events if e["name"] == "train"] == ["4", "5"]
    assert any(e["name"] == "PjitFunction(eval_step)" for e in events)
    assert "moejax: profile of steps 4 .. 5 in" in r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6))
    for row in rows:
        assert {"train/loss", "throughput/tokens_per_second", "moe/drop_fraction"} <= set(row)
    assert "eval/loss" in rows[-1] and "eval/bpb" in rows[-1]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["n_layers"] == 2
    info = json.loads((run / "run_info.json").read_text())  # which peak MFU is measured against
    assert info["peak_source"] == "--peak-flops" and info["peak_units"] == 1 and info["peak_flops"] == 1e11
    assert info["profile_steps"] == [4, 9]
    # YNNPACK for reductions only on CPU
    assert info["step_compiler_options"] == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
    assert info["init_compiler_options"] == {}  # the suite's XLA_FLAGS set LLVM's level (-O0): they win
    assert info["xla_flags"] == ENV["XLA_FLAGS"]
    assert set(info["kernels"].values()) == {"xla"}  # every op on its XLA path on CPU
    if "malloc" not in ENV.get("LD_PRELOAD", ""):  # `python -m moejax.cli` skips the re-execution onto tcmalloc
        assert info["host_allocator"] == "glibc"
    assert info["host_allocator_settings"] == hostmem.allocator_settings(ENV)  # what the allocator started with
    # What the hero optimizer really ran with: the SPEC §4 heuristic's beta2 for this batch, not train.b2
    hp = optimizer_heuristic(total_tokens=6 * 4 * 128, width=128, batch_tokens=4 * 128)
    assert info["optimizer"] == {"name": "hero", "source": "SPEC §4 heuristic", "muonh_lr": hp.muonh_lr,
                                 "adam_lr": hp.adam_lr, "b1": hp.beta1, "b2": hp.beta2, "eps": hp.eps, "weight_decay": 0.0}
    assert info["optimizer"]["b2"] != cfg["train"]["b2"]
    flops = 3.0 * info["accounting"]["fwd_flops_per_token"] * info["accounting"]["tokens_per_step"]
    for row in rows:
        assert row["throughput/mfu"] == pytest.approx(flops / row["throughput/step_time"] / 1e11)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}

    assert (run / "checkpoints" / "step_00000003" / "COMMITTED").exists()  # a mid-run save on a relative path
    r = run_cli(*[a if a != "model.n_layers=2" else "model.n_layers=3" for a in args], cwd=tmp_path)
    assert r.returncode == 2
    assert "already holds a different run (model.n_layers: 2 there, 3 now)" in r.stderr
    assert "Traceback" not in r.stderr
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before, "a refused run must not touch the existing run dir"

    s = run_cli("summary", "run", cwd=tmp_path)
    assert s.returncode == 0 and "train loss" in s.stdout
    assert "alarms      none" in s.stdout  # QB, dropless: a healthy run raises nothing


def test_init_from_a_garbage_directory_fails_fast_and_leaves_nothing(tmp_path, capsys):
    garbage = tmp_path / "garbage"
    (garbage / "sub").mkdir(parents=True)
    (garbage / "weights.bin").write_bytes(b"\0" * 100)
    run = tmp_path / "r"
    assert main(["train", "--run-dir", str(run), "--init-from", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert "neither a run dir (with checkpoints/) nor a complete checkpoint" in err and err.count("\n") == 1
    assert not run.exists()
    (garbage / "checkpoints" / "step_00000005").mkdir(parents=True)  # a run dir whose only save never completed
    assert main(["train", "--run-dir", str(run), "--init-from", str(garbage)]) == 2
    assert "no complete checkpoint in" in capsys.readouterr().err and not run.exists()


def test_wandb_online_without_an_api_key_is_one_line(tmp_path, capsys, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--wandb", "online"]) == 2
    err = capsys.readouterr().err
    assert "--wandb online needs a W&B API key" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_without_mesh_every_device_is_used_data_parallel():
    from moejax.cli import _default_mesh, _resolve, build_parser

    args = build_parser().parse_args(["train", "--run-dir", "x"])
    cfg = _default_mesh(_resolve(args), args)
    assert cfg.parallel.mesh_shape == (1, 8, 1, 1)  # 8 forced CPU devices
    args = build_parser().parse_args(["train", "--run-dir", "x", "--mesh", "expert=2"])
    assert _default_mesh(_resolve(args), args).parallel.mesh_shape == (1, 1, 2, 1)  # --mesh wins
    args = build_parser().parse_args(["train", "--run-dir", "x", "--preset", "d768"])
    assert _default_mesh(_resolve(args), args).parallel.expert == 64  # a preset's own mesh stays


def test_remat_flag_sets_the_config_field_that_config_json_records():
    """`train --remat` turned remat on beside the config, so config.json said remat false for a remat run."""
    from moejax.cli import _resolve, build_parser

    resolve = lambda *extra: _resolve(build_parser().parse_args(["train", "--preset", "tiny", "--run-dir", "x",
                                                                 *extra]))
    assert resolve("--remat").train.remat and resolve("--remat").to_dict()["train"]["remat"] is True
    assert not resolve().train.remat


def test_summary_of_a_run_too_short_to_time_says_so(tmp_path, capsys):
    """Every step of a 2-step run is compile-dominated, so the run has no throughput: not "0 tokens/s"."""
    summary = {"preset": "tiny", "steps": 2, "first_loss": 7.7, "last_loss": 7.6, "tokens_per_second": 0.0,
               "mfu": 0.0, "wall_seconds": 9.0, "drop_fraction": 0.0, "alarms": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "throughput  n/a (too few steps after the compile to measure)" in out and "0 tokens/s" not in out
