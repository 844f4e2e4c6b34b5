"""HF checkpoint tokenizers: tokenizer.json through the `tokenizers` package, read the way
transformers' tokenizers backend reads a directory (no transformers at run time).

From tokenizer_config.json: the named special tokens (added to the tokenizer as special,
as transformers does), `split_special_tokens`, `clean_up_tokenization_spaces` (applied in
decode except for BPE models, as transformers v5 does) and `chat_template`
(chat_template.jinja takes precedence). special_tokens_map.json
is read only for legacy configs without `added_tokens_decoder`, as transformers does. The
stop ids come from generation_config.json, then config.json (`eos_token_id`, an int or a
list), then the eos token. Whether encode adds BOS/EOS is tokenizer.json's post-processor
alone: transformers v5 drops tokenizer_config's `add_bos_token` / `add_eos_token` when a
tokenizer.json exists. transformers' model-specific tokenizer classes are not mirrored.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Iterable, Optional, Sequence

import tokenizers

from kvjax.text import tool_formats
from kvjax.text.chat_template import render_chat_template
from kvjax.text.tokenizer import IncrementalDetokenizer, check_ids

__all__ = ["HFTokenizer", "load_tokenizer", "clean_up_tokenization"]

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
_EXTRA_SPECIAL_KEYS = ("extra_special_tokens", "additional_special_tokens")

# transformers' clean_up_tokenization, in its order.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
# Every character that is a cleanup pattern's non-final character. A cut after any other
# character c is safe to clean piece by piece: no match can contain c except as its last
# character, and such a match keeps c, so no match ever crosses the cut.
_CLEANUP_INNER_CHARS = frozenset(c for pattern, _ in _CLEANUP for c in pattern[:-1])


def clean_up_tokenization(text: str) -> str:
  """transformers' clean_up_tokenization: drops the space before punctuation and
  English contractions."""
  for pattern, replacement in _CLEANUP:
    text = text.replace(pattern, replacement)
  return text


def _cleanup_safe_end(text: str) -> int:
  """The longest prefix of text that can be cleaned apart from what follows it."""
  end = len(text)
  while end and text[end - 1] in _CLEANUP_INNER_CHARS:
    end -= 1
  return end


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the kvjax tokenizer interface (kvjax/text/tokenizer.py)."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, special_tokens: dict[str, str],
               eos_ids: tuple[int, ...], chat_template: Optional[str], clean_up: bool,
               source: str = "tokenizer",
               template_keys: str = "tokenizer_config.json or chat_template.jinja"):
    self._tokenizer = tokenizer
    self.special_tokens = dict(special_tokens)  # bos_token, eos_token, ... -> text
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos = special_tokens.get("bos_token")
    self.bos_id = None if bos is None else tokenizer.token_to_id(bos)
    self.eos_ids = tuple(eos_ids)
    self.chat_template = chat_template
    # The special tokens (text -> id), and the tool-call format they and the template imply.
    self.special_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()
                        if t.special}
    self.tool_format = tool_formats.detect(chat_template, self.special_ids)
    self._clean_up = clean_up
    self._source = source
    self._template_keys = template_keys  # where the source keeps a chat_template, for errors

  def to_json(self) -> str:
    """The tokenizer.json text of this tokenizer (llguidance builds its vocabulary from it:
    kvjax/constraints/vocabulary.py)."""
    return self._tokenizer.to_str()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids, equal to transformers' `tokenizer.encode(text, add_special_tokens=...)`."""
    if not isinstance(text, str):
      raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
    return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Ids -> text, equal to transformers' `tokenizer.decode(ids, skip_special_tokens=...)`."""
    text = self._raw_decode(check_ids(ids), skip_special_tokens)
    return clean_up_tokenization(text) if self._clean_up else text

  def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """Streams decode(ids, skip_special_tokens) one push at a time."""
    decode = functools.partial(self._raw_decode, skip_special_tokens=skip_special_tokens)
    if self._clean_up:
      return IncrementalDetokenizer(decode, clean_up_tokenization, _cleanup_safe_end)
    return IncrementalDetokenizer(decode)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: Optional[Sequence[dict]] = None) -> str:
    """The checkpoint's chat_template rendered as transformers renders it."""
    if self.chat_template is None:
      raise ValueError(f"{self._source} has no chat_template ({self._template_keys}); send "
                       "a plain prompt instead")
    return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                self.special_tokens, tools, self.tool_format)

  def _raw_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _read_json(directory: str, name: str) -> dict:
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
  return data


def _token_text(value: Any, where: str) -> Optional[str]:
  """A special token as tokenizer_config writes it: its text, or a serialized AddedToken."""
  if isinstance(value, dict):
    value = value.get("content")
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{where} must be a token string or an AddedToken object, got {value!r}")
  return value


def _special_tokens(directory: str, config: dict) -> tuple[dict[str, str], list[str]]:
  """Named special tokens (name -> text) and the extra special tokens' texts."""
  merged = dict(config)
  if "added_tokens_decoder" not in config:  # legacy layout: special_tokens_map.json wins
    merged.update(_read_json(directory, "special_tokens_map.json"))
  named = {}
  for name in _SPECIAL_TOKEN_NAMES:
    text = _token_text(merged.get(name), f"{name} in {directory}")
    if text is not None:
      named[name] = text
  extra = []
  for key in _EXTRA_SPECIAL_KEYS:
    values = merged.get(key) or []
    for value in values.values() if isinstance(values, dict) else values:
      extra.append(_token_text(value, f"{key} in {directory}"))
  return named, [t for t in extra if t is not None]


def _eos_ids(directory: str, tokenizer: tokenizers.Tokenizer, eos_token: Optional[str]
             ) -> tuple[int, ...]:
  vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
  for name in ("generation_config.json", "config.json"):
    value = _read_json(directory, name).get("eos_token_id")
    if value is None:
      continue
    ids = value if isinstance(value, list) else [value]
    for i in ids:
      if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
        raise ValueError(f"eos_token_id in {os.path.join(directory, name)} must be an id in "
                         f"[0, {vocab_size}) or a list of them, got {value!r}")
    return tuple(dict.fromkeys(ids))
  eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
  return () if eos_id is None else (eos_id,)


def _chat_template(directory: str, config: dict) -> Optional[str]:
  path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list) and all(isinstance(t, dict) for t in template):
    # named templates, [{"name": ..., "template": ...}]: the "default" one, as transformers
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  if template is not None and not isinstance(template, str):
    raise ValueError(f"chat_template in {directory}/tokenizer_config.json must be a string or "
                     f"a list of named templates, got {type(template).__name__}")
  return template


def load_tokenizer(path: str) -> Optional[HFTokenizer]:
  """The HF tokenizer of checkpoint directory `path`, or None without a tokenizer.json."""
  if not os.path.isdir(path):
    raise ValueError(f"tokenizer path {path!r} is not a directory")
  tokenizer_file = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(tokenizer_file):
    return None
  try:
    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
  except Exception as e:  # the Rust parser raises a bare Exception
    raise ValueError(f"{tokenizer_file} is not a tokenizers file: {e}") from e
  tokenizer.no_truncation()  # transformers' encode neither truncates nor pads by default
  tokenizer.no_padding()
  config = _read_json(path, "tokenizer_config.json")
  named, extra = _special_tokens(path, config)
  tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in list(named.values()) + extra])
  tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
  clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
      type(tokenizer.model).__name__ != "BPE" or bool(config.get(
          "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
  return HFTokenizer(tokenizer, named, _eos_ids(path, tokenizer, named.get("eos_token")),
                     _chat_template(path, config), clean_up, source=path)
