"""Prompt logprobs (vLLM's prompt_logprobs): each prompt position's log p and likeliest ids
equal a float64 log-softmax of kvjax.forward's logits (the dense, cache-free forward) on the
same ids, for prompts spanning several prefill chunks, beside batch mates, for a prompt whose
prefix is cached (it takes no hit, so every position is scored), and with MTP drafts."""
from __future__ import annotations

import numpy as np
import pytest

import kvjax
from tests import engine_helpers as h

NUM_TOP = 4


def _oracle(prompt):
  """float64 log p [len(prompt), V]: row i is the distribution of the id after prompt[i]."""
  logits = np.asarray(kvjax.forward(h.mtp_model(), [prompt]), np.float64)[0]
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _check(prompt, scores, num_top):
  want = _oracle(prompt)
  assert len(scores) == len(prompt) and scores[0] is None
  got = np.array([s.logprob for s in scores[1:]])
  np.testing.assert_allclose(got, want[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
  for i, s in enumerate(scores[1:]):
    top = np.argsort(-want[i])[:num_top]
    assert [t for t, _ in s.top] == top.tolist(), i
    np.testing.assert_allclose([lp for _, lp in s.top], want[i, top], atol=2e-4)


def _run(eng, requests):
  """requests: [(prompt, options)] -> per request (its first output, its final output)."""
  ids = [eng.add_request(p, 2, **kw) for p, kw in requests]
  first, final = {}, {}
  for out in eng.stream():
    first.setdefault(out.request_id, out)
    if out.finished:
      final[out.request_id] = out
  return [(first[i], final[i]) for i in ids]


@pytest.mark.parametrize("options", [dict(), dict(speculative="mtp", num_draft=2)],
                         ids=["plain", "mtp"])
def test_prompt_logprobs_equal_a_float64_forward(options):
  eng = h.engine(**options)  # 16-token chunks
  long, mate, other = h.prompts(3, seed=5, shared=40, lengths=(44, 46))
  mate = h.prompts(1, seed=6)[0]
  # Three chunks each, beside a plain batch mate and a second scored request.
  (a, _), (m, _), (b, _) = _run(eng, [(long, dict(prompt_logprobs=NUM_TOP)),
                                      (mate, dict(logprobs=2)),
                                      (other, dict(prompt_logprobs=1))])
  _check(long, a.prompt_logprobs, NUM_TOP)
  _check(other, b.prompt_logprobs, 1)
  assert m.prompt_logprobs is None and m.new_logprobs is not None
  # `long` is cached now: a plain request takes its 32-token hit, a scored one recomputes.
  scored_prompt = long[:36] + [9]
  (hit, hit_final), (scored, scored_final) = _run(
      eng, [(long[:40] + [7, 8], {}), (scored_prompt, dict(prompt_logprobs=0))])
  assert hit_final.metrics.prefix_hit_tokens == 32
  assert scored_final.metrics.prefix_hit_tokens == 0
  _check(scored_prompt, scored.prompt_logprobs, 0)
  assert hit.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption():
  eng = h.engine(num_pages=h.TINY_POOL)  # 3 usable pages: the later request is preempted
  first, second = h.prompts(2, seed=9, lengths=(20, 24))
  outs = _run(eng, [(first, dict(prompt_logprobs=2)), (second, dict(prompt_logprobs=2))])
  assert any(final.metrics.num_preemptions for _, final in outs)
  for prompt, (out, _) in zip([first, second], outs):
    _check(prompt, out.prompt_logprobs, 2)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.5])
def test_bad_prompt_logprobs_are_refused_by_name(bad):
  with pytest.raises(ValueError, match="prompt_logprobs"):
    h.engine().add_request([3, 4, 5], 2, prompt_logprobs=bad)
