"""The tokenizer interface every model's tokenizer satisfies, and the byte-level one.

The interface (`Tokenizer`; the HTTP server and the CLI code against exactly this):
  vocab_size: int                 ids the tokenizer can produce or decode (added tokens too)
  bos_id: Optional[int]           id of the beginning-of-sequence token, None without one
  eos_ids: tuple[int, ...]        ids that end generation (a checkpoint may have several)
  encode(text, add_special_tokens=...) -> list[int]
                                  HF tokenizers default to True and equal transformers'
                                  `tokenizer.encode(text)`; the byte tokenizer defaults to
                                  False (no BOS), as the CLI and corpus always did.
  decode(ids, skip_special_tokens=True) -> str
  detokenizer(skip_special_tokens=True) -> IncrementalDetokenizer
                                  `push(ids) -> str` the text new since the last push, holding
                                  back a character split across tokens until it completes
                                  (never a broken UTF-8 character or a U+FFFD for one);
                                  `flush() -> str` what is held back at the end. All pushes
                                  plus the flush concatenate to exactly `decode(all_ids)`.
  chat_template: Optional[str]    the chat template's text; None for a base model (a GGUF or
                                  HF checkpoint with none), which chat and
                                  /v1/chat/completions refuse up front
  apply_chat_template(messages, add_generation_prompt=True, tools=None) -> str
                                  the prompt text of a list of {"role", "content"} dicts
                                  (and OpenAI tool definitions: kvjax/text/chat_template.py); a
                                  chat prompt's ids are `encode(text, add_special_tokens=False)`
                                  because templates write their own BOS text (transformers'
                                  `apply_chat_template(tokenize=True)` does the same).
  tool_format: ToolFormat         how the model writes tool calls (kvjax/text/tool_formats.py:
                                  detected from an HF checkpoint's template and special
                                  tokens; the byte tokenizer's is Hermes)

The byte tokenizer: byte b is token id b; no vocabulary file exists or is ever downloaded,
and the special ids follow the 256 byte ids. Its specials have no text form in `encode`
(any text stays lossless bytes); `decode(..., skip_special_tokens=False)` shows them as
<s>, </s> and <pad>. Its chat template is kvjax.text.chat_template.BYTE_CHAT_TEMPLATE.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from kvjax.text.chat_template import BYTE_CHAT_TEMPLATE, render_chat_template
from kvjax.text.tool_calls import ToolFormat
from kvjax.text.tool_formats import HERMES

__all__ = ["Tokenizer", "IncrementalDetokenizer", "ByteTokenizer", "check_ids"]

# The replacement character a lossy UTF-8 decode writes for an incomplete character.
_REPLACEMENT = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
  """What kvjax needs of a tokenizer (see the module docstring)."""

  vocab_size: int
  bos_id: Optional[int]
  eos_ids: tuple[int, ...]
  chat_template: Optional[str]
  tool_format: ToolFormat

  def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

  def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer: ...

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: Optional[Sequence[dict]] = None) -> str: ...


def check_ids(ids: Iterable[int]) -> list[int]:
  """Ids as a list of Python ints; a ValueError names the first one that is not an id >= 0."""
  out = []
  for i in ids:
    if isinstance(i, bool) or not hasattr(i, "__index__") or int(i) < 0:
      raise ValueError(f"token ids must be integers >= 0, got {i!r}")
    out.append(int(i))
  return out


class IncrementalDetokenizer:
  """Streams the text of a growing id sequence, one `push` at a time.

  Only a small window of ids is decoded per push (vLLM's prefix/read offsets): the ids
  from `_prefix_offset` to `_read_offset` are those whose text was emitted last, decoded
  again so that decoders with context (a leading-space strip, byte fusion) see the same
  left neighbour they see in the full decode. Text ending in U+FFFD is a character still
  split across tokens and waits for the next push.

  `safe_end(text)`, when given, is where the text may be cut so that a later
  post-processing of the whole text (transformers' clean_up_tokenization) equals the
  post-processing of the pieces; `clean(text)` is that post-processing.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str],
               clean: Optional[Callable[[str], str]] = None,
               safe_end: Optional[Callable[[str], int]] = None):
    self._decode = decode
    self._clean = clean
    self._safe_end = safe_end
    self._ids: list[int] = []
    self._prefix_offset = 0  # ids before it are never decoded again
    self._read_offset = 0  # ids before it have had their text emitted
    self._uncleaned = ""  # decoded text waiting for a safe cleanup cut (cleanup only)

  def push(self, ids: Iterable[int]) -> str:
    """Appends ids; returns the text they complete (possibly "")."""
    self._ids += check_ids(ids)
    prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
    text = self._decode(self._ids[self._prefix_offset:])
    if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
      return ""
    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
    return self._cleaned(text[len(prefix_text):], final=False)

  def flush(self) -> str:
    """The text still held back (an unfinished character, text awaiting cleanup)."""
    prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
    text = self._decode(self._ids[self._prefix_offset:])
    self._prefix_offset = self._read_offset = len(self._ids)
    return self._cleaned(text[len(prefix_text):], final=True)

  def _cleaned(self, new_text: str, final: bool) -> str:
    if self._clean is None:
      return new_text
    self._uncleaned += new_text
    cut = len(self._uncleaned) if final else self._safe_end(self._uncleaned)
    ready, self._uncleaned = self._uncleaned[:cut], self._uncleaned[cut:]
    return self._clean(ready)


class ByteTokenizer:
  """UTF-8 bytes <-> ids; specials BOS=256, EOS=257, PAD=258."""

  num_bytes = 256
  bos_id = 256
  eos_id = 257
  pad_id = 258
  vocab_size = 259
  eos_ids = (eos_id,)
  # How decode(skip_special_tokens=False) and chat templates write the specials.
  special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
  _special_text = {bos_id: "<s>", eos_id: "</s>", pad_id: "<pad>"}
  chat_template = BYTE_CHAT_TEMPLATE
  tool_format = HERMES

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Text -> byte ids; BOS first only with add_special_tokens."""
    if not isinstance(text, str):
      raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
    return [self.bos_id] * add_special_tokens + list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Ids -> text. Invalid UTF-8 is replaced, never raised; ids >= vocab_size are dropped;
    specials are dropped, or written as <s> </s> <pad> when not skipped."""
    pieces, run = [], bytearray()
    for i in check_ids(ids):
      if i < self.num_bytes:
        run.append(i)
      elif i in self._special_text and not skip_special_tokens:
        pieces += [run.decode("utf-8", errors="replace"), self._special_text[i]]
        run = bytearray()
    return "".join(pieces) + run.decode("utf-8", errors="replace")

  def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """Streams decode(ids, skip_special_tokens) one push at a time."""
    return IncrementalDetokenizer(
        functools.partial(self.decode, skip_special_tokens=skip_special_tokens))

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: Optional[Sequence[dict]] = None) -> str:
    """Role-tagged lines (kvjax.text.chat_template.BYTE_CHAT_TEMPLATE); tools as text."""
    return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                self.special_tokens, tools, self.tool_format)
