"""kvjax's OpenAI-compatible HTTP server (`python -m kvjax serve`).

  text.py         detokenization and stop strings of one choice
  protocol.py     request bodies -> validated requests, OpenAI error JSON
  prom.py         Prometheus metrics (vLLM's names under kvjax:)
  engine_loop.py  the one thread that owns the Engine
  responses.py    OpenAI response objects and SSE chunks
  app.py          the FastAPI routes
  handle.py       serve_in_thread: the running server and its handle
"""
from kvjax.server.handle import ServerHandle, serve_in_thread

__all__ = ["ServerHandle", "serve_in_thread"]
