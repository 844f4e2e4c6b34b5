"""Tool calls in chat text (kvjax/text/tool_calls.py, kvjax/text/tool_formats.py): the Hermes block
parser, its streaming form against the whole-text parse over every split, templates with
and without `tools` against transformers' renderer, and the enforcing grammar against
jsonschema."""
from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from kvjax.constraints.vocabulary import constraint_vocabulary
from kvjax.text import tool_formats
from kvjax.text.chat_template import BYTE_CHAT_TEMPLATE, render_chat_template, takes_tools
from kvjax.text.tokenizer import ByteTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"$ref": "#/$defs/City"},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "$defs": {"City": {"enum": ["Paris", "Rome"]}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
NAMES = ("get_weather", "now")


def block(body: str) -> str:
  return f"<tool_call>\n{body}\n</tool_call>"


CALL = block('{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}')
OUTPUTS = [
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Rome", "days": 2})]),
    (CALL + "\n" + block('{"name": "now", "arguments": {}}') + "\n",
     "", [("get_weather", {"city": "Rome", "days": 2}), ("now", {})]),
    # Not calls: bad JSON, an unknown function, arguments not an object, unclosed.
    ("a " + block("{not json}") + " b", "a " + block("{not json}") + " b", []),
    (block('{"name": "rm", "arguments": {}}'), block('{"name": "rm", "arguments": {}}'), []),
    (block('{"name": "now", "arguments": 3}'), block('{"name": "now", "arguments": 3}'), []),
    ("  x <tool_call>\n{\"name\": \"now\"", "x <tool_call>\n{\"name\": \"now\"", []),
    ("no calls at all <tool", "no calls at all <tool", []),
    ("text\n\n" + CALL + "\n\nmore  ", "text\n\n\n\nmore",
     [("get_weather", {"city": "Rome", "days": 2})]),
]


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_parse_splits_content_and_calls(text, content, calls):
  assert tool_formats.HERMES.parse(text, NAMES) == (content, calls)


def check_stream_at_every_split(fmt, text: str, content: str, calls: list):
  """`fmt`'s stream, fed `text` split at every point (and in random pieces), yields
  exactly (content, calls)."""
  rng = random.Random(0)
  splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
  for _ in range(20):  # and random many-piece splits
    cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text))))
    splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
  for pieces in splits:
    stream, got_content, got_calls = fmt.stream(NAMES), "", []
    for piece in pieces:
      delta, new = stream.push(piece)
      got_content += delta
      got_calls += new
    rest, more = stream.finish()
    assert (got_content + rest, got_calls + more) == (content, calls), pieces


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_stream_equals_parse_of_the_whole_text_at_every_split(text, content, calls):
  check_stream_at_every_split(tool_formats.HERMES, text, content, calls)


# A tools-aware template in the Hermes style (what Qwen2.5-like checkpoints ship).
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name"
    " }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"},
]


def test_a_template_that_takes_tools_renders_them_as_transformers_does():
  assert takes_tools(HERMES)
  ours = render_chat_template(HERMES, HISTORY, True, {}, [WEATHER, CLOCK])
  theirs = render_jinja_template([HISTORY], tools=[WEATHER, CLOCK], chat_template=HERMES,
                                 add_generation_prompt=True)[0][0]
  assert ours == theirs
  assert json.dumps(WEATHER) in ours


def test_a_template_without_tools_gets_the_conversation_as_text():
  tokenizer = ByteTokenizer()
  assert not takes_tools(BYTE_CHAT_TEMPLATE)
  text = tokenizer.apply_chat_template(HISTORY, tools=[WEATHER])
  # Definitions in a system turn, the call as its block, the result as a user turn.
  assert text.startswith("<|system|># Tools") and json.dumps(WEATHER) in text
  assert "<|assistant|>" + CALL + "\n" in text
  assert "<|user|><tool_response>\nsunny, 24 C\n</tool_response>\n<|assistant|>" in text
  # Without tools or tool messages the template renders exactly as before.
  plain = [{"role": "user", "content": "hi"}]
  assert tokenizer.apply_chat_template(plain, tools=None) == render_chat_template(
      BYTE_CHAT_TEMPLATE, plain, True, tokenizer.special_tokens)
  merged = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}] + plain,
                                         tools=[CLOCK])
  assert merged.startswith("<|system|>Be brief.\n\n# Tools") and merged.count("<|system|>") == 1


@pytest.fixture(scope="module")
def vocabulary():
  tokenizer = ByteTokenizer()
  return constraint_vocabulary(tokenizer, tokenizer.eos_ids[0])


def accepts(vocabulary, lark: str, ids) -> bool:
  """Does the grammar take exactly these tokens (byte ids: the text's UTF-8)?"""
  matcher = llguidance.LLMatcher(vocabulary, llguidance.LLMatcher.grammar_from_lark(lark),
                                 log_level=0)
  return matcher.consume_tokens(list(ids)) and matcher.is_accepting()


# Arguments for get_weather, valid or not under its schema (jsonschema judges).
ARGUMENTS = [{"city": "Rome", "days": 2}, {"city": "Oslo", "days": 2},
             {"city": "Rome", "days": 9}, {"city": "Rome"},
             {"city": "Paris", "days": 7, "extra": 1}, {"city": "Paris", "days": 1}]


def test_grammar_accepts_exactly_valid_calls(vocabulary):
  schema = WEATHER["function"]["parameters"]
  lark = tool_formats.HERMES.grammar([WEATHER, CLOCK], parallel=True)
  for arguments in ARGUMENTS:  # jsonschema is the judge of the arguments
    valid = jsonschema.Draft202012Validator(schema).is_valid(arguments)
    text = block(json.dumps({"name": "get_weather", "arguments": arguments},
                            separators=(",", ":")))
    assert accepts(vocabulary, lark, text.encode()) == valid, arguments
  now = block('{"name":"now","arguments":{}}')
  assert accepts(vocabulary, lark, (now + "\n" + now).encode())
  assert not accepts(vocabulary, tool_formats.HERMES.grammar([WEATHER, CLOCK], False),
                     (now + "\n" + now).encode())
  assert not accepts(vocabulary, tool_formats.HERMES.grammar([WEATHER], True),
                     now.encode())  # not offered
  assert not accepts(vocabulary, lark, ("hello " + now).encode())  # only calls
