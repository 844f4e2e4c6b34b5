# python -m experiments.tp_collectives --config=configs/tp_collectives.py
"""Tensor-parallel collectives (issue 14): what a sharded step all-reduces, from the
compiled HLO on 8 fake CPU devices, and on paper what that costs llama3-70b on 8 GPUs.

Fake CPU devices share one host: they prove which collectives XLA emits and how
many bytes they carry, never how fast a real interconnect moves them.  On a
machine with several GPUs `measure_steps` also times the sharded decode step
(experiments/run_tp_device.sh).  `get_config("runlocal")` sweeps fewer points.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  # HLO measurement: the 'tiny' preset reshaped to 8 query heads of 16 (GQA 8/2), at
  # num_layers 2 and 4 so per-layer collectives are the difference / 2.
  config.hlo_tps = (2, 4, 8)
  config.hlo_dtypes = ("float32", "bfloat16")
  config.hlo_rows = 4  # decode rows: one token each
  # Paper model: llama3-70b on 8 GPUs.
  config.preset = "llama3-70b"
  config.weight_dtype = "bf16"
  config.kv_dtype = "bf16"
  config.gpu_gib = 141.0  # H200
  config.hbm_gbps = 4800.0  # H200 HBM3e, GB/s (decimal)
  config.nvlink_gbps = 900.0  # NVLink 4, GB/s per GPU
  config.all_reduce_latency_us = 8.0  # per all-reduce, an assumption (NCCL small-message)
  config.context = 4096
  config.paper_tps = (1, 2, 4, 8)
  config.batches = (1, 4, 16, 64, 128, 256)
  config.measure_steps = True  # time decode steps when several real accelerators exist
  config.measure_preset = "llama3-8b"
  config.out_dir = "results"
  config.name = "tp_collectives"
  if arg == "runlocal":
    config.hlo_tps = (2, 8)
    config.hlo_dtypes = ("float32",)
    config.batches = (1, 64)
    config.name = "tp_collectives_runlocal"  # never overwrite the committed results.
  return config
