"""`python -m kvjax generate | chat | serve | bench | memory | diagnose | eval` (or `kvjax`).

Each sub-command registers itself with `add_parser(subparsers)` and runs with
`run(args) -> exit code`; this file only dispatches.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import re
import sys
import time
from typing import Optional, Sequence

from kvjax.cli import bench as cli_bench
from kvjax.cli import chat as cli_chat
from kvjax.cli import memory as cli_memory
from kvjax.cli import diagnose as cli_diagnose
from kvjax.cli import eval as cli_eval
from kvjax.cli import serve as cli_serve
from kvjax.cli.checkpoint import add_checkpoint_flags
from kvjax.parallel import distributed
from kvjax.runtime.xla_options import add_compile_cache_flag, use_compile_cache

__all__ = ["main"]


def _prompt_ids(text: str) -> list[int]:
  """'1,2,3' -> [1, 2, 3]: every comma-separated field one non-negative integer."""
  fields = text.split(",")
  for i, field in enumerate(fields):
    if not re.fullmatch(r"\s*[0-9]+\s*", field):
      raise argparse.ArgumentTypeError(
          f"{text!r}: field {i + 1} ({field!r}) is not a token id (a non-negative integer); "
          "write comma-separated ids, e.g. --prompt-ids 1,2,3")
  return [int(field) for field in fields]


def _add_generate(subparsers) -> None:
  p = subparsers.add_parser("generate", help="generate a continuation of one prompt")
  add_checkpoint_flags(p)
  source = p.add_mutually_exclusive_group()
  source.add_argument("--prompt", default=None,
                      help="prompt text, encoded by the checkpoint's own tokenizer (default: "
                           "'def fibonacci(n):' on a model with a tokenizer)")
  source.add_argument("--prompt-ids", type=_prompt_ids, default=None,
                      help="comma-separated token ids, e.g. 1,2,3 (default: use --prompt)")
  p.add_argument("--chat", action="store_true",
                 help="send the prompt as one user message through the checkpoint's chat "
                      "template and print only the reply (default: continue the raw text)")
  p.add_argument("--system", default=None,
                 help="with --chat: a system message (default: none of ours; the template "
                      "may add its own)")
  p.add_argument("--max-new-tokens", type=int, default=64,
                 help="tokens to generate at most; EOS ends sooner (default: %(default)s)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0 is greedy (default: %(default)s)")
  p.add_argument("--top-k", type=int, default=None,
                 help="sample among the k likeliest tokens (default: all)")
  p.add_argument("--top-p", type=float, default=None,
                 help="sample within the top-p probability mass (default: all)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
  p.add_argument("--cache", default="paged", choices=("paged", "contiguous", "none"),
                 help="KV cache layout (default: %(default)s)")
  p.add_argument("--page-size", type=int, default=16,
                 help="tokens per KV page (default: %(default)s)")
  p.add_argument("--backend", default="reference",
                 help="attention backend name (default: %(default)s)")
  p.add_argument("--dtype", default="float32",
                 help="floating-point weights: float32 | bfloat16 | float16 (or fp32 | bf16 | "
                      "fp16) (default: %(default)s)")
  p.add_argument("--kv-dtype", default=None,
                 help="KV pages: the weights' dtype (default), fp32 | bf16 | fp16 (or float32 "
                      "| bfloat16 | float16), int8 or int4")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--no-warmup", action="store_true",
                 help="time the first call (XLA compilation included in TTFT)")
  add_compile_cache_flag(p)
  distributed.add_parallel_flags(p, router=False)  # --dp: one sample per replica
  p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
  import kvjax

  use_compile_cache(args.compile_cache)
  models = distributed.load_replicas(args, args.checkpoint, args.dtype, args.weight_dtype)
  model = models[0]
  tokenizer = model.tokenizer
  if args.chat and (args.prompt_ids is not None or tokenizer is None):
    raise ValueError(f"--chat: renders --prompt text through {model.config.name}'s chat "
                     "template, so it needs --prompt and a checkpoint with a tokenizer")
  if args.prompt_ids is not None:
    prompt = args.prompt_ids
    outside = [t for t in prompt if t >= model.config.vocab_size]
    if outside:
      raise ValueError(f"--prompt-ids: token id {outside[0]} is outside the vocabulary of "
                       f"{model.config.name} (vocab_size {model.config.vocab_size}: ids 0 to "
                       f"{model.config.vocab_size - 1})")
  elif tokenizer is None:
    raise ValueError(f"--prompt: {model.config.name} has no tokenizer (no tokenizer.json "
                     "in the checkpoint directory); pass token ids with --prompt-ids 1,2,3")
  else:
    text = "def fibonacci(n):" if args.prompt is None else args.prompt
    prompt = _chat_prompt(tokenizer, text, args.system) if args.chat else \
        tokenizer.encode(text, add_special_tokens=True)  # BOS as the model was trained
  # --dp M: the prompt on every replica at once, replica i with seed + i (M samples).
  runs = [functools.partial(kvjax.generate, replica, [prompt], args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed + i, cache=args.cache, page_size=args.page_size,
                            backend=args.backend, kv_dtype=args.kv_dtype)
          for i, replica in enumerate(models)]

  def in_parallel():  # each replica's devices work while the others' do
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
      return list(pool.map(lambda run: run(), runs))

  warmup_s = None
  if not args.no_warmup:  # compiles every shape, so the timed run measures serving
    start = time.perf_counter()
    in_parallel()
    warmup_s = time.perf_counter() - start
  for replica, result in enumerate(in_parallel()):
    result.stats["warmup_s"] = warmup_s
    _print_generated(args, prompt, tokenizer, result, replica if len(runs) > 1 else None)
  return 0


def _chat_prompt(tokenizer, text: str, system: Optional[str]) -> list[int]:
  """The ids of `text` as the user's message (after `system`'s) under the chat template."""
  messages = ([] if system is None else [{"role": "system", "content": system}]) + [
      {"role": "user", "content": text}]
  return cli_chat.chat_prompt_ids(tokenizer, messages)


def _print_generated(args, prompt, tokenizer, result, replica) -> None:
  tokens = result.tokens[0]
  text = None if tokenizer is None else tokenizer.decode(tokens)
  if args.json:
    print(json.dumps({"prompt_ids": prompt, "tokens": tokens, "text": text,
                      "stats": result.stats} | ({} if replica is None else {"replica": replica})))
    return
  if replica is not None:
    print(f"--- replica {replica} (seed {args.seed + replica})")
  if tokenizer is None:
    print(" ".join(map(str, tokens)))
  else:  # --chat: the reply alone, the template's markup unshown
    print(text if args.chat else tokenizer.decode(prompt) + text)
  stats, warmup_s = result.stats, result.stats["warmup_s"]
  print(f"\n[{len(tokens)} tokens | TTFT {stats['ttft_s'] * 1e3:.1f} ms | TPOT "
        f"{stats['tpot_s'] * 1e3:.2f} ms | {stats['tokens_per_s']:.1f} tok/s | "
        f"{stats['kv_pages_used']} KV pages"
        + ("]" if warmup_s is None else f" | warm-up (compile) {warmup_s:.1f} s]"),
        file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="kvjax", description=__doc__.splitlines()[0])
  subparsers = parser.add_subparsers(dest="command", required=True)
  _add_generate(subparsers)
  cli_chat.add_parser(subparsers)
  cli_memory.add_parser(subparsers)
  cli_bench.add_parser(subparsers)
  cli_diagnose.add_parser(subparsers)
  cli_serve.add_parser(subparsers)
  cli_eval.add_parser(subparsers)
  args = parser.parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as error:
    print(f"kvjax {args.command}: error: {error}", file=sys.stderr)
    return 2
