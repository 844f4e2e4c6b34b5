"""The OpenAI-compatible server end to end, over real sockets on 127.0.0.1.

Oracles: offline kvjax.generate (static batch) or a separate offline Engine of
the same ids, decoded with the model's tokenizer; the official `openai`
client; prometheus_client's own text parser; exact counts of what the tests
sent.  One server per module (same engine shapes as the offline Engine, so the
step programs compile once).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import openai
import pytest

import kvjax
from kvjax.runtime.serve_steps import num_compiled
from kvjax.server import serve_in_thread
from kvjax.server.handle import _warm_up
from kvjax.server.protocol import (Limits, OpenAIError, engine_error_param, parse_chat,
                                   parse_completion)
from kvjax.server.text import TextStream
from tests.server_helpers import (CONFIG, NAME, PROMPTS, chat_ids, expected, ids_of, scrape,
                                  sse_events, value)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint()


@pytest.fixture(scope="module")
def tok(model):
  return model.tokenizer


@pytest.fixture(scope="module")
def server(model):
  with serve_in_thread(model, CONFIG, served_model_name=NAME, max_waiting=64) as handle:
    yield handle


@pytest.fixture(scope="module")
def offline(model):
  """An offline Engine of the server's shapes: prompts -> output ids."""
  engine = kvjax.Engine(model, CONFIG)
  return lambda prompts, max_new, **sampling: engine.generate(prompts, max_new,
                                                              **sampling).tokens


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def assert_idle_and_pages_free(server, timeout_s: float = 30.0) -> None:
  """/metrics reaches 0 running and 0 waiting; every page is back in the pool (the
  prefix cache's evictable pages count as free) and the scheduler is consistent."""
  deadline = time.monotonic() + timeout_s
  while True:
    samples = scrape(server.root)
    idle = (value(samples, "kvjax:num_requests_running") == 0
            and value(samples, "kvjax:num_requests_waiting") == 0)
    if idle or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert idle, samples
  assert value(samples, "kvjax:kv_cache_usage_perc") == 0
  scheduler = server.engine.scheduler
  scheduler.check_invariants()
  assert scheduler.allocator.num_used == 0 and not scheduler.requests


def test_text_stream_cuts_before_stop_and_never_splits_a_character(tok):
  text = "x€ab!"  # € is three bytes: three tokens
  stream = TextStream(tok.detokenizer(), stop_strings=["ab"])
  deltas = [stream.push([t]) for t in tok.encode(text)]
  assert "".join(d for d, _ in deltas) == "x€"
  assert all("\ufffd" not in d for d, _ in deltas)
  assert [r for _, r in deltas if r] == ["stop"]
  assert stream.num_tokens == len("x€ab".encode())  # up to the token completing "ab"


def test_warm_up_compiles_what_two_concurrent_short_requests_run(model):
  """After the server's warm-up, one request decoding while another prefills compiles
  nothing (the single-step decode program; 3 rows: shapes no other test compiles)."""
  engine = kvjax.Engine(model, CONFIG, max_num_seqs=3)
  _warm_up(engine)
  before = num_compiled()
  engine.add_request([5, 6, 7, 8], 3)
  engine.step()
  engine.add_request([9, 10], 3)
  while engine.has_unfinished:
    engine.step()
  assert num_compiled() == before


def test_engine_refusals_and_tokenizerless_text_name_the_field(model):
  """What only the Engine can check (the pool's size) maps to the field; a text prompt
  on a model without a tokenizer is a 400, never silent byte-encoding."""
  small_pool = kvjax.Engine(model, CONFIG, num_pages=3)
  with pytest.raises(ValueError) as refused:
    small_pool.add_request([1] * 10, 100)
  assert engine_error_param(str(refused.value)) == "max_tokens"
  limits = Limits(NAME, model.config.vocab_size, CONFIG.max_model_len)
  with pytest.raises(OpenAIError) as error:
    parse_completion({"model": NAME, "prompt": "hello"}, limits, tokenizer=None)
  assert error.value.param == "prompt" and "tokenizer" in error.value.message
  assert parse_completion({"model": NAME, "prompt": [5, 6]}, limits, None).prompts == ((5, 6),)


