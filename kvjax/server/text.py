"""One choice's output text: incremental detokenization, stop strings, held-back text.

The engine emits token ids; a client sees text.  `TextStream` turns a
request's ids into text deltas the way vLLM does: a stop string is matched on
the decoded text, the text is cut just before it and the request counts as
finished ("stop") at the token that completed it; while streaming, the last
len(longest stop) - 1 characters are held back, since they could still become
the start of a stop string.  A final stop token (EOS or a `stop` id) counts as
a completion token but adds no text.  vLLM's options: include_stop_str_in_output
keeps the matched stop string in the text (cut just after it), and min_tokens
lets no stop string count before the choice has that many tokens.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["TextStream"]


class TextStream:
  """Text deltas of one choice.  `push(new ids, engine finish reason or None)`
  -> (text delta, finish reason or None); after a stop string the choice is
  finished and ignores further ids.

  Attributes:
    num_tokens: completion tokens so far (up to the one that completed a stop string).
    finish_reason: None while running, then "stop" or "length" (or the engine's).
  """

  def __init__(self, detokenizer, stop_strings: Sequence[str] = (),
               stop_ids: Sequence[int] = (), *, include_stop: bool = False, min_tokens: int = 0):
    self._detokenizer = detokenizer
    self._stops = tuple(stop_strings)
    self._hold = max(map(len, self._stops), default=1) - 1
    self._stop_ids = frozenset(stop_ids)
    self._include_stop = include_stop
    self._min_tokens = min_tokens
    self._text = ""
    self._sent = 0  # characters of _text already handed out
    self._searched = 0  # no stop string starts before this offset
    self.num_tokens = 0
    self.finish_reason: Optional[str] = None

  def push(self, ids: Sequence[int], finish_reason: Optional[str] = None):
    if self.finish_reason is not None:
      return "", None
    for n, token in enumerate(ids):
      self.num_tokens += 1
      last = finish_reason is not None and n == len(ids) - 1
      if not (last and finish_reason == "stop" and token in self._stop_ids):
        self._text += self._detokenizer.push([token])
      if self._cut_at_stop():
        return self._take(len(self._text), "stop")
    if finish_reason is not None:
      self._text += self._detokenizer.flush()
      return self._take(len(self._text), "stop" if self._cut_at_stop() else finish_reason)
    return self._take(len(self._text) - self._hold, None)

  def _cut_at_stop(self) -> bool:
    """Truncate the text at the first stop string in it (before it, or after it with
    include_stop; none counts before min_tokens) -> whether one was found."""
    found = [(i, len(s)) for i, s in ((self._text.find(s, self._searched), s)
                                       for s in self._stops) if i >= 0]
    if found and self.num_tokens >= self._min_tokens:
      start, length = min(found)
      self._text = self._text[:start + (length if self._include_stop else 0)]
      self.finish_reason = "stop"
      return True
    self._searched = max(self._searched, len(self._text) - self._hold)
    return False

  def _take(self, end: int, finish_reason: Optional[str]):
    end = max(end, self._sent)
    delta, self._sent = self._text[self._sent:end], end
    self.finish_reason = finish_reason
    return delta, finish_reason
