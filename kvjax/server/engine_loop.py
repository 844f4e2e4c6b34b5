"""The one thread that owns the Engine: admits submitted requests, steps, hands out text.

HTTP handlers never touch the Engine.  They `submit` a GenerationRequest with
a thread-safe `deliver` callback and receive, in order:
  Accepted            every choice is queued in the engine, or
  Failed(error)       nothing is (or no more is) coming: a bad request the Engine refused
                      (400), a choice whose constraint failed while decoding (400:
                      its text is no answer), an engine failure or a shutdown;
  Delta(...)          one choice's new text; its last carries the finish reason.
`cancel(submission)` (a client that went away) aborts its unfinished choices,
which frees their pages.  Detokenization and stop strings run here
(kvjax/server/text.py), so a stop string aborts its request in the engine
before the next step.

Admission is bounded in sequences, not requests: unfinished choices (n per
prompt, every prompt of a request) stay within max_num_seqs (what can run) +
max_waiting (what may wait), `capacity`.  `submit` returns False at once when a
submission's choices do not fit beside the unfinished ones, so a full server
answers 503 instead of queueing without end; a request asking for more than
`capacity` choices is refused earlier, as a 400 naming `n` (Limits.max_choices).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Optional

from kvjax.engine.requests import RequestStatus
from kvjax.server.prom import ServerMetrics
from kvjax.server.protocol import GenerationRequest, OpenAIError, engine_error_param
from kvjax.server.text import TextStream

__all__ = ["EngineLoop", "Submission", "Accepted", "Failed", "Delta"]

_IDLE_WAIT_S = 0.05  # how long the idle loop sleeps on its inbox before refreshing gauges


@dataclasses.dataclass(frozen=True)
class Accepted:
  pass


@dataclasses.dataclass(frozen=True)
class Failed:
  error: OpenAIError


@dataclasses.dataclass(frozen=True)
class Delta:
  index: int  # choice index: prompt * n + j
  text: str
  token_ids: list  # the new completion ids this text came from
  num_tokens: int  # completion tokens of the choice so far
  finish_reason: Optional[str]  # None until the choice's last delta
  logprobs: Optional[list] = None  # a kvjax.engine.requests.TokenLogprob per id, if asked
  prompt_logprobs: Optional[list] = None  # the engine's, on a choice's first delta, if asked


class Submission:
  """One HTTP request's choices; `deliver` must be safe to call from any thread."""

  def __init__(self, request: GenerationRequest, deliver: Callable[[object], None]):
    self.request = request
    self.deliver = deliver
    self.request_ids: list[str] = []  # the Engine's ids, set by the engine thread
    self.received_s = time.perf_counter()  # its arrival: TTFT and queue time count from here


@dataclasses.dataclass(eq=False)
class _Choice:
  submission: Submission
  index: int
  text: TextStream
  arrival_s: float
  queue_s: Optional[float] = None  # arrival to first scheduled
  started: bool = False  # its prompt tokens are counted
  # Why this loop ended it: "stop" (a stop string), "abort", "error" (its constraint failed).
  ended_by: Optional[str] = None


