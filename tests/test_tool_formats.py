"""The Llama 3.1 JSON and Mistral tool-call formats (kvjax/text/tool_formats.py): assistant
call turns rendered by transformers' renderer from small templates in their conventions
(tests/data/*_tools.jinja) parse back to exactly their calls; the streaming parse equals
the whole-text parse over every split; the format is detected from a template's text and
a tokenizer's special tokens; each format's grammar accepts exactly the calls jsonschema
validates, over the byte vocabulary and (Mistral's marker a special token) over an HF one."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from kvjax.constraints.vocabulary import constraint_vocabulary
from kvjax.text import tool_formats
from kvjax.text.chat_template import render_chat_template, takes_tools
from kvjax.text.hf_tokenizer import load_tokenizer
from kvjax.text.tokenizer import ByteTokenizer
from kvjax.text.tool_formats import HERMES, LLAMA_JSON
from tests.test_hf_tokenizer import _train_byte_level_bpe
from tests.test_tool_calls import (ARGUMENTS, CLOCK, HERMES as HERMES_TEMPLATE, NAMES, WEATHER,
                                   accepts, check_stream_at_every_split, vocabulary)

DATA = os.path.join(os.path.dirname(__file__), "data")
MISTRAL = tool_formats.mistral()  # its marker as text, as the byte tokenizer writes it


def template(name: str) -> str:
  with open(os.path.join(DATA, name), encoding="utf-8") as f:
    return f.read()


LLAMA_TEMPLATE = template("llama31_tools.jinja")
MISTRAL_TEMPLATE = template("mistral_tools.jinja")
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
ASK = [{"role": "user", "content": "Weather in Rome, and the time?"}]
ROME = ("get_weather", {"city": "Rome", "days": 2})
CALL_SETS = [[ROME], [ROME, ("now", {})], [("now", {}), ("get_weather", {"city": "Paris",
                                                                          "days": 7})]]


def turn(calls) -> dict:
  return {"role": "assistant", "content": "", "tool_calls": [
      {"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": a}}
      for i, (n, a) in enumerate(calls)]}


def rendered_turn(source: str, calls) -> str:
  """The text of an assistant turn of `calls`, as transformers renders the template: the
  conversation with the turn, less the one before it and the end-of-turn token."""
  def render(messages, prompt):
    return render_jinja_template([messages], tools=[WEATHER, CLOCK], chat_template=source,
                                 add_generation_prompt=prompt, **SPECIALS)[0][0]
  before, after = render(ASK, True), render(ASK + [turn(calls)], False)
  assert after.startswith(before)
  text = after[len(before):]
  for end in ("<|eot_id|>", SPECIALS["eos_token"]):
    text = text.removesuffix(end)
  return text


@pytest.mark.parametrize("calls", CALL_SETS)
@pytest.mark.parametrize("fmt, source", [(LLAMA_JSON, LLAMA_TEMPLATE), (MISTRAL, MISTRAL_TEMPLATE)])
def test_rendered_call_turns_parse_back_to_their_calls(fmt, source, calls):
  text = rendered_turn(source, calls)
  assert fmt.parse(text, NAMES) == ("", [tuple(c) for c in calls]), text
  # Not a turn of the other formats (and Hermes finds no block in it).
  assert HERMES.parse(text, NAMES) == (text.strip(), [])
  # Our renderer renders the template as transformers does, the tools included.
  assert takes_tools(source)
  history = ASK + [turn(calls), {"role": "tool", "tool_call_id": "call0abcd", "content": "24 C"}]
  assert render_chat_template(source, history, True, SPECIALS, [WEATHER, CLOCK], fmt) == (
      render_jinja_template([history], tools=[WEATHER, CLOCK], chat_template=source,
                            add_generation_prompt=True, **SPECIALS)[0][0])


def llama(*bodies, sep="; ") -> str:
  return sep.join(json.dumps(b) for b in bodies)


W = {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}
N = {"name": "now", "parameters": {}}
M = json.dumps([{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}},
                {"name": "now", "arguments": {}}])
OUTPUTS = [
    (LLAMA_JSON, llama(W), "", [ROME]),
    (LLAMA_JSON, " <|python_tag|>" + llama(W, N) + "\n", "", [ROME, ("now", {})]),
    (LLAMA_JSON, llama(W, N, sep=" ;"), "", [ROME, ("now", {})]),
    (LLAMA_JSON, llama({"name": "now", "arguments": {}}), "", [("now", {})]),  # vLLM's key
    (LLAMA_JSON, llama(W) + "\nDone.", "Done.", [ROME]),
    (LLAMA_JSON, llama(W) + "; oops", "; oops", [ROME]),
    # Not calls: prose first, an unknown function, bad JSON, unfinished, a bare tag.
    (LLAMA_JSON, "Sure: " + llama(W), "Sure: " + llama(W), []),
    (LLAMA_JSON, llama({"name": "rm", "parameters": {}}),
     llama({"name": "rm", "parameters": {}}), []),
    (LLAMA_JSON, '{"name": "now", "parameters": {}', '{"name": "now", "parameters": {}', []),
    (LLAMA_JSON, "{not json} x", "{not json} x", []),
    (LLAMA_JSON, "<|python_tag|>", "<|python_tag|>", []),
    (LLAMA_JSON, "<|python", "<|python", []),
    (LLAMA_JSON, "  plain answer  ", "plain answer", []),
    (MISTRAL, "[TOOL_CALLS] " + M, "", [ROME, ("now", {})]),
    (MISTRAL, "Checking.\n[TOOL_CALLS]" + M + " ", "Checking.", [ROME, ("now", {})]),
    (MISTRAL, "[TOOL_CALLS] " + M + "\nthen more", "then more", [ROME, ("now", {})]),
    # Not calls: an unknown function, not an array, an empty one, unfinished, the marker alone.
    (MISTRAL, '[TOOL_CALLS] [{"name": "rm", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "rm", "arguments": {}}]', []),
    (MISTRAL, "a [TOOL_CALLS] hello", "a [TOOL_CALLS] hello", []),
    (MISTRAL, "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    (MISTRAL, "x [TOOL_CALLS] " + M[:-3], "x [TOOL_CALLS] " + M[:-3], []),
    (MISTRAL, "x [TOOL_CA", "x [TOOL_CA", []),
    (MISTRAL, "[TOOL_CALLS]  ", "[TOOL_CALLS]", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", OUTPUTS)
def test_parse_and_stream_over_every_split(fmt, text, content, calls):
  assert fmt.parse(text, NAMES) == (content, calls)
  check_stream_at_every_split(fmt, text, content, calls)


def hf_tokenizer(directory, specials, chat_template=None):
  """A small byte-level BPE checkpoint tokenizer with extra special tokens."""
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=_train_byte_level_bpe(), bos_token="<s>", eos_token="</s>",
      additional_special_tokens=specials, chat_template=chat_template).save_pretrained(
          str(directory))
  return load_tokenizer(str(directory))


PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"


def test_the_format_comes_from_the_template_then_the_special_tokens(tmp_path):
  assert tool_formats.detect(LLAMA_TEMPLATE, {}) is LLAMA_JSON
  assert tool_formats.detect(MISTRAL_TEMPLATE, {}).name == "mistral"
  assert tool_formats.detect(HERMES_TEMPLATE, {"<|python_tag|>": 9}) is HERMES  # its text wins
  assert tool_formats.detect(PLAIN, {"<|python_tag|>": 9}) is LLAMA_JSON
  assert tool_formats.detect(None, {}) is HERMES and ByteTokenizer().tool_format is HERMES
  # A checkpoint's tokenizer: [TOOL_CALLS] a special token (named by id, kept in decoding).
  tokenizer = hf_tokenizer(tmp_path / "mistral", ["[TOOL_CALLS]"], PLAIN)
  mistral = tokenizer.tool_format
  assert mistral.name == "mistral" and mistral.keep_special
  assert f"<[{tokenizer.special_ids['[TOOL_CALLS]']}]>" in mistral.grammar([CLOCK], True)
  assert not MISTRAL.keep_special and '"[TOOL_CALLS]"' in MISTRAL.grammar([CLOCK], True)
  assert hf_tokenizer(tmp_path / "llama", ["<|python_tag|>"]).tool_format is LLAMA_JSON
  assert hf_tokenizer(tmp_path / "plain", [], PLAIN).tool_format is HERMES


@pytest.mark.parametrize("fmt, result", [
    (LLAMA_JSON, "<|ipython|>24 C"),
    (MISTRAL, '<|user|>[TOOL_RESULTS] {"content": "24 C", "call_id": "call0abcd"}'
              "[/TOOL_RESULTS]")])
def test_a_template_without_tools_gets_the_conversation_in_the_format(fmt, result):
  history = ASK + [turn([ROME]), {"role": "tool", "tool_call_id": "call0abcd",
                                  "content": "24 C"}]
  text = render_chat_template(PLAIN, history, False, SPECIALS, [WEATHER], fmt)
  lines = text.split("\n")
  assert lines[0].startswith("<|system|>") and '"get_weather"' in text
  call_line = next(line for line in lines if line.startswith("<|assistant|>"))
  assert fmt.parse(call_line[len("<|assistant|>"):], NAMES) == ("", [ROME])
  assert result in lines


def sentence(fmt, calls) -> str:
  """Calls written as the format's grammar writes them (compact JSON)."""
  compact = {"separators": (",", ":")}
  if fmt is LLAMA_JSON:
    return "; ".join(json.dumps({"name": n, "parameters": a}, **compact) for n, a in calls)
  return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                      **compact)


