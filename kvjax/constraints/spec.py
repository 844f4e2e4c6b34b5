"""What a constrained request asks for, as an llguidance grammar.

A `Constraint` is one of llguidance's formats: a JSON schema, any JSON object,
a regex, a list of choices (the output is exactly one of them) or a Lark
grammar (llguidance's Lark dialect, which also takes `%json` schemas inline).
`grammar()` is the llguidance grammar text; `check(vocabulary)` compiles it
against a model's vocabulary and raises ValueError naming the problem (a bad
regex, an unknown rule, a schema keyword llguidance does not implement, such
as `contains`), so an unsupported feature is refused, never ignored; so is a
grammar that accepts no output (`{"$ref": "#"}`, `start: a\na: a`) or only the
empty one (`start: `), found by a matcher's first step over a byte vocabulary
(what a grammar accepts does not depend on the tokenizer).  Its size
and depth are bounded first (kvjax/constraints/limits.py): llguidance's
compiler recurses, and a deep enough schema or grammar crashes the process.

JSON is compact: no whitespace between tokens (llguidance's default lets a
model write any amount, which a weak model fills its budget with).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Optional

import llguidance
import numpy as np

from kvjax.constraints import limits

__all__ = ["Constraint", "KINDS", "error_summary"]

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
    request, over a byte vocabulary) -> the grammar; ValueError naming what is wrong."""
    grammar = self.grammar()
    if vocabulary is None:
      is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
      if is_error:
        raise ValueError(f"{self.kind} constraint: {messages[0].strip()}")
    self._checked_matcher(grammar, vocabulary)
    return grammar

  def matcher(self, vocabulary: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher of this constraint over the model's `vocabulary`, checked as
    `check` checks it (the matcher the check compiled: a grammar compiles once)."""
    return self._checked_matcher(self.grammar(), vocabulary)

  def _checked_matcher(self, grammar: str, vocabulary: Optional[llguidance.LLTokenizer]
                       ) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(vocabulary or _byte_vocabulary(), grammar, log_level=0)
    problem = _first_step_problem(matcher, vocabulary)
    if problem is not None:
      raise ValueError(f"{self.kind} constraint: {problem}")
    return matcher


class _Bytes:
  """llguidance's TokenizerWrapper contract: one token per byte, then an EOS."""

  tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
  eos_token_id = 256
  bos_token_id = None
  special_token_ids = [256]

  def __call__(self, text: bytes) -> list[int]:
    return list(text)


@functools.lru_cache(maxsize=1)
def _byte_vocabulary() -> llguidance.LLTokenizer:
  return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _first_step_problem(matcher: llguidance.LLMatcher,
                        vocabulary: Optional[llguidance.LLTokenizer]) -> Optional[str]:
  """Why a fresh `matcher` over `vocabulary` (None: bytes) cannot constrain an output: its
  grammar does not compile, accepts nothing, or only the empty output; or None.  Computing
  the first mask consumes no token: the matcher stays at its start."""
  if matcher.is_error():  # it does not compile
    if vocabulary is None:  # it names token ids only the model's vocabulary has
      return None
    return matcher.get_error().strip()
  allowed = np.frombuffer(matcher.compute_bitmask(), np.uint32).copy()  # bit t%32 of word t//32
  if matcher.is_error():  # e.g. a rule that only refers to itself
    return f"the grammar accepts no output ({error_summary(matcher)})"
  for eos in (vocabulary or _byte_vocabulary()).eos_tokens:
    allowed[eos // 32] &= ~np.uint32(1 << (eos % 32))
  if not allowed.any():
    return "the grammar accepts only the empty output"
  return None


def error_summary(matcher: llguidance.LLMatcher) -> str:
  """The first line of a failed matcher's error (the rest dumps its parser state)."""
  return matcher.get_error().strip().split("\n", 1)[0]
