"""Iteration-level continuous batching (vLLM v1-like), host policy only.

Each `schedule()` call plans one engine step under a token budget
(`max_num_batched_tokens`) and a running-request cap (`max_num_seqs`):
  1. decode rows: running requests in steady decode feed their last token, plus
     draft slots when speculative decoding verifies (a step's draft count, at most
     `num_lookahead_slots`; rows verifying fewer leave the budget to prefill);
  2. prefill chunks: running requests still prefilling (chunked prefill), then
     waiting requests first come first served, using the prefix cache on
     admission; a waiting request that does not fit blocks those behind it.
Multi-step decode (`num_scheduler_steps` S > 1): one plan covers up to S decode steps
the engine runs in one device loop, when every running request decodes and no waiting
request could be admitted meanwhile (kvjax/engine/sched/burst.py).
A running request short of pages preempts, by recompute, the latest-admitted
running request not yet scheduled this step (possibly itself): its pages are freed
and it returns to the front of the waiting queue, to be prefilled again with its
generated tokens (cheaply, if its blocks are still cached).  The pages themselves,
prefix hits, cached blocks and sliding-window release are
kvjax/engine/sched/request_pages.py's, kept in every KV layer group at once by
kvjax/engine/sched/group_pages.py.

A row feeds `request.token_ids[start:]` (prompt then generated ids) plus
`num_draft` draft slots the engine fills.  A row that reaches the end of the
known tokens samples; `update_from_output` appends the sampled (for verify
rows: accepted + bonus) ids, applies stop conditions, caches newly computed
full blocks, rolls back pages of rejected drafts and frees finished requests.

Protocol: schedule() and update_from_output() alternate; the engine applies `copies`
before this step's forward (their sources are pinned until the next schedule()).
"""
from __future__ import annotations

import collections
import functools
import heapq
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from kvjax.caches.layout import PageRelease, WindowRelease
from kvjax.engine.requests import PageCopy, Request, RequestStatus, ScheduledRow, SchedulerOutput
from kvjax.engine.sched.burst import plan_burst
from kvjax.engine.sched.group_pages import GroupPages
from kvjax.engine.sched.prefix_cache import PrefixCache, PrefixHit

__all__ = ["Scheduler"]