def test_chat_on_a_base_model_is_a_400_naming_messages(model):
  """A tokenizer without a chat template (a base model) cannot render messages: refused up
  front as vLLM refuses it, not as a template error, nor by rendering something else."""
  from tokenizers import Tokenizer, models

  from kvjax.text.hf_tokenizer import HFTokenizer

  base = HFTokenizer(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), {}, (),
                     None, clean_up=False)
  limits = Limits(NAME, model.config.vocab_size, CONFIG.max_model_len)
  with pytest.raises(OpenAIError) as error:
    parse_chat({"model": NAME, "messages": [{"role": "user", "content": "hi"}]}, limits, base)
  assert error.value.param == "messages" and error.value.status == 400
  assert "no chat template" in error.value.message


def test_health_and_models(server):
  assert httpx.get(server.root + "/health").status_code == 200
  models = openai.OpenAI(base_url=server.url, api_key="unused").models.list()
  assert [m.id for m in models.data] == [NAME]


def test_completions_match_offline_generate(model, tok, client):
  prompts = [ids_of(tok, p) for p in PROMPTS[:3]]
  max_tokens = 20
  reference = kvjax.generate(model, prompts, max_tokens).tokens
  for text, ids, tokens in zip(PROMPTS, prompts, reference):
    want = expected(tok, tokens, max_tokens)
    got = client.completions.create(model=NAME, prompt=text, max_tokens=max_tokens,
                                    temperature=0)
    assert got.id.startswith("cmpl-")
    assert [(c.text, c.finish_reason) for c in got.choices] == [(want["text"],
                                                                  want["finish_reason"])]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens,
            got.usage.total_tokens) == (len(ids), want["tokens"], len(ids) + want["tokens"])
    chunks = list(client.completions.create(model=NAME, prompt=text, max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage
  # A list of prompts (text and ids) with n = 2: choice i is prompt i // 2.
  batch = client.completions.create(model=NAME, prompt=[PROMPTS[0], prompts[1]],
                                    max_tokens=max_tokens, temperature=0, n=2)
  assert [c.index for c in batch.choices] == [0, 1, 2, 3]
  assert [c.text for c in batch.choices] == [expected(tok, reference[i // 2],
                                                      max_tokens)["text"] for i in range(4)]
  assert batch.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
  assert batch.usage.completion_tokens == 2 * sum(
      expected(tok, reference[i], max_tokens)["tokens"] for i in range(2))


def test_chat_matches_offline_generate(model, tok, client):
  messages = [{"role": "system", "content": "You write Python."},
              {"role": "user", "content": "def add(a, b):"}]
  ids = chat_ids(tok, messages)
  max_tokens = 24
  want = expected(tok, kvjax.generate(model, [ids], max_tokens).tokens[0], max_tokens)
  got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                       temperature=0)
  assert got.id.startswith("chatcmpl-")
  assert got.choices[0].message.role == "assistant"
  assert (got.choices[0].message.content, got.choices[0].finish_reason) == (
      want["text"], want["finish_reason"])
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), want["tokens"])
  chunks = list(client.chat.completions.create(model=NAME, messages=messages,
                                               max_tokens=max_tokens, temperature=0,
                                               stream=True,
                                               stream_options={"include_usage": True}))
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  assert deltas[0].role == "assistant"
  assert "".join(d.content or "" for d in deltas) == got.choices[0].message.content
  assert chunks[-1].usage == got.usage


