"""The server at its edges (issue 33): what an adversarial client sends, as fixed cases
and as a bounded hypothesis fuzzer.

Oracles: the HTTP status set a correct server may answer (200, 400, 404, 422, 503;
never 500), a probe request answered identically before and after, kvjax.generate's
greedy tokens, exact counts of the sequences sent, and gc's census of live objects.
One server for the module (max_waiting 2 beside 8 running: a 10-sequence capacity).
The structured-output fuzzer (issue 53) sends schemas ($ref chains past the depth that
crashed llguidance among them), Lark grammars, regexes, choices and tools while a
thread times /health: it must never take over 1 s.
"""
from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.engine.requests import RequestOutput
from kvjax.server import serve_in_thread
from kvjax.server.protocol import MAX_BODY_BYTES, MAX_JSON_DEPTH
from tests.server_helpers import CONFIG, NAME, PROMPTS, ids_of, scrape, value
from tests.test_constraint_limits import ref_chain, rule_chain

MAX_WAITING = 2
CAPACITY = CONFIG.max_num_seqs + MAX_WAITING
ALLOWED = {200, 400, 404, 422, 503}
PROBE = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint()


@pytest.fixture(scope="module")
def server(model):
  with serve_in_thread(model, CONFIG, served_model_name=NAME, max_waiting=MAX_WAITING) as handle:
    yield handle


@pytest.fixture(scope="module")
def http(server):
  with httpx.Client(base_url=server.url, timeout=60) as client:  # one keep-alive connection
    yield client


def _post(http, path: str, body) -> httpx.Response:
  raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII escapes
  return http.post(path, content=raw, headers={"content-type": "application/json"})


def _choices(response: httpx.Response) -> list:
  assert response.status_code == 200, response.text
  return [(c["text"], c["finish_reason"]) for c in response.json()["choices"]]


def _wait_idle(server, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while (value(scrape(server.root), "kvjax:num_requests_running")
         or value(scrape(server.root), "kvjax:num_requests_waiting")
         or server.engine.stats().running or server.engine.stats().waiting):
    assert time.monotonic() < deadline, "the server never went idle"
    time.sleep(0.05)


def _assert_400(response: httpx.Response, param) -> None:
  assert response.status_code == 400, response.text
  assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("where", ["prompt", "prompts", "content", "content_part", "role",
                                   "stop"])
@pytest.mark.parametrize("bad", ["\ud800", "ok \udfff end", "a\x00b"],
                         ids=["high", "low", "nul"])
def test_lone_surrogates_and_nul_are_400_naming_the_field(http, where, bad):
  chat = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
  bodies = {
      "prompt": ("/completions", {"model": NAME, "prompt": bad, "max_tokens": 2}, "prompt"),
      "prompts": ("/completions", {"model": NAME, "prompt": ["fine", bad]}, "prompt"),
      "content": ("/chat/completions",
                  {**chat, "messages": [{"role": "user", "content": bad}]}, "messages"),
      "content_part": ("/chat/completions", {**chat, "messages": [
          {"role": "user", "content": [{"type": "text", "text": bad}]}]}, "messages"),
      "role": ("/chat/completions", {**chat, "messages": [{"role": bad, "content": "x"}]},
               "messages"),
      "stop": ("/completions", {**PROBE, "stop": ["ok", bad]}, "stop"),
  }
  path, body, param = bodies[where]
  _assert_400(_post(http, path, body), param)


def test_deep_and_huge_bodies_are_400_and_the_connection_stays_usable(http):
  before = _choices(_post(http, "/completions", PROBE))
  deep = ("[" * 5000 + "]" * 5000).encode()
  nested_field = (f'{{"model": "{NAME}", "prompt": ' + "[" * 1200 + "1" + "]" * 1200
                  + "}").encode()
  in_string = json.dumps({**PROBE, "stop": ["[" * 5000]}).encode()  # brackets in a string
  for body in (deep, nested_field):
    response = _post(http, "/completions", body)
    assert response.status_code == 400 and f"limit is {MAX_JSON_DEPTH}" in response.text
  assert _post(http, "/completions", in_string).status_code == 200
  assert _post(http, "/completions", b" " * (MAX_BODY_BYTES + 1)).status_code == 400
  assert _choices(_post(http, "/completions", PROBE)) == before  # same keep-alive connection


def test_a_tiny_top_p_over_http_answers_the_greedy_text(model, http):
  tok = model.tokenizer
  greedy = kvjax.generate(model, [ids_of(tok, PROMPTS[1])], 6).tokens[0]
  for top_p in (1e-39, 5e-324, 1e-45):
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0,
            "top_p": top_p, "seed": 5, "n": 2}
    texts = [text for text, _ in _choices(_post(http, "/completions", body))]
    assert texts == [tok.decode(greedy)] * 2, top_p


