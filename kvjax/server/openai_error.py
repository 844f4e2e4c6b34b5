"""OpenAIError: an error answer, HTTP status and OpenAI's error object, naming the request
field (`param`) it is about:
  {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
"""
from __future__ import annotations

from typing import Optional

__all__ = ["OpenAIError"]


class OpenAIError(Exception):
  """An error answer: HTTP status and OpenAI's error object."""

  def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
               kind: str = "invalid_request_error", code: Optional[str] = None):
    # Echoed client text must not break the UTF-8 answer (a lone surrogate is escaped).
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code = (message, param, status,
                                                                  kind, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}
