"""Tool calling request fields -> a `ToolUse`; tool messages of a chat history, checked.

OpenAI's `tools` (function definitions), `tool_choice` ("none", "auto" (the
default with tools), "required", or {"type": "function", "function": {"name"}})
and `parallel_tool_calls` (default true).  Calls are written in the loaded
model's tool-call format (its tokenizer's `tool_format`, kvjax/text/tool_formats.py:
Hermes, Llama 3.1 JSON or Mistral, from its chat template and special tokens).
The definitions go into the prompt through the chat template
(kvjax/text/chat_template.py; as the format's text when the template takes no tools)
and calls are parsed from the output into `message.tool_calls`.  "auto" leaves
the model free and parses what it writes (as vLLM's tool parsers do); "required"
and a named function are enforced by the format's grammar whose sentences are
only calls with arguments valid under their schemas (a named function: exactly one call;
"required": one, or more when parallel_tool_calls), so they cannot be combined
with `response_format`.  "none" puts no tools in the prompt and parses nothing.
A schema feature the matcher does not implement is a 400 naming `tools`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional

from kvjax.constraints import Constraint
from kvjax.text.tool_calls import ToolFormat

__all__ = ["ToolUse", "parse_tools", "tool_message_fields"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule


@dataclasses.dataclass(frozen=True)
class ToolUse:
  """A request's tools (OpenAI function definitions) and how it may call them."""

  tools: tuple  # of {"type": "function", "function": {...}} dicts
  choice: str  # "auto", "required" or "named"
  format: ToolFormat  # how the model writes calls
  name: Optional[str] = None  # the named function
  parallel: bool = True

  @property
  def names(self) -> tuple:
    return tuple(t["function"]["name"] for t in self.tools)

  def constraint(self) -> Optional[Constraint]:
    """The grammar "required" and a named function enforce (auto: None)."""
    if self.choice == "auto":
      return None
    tools = [t for t in self.tools if self.choice == "required"
             or t["function"]["name"] == self.name]
    # A named function is called once; "required" makes one or more calls (parallel).
    return Constraint("grammar", self.format.grammar(tools, self.parallel
                                                     and self.choice == "required"))


def parse_tools(body: dict, error, tool_format: ToolFormat) -> Optional[ToolUse]:
  """The request's ToolUse (calls in `tool_format`), or None (no tools, or tool_choice
  "none"); error(message, param) builds the 400."""
  tools, choice = body.get("tools"), body.get("tool_choice")
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise error(f"parallel_tool_calls must be a boolean, got {parallel!r:.200}",
                "parallel_tool_calls")
  if tools is None or tools == []:
    if choice not in (None, "none"):
      raise error(f"tool_choice {choice!r:.200} needs tools", "tool_choice")
    return None
  if not isinstance(tools, list):
    raise error(f"tools must be a list of function definitions, got {tools!r:.200}", "tools")
  checked = tuple(_tool(i, tool, error) for i, tool in enumerate(tools))
  names = [t["function"]["name"] for t in checked]
  duplicate = next((n for n in names if names.count(n) > 1), None)
  if duplicate is not None:
    raise error(f"tools define the function {duplicate!r} twice", "tools")
  choice = "auto" if choice is None else choice
  name = None
  if isinstance(choice, dict):
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or name not in names:
      raise error(f"tool_choice must name one of the tools ({', '.join(names)}) as "
                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                  f"{choice!r:.200}", "tool_choice")
    choice = "named"
  elif choice == "none":
    return None
  elif choice not in ("auto", "required"):
    raise error(f"tool_choice must be none, auto, required or a named function, got "
                f"{choice!r:.200}", "tool_choice")
  use = ToolUse(checked, choice, tool_format, name, True if parallel is None else parallel)
  try:  # e.g. a parameters keyword llguidance does not implement, or a schema too deep
    constraint = use.constraint()
    if constraint is not None:
      constraint.check(None)
  except ValueError as problem:
    raise error(f"tools: the parameters schemas cannot be enforced: {problem}",
                "tools") from None
  return use


def _tool(index: int, tool, error) -> dict:
  where = f"tools[{index}]"
  function = tool.get("function") if isinstance(tool, dict) else None
  if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function,
                                                                                    dict):
    raise error(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
                f"{tool!r:.200}", "tools")
  name = function.get("name")
  if not isinstance(name, str) or not _NAME.match(name):
    raise error(f"{where}.function.name must be 1-64 letters, digits, _ or -, got "
                f"{name!r:.100}", "tools")
  parameters = function.get("parameters")
  if parameters is not None and not isinstance(parameters, dict):
    raise error(f"{where}.function.parameters must be a JSON schema object, got "
                f"{parameters!r:.200}", "tools")
  description = function.get("description")
  if description is not None and not isinstance(description, str):
    raise error(f"{where}.function.description must be a string", "tools")
  kept = {"name": name}
  if description is not None:
    kept["description"] = description
  if parameters is not None:
    kept["parameters"] = parameters
  return {"type": "function", "function": kept}


def tool_message_fields(where: str, message: dict, error) -> dict:
  """The tool fields of one chat message, checked: an assistant's `tool_calls` (arguments
  given as JSON text become objects, as templates expect) and a tool result's
  `tool_call_id`."""
  role, fields = message.get("role"), {}
  if role == "tool":
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
      raise error(f"{where} (role tool) needs a string tool_call_id", "messages")
    fields["tool_call_id"] = call_id
  calls = message.get("tool_calls")
  if calls is None:
    return fields
  if role != "assistant" or not isinstance(calls, list):
    raise error(f"{where}.tool_calls must be a list on an assistant message", "messages")
  fields["tool_calls"] = [_history_call(f"{where}.tool_calls[{i}]", c, error)
                          for i, c in enumerate(calls)]
  return fields


def _history_call(where: str, call, error) -> dict:
  function = call.get("function") if isinstance(call, dict) else None
  if not isinstance(function, dict) or not isinstance(function.get("name"), str):
    raise error(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                f"{{\"name\", \"arguments\"}}}}, got {call!r:.200}", "messages")
  arguments = function.get("arguments", "{}")
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except ValueError:
      raise error(f"{where}.function.arguments is not JSON: {arguments!r:.200}",
                  "messages") from None
  if not isinstance(arguments, dict):
    raise error(f"{where}.function.arguments must be a JSON object", "messages")
  return {"id": str(call.get("id", "")), "type": "function",
          "function": {"name": function["name"], "arguments": arguments}}
