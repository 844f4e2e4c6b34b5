"""Draft policies (issue 17): the adaptive choice maximizes expected tokens per second
(checked against hand-computed rates), and whatever number of drafts each step picks,
greedy speculative output equals plain greedy and sampled output keeps the target
distribution; a step after a plain one never verifies stale drafts."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import kvjax
from kvjax.engine.sched.draft_policy import AdaptiveDrafts, FixedDrafts, expected_tokens, policy_from
from tests import engine_helpers as h


@dataclasses.dataclass
class Cycle:
  """A policy that ignores measurements: k = ks[0], ks[1], ... per decode step, and
  prefill[0], prefill[1], ... per step with prefill rows."""

  ks: tuple
  prefill: tuple = (2,)
  calls: int = 0
  prefill_calls: list = dataclasses.field(default_factory=list)

  def choose(self, bucket, requests, most=None):
    self.calls += 1
    return self.ks[(self.calls - 1) % len(self.ks)]

  def prefill_drafts(self, bucket):
    self.prefill_calls.append(self.prefill[len(self.prefill_calls) % len(self.prefill)])
    return self.prefill_calls[-1]

  def observe_step(self, bucket, k, seconds, num_steps):
    pass

  def observe_verify(self, num_draft, num_accepted):
    pass

  def estimates(self):
    return {"policy": "cycle", "ks": self.ks}


def _measured(policy, bucket, seconds_by_k, calls=4):
  for k, seconds in seconds_by_k.items():
    for _ in range(calls):  # the first call of each (bucket, k) is the compile
      policy.observe_step(bucket, k, seconds, 1)


# Step ms for k = 0, 1, 2 drafts: C9's CPU cost (3.4x at k = 2), a cheap verify, and one
# whose second draft costs more than it brings.
@pytest.mark.parametrize("step_ms,want", [((1, 2.2, 3.4), 0), ((1, 1.1, 1.2), 2),
                                          ((1, 1.2, 2.0), 1)])
def test_adaptive_picks_the_best_tokens_per_second(step_ms, want):
  # Acceptance 0.9 at position 1 and 0.8 through position 2 (the prior is outweighed).
  policy = AdaptiveDrafts(2, prior_weight=1e-9, candidates=(0, 1, 2))
  for _ in range(1000):
    policy.observe_verify(2, 2)
  for _ in range(125):
    policy.observe_verify(2, 0)
  for _ in range(125):
    policy.observe_verify(2, 1)
  through = policy.accept_through()
  np.testing.assert_allclose(through, [1125 / 1250, 1000 / 1250])
  seconds = {k: 1e-3 * ms for k, ms in enumerate(step_ms)}
  _measured(policy, 8, seconds)
  rates = {k: 8 * (1 + sum(through[:k])) / seconds[k] for k in range(3)}
  assert want == max(rates, key=rates.get)
  assert policy.choose(8, [None] * 8) == want
  assert policy.last_choice["reason"] == "best"


def test_adaptive_measures_every_choice_first_and_explores_later():
  policy = AdaptiveDrafts(2, warmup=2, explore_every=5, candidates=(0, 1, 2))
  seen = [policy.choose(4, []) for _ in range(3)]
  assert seen == [0, 0, 0]  # nothing measured yet: k = 0 first
  _measured(policy, 4, {0: 1e-3}, calls=3)
  assert policy.choose(4, []) == 1
  _measured(policy, 4, {1: 5e-3, 2: 9e-3}, calls=3)
  choices = [policy.choose(4, []) for _ in range(10)]
  assert choices.count(0) >= 8 and any(k != 0 for k in choices)  # mostly best, some explore


def test_step_cost_weighs_each_burst_by_its_steps():
  """A short burst pays the host's per-call overhead over few steps; it must not count
  as much as a full one (a mean of per-step times would be 3 ms here)."""
  policy = AdaptiveDrafts(2, warmup=1)
  policy.observe_step(1, 0, 1.0, 16)  # the first call: not counted
  policy.observe_step(1, 0, 16e-3, 16)
  policy.observe_step(1, 0, 5e-3, 1)
  assert policy._estimate(1, 0) == pytest.approx(1e-3)


def test_one_stalled_burst_does_not_move_the_cost_but_a_lasting_change_does():
  policy = AdaptiveDrafts(2, warmup=1, window=8)
  policy.observe_step(1, 0, 0.0, 16)  # the first call: not counted
  for _ in range(4):
    policy.observe_step(1, 0, 16 * 0.25e-3, 16)
  policy.observe_step(1, 0, 16 * 1.2e-3, 16)  # a stall (a mean of the 5 would be 0.44 ms)
  assert policy._estimate(1, 0) == pytest.approx(0.25e-3)
  for _ in range(3):
    policy.observe_step(1, 0, 16 * 1e-3, 16)
  assert policy._estimate(1, 0) == pytest.approx(0.25e-3)  # 4 slow of 8: half, not more
  policy.observe_step(1, 0, 16 * 1e-3, 16)
  assert policy._estimate(1, 0) == pytest.approx(1e-3)  # 5 of the last 8
  for _ in range(8):
    policy.observe_step(1, 0, 16 * 2e-3, 16)
  assert policy._estimate(1, 0) == pytest.approx(2e-3)  # older reports left the window


def test_explorations_back_off_while_the_choice_holds():
  policy = AdaptiveDrafts(2, warmup=1, explore_every=4, prior_weight=1e-9)
  for _ in range(100):
    policy.observe_verify(2, 0)  # nothing accepted: plain decoding wins
  _measured(policy, 1, {0: 1e-3, 2: 3e-3})
  explored = [i for i in range(1, 200) if policy.choose(1, [None]) != 0]
  # Gaps of 4, 8, 16, ... decisions, capped at 16 x 4.
  assert explored == [4, 12, 28, 60, 124, 188]


def test_a_new_bucket_measures_one_k_and_borrows_the_cost_ratios():
  policy = AdaptiveDrafts(2, warmup=1, prior_weight=1e-9, candidates=(0, 1, 2))
  for _ in range(100):
    policy.observe_verify(2, 2)  # every draft accepted: A = [1, 1]
  _measured(policy, 8, {0: 1e-3, 1: 1.5e-3, 2: 2e-3})  # k = 2 best: 3 tokens for 2x
  first = policy.choose(16, [None] * 16)
  assert first == 2 and policy.last_choice["reason"] == "measuring"
  _measured(policy, 16, {2: 6e-3})
  # t(16, 0) and t(16, 1) from bucket 8's ratios 1.5 and 2: 3 ms and 4.5 ms.
  assert policy._estimate(16, 0) == pytest.approx(3e-3)
  assert policy._estimate(16, 1) == pytest.approx(4.5e-3)
  assert policy.choose(16, [None] * 16) == 2 and policy.last_choice["reason"] == "best"
  assert (16, 0) not in policy._count and (16, 1) not in policy._count  # never compiled


def test_default_candidates_and_the_switch_margin():
  policy = AdaptiveDrafts(3, prior_weight=1e-9)
  assert policy.candidates == (0, 3)  # plain or the most drafts: two program families
  for _ in range(100):
    policy.observe_verify(3, 0)  # nothing accepted: A ~ 0
  _measured(policy, 8, {0: 1e-3, 3: 1.02e-3})
  assert policy.choose(8, [None]) == 0  # the fastest per token, once measured
  # A draft count that wins by less than the margin does not displace the current one.
  for _ in range(100):
    policy.observe_verify(3, 3)
  sticky = AdaptiveDrafts(3, prior_weight=1e-9, switch_margin=10.0)
  sticky._accepted, sticky._proposed = policy._accepted, policy._proposed
  sticky._current[8] = 0
  _measured(sticky, 8, {0: 1e-3, 3: 1.02e-3})
  assert policy.choose(8, [None]) == 3 and sticky.choose(8, [None]) == 0
  # Drafting must beat plain decoding by the margin, whatever k a bucket ran before.
  for current in (0, 3):
    near_tie = AdaptiveDrafts(3, prior_weight=1e-9)
    near_tie._accepted, near_tie._proposed = policy._accepted, policy._proposed
    near_tie._current[8] = current
    _measured(near_tie, 8, {0: 1e-3, 3: 3.9e-3})  # 4 tokens in 3.9 steps' time: +2.6%
    assert near_tie.choose(8, [None]) == 0
  with pytest.raises(ValueError, match="including 0"):
    AdaptiveDrafts(2, candidates=(1, 2))


def test_prefill_first_caps_k_where_drafts_would_displace_prefill():
  policy = AdaptiveDrafts(2, candidates=(0, 1, 2), prior_weight=1e-9)
  for _ in range(100):
    policy.observe_verify(2, 2)  # every draft accepted: 2 drafts win
  _measured(policy, 8, {0: 1e-3, 1: 1.1e-3, 2: 1.2e-3})
  assert policy.choose(8, [None]) == 2 and policy.choose(8, [None], most=None) == 2
  assert policy.choose(8, [None], most=1) == 1
  assert policy.choose(8, [None], most=0) == 0
  assert policy.last_choice["reason"] == "prefill first"
  two = AdaptiveDrafts(2, prior_weight=1e-9)  # candidates 0 and 2: a cap of 1 means 0
  two._accepted, two._proposed = policy._accepted, policy._proposed
  _measured(two, 8, {0: 1e-3, 2: 1.2e-3})
  assert two.choose(8, [None], most=1) == 0 and two.choose(8, [None], most=2) == 2


@dataclasses.dataclass
class Spy(Cycle):
  """Cycle that records the cap the engine offers each decision."""

  offered: list = dataclasses.field(default_factory=list)

  def choose(self, bucket, requests, most=None):
    self.offered.append((len(requests), most))
    return super().choose(bucket, requests, most)


def test_the_engine_offers_the_drafts_that_leave_room_for_prefill():
  # Budget 16: one request decodes while a 24-token prompt waits for the free slot, so
  # no draft fits beside it (cap 0); once it runs, what is left of it sets the cap.
  spy = Spy((2,))
  eng = h.engine(speculative="mtp", num_draft=2, draft_policy=spy, num_scheduler_steps=1)
  first, second = h.prompts(2, seed=7, lengths=(10, 10))[0], h.prompts(1, seed=8,
                                                                      lengths=(24, 24))[0]
  eng.add_request(first, h.MAX_NEW)
  eng.step()  # prefill
  eng.add_request(second, h.MAX_NEW)
  eng.step()
  assert spy.offered[0] == (1, 0)  # 24 waiting tokens > 16 - 1: nothing beside them
  finals = h.run_to_end(eng)
  assert (2, None) in spy.offered  # both decoding, nothing waits: no cap
  assert [finals[r].output_ids for r in sorted(finals)] == [
      h.reference(first), h.reference(second)]


def test_a_requests_own_acceptance_shrinks_toward_the_engine_rate():
  policy = AdaptiveDrafts(2, prior_weight=4.0)
  for _ in range(100):
    policy.observe_verify(2, 2)
  metrics = kvjax.engine.metrics.RequestMetrics("r", 5, 0.0)
  for _ in range(4):
    metrics.record_verify(2, 0, 2)
  overall = policy.accept_through()
  got = policy.accept_through(metrics)
  np.testing.assert_allclose(got, [(0 + 4 * g) / (4 + 4) for g in overall])
  assert expected_tokens(got, 2) == pytest.approx(1 + sum(got))


def test_policy_specs():
  assert isinstance(policy_from(None, 3), FixedDrafts)
  assert isinstance(policy_from("adaptive", 3), AdaptiveDrafts)
  with pytest.raises(ValueError, match="draft_policy must be"):
    policy_from("fast", 3)
  with pytest.raises(ValueError, match="needs speculative"):
    h.engine(draft_policy="adaptive")
  with pytest.raises(ValueError, match="num_draft must be an int or 'auto'"):
    h.engine(speculative="mtp", num_draft="two")
  eng = h.engine(speculative="mtp", num_draft="auto")
  assert eng.num_draft == 2 and isinstance(eng.draft_policy, AdaptiveDrafts)


@pytest.mark.parametrize("steps", [1, 4], ids=["single_step", "burst"])
def test_changing_the_draft_count_every_step_keeps_greedy_exact(steps):
  batch = h.prompts(5, seed=3, shared=20) + h.prompts(2, seed=4, lengths=(12, 15))
  # Prefill chunks draft 0, 2 or 1 in turn: a request may decode with drafts after a
  # prompt the MTP modules never saw (their K/V there is stale: fewer accepted, same ids).
  policy = Cycle((2, 0, 1, 1, 0), prefill=(0, 2, 1))
  eng = h.engine(speculative="mtp", num_draft=2, draft_policy=policy,
                 num_scheduler_steps=steps, num_pages=h.TINY_POOL)
  finals = h.run_staggered_finals(eng, batch)
  assert [out.output_ids for out in finals] == [h.reference(p) for p in batch]
  assert set(eng.steps.num_draft) == {0, 1, 2} and set(policy.prefill_calls) == {0, 1, 2}
  h.assert_no_pages_held(eng)


def test_prefill_rows_draft_what_their_decode_group_runs(monkeypatch):
  policy = AdaptiveDrafts(2)
  eng = h.engine(speculative="mtp", num_draft=2, draft_policy=policy, num_scheduler_steps=1)
  bucket = eng.packing.decode_rows_bucket(1)
  assert policy.prefill_drafts(bucket) == 2  # nothing chosen yet: the most, to measure
  launched = []
  run = eng._run
  monkeypatch.setattr(eng, "_run", lambda batch, num_draft, *a: launched.append(
      (int(batch.q_lens.max()), num_draft)) or run(batch, num_draft, *a))
  prompt = h.prompts(1, seed=9, lengths=(12, 12))[0]
  eng.generate([prompt], 3)
  assert launched[0] == (12, 2)  # the prompt's chunk, then decode steps
  _measured(policy, bucket, {0: 1e-3, 2: 9e-3})  # a verify step costs 9 decode steps
  assert policy.choose(bucket, [None]) == 0 and policy.prefill_drafts(bucket) == 0
  launched.clear()
  assert eng.generate([prompt], 3).tokens == [h.reference(prompt, 3)]
  assert launched[0] == (12, 0)  # a group decoding plainly: its prompt drafts nothing


def test_prefill_rows_of_an_unchosen_group_size_draft_what_the_nearest_chosen_one_runs():
  # A batch filling up admits its prompts while running 1, 2, 4, ... requests: group sizes
  # that never decode, so never choose; their prompts draft what the nearest size runs.
  policy = AdaptiveDrafts(2)
  assert [policy.prefill_drafts(b) for b in (1, 8, 32)] == [2, 2, 2]  # none chosen: measure
  _measured(policy, 32, {0: 1e-3, 2: 9e-3})
  assert policy.choose(32, [None] * 32) == 0
  assert [policy.prefill_drafts(b) for b in (1, 4, 16, 32)] == [0, 0, 0, 0]
  _measured(policy, 2, {0: 1e-3, 2: 1.1e-3})  # a cheap verify at 2 rows
  assert policy.choose(2, [None] * 2) == 2
  assert [policy.prefill_drafts(b) for b in (1, 2, 4, 16, 32)] == [2, 2, 2, 0, 0]


def test_a_step_after_a_plain_step_verifies_no_stale_drafts():
  # Cycle (2, 0): a prefill that drafts 2 is verified by the next decode step; afterwards
  # every k = 2 step follows a plain one, so it may only draft.  At most one verify step
  # per request (none if its prefill ran in a k = 0 step).
  eng = h.engine(speculative="mtp", num_draft=2, draft_policy=Cycle((2, 0)),
                 num_scheduler_steps=1)
  ids = [eng.add_request(p, h.MAX_NEW, temperature=1.0, seed=i)
         for i, p in enumerate(h.prompts(2, seed=5))]
  finals = h.run_to_end(eng)
  verify_steps = [finals[r].metrics.verify_steps for r in ids]
  assert max(verify_steps) == 1 and len(finals[ids[0]].output_ids) == h.MAX_NEW


def test_sampling_keeps_the_target_distribution_whatever_k_each_step_picks():
  # As tests/test_speculative.py: the first two tokens at temperature 1, exact marginals
  # from full forwards; here the first verify step of each request runs with k = 0, 1 or 2
  # depending on where the cycle stands when it arrives.
  model = h.mtp_model()
  prompt = [17, 4, 250, 61, 9]
  n, vocab = 900, model.config.vocab_size
  eng = h.engine(speculative="mtp", num_draft=2, draft_policy=Cycle((2, 0, 1)),
                 prefix_cache=False, num_pages=h.TINY_POOL)
  ids = [eng.add_request(prompt, 4, temperature=1.0, seed=s) for s in range(n)]
  finals = h.run_to_end(eng)
  first = np.array([finals[rid].output_ids[:2] for rid in ids])  # [n, 2]
  p0 = np.asarray(jax.nn.softmax(kvjax.forward(model, [prompt])[0, -1]), np.float64)
  extended = np.concatenate([np.tile(prompt, (vocab, 1)), np.arange(vocab)[:, None]], 1)
  p1 = p0 @ np.asarray(jax.nn.softmax(kvjax.forward(model, extended)[:, -1]), np.float64)
  for k, probs in enumerate((p0, p1)):
    counts = np.bincount(first[:, k], minlength=vocab)
    bound = 6 * np.sqrt(n * probs * (1 - probs)) + 5
    assert np.all(np.abs(counts - n * probs) <= bound), k
  assert set(eng.steps.num_draft) == {0, 1, 2}
