"""XLA compiler options for kvjax's step programs, chosen for the backend at first use.

On CPU, XLA hands dots (and, by default, more) to YNNPACK fusions.  Step programs
keep YNNPACK for dots alone (LIBRARY_FUSION_TYPE_DOT): it runs the batched
attention matmuls over gathered K/V 2-3x faster than XLA's own dot thunks and
the weight GEMMs no slower, while the default set cost the few-row GEMMs of
decode and verify steps 2-4x (engine MTP verify+draft step at batch 1: 4.55 ms
by default, 2.21 ms with every YNN fusion off).  Measured on a 2-core x86 VM,
the default model, 3 alternating processes per setting, dots only vs every YNN
fusion off: engine decode step at batch 1 0.36 vs 0.59 ms, at batch 8 1.78 vs
2.20 ms, at batch 32 7.1 vs 10.0 ms; kvjax.generate batch 1 2949 vs 1782
tokens/s, batch 8 3278 vs 2309; the MTP verify+draft step at batch 1 1.70 vs
1.38 ms (noisy: 1.44-2.64 vs 1.18-1.80).  `jit_step` compiles a step program
with these options on a CPU backend whose XLA accepts them (checked once with a
probe compile: an option this XLA does not know would fail every compile), and
with none elsewhere (GPU).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

__all__ = ["step_compiler_options", "jit_step"]

_CPU_STEP_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}  # dots only


@functools.lru_cache(maxsize=None)
def step_compiler_options() -> tuple:
  """((name, value), ...) for step programs on the default backend; () if none apply."""
  if jax.default_backend() != "cpu":
    return ()
  try:
    jax.jit(lambda x: x + 1, compiler_options=_CPU_STEP_OPTIONS).lower(1.0).compile()
  except Exception:  # this XLA lacks the option: compile as jax would by default
    return ()
  return tuple(_CPU_STEP_OPTIONS.items())


class _StepJit:
  """jax.jit(fun, **jit_kwargs) built at first use with step_compiler_options()."""

  def __init__(self, fun: Callable, jit_kwargs: dict):
    functools.update_wrapper(self, fun)
    self._fun, self._jit_kwargs, self._jitted = fun, jit_kwargs, None

  @property
  def jitted(self):
    if self._jitted is None:
      self._jitted = jax.jit(self._fun, compiler_options=dict(step_compiler_options()) or None,
                             **self._jit_kwargs)
    return self._jitted

  def __call__(self, *args, **kwargs):
    return self.jitted(*args, **kwargs)

  def __getattr__(self, name):  # lower, trace, _cache_size, ... of the jitted function
    return getattr(self.jitted, name)


def jit_step(fun: Callable = None, **jit_kwargs):
  """`jax.jit` for a decode/verify step program (usable as @jit_step(static_argnames=...))."""
  if fun is None:
    return functools.partial(jit_step, **jit_kwargs)
  return _StepJit(fun, jit_kwargs)
