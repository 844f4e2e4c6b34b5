"""Router: data-parallel Engine replicas behind the Engine's own interface.

A KV cache makes serving stateful: a multi-turn user whose history sits in one
replica's prefix cache should land on that replica again.  `Router(engines,
policy)` takes one Engine per replica (each on its own sub-mesh,
kvjax.parallel.sharding.submeshes, or sharing a device in tests) and offers
add_request / step / abort / stream / generate like one Engine.

Policies (where a new request goes):
  prefix        the replica whose prefix cache holds the longest cached prefix of
                the prompt (the same block hashes and cache_salt rules the engine
                uses, kvjax/engine/sched/prefix_cache.py `lookup`, which takes nothing), ties
                and misses to the least loaded;
  round_robin   replicas in turn;
  least_loaded  the replica with the fewest unfinished requests.
Load bound: under "prefix", a replica holding more than `max_imbalance`
unfinished requests above the least loaded one is not chosen, so at every
routing decision the chosen replica's load is within `max_imbalance` of the
minimum and no replica ever runs more than `max_imbalance + 1` requests ahead
of the least loaded one by routing alone.

`step()` steps every replica that has work, one after another on this thread;
the replicas' device work is their own (different devices in a real
deployment), the host loop is shared.  Request ids are the router's own.

What a server loop or a benchmark reads of an Engine, a Router offers over
its replicas: `stats()` (their kvjax/engine/stats.py EngineStats summed),
`request(id)` and `metrics` (by router id), `prefix_caches()` (every replica's),
`steps` (one StepLog entry per router step), `config` (the replicas' options,
max_num_seqs summed) and `model_config`.  So kvjax/server/ and `kvjax bench`
drive a Router where they drive an Engine (`--dp`).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Iterator, Mapping, Optional, Sequence, Union

from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.generate import run_until_finished
from kvjax.engine.metrics import StepLog
from kvjax.engine.requests import Request, RequestOutput
from kvjax.engine.sched.prefix_cache import PrefixCache
from kvjax.engine.stats import EngineStats
from kvjax.engine.validation import per_prompt_seeds
from kvjax.runtime.generation import GenerateResult, validate_prompts

__all__ = ["Router", "POLICIES"]

POLICIES = ("prefix", "round_robin", "least_loaded")


class Router:
  """Data-parallel replicas with one Engine's interface; see the module docstring."""

  def __init__(self, engines: Sequence[Engine], policy: str = "prefix", *,
               max_imbalance: int = 4):
    engines = list(engines)
    if not engines:
      raise ValueError("Router needs at least one engine")
    if policy not in POLICIES:
      raise ValueError(f"unknown routing policy {policy!r}; use one of {POLICIES}")
    if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or \
        max_imbalance < 0:
      raise ValueError(f"max_imbalance must be an int >= 0, got {max_imbalance!r}")
    vocab = {e.model_config.vocab_size for e in engines}
    if len(vocab) != 1:
      raise ValueError(f"replicas must serve one model; vocab sizes {sorted(vocab)}")
    self.engines = engines
    self.policy = policy
    self.max_imbalance = max_imbalance
    self._ids = itertools.count()
    self._turn = itertools.cycle(range(len(engines)))
    self._where: dict[str, tuple[int, str]] = {}  # router id -> (replica, engine id)
    self._router_id: dict[tuple[int, str], str] = {}
    self.routed = [0] * len(engines)  # requests sent to each replica
    self._pending: list[RequestOutput] = []  # returned by the next step()
    self._lock = threading.RLock()
    self.metrics = _ByRouterId(self, lambda engine: engine.metrics)
    self.steps = StepLog()

  @property
  def model_config(self):
    return self.engines[0].model_config

  @property
  def config(self) -> EngineConfig:
    """The replicas' options (replica 0's), max_num_seqs summed over the replicas."""
    return dataclasses.replace(self.engines[0].config,
                               max_num_seqs=sum(e.config.max_num_seqs for e in self.engines))

  # -- routing ----------------------------------------------------------------

  def load(self, replica: int) -> int:
    """Unfinished requests (running + waiting) of one replica."""
    stats = self.engines[replica].stats()
    return stats.running + stats.waiting

  def cached_prefix(self, replica: int, prompt: Sequence[int],
                    cache_salt: Optional[str] = None) -> int:
    """Prompt tokens the replica's prefix cache would reuse now (0 without a cache)."""
    return self.engines[replica].scheduler.cached_prefix(prompt, cache_salt)

  def choose(self, prompt: Sequence[int], cache_salt: Optional[str] = None) -> int:
    """The replica the policy sends `prompt` to (nothing is queued)."""
    loads = [self.load(r) for r in range(len(self.engines))]
    if self.policy == "round_robin":
      return next(self._turn)
    if self.policy == "least_loaded":
      return loads.index(min(loads))
    eligible = [r for r, load in enumerate(loads) if load <= min(loads) + self.max_imbalance]
    return max(eligible, key=lambda r: (self.cached_prefix(r, prompt, cache_salt), -loads[r]))

  def replica_of(self, request_id: str) -> int:
    """Which replica serves an unfinished request."""
    if request_id not in self._where:
      raise KeyError(f"unknown or finished request {request_id!r}")
    return self._where[request_id][0]

  # -- the Engine interface ---------------------------------------------------

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, **options) -> str:
    """Route one request -> the router's id for it; options as Engine.add_request.

    ValueError from the chosen replica (nothing queued) on bad input.
    """
    with self._lock:
      replica = self.choose(prompt, options.get("cache_salt"))
      engine_id = self.engines[replica].add_request(prompt, max_new_tokens, **options)
      request_id = str(next(self._ids))
      self._where[request_id] = (replica, engine_id)
      self._router_id[(replica, engine_id)] = request_id
      self.routed[replica] += 1
      return request_id

  def abort(self, request_id: str) -> bool:
    with self._lock:
      if request_id not in self._where:
        return False
      replica, engine_id = self._where[request_id]
      return self.engines[replica].abort(engine_id)

  @property
  def has_unfinished(self) -> bool:
    return bool(self._pending) or any(e.has_unfinished for e in self.engines)

  def stats(self) -> EngineStats:
    """The replicas' stats summed: their pools as one, their counters' totals."""
    return sum((e.stats() for e in self.engines), EngineStats())

  def request(self, request_id: str) -> Optional[Request]:
    """An unfinished request by router id (its replica's Request); None once finished."""
    if request_id not in self._where:
      return None
    replica, engine_id = self._where[request_id]
    return self.engines[replica].request(engine_id)

  def prefix_caches(self) -> list[PrefixCache]:
    """Every replica's prefix cache, in replica order."""
    return [cache for e in self.engines for cache in e.prefix_caches()]

  def step(self) -> list[RequestOutput]:
    """One step of every replica with work -> their outputs, under the router's ids
    (and outputs of other callers' requests that ran while `generate` did)."""
    with self._lock:
      start = time.perf_counter()
      outputs, self._pending = self._pending, []
      stepped = []
      for replica, engine in enumerate(self.engines):
        if not engine.has_unfinished:
          continue
        mark = engine.steps.num_recorded
        for out in engine.step():
          key = (replica, out.request_id)
          request_id = self._router_id[key]
          if out.finished:
            del self._router_id[key], self._where[request_id]
          outputs.append(dataclasses.replace(out, request_id=request_id))
        stepped.append(engine.steps.since(mark))
      if stepped:
        self._record(stepped, time.perf_counter() - start)
      return outputs

  def _record(self, logs: Sequence[StepLog], step_s: float) -> None:
    """One StepLog entry for a router step from the replica steps it ran."""
    last = [log for log in logs if log.num_recorded]
    stats = self.stats()
    self.steps.record(
        waiting=stats.waiting, running=stats.running,
        utilization=stats.utilization, pages_used=stats.pages_used,
        batched_tokens=sum(log.batched_tokens[-1] for log in last), step_s=step_s,
        decode_only=all(log.decode_only[-1] for log in last),
        num_steps=max((log.num_steps[-1] for log in last), default=1),
        row_shapes=[shape for log in last for shape in log.row_shapes[-1]],
        num_draft=max((log.num_draft[-1] for log in last), default=0))

  def stream(self) -> Iterator[RequestOutput]:
    """Step until every request finishes, yielding each step's outputs."""
    while self.has_unfinished:
      yield from self.step()

  __iter__ = stream

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               temperature: float = 0.0, top_k: Optional[int] = None,
               top_p: Optional[float] = None, seed: Union[int, Sequence[int]] = 0,
               stop: Union[None, int, Sequence[int]] = None,
               cache_salt: Optional[str] = None) -> GenerateResult:
    """Route and run `prompts` to completion -> GenerateResult (tokens per prompt).

    stats: "replicas" (which replica served each prompt), "finish_reasons",
    and the prefix hit tokens / queried tokens and preemptions of this call over every
    replica.
    """
    with self._lock:
      prompts = validate_prompts(self.engines[0].model_config, prompts, max_new_tokens)
      seeds = per_prompt_seeds(seed, len(prompts))
      before = self.stats()
      start = time.perf_counter()
      ids = [self.add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=s, stop=stop, cache_salt=cache_salt)
             for p, s in zip(prompts, seeds)]
      replicas = [self.replica_of(rid) for rid in ids]
      done, others = run_until_finished(self.step, ids)
      self._pending = others + self._pending
      stats = dict(replicas=replicas, finish_reasons=[done[r].finish_reason for r in ids],
                   latency_s=time.perf_counter() - start,
                   **self.stats().counted_since(before))
      return GenerateResult(tokens=[done[rid].output_ids for rid in ids], stats=stats)


class _ByRouterId(Mapping):
  """A per-replica mapping keyed by engine ids, seen by router ids (unfinished requests)."""

  def __init__(self, router: Router, of_engine):
    self._router = router
    self._of_engine = of_engine

  def _lookup(self, request_id: str):
    replica, engine_id = self._router._where[request_id]
    return self._of_engine(self._router.engines[replica]).get(engine_id)

  def __getitem__(self, request_id: str):
    value = self._lookup(request_id) if request_id in self._router._where else None
    if value is None:
      raise KeyError(request_id)
    return value

  def __iter__(self):
    return (rid for rid in list(self._router._where) if self._lookup(rid) is not None)

  def __len__(self) -> int:
    return sum(1 for _ in self)
