"""Chat templates: render a checkpoint's jinja2 `chat_template` the way transformers does.

The environment matches transformers' `apply_chat_template`: a sandboxed (immutable)
jinja2 environment with trim_blocks and lstrip_blocks, loop controls, a `{% generation %}`
block that renders its body, `raise_exception(message)`, `strftime_now(format)` and a
`tojson` filter that keeps non-ASCII text as is. Templates see `messages` (message keys
whose value is None dropped, as transformers does), `add_generation_prompt`, `tools`
(OpenAI function definitions, or None), `documents` (None) and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...).  A template that never reads `tools` gets a tool
conversation as text instead, in the tokenizer's tool-call format (its `tool_format`,
kvjax/text/tool_formats.py: the definitions in the system message, earlier calls and `tool`
results as turns), so every template can carry one.

BYTE_CHAT_TEMPLATE is the built-in byte model's own: one role-tagged line per message,
e.g. messages [{"role": "system", "content": "Be brief."}, {"role": "user", "content":
"hi"}] with add_generation_prompt render as

  <|system|>Be brief.
  <|user|>hi
  <|assistant|>

Roles are system, user and assistant; content is a string or a list of OpenAI text parts.
(Newlines are written as {{ '\\n' }}: trim_blocks eats a literal one after a block tag.)
"""
from __future__ import annotations

import datetime
import functools
import json
from typing import Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvjax.text import tool_calls
from kvjax.text.tool_calls import ToolFormat
from kvjax.text.tool_formats import HERMES

__all__ = ["BYTE_CHAT_TEMPLATE", "render_chat_template", "takes_tools"]

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
  rendered as its body, since kvjax never asks for an assistant-token mask."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # jinja2's own tojson escapes HTML characters, which changes the prompt text.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format):
  return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
  return _environment().from_string(source)


@functools.lru_cache(maxsize=16)
def takes_tools(source: str) -> bool:
  """Does the template read `tools` (and so render tool definitions its own way)?"""
  return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool,
                         special_tokens: Mapping[str, str],
                         tools: Optional[Sequence[dict]] = None,
                         tool_format: ToolFormat = HERMES) -> str:
  """The prompt text of `messages` (and `tools`) under the jinja2 template `source`;
  a template that takes no tools gets them as text in `tool_format`.

  ValueError names the problem for an empty or non-list `messages`, a message that is not
  a dict, a template that does not parse, or a template's raise_exception (e.g. a bad role).
  """
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
  for index, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ValueError(f"messages[{index}] must be a dict, got {message!r}")
  plain = [{k: v for k, v in message.items() if v is not None} for message in messages]
  try:
    template = _compile(source)
    if (tools or tool_calls.in_messages(plain)) and not takes_tools(source):
      plain, tools = tool_format.as_text(plain, tools), None
    return template.render(messages=plain, tools=tools or None, documents=None,
                           add_generation_prompt=bool(add_generation_prompt), **special_tokens)
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"chat template: {e}") from e
