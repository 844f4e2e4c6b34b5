"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter {lora_name, lora_path} and
/v1/unload_lora_adapter {lora_name}, on every replica of the served engine (Engine's
load_adapter / unload_adapter, kvjax/engine/adapters.py).  A loaded adapter is then a
`model` requests may name and /v1/models lists (kvjax/server/app.py)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from kvjax.server.openai_error import OpenAIError
from kvjax.server.request_body import parse_json

__all__ = ["add_adapter_routes", "load_on_every_replica"]


def _replicas(engine) -> list:
  return getattr(engine, "engines", [engine])  # a Router's, or the one Engine


def load_on_every_replica(engine, name: str, path: str) -> None:
  """Load adapter `name` from `path` on each replica, or on none (ValueError)."""
  done = []
  try:
    for replica in _replicas(engine):
      replica.load_adapter(name, path)
      done.append(replica)
  except ValueError:
    for replica in done:
      replica.unload_adapter(name)
    raise


def _string(body: dict, field: str) -> str:
  value = body.get(field)
  if not isinstance(value, str) or not value:
    raise OpenAIError(f"{field} must be a non-empty string, got {value!r:.200}", field)
  return value


def add_adapter_routes(app: FastAPI, state) -> None:
  """The load / unload endpoints on `app`, for ServerState `state`."""

  async def run(work):
    """work() on a worker thread (it waits for the engine's lock) -> its result."""
    return await asyncio.get_running_loop().run_in_executor(None, work)

  @app.post("/v1/load_lora_adapter")
  async def load_lora_adapter(request: Request):
    body = parse_json(await request.body())
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    if name == state.limits.model_name:
      raise OpenAIError(f"lora_name {name!r} is the base model's name", "lora_name")
    try:
      await run(lambda: load_on_every_replica(state.loop.engine, name, path))
    except ValueError as error:
      field = "lora_path" if str(error).startswith("lora_path") else "lora_name"
      raise OpenAIError(str(error), field) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

  @app.post("/v1/unload_lora_adapter")
  async def unload_lora_adapter(request: Request):
    name = _string(parse_json(await request.body()), "lora_name")
    if name not in state.limits.adapters:  # vLLM's answer: 404
      raise OpenAIError(f"The lora adapter {name!r:.200} cannot be found", "lora_name",
                        status=404, code="model_not_found")
    try:
      await run(lambda: [replica.unload_adapter(name)
                         for replica in _replicas(state.loop.engine)])
    except ValueError as error:  # a request still uses it
      raise OpenAIError(str(error), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