def test_admission_counts_sequences_not_requests(server, http):
  # n x prompts beyond the capacity: a 400 naming n, at once (issue 33 queued 128,000).
  start = time.perf_counter()
  response = _post(http, "/completions", {"model": NAME, "prompt": PROMPTS[:3], "n": 4})
  _assert_400(response, "n")
  assert time.perf_counter() - start < 1.0
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
          "stream": True, "n": CAPACITY - 2}

  async def run():
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
      async with client.stream("POST", "/completions", json=body) as filler:
        assert filler.status_code == 200
        await filler.aiter_lines().__anext__()  # the filler's choices are admitted
        # 3 more sequences do not fit beside CAPACITY - 2 (one request, 3 choices, did
        # fit under the old request-counting bound).
        over = await client.post("/completions", json={**PROBE, "n": 3})
        fits = await client.post("/completions", json={**PROBE, "max_tokens": 1, "n": 2})
      return over, fits

  over, fits = asyncio.run(run())
  assert over.status_code == 503 and over.json()["error"]["code"] == "queue_full"
  assert fits.status_code == 200
  _wait_idle(server)


def test_a_mass_abort_leaves_no_step_outputs_alive(server):
  body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 100, "temperature": 0,
          "stream": True}

  async def one(client):
    async with client.stream("POST", "/completions", json=body) as response:
      async for _ in response.aiter_lines():
        return  # hang up after the first chunk: the server aborts the request

  async def run():
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
      await asyncio.gather(*[one(client) for _ in range(CONFIG.max_num_seqs)])

  asyncio.run(run())
  _wait_idle(server)
  time.sleep(0.2)  # the engine thread is back waiting on its inbox
  gc.collect()
  alive = [o for o in gc.get_objects() if isinstance(o, RequestOutput)]
  assert alive == [], f"{len(alive)} RequestOutputs still referenced"


# -- the fuzzer ----------------------------------------------------------------------

# Every code point, lone surrogates and NUL included.
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "stream", "stream_options",
          "logprobs", "top_logprobs", "echo", "logit_bias", "suffix", "ignore_eos", "min_tokens",
          "repetition_penalty", "presence_penalty", "frequency_penalty",
          "include_stop_str_in_output", "skip_special_tokens"]
BASES = {"/completions": {"model": NAME, "prompt": "x = ", "max_tokens": 2},
         "/chat/completions": {"model": NAME, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]}}
DEEP = st.integers(1, 3000).map(lambda d: ("[" * d + "]" * d).encode())


@st.composite
def bodies(draw):
  """A base request with 1-3 fields set to random JSON, a random document, deep nesting,
  or random bytes."""
  kind = draw(st.sampled_from(["fields", "fields", "fields", "document", "deep", "bytes"]))
  path = draw(st.sampled_from(sorted(BASES)))
  if kind == "fields":
    body = dict(BASES[path])
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
      body[field] = draw(JSON)
    return path, json.dumps(body).encode()
  if kind == "document":
    return path, json.dumps(draw(JSON)).encode()
  if kind == "deep":
    return path, draw(DEEP)
  return path, draw(st.binary(max_size=64))


def test_fuzzed_requests_never_get_a_500_and_the_probe_is_unchanged(server, http):
  before = _choices(_post(http, "/completions", PROBE))
  deadline = time.monotonic() + 60
  seen = set()

  @settings(max_examples=250, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
  @given(bodies(), st.booleans())
  def fuzz(case, unknown_route):
    if time.monotonic() > deadline:
      return
    path, raw = case
    if unknown_route:
      path = "/no-such-route"
    if b'"stream": true' in raw:  # read streamed answers through to the end
      with http.stream("POST", path, content=raw) as response:
        status = response.status_code
        response.read()
    else:
      status = http.post(path, content=raw).status_code
    seen.add(status)
    assert status in ALLOWED, (status, path, raw[:300])

  fuzz()
  assert 400 in seen and 404 in seen
  _wait_idle(server)
  assert _choices(_post(http, "/completions", PROBE)) == before
  assert server.state.loop.alive


# -- structured outputs and tools -----------------------------------------------------

KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "anyOf", "allOf",
            "oneOf", "not", "$ref", "$defs", "$anchor", "$id", "minimum", "maximum",
            "minLength", "maxLength", "minItems", "maxItems", "pattern", "format",
            "additionalProperties", "contains", "prefixItems"]
TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"])
REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b", "#/properties/x", "#a", "urn:x",
                        "#/nope", "https://example.com/s.json", "#/$defs/a/properties/x"])
