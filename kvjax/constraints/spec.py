"""What a constrained request asks for, as an llguidance grammar.

A `Constraint` is one of llguidance's formats: a JSON schema, any JSON object,
a regex, a list of choices (the output is exactly one of them) or a Lark
grammar (llguidance's Lark dialect, which also takes `%json` schemas inline).
`grammar()` is the llguidance grammar text; `check(vocabulary)` compiles it
against a model's vocabulary and raises ValueError naming the problem (a bad
regex, an unknown rule, a schema keyword llguidance does not implement, such
as `contains`), so an unsupported feature is refused, never ignored.  Its size
and depth are bounded first (kvjax/constraints/limits.py): llguidance's
compiler recurses, and a deep enough schema or grammar crashes the process.

JSON is compact: no whitespace between tokens (llguidance's default lets a
model write any amount, which a weak model fills its budget with).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import llguidance

from kvjax.constraints import limits

__all__ = ["Constraint", "KINDS"]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class Constraint:
  """kind: one of KINDS; value: the schema (dict or JSON text), the regex, the
  choices (non-empty strings) or the Lark text; json_object takes none."""

  kind: str
  value: Any = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
    if self.kind == "choice":
      if (not isinstance(self.value, (list, tuple)) or not self.value
          or not all(isinstance(c, str) and c for c in self.value)):
        raise ValueError(f"choice constraint needs a non-empty list of non-empty strings, "
                         f"got {self.value!r:.200}")
      limits.check_choices(self.value)
    elif self.kind in ("regex", "grammar") and not (isinstance(self.value, str) and self.value):
      raise ValueError(f"{self.kind} constraint needs a non-empty string, got "
                       f"{self.value!r:.200}")
    elif self.kind == "json_schema" and not isinstance(self.value, (dict, str, bool)):
      raise ValueError(f"json_schema constraint needs a schema (dict or JSON text), got "
                       f"{type(self.value).__name__}")
    elif self.kind == "json_schema":
      limits.check_schema(self.value)
    elif self.kind == "grammar":
      limits.check_grammar(self.value)
    elif self.kind == "regex":
      limits.check_text("regex", self.value)

  def grammar(self) -> str:
    """The llguidance grammar (its JSON form) this constraint compiles to."""
    if self.kind in ("json_schema", "json_object"):
      schema = {"type": "object"} if self.kind == "json_object" else self.value
      try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
      except ValueError as error:
        raise ValueError(f"json_schema: {error}") from None
    if self.kind == "regex":
      return llguidance.LLMatcher.grammar_from_regex(self.value)
    if self.kind == "choice":  # JSON string literals are Lark literals
      return llguidance.LLMatcher.grammar_from_lark(
          "start: " + " | ".join(json.dumps(c) for c in self.value))
    return llguidance.LLMatcher.grammar_from_lark(self.value)

  def check(self, vocabulary: Optional[llguidance.LLTokenizer]) -> str:
    """Compile against `vocabulary` (None: the grammar alone, e.g. a server checking a
    request) -> the grammar; ValueError naming what is wrong."""
    grammar = self.grammar()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
    if is_error:
      raise ValueError(f"{self.kind} constraint: {messages[0].strip()}")
    return grammar
