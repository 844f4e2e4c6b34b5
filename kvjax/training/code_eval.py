"""Does a code model write Python that parses?  Held-out signatures and the cut rule.

A prompt is the header of a top-level function of a held-out file: its `def` line(s)
through the colon, decorators and body left out.  The model's greedy continuation
is cut at its last complete line, and earlier where a non-blank line starts at
column 0 (the function's body has ended and new top-level code begins); the
signature plus what is left must parse with `ast`.  A continuation that stopped
at end-of-file keeps its last line, which is then complete.
"""
from __future__ import annotations

import ast
import hashlib
from typing import Sequence

__all__ = ["function_signatures", "cut_continuation", "completion_parses"]


def _headers(text: str) -> list:
  """Headers of the top-level functions of one file whose body starts on a later line."""
  try:
    tree = ast.parse(text)
  except SyntaxError:
    return []
  lines = text.splitlines(keepends=True)
  headers = []
  for node in tree.body:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    first_body_line = node.body[0].lineno
    if first_body_line == node.lineno:  # `def f(): return 1`: no header line of its own
      continue
    header = "".join(lines[node.lineno - 1:first_body_line - 1])
    if header.rstrip().endswith(":"):  # a comment between header and body: not a header
      headers.append(header.rstrip() + "\n")
  return headers


def function_signatures(texts: Sequence[tuple], num: int, max_chars: int = 200) -> list:
  """`num` headers from files [(name, bytes)], ordered by sha256(name + header).

  Deterministic given the files; one header per file while files last, so a
  large module does not supply them all.
  """
  per_file = []
  for name, data in texts:
    ranked = sorted((hashlib.sha256(f"{name}\n{h}".encode()).hexdigest(), h)
                    for h in _headers(data.decode("utf-8")) if len(h) <= max_chars)
    per_file += [(rank, i, h) for i, (rank, h) in enumerate(ranked)]
  # Every file's best-ranked header first, then every file's second, ...
  chosen = sorted(per_file, key=lambda x: (x[1], x[0]))[:num]
  if len(chosen) < num:
    raise ValueError(f"only {len(chosen)} function headers in {len(texts)} files, "
                     f"asked for {num}")
  return [h for _, _, h in chosen]


def cut_continuation(continuation: str, finished: bool) -> str:
  """The complete body lines of a continuation (module docstring: the cut rule)."""
  lines = continuation.split("\n")
  if not finished:
    lines = lines[:-1]  # the last line is incomplete (or empty after a final newline)
  kept = []
  for line in lines:
    if line.strip() and not line[0].isspace():
      break
    kept.append(line)
  return "".join(line + "\n" for line in kept)


def completion_parses(signature: str, continuation: str, finished: bool = False) -> bool:
  """True iff the signature plus the cut continuation is valid Python."""
  try:
    ast.parse(signature + cut_continuation(continuation, finished))
  except (SyntaxError, ValueError):  # ValueError: a NUL byte in the source
    return False
  return True
