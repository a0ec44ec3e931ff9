"""The on-disk token store: written once by `moejax data prepare`, memory-mapped by the loader.

Layout of a store directory:
  manifest.json            format, tokenizer (spec, vocab size, EOS), per-source counts, sha256 of every file
  tokenizer.json           the Hugging Face tokenizer (absent for llama3: Meta's file, recorded by checksum)
  bytes_per_token.npy      int32 [vocab]: UTF-8 bytes each id decodes to (specials 0), for bits per byte
  <source>/tokens.npy      uint16 (vocab <= 65,536) or uint32 [N]: documents back to back, EOS after each
  <source>/doc_offsets.npy int64 [n_docs + 1]: document d is tokens[off[d]:off[d+1]] (its EOS included)

Choices: `.npy` (not a custom binary) so `np.load(mmap_mode="r")` opens any store; token arrays are
streamed to disk with a fixed-size header patched at the end, so memory stays flat for any corpus size;
the whole store is built under a hidden temporary name next to the target and renamed at the end, so a
failure (or Ctrl-C) never leaves a partial store where a loader could find it. The temporary name
(`.NAME.tmp-PID-XXXXXXXX@HOST`) records its writer, so the next prepare of NAME removes those left by
killed writers on this host. `--overwrite` replaces only an empty directory or a store holding nothing
but what prepare wrote; anything else is refused, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moejax.config import ConfigError

FORMAT = "moejax-token-store/1"
SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HEADER_BYTES = 128  # fixed .npy v1 header size, so the shape can be patched in place after streaming


class StoreError(ConfigError):
    """A missing, partial, corrupt or mismatched store; the message names the path and the numbers."""


# ---- writing ---------------------------------------------------------------------------------------
def _npy_header(dtype: np.dtype, n: int) -> bytes:
    body = f"{{'descr': '{np.dtype(dtype).str}', 'fortran_order': False, 'shape': ({n},), }}"
    body = body.ljust(_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


class NpyAppender:
    """Append 1-D chunks to a `.npy` file without knowing the final length up front."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.n = path, np.dtype(dtype), 0
        self.f = open(path, "wb")
        self.f.write(_npy_header(self.dtype, 0))

    def append(self, arr: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(arr, self.dtype).tobytes())
        self.n += len(arr)

    def close(self) -> int:
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, self.n))
        self.f.close()
        return self.n


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


STORE_FILES = ("manifest.json", "tokenizer.json", "bytes_per_token.npy")
SOURCE_FILES = ("tokens.npy", "doc_offsets.npy")


def _work_dir_re(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-(\d+)-[0-9a-f]{{8}}(?:@(.+))?$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _not_written_by_prepare(out: Path) -> str | None:
    """The first entry of `out` that `moejax data prepare` did not write (None: empty, or a pure store)."""
    if not out.is_dir():
        return f"{out} itself (not a directory)"
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    try:
        m = json.loads((out / "manifest.json").read_text())
        ok = isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("sources"), dict)
    except (OSError, ValueError):
        ok = False
    if not ok:
        return "its contents (no moejax manifest.json)"
    for name in entries:
        if name in STORE_FILES:
            continue
        sub = out / name
        if name not in m["sources"] or not sub.is_dir() or any(f.name not in SOURCE_FILES for f in sub.iterdir()):
            return name
    return None


