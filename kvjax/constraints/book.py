"""The host side of constrained decoding: one matcher per constrained request, and the
packed token masks of a step.

A `ConstraintBook` holds a model's vocabulary (an llguidance LLTokenizer, built
once per model: kvjax/constraints/vocabulary.py) and the LLMatcher of every
constrained request, advanced by the ids the request emits.  Before a step,
`masks` fills a packed int32 bitmask [B, J+1, Vb] (bit v % 32 of word v // 32:
token v is allowed) for each row and position it samples at: position 0 from
the matcher's state, and with host drafts (n-gram) position j + 1 after the
row's first j + 1 drafts, which the matcher consumes and then rolls back.  A
draft the grammar forbids ends the row's drafts there (the target could never
accept it; what would follow it has no mask).  Rows without a constraint are
all ones; a group with no constrained row gets None, the engine's unmasked
program, so unconstrained traffic pays nothing.  Ids past the vocabulary's
(a model's padded embedding rows) are never allowed.

Once a grammar is complete, llguidance allows only the end-of-sequence
token, so the vocabulary's EOS must be the model's: then a finished grammar
ends its request.  A matcher that fails (llguidance's error state: a rule
past 2,000 alternatives, a grammar that leads nowhere) also allows only EOS,
which would end its request as if the output were complete: `masks` lists
it in `failed` with llguidance's reason, and the engine finishes its request
with "error" (kvjax/engine/output_processor.py).  Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import functools
import time
from typing import Optional, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from kvjax.constraints.spec import Constraint, error_summary

__all__ = ["ConstraintBook", "allowed"]


def allowed(mask_row: np.ndarray, token: int) -> bool:
  """Is token's bit set in a packed mask row [Vb]?"""
  return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


