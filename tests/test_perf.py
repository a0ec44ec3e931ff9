"""MFU's peak is the whole job's: per device on accelerators, per process on CPU (issue 11 item 4)."""

import jax

from moejax.perf import job_peak


def test_cpu_peak_counts_processes_not_forced_host_devices():
    assert jax.device_count() == 8  # tests force 8 host devices; they share this one process's cores
    p = job_peak(1e11)
    assert p["platform"] == "cpu" and p["peak_units"] == jax.process_count() == 1
    assert p["peak_flops"] == 1e11 and p["peak_source"] == "--peak-flops"


def test_measured_peak_is_positive_and_labelled():
    p = job_peak()
    assert p["peak_flops"] > 1e8 and p["peak_source"].startswith("measured: float32 matmul")