class Scheduler:
  """Continuous-batching policy over a BlockAllocator and a PrefixCache.

  Args:
    num_pages: KV pages in the device pool, null page 0 included.
    page_size: tokens per page.
    max_num_seqs: cap on running requests (and rows per step).
    max_num_batched_tokens: token budget per step, draft slots included.
    max_model_len: cap on prompt + max_new_tokens; sets the block-table width.
    enable_prefix_caching: share computed full blocks across requests.
    prefix_match: "block" or "token" (see kvjax/engine/sched/prefix_cache.py).
    min_cacheable_tokens: shorter prefix hits are ignored.
    num_lookahead_slots: most draft slots per decode row (speculative decoding).
    num_scheduler_steps: most decode steps one plan may cover (1: every step alone).
    eos_token_id: ends every request (kept as its last output id).
    sliding_window: widest attention window W of every layer that reads these
      pages; pages wholly before the window of a request's next query are
      released.  None (some layer attends to the whole prefix): keep them all.
    page_release: the KV layout's page manager (default: the sliding_window rule).
    group_pools: (num_pages, page_release) of the pools of KV layer groups 1, 2, ...
      (kvjax/caches/groups.py), each with its own allocator; group 0's are num_pages and
      page_release.  Every request holds pages in every group, is admitted, given pages
      and preempted in all at once, and releases each group's dead pages by its rule; each
      group caches its own blocks, and a prefix hit is one every group serves
      (kvjax/engine/sched/group_pages.py).
  """

  def __init__(self, *, num_pages: int, page_size: int, max_num_seqs: int,
               max_num_batched_tokens: int, max_model_len: Optional[int] = None,
               enable_prefix_caching: bool = True, prefix_match: str = "block",
               min_cacheable_tokens: int = 0, num_lookahead_slots: int = 0,
               num_scheduler_steps: int = 1, eos_token_id: Optional[int] = None,
               sliding_window: Optional[int] = None,
               page_release: Optional[PageRelease] = None,
               group_pools: Sequence[tuple[int, PageRelease]] = ()):
    for name, value, least in (
        ("page_size", page_size, 1), ("max_num_seqs", max_num_seqs, 1),
        ("num_scheduler_steps", num_scheduler_steps, 1),
        ("max_num_batched_tokens", max_num_batched_tokens, 1),
        ("num_lookahead_slots", num_lookahead_slots, 0)):
      if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    if group_pools and enable_prefix_caching and prefix_match != "block":
      raise ValueError("prefix_match='token' with KV layer groups is not supported yet (a "
                       "partial block would be copied in one group's pool only)")
    if sliding_window is not None and sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    self.page_size = page_size
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.max_model_len = max_model_len
    self.num_lookahead_slots = num_lookahead_slots
    self.num_scheduler_steps = num_scheduler_steps
    self.eos_token_id = eos_token_id
    self.sliding_window = sliding_window
    self.page_release = page_release or WindowRelease(page_size, sliding_window)
    self.max_pages_per_seq = -(-(max_model_len or 0) // page_size) or num_pages - 1
    self.groups = GroupPages(
        [(num_pages, self.page_release), *group_pools], page_size, self.max_pages_per_seq,
        max_num_batched_tokens,
        functools.partial(PrefixCache, page_size=page_size, prefix_match=prefix_match,
                          min_cacheable_tokens=min_cacheable_tokens)
        if enable_prefix_caching else None)
    self.pages = self.groups[0]  # group 0's (the only group without kv_groups)
    self.allocator = self.pages.allocator
    self.prefix_cache = self.pages.prefix_cache  # group 0's; each group has its own
    self.requests: dict[str, Request] = {}  # unfinished, by id
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # admission order, highest priority first
    self._free_slots = list(range(max_num_seqs))
    self.num_preemptions = 0

  # -- requests ---------------------------------------------------------------

  def add_request(self, request_id: str, prompt_ids: Sequence[int],
                  max_new_tokens: int, *, stop_token_ids: Iterable[int] = (),
                  cache_salt: Optional[str] = None,
                  sampling: Any = None, ignore_eos: bool = False,
                  takes_prefix_hits: bool = True, lora_slot: int = 0) -> Request:
    """Queues a request (ignore_eos: EOS does not stop it; takes_prefix_hits False: it
    computes its whole prompt; lora_slot: its LoRA adapter's slot, 0 none); ValueError if
    it can never run."""
    prompt = tuple(int(t) for t in prompt_ids)
    if request_id in self.requests:
      raise ValueError(f"request id {request_id!r} is already in use")
    if not prompt:
      raise ValueError(f"request {request_id!r}: empty prompt")
    if min(prompt) < 0:
      raise ValueError(f"request {request_id!r}: negative token id {min(prompt)}")
    if max_new_tokens < 1:
      raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, "
                       f"got {max_new_tokens}")
    self.check_fits(f"request {request_id!r}", len(prompt), max_new_tokens)
    stops = set(stop_token_ids)
    if self.eos_token_id is not None and not ignore_eos:
      stops.add(self.eos_token_id)
    req = Request(request_id, prompt, max_new_tokens, frozenset(stops),
                  cache_salt, sampling, takes_prefix_hits=takes_prefix_hits,
                  lora_slot=lora_slot)
    self.groups.add(req)
    self.requests[request_id] = req
    self.waiting.append(req)
    return req

  def abort(self, request_id: str) -> bool:
    """Finishes a waiting or running request and frees its pages."""
    req = self.requests.get(request_id)
    if req is None:
      return False
    req.status = RequestStatus.FINISHED_ABORTED
    self._remove(req)
    return True

  def fail(self, request_id: str, good_ids: Sequence[int] = ()
           ) -> tuple[tuple[list[int], ...], int]:
    """Finishes a request whose step went non-finite -> (pages of each layer group, slot)
    to clear.

    `good_ids` (emitted before, e.g. by a burst's earlier steps) are appended
    first.  The pages only it holds (what it wrote, maybe NaN) leave the prefix
    cache; pages shared with others were written by someone else and stay.
    """
    req = self.requests[request_id]
    pages = self.groups.discard_own(req)
    slot = req.slot
    req.token_ids.extend(int(t) for t in good_ids)
    req.status = RequestStatus.FINISHED_ERROR
    self._remove(req)
    return pages, slot

  @property
  def has_unfinished(self) -> bool:
    return bool(self.requests)

  def check_fits(self, label: str, prompt_len: int, max_new_tokens: int) -> None:
    """ValueError (naming `label`) unless a request of this size can ever run here."""
    total = prompt_len + max_new_tokens
    if self.max_model_len is not None and total > self.max_model_len:
      raise ValueError(f"{label}: prompt {prompt_len} + max_new_tokens {max_new_tokens} = "
                       f"{total} exceeds max_model_len {self.max_model_len}")
    self.groups.check_fits(label, total)

  # -- one step ---------------------------------------------------------------

  def schedule(self, num_lookahead: Optional[int] = None, multi_step: bool = True
               ) -> SchedulerOutput:
    """Plans one step (or, unless multi_step is False, a decode burst): decode rows, then
    prefill chunks.  Decode rows get num_lookahead draft slots (a draft policy's k)."""
    k = self.num_lookahead_slots if num_lookahead is None else num_lookahead
    if not 0 <= k <= self.num_lookahead_slots:
      raise ValueError(f"num_lookahead must be in 0..{self.num_lookahead_slots}, got {k}")
    burst = plan_burst(self.running, bool(self.waiting), self.groups, k,
                       max_num_seqs=self.max_num_seqs, num_steps=self.num_scheduler_steps,
                       max_num_batched_tokens=self.max_num_batched_tokens) if multi_step else None
    if burst is not None:
      rows, steps = burst
      return self._output(rows, [], [], sum(1 + r.num_draft for r in rows), steps)
    budget = self.max_num_batched_tokens
    rows, copies, preempted, pins = [], [], [], []
    scheduled: set[str] = set()

    for decoding in (True, False):
      for req in list(self.running):
        if (budget == 0 or req.status is not RequestStatus.RUNNING
            or req.is_decoding != decoding):
          continue
        if decoding:
          left = req.max_new_tokens - req.num_output_tokens
          num_draft = min(k, left - 1, budget - 1)
          n = 1 + num_draft
        else:
          num_draft = 0
          n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self._reserve(req, req.num_computed_tokens + n, scheduled,
                             preempted):
          continue
        rows.append(self._row(req, n, num_draft, decoding))
        scheduled.add(req.request_id)
        budget -= n

    # Admitting right after a preemption would only thrash.
    while (self.waiting and budget and not preempted
           and len(self.running) < self.max_num_seqs):
      req = self.waiting[0]
      hits = self.groups.lookup(req)
      fit = self._admission(req, hits, budget)
      if fit is None and hits[0].copy_tokens:
        # Pinning the copy source may be what does not fit (in an exact-fit pool
        # the request would wait forever): reuse the full blocks only.
        hits = self.groups.without_copy(hits)
        fit = self._admission(req, hits, budget)
      if fit is None:
        break
      n, fits = fit
      self.waiting.popleft()
      self.groups.admit(req, hits, fits, pins, copies)
      req.slot = heapq.heappop(self._free_slots)
      req.status = RequestStatus.RUNNING
      self.running.append(req)
      rows.append(self._row(req, n, 0, False))
      budget -= n

    self.allocator.decref(pins)
    return self._output(rows, copies, preempted, self.max_num_batched_tokens - budget)

  def _output(self, rows: list[ScheduledRow], copies: list[PageCopy],
              preempted: list[str], num_batched_tokens: int,
              num_steps: int = 1) -> SchedulerOutput:
    block_tables, group_tables = self.groups.block_tables([r.request for r in rows])
    return SchedulerOutput(
        rows=tuple(rows), block_tables=block_tables, group_tables=group_tables,
        seq_lens=np.array([r.start + r.num_tokens for r in rows], np.int32),
        copies=tuple(copies), preempted_ids=tuple(preempted),
        num_batched_tokens=num_batched_tokens, num_steps=num_steps)

  def update_from_output(
      self, output: SchedulerOutput,
      new_token_ids: Mapping[str, Sequence[int]]) -> list[Request]:
    """Applies a step's sampled ids; returns the requests that finished.

    `new_token_ids[request_id]` holds, for every row with `sample`, 1 to
    1 + num_draft ids: the accepted drafts then the bonus/corrected token (a
    burst row: every step's, 1 to num_tokens ids in all).
    Rows without `sample` must have no entry (or an empty one).  Rows of
    requests aborted since `schedule()` are ignored.  Validation happens before
    any change, so a ValueError leaves the scheduler untouched.
    """
    output.check_new_ids(new_token_ids)
    finished = []
    for row in output.rows:
      req = row.request
      if req.status is not RequestStatus.RUNNING:
        continue
      computed = row.start + row.num_tokens
      if row.sample:
        ids = [int(t) for t in new_token_ids[row.request_id]]
        # KV is valid for the fed known tokens and every emitted id but the last
        # (accepted drafts; a burst's earlier steps fed theirs).
        computed = row.start + len(row.token_ids) + len(ids) - 1
        req.is_decoding = True
        for t in ids:
          req.token_ids.append(t)
          if t in req.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
          elif req.num_output_tokens >= req.max_new_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
          if req.status.is_finished:
            break
      req.num_computed_tokens = min(computed, req.num_tokens)
      self.groups.cache_blocks(req)
      if req.status.is_finished:
        self._remove(req)
        finished.append(req)
      else:
        self.groups.settle(req)
    return finished

  # -- checks -----------------------------------------------------------------

  def cached_prefix(self, prompt: Sequence[int], cache_salt: Optional[str] = None) -> int:
    """Prompt tokens a request would reuse from the prefix cache now (0 without one): with
    KV layer groups, the hit every group serves (kvjax/engine/sched/group_pages.py)."""
    if self.prefix_cache is None:
      return 0
    return self.groups.hits(list(prompt), cache_salt)[0].num_tokens

  def check_invariants(self) -> None:
    """AssertionError unless pages, slots and queues are all consistent."""
    self.groups.check_invariants(self.running)
    for r in self.running:
      assert r.status is RequestStatus.RUNNING and r.slot is not None
    for r in self.waiting:
      assert not r.pages and not any(r.group_pages) and r.slot is None
      assert r.num_computed_tokens == 0
    slots = sorted([r.slot for r in self.running] + self._free_slots)
    assert slots == list(range(self.max_num_seqs)), f"slots leaked: {slots}"
    assert len(self.running) + len(self.waiting) == len(self.requests)

  # -- internals --------------------------------------------------------------

  def _row(self, req: Request, n: int, num_draft: int,
           decoding: bool) -> ScheduledRow:
    start = req.num_computed_tokens
    known = req.token_ids[start:start + n - num_draft]
    return ScheduledRow(req, req.slot, start, n, num_draft,
                        np.asarray(known, np.int32),
                        sample=start + len(known) == req.num_tokens,
                        is_decode=decoding)

  def _admission(self, req: Request, hits: tuple[PrefixHit, ...],
                 budget: int) -> Optional[tuple[int, list]]:
    """(tokens to prefill now, (new pages, dead hit pages) of each layer group) if `req`
    fits now with each group's hit, else None."""
    n = min(req.num_tokens - hits[0].num_tokens, budget)
    fits = self.groups.admission(hits, n)
    return None if fits is None else (n, fits)

  def _reserve(self, req: Request, num_slots: int, scheduled: set[str],
               preempted: list[str]) -> bool:
    """Gives `req` pages for `num_slots` positions, preempting if needed.

    Returns False if `req` itself had to be preempted.
    """
    need = self.groups.need(req, num_slots)
    while not self.groups.can_allocate([need]):
      victim = next(r for r in reversed(self.running)
                    if r.request_id not in scheduled)
      self._preempt(victim)
      preempted.append(victim.request_id)
      if victim is req:
        return False
    self.groups.give(req, need)
    return True

  def _preempt(self, req: Request) -> None:
    self._release(req)
    self.running.remove(req)
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(req)

  def _remove(self, req: Request) -> None:
    """Drops a finished request from every queue and frees its pages."""
    if req in self.running:
      self.running.remove(req)
    else:
      self.waiting.remove(req)
    self._release(req)
    del self.requests[req.request_id]

  def _release(self, req: Request) -> None:
    self.groups.release(req)
    req.num_computed_tokens = 0
    req.is_decoding = False
    if req.slot is not None:
      heapq.heappush(self._free_slots, req.slot)
      req.slot = None