def test_logprobs_match_a_full_forward(model, tok, client):
  """Each token's log p (and the top alternatives) equal log_softmax of a full causal
  forward over prompt + output, with OpenAI's completions and chat shapes."""
  max_tokens, k = 8, 3
  ids = ids_of(tok, PROMPTS[0])
  out = kvjax.generate(model, [ids], max_tokens).tokens[0]
  logits = kvjax.forward(model, [ids + out[:-1]])[0, len(ids) - 1:]
  log_p = np.asarray(jax.nn.log_softmax(logits, axis=-1))  # [len(out), V]
  got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=max_tokens,
                                  temperature=0, logprobs=k).choices[0].logprobs
  np.testing.assert_allclose(got.token_logprobs, log_p[np.arange(len(out)), out], atol=2e-4)
  assert got.tokens == [tok.decode([t], skip_special_tokens=False) for t in out]
  assert got.text_offset == list(np.cumsum([0] + [len(t) for t in got.tokens[:-1]]))
  streamed = [c.choices[0].logprobs for c in client.completions.create(
      model=NAME, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, logprobs=k,
      stream=True) if c.choices and c.choices[0].logprobs]
  assert sum((s.token_logprobs for s in streamed), []) == got.token_logprobs
  assert sum((s.text_offset for s in streamed), []) == got.text_offset
  messages = [{"role": "user", "content": "def f(x):"}]
  chat_prompt = chat_ids(tok, messages)
  out = kvjax.generate(model, [chat_prompt], max_tokens).tokens[0]
  logits = kvjax.forward(model, [chat_prompt + out[:-1]])[0, len(chat_prompt) - 1:]
  log_p = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  content = client.chat.completions.create(
      model=NAME, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True,
      top_logprobs=k).choices[0].logprobs.content
  assert len(content) == len(out)
  for position, (entry, token) in enumerate(zip(content, out)):
    assert entry.token == tok.decode([token], skip_special_tokens=False)
    assert abs(entry.logprob - log_p[position, token]) < 2e-4
    want = np.argsort(-log_p[position])[:k]
    assert [t.token for t in entry.top_logprobs] == [
        tok.decode([int(i)], skip_special_tokens=False) for i in want]
    np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], log_p[position, want],
                               atol=2e-4)


async def _stream_one(http: httpx.AsyncClient, url: str, body: dict, disconnect_after=None):
  """POST a streaming request -> (text, finish reason, usage); or None once it hangs up
  after `disconnect_after` chunks."""
  text, reason, usage, chunks = "", None, None, 0
  async with http.stream("POST", url + "/completions", json=body) as response:
    assert response.status_code == 200, await response.aread()
    async for line in response.aiter_lines():
      for event in sse_events([line]):
        if event == "[DONE]":
          return text, reason, usage
        chunks += 1
        if disconnect_after is not None and chunks >= disconnect_after:
          return None  # leaving the block closes the connection mid-stream
        usage = event.get("usage") or usage
        for choice in event["choices"]:
          text += choice["text"]
          reason = choice["finish_reason"] or reason
  raise AssertionError("the stream ended without [DONE]")


