"""Engine: continuous batching over the pure steps, prefix caching, speculative decoding.

The host loop per `step()`:
  1. `Scheduler.schedule()` picks rows (decodes first, then prefill chunks),
     slots and pages (kvjax/engine/sched/scheduler.py owns every policy decision);
  2. token-mode prefix hits are page copies, applied first (`copy_pages`);
  3. decode rows and prefill rows are packed (kvjax/engine/sched/batching.py) into one
     StepBatch each and run as two calls of the jitted `serve_step`
     (kvjax/runtime/serve_steps.py); splitting them keeps a 1-token decode row from
     being padded to a 256-token prefill chunk.  A multi-step plan (decode rows
     only) runs `serve_burst`, a device loop of the same step;
  4. one host sync reads the emitted ids (kvjax/engine/output_processor.py sorts them by
     request), `update_from_output` appends them, applies stops and frees pages,
     and the output processor turns them into RequestOutputs with their metrics.
The host owns every length and block table; the device state holds only K/V
and each slot's pending drafts.

Sampling matches kvjax.generate: the token at sequence index p of a request
is drawn with fold_in(PRNGKey(seed), p), so greedy and sampled outputs do not
depend on batching, chunking or preemption (with speculation, greedy only;
see kvjax/runtime/speculative.py).

A request for which the model gives non-finite logits (NaN or inf weights or
activations) at any position it feeds, its drafts included, finishes with
finish_reason "error" after the tokens it emitted before; the pages only it
held are cleared and leave the prefix cache, so the other requests, now and
later, are unaffected.  So does a constrained request whose grammar matcher
fails (RequestOutput.error says why; kvjax/constraints/book.py).

Threading: an Engine is safe to share between threads.  One re-entrant lock
covers `add_request`, `abort`, `step` and `generate` (which holds it for its
whole run, so concurrent `generate` calls run one after another); a step's
outputs go to whichever thread called `step`, and `generate` hands other
callers' outputs on to the next `step`.  A server still gives the engine loop
one thread of its own (kvjax/server/).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import numpy as np

from kvjax.attention.variants import with_attention
from kvjax.caches.layout import with_layout_variant
from kvjax.constraints import Constraint, ConstraintBook
from kvjax.engine import generate as one_shot
from kvjax.engine.adapters import Adapters
from kvjax.engine.config import EngineConfig
from kvjax.engine.device_state import apply_page_copies, clear_request_pages, initial_state
from kvjax.engine.dispatch import dispatch
from kvjax.engine.metrics import RequestMetrics, StepLog
from kvjax.engine.output_processor import StepResult, record_prompt_logprobs, request_outputs
from kvjax.engine.requests import Request, RequestOutput
from kvjax.engine.row_group import launch
from kvjax.engine.sched.batching import Packing
from kvjax.engine.sched.draft_policy import decode_drafts, policy_from, prefill_drafts
from kvjax.engine.sched.ngram import NgramDrafter
from kvjax.engine.sched.prefix_cache import PrefixCache
from kvjax.engine.sched.scheduler import Scheduler
from kvjax.engine.sched.state_snapshots import SnapshotPool
from kvjax.engine.stats import EngineStats
from kvjax.engine.validation import check_request_id, checked_request
from kvjax.engine.warm_up import WarmUp, WarmUpPlan, engine_plan, warm_up
from kvjax.runtime.generation import GenerateResult
from kvjax.runtime.serve_steps import num_compiled

__all__ = ["Engine", "EngineConfig", "RequestOutput"]


class Engine:
  """Continuous-batching inference engine over one model.

  `Engine(model, config)` or `Engine(model, **options)`: the options are the
  fields of `EngineConfig` (kvjax/engine/config.py says what each does), and
  keywords override a given config.  The engine keeps its pages and prefix
  cache across `generate` calls, and forgets a request once its final
  RequestOutput (which carries its metrics) has been returned, so a
  long-running engine holds no per-request history.  When every layer (MTP
  modules and a draft model too) has a sliding window, pages behind a
  request's window return to the pool as it runs (kvjax/engine/sched/scheduler.py).
  """

  def __init__(self, model, config: Optional[EngineConfig] = None, **options):
    config = dataclasses.replace(config or EngineConfig(), **options)
    # Its config carries the variant (attention=, or an alias kv_dtype's such as "streaming").
    model = with_layout_variant(with_attention(model, config.attention), config.kv_dtype)
    config = config.resolve(model)
    cfg = model.config
    self.loras = Adapters(config.max_loras, config.max_lora_rank)
    self.model = self.loras.slotted(model)  # LoRA slots, empty until an adapter loads
    self.config = config
    self.model_config = cfg
    self.draft_model = config.draft_model
    self.num_draft = config.drafts_per_step  # the most drafts a step verifies (J)
    self.draft_policy = policy_from(config.draft_policy, self.num_draft) if self.num_draft \
        else None
    self._fresh_drafts: dict[str, int] = {}  # drafts a request's slot holds for its next step
    # Prompt lookup drafts on the host, from each request's tokens (kvjax/engine/sched/ngram.py).
    self.ngram = NgramDrafter(config.ngram_n) if config.speculative == "ngram" else None
    # One pool per KV layer group (kvjax/caches/groups.py), or the one pool.
    pools = config.group_pools(cfg) or [(config.num_pages, config.page_release(cfg))]
    self.scheduler = Scheduler(
        num_pages=pools[0][0], page_size=config.page_size, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, enable_prefix_caching=config.prefix_cache,
        prefix_match=config.prefix_match, min_cacheable_tokens=config.min_cacheable_tokens,
        num_lookahead_slots=self.num_draft, num_scheduler_steps=config.num_scheduler_steps,
        eos_token_id=cfg.eos_token_id, sliding_window=config.widest_window(cfg),
        page_release=pools[0][1], group_pools=pools[1:])
    self.packing = Packing.create(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        page_size=config.page_size, max_pages_per_seq=self.scheduler.max_pages_per_seq,
        num_draft=self.num_draft, max_model_len=config.max_model_len,
        prefill_full_width=config.prefill_full_width(cfg), lora=config.max_loras > 0,
        num_groups=len(config.layer_groups(cfg)))
    # A hybrid's prefix hits also need its recurrent state there
    # (kvjax/engine/sched/state_snapshots.py).
    self.snapshots = SnapshotPool(self.scheduler.prefix_cache, config.prefix_snapshots,
                                  config.num_pages) if config.prefix_snapshots else None
    # n-gram drafts ride in the batch, not the slots.
    self.state = initial_state(model, config, [n for n, _ in pools],
                               0 if self.ngram else self.num_draft)
    self._ids = itertools.count()
    self.metrics: dict[str, RequestMetrics] = {}  # unfinished requests only
    self._pending: list[RequestOutput] = []  # returned by the next step()
    # Prompt logprobs of requests that asked, filled chunk by chunk until their first output.
    self._prompt_scores: dict[str, list] = {}
    self.steps = StepLog()
    # MoE models: the tokens each layer routed to each expert over the steps it ran, [L, Ne].
    self.expert_tokens = (np.zeros((cfg.num_layers, cfg.num_experts), np.int64)
                          if cfg.num_experts else None)
    self._lock = threading.RLock()
    self.constraints = ConstraintBook()  # with a vocabulary: kvjax/constraints/vocabulary.py

  # -- whole runs: one-shot generation and warm-up (collaborator modules) -------------

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               temperature: float = 0.0, top_k: Optional[int] = None,
               top_p: Optional[float] = None, seed: Union[int, Sequence[int]] = 0,
               stop: Union[None, int, Sequence[int]] = None,
               cache_salt: Optional[str] = None) -> GenerateResult:
    """Run `prompts` to completion -> GenerateResult(tokens per prompt, stats)
    (kvjax/engine/generate.py).

    Every prompt is validated before any is queued, so bad input changes
    nothing.  `seed` is one int or one per prompt.  stats["finish_reasons"]
    says how each request ended ("stop", "length", or "error": see the module doc).
    """
    with self._lock:
      return one_shot.generate(self, prompts, max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                               cache_salt=cache_salt)

  def warm_up(self, *, progress: Optional[str] = None, **variants) -> WarmUp:
    """Compile every step program this engine can run, before it serves -> WarmUp
    (programs compiled, programs run, seconds); kvjax/engine/warm_up.py.

    variants: WarmUpPlan's stop_widths (the bursts of requests with stop ids), map_budget
    and prompt_logprobs (the prefill programs that score prompts).  progress: a progress
    bar's label.
    """
    with self._lock:
      return warm_up(self.warm_up_plan(**variants), progress)

  def warm_up_plan(self, **variants) -> WarmUpPlan:
    """`warm_up`'s programs, to run one at a time (a server's warm-up thread: between
    requests)."""
    return engine_plan(self, **variants)

  # -- LoRA adapters (kvjax/engine/adapters.py) ---------------------------------------

  @property
  def adapters(self) -> dict:
    """The loaded LoRA adapters by name."""
    return self.loras.loaded

  def load_adapter(self, name: str, path: str) -> None:
    """Load the PEFT LoRA adapter in directory `path` as `name`; ValueError (nothing
    changed) on a taken name, no free slot or a bad adapter."""
    with self._lock:
      self.model = self.loras.load(self.model, name, path)

  def unload_adapter(self, name: str) -> None:
    """Remove adapter `name` (its slot and cached prefix blocks); ValueError (nothing
    changed) if it is not loaded or a request uses it."""
    with self._lock:
      self.model = self.loras.unload(self.model, name, self.scheduler)

  # -- requests ---------------------------------------------------------------

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, *,
                  temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, seed: Optional[int] = None,
                  stop: Union[None, int, Sequence[int]] = None,
                  cache_salt: Optional[str] = None, logprobs: Optional[int] = None,
                  prompt_logprobs: Optional[int] = None, arrival_s: Optional[float] = None,
                  constraint: Optional[Constraint] = None, lora: Optional[str] = None,
                  **extensions) -> str:
    """Queue one request -> its id.  ValueError (nothing queued) on bad input.

    `stop`: token id(s) that end the request (kept as its last output id), in
    addition to the model's EOS.  `cache_salt` isolates a tenant's prefix
    blocks from everyone else's.  `logprobs` n (0..20): every RequestOutput
    carries each new id's log-probability and its n likeliest alternatives
    (kvjax/engine/requests.py TokenLogprob).  `prompt_logprobs` k (0..20): its first RequestOutput
    carries vLLM's prompt_logprobs, [None, then a TokenLogprob with k alternatives per prompt
    position after the first], scored in the prefill chunks it runs anyway.  `arrival_s`:
    when the request arrived (time.perf_counter; default now), e.g. a server's receipt time,
    so TTFT and queue time include the wait before this call.  `constraint`: outputs follow
    its grammar (kvjax/constraints; set engine.constraints first).  `lora`: the name of a
    loaded LoRA adapter to run it through (load_adapter; None: the base model).
    `extensions`: vLLM's ignore_eos, min_tokens, repetition/presence/frequency_penalty,
    logit_bias (kvjax/engine/validation.py).
    """
    with self._lock:
      return self._add_request(prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop, cache_salt=cache_salt,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               arrival_s=arrival_s, constraint=constraint, lora=lora,
                               **extensions)

  def _add_request(self, prompt, max_new_tokens, *, constraint=None, lora=None,
                   **options) -> str:
    request_id = str(next(self._ids))
    try:  # every argument checked before anything is queued
      checked = checked_request(self.model_config.vocab_size, prompt, max_new_tokens,
                                speculative=self.config.speculative if self.num_draft else None,
                                **options)
      matcher = None if constraint is None else self.constraints.compile(constraint)
      lora_slot, cache_salt = self.loras.request(lora, checked.cache_salt)
    except ValueError as error:
      raise ValueError(f"request {request_id!r}: {error}") from None
    ids, sampling = checked.ids, checked.sampling
    scored = sampling.prompt_logprobs is not None
    # A prefix hit's positions are never computed, so they could not be scored: a request
    # asking for prompt logprobs takes none and computes its whole prompt.
    self.scheduler.add_request(request_id, ids.tolist(), checked.max_new_tokens,
                               stop_token_ids=list(checked.stop_ids), cache_salt=cache_salt,
                               sampling=sampling, ignore_eos=sampling.ignore_eos,
                               takes_prefix_hits=not scored, lora_slot=lora_slot)
    if scored:
      self._prompt_scores[request_id] = [None] * int(ids.size)
    self.constraints.attach(request_id, matcher)
    now = time.perf_counter()
    arrival = now if checked.arrival_s is None else min(checked.arrival_s, now)
    self.metrics[request_id] = RequestMetrics(request_id, int(ids.size), arrival)
    return request_id

  def abort(self, request_id: str) -> bool:
    """Finish a waiting or running request now; its pages are freed.  False: no such
    request (any more); ValueError: request_id is no string.

    Its final RequestOutput (finish_reason "abort") comes with the next step().
    """
    with self._lock:
      return self._abort(request_id)

  def _abort(self, request_id: str) -> bool:
    req = self.scheduler.requests.get(check_request_id(request_id))
    if req is None or not self.scheduler.abort(request_id):
      return False
    metrics = self.metrics.pop(request_id)
    metrics.finish_s = time.perf_counter()
    self._fresh_drafts.pop(request_id, None)
    self.constraints.forget(request_id)
    self._prompt_scores.pop(request_id, None)
    self._pending.append(RequestOutput(request_id, [], list(req.output_ids), True,
                                       req.status.value, metrics))
    return True

  @property
  def has_unfinished(self) -> bool:
    """Requests still running or waiting, or final outputs not yet returned."""
    return self.scheduler.has_unfinished or bool(self._pending)

  # -- what it reports (a Router reports the same over its replicas) ----------

  def stats(self) -> EngineStats:
    """Its scheduler's and constraint book's numbers now (kvjax/engine/stats.py)."""
    return EngineStats.of(self.scheduler, self.constraints, self.expert_tokens)

  def request(self, request_id: str) -> Optional[Request]:
    """An unfinished request (waiting or running) by id; None once it finished."""
    return self.scheduler.requests.get(request_id)

  def prefix_caches(self) -> list[PrefixCache]:
    """Its prefix cache, if it has one (what publishes KV events, kvjax/engine/kv_events.py);
    with KV layer groups, group 0's."""
    cache = self.scheduler.prefix_cache
    return [] if cache is None else [cache]

  # -- stepping ---------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Run one scheduled step -> outputs of the requests that got tokens.

    Also returns outputs held back since the last step (aborts, and other
    requests' outputs produced while `generate` ran).
    """
    with self._lock:
      return self._step()

  def _step(self) -> list[RequestOutput]:
    start = time.perf_counter()
    outputs, self._pending = self._pending, []
    # The decode rows' J comes before planning, prefill rows' after
    # (kvjax/engine/sched/draft_policy.py); host drafts cannot feed a burst's later steps,
    # so n-gram rows burst only at J = 0, and nor can masks (of tokens not sampled yet), so
    # no burst while a constrained request runs.
    k = decode_drafts(self.draft_policy, self.scheduler, self.packing, self.metrics,
                      self.num_draft)
    plan = self.scheduler.schedule(k, multi_step=not (self.ngram and k or self.constraints))
    waiting = len(self.scheduler.waiting)
    if not plan.rows and waiting and not self.scheduler.running and not plan.preempted_ids:
      # Every waiting request fits an idle pool (add_request checks): a bug, not a wait.
      raise RuntimeError(f"the scheduler admitted none of {waiting} waiting requests into "
                         f"an idle pool of {self.scheduler.allocator.num_usable} pages")
    if plan.copies:
      self.state = apply_page_copies(self.state, plan.copies, self.config.max_num_seqs)
    decode = [i for i, r in enumerate(plan.rows) if r.is_decode]
    prefill = [i for i, r in enumerate(plan.rows) if not r.is_decode]
    k_prefill = prefill_drafts(self.draft_policy, self.scheduler, self.packing, self.num_draft,
                               self.ngram is not None) if prefill else self.num_draft
    # One program for the decode rows; the prefill rows in pieces that pad less.
    groups = [(decode, k)] if decode else []
    groups += [([prefill[j] for j in piece], k_prefill)
               for piece in self.packing.prefill_pieces([plan.rows[i] for i in prefill])]
    programs = num_compiled()
    snapshots = self.snapshots and self.snapshots.plan(plan.rows)
    launched = [(group, launch(self, plan, group, j, snapshots)) for group, j in groups]
    result, steps_run = StepResult(), 1
    for group, (_, emitted, drafted, steps) in launched:
      # device_get is the step's host sync.
      emitted, drafted, steps_run = jax.device_get((emitted, drafted, steps))
      rows = [plan.rows[i] for i in group]
      if emitted.expert_tokens is not None:  # [U, L, Ne]: a burst's steps, 0 past the last
        self.expert_tokens += emitted.expert_tokens.sum(0)
      if emitted.prompt is not None:
        record_prompt_logprobs(rows, emitted.prompt, self._prompt_scores)
      for row in rows:
        if row.start == row.request.num_cached_tokens and not row.is_decode:
          self.metrics[row.request_id].prefix_hit_tokens = row.request.num_cached_tokens
        self._fresh_drafts[row.request_id] = (
            (k if row.is_decode else k_prefill) if row.sample else 0)
      result.read(rows, emitted, drafted, steps_run, self.constraints.failed)
    before = {rid: self.scheduler.requests[rid].num_output_tokens for rid in result.new_ids}
    sampled = {rid: self.scheduler.requests[rid] for rid in result.new_ids}
    for req, good in result.broken:
      pages, slot = self.scheduler.fail(req.request_id, good)
      self.state = clear_request_pages(self.state, pages, slot, self.scheduler.max_pages_per_seq)
    self.scheduler.update_from_output(plan, result.new_ids)
    if self.snapshots:
      self.snapshots.settle()
    now = time.perf_counter()
    for rid, num_draft, num_accepted in result.verified:
      self.metrics[rid].record_verify(num_draft, num_accepted, self.num_draft)
      self.draft_policy.observe_verify(num_draft, num_accepted)
    produced = request_outputs(result, sampled, before, self.metrics, self.constraints, now,
                               self._prompt_scores)
    for out in produced:
      if out.finished:
        self._fresh_drafts.pop(out.request_id, None)
    outputs += produced
    decode_only = bool(plan.rows) and all(r.is_decode for r in plan.rows)
    if decode_only and self.draft_policy is not None and num_compiled() == programs:
      self.draft_policy.observe_step(launched[0][1][0][0], k, now - start, steps_run)
    stats = self.stats()
    self.steps.record(waiting=stats.waiting, running=stats.running,
                      utilization=stats.utilization, pages_used=stats.pages_used,
                      batched_tokens=plan.num_batched_tokens, step_s=now - start,
                      decode_only=decode_only, num_steps=steps_run,
                      row_shapes=[shape for _, (shape, *_) in launched],
                      num_draft=k if decode else 0)
    return outputs

  def stream(self) -> Iterator[RequestOutput]:
    """Step until every request finishes, yielding each step's outputs."""
    while self.has_unfinished:
      yield from self.step()

  __iter__ = stream

  def _run(self, batch, num_draft: int, logprobs: bool, burst=None, mask=None,
           score_prompt: bool = False):
    """One row group's program on this engine's state (kvjax/engine/dispatch.py)
    -> (Emitted [U, B, ...], drafted [U, B], steps run)."""
    self.state, emitted, drafted, steps = dispatch(
        self.model, self.draft_model, self.state, batch, backend=self.config.backend,
        num_draft=num_draft, host_drafts=bool(self.ngram and num_draft),
        max_steps=self.scheduler.num_scheduler_steps, logprobs=logprobs, burst=burst,
        mask=mask, score_prompt=score_prompt)
    return emitted, drafted, steps
