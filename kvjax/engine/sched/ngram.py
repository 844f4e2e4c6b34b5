"""Prompt-lookup (n-gram) drafting on the host: speculation without draft heads (issue 27).

A row whose tokens so far (prompt, then output) are x_0..x_{L-1} drafts from its
own history: for n = ngram_n down to 1, the last n tokens x_{L-n}..x_{L-1} are
looked up among the n-grams that end earlier (at e <= L - 2); the longest n that
occurs wins, its most recent occurrence (largest e) is taken, and the drafts are
the tokens that followed it, x_{e+1}..x_{e+K} (fewer where that runs past
x_{L-1}).  No occurrence: no drafts, and the row verifies none that step.

The drafts go into the row's columns 1..k of its decode batch and through the
same verify program as MTP's (kvjax/runtime/serve_steps.py `host_drafts`) as point-mass
distributions: a sampled row accepts d with probability p(d) and otherwise draws
from p without d, which keeps the target distribution exactly; a greedy row
accepts while d is the argmax (kvjax/runtime/speculative.py `accept`).  Prompts draft
nothing (a prefill row runs the plain program), and a multi-step burst runs only
when the step verifies no drafts, since its later steps could not get new ones
from the host.

Cost: per request, one dict per n from an n-gram to its latest end, extended by
the tokens appended since the last call (a history only grows: preemption
recomputes K/V but keeps the ids), so a step costs O(new tokens x ngram_n) dict
operations per row, never a scan of the history.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kvjax.engine.sched.batching import StepShape
from kvjax.runtime.step_batch import StepBatch

__all__ = ["DEFAULT_NGRAM_N", "check_ngram", "NgramIndex", "NgramDrafter", "with_drafts",
           "host_draft_shapes"]

DEFAULT_NGRAM_N = 3  # the longest n-gram looked up unless EngineConfig.ngram_n says


def check_ngram(ngram_n, num_draft) -> None:
  """ValueError naming the bad value unless ngram_n and num_draft (K) are ints >= 1."""
  for name, value in (("ngram_n", ngram_n), ("num_draft", num_draft)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"speculative='ngram' needs {name} an int >= 1, got {value!r}")


class NgramIndex:
  """One history's n-grams (n = 1..max_n) -> their latest end, grown as it grows."""

  def __init__(self, max_n: int):
    self.max_n = max_n
    self._latest = [{} for _ in range(max_n)]  # [n - 1]: n-gram tuple -> latest end e
    self._indexed = 0  # n-grams ending before this position are in _latest

  def propose(self, history: Sequence[int], k: int) -> list[int]:
    """Up to k drafts to follow `history` (its tokens so far; module doc)."""
    end = len(history) - 1  # the suffix ends here; an occurrence must end before
    for e in range(self._indexed, end):
      for n in range(1, min(self.max_n, e + 1) + 1):
        self._latest[n - 1][tuple(history[e - n + 1:e + 1])] = e
    self._indexed = max(self._indexed, end)
    for n in range(min(self.max_n, end), 0, -1):
      e = self._latest[n - 1].get(tuple(history[end - n + 1:]))
      if e is not None:
        return list(history[e + 1:e + 1 + min(k, end - e)])
    return []


class NgramDrafter:
  """The engine's n-gram drafter: an NgramIndex per live request."""

  def __init__(self, max_n: int):
    self.max_n = max_n
    self._index: dict[str, NgramIndex] = {}

  def propose(self, requests: Sequence, k: int, live: Mapping[str, object]) -> list[list[int]]:
    """Up to k drafts for each of `requests` (kvjax.engine.requests.Request); indices of
    requests no longer in `live` (the scheduler's unfinished ones) are dropped."""
    for rid in [r for r in self._index if r not in live]:
      del self._index[rid]
    if not k:
      return [[] for _ in requests]
    return [self._index.setdefault(r.request_id, NgramIndex(self.max_n)).propose(
        r.token_ids, k) for r in requests]


def with_drafts(batch: StepBatch, drafts: Sequence[Sequence[int]]) -> StepBatch:
  """A packed decode batch (host arrays) with row j's first num_draft[j] drafts in its
  columns 1..num_draft[j] (where serve_step's host_drafts reads them)."""
  tokens = np.array(batch.tokens)  # [B, T]
  for j, row_drafts in enumerate(drafts):
    n = int(batch.num_draft[j])
    tokens[j, 1:1 + n] = row_drafts[:n]
  return batch.replace(tokens=tokens)


def host_draft_shapes(shapes: Sequence[StepShape], draft_counts: Sequence[int]
                      ) -> list[StepShape]:
  """The programs an n-gram engine runs, of Packing.shapes((0, *draft_counts)): decode
  steps at each J its policy may pick, prefill chunks and bursts at J = 0 only (a
  burst only where the policy may pick 0)."""
  return [s for s in shapes if (s.kind == "prefill" and s.num_draft == 0) or
          (s.kind != "prefill" and s.num_draft in draft_counts and
           (s.kind == "decode" or s.num_draft == 0))]
