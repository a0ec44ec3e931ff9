"""Which implementation a fused-kernel op runs: the GPU kernel or the XLA path.

One rule for every op that has both (attention: MOEJAX_ATTENTION, grouped GEMM: MOEJAX_GROUPED, the
optimizer's Newton-Schulz: MOEJAX_NS, whose default kernel is for single-device runs only): the
environment variable chooses explicitly ('xla' or 'gpu_kernel'); unset, a GPU backend gets the kernel and
everything else XLA; a kernel chosen off GPU runs interpreted. Opt-in ops (`OPT_IN`) default to XLA
everywhere until a GPU has measured their kernel: MOEJAX_GROUPED_ROWS, the grouped GEMM kernels reading and
writing the rows in place instead of XLA gathering them into blocks and back (`grouped.swiglu_rows`), and
MOEJAX_EP_GROUPED, the expert-parallel transport's expert MLPs on those kernels instead of batched einsums
over its capacity buffers (`grouped.swiglu_kept_rows`). On
several GPUs each kernel runs per device: its caller wraps it in shard_map over the batch shards
(`parallel.backends`: the local MoE backend, and `attention_kernel`), since a custom call left to GSPMD would
run replicated (the train loop's steps are tested for it: tests/test_local_data_parallel.py).
`targeting_gpu()` makes a machine without a GPU choose and lower as a GPU would (`moejax plan --lower`, the
CUDA lowering tests).
Every kernel is written for Pallas's Triton backend (`pallas_util.plgpu`), which jax 0.11 deprecates: in a jax
without it every op runs its XLA path, `check_choices` says so once, and an explicit gpu_kernel is refused.
The choice is read while a function is traced. The step builders (`train.step`) fix it when the step is
built (`current`, `pinned`), so a step runs what was chosen when it was made, whenever jit traces it; for
other functions, jit caches the trace by function: trace a newly built one after changing the choice.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys

import jax

from moejax.config import ConfigError, ModelConfig
from moejax.model import flash_gpu, pallas_util
from moejax.model.moe import grouped_gpu

IMPLS = ("xla", "gpu_kernel")
_targeting_gpu = contextvars.ContextVar("moejax_targeting_gpu", default=False)  # set by `targeting_gpu`
_pinned = contextvars.ContextVar("moejax_pinned_kernels", default=None)  # set by `pinned`


def lowering_for_gpu() -> bool:
    """Whether what is traced now lowers for a GPU: a GPU backend, `targeting_gpu`, or as `pinned`. Picks
    the kernels, and plain-XLA choices that depend on the compiler (`layers.scale_channels`)."""
    pin = _pinned.get()
    if pin is not None:
        return pin["on_gpu"]
    return _targeting_gpu.get() or jax.default_backend() == "gpu"


def kernel_impl(env_var: str, what: str) -> str:
    """'gpu_kernel' or 'xla' for the op `what` (named in errors), by the rule above (or as `pinned`)."""
    pin = _pinned.get()
    if pin is not None:
        return pin["impl"][env_var]
    chosen = os.environ.get(env_var) or None
    if chosen is not None and chosen not in IMPLS:
        raise ConfigError(f"{env_var}={chosen!r} is not one of {IMPLS} (the {what} implementation)")
    if chosen == "gpu_kernel" and pallas_util.plgpu is None:
        raise ConfigError(f"{env_var}=gpu_kernel: the {what} kernel is written for Pallas's Triton backend, which "
                          f"this jax ({jax.__version__}) does not have; unset {env_var} to run the XLA path")
    if chosen:
        return chosen
    return "gpu_kernel" if lowering_for_gpu() and env_var not in OPT_IN and pallas_util.plgpu is not None else "xla"


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar, value):
    """`var` is `value` within the block (a context manager, or a decorator for each call)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def targeting_gpu():
    """Within the block (while tracing), choose and lower as on a GPU: unset choices default to the kernels,
    and chosen kernels lower to Triton instead of running interpreted. For lowering to CUDA on a machine
    without a GPU; a step traced here can't run on CPU (and stays in jit's cache: build a new one)."""
    return _holding(_targeting_gpu, True)


def explicitly_chosen(env_var: str) -> bool:
    """Whether the op's implementation was chosen by its environment variable (or as `pinned`), not left to
    the default: a default may be narrower than an explicit choice (MOEJAX_NS: one device only)."""
    pin = _pinned.get()
    return pin["explicit"][env_var] if pin is not None else bool(os.environ.get(env_var))


def current() -> dict:
    """Every op's implementation, whether each was chosen explicitly, and whether kernels lower for a GPU, as
    of now: what a builder pins."""
    return {"impl": {op[0]: kernel_impl(*op) for op in KERNEL_OPS},
            "explicit": {op[0]: explicitly_chosen(op[0]) for op in KERNEL_OPS}, "on_gpu": lowering_for_gpu()}


