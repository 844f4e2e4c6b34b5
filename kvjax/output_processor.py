"""The engine's output processor: one step's device outputs -> per-request results ->
RequestOutputs with their metrics (kvjax/engine.py runs it once per step).

`StepResult.read` takes a host copy of one launched group's Emitted [U, B, ...] and
drafted [U, B] (U = 1 but for a burst) and sorts its rows: ids for the scheduler, each
row's logprobs, each verify's (drafted, accepted) for the metrics and the draft policy,
and the rows whose logits went non-finite (kept with what they emitted before) or whose
constraint's matcher failed (what they sampled under its EOS-only mask is void).  After
the scheduler has applied the ids (stops, pages), `request_outputs` turns them into the
streaming unit: the new ids of each request, its final metrics once it finished.
"""
from __future__ import annotations

import dataclasses
from typing import Container, Optional

from kvjax.constraints import ConstraintBook
from kvjax.requests import Request, RequestOutput, ScheduledRow, TokenLogprob

__all__ = ["StepResult", "request_outputs"]


def _logprobs(emitted, row: int, counts, num_top: Optional[int]) -> Optional[list]:
  """One row's TokenLogprobs, in emission order, from a host copy of an Emitted [U, B, ...]."""
  if num_top is None:
    return None
  return [TokenLogprob(float(emitted.logprobs[s, row, c]),
                       tuple(zip(emitted.top_ids[s, row, c, :num_top].tolist(),
                                 emitted.top_logprobs[s, row, c, :num_top].tolist())))
          for s, n in enumerate(counts) for c in range(n)]


@dataclasses.dataclass
class StepResult:
  """One step's outputs by request."""

  new_ids: dict = dataclasses.field(default_factory=dict)  # id -> emitted ids (finite rows)
  new_logprobs: dict = dataclasses.field(default_factory=dict)  # id -> TokenLogprobs | None
  verified: list = dataclasses.field(default_factory=list)  # (id, drafted, accepted)
  broken: list = dataclasses.field(default_factory=list)  # (Request, ids emitted before)

  def read(self, rows: list[ScheduledRow], emitted, drafted, steps_run: int,
           failed_constraints: Container[str] = ()) -> None:
    """Add one group's rows (row j of the host copies is rows[j]); failed_constraints:
    the ids of requests whose matcher failed (ConstraintBook.failed)."""
    for j, row in enumerate(rows):
      failed = emitted.failed[:, j].any()
      void = row.request_id in failed_constraints
      if not (row.sample or failed):
        continue
      counts = emitted.counts[:steps_run, j]
      ids = [t for s, n in enumerate(counts) for t in emitted.tokens[s, j, :n].tolist()]
      self.new_logprobs[row.request_id] = _logprobs(emitted, j, counts,
                                                    row.request.sampling.logprobs)
      if failed or void:  # what it emitted before its logits broke is good
        self.broken.append((row.request, [] if void else ids))
      else:
        self.new_ids[row.request_id] = ids
        self.verified += [(row.request_id, int(drafted[s, j]), int(counts[s]) - 1)
                          for s in range(steps_run) if drafted[s, j]]


def request_outputs(result: StepResult, sampled: dict[str, Request], before: dict[str, int],
                    metrics: dict, constraints: ConstraintBook, now: float) -> list:
  """RequestOutputs of the failed, then the sampled requests, after the scheduler applied
  `result` (before: each sampled request's output count until then).  Finished requests
  leave `metrics` and `constraints`."""
  outputs = []
  for req, good in result.broken:
    record = metrics.pop(req.request_id)
    record.record_tokens(len(good), now)
    record.finish_s = now
    error = constraints.failed.get(req.request_id)
    constraints.forget(req.request_id)
    outputs.append(RequestOutput(req.request_id, good, list(req.output_ids), True,
                                 req.status.value, record, result.new_logprobs[req.request_id],
                                 error=error))
  for rid, req in sampled.items():
    new = req.output_ids[before[rid]:]
    record = metrics[rid]
    record.record_tokens(len(new), now)
    record.num_preemptions = req.num_preemptions
    finished = req.status.is_finished
    constraints.advance(rid, new, finished)
    if finished:
      record.finish_s = now
      del metrics[rid]
    logprobs = result.new_logprobs[rid]
    outputs.append(RequestOutput(rid, new, list(req.output_ids), finished,
                                 req.status.value if finished else None,
                                 record if finished else None,
                                 None if logprobs is None else logprobs[:len(new)]))
  return outputs
