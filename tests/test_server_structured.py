"""Structured outputs over HTTP: response_format (the official `openai` client, a
Pydantic model through chat.completions.parse) and vLLM's structured_outputs; every
answer parses and validates (`jsonschema`, `re`); unsupported schema features and
bad grammars are 400s naming them, and the server keeps serving."""
from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

import kvjax
from kvjax.server import serve_in_thread
from tests.server_helpers import CONFIG, NAME, scrape, value
from tests.test_constraint_limits import ref_chain, rule_chain
from tests.test_constraints import REF_LOOP, WIDE

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
             "minItems": 1, "maxItems": 2}},
    "required": ["color", "count", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Reply in JSON."}]


class Point(pydantic.BaseModel):
  x: int = pydantic.Field(ge=-9, le=9)
  label: str = pydantic.Field(pattern="^[a-z]{1,3}$")


@pytest.fixture(scope="module")
def server():
  with serve_in_thread(kvjax.load_checkpoint(), CONFIG, served_model_name=NAME,
                       max_waiting=16) as handle:
    yield handle


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_response_format_json_schema_validates(server, client):
  answers = client.chat.completions.create(
      model=NAME, messages=MESSAGES, max_tokens=80, n=3, temperature=1.0, seed=1,
      response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
  for choice in answers.choices:
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
  tokens = answers.usage.completion_tokens
  deadline = time.monotonic() + 10  # the loop publishes just after it answers
  while True:
    samples = scrape(server.root)
    if value(samples, "kvjax:structured_masks_total") >= tokens or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert value(samples, "kvjax:structured_masks_total") >= tokens  # one mask per token
  assert value(samples, "kvjax:structured_mask_seconds_total") > 0


def test_json_object_and_pydantic_parse(client):
  answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=80,
                                          temperature=0.0,
                                          response_format={"type": "json_object"})
  text = answer.choices[0].message.content
  assert answer.choices[0].finish_reason == "stop", text
  assert isinstance(json.loads(text), dict)
  parsed = client.chat.completions.parse(model=NAME, messages=MESSAGES, max_tokens=60,
                                         temperature=1.0, seed=3, response_format=Point)
  point = parsed.choices[0].message.parsed
  assert isinstance(point, Point) and -9 <= point.x <= 9


def test_bench_structured_workload_over_http(server, tmp_path):
  # `kvjax bench --url --workload structured` asks for each session's schema as
  # response_format: every ended answer validates (jsonschema), and its counts agree.
  from kvjax.cli import main as cli
  from kvjax.server.bench import workloads as bench_workloads

  masks = value(scrape(server.root), "kvjax:structured_masks_total")
  assert cli.main(["bench", "--url", server.url, "--workload", "structured",
                   "--num-prompts", "4", "--input-len", "12", "--output-len", "100",
                   "--temperature", "1.0", "--out-dir", str(tmp_path)]) == 0
  bench = json.loads((tmp_path / "bench_http_structured.json").read_text())
  records = sorted(bench["requests"], key=lambda r: r["session"])
  assert [r["success"] for r in records] == [True] * 4
  ended = [r for r in records if r["finish_reason"] == "stop"]
  for record in ended:
    jsonschema.validate(json.loads(record["text"]),
                        bench_workloads.STRUCTURED_SCHEMAS[record["session"]])
  assert bench["summary"]["structured"] == {"requests": 4, "ended": len(ended),
                                            "cut_at_length": 4 - len(ended),
                                            "ended_valid": len(ended)}
  assert len(ended) >= 3  # the schemas are small enough to end in 100 tokens
  assert value(scrape(server.root), "kvjax:structured_masks_total") > masks


@pytest.mark.parametrize("field, check", [
    ({"regex": "[0-9]{2}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{2}-[a-z]{2}", t)),
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"json": {"type": "integer", "minimum": 3, "maximum": 7}}, lambda t: 3 <= int(t) <= 7),
    ({"grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
])
def test_vllm_structured_outputs(server, field, check):
  body = {"model": NAME, "prompt": "x = ", "max_tokens": 40, "temperature": 1.0,
          "structured_outputs": field}
  answer = httpx.post(f"{server.url}/completions", json=body, timeout=60).json()
  text = answer["choices"][0]["text"]
  assert check(text), (field, text)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "contains": {"type": "integer"}}}}}, "response_format", "contains"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "nope"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    # Issue 53: llguidance segfaulted on this chain and took the server down with it.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                 ref_chain(1000)}}},
     "response_format", "nests 3000 levels deep"),
    ({"guided_grammar": rule_chain(3000)}, "guided_grammar", "bracketed groups"),
    ({"guided_choice": [str(i) for i in range(2001)]}, "guided_choice", "2001 items"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": ref_chain(1000)}}],
      "tool_choice": "required"}, "tools", "levels deep"),
    # Issue 53: these answered "" with finish_reason "stop".
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#"}}}}, "response_format", "accepts no output"),
    ({"guided_json": REF_LOOP}, "guided_json", "accepts no output"),
    ({"structured_outputs": {"grammar": "start: a\na: a"}}, "structured_outputs",
     "accepts no output"),
    ({"guided_grammar": "start: "}, "guided_grammar", "accepts only the empty output"),
])
def test_unsupported_features_are_400s_naming_them(server, client, body, param, words):
  reply = httpx.post(f"{server.url}/chat/completions", timeout=60,
                     json={"model": NAME, "messages": MESSAGES, "max_tokens": 4, **body})
  assert reply.status_code == 400, reply.text
  error = reply.json()["error"]
  assert error["param"] == param and words in error["message"], error
  ok = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
  assert ok.choices[0].finish_reason in ("stop", "length")
  assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("bad", [True, 5, 1.5, -1, 1e30, {"yes": 1}, "yes"])
@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_a_choice_that_is_no_list_of_strings_is_a_400_naming_the_field(server, field, bad):
  # Issue 53: numbers and booleans were a TypeError in Constraint, a 500.
  value = bad if field == "guided_choice" else {"choice": bad}
  reply = httpx.post(f"{server.url}/completions", timeout=60,
                     json={"model": NAME, "prompt": "x", "max_tokens": 2, field: value})
  assert reply.status_code == 400, reply.text
  error = reply.json()["error"]
  assert error["param"] == field and "non-empty list of non-empty strings" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_fails_while_decoding_is_an_error_not_a_stop(server, stream):
  # The matcher fails at run time (WIDE: past llguidance's 2,000 alternatives); the
  # reply was finish_reason "stop" with a prefix of an alternative as its text.
  body = {"model": NAME, "prompt": "x = ", "max_tokens": 20, "temperature": 0,
          "stream": stream, "structured_outputs": {"grammar": WIDE}}
  if not stream:
    reply = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
  else:
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as reply:
      assert reply.status_code == 200
      events = [json.loads(line[len("data: "):]) for line in reply.iter_lines()
                if line.startswith("data: {")]
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"]), events
    error = events[-1]["error"]
  assert error["param"] == "structured_outputs" and "max is 2000" in error["message"], error
  assert httpx.get(f"{server.root}/health", timeout=5).status_code == 200
