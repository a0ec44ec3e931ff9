"""A second run of one config in one process reuses the first one's traced and compiled functions.

jax caches a function's trace, lowering and executable by the Python function object. The loop built its optimizer
and steps, and `state.init_state` its initialisers, as new closures for every run, so each `train` in a process
traced, lowered and compiled (or read from the persistent cache) all of them again: ~8 s of a 9 s two-step run at
the tiny preset on this CPU (docs/LOG.md, forty-first session). A config repeats in one process when a notebook
resumes a run after a preemption or an error (the same command again), or reruns one, and in the test suite's many
short runs.

`reused(key, build)` keeps the last `KEPT` builds by key. A key holds everything its build reads: for the steps,
the whole `RunConfig` (stricter than the steps need), the mesh, the optimizer and its schedules, the state's
shardings and placement, the remat setting, the GPU-kernel choices the environment makes (`kernel_choice.current`,
which the step builders pin) and the step's compiler options; jax's own cache adds its config and the arguments'
shapes. Code changed at run time (a test's monkeypatch of a traced function) is not in any key: `clear()` first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

import jax

KEPT = 12  # builds kept (a run makes 4): each holds compiled executables (no arrays), MBs at the suite's shapes
_kept: OrderedDict[Hashable, Any] = OrderedDict()


def reused(key: Hashable, build: Callable[[], Any]) -> Any:
    """`build()`'s result for `key`, built once while it stays among the last `KEPT` keys used."""
    if key in _kept:
        _kept.move_to_end(key)
        return _kept[key]
    value = _kept[key] = build()
    while len(_kept) > KEPT:
        _kept.popitem(last=False)
    return value


def tree_key(tree) -> Hashable:
    """A hashable stand-in for a pytree of hashable leaves (shardings): its structure and its leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


def clear() -> None:
    _kept.clear()
