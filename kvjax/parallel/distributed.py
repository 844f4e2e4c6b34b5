"""Start-up of a multi-device, multi-host run: --tp/--ep/--dp and jax.distributed, for
the CLIs.

`add_parallel_flags(parser)` adds --tp, --ep, --dp, --router-policy and the
multi-host flags; `load_replicas(args, checkpoint, dtype, weight_dtype)` joins the run
(`initialize`), lays the (dp, ep, tp) mesh over every process's devices
(kvjax.make_mesh) and loads one Model per data row (kvjax/parallel/sharding.py
`submeshes`), each over ep x tp devices; `serving_engine(models, config, policy)`
is one Engine, or a kvjax.Router over one Engine per replica.

Multi-host.  Every process runs the same command with its own --process-id;
`jax.distributed.initialize` connects them through the coordinator, after
which jax.devices() lists every host's devices and one jitted step spans them
(tensor parallelism across hosts; collectives over NCCL on GPUs, gloo on CPU).
Flags left unset fall back to what `jax.distributed.initialize` reads itself
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster's
SLURM / Open MPI variables).  Two hosts of 8 GPUs, tensor parallel over all 16:

  host0$ python -m kvjax generate --checkpoint DIR --tp 16 \\
           --coordinator-address host0:1234 --num-processes 2 --process-id 0 --prompt-ids 1,2
  host1$ python -m kvjax generate --checkpoint DIR --tp 16 \\
           --coordinator-address host0:1234 --num-processes 2 --process-id 1 --prompt-ids 1,2

(--tp 8 --dp 2 instead keeps each replica's all-reduces on one host's NVLink.)
Every process must see the checkpoint at the same path; each reads only the
slices its devices hold.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

__all__ = ["add_parallel_flags", "initialize", "load_replicas", "serving_engine"]

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def add_parallel_flags(parser: argparse.ArgumentParser, *, router: bool = True) -> None:
  """--tp, --ep, --dp, the multi-host flags and (`router`: the command serves many
  requests through a kvjax.Router when --dp > 1) --router-policy."""
  parser.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel degree: devices one model is split over "
                           "(default: %(default)s)")
  parser.add_argument("--ep", type=int, default=1,
                      help="expert-parallel degree for a mixture-of-experts model: its routed "
                           "experts are split over this many groups of --tp devices, so one "
                           "model runs on ep x tp devices (default: 1, every device holds "
                           "every expert)")
  replicas = ("behind a kvjax.Router" if router
              else "each sampling the prompt once, seed + its index")
  parser.add_argument("--dp", type=int, default=1,
                      help=f"data-parallel replicas, each on its own --ep x --tp devices, "
                           f"{replicas} (default: %(default)s)")
  if router:
    parser.add_argument("--router-policy", default="prefix",
                        help="where a request goes with --dp > 1: prefix (the replica "
                             "holding its longest cached prefix) | round_robin | "
                             "least_loaded (default: %(default)s)")
  parser.add_argument("--coordinator-address", default=None,
                      help="host:port of process 0 for a multi-host run "
                           "(default: $JAX_COORDINATOR_ADDRESS)")
  parser.add_argument("--num-processes", type=int, default=None,
                      help="processes in a multi-host run (default: $JAX_NUM_PROCESSES)")
  parser.add_argument("--process-id", type=int, default=None,
                      help="this process's index (default: $JAX_PROCESS_ID)")


def initialize(coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None, process_id: Optional[int] = None) -> bool:
  """Join a multi-process run if any flag or JAX_* variable asks for one -> whether it did.

  On CPU the processes' collectives go over gloo.
  """
  import jax  # here, not at the top: `kvjax --help` adds these flags without jax

  given = (coordinator_address, num_processes, process_id)
  if all(v is None for v in given) and not any(os.environ.get(name) for name in _ENV):
    return False
  if jax.config.jax_platforms in (None, "", "cpu"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True


def load_replicas(args: argparse.Namespace, checkpoint: Optional[str], dtype,
                  weight_dtype: Optional[str] = None) -> list:
  """One kvjax.Model per data-parallel replica, each split over its --ep x --tp devices
  (`weight_dtype` int8 / int4 codes need one device: load_checkpoint says so)."""
  from kvjax.api import load_checkpoint
  from kvjax.parallel.sharding import make_mesh, submeshes

  initialize(args.coordinator_address, args.num_processes, args.process_id)
  if args.tp == 1 and args.dp == 1 and args.ep == 1:
    return [load_checkpoint(checkpoint, dtype=dtype, weight_dtype=weight_dtype)]
  mesh = make_mesh(tp=args.tp, dp=args.dp, ep=args.ep)
  return [load_checkpoint(checkpoint, dtype=dtype, mesh=row, weight_dtype=weight_dtype)
          for row in submeshes(mesh)]


def serving_engine(models: list, config, policy: str = "prefix"):
  """An Engine for one model; a kvjax.Router (`policy`) over one Engine per replica."""
  from kvjax.engine.engine import Engine
  from kvjax.engine.router import Router

  engines = [Engine(model, config) for model in models]
  return engines[0] if len(engines) == 1 else Router(engines, policy)
