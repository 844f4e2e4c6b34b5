"""The engine's output processor: one step's device outputs -> per-request results ->
RequestOutputs with their metrics (kvjax/engine/engine.py runs it once per step).

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
from kvjax.engine.requests import Request, RequestOutput, ScheduledRow, TokenLogprob

__all__ = ["StepResult", "request_outputs", "record_prompt_logprobs"]


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


def record_prompt_logprobs(rows: list[ScheduledRow], prompt, scores: dict) -> None:
  """Add one group's prompt scores to `scores` (id -> [None, TokenLogprob | None, ...],
  one entry per prompt position, for the requests still owed theirs).  prompt: a host copy
  of a score_prompt program's Emitted.prompt ([1, B, T] ..., kvjax/runtime/serve_steps.py), whose
  column t of row j scores position rows[j].start + t + 1; positions past the prompt (a
  preempted request's recomputed outputs, the sampled column) are not prompt positions."""
  chosen, top_ids, top_logprobs = (x[0] for x in prompt)
  for j, row in enumerate(rows):
    owed = scores.get(row.request_id)
    if owed is None or row.is_decode:
      continue
    num_top = row.request.sampling.prompt_logprobs
    for t in range(len(row.token_ids)):
      position = row.start + t + 1
      if position < len(owed):
        owed[position] = TokenLogprob(float(chosen[j, t]),
                                      tuple(zip(top_ids[j, t, :num_top].tolist(),
                                                top_logprobs[j, t, :num_top].tolist())))


def request_outputs(result: StepResult, sampled: dict[str, Request], before: dict[str, int],
                    metrics: dict, constraints: ConstraintBook, now: float,
                    prompt_scores: dict) -> list:
  """RequestOutputs of the failed, then the sampled requests, after the scheduler applied
  `result` (before: each sampled request's output count until then).  Finished requests
  leave `metrics` and `constraints`; a sampled request's first output takes its complete
  prompt logprobs out of `prompt_scores` (a failed request's incomplete ones are dropped)."""
  outputs = []
  for req, good in result.broken:
    record = metrics.pop(req.request_id)
    record.record_tokens(len(good), now)
    record.finish_s = now
    error = constraints.failed.get(req.request_id)
    constraints.forget(req.request_id)
    prompt_scores.pop(req.request_id, None)
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
                                 None if logprobs is None else logprobs[:len(new)],
                                 prompt_logprobs=prompt_scores.pop(rid, None)))
  return outputs
