"""Issue 14: collectives of a tensor-parallel step, from HLO, and what they cost on paper.

1. HLO (8 fake CPU devices): compile the sharded decode step of a GQA 8/2
   model at num_layers 2 and 4 for each tp and dtype; every all-reduce's
   result shape gives its bytes; per layer = (4 layers - 2 layers) / 2, per
   token = / rows.  The Megatron layout predicts 2 all-reduces of D values per
   token and layer (after o and after down).
2. Paper (llama3-70b, 8 GPUs): a decode step is bandwidth-bound, each GPU
   reading its 1/tp of the weights plus its kv heads' share of the batch's KV
   at HBM speed, then the layers' all-reduces: a ring moves 2 (tp-1)/tp of the
   message per GPU over NVLink, plus a fixed latency per all-reduce (config).
   TP pays when it cuts per-token latency (weights/tp) by more than the
   all-reduces add; DP (tp-way split replaced by replicas) keeps every GPU busy
   without collectives, so it wins on throughput wherever one replica fits
   (`verdict`).  On XLA:CPU the partial sums are reduced in float32 even for
   bf16 weights (its dots run in f32); the paper estimate assumes the weights'
   dtype on the wire, as on GPUs.
Fake CPU devices cannot measure speed: timings run only on several real
accelerators (experiments/run_tp_device.sh).
"""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import kvjax  # noqa: E402
from experiments import common  # noqa: E402
from kvjax.attention.backends import get_backend, on_mesh  # noqa: E402
from kvjax.caches import create_paged_cache  # noqa: E402
from kvjax.model.params import init_params  # noqa: E402
from kvjax.parallel import ledger
from kvjax.parallel import ledger_tp
from kvjax.parallel import sharding  # noqa: E402
from kvjax.runtime.sampling import SamplingParams  # noqa: E402
from kvjax.runtime.step_batch import make_step_batch  # noqa: E402
from kvjax.runtime.steps import prefill  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tp_collectives.py", "experiment config", lock_config=True)

_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
_ALL_REDUCE = re.compile(r"= (\([^=]*?\)|\S+) all-reduce(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def all_reduces(hlo: str) -> list[tuple[int, str]]:
  """(bytes, element types) of every all-reduce in compiled HLO text (tuples summed)."""
  found = []
  for result in _ALL_REDUCE.findall(hlo):
    shapes = _SHAPE.findall(result)
    found.append((sum(_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
                      for dtype, dims in shapes), ",".join(sorted({t for t, _ in shapes}))))
  return found


def _model(layers: int, tp: int, dtype) -> kvjax.Model:
  cfg = kvjax.get_preset("tiny").replace(name=f"tiny-8x16-L{layers}", num_layers=layers,
                                         num_heads=8, head_dim=16)
  mesh = sharding.make_mesh(tp=tp, devices=jax.devices("cpu"))  # the 8 fake host devices
  params = sharding.init_on_mesh(functools.partial(init_params, cfg, dtype=dtype), mesh,
                                 jax.random.PRNGKey(0))
  return kvjax.Model(*sharding.replicate_kv_heads(cfg, params, mesh), dtype)


def _decode_step_hlo(model: kvjax.Model, rows: int) -> str:
  cache = create_paged_cache(model.config, None, rows, 1 + rows, 16, model.dtype,
                             mesh=model.mesh)
  batch = make_step_batch(np.ones((rows, 1), np.int32), np.full(rows, 5), np.ones(rows, np.int32),
                          1 + np.arange(rows)[:, None], np.arange(rows, dtype=np.int32),
                          SamplingParams.make(rows))
  return prefill.lower(model.params, cache, batch, config=model.config,
                       backend=on_mesh(get_backend("reference"), model.mesh)).compile().as_text()


def hlo_rows(config) -> list[dict]:
  rows = []
  for dtype_name in config.hlo_dtypes:
    dtype = kvjax.api.resolve_dtype(dtype_name)
    for tp in config.hlo_tps:
      found = {layers: all_reduces(_decode_step_hlo(_model(layers, tp, dtype), config.hlo_rows))
               for layers in (2, 4)}
      per_layer = (len(found[4]) - len(found[2])) / 2
      layer_bytes = (sum(b for b, _ in found[4]) - sum(b for b, _ in found[2])) / 2
      rows.append(dict(
          dtype=dtype_name, tp=tp, all_reduces_2_layers=len(found[2]),
          all_reduces_4_layers=len(found[4]), all_reduces_per_layer=per_layer,
          all_reduces_outside_layers=len(found[2]) - 2 * per_layer,
          bytes_per_token_per_layer=layer_bytes / config.hlo_rows,
          hidden_size=kvjax.get_preset("tiny").hidden_size,
          all_reduce_types=sorted({t for _, t in found[4]})))
  return rows


def paper_rows(config, hidden_values_per_layer: float) -> list[dict]:
  """Decode step time of `config.preset` per tp and batch: HBM-bound reads + all-reduces."""
  cfg = kvjax.get_preset(config.preset)
  rows = []
  for tp in config.paper_tps:
    for batch in config.batches:
      plan = ledger_tp.tp_plan(cfg, config.context, tp, batch=batch, kv_dtype=config.kv_dtype,
                            weight_dtype=config.weight_dtype, gpu_gib=config.gpu_gib)
      read = plan.weight_bytes_per_device + batch * plan.kv_bytes_per_request_per_device
      hbm_s = read / (config.hbm_gbps * 1e9)
      message = batch * cfg.hidden_size * ledger.bytes_for(1, config.weight_dtype)
      num = 0 if tp == 1 else hidden_values_per_layer * cfg.num_layers  # all-reduces a step
      wire = num * message * 2 * (tp - 1) / tp / (config.nvlink_gbps * 1e9)
      latency = num * config.all_reduce_latency_us * 1e-6
      step = hbm_s + wire + latency
      rows.append(dict(tp=tp, batch=batch, fits=plan.fits, hbm_s=hbm_s,
                       all_reduce_wire_s=wire, all_reduce_latency_s=latency, step_s=step,
                       all_reduce_bytes_per_step=num * message,
                       tokens_per_s_per_gpu=batch / step / tp))
  return rows


def verdict(paper) -> list[dict]:
  """Per batch, among the tp that fit: the lowest step time (TP pays) and the most tokens/s
  per GPU (the rest of the GPUs as data-parallel replicas: DP pays)."""
  out = []
  for batch in sorted({r["batch"] for r in paper}):
    fits = [r for r in paper if r["batch"] == batch and r["fits"]]
    if fits:
      out.append(dict(batch=batch, latency_tp=min(fits, key=lambda r: r["step_s"])["tp"],
                      throughput_tp=max(fits, key=lambda r: r["tokens_per_s_per_gpu"])["tp"]))
  return out


def measured_steps(config) -> dict:
  """Median decode-step seconds per tp on real accelerators; on fake CPU devices nothing."""
  info = common.describe_device()
  if info["platform"] == "cpu" or jax.device_count() < 2 or not config.measure_steps:
    return dict(skipped="fake CPU devices (or one accelerator) cannot measure TP speed: "
                        "they share one host, so collectives cost nothing real",
                device=common.device_label(info))
  times = {}
  tp = 1
  while tp <= jax.device_count():
    model = kvjax.load_checkpoint(config.measure_preset, dtype="bfloat16",
                                  mesh=sharding.make_mesh(tp=tp) if tp > 1 else None)
    engine = kvjax.Engine(model, max_num_seqs=8, max_model_len=1024)
    prompts = [[1 + i] * 64 for i in range(8)]
    engine.generate(prompts, 16)  # compiles
    times[tp] = common.median_seconds(lambda: engine.generate(prompts, 64), 3) / 64
    tp *= 2
  return dict(device=common.device_label(info), seconds_per_decode_step=times)


def _plot(rows, path):
  with common.figure(path, 1, 2, figsize=(12, 4.5)) as (_, (left, right)):
    for tp in sorted({r["tp"] for r in rows}):
      mine = [r for r in rows if r["tp"] == tp]
      batches = [r["batch"] for r in mine]
      style = "-" if all(r["fits"] for r in mine) else ":"
      left.plot(batches, [1e3 * r["step_s"] for r in mine], style, marker="o", label=f"tp={tp}")
      right.plot(batches, [r["tokens_per_s_per_gpu"] for r in mine], style, marker="o",
                 label=f"tp={tp}")
    left.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="step ms (paper)",
             title="llama3-70b decode step: HBM-bound reads + all-reduces")
    right.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="tokens/s per GPU",
              title="throughput per GPU (dotted: some batches do not fit)")
    for ax in (left, right):
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=8)


