"""The HTTP routes of `kvjax serve` (FastAPI): OpenAI completions and chat, models,
health and Prometheus metrics, and the metadata a gateway reads.

A gateway in front of several servers (docs/DEPLOY.md: smg) probes /health, /v1/models
and SGLang's metadata routes, /server_info and /model_info (or /get_server_info and
/get_model_info): they say the served name, the context length, the KV pool's tokens
and the replica count.

A generation handler parses and checks its body (kvjax/server/protocol.py) in a
small thread pool, off the event loop: a huge prompt's JSON scan, its
tokenization, a chat template and a large grammar's compilation take seconds,
and /health and every stream keep being served meanwhile.  It then submits it to the
engine thread (kvjax/server/engine_loop.py) and awaits its
events on an asyncio queue that the engine thread fills through
`call_soon_threadsafe`.  A stream whose client goes away (the stream is
cancelled), a non-streamed request whose client goes away (polled while it
waits) and a handler that fails cancel their submission, which aborts the
requests and frees their pages.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib.metadata
import logging
from typing import Any, Optional

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvjax.engine.warm_up import BackgroundWarmUp
from kvjax.server.adapters import add_adapter_routes
from kvjax.server.engine_loop import EngineLoop, Failed, Submission
from kvjax.server.prom import ServerMetrics
from kvjax.server.protocol import (MAX_BODY_BYTES, Limits, OpenAIError, parse_chat,
                                   parse_completion, parse_json)
from kvjax.server.responses import Responses, sse

__all__ = ["ServerState", "create_app"]

_VERSION = importlib.metadata.version("kvjax")
_LOG = logging.getLogger("kvjax.server")
# Sent to no one: the status a handler returns for a client that left while its body was
# being read (nginx's "client closed request"), so the ASGI server logs no traceback.
_CLIENT_GONE = 499
_DISCONNECT_POLL_S = 0.05  # how often a non-streamed request checks that its client is there
_PARSE_THREADS = 4  # bodies parsed at once; more wait their turn (parsing is CPU work)


def _parse_pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(_PARSE_THREADS, thread_name_prefix="kvjax-parse")


@dataclasses.dataclass
class ServerState:
  """What the routes share: the engine thread, the request limits, the metrics."""

  loop: EngineLoop
  limits: Limits
  tokenizer: Any  # None: token ids only
  metrics: ServerMetrics
  created: int  # the served model's "created" timestamp
  ready: bool = False  # set once the server listens
  warm_up: Optional[BackgroundWarmUp] = None  # a background warm-up, running or done
  parsing: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
      default_factory=_parse_pool)  # where request bodies are parsed and tokenized


def create_app(state: ServerState) -> FastAPI:
  app = FastAPI(title="kvjax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(OpenAIError)
  async def openai_error(_: Request, error: OpenAIError):
    return JSONResponse(error.body(), status_code=error.status)

  @app.get("/health")
  async def health():
    """200 while the server answers: {"status": "ready"}, or "warming" with the background
    warm-up's progress (requests are served; one may compile), or "ready" with the progress
    of a warm-up that stopped early (kvjax/engine/warm_up.py); 503 once it stopped."""
    if not (state.ready and state.loop.alive):
      return JSONResponse({"status": "unavailable"}, status_code=503)
    warm_up = state.warm_up
    if warm_up is None or (warm_up.ready and not warm_up.stopped_early):
      return {"status": "ready"}
    progress = {"done": warm_up.done, "total": warm_up.total}
    if warm_up.ready or warm_up.error is not None:  # the rest compiles under requests
      return {"status": "ready", "warm_up": {**progress, "stopped_early": True}}
    return {"status": "warming", "warm_up": progress}

  @app.get("/v1/models")
  async def models():
    # The base model, then each loaded LoRA adapter (vLLM: root its path, parent the base).
    card = {"object": "model", "created": state.created, "owned_by": "kvjax",
            "max_model_len": state.limits.max_model_len}
    adapters = [{"id": name, **card, "root": loaded.path, "parent": state.limits.model_name}
                for name, loaded in list(state.limits.adapters.items())]
    return {"object": "list", "data": [{"id": state.limits.model_name, **card}, *adapters]}

  add_adapter_routes(app, state)

  @app.get("/server_info")
  @app.get("/get_server_info")
  async def server_info():
    engine = state.loop.engine
    replicas = getattr(engine, "engines", [engine])  # a Router's, or the one Engine
    return {"model_id": state.limits.model_name, "served_model_name": state.limits.model_name,
            "model_path": engine.model_config.name, "context_length": state.limits.max_model_len,
            "max_total_tokens": sum(e.config.num_pages * e.config.page_size for e in replicas),
            "dp_size": len(replicas), "is_embedding": False,
            "version": _VERSION, "engine": "kvjax"}

  @app.get("/model_info")
  @app.get("/get_model_info")
  async def model_info():
    return {"model_path": state.loop.engine.model_config.name, "is_generation": True,
            "has_image_understanding": False, "has_audio_understanding": False}

  @app.get("/metrics")
  async def metrics():
    return Response(state.metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _generate(state, request, parse_completion)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await _generate(state, request, parse_chat)

  return app


async def _generate(state: ServerState, http_request: Request, parse):
  loop = asyncio.get_running_loop()
  try:
    raw = await _body(http_request)
  except ClientDisconnect:
    _LOG.info("%s: the client left while its request body was being read",
              http_request.url.path)
    return Response(status_code=_CLIENT_GONE)
  request = await loop.run_in_executor(
      state.parsing, lambda: parse(parse_json(raw), state.limits, state.tokenizer))
  events: asyncio.Queue = asyncio.Queue()

  def deliver(event) -> None:  # called by the engine thread
    try:
      loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:  # the event loop has closed: the server stopped, nobody listens
      pass

  submission = Submission(request, deliver)
  if not state.loop.alive:
    raise OpenAIError("the engine is not running", status=503, kind="server_error")
  if not state.loop.submit(submission):
    raise OpenAIError(f"the server is at capacity ({state.loop.capacity} sequences: "
                      f"max_num_seqs + max_waiting={state.loop.max_waiting}); retry later",
                      status=503, kind="server_overloaded", code="queue_full")
  try:
    first = await events.get()
  except BaseException:
    state.loop.cancel(submission)
    raise
  if isinstance(first, Failed):
    raise first.error
  responses = Responses(request, request.lora or state.limits.model_name, state.tokenizer)
  if request.stream:
    return StreamingResponse(_stream(state.loop, submission, events, responses),
                             media_type="text/event-stream")
  return await _collect(state.loop, submission, events, responses, http_request)


async def _body(http_request: Request) -> bytes:
  """The request body, read no further than MAX_BODY_BYTES + 1 (parse_json refuses more)."""
  declared = http_request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
    raise OpenAIError(f"the request body is {declared} bytes; the limit is {MAX_BODY_BYTES}",
                      code="body_too_large")
  chunks, size = [], 0
  async for chunk in http_request.stream():
    chunks.append(chunk)
    size += len(chunk)
    if size > MAX_BODY_BYTES:
      break
  return b"".join(chunks)


async def _collect(engine_loop: EngineLoop, submission: Submission, events: asyncio.Queue,
                   responses: Responses, http_request: Request):
  """Await every choice's end -> the whole response (None if the client went away)."""
  k = submission.request.num_choices
  texts, reasons, counts = [""] * k, [None] * k, [0] * k
  ids, logprobs = [[] for _ in range(k)], [[] for _ in range(k)]
  prompt_logprobs = [None] * k  # the engine's, from each choice's first delta
  done = 0
  loop_time = asyncio.get_running_loop().time
  next_check = loop_time() + _DISCONNECT_POLL_S
  try:
    while done < k:
      # Checked on a clock, not only when the queue goes quiet: a busy engine can keep events
      # coming faster than the poll interval for the whole request.
      if loop_time() >= next_check:
        if await http_request.is_disconnected():
          return None
        next_check = loop_time() + _DISCONNECT_POLL_S
      try:
        event = await asyncio.wait_for(events.get(), max(next_check - loop_time(), 0.0))
      except asyncio.TimeoutError:
        continue
      if isinstance(event, Failed):
        raise event.error
      texts[event.index] += event.text
      ids[event.index] += event.token_ids
      logprobs[event.index] += event.logprobs or []
      if event.prompt_logprobs is not None:
        prompt_logprobs[event.index] = event.prompt_logprobs
      counts[event.index] = event.num_tokens
      if event.finish_reason is not None:
        reasons[event.index] = event.finish_reason
        done += 1
  finally:
    if done < k:
      engine_loop.cancel(submission)
  return responses.response(texts, ids, reasons, counts, logprobs, prompt_logprobs)


async def _stream(engine_loop: EngineLoop, submission: Submission, events: asyncio.Queue,
                  responses: Responses):
  """SSE chunks as the choices' text arrives, then usage (if asked) and [DONE]."""
  request = submission.request
  done = 0
  try:
    if request.chat:
      for index in range(request.num_choices):
        yield sse(responses.role_chunk(index))
    while done < request.num_choices:
      event = await events.get()
      if isinstance(event, Failed):
        yield sse(event.error.body())
        return
      done += event.finish_reason is not None
      yield sse(responses.chunk(event.index, event.text, event.token_ids, event.finish_reason,
                                event.logprobs, event.num_tokens, event.prompt_logprobs))
    if request.include_usage:
      yield sse(responses.usage_chunk())
    yield sse("[DONE]")
  finally:  # also when the client disconnects: the stream is cancelled mid-await
    if done < request.num_choices:
      engine_loop.cancel(submission)
