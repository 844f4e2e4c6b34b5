"""The device-mesh axis names, outermost first, as kvjax.make_mesh lays them out.

  data    data-parallel replicas (kvjax/engine/router.py): one model per row, no collective
          crosses rows, so it is outermost (rows may sit on different hosts).
  expert  expert parallelism (kvjax/moe/expert_parallel.py), only on a mesh made with
          ep > 1: each MoE layer's routed experts split Ne / ep a device; attention and
          dense MLPs are replicated along it.  Its one all-reduce per MoE layer spans
          expert x model, the whole replica.
  model   tensor parallelism (kvjax/parallel/sharding.py): heads, MLP widths (each expert's Fe
          too) and the vocabulary split tp ways.  Innermost, so a tp group is adjacent
          devices (one host's NVLink): the two all-reduces of every block stay there.
"""
from __future__ import annotations

__all__ = ["DATA", "EXPERT", "MODEL"]

DATA, EXPERT, MODEL = "data", "expert", "model"
