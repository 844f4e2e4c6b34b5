"""OpenAI response objects of one request: whole responses and SSE stream chunks.

Completions are "text_completion" objects with `text` choices; chat answers
are "chat.completion" objects with `message` choices, streamed as
"chat.completion.chunk" `delta`s whose first chunk per choice carries the
role.  `usage` counts each prompt once and every choice's completion tokens
(a final stop token included, as OpenAI counts it).  A model without a
tokenizer has no text: its choices carry `token_ids` instead.  Logprobs take
OpenAI's two shapes: completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset) and chat's `content` list of {token, logprob,
bytes, top_logprobs}; a token's text is its id decoded alone.  A request with
tools (kvjax/server/tools.py) has its tool calls parsed out of each choice's text
(in the model's format: kvjax/tool_formats.py) into `message.tool_calls`
(streamed: `delta.tool_calls`, one complete call per entry), the rest is the
content (null when only calls remain), and a choice that ended on its own with
calls finishes with "tool_calls".
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional, Sequence

from kvjax.server.protocol import GenerationRequest

__all__ = ["Responses", "sse"]


def _with_calls(finish_reason: str) -> str:
  """A choice that ended on its own (not at a length limit) after calling finished to
  let the tools run."""
  return "tool_calls" if finish_reason == "stop" else finish_reason


def sse(payload) -> str:
  """One server-sent event: `data: <json>` (or a literal such as [DONE])."""
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Responses:
  """Builds the JSON objects answering `request`, all with one id and timestamp."""

  def __init__(self, request: GenerationRequest, model_name: str, tokenizer):
    self.request = request
    self.chat = request.chat
    self.model_name = model_name
    self.tokenizer = tokenizer
    self.with_token_ids = tokenizer is None
    self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self._text_offset = [0] * request.num_choices  # completions' text_offset, per choice
    # Per choice: its tool-call parser and the calls it has streamed (with tools only).
    self._tool_streams = [request.tools.format.stream(request.tools.names) for _ in
                          range(request.num_choices if request.tools else 0)]
    self._calls_sent = [0] * request.num_choices
    self._streamed_tokens = [0] * request.num_choices  # per choice, in the chunks so far

  def usage(self, completion_tokens: Sequence[int]) -> dict:
    prompt = sum(map(len, self.request.prompts))
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  def response(self, texts: Sequence[str], token_ids: Sequence[list],
               finish_reasons: Sequence[str], completion_tokens: Sequence[int],
               logprobs: Sequence[list]) -> dict:
    """The whole (non-streamed) answer."""
    choices = []
    for index, (text, reason) in enumerate(zip(texts, finish_reasons)):
      choice = {"index": index, "finish_reason": reason,
                "logprobs": self.logprobs(index, token_ids[index], logprobs[index])}
      if self.chat and self.request.tools:
        content, calls = self.request.tools.format.parse(text, self.request.tools.names)
        choice["message"] = {"role": "assistant", "content": (content or None) if calls
                             else content}
        if calls:
          choice["message"]["tool_calls"] = self._tool_calls(calls)
          choice["finish_reason"] = _with_calls(reason)
      elif self.chat:
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

  def chunk(self, index: int, text: str, token_ids: list, finish_reason: Optional[str],
            logprobs: Optional[list], num_tokens: int) -> dict:
    """A stream chunk of choice `index`: its new text, `num_tokens` generated so far."""
    self._streamed_tokens[index] = num_tokens
    choice = {"index": index, "logprobs": self.logprobs(index, token_ids, logprobs),
              "finish_reason": finish_reason}
    if self.chat and self.request.tools:
      choice["delta"] = self._tool_delta(index, text, finish_reason is not None)
      if finish_reason is not None and self._calls_sent[index]:
        choice["finish_reason"] = _with_calls(finish_reason)
    elif self.chat:
      choice["delta"] = {"content": text} if text else {}
    else:
      choice["text"] = text
    if self.with_token_ids:
      choice["token_ids"] = token_ids
    return self._chunk([choice])

  def _tool_delta(self, index: int, text: str, last: bool) -> dict:
    """A chat delta of a request with tools: content outside calls, whole calls."""
    stream = self._tool_streams[index]
    content, calls = stream.push(text)
    if last:
      content += stream.finish()[0]
    delta = {"content": content} if content else {}
    if calls:
      delta["tool_calls"] = [{"index": self._calls_sent[index] + k, **call}
                             for k, call in enumerate(self._tool_calls(calls))]
      self._calls_sent[index] += len(calls)
    return delta

  def _tool_calls(self, calls) -> list:
    return [{"id": self.request.tools.format.call_id(), "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}
            for name, arguments in calls]

  def usage_chunk(self) -> dict:
    """stream_options.include_usage: the last chunk, no choices."""
    return {**self._chunk([]), "usage": self.usage(self._streamed_tokens)}

  def logprobs(self, index: int, token_ids: list, logprobs: Optional[list]) -> Optional[dict]:
    """OpenAI's logprobs object of a choice's next tokens (None if not asked)."""
    if self.request.logprobs is None:
      return None
    if self.chat:
      return {"content": [{**self._token(t, lp.logprob), "top_logprobs": [
          self._token(i, p) for i, p in lp.top]} for t, lp in zip(token_ids, logprobs)]}
    texts = [self._text(t) for t in token_ids]
    offsets = []
    for text in texts:
      offsets.append(self._text_offset[index])
      self._text_offset[index] += len(text)
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._text(i): p for i, p in lp.top} for lp in logprobs],
            "text_offset": offsets}

  def _text(self, token_id: int) -> str:
    if self.tokenizer is None:
      return f"token_id:{token_id}"
    return self.tokenizer.decode([token_id], skip_special_tokens=False)

  def _token(self, token_id: int, logprob: float) -> dict:
    text = self._text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

  def _chunk(self, choices: list) -> dict:
    out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
           "created": self.created, "model": self.model_name, "choices": choices}
    if self.request.continuous_usage:  # vLLM's continuous_usage_stats: counts so far
      out["usage"] = self.usage(self._streamed_tokens)
    elif self.request.include_usage:
      out["usage"] = None
    return out
