"""Structured-output request fields -> a kvjax Constraint (kvjax/constraints).

OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"},
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; vLLM's
`structured_outputs` (and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields): exactly one of `json`, `regex`,
`choice`, `grammar`.  The grammar is compiled here (no vocabulary needed), so a
bad regex, an unknown rule or a schema keyword llguidance does not implement is
a 400 naming the field and the problem before anything is queued.
"""
from __future__ import annotations

from typing import Optional, Tuple

from kvjax.constraints import Constraint

__all__ = ["parse_constraint"]

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
_GUIDED = {f"guided_{key}": key for key in _VLLM_KINDS}


def parse_constraint(body: dict, error) -> Tuple[Optional[str], Optional[Constraint]]:
  """(the field that sets it, the request's Constraint) or (None, None);
  error(message, param) builds the 400."""
  fields = [name for name in ("response_format", "structured_outputs", *_GUIDED)
            if body.get(name) is not None]
  if len(fields) > 1:
    raise error(f"set one of {', '.join(fields)}, not several", fields[1])
  if not fields:
    return None, None
  name = fields[0]
  value = body[name]
  if name in _GUIDED:
    value = {_GUIDED[name]: value}
  try:  # a Constraint checks its value's type and bounds, check() compiles it
    if name == "response_format":
      constraint = _response_format(value, error)
    else:
      constraint = _structured_outputs(value, name, error)
    if constraint is not None:
      constraint.check(None)
  except ValueError as problem:
    raise error(f"{name}: {problem}", name) from None
  return (None, None) if constraint is None else (name, constraint)


def _response_format(value, error) -> Optional[Constraint]:
  kind = value.get("type") if isinstance(value, dict) else None
  if kind == "text":
    return None
  if kind == "json_object":
    return Constraint("json_object")
  if kind == "json_schema":
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
      raise error("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                  "\"schema\": {...}}}", "response_format")
    return Constraint("json_schema", schema)
  raise error(f"response_format type must be text, json_object or json_schema, got "
              f"{value!r:.200}", "response_format")


def _structured_outputs(value, name: str, error) -> Constraint:
  given = [k for k in _VLLM_KINDS if isinstance(value, dict) and value.get(k) is not None]
  if len(given) != 1:
    raise error(f"{name} must set exactly one of {', '.join(_VLLM_KINDS)}, got "
                f"{value!r:.200}", name)
  return Constraint(_VLLM_KINDS[given[0]], value[given[0]])
