"""Checks on compiled step programs: host callbacks, shared by the step tests."""
from __future__ import annotations

import re

# Custom calls jax emits for io_callback / pure_callback / jax.debug.* on any backend.
_CALLBACK = re.compile(r"callback|host_compute|SendToHost|RecvFromHost", re.IGNORECASE)


def assert_no_host_callback(lowered) -> None:
  """AssertionError if a lowered jit program calls back into Python (a host sync)."""
  text = lowered.as_text()
  found = sorted(set(_CALLBACK.findall(text)))
  assert not found, f"the program calls the host: {found}"
