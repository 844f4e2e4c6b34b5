"""Scheduler: budgets, chunked prefill, prefix hits, preemption, speculation, windows.

The oracle is a fake device that stores token ids in place of K/V: it writes
every fed id at (block_table[pos // G], pos % G), applies page copies, and
reads the context back through the block table before "sampling" (with a
sliding window W, only the keys the row's first query sees: positions
>= start - W + 1).  A wrong block table, a reused cached page, a bad rollback
or a page released while still in the window shows up as a read-back
mismatch, and outputs must equal each request generated alone.
"""
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from kvjax.engine.requests import PageCopy, RequestStatus
from kvjax.engine.sched.batching import bucket, bucket_sizes
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.engine.sched.scheduler import Scheduler

VOCAB = 50


def next_token(seq):
  """A deterministic 'model': the next id is a function of the context."""
  return hash((tuple(seq[-3:]), len(seq))) % (VOCAB - 2) + 2


def generate_alone(prompt, max_new, stops=()):
  seq = list(prompt)
  for _ in range(max_new):
    seq.append(next_token(seq))
    if seq[-1] in stops:
      break
  return seq[len(prompt):]


class FakeDevice:
  """Token ids as KV; drafts are right unless `wrong_draft(position)`."""

  def __init__(self, sched, wrong_draft=lambda pos: pos % 3 == 0):
    self.sched = sched
    self.kv = np.full((sched.allocator.num_pages, sched.page_size), -1)
    self.wrong_draft = wrong_draft

  def _write(self, table, pos, token):
    g = self.sched.page_size
    self.kv[table[pos // g], pos % g] = token

  def _read(self, table, lo, n):
    g = self.sched.page_size
    return [int(self.kv[table[p // g], p % g]) for p in range(lo, n)]

  def _forward(self, table, start, known, ctx, num_draft):
    """Write known ids + drafts from `start`, check the context reads back -> sampled ids."""
    drafts = []
    for j in range(num_draft):
      guess = next_token(ctx + drafts)
      drafts.append(guess + 1 if self.wrong_draft(len(ctx) + j) else guess)
    for j, t in enumerate(known + drafts):
      self._write(table, start + j, t)
    window = self.sched.sliding_window
    lo = 0 if window is None else max(0, start - window + 1)
    assert self._read(table, lo, len(ctx)) == ctx[lo:], "KV read-back mismatch"
    ids = []
    for d in drafts:
      if next_token(ctx + ids) != d:
        break
      ids.append(d)
    return ids + [next_token(ctx + ids)]

  def _burst(self, table, row):
    """A multi-step row: single steps on its reserved pages until it stops (as serve_burst)."""
    req, g = row.request, self.sched.page_size
    left = req.max_new_tokens - req.num_output_tokens
    emitted = []
    for _ in range(row.num_steps):
      start, ctx = row.start + len(emitted), req.token_ids + emitted
      num_draft = min(self.sched.num_lookahead_slots, left - len(emitted) - 1)
      reserved = table[start // g:(start + num_draft) // g + 1]
      assert NULL_PAGE not in reserved, "a burst wrote past its reserved pages"
      emitted += self._forward(table, start, ctx[-1:], ctx, num_draft)
      if len(emitted) >= left or set(emitted) & req.stop_token_ids:
        break
    return emitted

  def step(self):
    out = self.sched.schedule()
    assert len(out.rows) <= self.sched.max_num_seqs
    assert out.num_batched_tokens == sum(len(r.token_ids) + r.num_draft for r in out.rows)
    assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
    assert not {r.request_id for r in out.rows} & set(out.preempted_ids)
    assert {r.num_steps for r in out.rows} <= {out.num_steps}
    for copy in out.copies:
      self.kv[copy.dst] = self.kv[copy.src]
    new = {}
    for table, row in zip(out.block_tables, out.rows):
      req = row.request
      known = [int(t) for t in row.token_ids]
      assert known == req.token_ids[row.start:row.start + len(known)]
      if row.num_steps > 1:
        new[row.request_id] = self._burst(table, row)
        continue
      ctx = req.token_ids[:row.start + len(known)]
      ids = self._forward(table, row.start, known, ctx, row.num_draft)
      if row.sample:
        new[row.request_id] = ids
    finished = self.sched.update_from_output(out, new)
    self.sched.check_invariants()
    return out, finished

  def run(self, max_steps=10_000):
    outputs = {}
    for _ in range(max_steps):
      if not self.sched.has_unfinished:
        return outputs
      _, finished = self.step()
      outputs.update({r.request_id: r.output_ids for r in finished})
    raise AssertionError("scheduler made no progress")


def make(**kw):
  args = dict(num_pages=64, page_size=4, max_num_seqs=8,
              max_num_batched_tokens=64)
  args.update(kw)
  return Scheduler(**args)


def assert_no_leak(sched):
  sched.check_invariants()
  assert sched.allocator.num_used == 0
  assert sched.allocator.num_free == sched.allocator.num_usable


# -- validation ---------------------------------------------------------------

# name: (prompt, max_new_tokens, error fragment)
BAD_REQUESTS = {
    "empty_prompt": ([], 4, "empty prompt"),
    "negative_id": ([1, -2], 4, "negative token id"),
    "no_new_tokens": ([1, 2], 0, "max_new_tokens must be >= 1"),
    "longer_than_context": (list(range(30)), 5, "exceeds max_model_len 32"),
    "more_pages_than_pool": (list(range(20)), 10, "needs up to 8 KV pages"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_fail_alone(name):
  prompt, max_new, fragment = BAD_REQUESTS[name]
  sched = make(num_pages=8, max_model_len=32 if "context" in name else None)
  sched.add_request("ok", [5, 6, 7], 3)
  with pytest.raises(ValueError, match=fragment):
    sched.add_request("bad", prompt, max_new)
  with pytest.raises(ValueError, match="already in use"):
    sched.add_request("ok", [1], 1)
  assert list(sched.requests) == ["ok"]
  assert FakeDevice(sched).run() == {"ok": generate_alone([5, 6, 7], 3)}


# -- one step -----------------------------------------------------------------

def test_chunked_prefill_runs_to_completion():
  sched = make(max_num_batched_tokens=16)
  prompt = list(range(2, 42))  # 40 tokens
  sched.add_request("a", prompt, 3)
  dev = FakeDevice(sched)
  chunks = [dev.step()[0].rows[0] for _ in range(4)]
  assert [(r.start, r.num_tokens, r.sample, r.is_decode) for r in chunks] == [
      (0, 16, False, False), (16, 16, False, False), (32, 8, True, False),
      (40, 1, True, True)]
  assert dev.run() == {"a": generate_alone(prompt, 3)}
  assert_no_leak(sched)


def test_decodes_first_then_prefill_under_budget():
  sched = make(max_num_batched_tokens=8)
  dev = FakeDevice(sched)
  sched.add_request("d1", [2, 3], 5)
  sched.add_request("d2", [4, 5], 5)
  dev.step()  # both prefills
  sched.add_request("p", list(range(2, 22)), 2)
  out, _ = dev.step()
  assert [(r.request_id, r.num_tokens) for r in out.rows] == [
      ("d1", 1), ("d2", 1), ("p", 6)]
  assert out.num_batched_tokens == 8
  assert [r.request_id for r in out.decode_rows] == ["d1", "d2"]
  np.testing.assert_array_equal(out.seq_lens, [3, 3, 6])
  assert (out.block_tables[:, 2:] == NULL_PAGE).all()
  assert out.block_tables.shape == (3, sched.allocator.num_usable)


def test_a_step_verifying_fewer_drafts_leaves_their_budget_to_prefill():
  # A draft policy's k for this step: decode rows reserve 1 + k tokens, not 1 + the most.
  for k, chunk in ((2, 2), (1, 4), (0, 6)):
    sched = make(max_num_batched_tokens=8, num_lookahead_slots=2)
    dev = FakeDevice(sched)
    sched.add_request("d1", [2, 3], 5)
    sched.add_request("d2", [4, 5], 5)
    dev.step()
    sched.add_request("p", list(range(2, 22)), 2)
    out = sched.schedule(num_lookahead=k)
    assert [(r.request_id, r.num_tokens, r.num_draft) for r in out.rows] == [
        ("d1", 1 + k, k), ("d2", 1 + k, k), ("p", chunk, 0)]
    assert out.num_batched_tokens == 8
  with pytest.raises(ValueError, match="num_lookahead must be in 0..2, got 3"):
    sched.schedule(num_lookahead=3)


def test_max_num_seqs_and_fcfs():
  sched = make(max_num_seqs=2)
  for rid in "abc":
    sched.add_request(rid, [2, 3, 4], 4)
  out = sched.schedule()
  assert [r.request_id for r in out.rows] == ["a", "b"]
  assert [r.slot for r in out.rows] == [0, 1]
  assert [r.request_id for r in sched.waiting] == ["c"]
  sched.update_from_output(out, {"a": [1], "b": [1]})
  sched.abort("a")
  [row] = sched.schedule().rows[1:]
  assert (row.request_id, row.slot) == ("c", 0)  # lowest free slot reused


def test_head_of_line_blocks_later_requests():
  sched = make(num_pages=5, page_size=4)  # 4 usable pages
  sched.add_request("big", list(range(2, 14)), 2)  # 3 pages
  sched.schedule()
  sched.add_request("huge", list(range(2, 14)), 4)  # needs 3, 1 free
  sched.add_request("tiny", [2], 1)  # would fit, but FCFS
  assert [r.request_id for r in sched.schedule().rows] == ["big"]


def test_bucket_helpers():
  assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
  assert bucket(100, maximum=48) == 48 and bucket(1, minimum=8) == 8
  assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


# -- finishing ----------------------------------------------------------------

def test_stop_conditions():
  prompt = [7, 8, 9]
  expected = generate_alone(prompt, 6)
  eos = expected[2]
  sched = make(eos_token_id=eos)
  sched.add_request("eos", prompt, 6)
  sched.add_request("stop", prompt, 6, stop_token_ids=[expected[1]])
  sched.add_request("len", prompt, 2, cache_salt="x")
  dev = FakeDevice(sched)
  finished = {}
  while sched.has_unfinished:
    finished.update({r.request_id: r for r in dev.step()[1]})
  assert finished["eos"].output_ids == expected[:3]
  assert finished["eos"].status is RequestStatus.FINISHED_STOPPED
  assert finished["stop"].output_ids == expected[:2]
  assert finished["len"].status is RequestStatus.FINISHED_LENGTH
  assert finished["len"].output_ids == expected[:2]
  assert_no_leak(sched)


def test_abort_frees_every_page():
  sched = make(num_pages=16, max_num_batched_tokens=6)
  sched.add_request("run", list(range(2, 12)), 4)
  sched.add_request("wait", [2, 3], 4)
  out = sched.schedule()
  assert sched.allocator.num_used == 2
  assert sched.abort("run") and sched.abort("wait") and not sched.abort("x")
  assert sched.update_from_output(out, {}) == []  # aborted rows are ignored
  assert_no_leak(sched)


def test_update_validation_leaves_state_unchanged():
  sched = make(num_lookahead_slots=2)
  sched.add_request("a", [2, 3, 4], 5)
  out = sched.schedule()
  for bad in ({"a": []}, {"a": [1, 2]}, {"zzz": [1]}, {}):
    with pytest.raises(ValueError):
      sched.update_from_output(out, bad)
  assert sched.requests["a"].output_ids == []
  sched.check_invariants()


# -- prefix cache through the scheduler ----------------------------------------

PROMPT30 = list(range(2, 32))

# name: (page_size, prefix_match, second prompt, hit tokens, copies)
SCHEDULER_HITS = {
    "c8_page64_zero": (64, "block", PROMPT30, 0, 0),
    "c8_page16_one_block": (16, "block", PROMPT30, 16, 0),
    "token_mode_shared_30": (16, "token", PROMPT30 + [40, 41], 30, 1),
    "block_mode_shared_30": (16, "block", PROMPT30 + [40, 41], 16, 0),
}


@pytest.mark.parametrize("name", SCHEDULER_HITS)
def test_prefix_hits_through_the_scheduler(name):
  page_size, mode, second, hits, num_copies = SCHEDULER_HITS[name]
  sched = make(num_pages=32, page_size=page_size, prefix_match=mode)
  dev = FakeDevice(sched)
  sched.add_request("first", PROMPT30, 8)  # 38 tokens: 2 full blocks at G=16
  first = dev.run()["first"]
  sched.add_request("second", second, 4)
  out, _ = dev.step()
  [row] = out.rows
  assert row.start == row.request.num_cached_tokens == hits
  assert len(out.copies) == num_copies
  if num_copies:
    assert out.copies[0] == PageCopy(out.copies[0].src, row.request.pages[1], 14)
  assert dev.run()["second"] == generate_alone(second, 4)
  assert first == generate_alone(PROMPT30, 8)
  assert sched.prefix_cache.hit_tokens == hits
  assert_no_leak(sched)


def test_token_hit_falls_back_to_full_blocks_when_its_copy_cannot_be_pinned():
  # 3 usable pages, all cached after "a".  "b" needs all 3; pinning its token-mode
  # copy source (a's third block) would leave 2: it must still run, on its 2 full blocks.
  sched = make(num_pages=4, page_size=4, max_num_seqs=2, prefix_match="token")
  dev = FakeDevice(sched)
  a = list(range(2, 14))
  sched.add_request("a", a, 1)
  dev.run()
  b = a[:10] + [30]
  assert sched.prefix_cache.lookup(b).copy_tokens == 2
  sched.add_request("b", b, 2)
  assert dev.run(max_steps=20) == {"b": generate_alone(b, 2)}
  assert sched.requests == {} and sched.prefix_cache.hit_tokens == 8
  assert_no_leak(sched)


def test_differently_salted_requests_never_share_pages():
  sched = make(page_size=4, prefix_match="token")
  dev = FakeDevice(sched)
  prompt = list(range(2, 20))
  sched.add_request("a", prompt, 3, cache_salt="tenant-a")  # 5 full blocks
  dev.run()
  sched.add_request("b", prompt, 2, cache_salt="tenant-b")
  sched.add_request("a2", prompt, 2, cache_salt="tenant-a")
  out, _ = dev.step()
  rows = {r.request_id: r for r in out.rows}
  assert rows["b"].start == 0
  assert rows["a2"].start == 17  # 4 blocks + 1 copied token
  [copy] = out.copies
  assert copy.dst == rows["a2"].request.pages[4]
  assert not set(rows["a2"].request.pages[:4]) & set(rows["b"].request.pages)


# -- preemption and speculation -------------------------------------------------

def test_preemption_by_recompute_keeps_outputs():
  prompts = {f"r{i}": list(range(2 + i, 12 + i)) for i in range(3)}
  sched = make(num_pages=9, page_size=4, max_num_batched_tokens=32)
  for rid, prompt in prompts.items():
    sched.add_request(rid, prompt, 12)
  dev = FakeDevice(sched)
  out, _ = dev.step()
  assert [r.request_id for r in out.rows] == ["r0", "r1"]  # 3 pages each
  seen = set()
  while sched.has_unfinished:
    seen.update(dev.step()[0].preempted_ids)
  assert sched.num_preemptions >= 1 and "r0" not in seen
  outputs = {rid: generate_alone(p, 12) for rid, p in prompts.items()}
  sched2 = make(num_pages=9, page_size=4, max_num_batched_tokens=32)
  for rid, prompt in prompts.items():
    sched2.add_request(rid, prompt, 12)
  assert FakeDevice(sched2).run() == outputs
  assert_no_leak(sched)


def test_preempted_request_goes_to_the_front():
  sched = make(num_pages=7, page_size=4, max_num_batched_tokens=32)
  sched.add_request("old", list(range(2, 10)), 12)  # 2 pages, grows to 5
  sched.add_request("new", list(range(2, 10)), 12)
  sched.add_request("later", [2], 1)
  dev = FakeDevice(sched)
  preempted = []
  while not preempted:
    preempted = list(dev.step()[0].preempted_ids)
  assert preempted == ["new"]
  assert [r.request_id for r in sched.waiting][:1] == ["new"]
  assert sched.requests["new"].status is RequestStatus.PREEMPTED
  assert sched.requests["new"].num_preemptions == 1


def test_speculative_slots_are_reserved_and_rolled_back():
  sched = make(num_pages=16, page_size=4, num_lookahead_slots=2)
  dev = FakeDevice(sched, wrong_draft=lambda pos: True)  # reject every draft
  sched.add_request("a", [2, 3, 4, 5, 6, 7], 10)
  dev.step()  # prefill: positions 0..5, 2 pages; 7 tokens known
  out = sched.schedule()
  [row] = out.rows
  assert (row.start, row.num_tokens, row.num_draft) == (6, 3, 2)
  assert len(row.request.pages) == 3  # positions 6..8 cross into page 3
  sched.update_from_output(out, {"a": [9]})  # no draft accepted
  assert row.request.num_computed_tokens == 7
  assert len(row.request.pages) == 2  # position 7 is next: page 3 rolled back
  sched.check_invariants()


def test_speculative_outputs_match_and_respect_max_new_tokens():
  prompt = list(range(2, 9))
  for wrong in (lambda pos: False, lambda pos: pos % 2 == 0):
    sched = make(num_pages=16, page_size=4, num_lookahead_slots=3)
    sched.add_request("a", prompt, 7)
    dev = FakeDevice(sched, wrong_draft=wrong)
    rows = []
    while sched.has_unfinished:
      out, finished = dev.step()
      rows += out.decode_rows
    assert finished[0].output_ids == generate_alone(prompt, 7)
    # Never more draft slots than tokens left to generate.
    assert all(r.num_draft <= r.request.max_new_tokens - 1 for r in rows)
    assert_no_leak(sched)


# -- multi-step decode -----------------------------------------------------------

def test_burst_reserves_its_steps_and_returns_what_it_did_not_use():
  sched = make(num_pages=16, page_size=4, max_num_seqs=2, num_scheduler_steps=4)
  dev = FakeDevice(sched)
  sched.add_request("a", [2, 3, 4, 5, 6], 6, stop_token_ids=[])
  dev.step()  # prefill: 5 positions (2 pages), 1 token emitted
  out = sched.schedule()
  [row] = out.rows
  # Up to 4 steps of 1 position from 5: positions 5..8 reserved (3 pages).
  assert (out.num_steps, row.num_steps, row.start, row.num_tokens) == (4, 4, 5, 4)
  assert len(row.request.pages) == 3
  with pytest.raises(ValueError, match="needs 1..4 new ids"):
    sched.update_from_output(out, {"a": [7] * 5})
  sched.update_from_output(out, {"a": [7, 8]})  # as if it stopped after 2 steps
  assert row.request.num_computed_tokens == 7 and len(row.request.pages) == 2
  sched.check_invariants()
  # 3 tokens left: the next burst runs at most 3 steps; it writes positions 7..9.
  out = sched.schedule()
  assert (out.num_steps, out.rows[0].num_tokens) == (3, 3)
  sched.update_from_output(out, {"a": [9, 10, 11]})
  assert_no_leak(sched)


def test_no_burst_while_a_waiting_request_could_be_admitted():
  sched = make(num_pages=32, page_size=4, max_num_seqs=2, num_scheduler_steps=4)
  dev = FakeDevice(sched)
  sched.add_request("a", [2, 3, 4], 20)
  dev.step()
  assert dev.step()[0].num_steps == 4  # alone: a burst
  sched.add_request("b", [5, 6, 7], 20)
  out, _ = dev.step()  # a free slot: decode a, prefill b
  assert out.num_steps == 1 and len(out.rows) == 2
  out, _ = dev.step()  # both decoding
  assert out.num_steps == 4
  sched.add_request("c", [8, 9], 3)  # waits: both slots are taken, bursts go on
  out, _ = dev.step()
  assert out.num_steps > 1 and len(out.rows) == 2
  assert dev.run()["c"] == generate_alone([8, 9], 3)
  assert_no_leak(sched)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_bursts_give_the_outputs_of_single_steps(lookahead):
  prompts = {"a": [2, 3, 4, 5, 6], "b": [7, 8, 9], "c": [10, 11]}
  stop = generate_alone(prompts["b"], 12)[6]  # b stops mid-burst
  outputs = {}
  for steps in (1, 8):
    sched = make(num_pages=24, page_size=4, max_num_seqs=2, num_lookahead_slots=lookahead,
                 num_scheduler_steps=steps)
    for rid, prompt in prompts.items():
      sched.add_request(rid, prompt, 12, stop_token_ids=[stop] if rid == "b" else [])
    outputs[steps] = FakeDevice(sched).run()
    assert_no_leak(sched)
  assert outputs[1] == outputs[8]
  assert outputs[8]["b"] == generate_alone(prompts["b"], 12, stops=(stop,))
  assert outputs[8]["b"][-1] == stop


# -- random sequences -----------------------------------------------------------

BASE = list(range(2, 40))

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 24), st.integers(1, 6),
              st.integers(1, 8), st.sampled_from([None, "s"])),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    num_pages=st.integers(3, 24), page_size=st.sampled_from([2, 4]),
    max_num_seqs=st.integers(1, 4), budget=st.integers(1, 12),
    caching=st.booleans(), mode=st.sampled_from(["block", "token"]),
    lookahead=st.integers(0, 2), window=st.sampled_from([None, 3, 6]),
    steps=st.sampled_from([1, 2, 5]), ops=st.lists(op, min_size=10, max_size=60))
def test_random_sequences_keep_invariants_and_never_leak(
    num_pages, page_size, max_num_seqs, budget, caching, mode, lookahead, window,
    steps, ops):
  # The fake model reads the last 3 ids, so any window >= 3 keeps its outputs.
  sched = make(num_pages=num_pages, page_size=page_size,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
               enable_prefix_caching=caching, prefix_match=mode,
               num_lookahead_slots=lookahead, sliding_window=window,
               num_scheduler_steps=steps,
               max_model_len=48)  # windowed requests may outgrow the pool
  dev = FakeDevice(sched)
  added, aborted, outputs = {}, set(), {}
  for o in ops:
    if o[0] == "add":
      _, shared, tail, max_new, salt = o
      prompt = BASE[:shared] + [40 + len(added)] * tail
      rid = f"r{len(added)}"
      try:
        sched.add_request(rid, prompt, max_new, cache_salt=salt)
        added[rid] = (prompt, max_new)
      except ValueError:
        pass  # too big for this pool: rejected alone
    elif o[0] == "abort":
      if sched.abort(f"r{o[1]}"):
        aborted.add(f"r{o[1]}")
    else:
      _, finished = dev.step()
      outputs.update({r.request_id: r.output_ids for r in finished})
    sched.check_invariants()
  outputs.update(dev.run())
  assert_no_leak(sched)  # every page free, or cached with refcount 0
  for rid, (prompt, max_new) in added.items():
    if rid not in aborted:
      assert outputs[rid] == generate_alone(prompt, max_new), rid


# -- sliding windows ------------------------------------------------------------

def test_window_bounds_the_pages_a_request_holds():
  # W = 6, G = 4, chunks of <= 4: a row starting at s holds pages (s - 5) // 4
  # through (s + n - 1) // 4, at most ceil((W + n - 2) / G) + 1 = 3; the request
  # spans 13 pages, the pool has 4.
  sched = make(num_pages=5, page_size=4, max_num_batched_tokens=4,
               sliding_window=6, max_model_len=64)
  prompt = list(range(2, 12))
  sched.add_request("a", prompt, 40)
  assert sched.pages.max_pages_held(50) == 3
  held, schedule = [], sched.schedule

  def schedule_and_record():  # pages held while the step runs
    out = schedule()
    for row in out.rows:
      first = max(0, row.start - 5) // 4
      assert set(row.request.pages[:first]) <= {NULL_PAGE}
      assert NULL_PAGE not in row.request.pages[first:]
      held.append(len(row.request.pages) - first)
    return out

  sched.schedule = schedule_and_record
  assert FakeDevice(sched).run() == {"a": generate_alone(prompt, 40)}
  assert max(held) == 3
  assert_no_leak(sched)


def test_windowed_prefix_hit_acquires_only_live_blocks():
  sched = make(page_size=4, sliding_window=6, max_num_batched_tokens=64)
  prompt = list(range(2, 32))  # 30 tokens: 7 full blocks once computed
  sched.add_request("a", prompt, 2)
  dev = FakeDevice(sched)
  dev.run()
  cached = sched.prefix_cache.lookup(prompt + [5])
  assert cached.num_tokens == 28
  sched.add_request("b", prompt + [5], 3)
  out, _ = dev.step()
  [row] = out.rows
  # Queries start at 28, so keys < 23 are dead: blocks 0..4 (positions 0..19).
  assert row.start == 28
  table = out.block_tables[0]
  assert (table[:5] == NULL_PAGE).all()
  assert list(table[5:7]) == list(cached.pages[5:])
  assert table[7] not in cached.pages
  assert all(sched.allocator.refcount(p) == 0 and sched.allocator.is_cached(p)
             for p in cached.pages[:5])
  assert sched.prefix_cache.hit_tokens == 28
  assert dev.run()["b"] == generate_alone(prompt + [5], 3)
  assert_no_leak(sched)


def test_evicted_block_ends_the_hit_at_the_hole():
  sched = make(num_pages=10, page_size=4, sliding_window=6, max_model_len=64)
  prompt = list(range(2, 32))
  sched.add_request("a", prompt, 2)
  dev = FakeDevice(sched)
  dev.run()
  blocks = sched.prefix_cache.lookup(prompt).pages
  assert len(blocks) == 7
  # 2 free pages, then the LRU's first: a block a released mid-run (deepest first
  # among those released together), which leaves a hole in a's chain.
  sched.add_request("other", [45] * 9, 1)
  dev.run()
  cached = [sched.allocator.is_cached(p) for p in blocks]
  hole = cached.index(False)
  assert cached == [True] * hole + [False] + [True] * (6 - hole)
  hit = sched.prefix_cache.lookup(prompt)
  assert hit.pages == blocks[:hole] and hit.num_tokens == 4 * hole
  assert_no_leak(sched)
