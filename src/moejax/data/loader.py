"""Packed sequences with segment ids: `pack_windows` and the pipeline's `MixtureLoader`.

A source (`store.SourceTokens`) is one flat token array (documents separated by EOS) plus document
offsets. `MixtureLoader` (built by `pipeline.make_data`) reads windows chosen by `mixture.py` from several
sources and packs them with `pack_windows`: every token is labelled with its document (segment ids from 1) and
its position inside that document, so attention, SConv and the loss never cross a boundary. A batch is a
pure function of (seed, step): resume needs nothing but the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moejax.data.store import StoreError

SPLITS = {"train": 0, "eval": 1}  # part of the permutation key, so the two splits never share an order


# ---- packed windows from a mixture of sources (the pipeline's loader) -----------------------------------
def pack_windows(tokens: np.ndarray, doc_offsets: np.ndarray, starts: np.ndarray,
                 seq_len: int) -> dict[str, np.ndarray]:
    """Rows of seq_len + 1 tokens from each start, labelled with document-relative segment ids (from 1) and
    positions (offset inside the document, so a document cut by the window keeps its true positions)."""
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts.tolist()]).astype(np.int32)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [R, S+1]
    doc = np.searchsorted(doc_offsets, idx, side="right") - 1
    seg = (doc - doc[:, :1] + 1).astype(np.int32)
    pos = (idx - doc_offsets[doc]).astype(np.int32)
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:], "segment_ids": seg[:, :-1], "positions": pos[:, :-1],
            "loss_mask": seg[:, 1:] == seg[:, :-1]}


def chunk_rows(batch: dict, context: int) -> dict:
    """Context parallelism: each [B, S] row becomes `context` consecutive rows [B*context, S/context] (a
    row-major reshape, so chunk j of sequence b is row b*context + j). Segment ids, positions, targets and
    the loss mask were computed on the whole sequence, so they stay right across the chunk boundaries."""
    if context == 1:
        return batch
    out = {}
    for key, a in batch.items():
        rows, seq = a.shape
        if seq % context:
            raise ValueError(f"seq_len ({seq}) is not divisible by the context-parallel degree ({context})")
        out[key] = a.reshape(rows * context, seq // context)
    return out


@dataclass(frozen=True)
class MixtureLoader:
    """`batch(step)`: this process's rows of the global batch of `step`, a pure function of (seed, step).

    Row r of the global batch depends only on (seed, step, r), so rows [p*B/P, (p+1)*B/P) computed by
    process p concatenate to the single-process batch for any process count P.
    """

    sources: tuple  # SourceTokens
    ranges: tuple[tuple[int, int], ...]  # token range [lo, hi) of this split in each source
    spans: tuple  # mixture.Span, ascending
    seed: int
    split: str
    vocab_size: int
    process_index: int = 0
    process_count: int = 1

    def span_at(self, step: int):
        for span in self.spans:
            if step < span.stop:
                return span
        return self.spans[-1]  # past the planned steps: the last span continues

    def seq_len_at(self, step: int) -> int:
        return self.span_at(step).seq_len

    def batch_size_at(self, step: int) -> int:
        return self.span_at(step).batch_size // self.process_count

    def batch(self, step: int) -> dict[str, np.ndarray]:
        from moejax.data.mixture import permute

        span = self.span_at(step)
        src, ctr = span.rows(step)
        per = span.batch_size // self.process_count
        mine = slice(self.process_index * per, (self.process_index + 1) * per)
        src, ctr = src[mine], ctr[mine]
        L, parts, where = span.seq_len, [], []
        for k in np.unique(src):
            lo, hi = self.ranges[k]
            n = (hi - lo - 1) // L
            rows = np.flatnonzero(src == k)
            epoch, within = np.divmod(ctr[rows], n)
            starts = np.empty(len(rows), np.int64)
            for e in np.unique(epoch):
                sel = epoch == e
                starts[sel] = lo + L * permute(within[sel], n, (self.seed, SPLITS[self.split], int(k), L, int(e)))
            parts.append(pack_windows(self.sources[k].tokens, self.sources[k].doc_offsets, starts, L))
            where.append(rows)
        order = np.argsort(np.concatenate(where), kind="stable")
        out = {key: np.concatenate([p[key] for p in parts])[order] for key in parts[0]}
        top = max(int(out["tokens"].max()), int(out["targets"].max()))
        if top >= self.vocab_size:  # an embedding lookup would clamp it silently
            names = ", ".join(repr(self.sources[k].name) for k in np.unique(src))
            raise StoreError(f"{self.split} batch {step}: token id {top} (source {names}) is >= the "
                             f"tokenizer's vocab_size {self.vocab_size}: the store is corrupt; check it with "
                             "`moejax data check --verify`")
        return out
