"""OpenAI request bodies -> validated `GenerationRequest`s; bad input -> `OpenAIError`.

Every check runs before anything reaches the engine, and every error names
the request field (`param`) it is about, as OpenAI's error JSON does:
  {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
Sampling fields go through kvjax/engine/validation.py, the Engine's own checks.
Prompts and chat messages become checked token ids in kvjax/server/prompts.py (text:
UTF-8 without NUL; lengths before tokenizing); a body is bounded before it is parsed
(kvjax/server/request_body.py); errors are OpenAIError (kvjax/server/openai_error.py).
Limits and those modules' bounds are re-exported here.
Defaults are OpenAI's: temperature 1, max_tokens 16 for completions and "up to
max_model_len" for chat.  Choice j of every prompt samples with seed + j (a
random seed when none is given), so n > 1 choices differ and a seeded request
is reproducible offline.
vLLM's request extensions are honoured: ignore_eos, min_tokens, stop_token_ids,
include_stop_str_in_output, skip_special_tokens, repetition_penalty, min_p (and OpenAI's
presence_penalty, frequency_penalty, logit_bias; kvjax/runtime/logit_processors.py),
truncate_prompt_tokens (the prompt's last k tokens), best_of equal to n, and for chat
add_generation_prompt and continue_final_message (the reply continues the last
message: the rendered text is cut right after its content, as transformers cuts it).
Tool calling (tools, tool_choice, parallel_tool_calls) is kvjax/server/tools.py.
Scoring text (completions only): `echo` returns the prompt before the completion, and with
`logprobs` n its tokens' logprobs too (the first None, as OpenAI's legacy completions and
lm-evaluation-harness's local-completions read them); `max_tokens` may then be 0 (the prompt
alone).  vLLM's `prompt_logprobs` k adds each choice's prompt logprobs in vLLM's form.  Both
come from the engine's prompt logprobs (Engine.add_request(prompt_logprobs=k)).
Unknown fields policy: a field neither API defines is ignored, as OpenAI's own
clients' extra_body and vLLM do; a field they define that kvjax cannot honour
(_UNSUPPORTED) is a 400 naming it, so a request never silently means less than it says.
"""
from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Optional

from kvjax.constraints import Constraint
from kvjax.engine.validation import EXTENSIONS, SEED_RANGE, check_int, sampling_options, stop_ids
from kvjax.server.openai_error import OpenAIError
from kvjax.server.prompts import (MAX_CHARS_PER_TOKEN, Limits, check_text_fits, checked,
                                  checked_text, chat_message, cut_after_final_message,
                                  prompt_ids, prompt_items, token_ids, truncation)
from kvjax.server.request_body import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_depth, parse_json
from kvjax.server.structured import parse_constraint
from kvjax.server.tools import ToolUse, parse_tools

__all__ = ["OpenAIError", "Limits", "GenerationRequest", "parse_json", "parse_completion",
           "parse_chat", "engine_error_param", "json_depth", "MAX_BODY_BYTES", "MAX_JSON_DEPTH",
           "MAX_CHARS_PER_TOKEN"]

MAX_N = 128
# Fields kvjax cannot honour yet: a request that sets one gets a 400 naming it.
_UNSUPPORTED = ("suffix", "use_beam_search", "allowed_token_ids", "bad_words",
                "functions", "function_call",  # these two: use tools
                "chat_template")
# stream_options' flags (OpenAI's include_usage, vLLM's continuous_usage_stats).
_STREAM_FLAGS = ("include_usage", "continuous_usage_stats")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """One validated completions or chat request: n choices per prompt.

  Choice index i is prompt i // n, sampled with seeds[i % n].
  """

  chat: bool
  prompts: tuple  # of tuples of token ids
  max_tokens: tuple  # per prompt
  temperature: float
  top_k: Optional[int]
  top_p: Optional[float]
  seeds: tuple  # per choice of a prompt, len n
  stop_strings: tuple
  stop_ids: tuple
  n: int
  stream: bool
  include_usage: bool  # stream_options: a last chunk with the usage
  logprobs: Optional[int] = None  # alternatives per token (None: no logprobs)
  continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage in every chunk
  extensions: tuple = ()  # ((name, value), ...): vLLM's fields for Engine.add_request
  include_stop_str_in_output: bool = False  # a matched stop string stays in the text
  skip_special_tokens: bool = True  # special tokens add no text
  min_tokens: int = 0  # no stop string counts before this many tokens (vLLM)
  constraint: Optional[Constraint] = None  # structured output (kvjax/server/structured.py)
  constraint_field: Optional[str] = None  # the field that set it: what its errors name
  tools: Optional[ToolUse] = None  # tool calls to parse from chat output (server/tools.py)
  echo: bool = False  # completions: the prompt (and its logprobs) before the completion
  prompt_logprobs: Optional[int] = None  # vLLM's field: alternatives per prompt position
  lora: Optional[str] = None  # the LoRA adapter its `model` names (None: the base model)

  @property
  def num_choices(self) -> int:
    return len(self.prompts) * self.n

  @property
  def scored_prompt(self) -> Optional[int]:
    """The engine's prompt_logprobs: the most alternatives echo's logprobs or vLLM's
    prompt_logprobs ask for (None: the prompt is not scored)."""
    asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
             if k is not None]
    return max(asked, default=None)


