"""Training corpus of the built-in model: the running interpreter's stdlib `.py` files.

The listing is deterministic: every `*.py` file under `sysconfig`'s stdlib directory,
sorted by relative path, except site-packages, test packages (their data is
deliberately odd: binary blobs, broken encodings), pydoc_data (a Sphinx-generated
750 KB string literal of English docs, not code) and files that are not clean
UTF-8 text.  Each file is recorded with its sha256.

Split: a file is held out iff the first 8 hex digits of sha256(relative path),
read as a fraction of 2**32, fall below `heldout_fraction`.  The split depends
on the path only, so it is stable across interpreter patch releases, and no byte
of a held-out file is ever returned by `split_tokens(corpus, "train")`.

Token stream of a split: for each file in listing order, BOS, its bytes, EOS
(kvjax.ByteTokenizer ids).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from typing import Optional

import numpy as np

from kvjax.text.tokenizer import ByteTokenizer

__all__ = ["SourceFile", "Corpus", "stdlib_dir", "load_corpus", "split_tokens",
           "heldout_slice", "tokens_sha256", "sample_batch"]

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                            "pydoc_data", "__pycache__"})
# Control bytes that never occur in real source text (NUL, ..., but not \t \n \f \r).
_BINARY_BYTES = frozenset(range(32)) - {9, 10, 12, 13}


@dataclasses.dataclass(frozen=True)
class SourceFile:
  path: str  # relative to the corpus root, '/'-separated
  sha256: str
  num_bytes: int
  heldout: bool


@dataclasses.dataclass(frozen=True)
class Corpus:
  root: str
  python_version: str
  heldout_fraction: float
  files: tuple  # tuple[SourceFile, ...], sorted by path

  def split_files(self, split: str) -> tuple:
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return tuple(f for f in self.files if f.heldout == (split == "heldout"))

  def summary(self) -> dict:
    """Counts, bytes and one sha256 over the whole listing (path and file sha256s)."""
    listing = "".join(f"{f.sha256}  {f.path}\n" for f in self.files)
    out = {"root": self.root, "python_version": self.python_version,
           "heldout_fraction": self.heldout_fraction,
           "listing_sha256": hashlib.sha256(listing.encode()).hexdigest(),
           "num_files": len(self.files), "num_bytes": sum(f.num_bytes for f in self.files)}
    for split in ("train", "heldout"):
      files = self.split_files(split)
      out[f"{split}_files"] = len(files)
      out[f"{split}_bytes"] = sum(f.num_bytes for f in files)
    return out


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _is_heldout(rel_path: str, fraction: float) -> bool:
  return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) < fraction * 2**32


def _is_source_text(data: bytes) -> bool:
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return not _BINARY_BYTES.intersection(data)


def load_corpus(root: Optional[str] = None, heldout_fraction: float = 0.05,
                max_files: Optional[int] = None) -> Corpus:
  """Lists and hashes the corpus files; `max_files` keeps the first n (smoke runs)."""
  root = os.path.realpath(root or stdlib_dir())
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
    paths.extend(os.path.join(dirpath, n) for n in filenames if n.endswith(".py"))
  files = []
  for path in sorted(paths, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/")):
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    with open(path, "rb") as f:
      data = f.read()
    if not data or not _is_source_text(data):
      continue
    files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(data),
                            _is_heldout(rel, heldout_fraction)))
    if max_files is not None and len(files) == max_files:
      break
  return Corpus(root, sys.version.split()[0], heldout_fraction, tuple(files))


def split_tokens(corpus: Corpus, split: str) -> np.ndarray:
  """int32 [n]: BOS + bytes + EOS of every file of `split`, checked against its sha256."""
  tok = ByteTokenizer()
  chunks = []
  for f in corpus.split_files(split):
    with open(os.path.join(corpus.root, f.path), "rb") as fh:
      data = fh.read()
    if hashlib.sha256(data).hexdigest() != f.sha256:
      raise ValueError(f"{f.path} changed since the corpus was listed")
    chunks += [np.array([tok.bos_id], np.int32), np.frombuffer(data, np.uint8).astype(np.int32),
               np.array([tok.eos_id], np.int32)]
  if not chunks:
    raise ValueError(f"the {split!r} split of {corpus.root} has no files")
  return np.concatenate(chunks)


def heldout_slice(heldout: np.ndarray, seq_len: int, num_windows: int) -> np.ndarray:
  """int32 [num_windows, seq_len + 1]: evenly spaced windows of the held-out stream.

  Deterministic given the stream: the fixed evaluation slice that the launcher
  reports and the tests recompute.
  """
  span = seq_len + 1
  if len(heldout) < num_windows * span:
    raise ValueError(f"held-out stream of {len(heldout)} tokens is shorter than "
                     f"{num_windows} windows of {span}")
  starts = np.linspace(0, len(heldout) - span, num_windows).astype(np.int64)
  return np.stack([heldout[s:s + span] for s in starts])


def tokens_sha256(tokens: np.ndarray) -> str:
  """sha256 of int32 little-endian token ids: pins an evaluation slice."""
  return hashlib.sha256(np.ascontiguousarray(tokens, "<i4").tobytes()).hexdigest()


def sample_batch(train: np.ndarray, seed: int, step: int, batch_size: int,
                 seq_len: int) -> np.ndarray:
  """int32 [batch_size, seq_len + 1] random windows; a pure function of (seed, step)."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(train) - seq_len - 1, size=batch_size)
  return np.stack([train[s:s + seq_len + 1] for s in starts])
