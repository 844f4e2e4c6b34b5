"""Bounds on constraints before llguidance sees them (kvjax/constraints/limits.py).

Oracles: llguidance itself, in a child process: the worst case at every bound
compiles on a 1 MiB thread stack and the child exits 0 (past the bounds
llguidance segfaults: issue 53's $ref chain 1,000 deep kills an 8 MiB main
thread); the refused cases are counted by hand (a chain of n objects
{"properties": {"x": {"$ref": next}}} nests 3 levels per link).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvjax.constraints import Constraint, limits


def ref_chain(n: int) -> dict:
  """Issue 53's schema: $defs d0..d<n-1>, each an object whose x is the next, the last an
  integer."""
  defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
          for i in range(n - 1)}
  defs[f"d{n - 1}"] = {"type": "integer"}
  return {"$defs": defs, "$ref": "#/$defs/d0"}


def anchor_chain(n: int) -> dict:
  """The same chain through "$anchor"s and "$id"s (alternating) instead of pointers."""
  def ref(i):
    return f"#a{i}" if i % 2 else f"urn:d{i}"
  defs = {f"d{i}": {("$anchor" if i % 2 else "$id"): (f"a{i}" if i % 2 else f"urn:d{i}"),
                    "type": "object", "properties": {"x": {"$ref": ref(i + 1)}}}
          for i in range(n)}
  defs[f"d{n}"] = {"$id": f"urn:d{n}", "type": "integer"} if n % 2 == 0 else {
      "$anchor": f"a{n}", "type": "integer"}
  return {"$defs": defs, "$ref": ref(0)}


def rule_chain(n: int, tail: str = '"b"', group: bool = False) -> str:
  """A Lark grammar of n + 2 rules, each rule the next one's prefix (in a group)."""
  body = "".join(f'r{i}: "a" ' + (f"(r{i + 1})" if group else f"r{i + 1}") + "\n"
                 for i in range(n))
  return f"start: r0\n{body}r{n}: {tail}\n"


# The deepest chain within the bound: root, $defs, then 3 levels per link.
DEEPEST = (limits.MAX_SCHEMA_DEPTH - 3) // 3 + 1


def test_schema_depth_counts_every_link_of_a_ref_chain():
  assert limits.schema_depth(ref_chain(1)) == 3  # root -> $defs -> d0
  assert limits.schema_depth(ref_chain(1000)) == 2 + 3 * 999 + 1
  assert limits.schema_depth(anchor_chain(10)) == 2 + 3 * 10 + 1
  recursive = {"type": "object", "properties": {"kids": {"type": "array",
                                                         "items": {"$ref": "#"}}}}
  assert limits.schema_depth(recursive) == 4  # cut where it repeats
  assert limits.schema_depth(ref_chain(DEEPEST)) <= limits.MAX_SCHEMA_DEPTH
  assert limits.schema_depth(ref_chain(DEEPEST + 1)) > limits.MAX_SCHEMA_DEPTH


@pytest.mark.parametrize("kind, value, words", [
    ("json_schema", ref_chain(1000), "nests 3000 levels deep"),
    ("json_schema", json.dumps(ref_chain(DEEPEST + 1)), "levels deep"),
    ("json_schema", anchor_chain(100), "levels deep"),
    ("json_schema", {"$ref": "https://example.com/s.json"}, "does not resolve"),
    ("json_schema", {"enum": ["x" * limits.MAX_BYTES]}, "bytes; the limit"),
    ("grammar", rule_chain(3000), "rules, terminals and bracketed groups"),
    ("grammar", rule_chain(200, group=True), "rules, terminals and bracketed groups"),
    ("grammar", rule_chain(2, tail="%json " + json.dumps(ref_chain(1000))), "levels deep"),
    ("grammar", 'start: "' + "a" * limits.MAX_BYTES + '"', "bytes; the limit"),
    ("regex", "a" * (limits.MAX_BYTES + 1), "bytes; the limit"),
    ("choice", [f"c{i}" for i in range(limits.MAX_CHOICES + 1)], "items; the limit"),
    ("choice", ["x" * 70_000] * 2, "bytes; the limit"),
], ids=["chain_1000", "chain_text", "anchor_chain", "remote_ref", "big_schema", "rule_chain",
        "group_chain", "inline_json_chain", "big_grammar", "big_regex", "many_choices",
        "big_choices"])
def test_past_a_bound_is_refused_naming_it(kind, value, words):
  with pytest.raises(ValueError, match=words):
    Constraint(kind, value)


def test_literals_comments_and_schemas_are_not_counted_as_rules():
  text = ('start: "(" item ")" // ( [ a: b:\n'
          'item: /[a-z(]+/ | %json {"enum": [[[1]], "x: (["]}\n')
  bare = Constraint("grammar", text + "".join(f"r{i}: item\n" for i in range(
      limits.MAX_RULES - 2)))
  assert bare.check(None)
  with pytest.raises(ValueError, match="bracketed groups"):
    Constraint("grammar", bare.value + "one_more: item\n")


WORST_CASES = f"""
  import json, sys, threading
  from kvjax.constraints import Constraint
  from tests.test_constraint_limits import DEEPEST, ref_chain, rule_chain, limits
  deepest = json.dumps(ref_chain(DEEPEST))
  cases = [("json_schema", ref_chain(DEEPEST)),
           ("grammar", rule_chain(limits.MAX_RULES - 3, "%json " + deepest)),
           ("grammar", rule_chain(limits.MAX_RULES // 2 - 2, "%json " + deepest, group=True)),
           ("choice", [f"c{{i}}" for i in range(limits.MAX_CHOICES)])]
  def compile_all():
    for kind, value in cases:
      Constraint(kind, value).check(None)
      print(kind, "compiled", flush=True)
  threading.stack_size(1 << 20)
  thread = threading.Thread(target=compile_all)
  thread.start()
  thread.join()
"""


def test_the_worst_case_at_every_bound_compiles_on_a_1_mib_stack():
  # A child process: past the bounds llguidance would take the test run down with it.
  child = subprocess.run([sys.executable, "-c", textwrap.dedent(WORST_CASES)],
                         capture_output=True, text=True, timeout=120)
  assert child.returncode == 0, child.stderr[-2000:]
  assert child.stdout.count("compiled") == 4, child.stdout
