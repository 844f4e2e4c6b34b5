"""XLA compiler options for kvjax's step programs, chosen for the backend at first use.

On CPU, XLA hands dots (and, by default, more) to YNNPACK fusions.  Decode and
verify step programs keep YNNPACK for dots alone (LIBRARY_FUSION_TYPE_DOT), prefill
programs none (numbers at _CPU_STEP_OPTIONS): for dots alone, YNNPACK runs the batched
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
from typing import Callable, Optional

import jax

__all__ = ["step_compiler_options", "jit_step", "DECODE_COLUMNS"]

# Per program kind: decode and verify steps (a few columns per row: YNNPACK for dots
# only) and prefill chunks (XLA's own dots: with YNNPACK's, a prefill-heavy engine run
# of 32 prompts of 512 tokens took 1.54-1.63 s instead of 1.20-1.37 s).
_CPU_STEP_OPTIONS = {
    "decode": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "prefill": {"xla_cpu_experimental_ynn_fusion_type": ""},
}
# A step program whose StepBatch feeds at most this many columns per row is a decode
# or verify step (1 + J columns); prefill chunks are wider (kvjax/batching.py buckets).
DECODE_COLUMNS = 8


@functools.lru_cache(maxsize=None)
def step_compiler_options(kind: str = "decode") -> tuple:
  """((name, value), ...) for `kind` ("decode" or "prefill") step programs on the default
  backend; () if none apply."""
  if jax.default_backend() != "cpu":
    return ()
  options = _CPU_STEP_OPTIONS[kind]
  try:
    jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
  except Exception:  # this XLA lacks the option: compile as jax would by default
    return ()
  return tuple(options.items())


class _StepJit:
  """jax.jit(fun, **jit_kwargs), one per program kind, each built at first use with
  step_compiler_options(kind); a call's kind is that of its StepBatch argument (the
  positional `batch_argnum`; None: always "decode")."""

  def __init__(self, fun: Callable, batch_argnum: Optional[int], jit_kwargs: dict):
    functools.update_wrapper(self, fun)
    self._fun, self._batch_argnum, self._jit_kwargs = fun, batch_argnum, jit_kwargs
    self._jitted: dict = {}

  def jitted(self, kind: str = "decode"):
    if kind not in self._jitted:
      self._jitted[kind] = jax.jit(
          self._fun, compiler_options=dict(step_compiler_options(kind)) or None,
          **self._jit_kwargs)
    return self._jitted[kind]

  def kind_of(self, batch) -> str:
    return "decode" if batch.tokens.shape[1] <= DECODE_COLUMNS else "prefill"

  def __call__(self, *args, **kwargs):
    kind = "decode" if self._batch_argnum is None else self.kind_of(args[self._batch_argnum])
    return self.jitted(kind)(*args, **kwargs)

  def _cache_size(self) -> int:
    """Programs compiled so far, every kind."""
    return sum(f._cache_size() for f in self._jitted.values())

  def __getattr__(self, name):  # lower, trace, ... of the decode program
    return getattr(self.jitted("decode"), name)


def jit_step(fun: Callable = None, *, batch_argnum: Optional[int] = None, **jit_kwargs):
  """`jax.jit` for a step program (usable as @jit_step(static_argnames=...)); batch_argnum:
  the positional StepBatch argument whose width picks the options (None: a decode loop)."""
  if fun is None:
    return functools.partial(jit_step, batch_argnum=batch_argnum, **jit_kwargs)
  return _StepJit(fun, batch_argnum, jit_kwargs)
