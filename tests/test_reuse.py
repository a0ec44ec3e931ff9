"""A second run of one config in one process reuses the first one's jitted functions (`train.reuse`), and a
change in anything they are built from (the config, a kernel choice, the compiler options) builds them anew."""

import json

import jax
import numpy as np
import pytest

from moejax.cli import main
from moejax.train import loop, reuse
from tests.tiny_run import TRAIN_ARGS

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # jax's event for each function lowered to HLO
ARGS = [*TRAIN_ARGS, "--set", "train.eval_batches=1", "--set", "model.n_layers=1"]  # an eval step; 1 layer: quick
LOSS_RTOL = 1e-5  # another compile of the same fp32 step (XLA's reductions, not YNNPACK's): summation order


@pytest.fixture
def counted(monkeypatch):
    """(train-step builds, train-step traces, jax events), counted from an empty `reuse` (the wrapper below is
    code patched at run time, which no key holds); emptied again after the test."""
    reuse.clear()
    builds, traces, events = [], [], []
    real = loop.make_train_step

    def make_train_step(*args, **kwargs):
        step = real(*args, **kwargs)
        builds.append(1)

        def traced(state, batch):  # its body runs once per trace; a jit cache hit skips it
            traces.append(1)
            return step(state, batch)
        return traced

    monkeypatch.setattr(loop, "make_train_step", make_train_step)
    listen = lambda name, secs, **kw: events.append(name)
    jax.monitoring.register_event_duration_secs_listener(listen)
    yield builds, traces, events
    jax.monitoring.unregister_event_duration_listener(listen)
    reuse.clear()


def _train(run_dir, *extra) -> list[dict]:
    assert main(["train", "--run-dir", str(run_dir), *ARGS, *extra]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_config_trained_again_in_one_process_traces_nothing_and_a_change_builds_anew(tmp_path, counted,
                                                                                     monkeypatch):
    builds, traces, events = counted
    first = _train(tmp_path / "a")
    assert LOWERED in events and (len(builds), len(traces)) == (1, 1)
    events.clear()
    again = _train(tmp_path / "b")
    assert LOWERED not in events  # no step, eval step or initialiser lowered (so none compiled or read) again
    assert (len(builds), len(traces)) == (1, 1)
    assert [(r.get("train/loss"), r.get("eval/loss")) for r in again] == [
        (r.get("train/loss"), r.get("eval/loss")) for r in first]
    # The same config with the attention kernel now chosen explicitly (the default on CPU, so the same values)
    monkeypatch.setenv("MOEJAX_ATTENTION", "xla")
    chosen = _train(tmp_path / "c")
    assert (len(builds), len(traces)) == (2, 2)
    assert [r.get("train/loss") for r in chosen] == [r.get("train/loss") for r in first]
    # XLA's default options for the CPU step instead of the project's (`xla_flags.step_compiler_options`)
    monkeypatch.delenv("MOEJAX_ATTENTION")
    monkeypatch.setenv("MOEJAX_XLA_DEFAULTS", "1")
    defaults = _train(tmp_path / "d")
    assert (len(builds), len(traces)) == (3, 3)
    np.testing.assert_allclose([r["train/loss"] for r in defaults if "train/loss" in r],
                               [r["train/loss"] for r in first if "train/loss" in r], rtol=LOSS_RTOL)
    monkeypatch.delenv("MOEJAX_XLA_DEFAULTS")
    # Another learning rate: the same shapes, a step that must not be the first one's (it computes the rate)
    other = _train(tmp_path / "e", "--set", "train.learning_rate=0.01")
    assert (len(builds), len(traces)) == (4, 4)
    assert other[1]["train/learning_rate"] == pytest.approx(0.01) != first[1]["train/learning_rate"]
    assert other[1]["train/param_norm"] != first[1]["train/param_norm"]


def test_reused_keeps_the_last_kept_keys():
    reuse.clear()
    built = []
    build = lambda k: (lambda: built.append(k) or object())
    first = reuse.reused("k0", build("k0"))
    for i in range(1, reuse.KEPT):
        reuse.reused(f"k{i}", build(f"k{i}"))
    assert reuse.reused("k0", build("k0")) is first  # used again: now the newest
    reuse.reused("new", build("new"))  # one past KEPT: the least recently used (k1) goes
    assert reuse.reused("k0", build("k0")) is first and built.count("k0") == 1
    reuse.reused("k1", build("k1"))
    assert built.count("k1") == 2
    reuse.clear()
