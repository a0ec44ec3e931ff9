"""XLA_FLAGS shared by the CLI and the subprocesses it (and the tests, benches and CUDA compiles) starts.

A forced host-device count is read once, when XLA's first backend starts, so a subprocess that lays out its
own mesh must not inherit its parent's.
"""

FORCED_HOST_DEVICES = "--xla_force_host_platform_device_count"


def without_forced_host_devices(xla_flags: str) -> str:
    """XLA_FLAGS for a `moejax` subprocess: all but a forced host-device count, so that `--mesh` sets its own."""
    return " ".join(f for f in xla_flags.split() if not f.startswith(FORCED_HOST_DEVICES))
