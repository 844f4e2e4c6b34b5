"""A request body's bytes -> a JSON object, bounded before it is parsed.

A body is refused when it exceeds MAX_BODY_BYTES or nests deeper than MAX_JSON_DEPTH:
the depth is measured by an iterative scan (json_depth), so no parser ever recurses on
hostile input.
"""
from __future__ import annotations

import json

import numpy as np

from kvjax.server.openai_error import OpenAIError

__all__ = ["MAX_BODY_BYTES", "MAX_JSON_DEPTH", "json_depth", "parse_json"]

MAX_BODY_BYTES = 16 << 20  # 16 MiB: far above a max_model_len prompt of ids
MAX_JSON_DEPTH = 32  # a request body needs 4 (messages -> message -> content parts -> part)
# The bytes json_depth reads: quotes, backslashes and brackets.
_JSON_SYNTAX = np.isin(np.arange(256), np.frombuffer(b'"\\[]{}', np.uint8))


def json_depth(raw: bytes) -> int:
  """The deepest nesting of arrays and objects in JSON text `raw`: a running sum over
  its brackets outside strings, no recursion (malformed text gets some depth;
  json.loads refuses it afterwards).  Numpy passes over the bytes that matter (quotes,
  backslashes, brackets), which release the GIL: 10 MB of text takes milliseconds, 16 MiB
  of nothing but those bytes about a second, and no other thread stalls meanwhile (a regex
  over the strings held the GIL for 6-11 s on 10 MB of text)."""
  text = np.frombuffer(raw, np.uint8)
  at = np.flatnonzero(_JSON_SYNTAX[text])  # positions of the bytes that matter
  if at.size == 0:
    return 0
  byte = text[at]
  backslash = byte == ord("\\")
  follows = np.concatenate(([False], at[1:] == at[:-1] + 1))  # right after the one before
  # The backslash run each backslash ends; a quote is escaped when an odd run ends
  # right before it.
  starts = backslash & ~(follows & np.concatenate(([False], backslash[:-1])))
  index = np.arange(at.size, dtype=np.int32)
  run_start = np.maximum.accumulate(np.where(starts, index, np.int32(-1)))
  run = np.where(backslash, index - run_start + 1, 0)
  run_before = np.where(follows, np.concatenate(([0], run[:-1])), 0)
  quote = (byte == ord('"')) & (run_before % 2 == 0)
  in_string = np.logical_xor.accumulate(quote)
  opens = ((byte == ord("[")) | (byte == ord("{"))) & ~in_string
  closes = ((byte == ord("]")) | (byte == ord("}"))) & ~in_string
  steps = opens.astype(np.int8) - closes.astype(np.int8)
  return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def parse_json(raw: bytes) -> dict:
  """The request body as a JSON object; too large or too deep -> 400 before parsing."""
  if len(raw) > MAX_BODY_BYTES:
    raise OpenAIError(f"the request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}",
                      code="body_too_large")
  depth = json_depth(raw)
  if depth > MAX_JSON_DEPTH:
    raise OpenAIError(f"the request body nests {depth} levels deep; the limit is "
                      f"{MAX_JSON_DEPTH}", code="invalid_json")
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as error:
    raise OpenAIError(f"the request body is not valid JSON: {error}", code="invalid_json")
  if not isinstance(body, dict):
    raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}",
                      code="invalid_json")
  return body