def test_32_streaming_clients_a_quarter_disconnecting(tok, server, offline):
  before = scrape(server.root)
  prompts = [ids_of(tok, PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
             for i in range(32)]
  kinds = ["greedy", "sampled", "stop", "disconnect", "greedy", "filtered", "stop",
           "disconnect"] * 4
  seeds = {i: 1000 + i for i in range(32) if kinds[i] in ("sampled", "filtered")}
  filtered = dict(temperature=0.8, top_k=40, top_p=0.9)
  stops = [" of", "first", "stack", "\n   "]  # several are hit, after 0 to 9 characters
  max_tokens, long_tokens = 24, 96
  bodies = []
  for i, kind in enumerate(kinds):
    body = {"model": NAME, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if kind == "sampled":
      body.update(temperature=0.8, seed=seeds[i])
    elif kind == "filtered":
      body.update(filtered, seed=seeds[i])
    elif kind == "stop":
      body["stop"] = stops
    elif kind == "disconnect":
      body["max_tokens"] = long_tokens
    bodies.append(body)

  async def run_all():
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
      return await asyncio.wait_for(asyncio.gather(*[
          _stream_one(http, server.url, body, 3 if kind == "disconnect" else None)
          for body, kind in zip(bodies, kinds)]), timeout=240)

  start = time.monotonic()
  results = asyncio.run(run_all())
  wall = time.monotonic() - start
  greedy_ids = [i for i, k in enumerate(kinds) if k in ("greedy", "stop")]
  reference = dict(zip(greedy_ids, offline([prompts[i] for i in greedy_ids], max_tokens)))
  for kind, sampling in (("sampled", dict(temperature=0.8)), ("filtered", filtered)):
    ids = [i for i in sorted(seeds) if kinds[i] == kind]
    reference.update(zip(ids, offline([prompts[i] for i in ids], max_tokens,
                                      seed=[seeds[i] for i in ids], **sampling)))
  completion_tokens = 0
  for i, kind in enumerate(kinds):
    if kind == "disconnect":
      assert results[i] is None
      continue
    want = expected(tok, reference[i], max_tokens, stops if kind == "stop" else ())
    text, reason, usage = results[i]
    assert (text, reason) == (want["text"], want["finish_reason"]), (i, kind)
    assert usage["completion_tokens"] == want["tokens"]
    completion_tokens += want["tokens"]
  assert sum(kinds[i] == "stop" and results[i][1] == "stop" for i in range(32)) >= 4
  assert_idle_and_pages_free(server)
  after = scrape(server.root)
  delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)
  assert delta("kvjax:request_success_total", finished_reason="abort") == 8
  assert delta("kvjax:request_success_total", finished_reason="stop") + delta(
      "kvjax:request_success_total", finished_reason="length") == 24
  # Disconnected requests stopped early: fewer tokens than asked, counted as generated.
  aborted_tokens = delta("kvjax:generation_tokens_total") - completion_tokens
  assert 8 * 3 <= aborted_tokens < 8 * long_tokens
  print(f"32 streaming clients: {wall:.1f} s")


def test_non_streamed_client_hanging_up_aborts_its_choices(server):
  before = scrape(server.root)
  n = 2 * CONFIG.max_num_seqs  # two waves: the second is still waiting when the client goes
  body = json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
                     "n": n}).encode()
  host, port = server.root.removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=10) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    # Hang up only once the engine holds the request (a timeout-based client can go before
    # the server has even read it, and then there is nothing to abort).
    deadline = time.monotonic() + 30
    while value(scrape(server.root), "kvjax:num_requests_running") == 0:
      assert time.monotonic() < deadline, "the request never started"
      time.sleep(0.01)
  assert_idle_and_pages_free(server)
  after = scrape(server.root)
  aborted = (value(after, "kvjax:request_success_total", finished_reason="abort")
             - value(before, "kvjax:request_success_total", finished_reason="abort"))
  assert CONFIG.max_num_seqs <= aborted <= n


def test_non_streamed_request_notices_hang_up_while_tokens_keep_coming():
  """The disconnect check runs on a clock: a queue that never goes quiet must not hide it."""
  from types import SimpleNamespace
  from kvjax.server.app import _collect
  from kvjax.server.engine_loop import Delta

  class HungUp:
    async def is_disconnected(self):
      return True

  cancelled = []
  loop = SimpleNamespace(cancel=cancelled.append)
  submission = SimpleNamespace(request=SimpleNamespace(num_choices=1))

  async def main():
    events = asyncio.Queue()

    async def engine():  # a token every millisecond, never finishing within the test
      for i in range(5000):
        events.put_nowait(Delta(index=0, text="x", token_ids=[i], num_tokens=i + 1,
                                finish_reason=None))
        await asyncio.sleep(0.001)

    producer = asyncio.create_task(engine())
    try:
      return await asyncio.wait_for(_collect(loop, submission, events, None, HungUp()), 2.0)
    finally:
      producer.cancel()

  assert asyncio.run(main()) is None
  assert cancelled == [submission]