def main(argv):
  del argv
  config = _CONFIG.value
  hlo = hlo_rows(config)
  print(f"{'weights':9} {'tp':>3} {'AR/layer':>9} {'AR outside':>10} {'B/token/layer':>14} "
        f"types  (D = {hlo[0]['hidden_size']})")
  for r in hlo:
    print(f"{r['dtype']:9} {r['tp']:>3} {r['all_reduces_per_layer']:>9g} "
          f"{r['all_reduces_outside_layers']:>10g} {r['bytes_per_token_per_layer']:>14g} "
          f"{r['all_reduce_types']}")
  per_layer = hlo[0]["all_reduces_per_layer"]
  paper = paper_rows(config, per_layer)
  print(f"\n{config.preset} on {max(config.paper_tps)} GPUs, context {config.context}: "
        f"HBM {config.hbm_gbps:g} GB/s, NVLink {config.nvlink_gbps:g} GB/s, "
        f"{config.all_reduce_latency_us:g} us per all-reduce (assumed)")
  print(f"{'tp':>3} {'batch':>6} {'fits':>5} {'HBM ms':>8} {'AR wire ms':>10} {'AR lat ms':>9} "
        f"{'step ms':>8} {'tok/s/GPU':>10}")
  for r in paper:
    print(f"{r['tp']:>3} {r['batch']:>6} {str(r['fits']):>5} {1e3 * r['hbm_s']:>8.2f} "
          f"{1e3 * r['all_reduce_wire_s']:>10.3f} {1e3 * r['all_reduce_latency_s']:>9.2f} "
          f"{1e3 * r['step_s']:>8.2f} {r['tokens_per_s_per_gpu']:>10.1f}")
  verdicts = verdict(paper)
  for v in verdicts:
    print(f"batch {v['batch']:>4}: lowest latency tp={v['latency_tp']}, most tokens/s per GPU "
          f"tp={v['throughput_tp']} (then dp={max(config.paper_tps) // v['throughput_tp']} "
          f"replicas)")
  measured = measured_steps(config)
  print("\nmeasured:", measured)
  out = dict(issue=14, hlo=hlo, paper=paper, verdicts=verdicts, measured=measured,
             assumptions=dict(hbm_gbps=config.hbm_gbps, nvlink_gbps=config.nvlink_gbps,
                              all_reduce_latency_us=config.all_reduce_latency_us,
                              ring_all_reduce="2 (tp-1)/tp of the message per GPU"),
             device=common.describe_device())
  common.write_results(config.out_dir, config.name, out, plot=functools.partial(_plot, paper),
                       indent=2)


if __name__ == "__main__":
  app.run(main)
