"""JAX's persistent compilation cache: a restart (a resume after preemption, a second `generate`) loads the
compiled step instead of compiling it again.

The default location is `~/.cache/moejax/jax` (beside the tokenizer cache); `JAX_COMPILATION_CACHE_DIR`
or an explicit `jax.config` setting wins (the test suite points it at a per-session directory).
"""

from __future__ import annotations

import jax

from moejax.data.tokenizer import cache_dir


def enable_compile_cache() -> None:
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
