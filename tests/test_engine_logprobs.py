"""Engine logprobs: every emitted id's log-probability and its likeliest alternatives equal
a float64 log-softmax of kvjax.forward's logits (the dense, cache-free forward) at the
position that emitted it, on single steps, multi-step bursts and MTP verify steps."""
from __future__ import annotations

import numpy as np
import pytest

import kvjax
from tests import engine_helpers as h

PROMPTS = h.prompts(3, seed=17)
NUM_TOP = 3


def _oracle(model, prompt, output):
  """float64 log p [len(output), V] of each output position, from one full forward."""
  logits = np.asarray(kvjax.forward(model, [prompt + output]), np.float64)[0]
  rows = logits[len(prompt) - 1:len(prompt) + len(output) - 1]
  top = rows.max(-1, keepdims=True)
  return rows - top - np.log(np.exp(rows - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("options", [dict(num_scheduler_steps=1), dict(num_scheduler_steps=4),
                                     dict(speculative="mtp", num_draft=2)],
                         ids=["single_step", "burst", "mtp"])
def test_logprobs_equal_a_float64_forward(options):
  model = h.mtp_model()
  eng = h.engine(**options)
  sampling = [dict(), dict(temperature=0.8, seed=3), dict(temperature=1.2, top_k=20, seed=4)]
  ids = [eng.add_request(p, h.MAX_NEW, logprobs=NUM_TOP, **kw) for p, kw in zip(PROMPTS, sampling)]
  plain = eng.add_request(PROMPTS[0], h.MAX_NEW)
  streamed = {rid: [] for rid in ids}
  finals = {}
  for out in eng.stream():
    if out.request_id == plain:
      assert out.new_logprobs is None
      continue
    assert len(out.new_logprobs) == len(out.new_token_ids)
    streamed[out.request_id] += out.new_logprobs
    if out.finished:
      finals[out.request_id] = out
  for rid, prompt in zip(ids, PROMPTS):
    output = finals[rid].output_ids
    want = _oracle(model, prompt, output)
    got = streamed[rid]
    assert len(got) == len(output) == h.MAX_NEW
    np.testing.assert_allclose([g.logprob for g in got],
                               want[np.arange(len(output)), output], atol=2e-4)
    for k, g in enumerate(got):
      top = np.argsort(-want[k])[:NUM_TOP]
      assert [i for i, _ in g.top] == top.tolist(), (rid, k)
      np.testing.assert_allclose([lp for _, lp in g.top], want[k, top], atol=2e-4)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_bad_logprobs_are_refused_by_name(bad):
  with pytest.raises(ValueError, match="logprobs"):
    h.engine().add_request(PROMPTS[0], 2, logprobs=bad)
