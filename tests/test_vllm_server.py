"""vLLM's request fields over HTTP: ignore_eos, min_tokens, stop strings kept in the text,
special tokens shown, penalties, unknown fields and models (the engine's own semantics
are checked against a numpy oracle in tests/test_vllm_fields.py)."""
from __future__ import annotations

import httpx
import openai
import pytest

import kvjax
from kvjax.server import serve_in_thread
from tests.server_helpers import CONFIG, NAME, ids_of

EOS_FORCED = {"257": 100}  # the default model's EOS (id 257) always wins


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint()


@pytest.fixture(scope="module")
def server(model):
  with serve_in_thread(model, CONFIG, served_model_name=NAME, max_waiting=16) as handle:
    yield handle


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _complete(client, prompt, max_tokens, **extra):
  return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                   temperature=0, extra_body=extra)


def test_ignore_eos_yields_exactly_max_tokens(client):
  plain = _complete(client, "x = 1", 12, logit_bias=EOS_FORCED)
  assert (plain.usage.completion_tokens, plain.choices[0].finish_reason) == (1, "stop")
  for stream in (False, True):
    if stream:
      chunks = list(client.completions.create(
          model=NAME, prompt="x = 1", max_tokens=12, temperature=0, stream=True,
          stream_options={"include_usage": True},
          extra_body=dict(logit_bias=EOS_FORCED, ignore_eos=True, skip_special_tokens=False)))
      text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
      answer = _complete(client, "x = 1", 12, logit_bias=EOS_FORCED, ignore_eos=True,
                         skip_special_tokens=False)
      text, usage = answer.choices[0].text, answer.usage
    assert usage.completion_tokens == 12
    assert text == "</s>" * 12  # skip_special_tokens false: EOS shows as text
  hidden = _complete(client, "x = 1", 5, logit_bias=EOS_FORCED, ignore_eos=True)
  assert (hidden.usage.completion_tokens, hidden.choices[0].text) == (5, "")


def test_min_tokens_holds_off_eos_and_stop_strings(client, model):
  answer = _complete(client, "x = 1", 20, logit_bias=EOS_FORCED, min_tokens=5)
  assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (6, "stop")
  greedy = model.tokenizer.decode(kvjax.Engine(model, CONFIG).generate(
      [ids_of(model.tokenizer, "for i in range(10):")], 60).tokens[0])
  for min_tokens, include in ((0, False), (0, True), (25, False), (25, True)):
    # Byte tokens: a character per token; the first "range" ending at >= min_tokens counts.
    end = next(i + 5 for i in range(len(greedy)) if greedy.startswith("range", i)
               and i + 5 >= min_tokens)
    got = _complete(client, "for i in range(10):", 60, stop=["range"], min_tokens=min_tokens,
                    include_stop_str_in_output=include).choices[0]
    assert (got.text, got.finish_reason) == (greedy[:end if include else end - 5], "stop")


def test_penalties_over_http_equal_the_engine(client, model):
  fields = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                logit_bias={"101": 2.0})
  got = _complete(client, "for i in range(10):", 24, **fields).choices[0].text
  engine = kvjax.Engine(model, CONFIG)
  rid = engine.add_request(ids_of(model.tokenizer, "for i in range(10):"), 24, **fields)
  want = [o for o in engine.stream() if o.request_id == rid and o.finished][0].output_ids
  assert got == model.tokenizer.decode(want)
  plain = _complete(client, "for i in range(10):", 24).choices[0].text
  assert got != plain


def test_unknown_fields_ignored_unsupported_400_unknown_model_404(server, client):
  plain = _complete(client, "x = 1", 4).choices[0].text
  assert _complete(client, "x = 1", 4, some_future_field={"a": 1}).choices[0].text == plain
  body = {"model": NAME, "prompt": "x", "max_tokens": 2}
  for field, value in (("use_beam_search", True), ("presence_penalty", 3),
                       ("include_stop_str_in_output", "yes"), ("min_tokens", 5)):
    answer = httpx.post(f"{server.url}/completions", json={**body, field: value}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
  answer = httpx.post(f"{server.url}/completions", json={**body, "model": "gpt-4"}, timeout=30)
  assert answer.status_code == 404
  assert answer.json()["error"]["code"] == "model_not_found"
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_continuous_usage_stats_puts_the_counts_so_far_in_every_chunk(server, client, model):
  """vLLM's stream_options.continuous_usage_stats (guidellm sends it): each chunk's usage
  counts the tokens streamed up to it; the last chunk the whole answer."""
  prompt = "x = 1"
  chunks = list(client.completions.create(
      model=NAME, prompt=prompt, max_tokens=9, temperature=0, stream=True,
      stream_options={"include_usage": True, "continuous_usage_stats": True},
      extra_body=dict(ignore_eos=True)))
  prompt_tokens = len(ids_of(model.tokenizer, prompt))
  streamed = 0
  for chunk in chunks[:-1]:
    streamed += len(chunk.choices[0].text.encode())  # byte tokens: a byte each
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
            chunk.usage.total_tokens) == (prompt_tokens, streamed, prompt_tokens + streamed)
  assert (chunks[-1].choices, chunks[-1].usage.completion_tokens) == ([], 9)
  plain = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}))
  assert [c.usage for c in plain[:-1]] == [None] * (len(plain) - 1)
  for options in ({"continuous_usage_stats": "yes"}, {"include_usage": 1}):
    answer = httpx.post(f"{server.url}/completions", timeout=30, json={
        "model": NAME, "prompt": prompt, "max_tokens": 2, "stream": True,
        "stream_options": options})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream_options"
