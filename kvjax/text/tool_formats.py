"""The tool-call formats models are trained on, and which one a checkpoint uses.

HERMES (Hermes, Qwen2.5 / Qwen3, SmolLM3; the default): calls are blocks anywhere in
the output, results are <tool_response> turns:

  <tool_call>
  {"name": "get_weather", "arguments": {"city": "Paris"}}
  </tool_call>

LLAMA_JSON (Llama 3.1 / 3.2 custom tools): the output is the calls, JSON objects
with "parameters" (vLLM's parser also takes "arguments"), optionally after
<|python_tag|>, a `;` between two; results come back in the `ipython` role.  Text
after the last call is content; an output that does not start with a call is all
content.

  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", ...}

`mistral(marker_id)` (Mistral v3+ templates): content, then [TOOL_CALLS] and a JSON
array of calls; call ids are 9 letters and digits (the templates refuse others) and
results are [TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS].  The
marker is a special token in Mistral's tokenizers: the grammar then names it by id
and decoding keeps it.

  [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

`detect(chat_template, special_ids)` picks the format in one place: the template's
own text first (it writes <tool_call>, [TOOL_CALLS], or <|python_tag|> / the
ipython role), then the tokenizer's special tokens ([TOOL_CALLS], <|python_tag|>),
else Hermes.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from typing import Mapping, Optional, Sequence

from kvjax.text.tool_calls import (ToolFormat, calls_schema, checked_call, decode_json,
                                   partial_prefix, space_end)

__all__ = ["HERMES", "LLAMA_JSON", "mistral", "detect", "OPEN", "CLOSE", "PYTHON_TAG",
           "TOOL_CALLS"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
_NO_SPACES = {"whitespace_flexible": False}
_ID_CHARACTERS = string.ascii_letters + string.digits


def _openai_id() -> str:
  return "call_" + uuid.uuid4().hex[:24]


def _arguments(call: dict):
  return call["function"]["arguments"]


# Hermes.

_HERMES_FORMAT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def _hermes_scan(text: str, names: frozenset, start: bool, final: bool):
  open_at = text.find(OPEN)
  if open_at < 0:
    end = len(text) - partial_prefix(text, OPEN)
    return end, [], end
  close_at = text.find(CLOSE, open_at)
  if close_at < 0:
    return open_at, [], open_at
  end = close_at + len(CLOSE)
  try:
    call = checked_call(json.loads(text[open_at + len(OPEN):close_at]), names, ("arguments",))
  except ValueError:
    call = None
  if call is None:
    return end, [], end  # not a call: its text is content
  return open_at, [call], end


def _hermes_grammar(tools: Sequence[dict], parallel: bool) -> str:
  calls, defs = calls_schema(tools, "arguments")
  schema = {"anyOf": calls, "$defs": defs, "x-guidance": _NO_SPACES}
  repeat = ' ("\\n" call)*' if parallel else ""
  return (f"start: call{repeat}\n"
          f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n')


HERMES = ToolFormat(
    name="hermes", scan=_hermes_scan, grammar=_hermes_grammar,
    instructions=lambda tools: _HERMES_FORMAT.format(
        tools="\n".join(json.dumps(t) for t in tools)),
    call_text=lambda calls: "\n".join(
        f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}"
        f"\n{CLOSE}" for c in calls),
    result_message=lambda message: {
        "role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n"
                                   "</tool_response>"},
    call_id=_openai_id)


# Llama 3.1 / 3.2 JSON.

_LLAMA_FORMAT = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}")
_LLAMA_KEYS = ("parameters", "arguments")


def _llama_scan(text: str, names: frozenset, start: bool, final: bool):
  everything, wait = (len(text), [], len(text)), (0, [], 0)
  if not start:
    return everything
  at = space_end(text, 0)
  if text.startswith(PYTHON_TAG, at):
    at = space_end(text, at + len(PYTHON_TAG))
  elif PYTHON_TAG.startswith(text[at:]):  # nothing yet, or the tag's beginning
    return everything if final else wait
  calls, last = [], 0
  while True:
    if at == len(text) and not final:
      return wait
    decoded = decode_json(text, at) if text.startswith("{", at) else None
    call = decoded and checked_call(decoded[0], names, _LLAMA_KEYS)
    if call is None:
      if decoded is None and text.startswith("{", at) and not final:
        return wait  # an object still arriving
      return (0, calls, last) if calls else everything
    calls.append(call)
    last = decoded[1]
    after = space_end(text, last)
    if after == len(text) and not final:
      return wait  # a `;` and another call may follow
    if not text.startswith(";", after):
      return 0, calls, last
    at = space_end(text, after + 1)


def _llama_grammar(tools: Sequence[dict], parallel: bool) -> str:
  calls, defs = calls_schema(tools, "parameters")
  schema = {"anyOf": calls, "$defs": defs, "x-guidance": _NO_SPACES}
  repeat = ' ("; " call)*' if parallel else ""
  return f"start: call{repeat}\ncall: %json {json.dumps(schema)}\n"


LLAMA_JSON = ToolFormat(
    name="llama3_json", scan=_llama_scan, grammar=_llama_grammar,
    instructions=lambda tools: _LLAMA_FORMAT.format(
        tools="\n\n".join(json.dumps(t, indent=4) for t in tools)),
    call_text=lambda calls: "; ".join(
        json.dumps({"name": c["function"]["name"], "parameters": _arguments(c)})
        for c in calls),
    result_message=lambda message: {"role": "ipython", "content": message.get("content") or ""},
    call_id=_openai_id)


# Mistral v3+.

def _mistral_scan(text: str, names: frozenset, start: bool, final: bool):
  at = text.find(TOOL_CALLS)
  if at < 0:
    end = len(text) - partial_prefix(text, TOOL_CALLS)
    return end, [], end
  begin = space_end(text, at + len(TOOL_CALLS))
  if begin == len(text):
    return at, [], at
  if text[begin] != "[":
    return begin, [], begin  # the marker alone is content
  decoded = decode_json(text, begin)
  if decoded is None:
    return at, [], at  # still arriving (or never a call: content at the end)
  value, end = decoded
  calls = ([checked_call(v, names, ("arguments",)) for v in value]
           if isinstance(value, list) and value else [None])
  if None in calls:
    return end, [], end
  return at, calls, end


def _mistral_grammar(marker: str, tools: Sequence[dict], parallel: bool) -> str:
  calls, defs = calls_schema(tools, "arguments")
  schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": defs,
            "x-guidance": _NO_SPACES}
  if not parallel:
    schema["maxItems"] = 1
  return f'start: {marker} " " %json {json.dumps(schema)}\n'


def _mistral_call_text(calls: Sequence[dict]) -> str:
  return TOOL_CALLS + " " + json.dumps([
      {"name": c["function"]["name"], "arguments": _arguments(c), "id": c.get("id", "")}
      for c in calls])


def _mistral_result(message: dict) -> dict:
  result = json.dumps({"content": message.get("content") or "",
                       "call_id": message.get("tool_call_id", "")})
  return {"role": "user", "content": f"[TOOL_RESULTS] {result}[/TOOL_RESULTS]"}


def mistral(marker_id: Optional[int] = None) -> ToolFormat:
  """The Mistral format; marker_id: the [TOOL_CALLS] special token's id, if the tokenizer
  has it (the grammar names the token, and decoding keeps it)."""
  marker = json.dumps(TOOL_CALLS) if marker_id is None else f"<[{marker_id}]>"
  return ToolFormat(
      name="mistral", scan=_mistral_scan,
      grammar=lambda tools, parallel: _mistral_grammar(marker, tools, parallel),
      instructions=lambda tools: f"[AVAILABLE_TOOLS] {json.dumps(list(tools))}"
                                 "[/AVAILABLE_TOOLS]",
      call_text=_mistral_call_text, result_message=_mistral_result,
      call_id=lambda: "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9)),
      keep_special=marker_id is not None)


def detect(chat_template: Optional[str], special_ids: Mapping[str, int]) -> ToolFormat:
  """The format a checkpoint writes calls in: its chat template's text first, then its
  tokenizer's special tokens (text -> id), else Hermes."""
  template = chat_template or ""
  if OPEN in template:
    return HERMES
  if TOOL_CALLS in template:
    return mistral(special_ids.get(TOOL_CALLS))
  if PYTHON_TAG in template or "ipython" in template:
    return LLAMA_JSON
  if TOOL_CALLS in special_ids:
    return mistral(special_ids[TOOL_CALLS])
  if PYTHON_TAG in special_ids:
    return LLAMA_JSON
  return HERMES