@pytest.mark.parametrize("fmt", [LLAMA_JSON, MISTRAL])
def test_grammar_accepts_exactly_valid_calls(vocabulary, fmt):
  schema = WEATHER["function"]["parameters"]
  lark = fmt.grammar([WEATHER, CLOCK], True)
  encode = ByteTokenizer().encode
  for arguments in ARGUMENTS:  # jsonschema is the judge of the arguments
    valid = jsonschema.Draft202012Validator(schema).is_valid(arguments)
    text = sentence(fmt, [("get_weather", arguments)])
    assert accepts(vocabulary, lark, encode(text)) == valid, arguments
    if valid:  # and what the grammar allows parses back to its calls
      assert fmt.parse(text, NAMES) == ("", [("get_weather", arguments)])
  two = sentence(fmt, [("now", {}), ROME])
  assert accepts(vocabulary, lark, encode(two))
  assert fmt.parse(two, NAMES) == ("", [("now", {}), ROME])
  assert not accepts(vocabulary, fmt.grammar([WEATHER, CLOCK], False), encode(two))
  assert not accepts(vocabulary, fmt.grammar([WEATHER], True),
                     encode(sentence(fmt, [("now", {})])))  # not offered
  assert not accepts(vocabulary, lark, encode("hello " + sentence(fmt, [ROME])))


