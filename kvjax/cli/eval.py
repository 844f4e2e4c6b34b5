"""`python -m kvjax eval perplexity | humaneval | needle | choice`: what a variant costs in
quality (choice: multiple choice by loglikelihood, as lm-evaluation-harness scores it).

The variant is the checkpoint with --weight-dtype, --sliding-window and any
engine option (--kv-dtype, --page-size, --backend, ...; kvjax/engine/config.py).
Each task is a module of kvjax/eval/; progress goes to stderr, and
<out-dir>/<task>.json (the options, the device, the result) and <task>.png
are written.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile

from kvjax.engine.config import add_engine_flags, engine_config_from_flags
from kvjax.engine.validation import check_int

__all__ = ["add_parser", "check_args", "run"]

TASKS = ("perplexity", "humaneval", "needle", "choice")


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated ints, e.g. 512,1024")


def _floats(text: str) -> list[float]:
  try:
    return [float(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated numbers, e.g. 0,0.5,1")


def add_parser(subparsers) -> None:
  p = subparsers.add_parser("eval", help="quality of a variant: perplexity, HumanEval, needle, "
                                         "multiple choice")
  p.add_argument("task", choices=TASKS)
  p.add_argument("--checkpoint", default="smollm2-135m-instruct",
                 help="preset, GGUF file or model name, HF or kvjax checkpoint dir")
  p.add_argument("--dtype", default="float32", help="float weights and activations")
  p.add_argument("--weight-dtype", default=None,
                 help="quantized weights: int8 | int4 | a kvjax.weights.quantize scheme")
  p.add_argument("--sliding-window", type=int, default=None,
                 help="every layer attends to its last N tokens (sinks + window: "
                      "--attention sinks4-window1020, or --kv-dtype streaming)")
  p.add_argument("--out-dir", default="results/eval")
  add_engine_flags(p)
  ppl = p.add_argument_group("perplexity (the stdlib text of kvjax/eval/text_set.py)")
  ppl.add_argument("--context", type=int, default=512, help="tokens per scored segment")
  ppl.add_argument("--chunk", type=int, default=128, help="prefill chunk columns")
  ppl.add_argument("--decode-tokens", type=int, default=16,
                   help="last inputs of each segment fed one per decode step")
  ppl.add_argument("--max-tokens", type=int, default=None, help="score at most this many")
  ppl.add_argument("--batch-size", type=int, default=4, help="segments per step")
  he = p.add_argument_group("humaneval")
  he.add_argument("--limit", type=int, default=None,
                  help="the first N problems (default 164) or choice questions (default all)")
  he.add_argument("--max-new-tokens", type=int, default=256,
                  help="tokens per answer (default 256)")
  he.add_argument("--prompt-mode", choices=("auto", "completion", "chat"), default="auto",
                  help="humaneval and needle: chat (the prompt as a user turn of the chat "
                       "template, for instruct models; humaneval runs the reply's code block), "
                       "completion (the plain prompt continued, for base and code models) or "
                       "auto (default: chat when the model's tokenizer has a chat template, "
                       "else completion)")
  he.add_argument("--timeout", type=float, default=10.0, help="seconds per check")
  nd = p.add_argument_group("needle")
  nd.add_argument("--lengths", type=_ints, default=[512, 1024], help="context lengths")
  nd.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
  mc = p.add_argument_group("choice (multiple choice by loglikelihood, kvjax/eval/choice.py)")
  mc.add_argument("--task-file", default=None,
                  help="JSON lines {context, choices, answer} (default: a tiny bundled task)")
  p.set_defaults(func=run)


def device_label() -> str:
  """'cpu x86_64 x2 (Intel ...)' or the accelerator's kind."""
  import jax

  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"cpu {platform.machine()} x{os.cpu_count()} ({platform.processor() or 'cpu'})"
  return f"{device.platform} {device.device_kind}"


# Flags that are counts: (name, least value); None (unset) is allowed for the optional ones.
_COUNTS = (("context", 1), ("chunk", 1), ("decode_tokens", 0), ("batch_size", 1),
           ("max_new_tokens", 1), ("page_size", 1), ("max_num_seqs", 1),
           ("max_num_batched_tokens", 1), ("num_scheduler_steps", 1))
_OPTIONAL_COUNTS = (("max_tokens", 1), ("limit", 1), ("sliding_window", 1),
                    ("max_model_len", 1), ("num_pages", 2))


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
  """ValueError naming the first bad flag and its value, before any model loads: a bad
  --context or --timeout, or an unwritable --out-dir, would otherwise surface only after
  the model loaded and the task ran for minutes."""
  for name, low in _COUNTS:
    check_int(_flag(name), getattr(args, name), low)
  for name, low in _OPTIONAL_COUNTS:
    if getattr(args, name) is not None:
      check_int(_flag(name), getattr(args, name), low)
  if args.decode_tokens > args.context:
    raise ValueError(f"--decode-tokens must be in [0, --context={args.context}], got "
                     f"{args.decode_tokens}")
  if not (math.isfinite(args.timeout) and args.timeout > 0):
    raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
  for n in args.lengths:
    check_int("--lengths", n, 1)
  for depth in args.depths:
    if not 0 <= depth <= 1:
      raise ValueError(f"--depths must each be in [0, 1], got {depth!r}")
  _check_writable(args.out_dir)


