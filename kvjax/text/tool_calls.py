"""Tool calls in chat text: the `ToolFormat` record and what every format shares.

Tools are OpenAI function definitions ({"type": "function", "function": {"name",
"description", "parameters"}}); a call is (name, arguments dict).  A checkpoint's
format (kvjax/text/tool_formats.py: Hermes, Llama 3.1's JSON, Mistral's [TOOL_CALLS],
picked from its chat template and special tokens) says how calls are written, so
one `ToolFormat` gives all of it:

  parse(text, names)   output text -> (content, calls); a call whose JSON is not
                       {"name": one of `names`, <arguments>: {...}} stays content
  stream(names)        a `ToolCallStream`: the same split as the text arrives (the
                       concatenation of its pieces equals `parse` of the whole, over
                       every split of the text: `parse` is the stream fed at once)
  grammar(tools, parallel)  the Lark grammar (llguidance's dialect) whose sentences
                       are only calls of `tools` with arguments valid under their
                       `parameters` schemas: what tool_choice "required" or a named
                       function enforces
  as_text(messages, tools)  a conversation for a template that takes no `tools`:
                       the definitions and the format in the system message, earlier
                       `tool_calls` as the format's text, `tool` results as turns
  call_id()            a new call id in the form the format's templates check
  keep_special         decoding must keep special tokens (the format's marker is one)

A format's `scan(text, names, start, final)` is its whole parser: the longest
decided beginning of `text` (`start`: nothing came before it; `final`: no more text
follows) as (content_end, calls, consumed): text[:content_end] is content, the calls
follow it, and text[:consumed] is done; consumed 0 waits for more text (at the end,
what is left is content).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional, Sequence

__all__ = ["ToolCall", "ToolFormat", "ToolCallStream", "in_messages", "decode_json",
           "checked_call", "calls_schema", "partial_prefix", "space_end"]

ToolCall = tuple  # (name, arguments dict)
_DECODER = json.JSONDecoder()


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  """How one family of models writes tool calls (see the module doc)."""

  name: str
  scan: Callable  # (text, names: frozenset, start, final) -> (content_end, calls, consumed)
  grammar: Callable  # (tools, parallel: bool) -> Lark text
  instructions: Callable  # tools -> the system text that describes them
  call_text: Callable  # an assistant's OpenAI tool_calls -> its text
  result_message: Callable  # a `tool` message -> the message carrying it as text
  call_id: Callable  # () -> a new call id
  keep_special: bool = False

  def stream(self, names: Sequence[str]) -> "ToolCallStream":
    return ToolCallStream(names, self.scan)

  def parse(self, text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """Output text -> (content without the calls, stripped; the calls in order)."""
    stream = self.stream(names)
    content, calls = stream.push(text)
    rest, more = stream.finish()
    return content + rest, calls + more

  def as_text(self, messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> list[dict]:
    """Messages for a template that takes no tools (see the module doc)."""
    out = []
    for message in messages:
      role, content = message["role"], message.get("content") or ""
      if role == "assistant" and message.get("tool_calls"):
        text = self.call_text(message["tool_calls"])
        out.append({"role": "assistant", "content": content + "\n" + text if content else text})
      elif role == "tool":
        out.append(self.result_message(message))
      else:
        out.append(message)
    if tools:
      described = self.instructions(tools)
      if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
      else:
        out.insert(0, {"role": "system", "content": described})
    return out


def in_messages(messages: Sequence[dict]) -> bool:
  """Do the messages hold tool calls or tool results?"""
  return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


class ToolCallStream:
  """`push(text delta)` -> (content delta, calls completed); `finish()` the same for
  what was held back.  Text the format's scan has not decided is held back, and so is
  whitespace at the end of the content (it is content only once more text follows)."""

  def __init__(self, names: Sequence[str], scan: Callable):
    self._names = frozenset(names)
    self._scan = scan
    self._pending = ""  # text not yet decided
    self._start = True  # nothing was consumed yet
    self._space = ""  # whitespace held at the content's end
    self._started = False  # some content was emitted (leading whitespace is dropped)

  def push(self, text: str) -> tuple[str, list[ToolCall]]:
    self._pending += text
    return self._run(final=False)

  def finish(self) -> tuple[str, list[ToolCall]]:
    """The rest, decided as the end of the text (what stays undecided is content);
    trailing whitespace dropped."""
    content, calls = self._run(final=True)
    rest, self._pending = self._pending, ""
    return content + (self._content(rest.rstrip()) if rest.strip() else ""), calls

  def _run(self, final: bool) -> tuple[str, list[ToolCall]]:
    content, calls = [], []
    while self._pending:
      end, found, consumed = self._scan(self._pending, self._names, self._start, final)
      if not consumed:
        break
      content.append(self._pending[:end])
      calls += found
      self._pending, self._start = self._pending[consumed:], False
    return self._content("".join(content)), calls

  def _content(self, text: str) -> str:
    if not text:
      return ""
    body = text.rstrip()
    if not body:
      self._space += text
      return ""
    out = self._space + body if self._started else body.lstrip()
    self._space, self._started = text[len(body):], True
    return out


def decode_json(text: str, at: int):
  """(value, end) of the JSON value starting at text[at], or None if it does not decode
  there (yet: an array or object is decided by its own text, whatever follows it)."""
  try:
    return _DECODER.raw_decode(text, at)
  except ValueError:
    return None


def checked_call(value, names: frozenset, keys: Sequence[str]) -> Optional[ToolCall]:
  """The call a decoded JSON value holds ({"name", <one of keys>: {...}}), or None."""
  if not isinstance(value, dict) or value.get("name") not in names:
    return None
  arguments = next((value[k] for k in keys if k in value), None)
  return (value["name"], arguments) if isinstance(arguments, dict) else None


def space_end(text: str, at: int) -> int:
  """The index of the first non-whitespace character at or after `at` (or len)."""
  while at < len(text) and text[at].isspace():
    at += 1
  return at


def partial_prefix(text: str, tag: str) -> int:
  """The length of the longest end of `text` that is a proper prefix of `tag`."""
  for n in range(min(len(tag) - 1, len(text)), 0, -1):
    if text.endswith(tag[:n]):
      return n
  return 0


def _rebased(schema, root: str):
  """`schema` with every local $ref ("#...") pointing under `root`, so the schema can
  sit inside a larger one and keep its own $defs."""
  if isinstance(schema, dict):
    return {key: (root + value[1:] if key == "$ref" and isinstance(value, str)
                  and value.startswith("#") else _rebased(value, root))
            for key, value in schema.items()}
  if isinstance(schema, list):
    return [_rebased(item, root) for item in schema]
  return schema


def calls_schema(tools: Sequence[dict], arguments_key: str) -> tuple[list, dict]:
  """(the call object schema of each tool: {"name": its name, arguments_key: its
  `parameters`}, the $defs they refer to), for a schema whose root holds the $defs."""
  defs, calls = {}, []
  for i, tool in enumerate(tools):
    function = tool["function"]
    defs[f"tool{i}"] = _rebased(function.get("parameters") or {"type": "object"},
                                f"#/$defs/tool{i}")
    calls.append({"type": "object", "additionalProperties": False,
                  "required": ["name", arguments_key],
                  "properties": {"name": {"const": function["name"]},
                                 arguments_key: {"$ref": f"#/$defs/tool{i}"}}})
  return calls, defs