def test_bad_requests_get_400_naming_the_field(tok, server, offline):
  good = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0,
          "stream": True}
  long_prompt = list(range(1, 60))
  bad = [  # (raw body or dict, endpoint, param)
      (b"{not json", "completions", None),
      ({"model": "gpt-4", "prompt": "x"}, "completions", "model"),
      ({"model": NAME, "prompt": "x", "max_tokens": -1}, "completions", "max_tokens"),
      ({"model": NAME, "prompt": "x", "max_tokens": 0}, "completions", "max_tokens"),
      ({"model": NAME, "prompt": long_prompt, "max_tokens": 100}, "completions", "max_tokens"),
      ({"model": NAME, "prompt": list(range(200, 300))}, "completions", "prompt"),
      ({"model": NAME, "prompt": [1, 2, 259]}, "completions", "prompt"),
      ({"model": NAME, "prompt": "x", "temperature": -0.5}, "completions", "temperature"),
      (b'{"model": "%s", "prompt": "x", "temperature": NaN}' % NAME.encode(), "completions",
       "temperature"),
      (b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % NAME.encode(), "completions",
       "top_p"),
      ({"model": NAME, "prompt": "x", "max_tokens": "8"}, "completions", "max_tokens"),
      ({"model": NAME, "prompt": "x", "top_k": 1.5}, "completions", "top_k"),
      ({"model": NAME, "prompt": 5}, "completions", "prompt"),
      ({"model": NAME, "prompt": "x", "n": 0}, "completions", "n"),
      ({"model": NAME, "prompt": "x", "seed": -1}, "completions", "seed"),
      ({"model": NAME, "prompt": "x", "stop": [""]}, "completions", "stop"),
      ({"model": NAME, "prompt": "x", "stop": [300]}, "completions", "stop"),
      ({"model": NAME, "prompt": "x", "stream": "yes"}, "completions", "stream"),
      ({"model": NAME, "prompt": "x", "logprobs": 21}, "completions", "logprobs"),
      ({"model": NAME, "prompt": "x", "logprobs": True}, "completions", "logprobs"),
      ({"model": NAME, "messages": "hi"}, "chat/completions", "messages"),
      ({"model": NAME, "messages": [{"role": "user", "content": 3}]}, "chat/completions",
       "messages"),
      ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
       "chat/completions", "top_logprobs"),
      ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": 50}, "chat/completions", "top_logprobs"),
  ]
  reference = offline([ids_of(tok, PROMPTS[0])], 32)[0]
  want = expected(tok, reference, 32)

  async def run():
    async with httpx.AsyncClient(timeout=60) as http:
      around = [asyncio.create_task(_stream_one(http, server.url, good))]
      answers = []
      for body, endpoint, param in bad:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        answers.append(await http.post(f"{server.url}/{endpoint}", **kwargs))
      around.append(asyncio.create_task(_stream_one(http, server.url, good)))
      return answers, await asyncio.gather(*around)

  answers, around = asyncio.run(run())
  for (body, endpoint, param), answer in zip(bad, answers):
    # An unknown model is OpenAI's and vLLM's 404; every other bad field a 400.
    assert answer.status_code == (404 if param == "model" else 400), (body, answer.text)
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), (body, error)
    assert param is None or param in error["message"], error
  for text, reason, _ in around:
    assert (text, reason) == (want["text"], want["finish_reason"])
  assert_idle_and_pages_free(server)


