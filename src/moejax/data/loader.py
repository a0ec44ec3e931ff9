"""Token store and a resumable batcher of packed sequences with segment ids.

A `TokenStore` is one flat int32 token array (documents separated by EOS) plus document start offsets.
`Batcher.batch(step)` is a pure function of (seed, step, split): it draws `batch_size` windows of
`seq_len + 1` tokens and labels every token with its document (segment ids from 1) and its position
inside that document, so attention, SConv and the loss never cross a boundary. Resume needs nothing but
the step. The last `heldout_fraction` of documents is the evaluation split, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPLITS = {"train": 0, "eval": 1}


@dataclass(frozen=True)
class TokenStore:
    tokens: np.ndarray  # [N] int32
    doc_starts: np.ndarray  # [n_docs] int64, ascending, doc_starts[0] == 0

    @staticmethod
    def from_documents(encoded: list[list[int]], eos_id: int) -> "TokenStore":
        lens = np.array([len(e) + 1 for e in encoded], np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        flat = np.fromiter((t for e in encoded for t in (*e, eos_id)), np.int32, count=int(lens.sum()))
        return TokenStore(flat, starts)

    def split_range(self, split: str, heldout_fraction: float) -> tuple[int, int]:
        n_docs = len(self.doc_starts)
        n_eval = max(1, int(round(n_docs * heldout_fraction)))
        cut = int(self.doc_starts[n_docs - n_eval])
        return (0, cut) if split == "train" else (cut, len(self.tokens))


@dataclass(frozen=True)
class Batcher:
    store: TokenStore
    seq_len: int
    batch_size: int
    seed: int
    split: str = "train"
    heldout_fraction: float = 0.02

    def __post_init__(self):
        lo, hi = self.store.split_range(self.split, self.heldout_fraction)
        if hi - lo < self.seq_len + 2:
            raise ValueError(f"{self.split} split has {hi - lo} tokens, fewer than seq_len + 2 ({self.seq_len + 2})")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        lo, hi = self.store.split_range(self.split, self.heldout_fraction)
        rng = np.random.default_rng([self.seed, step, SPLITS[self.split]])
        starts = rng.integers(lo, hi - self.seq_len - 1, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # [B, S+1]
        toks = self.store.tokens[idx]
        doc = np.searchsorted(self.store.doc_starts, idx, side="right") - 1
        seg = (doc - doc[:, :1] + 1).astype(np.int32)
        pos = (idx - self.store.doc_starts[doc]).astype(np.int32)
        return {
            "tokens": toks[:, :-1],
            "targets": toks[:, 1:],
            "segment_ids": seg[:, :-1],
            "positions": pos[:, :-1],
            "loss_mask": seg[:, 1:] == seg[:, :-1],
        }
