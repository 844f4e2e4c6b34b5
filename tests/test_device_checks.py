"""The host-callback check catches what it is there for (else the step tests prove nothing)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.device_checks import assert_no_host_callback


@pytest.mark.parametrize("sync", [
    lambda x: jax.debug.callback(lambda v: None, x),
    lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x),
    lambda x: jax.debug.print("{}", x),
], ids=["debug_callback", "pure_callback", "debug_print"])
def test_a_host_sync_is_caught(sync):
  def step(x):
    out = sync(x)
    return (x if out is None else out) * 2

  x = jnp.ones(3)
  assert_no_host_callback(jax.jit(lambda x: x * 2).lower(x))
  with pytest.raises(AssertionError, match="calls the host"):
    assert_no_host_callback(jax.jit(step).lower(x))
