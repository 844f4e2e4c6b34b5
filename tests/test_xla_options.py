"""Step programs compile with the backend's step options, and those change no result."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import engine, generation
from kvjax.xla_options import jit_step, step_compiler_options


def test_cpu_step_programs_turn_ynn_fusions_off():
  assert jax.default_backend() == "cpu"
  assert step_compiler_options() == (("xla_cpu_experimental_ynn_fusion_type", ""),)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 192)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(192, 512)), jnp.float32)
  step = jit_step(lambda x, w: jnp.dot(x, w, precision="highest"))
  plain = jax.jit(lambda x, w: jnp.dot(x, w, precision="highest"))
  # A 3-row GEMM: the default program is a YNN fusion, the step program is not.
  assert '"__ynn_fusion"' in plain.lower(x, w).compile().as_text()
  assert '"__ynn_fusion"' not in step.lower(x, w).compile().as_text()
  np.testing.assert_allclose(step(x, w), np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                             rtol=1e-5, atol=1e-4)


def test_engine_and_generation_steps_use_them():
  for program in (engine.serve_step, engine.serve_burst, generation._decode_loop):
    assert program.jitted is program.jitted  # built once
    assert program.__wrapped__.__name__ in ("_serve_rows", "serve_burst", "_decode_loop")
