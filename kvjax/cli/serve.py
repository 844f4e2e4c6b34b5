"""`python -m kvjax serve`: the OpenAI-compatible HTTP server (kvjax/server/).

  python -m kvjax serve --checkpoint ./hf_llama --port 8000 --served-model-name llama \
      --max-waiting 64 --max-num-seqs 16
  python -m kvjax serve --checkpoint smollm2-135m-instruct --weight-dtype int8

Loads the model, prints one line to stdout, `kvjax serving <name> at
http://<host>:<port>/v1` (the real port when --port is 0), and serves until SIGINT
or SIGTERM.  --warm-up background (the default) compiles every step program the
engine can run (each serves every sampling option) while it already serves (/health says
"warming", then "ready"; a line on stderr says when); --warm-up full compiles them
first (a progress bar), before that line; --warm-up minimal only what two short
requests run (the rest compiles under the first clients).  Compiled programs go
to --compile-cache, so the next start of the same settings loads them.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from kvjax.cli.checkpoint import add_checkpoint_flags
from kvjax.engine.config import add_engine_flags, engine_config_from_flags
from kvjax.engine.warm_up import WARM_UP_MODES
from kvjax.parallel import distributed
from kvjax.runtime.xla_options import add_compile_cache_flag, use_compile_cache, xla_compile_counts

__all__ = ["add_parser", "run", "SERVE_SCHEDULER_STEPS"]

SERVE_SCHEDULER_STEPS = 1  # the server's default: smooth streams (ITL ~= TPOT), see below


def add_parser(subparsers) -> argparse.ArgumentParser:
  """Registers the `serve` sub-command on an argparse `subparsers` object."""
  p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                            description=__doc__.splitlines()[0])
  add_checkpoint_flags(p)
  p.add_argument("--dtype", default="float32",
                 help="floating-point weights: float32 | bfloat16 | float16 (or fp32 | bf16 | "
                      "fp16) (default: %(default)s)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
  p.add_argument("--port", type=int, default=8000,
                 help="port, 0: any free port (default: %(default)s)")
  p.add_argument("--served-model-name", default=None,
                 help="the `model` clients send (default: the model config's name)")
  p.add_argument("--max-waiting", type=int, default=256,
                 help="sequences (prompts x n) that may wait beyond the --max-num-seqs running "
                      "ones; more get 503 (default: %(default)s)")
  p.add_argument("--warm-up", choices=WARM_UP_MODES, default="background",
                 help="background: serve at once and compile every step program while "
                      "idle, /health says warming until done; full: "
                      "compile them all before serving; minimal: only two short requests' "
                      "programs (default: %(default)s)")
  p.add_argument("--vllm-metrics", action=argparse.BooleanOptionalAction, default=False,
                 help="/metrics also under vLLM's names (vllm:num_requests_waiting, ...), for "
                      "routers that read them, such as llm-d's (default: kvjax: names only)")
  p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                 help="publish vLLM-format KV events of the prefix cache on this ZMQ endpoint "
                      "(tcp://*:5557 binds), for KV-aware routers such as llm-d's or Dynamo's; "
                      "needs pyzmq and msgpack (default: off)")
  p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR", type=_lora_flag,
                 help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable; "
                      "--max-loras defaults to their count)")
  add_compile_cache_flag(p)
  add_engine_flags(p)
  # One decode step per device call: a burst's tokens reach clients together, so streams
  # would arrive in clumps (tiny default model, 16 x 128 -> 128 over HTTP, 2 shared cores:
  # 16 steps ITL p50 26-31 ms beside TPOT 1.8 ms, ~3,000 tok/s; 4 steps 12 ms / 4.8 ms;
  # 1 step 4.6 ms / 4.7 ms, ~1,500 tok/s).  Throughput-bound serving: --num-scheduler-steps 16.
  p.set_defaults(num_scheduler_steps=SERVE_SCHEDULER_STEPS)
  distributed.add_parallel_flags(p)
  p.set_defaults(func=run)
  return p


def _lora_flag(text: str) -> tuple:
  """--lora NAME=DIR -> (NAME, DIR)."""
  name, equals, directory = text.partition("=")
  if not (name and equals and directory):
    raise argparse.ArgumentTypeError(f"--lora takes NAME=DIR, got {text!r}")
  return name, directory


def run(args: argparse.Namespace) -> int:
  from kvjax.server import serve_in_thread

  start = time.perf_counter()
  use_compile_cache(args.compile_cache)
  xla_compile_counts()  # counting starts here
  models = distributed.load_replicas(args, args.checkpoint, args.dtype, args.weight_dtype)
  loras = dict(args.lora)
  config = engine_config_from_flags(args, max_loras=args.max_loras or len(loras))
  handle = serve_in_thread(models, config, host=args.host,
                           port=args.port, served_model_name=args.served_model_name,
                           max_waiting=args.max_waiting, warm_up=args.warm_up,
                           router_policy=args.router_policy, vllm_metrics=args.vllm_metrics,
                           kv_events=args.kv_events, loras=loras)
  if handle.warm_up is not None:
    _report_warm_up(handle, start)
  elif args.warm_up == "background":
    threading.Thread(target=lambda: handle.wait_ready() and _report_warm_up(handle, start),
                     name="kvjax-ready-line", daemon=True).start()
  stopped = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stopped.set())
  print(f"kvjax: listening {time.perf_counter() - start:.1f} s after start", file=sys.stderr,
        flush=True)
  print(f"kvjax serving {handle.model_name} at {handle.url}", flush=True)
  with handle:
    stopped.wait()
  return 0


def _report_warm_up(handle, start: float) -> None:
  compiled, loaded = xla_compile_counts()
  background = handle.state.warm_up
  of = "" if background is None else f" of {background.total}"
  early = (" (stopped at half the process's memory-map limit: the rest compile under "
           "requests)") if background is not None and background.stopped_early else ""
  print(f"kvjax warm-up: {handle.warm_up.runs}{of} step programs run in "
        f"{handle.warm_up.seconds:.1f} s{early}; XLA compiled {compiled} programs, loaded "
        f"{loaded} from the compile cache; ready {time.perf_counter() - start:.1f} s after start",
        file=sys.stderr, flush=True)
