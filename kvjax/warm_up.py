"""Compile an engine's step programs before it serves (`Engine.warm_up`).

An engine runs one serve_step or serve_burst program (kvjax/serve_steps.py) per
packed shape (kvjax/batching.py `Packing.shapes`: rows, columns, table width),
per draft count J its policy may pick (kvjax/draft_policy.py) and per static
variant: `use_filter` (a row with top-k or top-p) and `logprobs` (a row asking
for them).  XLA compiles each one when it first comes, seconds on a CPU that
the request forming the new shape would wait.  `warm_up` runs every program
once on a batch of padding rows only (q_lens 0, the scratch slot, the null
page), which writes nothing a request reads, so the engine's later outputs,
pages, prefix cache and draft policy are what they would have been; afterwards
no step compiles (tests/test_warm_up.py).  The first program runs once more
first: a fresh engine's state arrays are uncommitted and a step returns them
committed when the params are (a loaded checkpoint's), which the jit cache keys
apart, so without it the first program would be compiled for the fresh state
only and again under the first request that packs its shape.

Left to compile when first met: the variants not asked for (each doubles the
programs: top-k / top-p and logprobs requests are the exception in most
traffic, so both are off by default), and bursts of a request with a stop id
beyond EOS (a burst's stop-id width E is bucketed; requests with EOS alone, or
no stop at all, run E = 1).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Optional, Sequence

from absl import logging

from kvjax.batching import StepShape
from kvjax.draft_policy import FixedDrafts
from kvjax.serve_steps import num_compiled

__all__ = ["WARM_UP_MODES", "WarmUp", "draft_counts", "warm_up"]

# A server's choices (kvjax/server/handle.py): every program, or two short requests' only.
WARM_UP_MODES = ("full", "minimal")


@dataclasses.dataclass(frozen=True)
class WarmUp:
  """What a warm-up did."""

  programs: int  # step programs its runs compiled (kvjax.serve_steps.num_compiled), <= runs
  runs: int  # programs it ran: shapes x variants (already compiled ones included)
  seconds: float


def draft_counts(policy, num_draft: int) -> tuple[int, ...]:
  """The J a decode group's program may run: a fixed policy's J, an adaptive policy's
  candidates, any other policy's 0..J (it may choose any of them)."""
  if policy is None:
    return (num_draft,)
  if isinstance(policy, FixedDrafts):
    return (policy.num_draft,)
  return tuple(getattr(policy, "candidates", range(num_draft + 1)))


def warm_up(shapes: Sequence[StepShape], run: Callable[[StepShape, bool, bool], None], *,
            filtered: bool = False, logprobs: bool = False,
            progress: Optional[str] = None) -> WarmUp:
  """run(shape, use_filter, logprobs) for every shape and variant -> WarmUp.

  Variants: use_filter False (and True with `filtered`) times logprobs False (and
  True with `logprobs`).  progress: label of a progress bar (programs run, rate);
  either way the totals go to the absl log.
  """
  variants = list(itertools.product((False, True) if filtered else (False,),
                                    (False, True) if logprobs else (False,)))
  runs = [(shape, *variant) for shape in shapes for variant in variants]
  start = time.perf_counter()
  run(*runs[0])  # the state's form settles (module doc): neither counted nor shown
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=len(runs), unit="program", desc=progress)
  before = num_compiled()  # so programs <= runs: each run compiles one program at most
  for args in runs:
    run(*args)
    if bar is not None:
      bar.update()
  if bar is not None:
    bar.close()
  result = WarmUp(num_compiled() - before, len(runs), time.perf_counter() - start)
  logging.info("warm-up: %d step programs compiled (%d shapes x %d variants) in %.1f s",
               result.programs, len(shapes), len(variants), result.seconds)
  return result