def test_mistral_grammar_over_a_vocabulary_with_the_marker_token(tmp_path):
  tokenizer = hf_tokenizer(tmp_path, ["[TOOL_CALLS]"], MISTRAL_TEMPLATE)
  vocabulary = constraint_vocabulary(tokenizer, tokenizer.eos_ids[0])
  fmt, marker = tokenizer.tool_format, tokenizer.special_ids["[TOOL_CALLS]"]
  lark = fmt.grammar([WEATHER, CLOCK], True)
  for arguments in ARGUMENTS:
    valid = jsonschema.Draft202012Validator(WEATHER["function"]["parameters"]).is_valid(arguments)
    text = sentence(fmt, [("get_weather", arguments)])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == marker  # the marker's text encodes as its one special token
    assert accepts(vocabulary, lark, ids) == valid, arguments
    # The calls need the marker decoded: the server keeps special tokens for this format.
    assert fmt.parse(tokenizer.decode(ids, skip_special_tokens=False), NAMES) == (
        "", [("get_weather", arguments)])
    assert fmt.parse(tokenizer.decode(ids), NAMES)[1] == []
  spelled = tokenizer.encode("[TOOL_CALLS", add_special_tokens=False) + tokenizer.encode(
      "] " + sentence(fmt, [ROME])[len("[TOOL_CALLS] "):], add_special_tokens=False)
  assert not accepts(vocabulary, lark, spelled)  # the marker spelled out in text is refused
