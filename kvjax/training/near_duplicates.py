"""Near-duplicate clusters of texts: 5-token shingles, MinHash, exact Jaccard, union-find.

Tokens are identifiers, numbers and single punctuation marks.  Each text gets a
128-permutation MinHash of its shingle set; every pair whose signatures agree on at
least `threshold - 0.15` of the permutations has its exact Jaccard computed.  With
~10^4 texts the all-pairs signature comparison costs less than the hashing, so no LSH
banding.  Pairs at or above the threshold join one cluster, rooted at its first text
(callers order texts by preference).
"""
from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

__all__ = ["clusters", "TOKEN_RE", "SHINGLE_TOKENS", "NUM_PERMUTATIONS"]

TOKEN_RE = re.compile(r"\w+|[^\w\s]")
SHINGLE_TOKENS = 5
NUM_PERMUTATIONS = 128
_SIG_MARGIN = 0.15  # how far below the threshold a signature estimate still gets checked


def _token_hashes(text: str, cache: dict) -> np.ndarray:
  out = []
  for tok in TOKEN_RE.findall(text):
    h = cache.get(tok)
    if h is None:
      h = cache[tok] = int.from_bytes(hashlib.blake2b(tok.encode(), digest_size=8).digest(),
                                      "little")
    out.append(h)
  return np.array(out, np.uint64)


def _shingles(tokens: np.ndarray) -> np.ndarray:
  """uint64 sorted unique hashes of every run of SHINGLE_TOKENS tokens (one for shorter texts)."""
  if len(tokens) < SHINGLE_TOKENS:
    tokens = np.concatenate([tokens, np.zeros(SHINGLE_TOKENS - len(tokens), np.uint64)])
  n = len(tokens) - SHINGLE_TOKENS + 1
  h = np.zeros(n, np.uint64)
  with np.errstate(over="ignore"):  # arithmetic mod 2**64 is the hash
    for j in range(SHINGLE_TOKENS):
      h = h * np.uint64(0x100000001B3) + tokens[j:j + n]
  return np.unique(h)


def _minhash(shingles: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """uint32 [NUM_PERMUTATIONS]: per permutation the top 32 bits of min((a * x + b) mod 2**64)."""
  sig = np.full(len(a), np.iinfo(np.uint64).max, np.uint64)
  for start in range(0, len(shingles), 1 << 14):  # bounds the [perm, chunk] temporary
    with np.errstate(over="ignore"):
      part = a[:, None] * shingles[None, start:start + (1 << 14)] + b[:, None]
    sig = np.minimum(sig, part.min(1))
  return (sig >> np.uint64(32)).astype(np.uint32)


def _jaccard(x: np.ndarray, y: np.ndarray) -> float:
  inter = len(np.intersect1d(x, y, assume_unique=True))
  return inter / (len(x) + len(y) - inter)


def _near_pairs(shingle_sets: Sequence[np.ndarray], threshold: float) -> list:
  """(i, j, jaccard) with i < j and exact Jaccard >= threshold."""
  rng = np.random.default_rng(0)
  a = rng.integers(1, 2**63, NUM_PERMUTATIONS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
  b = rng.integers(0, 2**63, NUM_PERMUTATIONS, dtype=np.uint64)
  sigs = np.stack([_minhash(s, a, b) for s in shingle_sets])  # [files, perms]
  min_agree = int(np.floor((threshold - _SIG_MARGIN) * NUM_PERMUTATIONS))
  pairs = []
  for i0 in range(0, len(sigs), 64):
    agree = (sigs[i0:i0 + 64, None, :] == sigs[None, :, :]).sum(-1)  # [chunk, files]
    for di, j in zip(*np.nonzero(agree >= min_agree)):
      i = i0 + int(di)
      if i < j:
        jac = _jaccard(shingle_sets[i], shingle_sets[j])
        if jac >= threshold:
          pairs.append((i, int(j), jac))
  return pairs


def clusters(texts: Sequence[str], threshold: float) -> tuple:
  """-> (root index per text, {index: best Jaccard with a near copy})."""
  cache = {}
  shingle_sets = [_shingles(_token_hashes(t, cache)) for t in texts]
  parent = list(range(len(texts)))

  def root(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  best_jaccard = {}
  for i, j, jac in _near_pairs(shingle_sets, threshold):
    ri, rj = root(i), root(j)
    if ri != rj:
      parent[max(ri, rj)] = min(ri, rj)  # the earlier (preferred) text stays the root
    for x in (i, j):
      best_jaccard[x] = max(best_jaccard.get(x, 0.0), jac)
  return [root(i) for i in range(len(texts))], best_jaccard
