"""Tokenizers: a byte-level BPE trained on the corpus (the default), a tokenizer.json, or Llama-3.

The Llama-3 tokenizer (128,256 ids) is an optional extra (Meta's licence) handled by the data-pipeline
issue; the demo never needs it.
"""

from __future__ import annotations

import hashlib
import os
import threading
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
    interruptible(tok.train_from_iterator, docs, trainer=trainer)
    return tok


def interruptible(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a worker thread, the caller waiting in short slices.

    Why: tokenizers' Rust calls (BPE training, batch encoding) release the GIL but keep the main thread out
    of Python until they return, so Ctrl-C waited for the end of a training that can take minutes. Waiting
    on an event in slices lets the signal handler run at once. (Not `Thread.join(timeout)`: CPython 3.11 marks
    a running thread stopped when an exception interrupts its join.) An interrupted call is abandoned (a
    daemon thread), not awaited; its exceptions reach the caller unchanged."""
    out: dict = {}
    done = threading.Event()

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller as is
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="moejax-tokenizer", daemon=True).start()
    while not done.wait(0.1):
        pass
    if "error" in out:
        raise out["error"]
    return out["value"]


def bytes_per_token(tok: Tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each id decodes to (byte-level BPE: one symbol per byte; specials count 0), for bpb."""
    out = np.zeros((vocab_size,), np.int32)
    special = {EOS}
    for i in range(min(vocab_size, tok.get_vocab_size())):
        s = tok.id_to_token(i)
        out[i] = 0 if s is None or s in special else len(s)
    return out


# ---- tokenizer specs for `moejax data prepare` ----------------------------------------------------
# A spec is `bpe:VOCAB` (byte-level BPE trained on the sources), a path to a Hugging Face tokenizer.json,
# or `llama3` (Meta's tiktoken model inside the optional `llama-models` package).
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
# Llama-3's pre-tokenizer regex and specials, from llama_models/llama3/tokenizer.py (128,000 BPE ids +
# 256 reserved specials; <|end_of_text|> = 128001).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = 256


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the few calls the pipeline needs (batch encode runs on Rust threads)."""

    def __init__(self, tok: Tokenizer, spec: str):
        # A document's text is text: without this, tokenizers matches its special tokens inside the text (even
        # with add_special_tokens=False), so a web page quoting "<|endoftext|>" got the EOS id mid-document:
        # a false document boundary to nothing, 0 bytes counted for 13 (tiktoken's encode_ordinary never did).
        tok.encode_special_tokens = True
        self.tok, self.spec = tok, spec
        self.vocab_size = tok.get_vocab_size()
        eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise ValueError(f"tokenizer {spec} has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}")
        self.eos_token, self.eos_id = eos, tok.token_to_id(eos)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encoded = interruptible(self.tok.encode_batch, texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encoded]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def bytes_per_token(self) -> np.ndarray:
        if isinstance(self.tok.pre_tokenizer, pre_tokenizers.ByteLevel):
            return bytes_per_token(self.tok, self.vocab_size)
        # Other models: UTF-8 length of each id's text (specials 0); exact for byte-fallback-free vocabs.
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        out = np.zeros((self.vocab_size,), np.int32)
        for i in range(self.vocab_size):
            s = self.tok.id_to_token(i)
            out[i] = 0 if s is None or s in special else len(self.tok.decode([i]).encode("utf-8"))
        return out

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


class TiktokenTokenizer:
    """Llama-3 through tiktoken; `encode_ordinary_batch` runs on tiktoken's thread pool."""

    def __init__(self, model_path: str, spec: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(model_path)
        n = len(ranks)
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        specials += [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_SPECIALS - len(specials))]
        self.enc = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={t: n + i for i, t in enumerate(specials)})
        self.spec, self.vocab_size, self.model_path = spec, n + LLAMA3_SPECIALS, model_path
        self.eos_token, self.eos_id = "<|end_of_text|>", n + 1

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e, np.int64) for e in self.enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)]

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def bytes_per_token(self) -> np.ndarray:
        out = np.zeros((self.vocab_size,), np.int32)
        for i in range(self.vocab_size - LLAMA3_SPECIALS):
            out[i] = len(self.enc.decode_single_token_bytes(i))
        return out

    def save(self, path: Path) -> None:  # the model file is Meta's; the store records its checksum instead
        pass


def llama3_model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llama_models")
    path = Path(spec.origin).parent / "llama3" / "tokenizer.model" if spec and spec.origin else None
    if path is None or not path.exists() or importlib.util.find_spec("tiktoken") is None:
        raise ValueError("tokenizer llama3 needs the optional llama-models and tiktoken packages: "
                         "pip install moejax[llama]")
    return str(path)


MAX_VOCAB = 2**31 - 1


def tokenizer_from_spec(spec: str, training_docs=None):
    """`bpe:VOCAB` (trained on `training_docs()`, an iterable factory), a tokenizer.json path, or `llama3`.
    Raises ValueError with a one-line message for a bad spec."""
    if spec.startswith("bpe:"):
        vocab = spec[4:]
        if not vocab.isdecimal() or not 257 <= int(vocab) <= MAX_VOCAB:
            raise ValueError(f"tokenizer {spec!r}: VOCAB must be an integer from 257 (256 bytes + EOS) to "
                             f"{MAX_VOCAB:,} (token ids are int32)")
        return HFTokenizer(train_bpe(training_docs(), int(vocab)), spec)
    if spec == "llama3":
        return TiktokenTokenizer(llama3_model_path(), spec)
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(f"tokenizer file {spec} does not exist")
        try:
            tok = Tokenizer.from_file(spec)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            reason = str(e).splitlines()[0]
            raise ValueError(f"tokenizer file {spec} is not a valid tokenizer.json ({reason})") from None
        return HFTokenizer(tok, spec)
    raise ValueError(f"unknown tokenizer {spec!r} (use bpe:VOCAB, a path to a tokenizer.json, or llama3)")
