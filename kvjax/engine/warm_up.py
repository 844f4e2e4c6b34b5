"""Compile an engine's step programs before it serves (`Engine.warm_up`).

`engine_plan(engine)` forms one engine's plan (its packing's shapes, its draft policy's
counts, the page programs); the rest of this module plans and paces runs of any plan.

An engine runs one serve_step or serve_burst program (kvjax/runtime/serve_steps.py) per
packed shape (kvjax/engine/sched/batching.py `Packing.shapes`: rows, columns, table width)
and per draft count J its policy may pick (kvjax/engine/sched/draft_policy.py); one program
serves every sampling option (top-k / top-p, logprobs: runtime conds,
kvjax/runtime/serve_steps.py).  XLA compiles each one when it first comes, seconds on a
CPU that the request forming the new shape would wait.  `warm_up` runs every program
once on a batch of padding rows only (q_lens 0, the scratch slot, the null
page), which writes nothing a request reads, so the engine's later outputs,
pages, prefix cache and draft policy are what they would have been; afterwards
no step compiles (tests/test_warm_up.py).  The first program runs once more
first: a fresh engine's state arrays are uncommitted and a step returns them
committed when the params are (a loaded checkpoint's), which the jit cache keys
apart, so without it the first program would be compiled for the fresh state
only and again under the first request that packs its shape.

Bursts have a variant per width E of their stop-id array (`stop_widths`,
opt-in, bucketed: a request with EOS alone or no stop id runs E = 1, one with 1
stop id beyond EOS E = 2, 2-3 beyond E = 4).  A server asks for all three (one
with more stop ids than its widest E still compiles under its first burst).

A prefill shape has a second program that also scores every column (prompt logprobs,
kvjax/runtime/serve_steps.py score_prompt: at most one more program per prefill shape), compiled
under the first request that asks for them, or here with `prompt_logprobs=True` (opt-in,
after every other run: a server that scores prompts, e.g. for lm-evaluation-harness).

`WarmUpPlan` runs the programs one at a time (`step()`), so a server's
warm-up thread can run them between requests and report its progress;
`warm_up` runs a whole plan at once.  A plan runs every shape's E = 1 program
first, then the wider bursts: the likeliest first, because a plan may stop early.

Every compiled XLA:CPU program keeps its LLVM-JIT code in memory maps, ~250 per
step program of the default model, and a process past the kernel's
vm.max_map_count (65,530 by default) fails its next compile ("LLVM compilation
error: Cannot allocate memory"): the default model's server runs 23 programs at
its 2,048-token context (before prefill chunks walked their pages a block at a
time, kvjax/attention/blocked.py, 101; 116 with bursts, ~29,000 maps).  With `map_budget`
a plan stops once the
process holds that fraction of the limit (a server: half, leaving the rest to
programs compiled under requests); `WarmUp.runs` then counts what it ran.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from absl import logging

from kvjax.engine.device_state import apply_page_copies, clear_request_pages
from kvjax.engine.sched.batching import StepShape, burst_limits
from kvjax.engine.sched.draft_policy import FixedDrafts
from kvjax.engine.sched.ngram import host_draft_shapes
from kvjax.runtime.logit_processors import with_processing
from kvjax.runtime.serve_steps import num_compiled

__all__ = ["WARM_UP_MODES", "WarmUp", "WarmUpPlan", "BackgroundWarmUp", "SERVER_VARIANTS",
           "draft_counts", "warm_up", "engine_plan"]

# A server's choices (kvjax/server/handle.py): every program while it already serves,
# every program before it serves, or two short requests' programs only.
WARM_UP_MODES = ("background", "full", "minimal")
# What a server's full warm-up covers: every burst stop-id width a request can need, while
# the process holds under half its memory-map limit (the module doc).
SERVER_VARIANTS = dict(stop_widths=(1, 2, 4), map_budget=0.5)


@dataclasses.dataclass(frozen=True)
class WarmUp:
  """What a warm-up did."""

  programs: int  # step programs its runs compiled (kvjax.runtime.serve_steps.num_compiled), <= runs
  runs: int  # programs it ran: shapes, bursts per stop width (compiled ones included)
  seconds: float


def draft_counts(policy, num_draft: int) -> tuple[int, ...]:
  """The J a decode group's program may run: a fixed policy's J, an adaptive policy's
  candidates, any other policy's 0..J (it may choose any of them)."""
  if policy is None:
    return (num_draft,)
  if isinstance(policy, FixedDrafts):
    return (policy.num_draft,)
  return tuple(getattr(policy, "candidates", range(num_draft + 1)))


