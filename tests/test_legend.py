"""docs/DIMENSIONS.md is followed: every einsum string and every bracketed shape
(`# [B, T, N, H]`, in comments and docstrings) in kvjax/ and pallas_kernels/ uses only the
legend's dimensions.  Einsum letters are the lowercase of the legend's one-letter
dimensions; shapes name dimensions by their legend symbol (Hv, Gq, ...), numbers, words
(`window`) or arithmetic of these (`J + 1`)."""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kvjax", "pallas_kernels")

_EINSUM = re.compile(r"^\s*[a-zA-Z.]+(\s*,\s*[a-zA-Z.]+)*\s*->\s*[a-zA-Z.]*\s*$")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_']*")
# One item of a shape: a name or number, or arithmetic of them (`J + 1`, `2 Nk Hk + Nv Hv`).
_ITEM = re.compile(r"^\(?[A-Za-z0-9_']+\)?(\s*[-+*/ ]\s*\(?[A-Za-z0-9_']+\)?)*$")
_TYPE = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # CamelCase: a class

_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")  # a module constant (`ROWS`) is a word


def legend(path: str = os.path.join(ROOT, "docs", "DIMENSIONS.md")) -> dict[str, str]:
  """Symbol -> its einsum letter ('' for none), from the legend table: the first column's
  symbols ('Hn, Hr' gives two); a one-letter symbol's letter is its lowercase, a longer
  one has the letter its row names (`einsum letter `g``), else none."""
  letter_of = {}
  with open(path) as f:
    for line in f:
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("letter", "---"):
        named = re.findall(r"einsum letter `([a-z])`", line)
        for symbol in (c.strip() for c in cells[0].split(",")):
          letter_of[symbol] = symbol.lower() if len(symbol) == 1 else "".join(named[:1])
  return letter_of


def _shape_names(text: str):
  """Every bracketed shape in text -> the dimension names it uses: '[B, J + 1, V]' gives
  ('[B, J + 1, V]', ['B', 'J', 'V']).  A bracket is a shape when each comma-separated item
  is a name, number or their arithmetic and one item starts with an uppercase letter
  (so `[0, 1]`, `[i]`, `[:, None]` and `[drafts]` are not shapes)."""
  for match in _BRACKETS.finditer(text):
    items = [i.strip() for i in match.group(1).split(",")]
    items = [i for i in items if i not in ("...", "")]
    if not items or not all(_ITEM.match(i) for i in items):
      continue
    names = [n for i in items for n in _NAME.findall(i)]
    if any(n in ("None", "True", "False") or len(n) > 3 and _TYPE.match(n) for n in names):
      continue  # an index expression or a type (`tuple[BlockParams, ...]`), not a shape
    if any(n[0].isupper() for n in names):
      yield match.group(0), names


def _shape_items(text: str) -> list[list[str]]:
  """The items of each bracketed shape in text ('[B, J + 1]' -> ['B', 'J + 1'])."""
  return [[i.strip() for i in shape[1:-1].split(",") if i.strip() not in ("...", "")]
          for shape, _ in _shape_names(text)]


def _einsum_calls(tree):
  """(spec Constant, first line, last line) of each call whose first argument is an
  einsum string (jnp.einsum, and helpers taking a spec: `dot(spec, a, b)`), and of every
  other einsum-shaped string constant (last line None)."""
  in_calls = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      in_calls[id(node.args[0])] = node.end_lineno
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _EINSUM.match(
        node.value):
      yield node, in_calls.get(id(node))