SCHEMA = st.recursive(
    st.booleans() | st.fixed_dictionaries({"type": TYPES}) | REFS.map(lambda r: {"$ref": r}),
    lambda inner: st.dictionaries(
        st.sampled_from(KEYWORDS),
        inner | JSON | TYPES | REFS | st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b", "x"]), inner, max_size=3), max_size=4),
    max_leaves=10)
SCHEMAS = SCHEMA | st.integers(1, 1200).map(ref_chain) | JSON
LARK = (st.lists(st.sampled_from([
    "start:", " a", " b", "\na:", "\nb:", ' "x"', " /[a-z]+/", " |", " (", " )", "*", "+", "?",
    " [", " ]", ' %json {"type": "integer"}', ' %json {"$ref": "#"}', "\n", "~2", ' "\\"',
    " %ignore", " //", "\nA:", " A"]), max_size=24).map("".join)
        | st.integers(1, 3000).map(rule_chain) | TEXT)
REGEX = st.lists(st.sampled_from(["a", "b", "(", ")", "[a-z]", "*", "+", "?", "{2,5}",
                                  "{1000}", "|", ".", "\\", "^", "$", "\\d"]),
                 max_size=20).map("".join) | TEXT
CHOICES = (st.lists(TEXT, max_size=5) | JSON
           | st.integers(0, 2500).map(lambda n: [f"c{i}" for i in range(n)]))
STRUCTURED = st.one_of(
    SCHEMAS.map(lambda s: {"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": s}}}),
    (st.sampled_from([{"type": "json_object"}, {"type": "text"}]) | JSON).map(
        lambda v: {"response_format": v}),
    st.one_of(SCHEMAS.map(lambda v: {"json": v}), LARK.map(lambda v: {"grammar": v}),
              REGEX.map(lambda v: {"regex": v}), CHOICES.map(lambda v: {"choice": v}),
              JSON).map(lambda v: {"structured_outputs": v}),
    SCHEMAS.map(lambda v: {"guided_json": v}), LARK.map(lambda v: {"guided_grammar": v}),
    REGEX.map(lambda v: {"guided_regex": v}), CHOICES.map(lambda v: {"guided_choice": v}))
TOOL = st.fixed_dictionaries(
    {"type": st.just("function") | JSON,
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | TEXT},
                                       optional={"parameters": SCHEMAS,
                                                 "description": TEXT | JSON}) | JSON}) | JSON
TOOL_CHOICES = st.sampled_from(["none", "auto", "required",
                                {"type": "function", "function": {"name": "f"}}]) | JSON
TOOLS = st.fixed_dictionaries({"tools": st.lists(TOOL, max_size=3) | JSON},
                              optional={"tool_choice": TOOL_CHOICES,
                                        "parallel_tool_calls": st.booleans() | JSON})


class HealthWatch(threading.Thread):
  """Times GET /health back to back until stopped: the slowest answer, and any non-200."""

  def __init__(self, url: str):
    super().__init__(daemon=True)
    self.url, self.slowest, self.statuses = url, 0.0, set()
    self.stopped = threading.Event()

  def run(self):
    with httpx.Client(timeout=10) as client:
      while not self.stopped.wait(0.02):
        start = time.perf_counter()
        self.statuses.add(client.get(self.url).status_code)
        self.slowest = max(self.slowest, time.perf_counter() - start)


def test_fuzzed_structured_outputs_and_tools_never_get_a_500_nor_stall_health(server, http):
  before = _choices(_post(http, "/completions", PROBE))
  deadline = time.monotonic() + 25
  seen = set()
  watch = HealthWatch(f"{server.root}/health")
  watch.start()

  @settings(max_examples=150, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
  @given(st.sampled_from(sorted(BASES)), STRUCTURED | st.none(), TOOLS | st.none(),
         st.booleans())
  def fuzz(path, structured, tools, stream):
    if time.monotonic() > deadline:
      return
    body = {**BASES[path], "temperature": 0, "max_tokens": 3, "stream": stream,
            **(structured or {}), **(tools or {})}
    raw = json.dumps(body).encode()
    with http.stream("POST", path, content=raw) as response:
      status = response.status_code
      text = response.read()
    seen.add(status)
    assert status in ALLOWED, (status, path, raw[:300], text[:300])
    assert not (stream and status == 200 and b'"server_error"' in text), text[:300]

  try:
    fuzz()
  finally:
    watch.stopped.set()
    watch.join()
  assert {200, 400} <= seen
  assert watch.statuses == {200} and watch.slowest < 1.0, (watch.statuses, watch.slowest)
  _wait_idle(server)
  assert _choices(_post(http, "/completions", PROBE)) == before
  assert server.state.loop.alive
