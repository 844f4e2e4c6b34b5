"""`python -m kvjax bench`: serving workloads through the Engine or a running server.

(The benchmark of claims C8, C14, C15 and C18.)

Workloads (kvjax/server/bench/workloads.py: random, shared-system-prompt, multi-turn-chat,
structured) arrive at once; a chat's next turn arrives when its previous turn
finishes.  With --range-ratio r (vLLM's random dataset), each request's input and
output lengths are drawn uniformly from [len x (1 - r), len x (1 + r)].  The
structured workload's answers follow JSON schemas (over HTTP as response_format);
the summary counts answers that end and parse.  A warm-up pass of the same workload
on a throwaway engine compiles every shape first, so timings exclude compiles.
Writes <out-dir>/bench_<workload>.json and .png and prints a table.

With --url the same workloads go over HTTP to a running server
(kvjax/server/bench/client.py: --request-rate Poisson arrivals, --burstiness gamma,
--max-concurrency, --goodput ttft:MS tpot:MS e2el:MS), timed by the client;
--checkpoint then only names the tokenizer (vocabulary, answers back to ids
for multi-turn chats).  Writes <out-dir>/bench_http_<workload>.json (read by
`python -m kvjax diagnose --bench-json`) and .png.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from typing import Optional, Sequence

import numpy as np

from kvjax.cli.checkpoint import add_checkpoint_flags
from kvjax.parallel import distributed
from kvjax.server.bench.workloads import WORKLOADS, Session, make_workload, structured_counts

__all__ = ["run_workload", "with_constraints", "add_parser", "run"]


def run_workload(engine, sessions: Sequence[Session], *, progress: Optional[str] = None,
                 **sampling) -> dict:
  """Serve every session to completion through `engine` (an Engine, or a kvjax.Router of
  replicas) -> metrics summary plus per-turn TTFTs.

  Returns kvjax.engine.metrics.summarize's dict with "turn_ttft_s" (mean TTFT per
  turn index), "outputs" (per session, per turn output ids) and "finish_reasons"
  (alike).  A session with a schema answers under it (set engine.constraints first:
  with_constraints).  `progress`: a progress bar with this label (requests done, rate).
  """
  from kvjax.constraints import Constraint
  from kvjax.engine.metrics import summarize

  total = sum(len(s.turns) for s in sessions)
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=total, unit="req", desc=progress)
  history = [[] for _ in sessions]
  outputs = [[] for _ in sessions]
  reasons = [[] for _ in sessions]
  owner: dict[str, tuple[int, int]] = {}
  finals = {}  # request id -> its final RequestOutput (with its metrics)

  def submit(i: int) -> None:
    turn = len(outputs[i])
    history[i] += sessions[i].turns[turn]
    schema = sessions[i].schema
    constraint = None if schema is None else Constraint("json_schema", schema)
    rid = engine.add_request(history[i], sessions[i].max_new_tokens, constraint=constraint,
                             **sampling)
    owner[rid] = (i, turn)

  before = engine.stats()
  mark = engine.steps.num_recorded
  start = time.perf_counter()
  for i in range(len(sessions)):
    submit(i)
  while engine.has_unfinished:
    for out in engine.step():
      if not out.finished or out.request_id not in owner:
        continue
      finals[out.request_id] = out
      i, _ = owner[out.request_id]
      outputs[i].append(out.output_ids)
      reasons[i].append(out.finish_reason)
      history[i] += out.output_ids
      if bar is not None:
        bar.update(1)
      if len(outputs[i]) < len(sessions[i].turns):
        submit(i)
  wall = time.perf_counter() - start
  if bar is not None:
    bar.close()
  steps = engine.steps.since(mark)
  metrics = [finals[rid].metrics for rid in owner]
  summary = summarize(metrics, steps, wall, **engine.stats().counted_since(before))
  num_turns = max(len(s.turns) for s in sessions)
  per_turn = [[m.ttft_s for rid, m in zip(owner, metrics) if owner[rid][1] == t]
              for t in range(num_turns)]
  summary["turn_ttft_s"] = [float(np.mean(x)) for x in per_turn]
  summary["turn_prompt_tokens"] = [float(np.mean([m.prompt_len for rid, m in
                                                  zip(owner, metrics) if owner[rid][1] == t]))
                                   for t in range(num_turns)]
  summary["outputs"] = outputs
  summary["finish_reasons"] = reasons
  return summary


def with_constraints(engine, model):
  """`engine` (an Engine or a Router of them) with a ConstraintBook for `model`'s
  vocabulary, which constrained requests need."""
  from kvjax.constraints.vocabulary import constraint_book

  if model.tokenizer is None or model.config.eos_token_id is None:
    raise ValueError(f"the structured workload needs a model with a tokenizer and an EOS "
                     f"id; {model.config.name!r} has "
                     f"{'no tokenizer' if model.tokenizer is None else 'no EOS id'}")
  for replica in getattr(engine, "engines", [engine]):
    replica.constraints = constraint_book(model.tokenizer, model.config)
  return engine


def add_parser(subparsers) -> argparse.ArgumentParser:
  """Registers the `bench` sub-command on an argparse `subparsers` object."""
  p = subparsers.add_parser("bench", help="serving benchmark through the Engine or a server",
                            description=__doc__.splitlines()[0])
  p.add_argument("--workload", default="random", choices=WORKLOADS,
                 help="what the requests look like (default: %(default)s)")
  add_checkpoint_flags(p)
  p.add_argument("--num-requests", "--num-prompts", type=int, default=16,
                 help="requests (chats) to serve (default: %(default)s)")
  p.add_argument("--input-len", type=int, default=128,
                 help="prompt (user message) tokens (default: %(default)s)")
  p.add_argument("--output-len", type=int, default=64,
                 help="new tokens per request (default: %(default)s)")
  p.add_argument("--system-len", type=int, default=256,
                 help="shared system prompt tokens (default: %(default)s)")
  p.add_argument("--num-turns", type=int, default=10,
                 help="turns per chat (default: %(default)s)")
  p.add_argument("--range-ratio", type=float, default=0.0,
                 help="lengths uniform in [len x (1 - r), len x (1 + r)] (default: "
                      "%(default)s, fixed lengths)")
  from kvjax.engine.config import add_engine_flags  # lazy: `kvjax --help` imports no jax

  add_engine_flags(p)
  distributed.add_parallel_flags(p)
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature (default: %(default)s, greedy)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the prompts and the sampling (default: %(default)s)")
  p.add_argument("--no-warmup", action="store_true",
                 help="time compiles too (default: compile every shape first, untimed)")
  p.add_argument("--out-dir", default="bench_results",
                 help="where the JSON and PNG go; the repo's results/ holds only the "
                      "experiments' committed runs (default: %(default)s)")
  http = p.add_argument_group("HTTP mode (bench a running server)")
  http.add_argument("--url", default=None,
                    help="server URL, its root or its /v1 base (default: none, bench an "
                         "in-process Engine)")
  http.add_argument("--request-rate", type=float, default=math.inf,
                    help="sessions per second (default: inf, all at once)")
  http.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrival gaps (default: %(default)s, Poisson)")
  http.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight at most (default: unlimited)")
  http.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                    help="targets a good request meets: ttft:MS tpot:MS e2el:MS (default: "
                         "none, no goodput)")
  http.add_argument("--model", default=None, help="served model name (default: the first one "
                                                   "GET /v1/models lists)")
  http.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds per request (default: %(default)s)")
  p.set_defaults(func=run)
  return p


_TABLE = (("requests", "num_requests", "{:.0f}"), ("wall s", "wall_s", "{:.2f}"),
          ("output tok/s", "tokens_per_s", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
          ("TTFT mean ms", ("ttft", "mean"), "{:.1f}"), ("TTFT p99 ms", ("ttft", "p99"), "{:.1f}"),
          ("TPOT mean ms", ("tpot", "mean"), "{:.2f}"), ("ITL p99 ms", ("itl", "p99"), "{:.2f}"),
          ("ITL same-step share", "itl_same_step_fraction", "{:.2f}"),
          ("e2e mean s", ("e2e_latency", "mean"), "{:.2f}"),
          ("KV util mean", ("kv_utilization", "mean"), "{:.2f}"),
          ("KV pages peak", "kv_pages_used", "{:.0f}"),
          ("prefix hit rate", "prefix_hit_rate", "{:.3f}"),
          ("acceptance len", "acceptance_length", "{:.2f}"),
          ("preemptions", "num_preemptions", "{:.0f}"),
          ("queue depth mean", ("queue_depth", "mean"), "{:.1f}"))


def _structured_line(counts: dict) -> str:
  return (f"  structured: {counts['ended']} of {counts['requests']} answers ended, "
          f"{counts['ended_valid']} of them valid JSON of their schema; "
          f"{counts['cut_at_length']} cut at --output-len")


def format_table(summary: dict) -> str:
  lines = []
  for label, key, fmt in _TABLE:
    value = summary.get(key) if isinstance(key, str) else summary[key[0]][key[1]]
    if value is None:  # e.g. the acceptance length of a run without speculation
      continue
    if "ms" in label:
      value *= 1e3
    lines.append(f"  {label:<18} {fmt.format(value)}")
  return "\n".join(lines)


def _plot(summary: dict, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  turns = np.arange(1, len(summary["turn_ttft_s"]) + 1)
  left.plot(turns, np.asarray(summary["turn_ttft_s"]) * 1e3, "o-")
  left.set(xlabel="turn", ylabel="mean TTFT (ms)", title="TTFT per turn (C15)")
  right.bar(["TTFT", "TPOT", "ITL"],
            [summary[k]["mean"] * 1e3 for k in ("ttft", "tpot", "itl")], label="mean")
  right.bar(["TTFT", "TPOT", "ITL"],
            [summary[k]["p99"] * 1e3 for k in ("ttft", "tpot", "itl")], alpha=0.4, label="p99")
  right.set(ylabel="ms", title="latency (C18)")
  right.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _engine(models: list, args: argparse.Namespace, max_model_len: int):
  """An Engine (or, --dp > 1, a kvjax.Router over one per replica) for the flags."""
  from kvjax.engine.config import engine_config_from_flags

  config = engine_config_from_flags(args, max_model_len=args.max_model_len or max_model_len)
  return distributed.serving_engine(models, config, args.router_policy)


def _run_http(args: argparse.Namespace, sessions: Sequence[Session], tokenizer) -> int:
  from kvjax.server.bench import client as bench_client

  goodput = bench_client.parse_goodput(args.goodput)
  result = bench_client.run_benchmark(
      args.url, sessions, request_rate=args.request_rate, burstiness=args.burstiness,
      max_concurrency=args.max_concurrency, goodput=goodput,
      encode=None if tokenizer is None else functools.partial(tokenizer.encode,
                                                              add_special_tokens=False),
      model=args.model, temperature=args.temperature, seed=args.seed,
      timeout_s=args.request_timeout)
  if args.workload == "structured":
    records = sorted(result["requests"], key=lambda r: r["session"])
    result["summary"]["structured"] = structured_counts(
        sessions, [r["text"] for r in records], [r["finish_reason"] for r in records])
  title = (f"{args.workload} over HTTP: {args.num_requests} x {args.input_len} -> "
           f"{args.output_len}, rate {args.request_rate}, burstiness {args.burstiness}, "
           f"max concurrency {args.max_concurrency}")
  print(title)
  print(bench_client.format_table(result["summary"]))
  if args.workload == "structured":
    print(_structured_line(result["summary"]["structured"]))
  os.makedirs(args.out_dir, exist_ok=True)
  stem = os.path.join(args.out_dir, f"bench_http_{args.workload}")
  with open(stem + ".json", "w") as f:
    json.dump({"args": vars(args) | {"func": None}, **result}, f, indent=1)
  bench_client.plot(result, stem + ".png", title)
  print(f"wrote {stem}.json and {stem}.png")
  return 0


def run(args: argparse.Namespace) -> int:
  models = distributed.load_replicas(args, args.checkpoint, "float32", args.weight_dtype)
  model = models[0]
  sessions = make_workload(args.workload, vocab_size=model.config.vocab_size,
                           num_requests=args.num_requests, input_len=args.input_len,
                           output_len=args.output_len, system_len=args.system_len,
                           num_turns=args.num_turns, range_ratio=args.range_ratio,
                           seed=args.seed, tokenizer=model.tokenizer)
  if args.url is not None:
    return _run_http(args, sessions, model.tokenizer)
  longest = max(sum(map(len, s.turns)) + len(s.turns) * s.max_new_tokens for s in sessions)
  max_model_len = min(model.config.max_position_embeddings, longest)
  structured = args.workload == "structured"

  def engine():
    made = _engine(models, args, max_model_len)
    return with_constraints(made, model) if structured else made

  if not args.no_warmup:  # same shapes on a throwaway engine: compiles, not timings
    run_workload(engine(), sessions, progress="warm-up (compiling step programs)",
                 temperature=args.temperature, seed=args.seed)
  summary = run_workload(engine(), sessions, progress="bench",
                         temperature=args.temperature, seed=args.seed)
  outputs, reasons = summary.pop("outputs"), summary.pop("finish_reasons")
  if structured:
    summary["structured"] = structured_counts(
        sessions, [model.tokenizer.decode(o[0]) for o in outputs], [r[0] for r in reasons])
  title = (f"{args.workload}: {model.config.name}, {args.num_requests} x {args.input_len}"
           f" -> {args.output_len}, spec={args.speculative}, "
           f"prefix_cache={args.prefix_cache}"
           + (f", dp={args.dp} ({args.router_policy})" if args.dp > 1 else ""))
  print(title)
  print(format_table(summary))
  if structured:
    print(_structured_line(summary["structured"]))
  os.makedirs(args.out_dir, exist_ok=True)
  stem = os.path.join(args.out_dir, f"bench_{args.workload}")
  with open(stem + ".json", "w") as f:
    json.dump({"args": vars(args) | {"func": None}, "summary": summary}, f, indent=1)
  _plot(summary, stem + ".png", title)
  print(f"wrote {stem}.json and {stem}.png")
  return 0
