"""`serve_in_thread`: a live server (engine thread + uvicorn thread) and its handle.

Builds the Engine (or, given one model per data-parallel replica, a
kvjax.Router over one Engine each: the engine thread drives it as it would
one Engine), warms it up, starts the engine thread and uvicorn, and
returns once the socket listens.  Port 0 picks a free port; `handle.port` is the
real one.  The warm-up decides what the first clients pay in XLA compilation:
"full" compiles every step program the engine can run, bursts in every stop-id
width (Engine.warm_up, kvjax/engine/warm_up.py SERVER_VARIANTS), so no request waits on a
compile; "background" compiles the same programs in a thread while the server
already answers, whenever no request is running (a request meeting a program not
yet compiled compiles it; /health says "warming" until the last one ran, then
"ready"); "minimal" runs two short requests, which compile the prefill, decode
and multi-step programs of short contexts only (a quick start for tests and
notebooks).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Mapping, Optional, Sequence, Union

import uvicorn

from kvjax.constraints.vocabulary import constraint_book
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.kv_events import KVEventPublisher, replica_endpoint
from kvjax.engine.router import Router
from kvjax.engine.validation import check_int
from kvjax.engine.warm_up import SERVER_VARIANTS, WARM_UP_MODES, BackgroundWarmUp, WarmUp
from kvjax.server.adapters import load_on_every_replica
from kvjax.server.app import ServerState, create_app
from kvjax.server.engine_loop import EngineLoop
from kvjax.server.prom import ServerMetrics
from kvjax.server.protocol import Limits

__all__ = ["ServerHandle", "serve_in_thread"]

_START_TIMEOUT_S = 60.0
_WARMUP_PROMPT_LEN = 3  # shorter than a page: the warm-up leaves no prefix-cache block


class ServerHandle:
  """A running server: `.url` (the OpenAI base URL, ending in /v1), `.root` (where
  /health and /metrics live), `.port`, `.engine` (the Engine or the replicas' Router; to
  inspect, not to drive), `.stop()`,
  `.warm_up` (a full or finished background warm-up's kvjax.engine.warm_up.WarmUp: programs
  compiled, seconds; None after a minimal one or while a background one runs),
  `.wait_ready(timeout_s)`.  Also a context manager that stops the server on exit."""

  def __init__(self, server: uvicorn.Server, thread: threading.Thread, loop: EngineLoop,
               state: ServerState, host: str, port: int, warm_up: Optional[WarmUp] = None):
    self._server, self._thread, self._loop, self.state = server, thread, loop, state
    self._warm_up = warm_up
    self.kv_events: list = []  # kvjax.engine.kv_events.KVEventPublisher per replica
    self.port = port
    self.root = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    self.url = self.root + "/v1"
    self.engine = loop.engine
    self.model_name = state.limits.model_name

  @property
  def warm_up(self) -> Optional[WarmUp]:
    background = self.state.warm_up
    return self._warm_up if background is None else background.result

  def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
    """Block until a background warm-up finished (at once for the others) -> ready?"""
    return self.state.warm_up is None or self.state.warm_up.wait(timeout_s)

  def stop(self) -> None:
    """Fail what is still running (503), then close the socket; idempotent."""
    self.state.ready = False
    if self.state.warm_up is not None:
      self.state.warm_up.stop()
    self._loop.stop()
    self._server.should_exit = True
    self._thread.join(_START_TIMEOUT_S)
    self.state.parsing.shutdown(wait=False, cancel_futures=True)
    for publisher in self.kv_events:
      publisher.close()
    self.kv_events = []

  def __enter__(self) -> "ServerHandle":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def serve_in_thread(model: Union[object, Sequence], engine_config: Optional[EngineConfig] = None,
                    *, host: str = "127.0.0.1", port: int = 0,
                    served_model_name: Optional[str] = None, max_waiting: int = 256,
                    warm_up: str = "minimal", router_policy: str = "prefix",
                    vllm_metrics: bool = False, kv_events: Optional[str] = None,
                    loras: Optional[Mapping[str, str]] = None) -> ServerHandle:
  """Serve `model` over HTTP from background threads -> a ServerHandle.

  model: a kvjax.Model, or a list of them, one per data-parallel replica (each
  on its own devices), served behind a kvjax.Router with `router_policy`.
  max_waiting: sequences (each prompt's n choices) that may wait beyond the max_num_seqs
  running ones (of every replica); beyond that the server answers 503 at once, and a
  request of more sequences than both together gets 400 naming `n`.  served_model_name:
  the `model` field clients send (default: the model config's name).  warm_up:
  "background" (`python -m kvjax serve`'s default), "full" (with a progress bar) or
  "minimal" (see the module doc).
  vllm_metrics: /metrics also under vLLM's vllm: names (kvjax/server/prom.py).
  kv_events: a ZMQ endpoint where each replica's prefix cache publishes vLLM's KV events
  (kvjax/engine/kv_events.py; replica i at kv_events.replica_endpoint(kv_events, i)).
  loras: {name: PEFT adapter directory} loaded before serving, each a `model` requests may
  name (engine_config.max_loras slots; POST /v1/load_lora_adapter adds more).
  """
  check_int("max_waiting", max_waiting, 0)
  check_int("port", port, 0, 65536)
  if warm_up not in WARM_UP_MODES:
    raise ValueError(f"warm_up must be one of {WARM_UP_MODES}, got {warm_up!r}")
  models = list(model) if isinstance(model, (list, tuple)) else [model]
  engines = [Engine(m, engine_config) for m in models]
  for m, e in zip(models, engines):  # structured outputs need the model's EOS and tokenizer
    if m.tokenizer is not None and m.config.eos_token_id is not None:
      e.constraints = constraint_book(m.tokenizer, m.config)
  engine = engines[0] if len(engines) == 1 else Router(engines, router_policy)
  for lora_name, path in (loras or {}).items():
    load_on_every_replica(engine, lora_name, path)
  warmed = None
  if warm_up == "full":
    runs = [e.warm_up(progress=f"warm-up (compiling step programs){_of(i, engines)}",
                      **SERVER_VARIANTS) for i, e in enumerate(engines)]
    warmed = dataclasses.replace(runs[0], programs=sum(r.programs for r in runs),
                                 runs=sum(r.runs for r in runs),
                                 seconds=sum(r.seconds for r in runs))
  elif warm_up == "minimal":
    for e in engines:
      _warm_up(e)
  publishers = [] if kv_events is None else [
      KVEventPublisher(replica_endpoint(kv_events, i), e.config.page_size,
                       data_parallel_rank=i).attach(cache)
      for i, e in enumerate(engines) for cache in e.prefix_caches()]
  model = models[0]
  name = served_model_name or model.config.name
  metrics = ServerMetrics(name, max_model_len=engine.config.max_model_len,
                          max_num_seqs=engine.config.max_num_seqs, vllm_names=vllm_metrics)
  tokenizer = model.tokenizer
  loop = EngineLoop(engine, tokenizer, metrics, max_waiting)
  state = ServerState(loop, Limits(name, model.config.vocab_size, engine.config.max_model_len,
                                   max_choices=loop.capacity, adapters=engines[0].adapters),
                      tokenizer, metrics, created=int(time.time()))
  if warm_up == "background":  # the engine thread's requests go first (kvjax/engine/warm_up.py)
    state.warm_up = BackgroundWarmUp([e.warm_up_plan(**SERVER_VARIANTS) for e in engines],
                                     busy=lambda: engine.has_unfinished or loop.num_waiting > 0)
  server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=port,
                                         log_level="warning", access_log=False,
                                         lifespan="off", timeout_graceful_shutdown=5))
  thread = threading.Thread(target=server.run, name="kvjax-http", daemon=True)
  loop.start()
  thread.start()
  deadline = time.monotonic() + _START_TIMEOUT_S
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      loop.stop()
      server.should_exit = True
      raise OSError(f"the server could not listen on {host}:{port}")
    time.sleep(0.01)
  bound = server.servers[0].sockets[0].getsockname()[1]
  state.ready = True
  if state.warm_up is not None:
    state.warm_up.start()
  handle = ServerHandle(server, thread, loop, state, host, bound, warmed)
  handle.kv_events = publishers
  return handle


def _of(replica: int, engines: list) -> str:
  return f", replica {replica}" if len(engines) > 1 else ""


def _warm_up(engine: Engine) -> None:
  """The minimal warm-up: the prefill, decode and multi-step programs of two short requests.

  The second joins once the first has its first token, so one step decodes beside a
  prefill: the single-step decode program, which concurrent traffic meets at once
  (alone, a request's decode steps all run as multi-step bursts).  Longer contexts
  (wider block tables) and other row buckets still compile when they first come.
  """
  engine.add_request([0] * _WARMUP_PROMPT_LEN, 4)
  engine.step()
  engine.add_request([1] * _WARMUP_PROMPT_LEN, 4)
  while engine.has_unfinished:
    engine.step()
