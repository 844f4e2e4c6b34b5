"""OpenAI response objects of one request: whole responses and SSE stream chunks.

Completions are "text_completion" objects with `text` choices; chat answers
are "chat.completion" objects with `message` choices, streamed as
"chat.completion.chunk" `delta`s whose first chunk per choice carries the
role.  `usage` counts each prompt once and every choice's completion tokens
(a final stop token included, as OpenAI counts it).  A model without a
tokenizer has no text: its choices carry `token_ids` instead.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional, Sequence

from kvjax.server.protocol import GenerationRequest

__all__ = ["Responses", "sse"]


def sse(payload) -> str:
  """One server-sent event: `data: <json>` (or a literal such as [DONE])."""
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Responses:
  """Builds the JSON objects answering `request`, all with one id and timestamp."""

  def __init__(self, request: GenerationRequest, model_name: str, with_token_ids: bool):
    self.request = request
    self.chat = request.chat
    self.model_name = model_name
    self.with_token_ids = with_token_ids
    self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())

  def usage(self, completion_tokens: Sequence[int]) -> dict:
    prompt = sum(map(len, self.request.prompts))
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  def response(self, texts: Sequence[str], token_ids: Sequence[list],
               finish_reasons: Sequence[str], completion_tokens: Sequence[int]) -> dict:
    """The whole (non-streamed) answer."""
    choices = []
    for index, (text, reason) in enumerate(zip(texts, finish_reasons)):
      choice = {"index": index, "finish_reason": reason, "logprobs": None}
      if self.chat:
        choice["message"] = {"role": "assistant", "content": text}
      else:
        choice["text"] = text
      if self.with_token_ids:
        choice["token_ids"] = token_ids[index]
      choices.append(choice)
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model_name, "choices": choices,
            "usage": self.usage(completion_tokens)}

  def role_chunk(self, index: int) -> dict:
    """A chat stream's first chunk of a choice."""
    return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])

  def chunk(self, index: int, text: str, token_ids: list, finish_reason: Optional[str]) -> dict:
    choice = {"index": index, "logprobs": None, "finish_reason": finish_reason}
    if self.chat:
      choice["delta"] = {"content": text} if text else {}
    else:
      choice["text"] = text
    if self.with_token_ids:
      choice["token_ids"] = token_ids
    return self._chunk([choice])

  def usage_chunk(self, completion_tokens: Sequence[int]) -> dict:
    """stream_options.include_usage: the last chunk, no choices."""
    return {**self._chunk([]), "usage": self.usage(completion_tokens)}

  def _chunk(self, choices: list) -> dict:
    out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
           "created": self.created, "model": self.model_name, "choices": choices}
    if self.request.include_usage:
      out["usage"] = None
    return out
