"""The bench's workloads: what the requests look like, deterministic given their arguments.

  random                independent prompts of input_len ids
  shared-system-prompt  one system_len system prompt, then a unique question
  multi-turn-chat       chats of num_turns turns; each turn's prompt is the whole
                        history plus a new user message, so the prefix cache can skip
                        everything but the new turn
  structured            random prompts, each answer under a JSON schema (one of
                        STRUCTURED_SCHEMAS in turn); structured_counts judges the answers
Prompt ids are slices of the held-out stdlib code: its bytes for byte-level models (the
default model), its ids under the model's own tokenizer for others that have one (a GGUF
or HF checkpoint), random ids for a model without one.  kvjax/cli/bench.py serves them
through an Engine, kvjax/server/bench/client.py over HTTP.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

import numpy as np

__all__ = ["Session", "make_workload", "structured_counts", "WORKLOADS", "STRUCTURED_SCHEMAS"]

WORKLOADS = ("random", "shared-system-prompt", "multi-turn-chat", "structured")

# The structured workload's schemas, request i taking number i mod 4: small bounded
# records (string lengths, item counts), so most answers end within --output-len.
STRUCTURED_SCHEMAS = (
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    {"type": "array", "minItems": 1, "maxItems": 6,
     "items": {"enum": ["red", "green", "blue"]}},
    {"type": "object", "additionalProperties": False, "required": ["ok", "score"],
     "properties": {"ok": {"type": "boolean"},
                    "score": {"type": "integer", "minimum": -50, "maximum": 50}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}},
)


@dataclasses.dataclass
class Session:
  """A chat (one turn for single-shot workloads): user messages and output lengths."""

  turns: list  # list[list[int]] user message ids per turn
  max_new_tokens: int
  schema: Optional[dict] = None  # the answers' JSON schema (the structured workload)


def _token_source(vocab_size: int, seed: int, tokenizer=None) -> np.ndarray:
  """Real Python text, the stdlib files kvjax.training.corpus holds out of its own split (the
  default model trained on the whole stdlib): as byte ids for byte-level models, through
  `tokenizer` (the model's own) for others that have one; else random ids."""
  from kvjax.text.tokenizer import ByteTokenizer

  byte_level = vocab_size == ByteTokenizer().vocab_size
  if byte_level or tokenizer is not None:
    from kvjax.training import corpus
    try:
      heldout = corpus.split_tokens(corpus.load_corpus(), "heldout")
    except (OSError, ValueError):
      heldout = None
    if heldout is not None and byte_level:
      return heldout
    if heldout is not None:
      text = ByteTokenizer().decode(heldout)  # the files' text, BOS / EOS dropped
      return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
  return np.random.default_rng(seed).integers(3, vocab_size, 1 << 16).astype(np.int32)


def make_workload(name: str, *, vocab_size: int, num_requests: int, input_len: int,
                  output_len: int, system_len: int = 256, num_turns: int = 10,
                  range_ratio: float = 0.0, seed: int = 0, tokenizer=None) -> list[Session]:
  """Sessions of a named workload; deterministic given the arguments.

  tokenizer: the model's own, which encodes the prompt text of a model whose
  vocabulary is not the byte one (None: random ids for such a model).

  range_ratio r in [0, 1): every user message and output length is drawn
  uniformly from [len x (1 - r), len x (1 + r)] (at least 1); 0 = fixed lengths.
  """
  if name not in WORKLOADS:
    raise ValueError(f"unknown workload {name!r}; use one of {WORKLOADS}")
  if not 0 <= range_ratio < 1:
    raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
  source = _token_source(vocab_size, seed, tokenizer)
  rng = np.random.default_rng(seed)

  def length(mean: int) -> int:
    if not range_ratio:
      return mean
    lo, hi = round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))
    return max(1, int(rng.integers(lo, hi + 1)))

  def piece(n: int) -> list[int]:
    start = int(rng.integers(0, len(source) - n))
    return [int(t) for t in source[start:start + n]]

  if name == "random":
    return [Session([piece(length(input_len))], length(output_len))
            for _ in range(num_requests)]
  if name == "structured":
    return [Session([piece(length(input_len))], length(output_len),
                    STRUCTURED_SCHEMAS[i % len(STRUCTURED_SCHEMAS)])
            for i in range(num_requests)]
  if name == "shared-system-prompt":
    system = piece(system_len)
    return [Session([system + piece(length(input_len))], length(output_len))
            for _ in range(num_requests)]
  return [Session([piece(length(input_len)) for _ in range(num_turns)], length(output_len))
          for _ in range(num_requests)]


def structured_counts(sessions: Sequence[Session], texts: Sequence[str],
                      finish_reasons: Sequence[Optional[str]]) -> dict:
  """How the structured workload's answers came out: requests, ended (finish "stop": the
  grammar completed), cut at --output-len, and ended answers that parse as JSON of the
  schema's top-level type with its required keys (a shallow check; the tests validate
  against the full schemas with jsonschema)."""
  ended = valid = 0
  for session, text, reason in zip(sessions, texts, finish_reasons):
    if reason != "stop":
      continue
    ended += 1
    try:
      value = json.loads(text)
    except ValueError:
      continue
    kind = {"object": dict, "array": list}[session.schema["type"]]
    valid += isinstance(value, kind) and all(k in value for k in
                                             session.schema.get("required", ()))
  return {"requests": len(sessions), "ended": ended, "cut_at_length": len(sessions) - ended,
          "ended_valid": valid}
