"""Serving metrics with vLLM's definitions (claim C18's diagnosis signals).

Per request (host wall clock, seconds from `add_request`; `RequestMetrics`
names them as a run's stats do, `ttft_s`, `tpot_s`, ...):
  ttft_s   time to the first output token (prefill, queueing, prefix cache: C15)
  tpot_s   (e2e latency - TTFT) / (output_len - 1): mean time per later token
  itls_s   gaps between consecutive token arrivals (a verify step that emits 3
           tokens yields one gap and two zero gaps, as in vLLM)
  e2e_s    add_request to the last token
  acceptance_length  tokens emitted per verify step (speculation only)
Per run: request and output-token throughput, KV page utilization, prefix hit
tokens and rate, speculative acceptance rate per draft position and mean
acceptance length (tokens emitted per verify step), preemptions and queue
depth.  Distributions are reported as mean, median and P99.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["RequestMetrics", "StepLog", "distribution", "summarize"]


def distribution(values: Iterable[float]) -> dict:
  """{'mean', 'median', 'p99'} of values (zeros when empty)."""
  x = np.asarray(list(values), np.float64)
  if x.size == 0:
    return {"mean": 0.0, "median": 0.0, "p99": 0.0}
  return {"mean": float(x.mean()), "median": float(np.median(x)),
          "p99": float(np.percentile(x, 99))}


@dataclasses.dataclass
class RequestMetrics:
  """Timeline of one request; times are host perf_counter seconds."""

  request_id: str
  prompt_len: int
  arrival_s: float
  token_times: list = dataclasses.field(default_factory=list)  # one per output token
  finish_s: Optional[float] = None
  prefix_hit_tokens: int = 0  # at the last admission
  num_preemptions: int = 0
  verify_steps: int = 0  # steps that fed >= 1 draft
  emitted: int = 0  # tokens those steps emitted (accepted + 1)
  proposed: list = dataclasses.field(default_factory=list)  # [J] drafts offered per position
  accepted: list = dataclasses.field(default_factory=list)  # [J] drafts accepted per position

  def record_tokens(self, n: int, now: float) -> None:
    self.token_times.extend([now] * n)

  def record_verify(self, num_draft: int, num_accepted: int, num_positions: int) -> None:
    if not self.proposed:
      self.proposed, self.accepted = [0] * num_positions, [0] * num_positions
    self.verify_steps += 1
    self.emitted += num_accepted + 1
    for j in range(num_draft):
      self.proposed[j] += 1
      self.accepted[j] += j < num_accepted

  @property
  def acceptance_length(self) -> Optional[float]:
    """Mean tokens emitted per verify step (accepted drafts + 1); None without speculation."""
    return self.emitted / self.verify_steps if self.verify_steps else None

  @property
  def output_len(self) -> int:
    return len(self.token_times)

  @property
  def ttft_s(self) -> Optional[float]:
    return self.token_times[0] - self.arrival_s if self.token_times else None

  @property
  def e2e_s(self) -> Optional[float]:
    return self.token_times[-1] - self.arrival_s if self.token_times else None

  @property
  def tpot_s(self) -> Optional[float]:
    if self.output_len < 2:
      return None
    return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

  @property
  def itls_s(self) -> list:
    return list(np.diff(self.token_times)) if self.output_len > 1 else []


_SAMPLES = ("queue_depth", "running", "kv_utilization", "pages_used", "batched_tokens",
            "step_s", "decode_only", "num_steps", "row_shapes", "num_draft")


@dataclasses.dataclass
class StepLog:
  """Engine-wide samples, one per step; the newest `max_steps` at least are kept.

  `num_recorded` counts every step ever recorded: a run notes it at its start
  and reads its own steps back with `since(mark)`, so a long-running engine's
  log stays bounded.
  """

  max_steps: int = 100_000
  num_recorded: int = 0
  queue_depth: list = dataclasses.field(default_factory=list)  # waiting requests
  running: list = dataclasses.field(default_factory=list)  # requests holding a slot
  kv_utilization: list = dataclasses.field(default_factory=list)  # used / usable pages
  pages_used: list = dataclasses.field(default_factory=list)
  batched_tokens: list = dataclasses.field(default_factory=list)
  step_s: list = dataclasses.field(default_factory=list)  # wall time, schedule to outputs
  decode_only: list = dataclasses.field(default_factory=list)  # no prefill row this step
  num_steps: list = dataclasses.field(default_factory=list)  # forward steps run (a burst: > 1)
  row_shapes: list = dataclasses.field(default_factory=list)  # padded (B, T) of each row group
  num_draft: list = dataclasses.field(default_factory=list)  # drafts a step's program verifies

  def record(self, *, waiting: int, running: int, utilization: float, pages_used: int,
             batched_tokens: int, step_s: float, decode_only: bool, num_steps: int = 1,
             row_shapes: tuple = (), num_draft: int = 0) -> None:
    self.queue_depth.append(waiting)
    self.running.append(running)
    self.kv_utilization.append(utilization)
    self.pages_used.append(pages_used)
    self.batched_tokens.append(batched_tokens)
    self.step_s.append(step_s)
    self.decode_only.append(decode_only)
    self.num_steps.append(num_steps)
    self.row_shapes.append(tuple(row_shapes))
    self.num_draft.append(num_draft)
    self.num_recorded += 1
    if len(self.step_s) >= 2 * self.max_steps:  # amortized: trim once per max_steps steps
      for name in _SAMPLES:
        del getattr(self, name)[:-self.max_steps]

  def since(self, mark: int) -> "StepLog":
    """The steps recorded after `num_recorded` was `mark` (ValueError if trimmed away)."""
    count = self.num_recorded - mark
    if not 0 <= count <= len(self.step_s):
      raise ValueError(f"steps since {mark} are no longer kept ({self.num_recorded} recorded, "
                       f"the newest {len(self.step_s)} kept)")
    start = len(self.step_s) - count
    return StepLog(self.max_steps, count,
                   **{name: getattr(self, name)[start:] for name in _SAMPLES})


def _fraction(flags) -> float:
  flags = list(flags)
  return sum(flags) / len(flags) if flags else 0.0


def summarize(requests: Sequence[RequestMetrics], steps: StepLog, wall_s: float, *,
              prefix_hit_tokens: int, prefix_queried_tokens: int,
              num_preemptions: int) -> dict:
  """One flat-ish dict of every metric over `requests` and the steps of a run."""
  done = [r for r in requests if r.token_times]
  out_tokens = sum(r.output_len for r in done)
  proposed = np.zeros(max([len(r.proposed) for r in done] + [0]))
  accepted = np.zeros_like(proposed)
  for r in done:
    proposed[:len(r.proposed)] += r.proposed
    accepted[:len(r.accepted)] += r.accepted
  verify_steps = sum(r.verify_steps for r in done)
  ttft = distribution(r.ttft_s for r in done)
  tpot = distribution(r.tpot_s for r in done if r.tpot_s is not None)
  return {
      "num_requests": len(done),
      "wall_s": wall_s,
      "ttft_s": ttft["mean"], "tpot_s": tpot["mean"],
      "ttft": ttft, "tpot": tpot,
      "itl": distribution(x for r in done for x in r.itls_s),
      # Tokens that reached the host in the same step as the one before (a multi-step
      # burst's, or a verify step's accepted drafts): their ITL reads 0 because the
      # host saw them together; this share says how much of "itl" that is.
      "itl_same_step_fraction": _fraction(x == 0 for r in done for x in r.itls_s),
      # Decode steps by the drafts their program verified (an adaptive policy's choices).
      "decode_steps_by_num_draft": dict(sorted(collections.Counter(
          k for k, d in zip(steps.num_draft, steps.decode_only) if d).items())),
      "e2e_latency": distribution(r.e2e_s for r in done),
      "request_throughput": len(done) / wall_s if wall_s else 0.0,
      "tokens_per_s": out_tokens / wall_s if wall_s else 0.0,
      "num_generated_tokens": out_tokens,
      "prompt_tokens": distribution(r.prompt_len for r in requests),
      "kv_pages_used": int(max(steps.pages_used, default=0)),
      "kv_utilization": distribution(steps.kv_utilization),
      "prefix_hit_tokens": prefix_hit_tokens,
      "prefix_hit_rate": prefix_hit_tokens / prefix_queried_tokens if prefix_queried_tokens
                         else 0.0,
      # None without speculation: there is nothing to accept.
      "acceptance_length": (sum(r.emitted for r in done) / verify_steps if verify_steps
                            else None),
      "acceptance_rate_per_position": [float(a / p) if p else 0.0
                                       for a, p in zip(accepted, proposed)],
      "acceptance_rate": float(accepted.sum() / proposed.sum()) if proposed.sum() else 0.0,
      "num_verify_steps": verify_steps,
      "num_preemptions": num_preemptions,
      "num_steps": len(steps.queue_depth),
      "queue_depth": distribution(steps.queue_depth),
      "running": distribution(steps.running),
      # One decode (or verify + draft) step of the whole batch: what C9 compares
      # (a multi-step burst counts as its mean step).
      "decode_step_s": distribution(t / n for t, d, n in zip(steps.step_s, steps.decode_only,
                                                             steps.num_steps) if d),
  }
