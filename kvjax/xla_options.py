"""XLA compiler options for kvjax's step programs, chosen for the backend at first use.

On CPU, XLA hands dots to YNNPACK fusions, which run the few-row GEMMs of decode
and verify steps (1 to B x (K + 1) rows) at 2-4x the cost of XLA's own dot
thunks.  Measured on a 2-core x86 VM, same runs with the fusions off: engine MTP
verify+draft step at batch 1 4.55 -> 2.21 ms, static decode at batch 1 711 ->
1385 tok/s, prefill-heavy serving unchanged.  `jit_step` compiles a step program
with these options on a CPU backend whose XLA accepts them (checked once with a
probe compile: an option this XLA does not know would fail every compile), and
with none elsewhere (GPU).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

__all__ = ["step_compiler_options", "jit_step"]

_CPU_STEP_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}  # "": no YNN fusions


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
