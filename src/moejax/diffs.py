"""Nested-dict comparison: the first field where two config trees differ, named with a dotted path.

One traversal for every "is this the same run / the same model?" check (a run dir's config.json, a
checkpoint's model config). Nested dicts are flattened to dotted keys ("moe.top_k"); a field present on
one side only compares as `MISSING`. Fields are visited in `new`'s order, then those only `old` has, so
the field reported is the first one a reader of the current config would reach.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

MISSING = "<missing>"


class Difference(NamedTuple):
    key: str  # dotted path, e.g. "model.n_layers"
    old: Any  # MISSING when only `new` has the field
    new: Any  # MISSING when only `old` has the field


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; non-dict values are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def find_difference(old: dict, new: dict, *, ignore: Iterable[str] = ()) -> Difference | None:
    """The first differing leaf (dotted keys in `ignore` are skipped), or None when the trees agree."""
    a, b, skip = flatten(old), flatten(new), set(ignore)
    for key in [*b, *(k for k in a if k not in b)]:
        if key not in skip and a.get(key, MISSING) != b.get(key, MISSING):
            return Difference(key, a.get(key, MISSING), b.get(key, MISSING))
    return None


def first_difference(old: dict, new: dict, *, ignore: Iterable[str] = ()) -> str:
    """"" when the trees agree, else one line: "model.n_layers: 2 there, 3 now"."""
    d = find_difference(old, new, ignore=ignore)
    return "" if d is None else f"{d.key}: {d.old!r} there, {d.new!r} now"