class WarmUpPlan:
  """Every run of a warm-up, one per `step()`: run(shape, stop_width, score_prompt) for
  every shape (a burst per stop width; a prefill shape also scoring its prompt columns with
  prompt_logprobs); `prepare()` before the first, `finish()` after the last."""

  def __init__(self, shapes: Sequence[StepShape], run: Callable[..., None], *,
               stop_widths: Sequence[int] = (1,), prepare: Callable[[], None] = lambda: None,
               finish: Callable[[], None] = lambda: None, map_budget: Optional[float] = None,
               prompt_logprobs: bool = False):
    self.num_shapes = len(shapes)
    runs = [(shape, width, False) for shape in shapes
            for width in (stop_widths if shape.kind == "burst" else (1,))]
    runs += [(shape, 1, True) for shape in shapes
             if prompt_logprobs and shape.kind == "prefill"]
    # Stable: shapes keep their order, every E = 1 program before the wider bursts, the
    # prompt-scoring programs last.
    self.runs = sorted(runs, key=lambda run: (run[2], run[1] > 1))
    self._run, self._prepare, self._finish = run, prepare, finish
    self._map_budget = map_budget
    self.stopped_early = False  # the map budget ran out before every run
    self._todo = self.runs[:1] + self.runs  # the first twice: the state's form settles
    self.done = 0  # runs finished (of len(runs))
    self._compiled = self._start = None
    self.result: Optional[WarmUp] = None  # set by the last step

  @property
  def total(self) -> int:
    return len(self.runs)

  def step(self) -> bool:
    """Run the next program -> True while more are left."""
    if self._start is None:
      self._compiled, self._start = num_compiled(), time.perf_counter()
      self._prepare()
    if self._todo and self._map_budget is not None and _maps_used() > self._map_budget:
      self.stopped_early = True
      logging.warning("warm-up: stopped after %d of %d step programs: the process holds "
                      "%.0f%% of vm.max_map_count (the rest compile under requests)",
                      self.done, self.total, 100 * _maps_used())
      self._todo = []
    if self._todo:
      self._run(*self._todo.pop(0))
      self.done = max(0, self.total - len(self._todo))
    if self._todo:
      return True
    if self.result is None:
      self._finish()
      self.result = WarmUp(num_compiled() - self._compiled, self.done,
                           time.perf_counter() - self._start)
      logging.info("warm-up: %d step programs compiled (%d runs over %d shapes) in %.1f s",
                   self.result.programs, self.total, self.num_shapes, self.result.seconds)
    return False


