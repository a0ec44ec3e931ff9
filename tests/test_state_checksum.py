"""The checkpoint's array checksums (`moejax.state_checksum`): the same bits from numpy and from XLA, from any
sharding and memory kind, and any flipped bit changes them."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import state_checksum as sc

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.uint32, np.int8, np.bool_]


def _array(dtype, shape=(16, 24), seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)


def _reference(a: np.ndarray) -> str:
    """The definition, one word at a time in Python integers."""
    raw = np.ascontiguousarray(a).reshape(-1)
    words = (raw.view(np.uint32) if raw.dtype.itemsize == 4 else
             raw.view(np.uint16 if raw.dtype.itemsize == 2 else np.uint8)).astype(np.int64).tolist()
    plain = sum(words) % 2**32
    mixed = sum(((w ^ (w >> 16)) * sc.MIX) % 2**32 for w in words) % 2**32
    return f"{plain:08x}:{mixed:08x}"


@pytest.mark.parametrize("device_sums", ["numpy", "xla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_host_device_sharded_and_pinned_host_give_the_definitions_bits(dtype, device_sums, monkeypatch):
    """A checkpoint saved on one mesh (or with the optimizer state offloaded) checks on another: sums are exact
    and order-free, whether XLA reduces the shards on device (a GPU's arrays; here forced) or numpy reduces them
    on the host (pinned_host arrays, and a CPU backend's)."""
    monkeypatch.setattr(sc, "NUMPY_ON_CPU", device_sums == "numpy")
    x = _array(dtype)
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    placed = {
        "numpy": x,
        "one device": jnp.asarray(x),
        "sharded": jax.device_put(x, NamedSharding(mesh, P("data", "expert"))),
        "pinned_host, sharded": jax.device_put(x, NamedSharding(mesh, P("data", "expert"), memory_kind="pinned_host")),
        "pinned_host, replicated": jax.device_put(x, NamedSharding(mesh, P(None, "expert"),
                                                                   memory_kind="pinned_host")),
    }
    got = sc.checksums(placed)
    assert got == dict.fromkeys(placed, _reference(x))


def test_numpy_chunks_add_up_to_the_whole(monkeypatch):
    x = _array(np.float32, (1000,))
    whole = sc.checksums({"x": x})
    monkeypatch.setattr(sc, "CHUNK_WORDS", 7)
    assert sc.checksums({"x": x}) == whole == {"x": _reference(x)}


@pytest.mark.parametrize("device_sums", ["numpy", "xla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_single_flipped_bit_changes_the_checksum(dtype, device_sums, monkeypatch):
    monkeypatch.setattr(sc, "NUMPY_ON_CPU", device_sums == "numpy")
    x = _array(dtype, (4, 6))
    before = sc.checksums({"x": jnp.asarray(x)})["x"]
    raw = x.reshape(-1).view(np.uint8)
    bits = 1 if x.dtype == np.bool_ else 8  # a bool holds 0 or 1: only its low bit is data
    for i in range(raw.size):
        for bit in range(bits):
            y = raw.copy()
            y[i] ^= np.uint8(1 << bit)
            assert sc.checksums({"x": jnp.asarray(y.view(x.dtype).reshape(x.shape))})["x"] != before, (i, bit)


def test_swapped_words_change_the_mixed_sum_only_when_values_differ():
    """Order-free by design (any sharding sums alike), so two values trading places are not seen; what a
    disk does (flips, zeroed or stale blocks) changes the values."""
    x = np.arange(8, dtype=np.uint32)
    assert sc.checksums({"x": x}) == sc.checksums({"x": x[::-1].copy()})
    zeroed = x.copy()
    zeroed[4:] = 0
    assert sc.checksums({"x": x}) != sc.checksums({"x": zeroed})


def test_leaves_are_named_alike_in_a_dataclass_and_a_partial_dict():
    """`weights.restore_weights` reads {"params": ...} alone: its leaves must carry the whole state's names."""
    from moejax.train.state import TrainState

    w = {"embed": jnp.ones((2, 3)), "blocks": [jnp.zeros((4,)), jnp.zeros((0, 2))]}
    state = TrainState(step=jnp.int32(1), params=w, compute=w, opt_state={}, rng=jnp.zeros((2,), jnp.uint32))
    whole, part = sc.checksums(state), sc.checksums({"params": w})
    assert set(whole) == {"step", "params/embed", "params/blocks/0", "compute/embed", "compute/blocks/0", "rng"}
    assert part == {k: v for k, v in whole.items() if k.startswith("params/")}  # zero-size leaves: none
    assert sc.mismatches(whole, {"params": w}) == []
    assert sc.mismatches(whole, {"params": {**w, "embed": w["embed"] * 2}}) == ["params/embed"]