def test_metrics_counters_equal_what_was_sent(tok, server, client):
  before = scrape(server.root)
  answers = [client.completions.create(model=NAME, prompt=p, max_tokens=m, **extra)
             for p, m, extra in [(PROMPTS[0], 8, {"temperature": 0}),
                                 (PROMPTS[1], 12, {"temperature": 0, "n": 2}),
                                 # The docstring's quotes come mid-burst, in the
                                 # request's last output
                                 (PROMPTS[0], 16, {"temperature": 0, "stop": ['"""']}),
                                 (PROMPTS[3], 5, {"temperature": 0.7, "seed": 3})]]
  after = scrape(server.root)
  delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)
  choices = [c for a in answers for c in a.choices]
  assert choices[3].finish_reason == "stop" and choices[3].text == "\n    "
  prompt_tokens = sum(len(ids_of(tok, p)) for p in [PROMPTS[0], PROMPTS[1], PROMPTS[1],
                                                     PROMPTS[0], PROMPTS[3]])
  assert delta("kvjax:prompt_tokens_total") == prompt_tokens
  assert delta("kvjax:generation_tokens_total") == sum(a.usage.completion_tokens
                                                       for a in answers)
  for reason in ("stop", "length"):
    assert delta("kvjax:request_success_total", finished_reason=reason) == sum(
        c.finish_reason == reason for c in choices)
  for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
               "request_queue_time_seconds", "request_prompt_tokens",
               "request_generation_tokens"):
    assert delta(f"kvjax:{name}_count") == len(choices), name
  assert delta("kvjax:request_generation_tokens_sum") == delta("kvjax:generation_tokens_total")
  assert delta("kvjax:prefix_cache_queries_total") >= prompt_tokens - len(choices)
  assert value(after, "kvjax:max_num_seqs") == CONFIG.max_num_seqs


def test_full_queue_answers_503_at_once(model, tok):
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
          "stream": True}
  with serve_in_thread(model, CONFIG, served_model_name=NAME, max_waiting=1) as server:

    async def run():
      async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as http:
        # 8 running + 1 waiting: the engine is full and so is the queue.
        fillers = [asyncio.create_task(_stream_one(http, server.url, body))
                   for _ in range(CONFIG.max_num_seqs + 1)]
        deadline = time.monotonic() + 60
        while value(scrape(server.root), "kvjax:num_requests_waiting") < 1:
          assert time.monotonic() < deadline, "the queue never filled"
          await asyncio.sleep(0.02)
        times, answers = [], []
        for _ in range(5):
          start = time.perf_counter()
          answers.append(await http.post(server.url + "/completions", json=body))
          times.append(time.perf_counter() - start)
        for task in fillers:
          task.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        return times, answers

    times, answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [503] * 5
    assert answers[0].json()["error"]["code"] == "queue_full"
    assert statistics.median(times) < 0.1, times
    assert_idle_and_pages_free(server)
    print(f"503 answered in {statistics.median(times) * 1e3:.1f} ms (median of 5)")


@pytest.fixture(scope="module")
def hf_chat_model(tmp_path_factory):
  """A tiny random Llama saved by transformers with a byte-level BPE tokenizer and a
  ChatML template -> (kvjax Model loaded from the directory, transformers' tokenizer)."""
  import torch
  import transformers

  from tests.test_hf_tokenizer import CHATML, _train_byte_level_bpe

  directory = str(tmp_path_factory.mktemp("hf_chat"))
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=_train_byte_level_bpe(), bos_token="<s>", eos_token="<|im_end|>",
      chat_template=CHATML)
  hf_tok.save_pretrained(directory)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      initializer_range=0.2, bos_token_id=hf_tok.bos_token_id,
      eos_token_id=hf_tok.eos_token_id)).save_pretrained(directory)
  return kvjax.load_checkpoint(directory), transformers.AutoTokenizer.from_pretrained(directory)


def test_hf_tokenizer_text_and_chat_equal_transformers_decode(hf_chat_model):
  """Multi-byte text through a BPE tokenizer: the served text (streamed or not) is
  transformers' decode of kvjax.generate's ids for transformers' own prompt ids."""
  model, hf_tok = hf_chat_model
  max_tokens = 24
  prompt = "日本語 café 🐍 def main():"
  messages = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "你好，世界！ emoji 🚀"}]
  prompts = [hf_tok.encode(prompt),
             hf_tok.encode(hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False),
                           add_special_tokens=False)]
  want = [hf_tok.decode(out, skip_special_tokens=True)
          for out in kvjax.generate(model, prompts, max_tokens).tokens]
  assert any(ord(c) > 127 for c in "".join(want))  # the test decodes multi-byte characters
  with serve_in_thread(model, CONFIG, served_model_name="hf") as server:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    sampling = dict(model="hf", max_tokens=max_tokens, temperature=0)
    got = client.completions.create(prompt=prompt, **sampling)
    assert (got.choices[0].text, got.usage.prompt_tokens) == (want[0], len(prompts[0]))
    chunks = client.completions.create(prompt=prompt, stream=True, **sampling)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
    chat = client.chat.completions.create(messages=messages, **sampling)
    assert (chat.choices[0].message.content, chat.usage.prompt_tokens) == (want[1],
                                                                          len(prompts[1]))
    chunks = client.chat.completions.create(messages=messages, stream=True, **sampling)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[1]


