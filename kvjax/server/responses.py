"""OpenAI response objects of one request: whole responses and SSE stream chunks.

Completions are "text_completion" objects with `text` choices; chat answers
are "chat.completion" objects with `message` choices, streamed as
"chat.completion.chunk" `delta`s whose first chunk per choice carries the
role.  `usage` counts each prompt once and every choice's completion tokens
(a final stop token included, as OpenAI counts it).  A model without a
tokenizer has no text: its choices carry `token_ids` instead.  Logprobs take
OpenAI's two shapes: completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset) and chat's `content` list of {token, logprob,
bytes, top_logprobs}; a token's text is its id decoded alone, and text_offset counts those
texts' characters (as vLLM does).  `echo` puts the prompt (decoded) before a completion's text
and, with logprobs, its tokens before the completion's (token_logprobs and top_logprobs None at
the first, which nothing predicts); vLLM's prompt_logprobs comes as the choice's
`prompt_logprobs`: None, then {id: {logprob, rank, decoded_token}} per prompt position (rank
where the id is among the likeliest asked for).  A request with
tools (kvjax/server/tools.py) has its tool calls parsed out of each choice's text
(in the model's format: kvjax/text/tool_formats.py) into `message.tool_calls`
(streamed: `delta.tool_calls`, one complete call per entry), the rest is the
content (null when only calls remain), and a choice that ended on its own with
calls finishes with "tool_calls".
"""
from __future__ import annotations

import itertools
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


def _joined(first: Optional[dict], then: Optional[dict]) -> Optional[dict]:
  """Two completions logprobs objects (parallel lists) one after the other."""
  if first is None or then is None:
    return then if first is None else first
  return {key: first[key] + then[key] for key in first}


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
    self._echoed = [False] * request.num_choices  # echo: its prompt went out

  def usage(self, completion_tokens: Sequence[int]) -> dict:
    prompt = sum(map(len, self.request.prompts))
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  def response(self, texts: Sequence[str], token_ids: Sequence[list],
               finish_reasons: Sequence[str], completion_tokens: Sequence[int],
               logprobs: Sequence[list], prompt_logprobs: Sequence[Optional[list]]) -> dict:
    """The whole (non-streamed) answer; prompt_logprobs: the engine's, per choice."""
    choices = []
    for index, (text, reason) in enumerate(zip(texts, finish_reasons)):
      echo_text, echo_ids, echo_logprobs = self._echo(index, prompt_logprobs[index])
      text = echo_text + text
      choice = {"index": index, "finish_reason": reason,
                "logprobs": _joined(echo_logprobs, self.logprobs(index, token_ids[index],
                                                                 logprobs[index]))}
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
        choice["token_ids"] = echo_ids + token_ids[index]
      self._add_prompt_logprobs(choice, prompt_logprobs[index])
      choices.append(choice)
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.model_name, "choices": choices,
            "usage": self.usage(completion_tokens)}

  def role_chunk(self, index: int) -> dict:
    """A chat stream's first chunk of a choice."""
    return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])

  def chunk(self, index: int, text: str, token_ids: list, finish_reason: Optional[str],
            logprobs: Optional[list], num_tokens: int,
            prompt_logprobs: Optional[list] = None) -> dict:
    """A stream chunk of choice `index`: its new text, `num_tokens` generated so far (the
    first: the echo and the engine's prompt_logprobs)."""
    self._streamed_tokens[index] = num_tokens
    echo_text, echo_ids, echo_logprobs = self._echo(index, prompt_logprobs)
    choice = {"index": index, "finish_reason": finish_reason,
              "logprobs": _joined(echo_logprobs, self.logprobs(index, token_ids, logprobs))}
    text, token_ids = echo_text + text, echo_ids + token_ids
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
    if prompt_logprobs is not None:
      self._add_prompt_logprobs(choice, prompt_logprobs)
    return self._chunk([choice])

  def _echo(self, index: int, scores: Optional[list]) -> tuple:
    """echo, once per choice -> (prompt text, prompt ids, its logprobs object or None);
    ("", [], None) otherwise.  scores: the engine's prompt logprobs (with logprobs)."""
    if not self.request.echo or self._echoed[index]:
      return "", [], None
    self._echoed[index] = True
    ids = list(self.request.prompts[index // self.request.n])
    text = "" if self.tokenizer is None else self.tokenizer.decode(
        ids, skip_special_tokens=self.request.skip_special_tokens)
    num_top = self.request.logprobs
    if num_top is None or scores is None:  # none asked, or the request failed unscored
      return text, ids, None
    texts = [self._text(t) for t in ids]
    offsets = list(itertools.accumulate(map(len, texts), initial=self._text_offset[index]))
    self._text_offset[index] = offsets.pop()
    return text, ids, {
        "tokens": texts, "token_logprobs": [None] + [s.logprob for s in scores[1:]],
        "top_logprobs": [None] + [{self._text(i): p for i, p in s.top[:num_top]}
                                  for s in scores[1:]],
        "text_offset": offsets}

  def _add_prompt_logprobs(self, choice: dict, scores: Optional[list]) -> None:
    """vLLM's prompt_logprobs on a completions choice, if the request asked."""
    num_top = self.request.prompt_logprobs
    if num_top is None:
      return
    if scores is None:  # the request failed before its prompt was scored
      choice["prompt_logprobs"] = None
      return
    ids = self.request.prompts[choice["index"] // self.request.n]
    entries = [None]
    for token, score in zip(ids[1:], scores[1:]):
      top = score.top[:num_top]
      ranks = {i: rank for rank, (i, _) in enumerate(top, 1)}
      entry = {token: {"logprob": score.logprob, "rank": ranks.get(token),
                       "decoded_token": self._text(token)}}
      entry.update({i: {"logprob": p, "rank": ranks[i], "decoded_token": self._text(i)}
                    for i, p in top if i != token})
      entries.append(entry)
    choice["prompt_logprobs"] = entries

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
