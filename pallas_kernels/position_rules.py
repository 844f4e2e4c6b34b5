"""Position rules (an attention variant's mask, score and kv_range) made callable in a kernel.

A rule is a plain jnp function of broadcast integer positions (and the query head index):
  mask(q_pos, kv_pos) -> bool            True where the query at q_pos may see key kv_pos
  score(s, q_pos, kv_pos, head) -> s     s: the scaled (and soft-capped) score, float32
  kv_range(q_pos) -> (lo, hi)            no key outside [lo, hi) is visible to q_pos
A Pallas kernel body may not capture array constants (pallas_call raises), yet a rule
written naturally closes over one (an ALiBi slope table).  `lift` traces the rule once at
the shapes the kernel calls it with: the arrays it closed over become kernel inputs, and
the returned `LiftedRule` replays the trace on their values inside the body.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr

__all__ = ["LiftedRule", "TileRules", "lift", "check_rules"]


@dataclasses.dataclass(frozen=True, eq=False)
class LiftedRule:
  jaxpr: Jaxpr
  const_shapes: tuple  # each closed-over array's shape (it travels at least 1-d)

  @property
  def num_consts(self) -> int:
    return len(self.const_shapes)

  def __call__(self, const_refs, *args) -> list:
    """The rule's outputs on args, its constants read from const_refs (kernel refs)."""
    consts = [ref[...].reshape(shape) for ref, shape in zip(const_refs, self.const_shapes)]
    return jax.core.eval_jaxpr(self.jaxpr, consts, *args)


def lift(fn: Optional[Callable], *avals) -> tuple[Optional[LiftedRule], list]:
  """fn traced at avals (ShapeDtypeStructs) -> (LiftedRule, its constants, each >= 1-d),
  or (None, []) for no rule."""
  if fn is None:
    return None, []
  closed = jax.make_jaxpr(fn)(*avals)
  consts = [jnp.asarray(c) for c in closed.consts]
  return (LiftedRule(closed.jaxpr, tuple(c.shape for c in consts)),
          [c.reshape(c.shape or (1,)) for c in consts])


@dataclasses.dataclass(frozen=True)
class TileRules:
  """The lifted rules a kernel applies per tile (each None: not given)."""
  mask: Optional[LiftedRule] = None
  score: Optional[LiftedRule] = None
  kv_range: Optional[LiftedRule] = None

  def split_refs(self, refs) -> tuple[list, list, list, list]:
    """Kernel refs after the pages -> (mask, score, kv_range constant refs, the rest)."""
    out, refs = [], list(refs)
    for rule in (self.mask, self.score, self.kv_range):
      n = 0 if rule is None else rule.num_consts
      out.append(refs[:n])
      refs = refs[n:]
    return out[0], out[1], out[2], refs


def check_rules(mask_fn, score_fn, kv_range_fn) -> None:
  for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn), ("kv_range_fn", kv_range_fn)):
    if fn is not None and not callable(fn):
      raise ValueError(f"{name} must be a function of jnp arrays or None, got "
                       f"{type(fn).__name__}")
