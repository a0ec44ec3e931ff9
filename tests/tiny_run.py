"""One tiny run trained through the CLI, shared by the generate and export tests (trained once a session)."""

from pathlib import Path

from moejax.cli import main

_RUNS: dict[str, Path] = {}
TRAIN_ARGS = ["--preset", "tiny", "--steps", "2", "--mesh", "data=1", "--no-progress", "--wandb", "disabled",
              "--peak-flops", "1e11",
              "--set", "model.n_layers=2", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
              "--set", "train.eval_batches=0", "--set", "train.checkpoint_every=1", "--set", "data.prefetch=0",
              "--set", "train.optimizer=adam"]  # adam: a smaller step to compile than MuonH


def tiny_run_dir(tmp_path_factory) -> Path:
    """A finished 2-step run (2 layers: one local, one global) with complete checkpoints at steps 1 and 2."""
    if "run" not in _RUNS:
        run = tmp_path_factory.mktemp("tiny_run") / "run"
        assert main(["train", "--run-dir", str(run), *TRAIN_ARGS]) == 0
        _RUNS["run"] = run
    return _RUNS["run"]
