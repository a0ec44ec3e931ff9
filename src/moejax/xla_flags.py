"""XLA settings: the XLA_FLAGS shared by the CLI and the subprocesses it (and the tests, benches and CUDA
compiles) starts, and the compiler options the jitted train steps are built with.

A forced host-device count is read once, when XLA's first backend starts, so a subprocess that lays out its
own mesh must not inherit its parent's.

XLA:CPU hands dots and many elementwise and reduction fusions to YNNPACK by default. A MoE step is full of
batched matmuls only 64-128 wide (grouped-GEMM blocks, Newton-Schulz stacks, attention heads), which YNNPACK
runs at 20-45% of the 1024^3 peak; XLA's own Eigen dots and fused loops run them up to ~2x faster. The whole
train step at issue 11's CPU shape: 1.18-1.20x with every YNNPACK fusion off, both compiled in one process
(docs/LOG.md, 2026-12-02, eighth session); the tiny demo's step 1.04-1.12x. YNNPACK's reductions, though,
beat XLA's own loops: the three norm metrics (grad, update, param) over 12M parameters took 18.5 ms each
without them and 3.7 with them, and the step with reductions alone left to YNNPACK ran 1.04-1.13x (adam)
and 1.11x (hero) faster than with none, the tiny demo's step 1.03x (docs/LOG.md 2026-12-03, sixteenth
session; YNNPACK's elementwise fusions on top cost 0.80x in the eighth). So train steps compile with
YNNPACK for reductions only on CPU, per executable (not process-wide, so nothing else changes), unless
XLA_FLAGS names the option (the user's setting wins) or MOEJAX_XLA_DEFAULTS=1 asks for XLA's defaults. Eval
steps keep XLA's defaults: a forward pass is mostly the LM head's one large dot, which YNNPACK runs faster
(the tiny eval step measured 0.82-0.99x with dots off).

The parameter initialiser compiles with LLVM at -O1 on CPU (`init_compiler_options`): XLA's default -O2 spent
8.4 s on the tiny model's random initialisers (a threefry hash per leaf) and 9.2 s at issue 11's CPU shape,
-O1 3.0 and 3.2 s, with the same bits in every leaf (tiny, the CPU shape, two layers of d768; docs/LOG.md
2026-12-06, forty-second session). A run's first start, and every new model config, is ~5 s sooner.
"""

from __future__ import annotations

import functools
import os
import warnings

FORCED_HOST_DEVICES = "--xla_force_host_platform_device_count"
YNN_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
CPU_STEP_OPTIONS = {YNN_FUSIONS: "LIBRARY_FUSION_TYPE_REDUCE"}  # the library fusion types YNNPACK may take
XLA_DEFAULTS = "MOEJAX_XLA_DEFAULTS"  # =1: the train step and the initialiser compile with XLA's defaults
OPT_LEVEL = "xla_backend_optimization_level"  # LLVM's -O level of XLA's CPU and GPU backends (default 2)
CPU_INIT_OPTIONS = {OPT_LEVEL: 1}


def without_forced_host_devices(xla_flags: str) -> str:
    """XLA_FLAGS for a `moejax` subprocess: all but a forced host-device count, so that `--mesh` sets its own."""
    return " ".join(f for f in xla_flags.split() if not f.startswith(FORCED_HOST_DEVICES))


def step_compiler_options(platform: str) -> dict:
    """`compiler_options` for a jitted train step on `platform` ("cpu", "gpu", ...): CPU_STEP_OPTIONS on
    CPU, unless XLA_FLAGS sets one of them, MOEJAX_XLA_DEFAULTS=1, or this jaxlib doesn't know them (an
    unknown option fails every compile: a warning, then none); nothing elsewhere. Recorded in run_info.json.
    A jit with options can't be traced inside another jit or grad: the steps are called at top level."""
    if not _ours_to_set(platform, CPU_STEP_OPTIONS):
        return {}
    return dict(CPU_STEP_OPTIONS) if _cpu_options_known() else {}


def init_compiler_options(platform: str) -> dict:
    """`compiler_options` for the jitted parameter initialiser on `platform`: CPU_INIT_OPTIONS on CPU (it runs
    once, and -O1 compiles it in a third of -O2's time to the same bits), unless XLA_FLAGS sets the level (the
    test suite's -O0) or MOEJAX_XLA_DEFAULTS=1; nothing elsewhere."""
    return dict(CPU_INIT_OPTIONS) if _ours_to_set(platform, CPU_INIT_OPTIONS) else {}


def _ours_to_set(platform: str, cpu_options: dict) -> bool:
    """Whether moejax sets `cpu_options` on `platform`: on CPU only, and not where XLA_FLAGS names one of them (the
    user's setting wins) or MOEJAX_XLA_DEFAULTS=1 asks for XLA's defaults."""
    named = {f.split("=", 1)[0] for f in os.environ.get("XLA_FLAGS", "").split()}
    return platform == "cpu" and os.environ.get(XLA_DEFAULTS) != "1" and not any(f"--{k}" in named for k in cpu_options)


@functools.cache
def _cpu_options_known() -> bool:
    import jax  # not at import: the CLI sets XLA_FLAGS before jax starts
    import jax.numpy as jnp

    try:
        x = jnp.zeros((), device=jax.devices("cpu")[0])
        jax.jit(lambda x: x + 1).lower(x).compile(compiler_options=CPU_STEP_OPTIONS)
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" not in str(e) and "not a valid" not in str(e):
            raise
        warnings.warn(f"moejax: this jaxlib ({jax.__version__}) does not take {CPU_STEP_OPTIONS}: CPU train steps "
                      f"compile with XLA's defaults ({str(e).splitlines()[0]})", stacklevel=2)
        return False
    return True
