"""The request vocabulary shared by the scheduler, the engine and their callers.

A `Request` is one request's host state (only the scheduler writes it); a
`SchedulerOutput` is one step's plan: `ScheduledRow`s (which tokens a row
feeds, from where, into which slot) and `PageCopy`s (token-mode prefix hits);
a `RequestOutput` is what a step hands back per request (the streaming unit).
`SamplingOptions` are a request's validated sampling parameters.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Optional, Sequence

import numpy as np

__all__ = ["RequestStatus", "Request", "ScheduledRow", "PageCopy", "SchedulerOutput",
           "RequestOutput", "TokenLogprob", "SamplingOptions"]


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """One request's sampling parameters, as Engine.add_request validated them."""

  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int = 0  # folded with each position (kvjax/runtime/sampling.py)
  logprobs: Optional[int] = None  # report each token's log p and this many alternatives
  prompt_logprobs: Optional[int] = None  # the same for each prompt position after the first
  # vLLM's extensions (kvjax/runtime/logit_processors.py applies all but ignore_eos on the device):
  ignore_eos: bool = False  # EOS does not end the request (max_new_tokens or a stop id does)
  min_tokens: int = 0  # no stop id (EOS included) before this many tokens
  repetition_penalty: float = 1.0  # 1: off
  presence_penalty: float = 0.0  # 0: off
  frequency_penalty: float = 0.0  # 0: off
  logit_bias: tuple = ()  # ((token id, bias), ...), OpenAI's logit_bias
  min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (0: off)

  @property
  def processed(self) -> bool:
    """Does a step need logit processing for this request (kvjax/runtime/logit_processors.py)?"""
    return bool(self.min_tokens or self.repetition_penalty != 1.0 or self.presence_penalty
                or self.frequency_penalty or self.logit_bias or self.min_p)