def violations(source: str, letter_of: dict[str, str]) -> list[str]:
  """'line N: what' for each einsum letter or shape dimension not in the legend, and each
  einsum whose output letters disagree with the shape comment on its line."""
  found, letters = [], set(letter_of.values()) - {""}
  tree = ast.parse(source)
  comments = {}
  for t in tokenize.generate_tokens(io.StringIO(source).readline):
    if t.type == tokenize.COMMENT:
      comments[t.start[0]] = t.string
  for node, last in _einsum_calls(tree):
    spec = node.value.replace(" ", "")
    bad = sorted({c for c in spec if c.isalpha() and c not in letters})
    if bad:
      found.append(f"line {node.lineno}: einsum {spec!r} uses {', '.join(bad)}")
    shapes = [sh for n in range(node.lineno, (last or node.lineno) + 1)
              for sh in _shape_items(comments.get(n, ""))]
    out = spec.split("->")[1].replace(".", "")
    if shapes and len(shapes[-1]) == len(out):
      for letter, item in zip(out, shapes[-1]):
        want = letter_of.get(item)
        if want is not None and letter != want:
          found.append(f"line {node.lineno}: einsum {spec!r} gives {letter!r} for {item}"
                       f" (its letter: {want or 'none'})")
  texts = [(n, c) for n, c in comments.items()]
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc and node.body:
        texts.append((node.body[0].lineno, doc))
  for lineno, text in sorted(texts):
    for shape, names in _shape_names(text):
      # Single letters and capitalised names are dimensions; lowercase words (`window`,
      # `num_draft`) and module constants (`ROWS`) are allowed.
      bad = [n for n in names if (len(n) == 1 or n[0].isupper()) and not n.isdigit()
             and n.rstrip("'") not in letter_of and not _CONSTANT.match(n)]  # T': another T
      if bad:
        found.append(f"line {lineno}: shape {shape} uses {', '.join(dict.fromkeys(bad))}")
  return sorted(found, key=lambda v: int(v.split()[1][:-1]))


def _sources():
  out = []
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
      out += [os.path.relpath(os.path.join(directory, f), ROOT) for f in files
              if f.endswith(".py")]
  return sorted(out)


LEGEND = legend()


@pytest.mark.parametrize("path", _sources())
def test_shapes_and_einsums_follow_the_legend(path):
  with open(os.path.join(ROOT, path)) as f:
    assert violations(f.read(), LEGEND) == []


def test_the_legend_is_read():
  assert {"B", "T", "Gq", "Hn", "Hr", "Lc", "Nc", "J", "Z", "I", "O"} <= set(LEGEND)
  assert not {"G", "g", "letter", "---"} & set(LEGEND)
  assert (LEGEND["B"], LEGEND["Gq"], LEGEND["Hv"], LEGEND["Hn"]) == ("b", "g", "o", "")


def test_planted_violations_are_caught():
  source = '''
def f(q, k):
  """q [B, T, N, H]; k [B, G, K, H] with a G that is not in the legend."""
  s = jnp.einsum("btnh,bsnh->bnts", q, k)  # [B, N, T, S]
  w = jnp.einsum("bgnh,bsnh->bgs", q, k)  # [B, Z, S]: g is Gq, not page size
  x = y[:, None]  # [0, 1] and [i] and [drafts] are not shapes, nor tuple[Removed, ...]
  o = dot("btnr,rnv->btnv", x, w)  # [B, T, N, Hv]: v is the vocabulary
  u = jnp.einsum("bTh,bsh->bTs", q,
                 k)  # [B, T, S]
  return s  # [B, J + 1, Hv], [2 Nk Hk + Nv Hv, Kc - 1], [ROWS, block_k]; not [S_kv], [G']
'''
  assert violations(source, LEGEND) == [
      "line 3: shape [B, G, K, H] uses G",
      "line 5: einsum 'bgnh,bsnh->bgs' gives 'g' for Z (its letter: z)",
      "line 7: einsum 'btnr,rnv->btnv' gives 'v' for Hv (its letter: o)",
      "line 8: einsum 'bTh,bsh->bTs' uses T",
      "line 8: einsum 'bTh,bsh->bTs' gives 'T' for T (its letter: t)",
      "line 10: shape [S_kv] uses S_kv",
      "line 10: shape [G'] uses G'"]