def pinned(choices: dict):
    """Within the block, `choices` (from `current`) decide, whatever the environment says by then."""
    return _holding(_pinned, choices)


@contextlib.contextmanager
def chosen(env_var: str, impl: str):
    """Within the block, `env_var` chooses `impl` (benchmarks A/B both paths in one process; the choice is
    read when a function is traced, so build and trace a new function inside the block)."""
    if impl not in IMPLS:
        raise ConfigError(f"{env_var}={impl!r} is not one of {IMPLS}")
    before = os.environ.get(env_var)
    os.environ[env_var] = impl
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(env_var)
        else:
            os.environ[env_var] = before


def vma_checked(op: tuple[str, str]) -> bool:
    """Whether a shard_map around `op` may keep its varying-axes check: not when `op`'s kernel runs through the
    Pallas interpreter (CPU tests), which slices blocks with unvarying grid indices that the check rejects (jax
    0.10.2 and 0.11.2). Unchecked, shard_map's transpose sums the cotangents of replicated inputs itself."""
    return not (kernel_impl(*op) == "gpu_kernel" and run_interpreted())


def run_interpreted() -> bool:
    """Whether a chosen GPU kernel runs through the Pallas interpreter: off GPU (CPU tests, or a user who
    sets gpu_kernel on CPU: same values, slowly), unless `targeting_gpu`."""
    return not lowering_for_gpu()


# Every op with a GPU kernel: (environment variable, what the error calls it).
ATTENTION = ("MOEJAX_ATTENTION", "attention")
GROUPED = ("MOEJAX_GROUPED", "grouped GEMM")
NEWTON_SCHULZ = ("MOEJAX_NS", "Newton-Schulz")  # the optimizer's (train.ns_gpu), on one device by default
# The grouped GEMM's row gathers inside its kernels (on with MOEJAX_GROUPED's kernels only); not yet timed.
GROUPED_ROWS = ("MOEJAX_GROUPED_ROWS", "grouped GEMM row gathers")
# The expert-parallel transport's expert MLPs on the grouped kernels, its received rows read in place and its
# capacity buffers' empty rows skipped (`parallel.expert_parallel`); not yet timed.
EP_GROUPED = ("MOEJAX_EP_GROUPED", "expert-parallel expert GEMMs")
KERNEL_OPS = (ATTENTION, GROUPED, NEWTON_SCHULZ, GROUPED_ROWS, EP_GROUPED)
OPT_IN = {GROUPED_ROWS[0], EP_GROUPED[0]}  # unset: XLA, on a GPU too


def check_choices(model: ModelConfig | None = None, seq_len: int | tuple[int, ...] | None = None) -> None:
    """Raise, before a run starts, the ConfigError a bad or missing choice, or a model shape a chosen kernel
    can't take, would raise mid-trace. `seq_len`: the row length, or every row length the run will have
    (context phases: seq_len / context-parallel degree)."""
    for op in KERNEL_OPS:
        kernel_impl(*op)
    if lowering_for_gpu() and pallas_util.plgpu is None:
        print(f"moejax: note: this jax ({jax.__version__}) has no Pallas Triton backend, so attention, the grouped "
              "GEMM and Newton-Schulz run on their XLA paths, not the GPU kernels", file=sys.stderr)
    if kernel_impl(*GROUPED_ROWS) == "gpu_kernel" and kernel_impl(*GROUPED) != "gpu_kernel":
        raise ConfigError(f"{GROUPED_ROWS[0]}=gpu_kernel moves the row gathers into the grouped GEMM's kernels, "
                          f"but {GROUPED[0]} is xla here: set {GROUPED[0]}=gpu_kernel too, or unset {GROUPED_ROWS[0]}")
    if model is None:
        return
    problems = {}
    for op in (GROUPED, EP_GROUPED):
        if kernel_impl(*op) == "gpu_kernel":
            problems[op[0]] = grouped_gpu.shape_problem(grouped_gpu.MIN_TILE, model.latent_width, model.expert_width)
    if kernel_impl(*ATTENTION) == "gpu_kernel" and seq_len is not None:
        rows = (seq_len,) if isinstance(seq_len, int) else seq_len
        problems[ATTENTION[0]] = next(filter(None, (flash_gpu.shape_problem(s, model.n_heads, model.n_kv_heads,
                                                                            model.head_dim) for s in rows)), None)
    problems = [f"{var}=gpu_kernel: {p}" for var, p in problems.items() if p]
    if problems:
        raise ConfigError("; ".join(problems) + " — fix the model, or set the variable to xla")
