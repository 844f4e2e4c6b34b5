"""Tool calling over HTTP with the official `openai` client: tool_choice required and a
named function enforce calls whose arguments validate (`jsonschema`) against their
schemas, streamed and not; a call -> tool result -> answer round trip; "auto" leaves the
model free (its answer equals the plain completion of the same rendered prompt); bad
tool fields are 400s naming them, and the server keeps serving.  A model whose template
and tokenizer are Mistral's gets its calls in that format: the [TOOL_CALLS] token, ids
its template accepts."""
from __future__ import annotations

import json

import re

import httpx
import jax
import jsonschema
import openai
import pytest

import kvjax
from kvjax.model.params import init_params
from kvjax.server import serve_in_thread
from tests.test_tool_formats import MISTRAL_TEMPLATE, hf_tokenizer

NAME = "tiny-tools-test"
# The tool definitions go into the byte model's prompt as text: ~1 KiB of tokens.
CONFIG = kvjax.EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1280,
                            page_size=16)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "now", "description": "The time in a time zone",
    "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                   "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def server():
  with serve_in_thread(kvjax.load_checkpoint(), CONFIG, served_model_name=NAME,
                       max_waiting=8) as handle:
    yield handle


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def check_call(call) -> dict:
  assert call.type == "function" and call.id.startswith("call_")
  return check_arguments(call)


def check_arguments(call) -> dict:
  arguments = json.loads(call.function.arguments)
  jsonschema.validate(arguments, SCHEMAS[call.function.name])
  return arguments


def required_calls(client, n: int, seed: int):
  """n sampled answers under tool_choice "required" (one call each) -> (the answer, its
  calls)."""
  answer = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
      max_tokens=120, n=n, temperature=1.0, seed=seed)
  calls = []
  for choice in answer.choices:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    calls.append(choice.message.tool_calls[0])
  return answer, calls


def test_required_calls_validate_against_their_schemas(client):
  for call in required_calls(client, n=3, seed=7)[1]:
    check_call(call)


def test_named_function_streamed(client):
  stream = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.0, stream=True,
      tool_choice={"type": "function", "function": {"name": "now"}})
  calls, reasons, content = [], [], ""
  for chunk in stream:
    delta = chunk.choices[0].delta
    content += delta.content or ""
    calls += delta.tool_calls or []
    reasons.append(chunk.choices[0].finish_reason)
  assert reasons[-1] == "tool_calls" and content == ""
  assert [c.function.name for c in calls] == ["now"] and calls[0].index == 0
  check_call(calls[0])


def test_round_trip_call_result_answer(server, client):
  first = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
      max_tokens=120, temperature=0.0)
  call = first.choices[0].message.tool_calls[0]
  history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
  final = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=8, temperature=0.0)
  assert final.choices[0].message.tool_calls is None
  assert isinstance(final.choices[0].message.content, str)
  # The prompt the server rendered: the call's arguments as an object, the result as a turn,
  # and (tool_choice none) no definitions.
  tokenizer = kvjax.load_checkpoint().tokenizer
  expected = ASK + [{"role": "assistant", "content": "", "tool_calls": [
      {"id": call.id, "type": "function", "function": {
          "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
  text = tokenizer.apply_chat_template(expected)
  assert "sunny, 24 C" in text and call.function.arguments in text and "# Tools" not in text
  assert final.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_auto_leaves_the_model_free(server, client):
  tokenizer = kvjax.load_checkpoint().tokenizer
  answer = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS,
                                          max_tokens=24, temperature=0.0)
  ids = tokenizer.encode(tokenizer.apply_chat_template(ASK, tools=TOOLS),
                         add_special_tokens=False)
  plain = httpx.post(f"{server.url}/completions", timeout=120, json={
      "model": NAME, "prompt": ids, "max_tokens": 24, "temperature": 0.0}).json()
  assert answer.usage.prompt_tokens == len(ids)  # the definitions are in the prompt
  assert answer.choices[0].message.content == plain["choices"][0]["text"].strip()
  assert answer.choices[0].finish_reason == plain["choices"][0]["finish_reason"]


BAD_NAME = {"type": "function", "function": {"name": "bad name"}}
CONTAINS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}}}}


@pytest.mark.parametrize("path, body, param, words", [
    ("chat", {"tools": {"x": 1}}, "tools", "must be a list"),
    ("chat", {"tools": [{"type": "code", "function": {}}]}, "tools", "tools[0]"),
    ("chat", {"tools": [BAD_NAME]}, "tools", "bad name"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "get_weather, now"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "always"),
    ("chat", {"tools": TOOLS, "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ("chat", {"tools": [CONTAINS], "tool_choice": "required"}, "tools", "contains"),
    ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ("chat", {"functions": [WEATHER["function"]]}, "functions", "not supported"),
    ("chat", {"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ("chat", {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}]},
     "messages", "not JSON"),
    ("completions", {"prompt": "x", "tools": TOOLS}, "tools", "chat/completions"),
])
def test_bad_tool_fields_are_400s_naming_them(server, client, path, body, param, words):
  reply = httpx.post(f"{server.url}/{path}/completions" if path == "chat" else
                     f"{server.url}/completions", timeout=60,
                     json={"model": NAME, "messages": ASK, "max_tokens": 4, **body})
  assert reply.status_code == 400, reply.text
  error = reply.json()["error"]
  assert error["param"] == param and words in error["message"], error
  ok = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4)
  assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
  """A tiny random model with a byte-level BPE tokenizer whose [TOOL_CALLS] is a special
  token and whose template is Mistral's (tests/data/mistral_tools.jinja)."""
  tokenizer = hf_tokenizer(tmp_path_factory.mktemp("mistral"), ["[TOOL_CALLS]"],
                           MISTRAL_TEMPLATE)
  cfg = kvjax.get_preset("tiny").replace(name="tiny-mistral-tools", vocab_size=640,
                                         eos_token_id=tokenizer.eos_ids[0])
  model = kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(5), std=0.2),
                      tokenizer=tokenizer)
  config = kvjax.EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                              page_size=16)  # the tiny preset's context
  with serve_in_thread(model, config, served_model_name=NAME, max_waiting=8) as handle:
    yield handle, openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0,
                                timeout=120), tokenizer


def check_mistral_call(call) -> dict:
  assert call.type == "function" and re.fullmatch(r"[A-Za-z0-9]{9}", call.id), call.id
  return check_arguments(call)


def test_a_mistral_model_calls_in_its_format(mistral):
  handle, client, tokenizer = mistral
  assert tokenizer.tool_format.name == "mistral"
  answer, calls = required_calls(client, n=2, seed=3)
  for call in calls:
    check_mistral_call(call)
  stream = client.chat.completions.create(
      model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.0, stream=True,
      tool_choice={"type": "function", "function": {"name": "now"}})
  calls, reasons = [], []
  for chunk in stream:
    calls += chunk.choices[0].delta.tool_calls or []
    reasons.append(chunk.choices[0].finish_reason)
  assert reasons[-1] == "tool_calls" and [c.function.name for c in calls] == ["now"]
  check_mistral_call(calls[0])
  # The id goes back through the template, which refuses any other kind.
  call = answer.choices[0].message.tool_calls[0]
  history = ASK + [answer.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
  final = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                         max_tokens=4, temperature=0.0)
  expected = tokenizer.apply_chat_template(ASK + [
      {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
       "function": {"name": call.function.name,
                    "arguments": json.loads(call.function.arguments)}}]},
      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], tools=TOOLS)
  assert "[TOOL_RESULTS]" in expected and call.id in expected
  assert final.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
