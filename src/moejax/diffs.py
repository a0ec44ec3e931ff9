"""The one nested-dict comparison: where two configs (or manifests) first differ, as a readable line."""

from __future__ import annotations


def first_difference(old: dict, new: dict, prefix: str = "") -> str:
    """`"model.n_layers: 2 there, 3 now"` for the first differing key (sorted, depth first); "" if equal."""
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            d = first_difference(a, b, f"{prefix}{key}.")
            if d:
                return d
        elif a != b:
            return f"{prefix}{key}: {a!r} there, {b!r} now"
    return ""