def _maps_used() -> float:
  """This process's memory maps / vm.max_map_count (0 where /proc does not say)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f) / limit
  except (OSError, ValueError):
    return 0.0


def warm_up(plan: WarmUpPlan, progress: Optional[str] = None) -> WarmUp:
  """Run every step of `plan` -> WarmUp.  progress: label of a progress bar (programs
  run, rate); either way the totals go to the absl log."""
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=plan.total, unit="program", desc=progress)
  while plan.step():
    if bar is not None:
      bar.n = plan.done
      bar.refresh()
  if bar is not None:
    bar.n = plan.done
    bar.close()
  return plan.result


class BackgroundWarmUp:
  """Runs warm-up plans in a daemon thread while a server already serves: a program at a
  time, only while `busy()` is False (requests first: one that needs a program not yet
  compiled compiles it under its own step), each under its engine's lock.  `done` /
  `total`: runs so far / in all; `result`: the plans' WarmUp summed, once every one ran."""

  _IDLE_POLL_S = 0.02

  def __init__(self, plans: Sequence[WarmUpPlan], busy: Callable[[], bool]):
    self._plans, self._busy = list(plans), busy
    self.total = sum(p.total for p in plans)
    self.result: Optional[WarmUp] = None
    self.error: Optional[BaseException] = None
    self._stopping, self._finished = threading.Event(), threading.Event()
    self._thread = threading.Thread(target=self._run, name="kvjax-warm-up", daemon=True)

  @property
  def done(self) -> int:
    return sum(p.done for p in self._plans)

  @property
  def ready(self) -> bool:
    return self.result is not None

  @property
  def stopped_early(self) -> bool:
    """A plan stopped at its map budget (kvjax/engine/warm_up.py): some variants compile later."""
    return any(p.stopped_early for p in self._plans)

  def start(self) -> "BackgroundWarmUp":
    self._thread.start()
    return self

  def wait(self, timeout_s: Optional[float] = None) -> bool:
    """Block until every plan ran (or failed, or stopped) -> whether every plan ran."""
    self._finished.wait(timeout_s)
    return self.ready

  def stop(self) -> None:
    self._stopping.set()
    self._thread.join()

  def _run(self) -> None:
    try:
      for plan in self._plans:
        while not self._stopping.is_set():
          if self._busy():
            time.sleep(self._IDLE_POLL_S)
          elif not plan.step():
            break
      if not self._stopping.is_set():
        results = [p.result for p in self._plans]
        self.result = WarmUp(sum(r.programs for r in results), sum(r.runs for r in results),
                             sum(r.seconds for r in results))
    except Exception as error:  # the server still serves; its requests compile what they need
      logging.exception("the background warm-up failed")
      self.error = error
    finally:
      self._finished.set()


def engine_plan(engine, **variants) -> WarmUpPlan:
  """`engine`'s warm-up (kvjax/engine/engine.py Engine; this module is its collaborator and
  uses its lock and its run / copy / clear methods): a run per shape its packing can
  form (Packing.shapes), per draft count its policy may pick and per burst stop width, on
  padding-only batches, and the page copy / clear programs on the null page, so no
  request waits on XLA and nothing a request reads changes.  variants: WarmUpPlan's."""
  counts = draft_counts(engine.draft_policy, engine.num_draft)
  shapes = engine.packing.shapes((0, *counts) if engine.ngram else counts,
                                 bursts=engine.scheduler.num_scheduler_steps > 1)
  if engine.ngram is not None:
    shapes = host_draft_shapes(shapes, counts)
  return WarmUpPlan(shapes, lambda *run: _run_padding(engine, *run),
                    prepare=lambda: _warm_up_pages(engine),
                    finish=lambda: jax.block_until_ready(engine.state), **variants)


def _warm_up_pages(engine) -> None:
  with engine._lock:
    if engine.config.prefix_cache and engine.config.prefix_match == "token":
      engine.state = apply_page_copies(engine.state, [], engine.config.max_num_seqs)
    # No page of any KV layer group, the scratch slot.
    engine.state = clear_request_pages(engine.state, ([],) * len(engine.scheduler.groups),
                                       engine.config.max_num_seqs,
                                       engine.scheduler.max_pages_per_seq)


def _run_padding(engine, shape: StepShape, stop_width: int = 1,
                 score_prompt: bool = False) -> None:
  """One step program of `shape` on padding rows (a burst's: none runs a step), its
  stop-id array `stop_width` wide (score_prompt: the prefill program scoring prompts)."""
  with engine._lock:
    batch = with_processing(
        engine.packing.padding(shape, snapshots=engine.snapshots is not None), [],
        engine.model_config.vocab_size)  # neutral, as every group's
    burst = None
    if shape.kind == "burst":
      left, _ = burst_limits([], shape.rows)
      burst = (left, np.full((shape.rows, stop_width), -1, np.int32), 1)
    engine._run(batch, shape.num_draft, False, burst, score_prompt=score_prompt)