class RequestStatus(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  PREEMPTED = "preempted"  # waiting again, to be recomputed
  FINISHED_STOPPED = "stop"  # eos or a stop token
  FINISHED_LENGTH = "length"  # max_new_tokens reached
  FINISHED_ABORTED = "abort"
  FINISHED_ERROR = "error"  # the model's logits for this request went non-finite

  @property
  def is_finished(self) -> bool:
    return self.name.startswith("FINISHED")


@dataclasses.dataclass(eq=False)
class Request:
  """A request's host state; the engine reads it, only the scheduler writes."""

  request_id: str
  prompt_ids: tuple[int, ...]
  max_new_tokens: int
  stop_token_ids: frozenset[int] = frozenset()
  cache_salt: Optional[str] = None
  sampling: Any = None  # SamplingOptions; never read by the scheduler
  token_ids: list[int] = dataclasses.field(init=False)  # prompt + generated
  num_computed_tokens: int = 0  # leading tokens whose KV is in `pages`
  pages: list[int] = dataclasses.field(default_factory=list)  # block table
  # The block tables of KV layer groups 1, 2, ... (kvjax/caches/groups.py); `pages` is
  # group 0's.  Empty: the engine keeps one pool.
  group_pages: list[list[int]] = dataclasses.field(default_factory=list)
  slot: Optional[int] = None  # row in the engine's per-sequence state
  status: RequestStatus = RequestStatus.WAITING
  num_cached_tokens: int = 0  # prefix-hit tokens at the last admission
  num_preemptions: int = 0
  is_decoding: bool = False  # last row sampled: the next row may verify drafts
  # False: admission looks up no prefix hit, so every prompt position is computed (and
  # scored: prompt logprobs); its blocks still enter the cache for others.
  takes_prefix_hits: bool = True
  block_hashes: list[bytes] = dataclasses.field(default_factory=list)
  lora_slot: int = 0  # its LoRA adapter's slot (kvjax/lora/); 0: the base model
  num_cached_blocks: int = 0  # leading blocks already offered to the cache

  def __post_init__(self):
    self.token_ids = list(self.prompt_ids)

  @property
  def num_tokens(self) -> int:
    return len(self.token_ids)

  @property
  def num_output_tokens(self) -> int:
    return len(self.token_ids) - len(self.prompt_ids)

  @property
  def output_ids(self) -> list[int]:
    """Generated ids, including a final stop token if one ended the request."""
    return self.token_ids[len(self.prompt_ids):]


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
  """One sequence's work in a step.

  Attributes:
    request: the request (read-only for the engine).
    slot: the request's row in the engine's per-sequence state.
    start: position of the first token fed (= tokens already in the cache).
    num_tokens: positions written this step, draft slots included (a burst
      row: every position its num_steps steps may write, pages reserved).
    num_draft: trailing draft slots the engine fills with its own drafts (a
      burst row: in its first step).
    token_ids: [num_tokens - num_draft] int32 known ids to feed.
    sample: the last known position yields a token (end of a prefill or a
      decode/verify row); otherwise it is a mid-prompt chunk.
    is_decode: a steady-decode row (may carry drafts), not a prefill chunk.
    num_steps: decode steps this row may run in a burst (1: a single step).
  """

  request: Request
  slot: int
  start: int
  num_tokens: int
  num_draft: int
  token_ids: np.ndarray
  sample: bool
  is_decode: bool
  num_steps: int = 1

  @property
  def request_id(self) -> str:
    return self.request.request_id


@dataclasses.dataclass(frozen=True)
class PageCopy:
  """Token-mode prefix hit: copy page `src` into `dst` before the forward."""

  src: int
  dst: int
  num_tokens: int  # leading tokens of `src` that are reused


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """A step plan; rows are decode rows first, then prefill chunks.

  Attributes:
    rows: scheduled rows (B of them).
    block_tables: [B, max_pages_per_seq] int32 page ids, padded with the null
      page so every gather stays in bounds and padded writes land nowhere.
    seq_lens: [B] int32 KV length of each row after this step (start +
      num_tokens, draft slots included).
    copies: page copies for token-mode prefix hits, to apply first.
    group_tables: each KV layer group's [B, max_pages_per_seq] table, group 0's first
      (kvjax/caches/groups.py); empty where the engine keeps one pool.
    preempted_ids: requests preempted this step (their slots are free).
    num_batched_tokens: positions one forward of the step computes, <=
      max_num_batched_tokens (a burst: its first step's).
    num_steps: decode steps of a burst plan (1: a single step).
  """

  rows: tuple[ScheduledRow, ...]
  block_tables: np.ndarray
  seq_lens: np.ndarray
  copies: tuple[PageCopy, ...]
  preempted_ids: tuple[str, ...]
  num_batched_tokens: int
  num_steps: int = 1
  group_tables: tuple = ()

  def check_new_ids(self, new_token_ids: Mapping[str, Sequence[int]]) -> None:
    """ValueError unless `new_token_ids` is what this plan's rows can have sampled: 1 to
    1 + num_draft ids (a burst row: up to num_tokens) for every sampling row of a request
    still running, none for mid-prompt chunks or requests outside the plan."""
    by_id = {row.request_id: row for row in self.rows}
    for rid, ids in new_token_ids.items():
      row = by_id.get(rid)
      if row is None:
        raise ValueError(f"token ids for request {rid!r}, not in this step")
      if len(ids) and not row.sample:
        raise ValueError(f"request {rid!r} was a mid-prompt chunk; it samples nothing")
      most = row.num_tokens - len(row.token_ids) + 1
      if row.sample and not 1 <= len(ids) <= most:
        raise ValueError(f"request {rid!r} needs 1..{most} new ids, got {len(ids)}")
    missing = [r.request_id for r in self.rows
               if r.sample and r.request_id not in new_token_ids
               and r.request.status is RequestStatus.RUNNING]
    if missing:
      raise ValueError(f"no sampled ids for requests {missing}")

  @property
  def decode_rows(self) -> tuple[ScheduledRow, ...]:
    return tuple(r for r in self.rows if r.is_decode)

  @property
  def prefill_rows(self) -> tuple[ScheduledRow, ...]:
    return tuple(r for r in self.rows if not r.is_decode)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What a step produced for one request (the streaming unit)."""

  request_id: str
  new_token_ids: list  # ids appended this step
  output_ids: list  # every id generated so far
  finished: bool
  finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" once finished
  metrics: Any = None  # the request's RequestMetrics (kvjax/engine/metrics.py), once finished
  new_logprobs: Optional[list] = None  # a TokenLogprob per new id, if the request asked
  error: Optional[str] = None  # finish_reason "error" from a failed constraint: why
  # vLLM's prompt_logprobs, on a request's first output if it asked: None for the first
  # prompt position, then a TokenLogprob of each prompt id given the ids before it.
  prompt_logprobs: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """An emitted id's log-probability under the model's raw distribution (before
  temperature and top-k/top-p, as vLLM reports it) and the likeliest ids there."""

  logprob: float
  top: tuple  # ((id, logprob), ...), most likely first, as many as the request asked