class ConstraintBook:
  """Matchers by request id over one vocabulary; masks per step (see module doc)."""

  def __init__(self, vocabulary: Optional[llguidance.LLTokenizer] = None, vocab_size: int = 0,
               eos_token_id: Optional[int] = None):
    """vocabulary None: an engine's book before a vocabulary is given (refuses constraints)."""
    self.vocabulary = vocabulary
    self.matchers: dict[str, llguidance.LLMatcher] = {}
    self.failed: dict[str, str] = {}  # request id -> why its matcher failed
    self.mask_s = 0.0  # host seconds spent filling masks
    self.masks_filled = 0  # (row, position) masks filled
    if vocabulary is None:
      return
    if vocabulary.vocab_size > vocab_size:
      raise ValueError(f"the constraint vocabulary has {vocabulary.vocab_size} tokens, more "
                       f"than the model's vocab_size {vocab_size}")
    if eos_token_id is None or vocabulary.eos_token != eos_token_id:
      raise ValueError(f"the constraint vocabulary's EOS {vocabulary.eos_token} must be the "
                       f"model's eos_token_id ({eos_token_id}): a finished grammar allows "
                       f"only EOS, which must end the request")
    self.words = -(-vocab_size // 32)  # Vb
    self._own_words = -(-vocabulary.vocab_size // 32)  # what llguidance fills
    self._executor = llguidance.LLExecutor()

  def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
    """A fresh matcher of `constraint` (attach it: matchers[request_id] = it); ValueError
    naming the problem if the constraint is bad."""
    if self.vocabulary is None:
      raise ValueError("a constraint needs the engine's constraint vocabulary: set "
                       "engine.constraints = constraint_book(tokenizer, model config)")
    if not isinstance(constraint, Constraint):
      raise ValueError(f"constraint must be a kvjax.constraints.Constraint, got "
                       f"{type(constraint).__name__}")
    return constraint.matcher(self.vocabulary)

  def attach(self, request_id: str, matcher: Optional[llguidance.LLMatcher]) -> None:
    """The request's matcher from `compile` (None: an unconstrained request)."""
    if matcher is not None:
      self.matchers[request_id] = matcher

  def forget(self, request_id: str) -> None:
    self.matchers.pop(request_id, None)
    self.failed.pop(request_id, None)

  def __contains__(self, request_id: str) -> bool:
    return request_id in self.matchers

  def __bool__(self) -> bool:
    return bool(self.matchers)

  def advance(self, request_id: str, ids: Sequence[int], finished: bool = False) -> None:
    """The request emitted ids (all allowed by its masks); a finished one is forgotten."""
    matcher = self.matchers.get(request_id)
    if finished:
      self.forget(request_id)
    elif matcher is not None:
      matcher.consume_tokens([int(t) for t in ids])

  @property
  def mask_us_per_token(self) -> float:
    return 1e6 * self.mask_s / max(self.masks_filled, 1)

  def masks(self, rows: Sequence, columns: int, drafts: Optional[Sequence[list[int]]] = None):
    """Masks of one row group -> (mask [len(rows), columns, Vb] int32 or None, drafts).

    rows: the group's ScheduledRows (kvjax/engine/requests.py); one that samples nothing
    or has no constraint is all ones.  drafts[b] (host drafts, at most columns - 1
    each) come back cut at the first one the grammar forbids; where the grammar
    forces the next tokens (JSON keys and punctuation, the rest of an enum value),
    a constrained row drafts those instead (jump-forward decoding through the same
    exact verification: where the mask leaves a forced token the only choice, it
    is accepted whatever the target's distribution).
    """
    constrained = [(b, self.matchers[r.request_id]) for b, r in enumerate(rows)
                   if r.sample and r.request_id in self.matchers]
    if not constrained:
      return None, drafts
    start = time.perf_counter()
    mask = np.full((len(rows), columns, self.words), -1, np.int32)
    own = np.zeros((len(constrained), self._own_words), np.int32)
    llg_numpy.fill_next_token_bitmask_par(
        self._executor, [(m, i) for i, (_, m) in enumerate(constrained)], own)
    drafts = None if drafts is None else [list(d) for d in drafts]
    filled = len(constrained)
    for i, (b, matcher) in enumerate(constrained):
      mask[b, :, self._own_words:] = 0
      mask[b, 0, :self._own_words] = own[i]
      if drafts is None:
        continue
      forced = matcher.compute_ff_tokens()[:columns - 1]
      if forced:
        drafts[b] = forced
      consumed = 0
      for j, token in enumerate(drafts[b]):
        if not (allowed(mask[b, j], token) and matcher.try_consume_tokens([token]) == 1):
          del drafts[b][j:]
          break
        consumed += 1
        llg_numpy.fill_next_token_bitmask(matcher, mask[b, :, :self._own_words], j + 1)
        filled += 1
      matcher.rollback(consumed)
    for b, matcher in constrained:  # its mask allows only EOS: the row's sample is void
      if matcher.is_error():
        self.failed[rows[b].request_id] = error_summary(matcher)
    self.mask_s += time.perf_counter() - start
    self.masks_filled += filled
    return mask, drafts

  @staticmethod
  def step_mask(mask: Optional[np.ndarray], num_rows: int, columns: int,
                vocab_size: int) -> np.ndarray:
    """The token mask a serve step gets: mask (its rows, J+1, Vb) with all-ones padding
    rows up to num_rows (a packed batch's B), or, for a group with no constrained row
    (mask None), the shared all-ones mask [B, columns, Vb]: every step program takes
    one, so a request's first constraint compiles nothing (the device skips an
    all-ones mask: kvjax/runtime/sampling.py apply_token_mask)."""
    if mask is None:
      return _open_mask(num_rows, columns, -(-vocab_size // 32))
    if mask.shape[0] == num_rows:
      return mask
    pad = np.full((num_rows - mask.shape[0], *mask.shape[1:]), -1, np.int32)
    return np.concatenate([mask, pad])


@functools.lru_cache(maxsize=64)
def _open_mask(num_rows: int, columns: int, words: int) -> np.ndarray:
  """All ones [B, columns, Vb] int32, made once per shape and never written."""
  mask = np.full((num_rows, columns, words), -1, np.int32)
  mask.setflags(write=False)
  return mask