def parse_completion(body: dict, limits: Limits, tokenizer) -> GenerationRequest:
  """A /v1/completions body (prompt: text, ids, or a list of either)."""
  if "prompt" not in body:
    raise OpenAIError("prompt is required", "prompt")
  for name in ("tools", "tool_choice"):
    if body.get(name) is not None:
      raise OpenAIError(f"{name} needs /v1/chat/completions", name)
  items = prompt_items(body["prompt"])
  if limits.max_choices is not None and len(items) > limits.max_choices:
    raise OpenAIError(f"{len(items)} prompts; this server takes at most "
                      f"{limits.max_choices} sequences per request", "prompt")
  keep = truncation(body)
  prompts = [prompt_ids(p, limits, tokenizer, keep) for p in items]
  return _request(body, limits, prompts, chat=False, param="prompt")


def parse_chat(body: dict, limits: Limits, tokenizer) -> GenerationRequest:
  """A /v1/chat/completions body: messages rendered by the tokenizer's chat template."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise OpenAIError(f"messages must be a non-empty list of messages, got {messages!r}",
                      "messages")
  if tokenizer is None:
    raise OpenAIError("this model has no tokenizer, so no chat template: use "
                      "/v1/completions with token ids", "messages")
  if tokenizer.chat_template is None:  # vLLM's answer too: a 400, the template is required
    raise OpenAIError("this model has no chat template (a base model), so it cannot render "
                      "messages: use /v1/completions with a prompt", "messages")
  rendered = [chat_message(i, m) for i, m in enumerate(messages)]
  check_text_fits(sum(len(m["content"]) for m in rendered), limits, "messages")
  continued = _flag(body, "continue_final_message", False)
  generation_prompt = _flag(body, "add_generation_prompt", not continued)
  if continued and generation_prompt:
    raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
  keep = truncation(body)
  tool_use = parse_tools(body, OpenAIError, tokenizer.tool_format)
  try:
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=generation_prompt,
                                         tools=list(tool_use.tools) if tool_use else None)
  except Exception as error:  # the template is the checkpoint's data: its refusal is a 400
    raise OpenAIError(f"the chat template rejected the messages: {error}", "messages")
  if continued:
    text = cut_after_final_message(text, rendered[-1]["content"])
  # Templates write their own BOS text (kvjax/text/tokenizer.py): no special tokens added.
  ids = token_ids(tokenizer.encode(text, add_special_tokens=False), limits, "messages", keep)
  return _request(body, limits, [ids], chat=True, param="messages", tool_use=tool_use)


def engine_error_param(message: str) -> Optional[str]:
  """The request field an Engine.add_request ValueError is about."""
  for words, param in (("constraint", "response_format"), ("lora", "model"),
                       ("KV pages", "max_tokens"),
                       ("spans", "max_tokens"), ("max_new_tokens", "max_tokens"),
                       ("token id", "prompt"),
                       ("prompt", "prompt"), ("stop", "stop")):
    if words in message:
      return param
  return None


def _request(body: dict, limits: Limits, prompts: list, *, chat: bool, param: str,
             tool_use: Optional[ToolUse] = None) -> GenerationRequest:
  """The fields shared by both endpoints, checked; `param` names the prompt field."""
  lora = _check_model(body, limits)
  logprobs, logprobs_param = _logprobs(body, chat)
  echo = _flag(body, "echo", False)
  prompt_logprobs = body.get("prompt_logprobs")
  _check_fields_honoured(body, chat, echo, prompt_logprobs)
  lengths = _max_tokens(body, limits, prompts, chat, echo)
  n = _choices(body, limits, len(prompts))
  seeds = _seeds(body.get("seed"), n)
  temperature, top_k, extensions = _sampling(body, limits, seeds[0], logprobs, logprobs_param,
                                             prompt_logprobs, min(lengths))
  strings, ids = _stops(body.get("stop"), limits)
  ids += checked("stop_token_ids", stop_ids, body.get("stop_token_ids"), limits.vocab_size)
  stream, options = _stream(body)
  return GenerationRequest(
      chat=chat, prompts=tuple(map(tuple, prompts)), max_tokens=tuple(lengths),
      temperature=float(temperature), top_k=top_k, top_p=body.get("top_p"),
      seeds=tuple(seeds), stop_strings=strings, stop_ids=ids, n=n, stream=bool(stream),
      include_usage=options.get("include_usage", False),
      continuous_usage=options.get("include_usage", False) and options.get(
          "continuous_usage_stats", False), logprobs=logprobs,
      extensions=tuple(extensions.items()), min_tokens=extensions.get("min_tokens", 0),
      include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
      # A format whose marker is a special token (Mistral's [TOOL_CALLS]) needs it decoded.
      skip_special_tokens=_flag(body, "skip_special_tokens", True) and not (
          tool_use and tool_use.format.keep_special),
      tools=tool_use, echo=echo, prompt_logprobs=prompt_logprobs, lora=lora,
      **_constraint(body, tool_use))


def _check_model(body: dict, limits: Limits) -> Optional[str]:
  """`model` must name the served model or a loaded LoRA adapter (another: OpenAI's 404).

  Returns the adapter's name, or None for the base model.
  """
  model = body.get("model")
  if model is None:
    raise OpenAIError(f"model is required; this server serves {limits.model_name!r}", "model")
  if model == limits.model_name:
    return None
  if not (isinstance(model, str) and model in limits.adapters):
    served = [limits.model_name, *limits.adapters]  # OpenAI's and vLLM's answer: 404
    raise OpenAIError(f"The model {model!r:.200} does not exist; this server serves "
                      f"{served}", "model", status=404, code="model_not_found")
  return model


def _check_fields_honoured(body: dict, chat: bool, echo: bool, prompt_logprobs) -> None:
  """Completions-only fields on chat, and fields kvjax cannot honour, are 400s naming them."""
  for name, value in (("echo", echo), ("prompt_logprobs", prompt_logprobs)):
    if chat and value not in (None, False):
      raise OpenAIError(f"{name} needs /v1/completions", name)
  for name in _UNSUPPORTED:
    if body.get(name) not in (None, False, 0, "", [], {}):
      raise OpenAIError(f"{name} is not supported", name)


def _max_tokens(body: dict, limits: Limits, prompts: list, chat: bool, echo: bool
                ) -> list[int]:
  """Each prompt's token budget: max_tokens (chat: max_completion_tokens first), else
  OpenAI's default (16; chat: up to max_model_len); prompt + budget must fit."""
  length_param = "max_tokens"
  if chat and body.get("max_completion_tokens") is not None:
    length_param = "max_completion_tokens"
  max_tokens = body.get(length_param)
  lengths = []
  for ids in prompts:
    if max_tokens is None:
      lengths.append(limits.max_model_len - len(ids) if chat else 16)
      continue
    # 0 (the prompt alone) only where the prompt comes back.
    lengths.append(checked(length_param, check_int, length_param, max_tokens,
                            0 if echo else 1))
    if len(ids) + lengths[-1] > limits.max_model_len:
      raise OpenAIError(f"prompt ({len(ids)} tokens) + {length_param} ({lengths[-1]}) exceeds "
                        f"max_model_len {limits.max_model_len}", length_param)
  return lengths


def _choices(body: dict, limits: Limits, num_prompts: int) -> int:
  """n (best_of, if given, must equal it); n * prompts within the server's max_choices."""
  n = 1 if body.get("n") is None else checked("n", check_int, "n", body["n"], 1, MAX_N + 1)
  best_of = body.get("best_of")  # vLLM: best_of == n samples n and returns them all
  if best_of is not None and checked("best_of", check_int, "best_of", best_of, 1) != n:
    raise OpenAIError(f"best_of must equal n ({n}): kvjax does not rank extra choices, got "
                      f"{best_of!r}", "best_of")
  if limits.max_choices is not None and n * num_prompts > limits.max_choices:
    raise OpenAIError(f"n={n} choices for each of {num_prompts} prompts is {n * num_prompts} "
                      f"sequences; this server takes at most {limits.max_choices} per request",
                      "n")
  return n


def _seeds(seed, n: int) -> list[int]:
  """Choice j's seed: seed + j (a random seed when none is given)."""
  if seed is None:
    return [secrets.randbelow(SEED_RANGE[1]) for _ in range(n)]
  seed = checked("seed", check_int, "seed", seed, *SEED_RANGE)
  return [(seed + j) % SEED_RANGE[1] for j in range(n)]


def _sampling(body: dict, limits: Limits, seed: int, logprobs, logprobs_param: str,
              prompt_logprobs, max_tokens: int) -> tuple:
  """-> (temperature, top_k, vLLM extensions set), checked by the Engine's own
  sampling_options; its error becomes a 400 naming the field."""
  temperature = body.get("temperature", 1.0)
  temperature = 1.0 if temperature is None else temperature
  top_k = body.get("top_k")
  top_k = None if type(top_k) is int and top_k == -1 else top_k  # vLLM's "off"
  extensions = {name: body[name] for name in EXTENSIONS if body.get(name) is not None}
  try:
    sampling_options(limits.vocab_size, temperature=temperature, top_k=top_k,
                     top_p=body.get("top_p"), seed=seed, logprobs=logprobs,
                     prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, **extensions)
  except ValueError as error:  # its messages start with the field's name
    message, param = str(error), re.match(r"\w+", str(error)).group()
    if param == "logprobs":  # chat's number of alternatives is top_logprobs
      message, param = logprobs_param + message[len(param):], logprobs_param
    raise OpenAIError(message, param) from None
  return temperature, top_k, extensions


def _stream(body: dict) -> tuple:
  """-> (stream, stream_options or {}); options need stream: true and boolean flags."""
  stream = body.get("stream", False)
  if not isinstance(stream, bool) and stream is not None:
    raise OpenAIError(f"stream must be a boolean, got {stream!r}", "stream")
  options = body.get("stream_options")
  if options is not None and (not stream or not isinstance(options, dict) or not all(
      isinstance(options.get(flag, False), bool) for flag in _STREAM_FLAGS)):
    raise OpenAIError("stream_options must be an object {include_usage: bool, "
                      "continuous_usage_stats: bool} and needs stream: true, got "
                      f"{options!r}", "stream_options")
  return stream, options or {}


def _constraint(body: dict, tool_use: Optional[ToolUse]) -> dict:
  """GenerationRequest's constraint and constraint_field: the structured-output
  constraint, or the grammar tool_choice required / named enforces (the two cannot be
  combined)."""
  field, constraint = parse_constraint(body, OpenAIError)
  enforced = tool_use.constraint() if tool_use else None
  if enforced is not None and constraint is not None:
    raise OpenAIError(f"tool_choice {body['tool_choice']!r:.100} enforces the tool call "
                      "grammar and cannot be combined with response_format or "
                      "structured_outputs", "tool_choice")
  if enforced is not None:
    return {"constraint": enforced, "constraint_field": "tool_choice"}
  return {"constraint": constraint, "constraint_field": field}


def _flag(body: dict, name: str, default: bool) -> bool:
  """A boolean field (null or absent: the default); anything else is a 400 naming it."""
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise OpenAIError(f"{name} must be a boolean, got {value!r:.200}", name)
  return value


def _logprobs(body: dict, chat: bool) -> tuple:
  """-> (alternatives per token or None, the field that set them).

  Completions: `logprobs` is that number.  Chat: `logprobs` is a boolean and
  `top_logprobs` the number (0 when absent).
  """
  logprobs = body.get("logprobs")
  if not chat:
    return logprobs, "logprobs"
  top = body.get("top_logprobs")
  if not isinstance(logprobs, (bool, type(None))):
    raise OpenAIError(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
  if not logprobs:
    if top is not None:
      raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    return None, "logprobs"
  return (0 if top is None else top), "top_logprobs"


def _stops(stop, limits: Limits) -> tuple[tuple, tuple]:
  """stop: a string, or a list of strings and token ids -> (strings, ids)."""
  items = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if not isinstance(items, list):
    raise OpenAIError(f"stop must be a string or a list of strings and token ids, got "
                      f"{stop!r:.200}", "stop")
  strings = tuple(checked_text(s, "stop", "a stop string") for s in items if isinstance(s, str))
  if "" in strings:
    raise OpenAIError("stop strings must not be empty", "stop")
  ids = checked("stop", stop_ids, [s for s in items if not isinstance(s, str)],
                 limits.vocab_size)
  return strings, ids
