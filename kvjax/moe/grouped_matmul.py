"""The grouped expert path's ragged matmul as capability records, chosen by name (as the
attention backends are, kvjax/attention/backends.py).

  ragged_dot(lhs [Ae, D], rhs [Ne, D, Fe], group_sizes [Ne] int32) -> [Ae, Fe]: row
      block e (the group_sizes[e] rows after the earlier experts' rows) of lhs times
      rhs[e] (the down projection alike, D and Fe swapped).

Built-in names (ModelConfig.moe_grouped_matmul):
  xla      jax.lax.ragged_dot: grouped kernels on TPU; XLA:CPU, and XLA:GPU for some
           shapes, run it as a masked dense dot (Ne x the flops).
  tokamax  tokamax.ragged_dot (`pip install "kvjax[gpu]"`): its Mosaic GPU kernel
           (Hopper, Blackwell), else its Triton kernel, else tokamax's own XLA
           implementation (the CPU dry run); tokamax is imported at first use, so
           kvjax never needs it.
Expert parallelism (kvjax/moe/expert_parallel.py) keeps "xla": it lets rows past the
local groups through and drops them after, relying on jax.lax.ragged_dot's defined
output for them, which a kernel need not write.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import types
from typing import Callable, Optional

import jax

__all__ = ["GroupedMatmul", "GROUPED_MATMULS", "get_grouped_matmul"]

# tokamax tries these in order and takes the first that does not raise NotImplementedError
# (the GPU kernels raise it off a GPU, and for shapes or dtypes they do not take).
TOKAMAX_IMPLEMENTATIONS = ("mosaic", "triton", "xla")


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  name: str
  ragged_dot: Callable
  requires: Optional[str] = None  # the module it imports at first use, None: jax alone
  extra: Optional[str] = None  # kvjax's pip extra that installs it

  def check_available(self) -> None:
    """ImportError naming the extra unless `requires` can be imported."""
    if self.requires is not None and importlib.util.find_spec(self.requires) is None:
      raise ImportError(f"grouped matmul {self.name!r} needs {self.requires}: "
                        f"pip install \"kvjax[{self.extra}]\"")


def _tokamax_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  import tokamax  # pylint: disable=g-import-not-at-top  # optional: the "gpu" extra
  from absl import flags  # pylint: disable=g-import-not-at-top
  # tokamax reads its options from absl flags and, where no absl app has parsed them,
  # parses sys.argv itself: the host program's own arguments (pytest's, the CLI's) then
  # fail as unknown flags.  Unparsed, tokamax's defaults are what it would get.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=TOKAMAX_IMPLEMENTATIONS)


GROUPED_MATMULS = types.MappingProxyType({
    "xla": GroupedMatmul("xla", jax.lax.ragged_dot),
    "tokamax": GroupedMatmul("tokamax", _tokamax_ragged_dot, requires="tokamax", extra="gpu"),
})


def get_grouped_matmul(name: str) -> GroupedMatmul:
  """The record named `name`; ValueError naming the known ones, ImportError naming the
  extra where its module is missing."""
  if name not in GROUPED_MATMULS:
    raise ValueError(f"unknown moe_grouped_matmul {name!r}; known: {sorted(GROUPED_MATMULS)}")
  record = GROUPED_MATMULS[name]
  record.check_available()
  return record
