"""One choice's output text: incremental detokenization, stop strings, held-back text.

The engine emits token ids; a client sees text.  `TextStream` turns a
request's ids into text deltas the way vLLM does: a stop string is matched on
the decoded text, the text is cut just before it and the request counts as
finished ("stop") at the token that completed it; while streaming, the last
len(longest stop) - 1 characters are held back, since they could still become
the start of a stop string.  A final stop token (EOS or a `stop` id) counts as
a completion token but adds no text.
"""
from __future__ import annotations

import codecs
from typing import Optional, Sequence

from kvjax.tokenizer import ByteTokenizer

__all__ = ["TextStream", "tokenizer_of", "prompt_ids"]


class _ByteChatTokenizer(ByteTokenizer):
  """The byte model's text interface until kvjax.Model carries `.tokenizer`.

  Chat template: one "<role>: <content>\\n" line per message, then "assistant: ".
  """

  eos_ids = (ByteTokenizer.eos_id,)

  def detokenizer(self) -> "_Utf8Detokenizer":
    return _Utf8Detokenizer()

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


class _Utf8Detokenizer:
  """Byte ids -> text, holding an incomplete multi-byte character back."""

  def __init__(self):
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, ids: Sequence[int]) -> str:
    return self._decoder.decode(bytes(i for i in ids if 0 <= i < ByteTokenizer.num_bytes))

  def flush(self) -> str:
    return self._decoder.decode(b"", final=True)


def tokenizer_of(model):
  """The model's tokenizer, or None (token ids only).

  The one fallback: a byte-level model (vocab 259) without `.tokenizer` gets
  the byte tokenizer; remove it once kvjax.Model always carries one.
  """
  tokenizer = getattr(model, "tokenizer", None)
  if tokenizer is None and model.config.vocab_size == ByteTokenizer.vocab_size:
    tokenizer = _ByteChatTokenizer()
  return tokenizer


def prompt_ids(tokenizer, text: str) -> list[int]:
  """Text -> prompt ids, led by the tokenizer's BOS (if it has one) exactly once."""
  ids = list(tokenizer.encode(text))
  bos = getattr(tokenizer, "bos_id", None)
  if bos is not None and ids[:1] != [bos]:
    ids.insert(0, bos)
  return ids


class TextStream:
  """Text deltas of one choice.  `push(new ids, engine finish reason or None)`
  -> (text delta, finish reason or None); after a stop string the choice is
  finished and ignores further ids.

  Attributes:
    num_tokens: completion tokens so far (up to the one that completed a stop string).
    finish_reason: None while running, then "stop" or "length" (or the engine's).
  """

  def __init__(self, detokenizer, stop_strings: Sequence[str] = (),
               stop_ids: Sequence[int] = ()):
    self._detokenizer = detokenizer
    self._stops = tuple(stop_strings)
    self._hold = max(map(len, self._stops), default=1) - 1
    self._stop_ids = frozenset(stop_ids)
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
    """Truncate the text before the first stop string in it -> whether one was found."""
    found = [i for i in (self._text.find(s, self._searched) for s in self._stops) if i >= 0]
    if found:
      self._text = self._text[:min(found)]
      self.finish_reason = "stop"
      return True
    self._searched = max(self._searched, len(self._text) - self._hold)
    return False

  def _take(self, end: int, finish_reason: Optional[str]):
    end = max(end, self._sent)
    delta, self._sent = self._text[self._sent:end], end
    self.finish_reason = finish_reason
    return delta, finish_reason
