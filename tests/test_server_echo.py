"""Scoring text over HTTP: /v1/completions with echo, logprobs and max_tokens 0 or 1 (what
lm-evaluation-harness's local-completions sends), and vLLM's prompt_logprobs.

Oracle: a float64 log-softmax of kvjax.forward's logits (the dense, cache-free forward) over
the prompt ids; lm-eval's own reading of the answer (`parse_logprobs`: the sum of
token_logprobs[ctxlen:-1], greedy if each equals its top_logprobs' best) is restated here,
as is how it builds experiments/lm_eval_run's requests (checked against kvjax/eval/choice.py
through an Engine: tests/test_eval_choice.py checks that against the float64 forward)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import yaml

import kvjax
from experiments import lm_eval_run
from kvjax.eval import choice as eval_choice
from kvjax.server import serve_in_thread
from tests.server_helpers import CONFIG, NAME, PROMPTS, ids_of, sse_events

# Over 64 tokens (two of the server's prefill chunks) within max_model_len 128.
LONG = "".join(PROMPTS[:4])


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint()


@pytest.fixture(scope="module")
def tok(model):
  return model.tokenizer


@pytest.fixture(scope="module")
def server(model):
  with serve_in_thread(model, CONFIG, served_model_name=NAME, max_waiting=16) as handle:
    yield handle


def _log_p(model, ids):
  """float64 log p [len(ids), V]: row i is the distribution of the id after ids[i]."""
  logits = np.asarray(kvjax.forward(model, [ids]), np.float64)[0]
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _post(server, **body):
  answer = httpx.post(f"{server.url}/completions", json={"model": NAME, **body}, timeout=120)
  assert answer.status_code == 200, answer.text
  return answer.json()


def _lm_eval_reading(choice, ctxlen):
  """lm_eval/models/openai_completions.py parse_logprobs, for one choice."""
  token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
  top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
  return sum(token_logprobs), all(t == max(d.values()) for t, d in zip(token_logprobs, top))


def test_echo_logprobs_score_the_prompt_as_lm_eval_reads_them(model, tok, server):
  long, short = ids_of(tok, LONG), ids_of(tok, PROMPTS[2])
  assert 64 < len(long) < 120
  answer = _post(server, prompt=[long, short], echo=True, logprobs=1, max_tokens=1,
                 temperature=0)
  for choice, ids in zip(sorted(answer["choices"], key=lambda c: c["index"]), [long, short]):
    log_p = _log_p(model, ids)
    lp = choice["logprobs"]
    generated = kvjax.generate(model, [ids], 1).tokens[0][0]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:],
                               log_p[np.arange(len(ids)), ids[1:] + [generated]], atol=2e-4)
    best = log_p.argmax(-1)
    assert [list(d) for d in lp["top_logprobs"][1:]] == [
        [tok.decode([int(b)], skip_special_tokens=False)] for b in best]
    np.testing.assert_allclose([v for d in lp["top_logprobs"][1:] for v in d.values()],
                               log_p[np.arange(len(ids)), best], atol=2e-4)
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids + [generated]]
    assert lp["tokens"] == texts
    assert lp["text_offset"] == np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist()
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True) + tok.decode(
        [generated], skip_special_tokens=True)
    # A continuation's loglikelihood, as lm-eval computes it, for a context of ctxlen ids.
    ctxlen = len(ids) - 5
    total, greedy = _lm_eval_reading(choice, ctxlen)
    want = log_p[np.arange(ctxlen - 1, len(ids) - 1), ids[ctxlen:]]
    assert abs(total - want.sum()) < 1e-3
    assert greedy == bool(np.all(best[ctxlen - 1:len(ids) - 1] == ids[ctxlen:]))


def _lm_eval_pairs(tok, question):
  """lm-eval 0.4.13's (context ids, continuation ids) per choice of `question` in
  experiments/lm_eval_run's choice task: api/task.py joins target_delimiter (default " ")
  and the choice, api/model.py _encode_pair moves the context's trailing spaces and splits
  the whole encoding, api_models.py tok_encode adds special tokens only with
  add_bos_token."""
  task = yaml.safe_load(lm_eval_run.TASKS.format(data=eval_choice.TINY_TASK))
  delimiter = task.get("target_delimiter", " ")
  special = "add_bos_token=True" in lm_eval_run.model_args(NAME, "http://x", "dir")
  pairs = []
  for text in question["choices"]:
    context, continuation = question["context"], delimiter + text
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=special)
    num_context = len(tok.encode(context, add_special_tokens=special))
    pairs.append((whole[:num_context], whole[num_context:]))
  return pairs


def test_lm_eval_run_scores_as_kvjax_eval_choice_does(model, tok, server):
  """lm-eval's requests (a question's choices batched in one, as with batch_size > 1) and
  its reading of the answer equal the offline prompt logprobs of kvjax/eval/choice.py."""
  engine = kvjax.Engine(model, max_model_len=128)
  for question in eval_choice.load_questions(limit=2):
    pairs = _lm_eval_pairs(tok, question)
    offline = [eval_choice.encode_pair(tok, question["context"], c)
               for c in question["choices"]]
    assert [(ctx + cont, len(ctx)) for ctx, cont in pairs] == offline
    answer = _post(server, prompt=[ctx + cont for ctx, cont in pairs], temperature=0,
                   max_tokens=1, logprobs=1, seed=1234, echo=True)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    served = [_lm_eval_reading(c, len(ctx))[0] for c, (ctx, _) in zip(choices, pairs)]
    np.testing.assert_allclose(served, eval_choice.loglikelihoods(engine, offline),
                               atol=1e-3)


def test_max_tokens_0_returns_the_prompt_alone(model, tok, server):
  ids = ids_of(tok, PROMPTS[0])
  answer = _post(server, prompt=PROMPTS[0], echo=True, logprobs=2, max_tokens=0)
  choice = answer["choices"][0]
  assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 0
  assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
  log_p = _log_p(model, ids)
  np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:],
                             log_p[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)
  assert [len(d) for d in choice["logprobs"]["top_logprobs"][1:]] == [2] * (len(ids) - 1)
  # Streamed: the same text and logprobs, the echo in the first chunk.
  chunks = httpx.post(f"{server.url}/completions", timeout=120, json={
      "model": NAME, "prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 0,
      "stream": True}).text.splitlines()
  events = [e for e in sse_events(chunks) if e != "[DONE]"]
  assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
  assert sum((e["choices"][0]["logprobs"]["token_logprobs"] for e in events), []) == \
      choice["logprobs"]["token_logprobs"]


def test_vllm_prompt_logprobs_field(model, tok, server):
  ids = ids_of(tok, LONG)
  answer = _post(server, prompt=ids, prompt_logprobs=3, max_tokens=2, temperature=0)
  choice = answer["choices"][0]
  plain = _post(server, prompt=ids, max_tokens=2, temperature=0)["choices"][0]
  assert choice["text"] == plain["text"] and "prompt_logprobs" not in plain
  entries = choice["prompt_logprobs"]
  assert len(entries) == len(ids) and entries[0] is None
  log_p = _log_p(model, ids)
  for position, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
    top = np.argsort(-log_p[position])[:3].tolist()
    assert list(entry)[0] == str(token)
    assert set(entry) == {str(i) for i in [token] + top}
    for rank, i in enumerate(top, 1):
      assert entry[str(i)]["rank"] == rank
      assert abs(entry[str(i)]["logprob"] - log_p[position, i]) < 2e-4
    assert abs(entry[str(token)]["logprob"] - log_p[position, token]) < 2e-4


@pytest.mark.parametrize("field, body, path", [
    ("max_tokens", {"prompt": "x", "max_tokens": 0}, "completions"),
    ("prompt_logprobs", {"prompt": "x", "prompt_logprobs": 21}, "completions"),
    ("echo", {"prompt": "x", "echo": "yes"}, "completions"),
    ("echo", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
     "chat/completions"),
])
def test_bad_scoring_fields_are_400_by_name(server, field, body, path):
  answer = httpx.post(f"{server.url}/{path}", json={"model": NAME, **body}, timeout=30)
  assert answer.status_code == 400, answer.text
  assert answer.json()["error"]["param"] == field
