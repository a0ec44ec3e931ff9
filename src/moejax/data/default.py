"""The demo dataset: KJV chapters, a cached byte-level BPE, and a cached token store."""

from __future__ import annotations

import os

import numpy as np

from moejax.data.corpus import bible_documents
from moejax.data.loader import TokenStore
from moejax.data.tokenizer import EOS, cache_dir, cached_bpe, corpus_key


def bible_store(vocab_size: int):
    """(TokenStore, tokenizer) for the embedded corpus; tokens cached as .npz next to the tokenizer."""
    docs = bible_documents()
    tok = cached_bpe(docs, vocab_size, "kjv")
    path = cache_dir() / f"kjv-{corpus_key(docs)}-bpe{vocab_size}.npz"
    if path.exists():
        with np.load(path) as z:
            return TokenStore(z["tokens"], z["doc_starts"]), tok
    encoded = [e.ids for e in tok.encode_batch(docs)]
    store = TokenStore.from_documents(encoded, tok.token_to_id(EOS))
    tmp = str(path) + f".tmp{os.getpid()}.npz"
    np.savez(tmp, tokens=store.tokens, doc_starts=store.doc_starts)
    os.replace(tmp, path)
    return store, tok