class StoreWriter:
    """Builds a store under a temporary directory; `commit()` renames it into place, `abort()` deletes it."""

    def __init__(self, out: Path, overwrite: bool = False):
        self.out, self.overwrite = Path(out), overwrite
        if self.out.exists() and not overwrite:
            raise StoreError(f"{self.out} already exists; choose another --out or pass --overwrite")
        if self.out.exists() and (alien := _not_written_by_prepare(self.out)):
            raise StoreError(f"--overwrite refused: {self.out} is not empty and not only a token store "
                             f"(moejax did not write {alien}); choose another --out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{tag}"
        self._old = self.out.parent / f".{self.out.name}.old-{tag}"
        self.tmp.mkdir()
        self.sources: dict[str, dict] = {}

    def _remove_leftovers(self) -> None:
        """Work dirs of killed prepare runs of this store on this host (their PID is gone): `.tmp-` ones
        always, `.old-` ones (a replaced store) only once the swap had finished, i.e. `out` exists."""
        pattern, host, removed = _work_dir_re(self.out.name), socket.gethostname(), []
        for p in self.out.parent.iterdir():
            m = pattern.match(p.name)
            if not m or m.group(3) not in (None, host) or _pid_alive(int(m.group(2))):
                continue
            if m.group(1) == "old" and not self.out.exists():
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        if removed:
            print(f"moejax: removed {len(removed)} work dir(s) left by killed prepare runs: {', '.join(removed)}",
                  file=sys.stderr)

    def source_paths(self, name: str) -> tuple[Path, Path]:
        (self.tmp / name).mkdir()
        return self.tmp / name / "tokens.npy", self.tmp / name / "doc_offsets.npy"

    def commit(self, manifest: dict) -> Path:
        for name, info in manifest["sources"].items():
            info["sha256"] = {f: sha256_file(self.tmp / name / f) for f in ("tokens.npy", "doc_offsets.npy")}
        manifest["sha256"] = {f.name: sha256_file(f) for f in sorted(self.tmp.iterdir()) if f.is_file()}
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if self.overwrite and self.out.exists():  # --overwrite: swap, then delete the old store
            os.rename(self.out, self._old)
            os.rename(self.tmp, self.out)
            shutil.rmtree(self._old, ignore_errors=True)
            return self.out
        try:  # a directory renames over an empty one only: a store another process finished first stays
            os.rename(self.tmp, self.out)
        except OSError:
            if not self.out.exists():
                raise
            raise StoreError(f"{self.out} already exists (written while this one was built); "
                             "choose another --out or pass --overwrite") from None
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- reading ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceTokens:
    """One source: a flat token array and its document offsets (memory-mapped when read from disk)."""

    name: str
    tokens: np.ndarray  # [N] uint16/uint32/int32
    doc_offsets: np.ndarray  # [n_docs + 1] int64, doc_offsets[0] == 0, doc_offsets[-1] == N

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def heldout_cut(self, fraction: float) -> int:
        """Token offset where the held-out documents (the last `fraction`, at least one) begin."""
        if self.n_docs < 2:
            raise StoreError(f"source {self.name!r} has {self.n_docs} document(s); a train/eval split needs >= 2")
        n_eval = min(self.n_docs - 1, max(1, int(round(self.n_docs * fraction))))
        return int(self.doc_offsets[self.n_docs - n_eval])

    def document(self, i: int) -> np.ndarray:
        """Document i's tokens without its trailing EOS."""
        return np.asarray(self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1] - 1])

    @staticmethod
    def from_documents(name: str, encoded: list, eos_id: int) -> "SourceTokens":
        lens = np.array([len(e) + 1 for e in encoded], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = np.concatenate([np.append(np.asarray(e, np.int32), np.int32(eos_id)) for e in encoded])
        return SourceTokens(name, flat.astype(np.int32), offsets)


@dataclass(frozen=True)
class Store:
    path: str  # "" for an in-memory store
    tokenizer_spec: str
    vocab_size: int
    eos_id: int
    bytes_per_token: np.ndarray  # int32 [vocab_size]
    sources: dict[str, SourceTokens] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    verified_files: int = 0  # files checked against their sha256 when opened with verify=True

    def describe(self) -> dict:
        return {"path": self.path, "tokenizer": self.tokenizer_spec, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "identity": data_identity(self.manifest),
                "sources": {n: {"documents": s.n_docs, "tokens": s.n_tokens} for n, s in self.sources.items()}}


def data_identity(manifest: dict) -> str:
    """sha256 of what a store holds: its tokenizer and the checksum of every data file, not where it lies or
    when it was made. A resume checks it (`run_dir.check_same_data`): the same tokens, wherever the store is."""
    core = {"tokenizer": manifest.get("tokenizer"), "files": manifest.get("sha256", {}),
            "sources": {n: s.get("sha256", {}) for n, s in manifest.get("sources", {}).items()}}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()


def open_store(path: str, verify: bool = False) -> Store:
    """Memory-map a store. Always checks shapes against the manifest (cheap); `verify` also checks every
    sha256 and that each token id is below the vocabulary (one pass over the data)."""
    root = Path(path)
    mpath = root / "manifest.json"
    if not mpath.is_file():
        raise StoreError(f"{root} is not a token store (no manifest.json); create one with `moejax data prepare`")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{mpath} is not valid JSON ({e.msg})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        found = m.get("format") if isinstance(m, dict) else f"a JSON {type(m).__name__}"
        raise StoreError(f"{mpath}: format {found!r}, expected {FORMAT!r}")
    try:  # a hand-edited or damaged manifest: one line naming it, not a KeyError
        vocab, eos = int(m["tokenizer"]["vocab_size"]), int(m["tokenizer"]["eos_id"])
        spec, listed, dtype = str(m["tokenizer"]["spec"]), dict(m["sources"]), np.dtype(m["dtype"])
        for info in listed.values():
            int(info["tokens"]), int(info["documents"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreError(f"{mpath} is damaged: field {e} is missing or malformed; prepare the store again") from None
    if not listed:
        raise StoreError(f"{mpath} lists no sources; prepare the store again")
    verified = _verify_checksums(root, m) if verify else 0
    bpt = _load(root / "bytes_per_token.npy")
    if bpt.shape != (vocab,):
        raise StoreError(f"{root}/bytes_per_token.npy has shape {bpt.shape}, expected ({vocab},)")
    sources = {name: _open_source(root, name, info, vocab, verify, dtype) for name, info in listed.items()}
    return Store(str(root), spec, vocab, eos, np.asarray(bpt, np.int32), sources, m, verified)


def _load(path: Path) -> np.ndarray:
    if not path.is_file():
        raise StoreError(f"store file {path} is missing")
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, EOFError, OSError) as e:  # EOFError: an empty (truncated) file
        raise StoreError(f"store file {path} is unreadable ({e or type(e).__name__})") from None


def _open_source(root: Path, name: str, info: dict, vocab: int, verify: bool, dtype: np.dtype) -> SourceTokens:
    toks, offs = _load(root / name / "tokens.npy"), _load(root / name / "doc_offsets.npy")
    n_tok, n_docs = int(info["tokens"]), int(info["documents"])
    if toks.dtype != dtype:  # e.g. rewritten as floats: the ids would be cast silently
        raise StoreError(f"store file {root / name / 'tokens.npy'} holds {toks.dtype}, the manifest says {dtype}")
    if toks.shape != (n_tok,) or offs.shape != (n_docs + 1,) or offs[0] != 0 or offs[-1] != n_tok:
        raise StoreError(f"source {name!r} in {root}: arrays ({toks.shape[0]} tokens, {offs.shape[0] - 1} docs) "
                         f"disagree with the manifest ({n_tok} tokens, {n_docs} docs)")
    if verify:
        hi = max((int(toks[i:i + (1 << 24)].max()) for i in range(0, n_tok, 1 << 24)), default=0)
        if hi >= vocab:
            raise StoreError(f"source {name!r} in {root}: token id {hi} is out of range for the tokenizer's "
                             f"vocabulary of {vocab}")
        if np.any(np.diff(offs) <= 0):
            raise StoreError(f"source {name!r} in {root}: doc_offsets are not strictly increasing")
    return SourceTokens(name, toks, offs)


def _verify_checksums(root: Path, m: dict) -> int:
    """Check every file the manifest lists against its sha256; returns how many there are."""
    expected = {f: h for f, h in m.get("sha256", {}).items()}
    for name, info in m["sources"].items():
        expected.update({f"{name}/{f}": h for f, h in info.get("sha256", {}).items()})
    for rel, want in sorted(expected.items()):
        if not (root / rel).is_file():
            raise StoreError(f"store file {root / rel} is missing (the manifest lists it)")
        got = sha256_file(root / rel)
        if got != want:
            raise StoreError(f"{root / rel}: sha256 {got[:16]} does not match the manifest's {want[:16]}")
    return len(expected)


def new_manifest(tokenizer, dtype: np.dtype) -> dict:
    tok = {"spec": tokenizer.spec, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
           "eos_token": tokenizer.eos_token}
    if getattr(tokenizer, "model_path", None):  # llama3: Meta's file is not copied; pin it by checksum
        tok["model_sha256"] = sha256_file(Path(tokenizer.model_path))
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dtype": dtype.name,
            "tokenizer": tok, "sources": {}}
