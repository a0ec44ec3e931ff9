"""Tokenizers: a byte-level BPE trained on the corpus (the default), cached by (corpus, vocab size).

The Llama-3 tokenizer (128,256 ids) is an optional extra (Meta's licence) handled by the data-pipeline
issue; the demo never needs it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def cache_dir() -> Path:
    root = os.environ.get("MOEJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moejax")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_key(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_bpe(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def cached_bpe(docs: list[str], vocab_size: int, name: str) -> Tokenizer:
    """Train once per (corpus, vocab) and keep the tokenizer.json in the cache (written atomically)."""
    path = cache_dir() / f"{name}-{corpus_key(docs)}-bpe{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train_bpe(docs, vocab_size)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok


def bytes_per_token(tok: Tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each id decodes to (byte-level BPE: one symbol per byte; specials count 0), for bpb."""
    out = np.zeros((vocab_size,), np.int32)
    special = {EOS}
    for i in range(min(vocab_size, tok.get_vocab_size())):
        s = tok.id_to_token(i)
        out[i] = 0 if s is None or s in special else len(s)
    return out
