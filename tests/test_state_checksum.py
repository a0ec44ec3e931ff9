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


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _reference(a: np.ndarray) -> str:
    """The definition, one word at a time in Python integers."""
    raw = np.ascontiguousarray(a)
    if raw.dtype.itemsize == 8:
        words = raw.reshape(raw.shape + (1,)).view(np.uint32)
    else:
        words = (raw.view(np.uint32) if raw.dtype.itemsize == 4 else
                 raw.view(np.uint16 if raw.dtype.itemsize == 2 else np.uint8)).astype(np.uint32)
    plain = mixed = placed = 0
    for index in np.ndindex(*words.shape):
        w = int(words[index])
        weight = 1
        for k, i in enumerate(index):
            weight = weight * (_fmix32((i + k * 0x9E3779B9) % 2**32) | 1) % 2**32
        plain += w
        mixed += ((w ^ (w >> 16)) * sc.MIX) % 2**32
        placed += w * weight
    return f"{plain % 2**32:08x}:{mixed % 2**32:08x}:{placed % 2**32:08x}"


@pytest.mark.parametrize("device_sums", ["numpy", "xla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_host_device_sharded_and_pinned_host_give_the_definitions_bits(dtype, device_sums, monkeypatch):
    """A checkpoint saved on one mesh (or with the optimizer state offloaded) checks on another: sums are exact
    and independent of reduction order, whether XLA reduces the shards on device (a GPU's arrays; here forced) or
    numpy reduces them on the host (pinned_host arrays, and a CPU backend's)."""
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


@pytest.mark.parametrize("shape", [(1000,), (3, 2, 3), (3, 5, 40), (2, 3, 1, 9)])
def test_numpy_blocks_add_up_to_the_whole(shape, monkeypatch):
    """Blocks smaller than a row, than a plane, and sharded ones: each block's weights start at its global index."""
    x = _array(np.float32, shape)
    whole = sc.checksums({"x": x})
    monkeypatch.setattr(sc, "CHUNK_WORDS", 7)
    axis = next(a for a, n in enumerate(shape) if n % 2 == 0)  # halved over 2 devices, so shards start mid-array
    spec = P(*[("data" if a == axis else None) for a in range(len(shape))])
    sharded = jax.device_put(x, NamedSharding(jax.make_mesh((2,), ("data",)), spec))
    assert len({str(s.index) for s in sharded.addressable_shards}) == 2
    assert sc.checksums({"x": x}) == sc.checksums({"x": sharded}) == whole == {"x": _reference(x)}


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


def test_values_in_the_wrong_place_change_the_placed_sum_only():
    """Two shards, rows or words that trade places, or a square matrix's transpose: the same values, so `plain` and
    `mixed` keep their bits; `placed` weighs each word by its global index and changes."""
    x = _array(np.float32, (8, 8), seed=3)
    moved = {
        "two words": x.reshape(-1)[[1, 0, *range(2, 64)]].reshape(8, 8),
        "two rows": x[[4, 1, 2, 3, 0, 5, 6, 7]],
        "two halves (shards)": np.concatenate([x[4:], x[:4]]),
        "transpose": x.T.copy(),
        "reversed": x.reshape(-1)[::-1].reshape(8, 8).copy(),
    }
    before = sc.checksums({"x": x})["x"].split(":")
    for what, y in moved.items():
        after = sc.checksums({"x": y})["x"].split(":")
        assert after[:2] == before[:2] and after[2] != before[2], what


@pytest.mark.parametrize("device_sums", ["numpy", "xla"])
def test_shards_restored_to_each_others_places_are_seen(device_sums, monkeypatch):
    """The failure a sharded restore could have: every shard intact, one written where another belongs."""
    monkeypatch.setattr(sc, "NUMPY_ON_CPU", device_sums == "numpy")
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    sharding = NamedSharding(mesh, P("data", "expert"))
    x = _array(np.float32, (16, 24), seed=4)
    y = x.copy()
    y[:8, :6], y[:8, 6:12] = x[:8, 6:12], x[:8, :6]
    assert sc.checksums({"x": jax.device_put(x, sharding)}) == {"x": _reference(x)}
    assert sc.mismatches(sc.checksums({"x": x}), {"x": jax.device_put(y, sharding)}) == ["x"]


def test_a_two_sum_entry_from_before_placed_is_checked_on_its_two():
    x = _array(np.float32, (4, 6))
    now = sc.checksums({"x": x})["x"]
    old = now.rsplit(":", 1)[0]
    assert sc.mismatches({"x": old}, {"x": x}) == []
    assert sc.mismatches({"x": old}, {"x": x * 2}) == ["x"]
    for damaged in (now.split(":")[0], now + ":00000000", 7, None, now.replace(now[-1], "g")):
        assert sc.mismatches({"x": damaged}, {"x": x}) == ["x"], damaged


@pytest.mark.parametrize("device_sums", ["numpy", "xla"])
def test_eight_byte_leaves_and_scalars_give_the_definitions_bits(device_sums, monkeypatch):
    """A uint64 / float64 leaf (x64 host arrays) is two words an element, on a last axis of 2; a 0-d leaf has
    weight 1 on its one word."""
    monkeypatch.setattr(sc, "NUMPY_ON_CPU", device_sums == "numpy")
    leaves = {"u64": np.arange(12, dtype=np.uint64).reshape(3, 4) * np.uint64(0x1234567890AB),
              "f64": np.linspace(-1, 1, 5), "scalar": np.float32(3.5), "step": jnp.int32(7)}
    expect = {n: _reference(np.asarray(x)) for n, x in leaves.items()}
    assert sc.checksums(leaves) == expect


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