class EngineLoop:
  """Runs `engine` in a daemon thread between `start()` and `stop()`."""

  def __init__(self, engine, tokenizer, metrics: ServerMetrics, max_waiting: int):
    self.engine = engine
    self.tokenizer = tokenizer
    self.metrics = metrics
    self.max_waiting = max_waiting
    self.error: Optional[BaseException] = None  # what stopped the loop, if it failed
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()  # guards the admission counts
    self.capacity = engine.config.max_num_seqs + max_waiting  # unfinished choices at most
    self._unfinished = 0  # choices submitted and not finished (queued here included)
    self._queued = 0  # choices submitted, not yet added to the engine
    self._engine_waiting = 0  # the engine's waiting requests when last published
    self._choices: dict[str, _Choice] = {}  # by engine request id
    self._unscheduled: set[str] = set()
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._run, name="kvjax-engine-loop", daemon=True)
    eos = engine.model_config.eos_token_id
    self._eos_ids = set(getattr(tokenizer, "eos_ids", ())) | ({eos} if eos is not None else set())
    metrics.waiting.set_function(lambda: self.num_waiting)  # fresh even mid-step

  # -- any thread ---------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stop stepping; unfinished requests get Failed (503)."""
    self._stopping.set()
    self._inbox.put(None)
    self._thread.join(timeout_s)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stopping.is_set()

  @property
  def num_waiting(self) -> int:
    """Choices admitted but not running: queued for this thread or waiting in the engine."""
    with self._lock:
      return self._queued + self._engine_waiting

  def submit(self, submission: Submission) -> bool:
    """Queue a submission -> False (nothing queued) when the waiting bound is reached."""
    with self._lock:
      if not self.alive or self._unfinished + submission.request.num_choices > self.capacity:
        return False
      self._queued += submission.request.num_choices
      self._unfinished += submission.request.num_choices
    self._inbox.put(("submit", submission))
    return True

  def cancel(self, submission: Submission) -> None:
    """Abort a submission's unfinished choices (its client is gone)."""
    self._inbox.put(("cancel", submission))

  # -- the engine thread ----------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stopping.is_set():
        self._drain(block=not self.engine.has_unfinished)
        self._publish()  # admitted requests show before a step that may take long
        if self.engine.has_unfinished:
          start = time.perf_counter()
          outputs = self.engine.step()
          self._note_scheduled(start)
          self._dispatch(outputs)
          # Delivered: drop them now, not at the next step (after a mass abort the idle
          # loop would hold every aborted request's RequestOutput while it waits).
          del outputs
        self._publish()
      reason = OpenAIError("the server is shutting down", status=503, kind="server_error")
    except Exception as error:  # a bug: fail every request instead of hanging them
      logging.getLogger(__name__).exception("the engine loop failed")
      self.error = error
      reason = OpenAIError(f"the engine failed: {error!r}", status=500, kind="server_error")
    self._stopping.set()
    self._fail_all(reason)

  def _drain(self, block: bool) -> None:
    try:
      command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
      while True:
        if command is not None:
          kind, submission = command
          (self._admit if kind == "submit" else self._cancel)(submission)
        command = self._inbox.get_nowait()
    except queue.Empty:
      pass

  def _admit(self, submission: Submission) -> None:
    request = submission.request
    with self._lock:
      self._queued -= request.num_choices
    ids = []
    try:
      for i in range(request.num_choices):
        prompt = i // request.n
        # max_tokens 0 (echo: the prompt alone) samples one token, never shown: the engine
        # samples at the end of the prompt's last chunk anyway.
        ids.append(self.engine.add_request(
            request.prompts[prompt], max(1, request.max_tokens[prompt]),
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            seed=request.seeds[i % request.n], stop=list(request.stop_ids) or None,
            logprobs=request.logprobs, prompt_logprobs=request.scored_prompt,
            arrival_s=submission.received_s,
            constraint=request.constraint, lora=request.lora, **dict(request.extensions)))
    except ValueError as error:  # checks only the engine can make (e.g. the pool's size)
      for request_id in ids:
        self.engine.abort(request_id)
      with self._lock:
        self._unfinished -= request.num_choices
      submission.deliver(Failed(OpenAIError(str(error), engine_error_param(str(error)))))
      return
    submission.request_ids = ids
    stop_ids = self._eos_ids | set(request.stop_ids)
    for i, request_id in enumerate(ids):
      detokenizer = (self.tokenizer.detokenizer(request.skip_special_tokens) if self.tokenizer
                     else _NoText())
      text = TextStream(detokenizer, request.stop_strings, stop_ids, min_tokens=request.min_tokens,
                        include_stop=request.include_stop_str_in_output)
      self._choices[request_id] = _Choice(
          submission, i, text,
          self.engine.metrics[request_id].arrival_s)
    self._unscheduled.update(ids)
    submission.deliver(Accepted())

  def _cancel(self, submission: Submission) -> None:
    for request_id in submission.request_ids:
      choice = self._choices.get(request_id)
      if choice and choice.ended_by is None and choice.text.finish_reason is None:
        choice.ended_by = "abort"
        self.engine.abort(request_id)

  def _note_scheduled(self, step_start: float) -> None:
    """Queue time of the requests this step scheduled for the first time."""
    for request_id in list(self._unscheduled):
      req = self.engine.request(request_id)
      if req is None or req.status is not RequestStatus.WAITING:
        self._unscheduled.discard(request_id)
        choice = self._choices.get(request_id)
        if choice is not None and (req is not None or choice.ended_by is None):
          choice.queue_s = step_start - choice.arrival_s

  def _dispatch(self, outputs) -> None:
    for out in outputs:
      choice = self._choices.get(out.request_id)
      if choice is None:
        continue  # aborted by a rejected submission
      running = choice.ended_by is None and choice.text.finish_reason is None
      if out.error is not None and running:  # its text is no answer
        choice.ended_by = "error"
        field = choice.submission.request.constraint_field
        choice.submission.deliver(Failed(OpenAIError(
            f"{field}: the constraint failed while decoding: {out.error}", field)))
      if choice.ended_by is None and choice.text.finish_reason is None:
        if not choice.started and out.new_token_ids:
          choice.started = True
          self.metrics.prompt_tokens.inc(len(choice.submission.request.prompts[
              choice.index // choice.submission.request.n]))
        before = choice.text.num_tokens
        request = choice.submission.request
        prompt_only = request.max_tokens[choice.index // request.n] == 0
        text, reason = choice.text.push(
            [] if prompt_only else out.new_token_ids,
            ("length" if prompt_only else out.finish_reason) if out.finished else None)
        kept = out.new_token_ids[:choice.text.num_tokens - before]
        self.metrics.generation_tokens.inc(len(kept))
        if reason == "stop" and not out.finished:  # a stop string: no need to go on
          choice.ended_by = "stop"
          self.engine.abort(out.request_id)
        logprobs = None if out.new_logprobs is None else out.new_logprobs[:len(kept)]
        if text or kept or reason:
          choice.submission.deliver(Delta(choice.index, text, kept, choice.text.num_tokens,
                                          reason, logprobs, out.prompt_logprobs))
      if out.finished:
        with self._lock:
          self._unfinished -= 1
        del self._choices[out.request_id]
        self._unscheduled.discard(out.request_id)
        # The client's reason: a stop string's "stop" also when the engine's last output
        # held it; the engine's for the rest (a cancelled choice: "abort").
        self.metrics.record_finished(out.metrics, choice.text.finish_reason or out.finish_reason,
                                     choice.text.num_tokens, choice.queue_s)

  def _publish(self) -> None:
    stats = self.engine.stats()
    with self._lock:
      self._engine_waiting = stats.waiting
    self.metrics.observe_engine(stats)

  def _fail_all(self, error: OpenAIError) -> None:
    """Failed to every submission still owed an answer, queued ones included."""
    owed = {id(c.submission): c.submission for c in self._choices.values()
            if c.ended_by is None and c.text.finish_reason is None}
    try:
      while True:
        command = self._inbox.get_nowait()
        if command is not None and command[0] == "submit":
          owed[id(command[1])] = command[1]
    except queue.Empty:
      pass
    for submission in owed.values():
      submission.deliver(Failed(error))


class _NoText:
  """The detokenizer of a model without a tokenizer: ids only, no text."""

  def push(self, ids) -> str:
    return ""

  def flush(self) -> str:
    return ""
