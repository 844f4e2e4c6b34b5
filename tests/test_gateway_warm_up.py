"""The background warm-up: the server answers while it compiles, /health says warming
then ready, and after ready no request with any sampling option compiles.

Oracles: /health's status, kvjax.runtime.serve_steps.num_compiled and jax's own compile events
(kvjax.runtime.xla_options.xla_compile_counts: programs compiled or loaded from the persistent
cache), and an offline Engine of the same shapes for the greedy tokens."""
from __future__ import annotations

import concurrent.futures

import httpx
import jax
import pytest

import kvjax
from kvjax.runtime.serve_steps import num_compiled
from kvjax.runtime.xla_options import xla_compile_counts
from kvjax.server import serve_in_thread

# 2 rows, 16-token chunks, tables of 2 pages: 3 shapes, 5 runs (the burst in 3 stop-id
# widths; one program a shape serves top-k / top-p and logprobs).
pytestmark = pytest.mark.slow  # ~1 min on 2 busy cores

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, page_size=16)


@pytest.fixture(scope="module")
def model(tiny_model):  # no tokenizer: token-id prompts, token_ids in the answers
  params = jax.device_put(tiny_model.params, jax.devices()[0])  # committed, as a checkpoint's
  return kvjax.Model(tiny_model.config, params, tiny_model.dtype, tiny_model.tokenizer)


def _complete(root: str, **body) -> dict:
  answer = httpx.post(root + "/v1/completions", timeout=120,
                      json={"model": "tiny", "max_tokens": 8, **body})
  assert answer.status_code == 200, answer.text
  return answer.json()


def test_it_serves_while_warming_and_compiles_nothing_after_ready(model, released_programs):
  offline = kvjax.Engine(model, **SMALL)
  prompts = [[40, 50, 60], [70, 80, 90, 100, 110] * 2]
  want = offline.generate(prompts, 8).tokens
  xla_compile_counts()  # start counting
  with serve_in_thread(model, kvjax.EngineConfig(**SMALL), warm_up="background") as server:
    first = httpx.get(server.root + "/health", timeout=10).json()
    assert first["status"] == "warming" and first["warm_up"]["done"] < first["warm_up"]["total"]
    # Answered before the warm-up ends (the request compiles what it needs).
    got = _complete(server.root, prompt=prompts[0], temperature=0)["choices"][0]["token_ids"]
    assert got == want[0]
    assert server.wait_ready(300)
    assert httpx.get(server.root + "/health", timeout=10).json() == {"status": "ready"}
    assert server.warm_up.runs == first["warm_up"]["total"]
    steps, xla = num_compiled(), sum(xla_compile_counts())
    bodies = [dict(prompt=prompts[1], temperature=0),
              dict(prompt=prompts[0], temperature=0.8, top_p=0.9, seed=1),
              dict(prompt=prompts[1], temperature=0.8, top_k=5, seed=2, n=2),
              dict(prompt=prompts[0], logprobs=2, temperature=0),
              dict(prompt=prompts[1], top_p=0.5, logprobs=1, seed=3, max_tokens=16),
              dict(prompt=prompts[0], stop_token_ids=[61], temperature=0, max_tokens=20),
              dict(prompt=prompts[1], stop_token_ids=[61, 62, 63], top_k=3, max_tokens=16),
              dict(prompt=[7] * 20, temperature=0, max_tokens=10)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # rows of every bucket
      answers = list(pool.map(lambda b: _complete(server.root, **b), bodies * 2))
    assert all(a["choices"] for a in answers)
    stream = httpx.post(server.root + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompts[1], "stream": True, "max_tokens": 8,
        "logprobs": 2, "top_p": 0.9, "stop_token_ids": [5, 6]})
    assert stream.status_code == 200 and "[DONE]" in stream.text
    assert num_compiled() == steps
    assert sum(xla_compile_counts()) == xla  # no program compiled, none loaded either
  assert _complete_fails_after_stop(server.root)


def _complete_fails_after_stop(root: str) -> bool:
  try:
    httpx.get(root + "/health", timeout=5)
  except httpx.HTTPError:
    return True
  return False
