"""Prompts and chat messages -> checked token ids, against the served model's Limits.

Text fields must be encodable UTF-8 (no lone surrogates such as "\\ud800", which JSON
can spell) and hold no NUL character (tokenizers and templates treat it as a terminator
or drop it, so a prompt with one would not mean what it says).  A text prompt's length
is checked before it is tokenized (MAX_CHARS_PER_TOKEN), an id list's before its ids.
Every error is an OpenAIError naming the request field.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping, Optional

from kvjax.engine.validation import check_int
from kvjax.server.openai_error import OpenAIError
from kvjax.server.tools import tool_message_fields

__all__ = ["MAX_CHARS_PER_TOKEN", "Limits", "checked", "checked_text", "is_token_id",
           "prompt_items", "truncation", "cut_after_final_message", "prompt_ids",
           "check_text_fits", "check_fits", "token_ids", "chat_message"]

# Characters one token covers at most, on average over a prompt: generous (English text
# averages about 4; the longest tokens of common vocabularies, runs of spaces or symbols,
# are 16 to 128).  A text prompt longer than max_model_len of them cannot fit, so it gets
# its 400 before it is tokenized (a 10 MB prompt took 38 s to tokenize and check).
MAX_CHARS_PER_TOKEN = 128


@dataclasses.dataclass(frozen=True)
class Limits:
  """What a request is checked against: the served name and the engine's bounds."""

  model_name: str
  vocab_size: int
  max_model_len: int
  max_choices: Optional[int] = None  # choices (prompts x n) one request may ask for
  # The engine's loaded LoRA adapters by name (a live view: loads and unloads show at once).
  adapters: Mapping = dataclasses.field(default_factory=dict)


def checked(param: str, check, *args, **kwargs):
  """check(*args, **kwargs), its ValueError as an OpenAIError naming `param`."""
  try:
    return check(*args, **kwargs)
  except ValueError as error:
    raise OpenAIError(str(error), param) from None


def checked_text(value: str, param: str, what: str) -> str:
  """`value` if it is UTF-8-encodable text without NUL; else a 400 naming `param`."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as error:
    raise OpenAIError(f"{what} is not valid Unicode: lone surrogate "
                      f"{ascii(value[error.start])} at character {error.start}", param) from None
  if "\0" in value:
    raise OpenAIError(f"{what} holds a NUL character (at character {value.index(chr(0))}); "
                      "NUL is not allowed in text", param)
  return value


def is_token_id(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_items(prompt) -> list:
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                 and all(map(is_token_id, prompt))):
    return [prompt]
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    return prompt
  raise OpenAIError("prompt must be a string, a list of token ids, or a non-empty list of "
                    f"strings or token id lists, got {prompt!r:.200}", "prompt")


def truncation(body: dict) -> Optional[int]:
  """vLLM's truncate_prompt_tokens: keep a prompt's last k tokens (None: all)."""
  keep = body.get("truncate_prompt_tokens")
  return None if keep is None else checked("truncate_prompt_tokens", check_int,
                                            "truncate_prompt_tokens", keep, 1)


def cut_after_final_message(text: str, final: str) -> str:
  """The rendered chat up to the end of the last message's content (stripped), so the
  reply continues it: transformers' and vLLM's continue_final_message."""
  final = final.strip()
  if final not in text:
    raise OpenAIError("continue_final_message: the chat template does not write the last "
                      "message's content", "continue_final_message")
  return text[:text.rindex(final) + len(final)]


def prompt_ids(item, limits: Limits, tokenizer, keep: Optional[int]) -> list[int]:
  if isinstance(item, str):
    if tokenizer is None:
      raise OpenAIError("this model has no tokenizer: send the prompt as token ids", "prompt")
    check_text_fits(len(item), limits, "prompt")
    text = checked_text(item, "prompt", "the prompt")
    item = tokenizer.encode(text, add_special_tokens=True)  # BOS where the tokenizer has one
  return token_ids(item, limits, "prompt", keep)


def check_text_fits(chars: int, limits: Limits, param: str) -> None:
  """400 for a text of `chars` characters that max_model_len tokens cannot hold (decided
  before it is tokenized; MAX_CHARS_PER_TOKEN)."""
  bound = (limits.max_model_len - 1) * MAX_CHARS_PER_TOKEN
  if chars > bound:
    raise OpenAIError(f"the {param} is {chars} characters; a prompt shorter than "
                      f"max_model_len {limits.max_model_len} tokens holds at most {bound} "
                      f"({MAX_CHARS_PER_TOKEN} characters per token)", param)


def check_fits(num_tokens: int, limits: Limits, param: str) -> None:
  """400 for a prompt that leaves no room for a token within max_model_len."""
  if num_tokens >= limits.max_model_len:
    raise OpenAIError(f"the prompt is {num_tokens} tokens but max_model_len is "
                      f"{limits.max_model_len}", param)


def token_ids(ids, limits: Limits, param: str, keep: Optional[int] = None) -> list[int]:
  """A non-empty list of ids in the model's vocabulary (a tokenizer's may be larger), its
  last `keep` ones when given, short enough for max_model_len (its length checked before
  its ids)."""
  if not ids:
    raise OpenAIError(f"the {param} must not be empty", param)
  ids = ids if keep is None else ids[-keep:]
  check_fits(len(ids), limits, param)
  return [checked(param, check_int, f"{param} token id", t, 0, limits.vocab_size)
          for t in ids]


def chat_message(index: int, message) -> dict:
  """{'role', 'content'} of one chat message (list content: its text parts joined), with
  its tool fields (server/tools.py); an assistant's content may be null when it calls."""
  where = f"messages[{index}]"
  if not isinstance(message, dict) or not isinstance(message.get("role"), str):
    raise OpenAIError(f"{where} must be an object with a string role, got {message!r:.200}",
                      "messages")
  content = message.get("content")
  if isinstance(content, list):
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
      raise OpenAIError(f"{where}.content parts must be {{'type': 'text', 'text': str}}",
                        "messages")
    content = "".join(p["text"] for p in content)
  if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
    content = ""
  if not isinstance(content, str):
    raise OpenAIError(f"{where}.content must be a string or a list of text parts, got "
                      f"{content!r:.200}", "messages")
  return {"role": checked_text(message["role"], "messages", f"{where}.role"),
          "content": checked_text(content, "messages", f"{where}.content"),
          **tool_message_fields(where, message, OpenAIError)}
