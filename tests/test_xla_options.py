"""Step programs compile with the backend's step options, and those change no result."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.runtime import serve_steps
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.xla_options import DECODE_COLUMNS, jit_step, step_compiler_options
from tests import engine_helpers as h


_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}  # every YNN fusion off


def test_cpu_step_programs_keep_ynn_fusions_for_single_dots_only():
  assert jax.default_backend() == "cpu"
  memory_scheduler = ("xla_cpu_scheduler_type", "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED")
  assert step_compiler_options() == step_compiler_options("decode") == (
      ("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"),
      memory_scheduler)
  assert step_compiler_options("prefill") == (tuple(_OFF.items())[0], memory_scheduler)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 192)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(192, 512)), jnp.float32)
  step = jit_step(lambda x, w: jnp.dot(x, w, precision="highest"))
  off = jax.jit(lambda x, w: jnp.dot(x, w, precision="highest"), compiler_options=_OFF)
  # A 3-row GEMM: the step program's dot is a YNN fusion, with them off it is not.
  assert '"__ynn_fusion"' in step.lower(x, w).compile().as_text()
  assert '"__ynn_fusion"' not in off.lower(x, w).compile().as_text()
  np.testing.assert_allclose(step(x, w), np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                             rtol=1e-5, atol=1e-4)


def test_the_engines_verify_step_compiles_with_them():
  # The compiled serve step itself (MTP verify + draft, batch 2) carries the options: its
  # program is the one jax.jit compiles with them, and differs from the one without.
  eng = h.engine(speculative="mtp")
  batch, static = h.decode_batch(eng, 0.8), h.step_static(eng)
  args = (eng.model.params, None, eng.state, batch)
  step = serve_steps.serve_step.lower(*args, **static).compile().as_text()
  compile_with = lambda options: jax.jit(
      serve_steps._serve_rows, static_argnames=serve_steps._STATIC, donate_argnames=("state",),
      compiler_options=options).lower(*args, **static).compile().as_text()
  assert step == compile_with(dict(step_compiler_options()))
  assert '"__ynn_fusion"' in step and '"__ynn_fusion"' not in compile_with(_OFF)


def test_prefill_chunks_compile_with_the_prefill_options():
  """A StepBatch wider than DECODE_COLUMNS runs the prefill program (no YNN fusion); a
  decode one the decode program; each kind's programs are counted."""
  eng = h.engine()
  static = h.step_static(eng)
  step = serve_steps.serve_step
  before = {kind: step.jitted(kind)._cache_size() for kind in ("decode", "prefill")}
  total = step._cache_size()
  chunk = make_step_batch(np.arange(2 * 16).reshape(2, 16) % 50, [0, 0], [16, 9],
                          np.array([[1, 2], [3, 4]]), slot_ids=[0, 1])
  assert chunk.tokens.shape[1] > DECODE_COLUMNS
  eng.state, _ = step(eng.model.params, None, eng.state, chunk, **static)
  assert step.jitted("prefill")._cache_size() == before["prefill"] + 1
  assert step.jitted("decode")._cache_size() == before["decode"]
  assert step._cache_size() == total + 1
  text = step.jitted("prefill").lower(eng.model.params, None, eng.state, chunk,
                                      **static).compile().as_text()
  assert '"__ynn_fusion"' not in text
