"""Bounds on a constraint's size and depth, checked before llguidance sees it.

llguidance compiles JSON schemas and Lark grammars by recursion: a `$ref`
chain about 900 deep, or a chain of about 2,000 Lark rules, overflows an 8 MiB
stack and the process dies of a segfault (issue 53); on a 1 MiB thread stack
150 and 300 do.  So a constraint's text is at most MAX_BYTES; a JSON schema
nests at most MAX_SCHEMA_DEPTH objects and arrays along any path, a `$ref`
leading on into its target (once per path: a recursive schema stops where it
repeats); a Lark grammar has at most MAX_RULES rules, terminals and bracketed
groups (each group is a rule of its own to llguidance) and its inline `%json`
schemas are bounded as schemas; a choice list has at most MAX_CHOICES
items (llguidance's limit on one rule's alternatives: past it the matcher fails
while decoding).  The worst case at every bound compiles on a 1 MiB stack
(tests/test_constraint_limits.py).  A refusal is a ValueError naming the bound.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

__all__ = ["MAX_BYTES", "MAX_SCHEMA_DEPTH", "MAX_RULES", "MAX_CHOICES", "check_schema",
           "check_grammar", "check_text", "check_choices", "schema_depth"]

MAX_BYTES = 128 << 10  # compiles in under 0.5 s whatever its shape
MAX_SCHEMA_DEPTH = 128  # a $ref chain of 42 objects {"properties": {"x": {"$ref"}}}
MAX_RULES = 256  # a chain of 512 rules each with a group overflows a 2 MiB stack
MAX_CHOICES = 2000
# A Lark definition starts a line: `name:`, `?name:`, `!name:`, `TERMINAL:`, `name.2:`.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.]*[ \t]*:", re.MULTILINE)
_INLINE_JSON = re.compile(r"%json\s*")
# What holds no rule: a string literal, a regex literal, a comment.
_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/|//[^\n]*')


def check_text(what: str, text: str) -> None:
  """A regex or grammar: at most MAX_BYTES of UTF-8."""
  size = len(text.encode("utf-8", "surrogatepass"))
  if size > MAX_BYTES:
    raise ValueError(f"{what} is {size} bytes; the limit is {MAX_BYTES}")


def check_choices(choices) -> None:
  """At most MAX_CHOICES strings of at most MAX_BYTES together."""
  if len(choices) > MAX_CHOICES:
    raise ValueError(f"choice has {len(choices)} items; the limit is {MAX_CHOICES}")
  check_text("choice (all items together)", "".join(choices))


def check_schema(schema: Any) -> None:
  """A schema (a dict, a bool or JSON text) within MAX_BYTES and MAX_SCHEMA_DEPTH."""
  if isinstance(schema, str):
    check_text("json_schema", schema)
    try:
      schema = json.loads(schema)
    except (ValueError, RecursionError) as error:
      raise ValueError(f"json_schema is not JSON: {error}") from None
  else:
    try:
      text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as error:
      raise ValueError(f"json_schema is not JSON data: {error}") from None
    check_text("json_schema", text)
  depth = schema_depth(schema)
  if depth > MAX_SCHEMA_DEPTH:
    raise ValueError(f"json_schema nests {depth} levels deep, following its $refs; the "
                     f"limit is {MAX_SCHEMA_DEPTH}")


def check_grammar(text: str) -> None:
  """A Lark grammar within MAX_BYTES and MAX_RULES, its %json schemas as check_schema's."""
  check_text("grammar", text)
  decoder = json.JSONDecoder()
  outside, start = [], 0  # the text outside its %json schemas
  for found in _INLINE_JSON.finditer(text):
    if found.start() < start:
      continue  # in a schema already read
    try:
      schema, end = decoder.raw_decode(text, found.end())
    except (ValueError, RecursionError):
      continue  # not JSON (text in a string literal, say): llguidance refuses it or it is none
    check_schema(schema)
    outside.append(text[start:found.start()])
    start = end
  outside.append(text[start:])
  bare = _LITERAL.sub(" ", " ".join(outside))
  rules = len(_DEFINITION.findall(bare)) + bare.count("(") + bare.count("[")
  if rules > MAX_RULES:
    raise ValueError(f"grammar has {rules} rules, terminals and bracketed groups; the limit "
                     f"is {MAX_RULES}")


def schema_depth(schema: Any) -> int:
  """The most objects and arrays nested along any path into `schema`, a `$ref` leading on
  into its target, each container at most once per path; ValueError for a $ref that
  does not resolve within the schema (followed: "#/json/pointer", "#anchor", a "$id"
  as written).  Iterative: a hostile schema makes no Python recursion."""
  if not isinstance(schema, (dict, list)):
    return 0
  targets = _Targets(schema)
  depths: dict[int, int] = {}  # id(container) -> its depth, once known
  on_path = {id(schema)}
  stack = [[schema, _children(schema, targets), 0]]  # [container, children, deepest child]
  while stack:
    frame = stack[-1]
    child = next(frame[1], None)
    if child is None:  # every child seen
      stack.pop()
      on_path.discard(id(frame[0]))
      depths[id(frame[0])] = frame[2] + 1
      if stack:
        stack[-1][2] = max(stack[-1][2], frame[2] + 1)
    elif id(child) in depths:
      frame[2] = max(frame[2], depths[id(child)])
    elif id(child) not in on_path:  # on the path: a recursive schema, cut here
      on_path.add(id(child))
      stack.append([child, _children(child, targets), 0])
  return depths[id(schema)]


def _children(container, targets: "_Targets"):
  """The containers inside `container`, then the target of its $ref, if any."""
  values = container.values() if isinstance(container, dict) else container
  yield from (v for v in values if isinstance(v, (dict, list)))
  if isinstance(container, dict) and isinstance(container.get("$ref"), str):
    target = targets.resolve(container["$ref"])
    if isinstance(target, (dict, list)):
      yield target


class _Targets:
  """Where a schema's $refs lead: its root, its "$id"s and its "$anchor"s."""

  def __init__(self, root):
    self.root, self.ids, self.anchors = root, {}, {}
    pending = [root]
    while pending:
      container = pending.pop()
      values = container.values() if isinstance(container, dict) else container
      pending += [v for v in values if isinstance(v, (dict, list))]
      if not isinstance(container, dict):
        continue
      if isinstance(container.get("$anchor"), str):
        self.anchors[container["$anchor"]] = container
      given = container.get("$id")
      if isinstance(given, str) and given.startswith("#"):  # an anchor before draft 2019
        self.anchors[given[1:]] = container
      elif isinstance(given, str):
        self.ids[given.rstrip("#")] = container

  def resolve(self, ref: str):
    base, _, fragment = ref.partition("#")
    node = self.root if base == "" else self.ids.get(base)
    if node is not None and fragment and not fragment.startswith("/"):
      node = self.anchors.get(fragment)
    elif node is not None and fragment:
      for part in urllib.parse.unquote(fragment)[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
          node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
          node = node[int(part)]
        else:
          node = None
          break
    if node is None:
      raise ValueError(f"json_schema: $ref {ref!r:.100} does not resolve within the schema "
                       "(kvjax follows \"#/json/pointer\", \"#anchor\" and \"$id\"s as "
                       "written)")
    return node