def _check_writable(out_dir: str) -> None:
  """--out-dir created if missing and a file written in it (then removed), or ValueError."""
  try:
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir):
      pass
  except OSError as error:
    raise ValueError(f"--out-dir {out_dir!r} is not a writable directory: {error}") from None


def _engine(args, model, max_model_len: int):
  from kvjax.engine.engine import Engine

  config = engine_config_from_flags(args, max_model_len=args.max_model_len or max_model_len)
  return Engine(model, config)


def run(args: argparse.Namespace) -> int:
  import kvjax
  from kvjax.attention.variants import with_attention
  from kvjax.eval import choice, humaneval, needle, perplexity, text_set, variant

  check_args(args)
  problems = humaneval.load_problems(args.limit) if args.task == "humaneval" else None
  model = kvjax.load_checkpoint(args.checkpoint, args.dtype, weight_dtype=args.weight_dtype)
  if model.tokenizer is None:
    raise ValueError(f"--checkpoint {args.checkpoint}: the model has no tokenizer; every eval "
                     "task encodes text")
  if args.prompt_mode == "auto":  # a base model (Gemma 3 270M) ships no chat template
    has_template = getattr(model.tokenizer, "chat_template", None) is not None
    args.prompt_mode = "chat" if has_template else "completion"
  model = with_attention(model, args.attention)  # every task, perplexity's steps too
  windowed = variant.with_window(model, args.sliding_window)
  if args.task == "perplexity":
    result = perplexity.perplexity(
        model, text_set.text_ids(model.tokenizer), context=args.context, chunk=args.chunk,
        decode_tokens=args.decode_tokens, page_size=args.page_size, kv_dtype=args.kv_dtype,
        sliding_window=args.sliding_window, backend=args.backend, batch_size=args.batch_size,
        max_tokens=args.max_tokens)
    summary = (f"{result['nats_per_token']:.4f} nats/token, "
               f"{result.get('bits_per_byte', float('nan')):.4f} bits/byte, "
               f"{result['tokens']} tokens")
  elif args.task == "humaneval":
    longest = max(len(humaneval.prompt_ids(model.tokenizer, p, args.prompt_mode))
                  for p in problems)
    engine = _engine(args, windowed, longest + args.max_new_tokens)
    result = humaneval.evaluate(engine, model.tokenizer, problems,
                                max_new_tokens=args.max_new_tokens, timeout_s=args.timeout,
                                mode=args.prompt_mode)
    summary = f"pass@1 {result['pass_at_1']:.3f} ({result['passed']}/{result['count']})"
  elif args.task == "choice":
    questions = choice.load_questions(args.task_file, args.limit)
    longest = max(len(choice.encode_pair(model.tokenizer, q["context"], c)[0])
                  for q in questions for c in q["choices"])
    engine = _engine(args, windowed, longest + 1)
    result = choice.evaluate(engine, model.tokenizer, questions)
    summary = f"acc {result['acc']:.3f}, acc_norm {result['acc_norm']:.3f} ({result['count']})"
  else:
    engine = _engine(args, windowed, max(args.lengths) + 16)
    result = needle.needle_accuracy(engine, model.tokenizer, args.lengths, args.depths,
                                    mode=args.prompt_mode)
    summary = f"accuracy {result['accuracy']:.3f} by length {result['by_length']}"
  options = {k: v for k, v in vars(args).items() if k != "func"}
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, args.task)
  with open(path + ".json", "w") as f:
    json.dump(dict(task=args.task, options=options, device=device_label(), result=result),
              f, indent=1)
  _plot(args.task, result, path + ".png", f"{args.checkpoint} {args.task}: {summary}")
  print(f"kvjax eval {args.task}: {summary}; wrote {path}.json and .png")
  return 0


def _plot(task: str, result: dict, path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4))
  if task == "perplexity":
    curve = result["nats_by_position"]
    ax.plot([c["position"] for c in curve], [c["nats"] for c in curve], marker="o")
    ax.set(xlabel="position in segment (tokens)", ylabel="mean nats/token")
  elif task == "humaneval":
    rows = result["problems"]
    ax.bar(range(len(rows)), [int(r["passed"]) for r in rows])
    ax.set(xlabel="problem (task-id order)", ylabel="passed", ylim=(0, 1.1))
  elif task == "choice":
    rows = result["rows"]
    ax.bar(range(len(rows)), [int(r["pick"] == r["answer"]) for r in rows])
    ax.set(xlabel="question (file order)", ylabel="likeliest choice right", ylim=(0, 1.1))
  else:
    lengths = sorted({r["context"] for r in result["rows"]})
    for n in lengths:
      rows = [r for r in result["rows"] if r["context"] == n]
      ax.plot([r["depth"] for r in rows], [int(r["correct"]) for r in rows], marker="o",
              label=f"context {n}")
    ax.set(xlabel="needle depth (0 = start)", ylabel="retrieved", ylim=(-0.1, 1.1))
    ax.legend()
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
