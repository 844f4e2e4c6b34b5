"""Tool calls in chat text, in the Hermes format: written into prompts, parsed from output.

A call is one block of text (the format of Hermes, Qwen2.5 / Qwen3 and SmolLM3):

  <tool_call>
  {"name": "get_weather", "arguments": {"city": "Paris"}}
  </tool_call>

Tools are OpenAI function definitions ({"type": "function", "function": {"name",
"description", "parameters"}}).  A chat template that takes `tools` renders them
its own way; for one that takes none (the byte model's, SmolLM2's ChatML),
`as_text(messages, tools)` writes the definitions and the format into the system
message, an assistant's earlier `tool_calls` into its content as blocks, and
`tool` results into user turns wrapped in <tool_response>, so any template
carries a tool conversation.

`parse(text, names)` splits output text into content and calls; `ToolCallStream`
does the same as the text arrives, and the concatenation of its pieces equals
`parse` of the whole.  A block that is not JSON {"name": one of `names`,
"arguments": {...}} stays in the content as text (nothing is dropped).
`grammar(tools, parallel)` is the Lark grammar (llguidance's dialect) whose
sentences are only calls of the given tools with arguments valid under their
`parameters` schemas: what tool_choice "required" or a named function enforces.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

__all__ = ["OPEN", "CLOSE", "ToolCall", "in_messages", "as_text", "parse", "ToolCallStream",
           "grammar"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FORMAT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
ToolCall = tuple  # (name, arguments dict)


def _block(name: str, arguments) -> str:
  return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def in_messages(messages: Sequence[dict]) -> bool:
  """Do the messages hold tool calls or tool results?"""
  return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def as_text(messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> list[dict]:
  """Messages for a template that takes no tools: definitions in the system message,
  earlier calls and results as text (see the module doc)."""
  out = []
  for message in messages:
    role, content = message["role"], message.get("content") or ""
    if role == "assistant" and message.get("tool_calls"):
      blocks = [_block(c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]]
      out.append({"role": "assistant", "content": "\n".join(([content] if content else [])
                                                            + blocks)})
    elif role == "tool":
      out.append({"role": "user",
                  "content": f"<tool_response>\n{content}\n</tool_response>"})
    else:
      out.append(message)
  if tools:
    described = _FORMAT.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0]["role"] == "system":
      out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
    else:
      out.insert(0, {"role": "system", "content": described})
  return out


def _call(block_text: str, names: frozenset) -> Optional[ToolCall]:
  """The call a block's inner text holds, or None if it is not a well-formed call."""
  try:
    value = json.loads(block_text)
  except ValueError:
    return None
  if (isinstance(value, dict) and value.get("name") in names
      and isinstance(value.get("arguments"), dict)):
    return value["name"], value["arguments"]
  return None


def parse(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
  """Output text -> (content without the call blocks, stripped; the calls in order)."""
  names, calls, pieces, start = frozenset(names), [], [], 0
  for match in _BLOCK.finditer(text):
    call = _call(match.group(1), names)
    if call is None:
      continue
    pieces.append(text[start:match.start()])
    calls.append(call)
    start = match.end()
  pieces.append(text[start:])
  return "".join(pieces).strip(), calls


class ToolCallStream:
  """`push(text delta)` -> (content delta, calls completed); `finish()` the same for
  what was held back.  Text that could still begin a block is held back, and so is
  whitespace at the end of the content (it is content only once more text follows)."""

  def __init__(self, names: Sequence[str]):
    self._names = frozenset(names)
    self._pending = ""  # text not yet classified
    self._space = ""  # whitespace held at the content's end
    self._started = False  # some content was emitted (leading whitespace is dropped)

  def push(self, text: str) -> tuple[str, list[ToolCall]]:
    self._pending += text
    content, calls = [], []
    while True:
      open_at = self._pending.find(OPEN)
      if open_at < 0:
        keep = _partial_prefix(self._pending, OPEN)
        content.append(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        break
      close_at = self._pending.find(CLOSE, open_at)
      if close_at < 0:
        content.append(self._pending[:open_at])
        self._pending = self._pending[open_at:]
        break
      end = close_at + len(CLOSE)
      call = _call(self._pending[open_at + len(OPEN):close_at], self._names)
      if call is None:  # not a call: its text is content
        content.append(self._pending[:end])
      else:
        content.append(self._pending[:open_at])
        calls.append(call)
      self._pending = self._pending[end:]
    return self._content("".join(content)), calls

  def finish(self) -> tuple[str, list[ToolCall]]:
    """The held-back text (an unclosed block is content); trailing whitespace dropped."""
    rest, self._pending = self._pending, ""
    return self._content(rest.rstrip()) if rest.strip() else "", []

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


def _partial_prefix(text: str, tag: str) -> int:
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


def grammar(tools: Sequence[dict], parallel: bool = True) -> str:
  """Lark text: one call (parallel: one or more, a newline apart) of `tools`, compact
  JSON, each call's arguments valid under its function's `parameters`."""
  defs, calls = {}, []
  for i, tool in enumerate(tools):
    function = tool["function"]
    defs[f"tool{i}"] = _rebased(function.get("parameters") or {"type": "object"},
                                f"#/$defs/tool{i}")
    calls.append({"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": function["name"]},
                                 "arguments": {"$ref": f"#/$defs/tool{i}"}}})
  schema = {"anyOf": calls, "$defs": defs, "x-guidance": {"whitespace_flexible": False}}
  repeat = ' ("\\n" call)*' if parallel else ""
  return (f"start: call{repeat}\n"
          f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n')