def test_stop_ends_open_streams_with_an_error_event(model):
  server = serve_in_thread(model, CONFIG, served_model_name=NAME)
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
          "stream": True}
  with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/completions",
                                                     json=body) as response:
    lines = response.iter_lines()
    first = sse_events([next(line for line in lines if line.startswith("data: "))])[0]
    assert first["choices"][0]["finish_reason"] is None
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 10
    events = sse_events(lines)
  assert events and "error" in events[-1] and "[DONE]" not in events, events[-3:]
  assert events[-1]["error"]["message"] == "the server is shutting down"
  with pytest.raises(httpx.ConnectError):
    httpx.get(server.root + "/health")


def test_cli_serve_prints_one_url_line_and_serves_port_0(tmp_path):
  command = [sys.executable, "-m", "kvjax", "serve", "--port", "0", "--served-model-name", "m",
             "--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "16",
             "--num-scheduler-steps", "1"]
  errors = open(tmp_path / "stderr", "w+")
  process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=errors,
                             text=True, env={**os.environ, "PYTHONPATH": ROOT})
  try:
    line = process.stdout.readline()
    assert line.startswith("kvjax serving m at http://127.0.0.1:"), (line, open(errors.name).read())
    url = line.split()[-1]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert port != 0 and url.endswith("/v1")
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    answer = httpx.post(url + "/completions", timeout=60,
                        json={"model": "m", "prompt": [256, 100], "max_tokens": 2})
    assert answer.json()["usage"]["completion_tokens"] == 2
  finally:
    process.terminate()
    assert process.wait(timeout=30) == 0
  assert process.stdout.read() == ""


def test_data_parallel_replicas_behind_one_server(model, tok):
  """Two replicas (sharing this CPU) behind a Router: the same greedy text as offline,
  requests spread over both, /metrics summed over them (the prefix counters grow by
  what the replicas' own caches counted) and idle afterwards."""
  with serve_in_thread([model, model], CONFIG, served_model_name=NAME,
                       router_policy="round_robin") as handle:
    prompts = [ids_of(tok, p) for p in PROMPTS[:4]]
    reference = kvjax.generate(model, prompts, 12).tokens
    client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
    caches = [e.scheduler.prefix_cache for e in handle.engine.engines]
    queried_before = sum(c.queried_tokens for c in caches)
    before = scrape(handle.root)
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [expected(tok, r, 12)["text"] for r in reference]
    assert handle.engine.routed == [2, 2]
    assert value(before, "kvjax:max_num_seqs") == 2 * CONFIG.max_num_seqs
    after = scrape(handle.root)
    assert value(after, "kvjax:request_success_total", finished_reason="length") - value(
        before, "kvjax:request_success_total", finished_reason="length") == 4
    assert value(after, "kvjax:num_requests_running") == 0
    assert handle.engine.stats().pages_used == 0
    queried = sum(c.queried_tokens for c in caches) - queried_before
    assert queried == sum(len(p) for p in prompts)
    deadline = time.monotonic() + 10  # the loop publishes after delivering the last step
    while (value(scrape(handle.root), "kvjax:prefix_cache_queries_total")
           - value(before, "kvjax:prefix_cache_queries_total") != queried):
      assert time.monotonic() < deadline, (scrape(handle.root), queried)
      time.sleep(0.05)
