"""Tensor-parallel checks on 8 fake CPU devices, run in a subprocess by tests/test_sharding.py.

`python tests/sharded_checks.py OUT.json` sets XLA_FLAGS before jax starts, runs
every check on shared tiny models (one jax start-up, compiles reused) and writes
{check: {"ok": bool, "error": str, ...measured values}}; test_sharding.py
asserts on each entry.  Oracles: the same checkpoint loaded on one device (its
tokens and logits), a hand-written table of the Megatron layout, HLO text.
"""
from __future__ import annotations

import os
import sys

# LLVM at -O0: these tiny models' checks are XLA-compile bound (many distinct
# sharded programs) and compare programs built alike; -O0 halves each compile, the HLO (its
# sharding and collectives, what is checked) is the same.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvjax  # noqa: E402
from kvjax.caches import create_paged_cache  # noqa: E402
from kvjax.cli import main as cli
from kvjax.model.params import init_params  # noqa: E402
from kvjax.parallel import sharding  # noqa: E402
from kvjax.runtime.sampling import SamplingParams  # noqa: E402
from kvjax.runtime.step_batch import make_step_batch  # noqa: E402
from kvjax.runtime.steps import prefill  # noqa: E402
from tests import engine_helpers, hf_models, test_mla  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 9, 44, 71], [3, 99, 12, 8, 61, 23, 5, 5, 90, 14, 2, 77, 31, 6, 15],
           [120, 1, 50]]
NEW_TOKENS = 12
# The layout promised by kvjax/parallel/sharding.py, written out leaf by leaf: M = "model".
M = sharding.MODEL
EXPECTED_SPECS = {
    "embed": (M, None), "lm_head": (None, M), "final_norm": (), "attn_norm": (),
    "mlp_norm": (), "wq": (None, M, None), "wk": (None, M, None), "wv": (None, M, None),
    "wo": (M, None, None), "q_norm": (), "k_norm": (), "w_gate": (None, M),
    "w_up": (None, M), "w_down": (M, None),
    # MLA: the shared latent projection replicated, per-head up-projections split.
    "wkv_a": (), "kv_norm": (), "wk_b": (None, M, None), "wv_b": (None, M, None),
}
_DIR = tempfile.mkdtemp(prefix="kvjax_sharded_")


def _hf_dir(name: str, config_cls, model_cls, **config) -> str:
  directory = os.path.join(_DIR, name)
  if not os.path.isdir(directory):
    torch.manual_seed(0)
    model_cls(config_cls(**config)).eval().save_pretrained(directory)
  return directory


def hf_family(family: str, **overrides) -> str:
  config_cls, model_cls, extra = hf_models.FAMILIES[family]
  return _hf_dir(family + "".join(f"_{k}{v}" for k, v in overrides.items()), config_cls,
                 model_cls, **{**hf_models._COMMON, **extra, **overrides})


def mla_dir() -> str:
  config_cls, model_cls, extra = test_mla.VARIANTS["deepseek_v2"]
  return _hf_dir("deepseek_v2", config_cls, model_cls, **{**test_mla._COMMON, **extra})


@functools.lru_cache(maxsize=None)
def load(path: str, tp: int) -> kvjax.Model:
  return kvjax.load_checkpoint(path, mesh=sharding.make_mesh(tp=tp) if tp > 1 else None)


def _spec(leaf) -> tuple:
  spec = tuple(leaf.sharding.spec)
  return spec + (None,) * (leaf.ndim - len(spec)) if spec else ()


def _padded(spec: tuple, ndim: int) -> tuple:
  return spec + (None,) * (ndim - len(spec)) if spec else ()


def check_layout(model: kvjax.Model) -> int:
  """Every param leaf carries EXPECTED_SPECS' sharding; -> leaves checked."""
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
    name = str(path[-1].name)
    assert isinstance(leaf.sharding, jax.sharding.NamedSharding), (name, leaf.sharding)
    assert _spec(leaf) == _padded(EXPECTED_SPECS[name], leaf.ndim), (name, leaf.sharding.spec)
    checked += 1
  return checked


def prefill_logits(model: kvjax.Model, kv_dtype=None) -> np.ndarray:
  """Logits [B, V] at each prompt's last token through a paged prefill step."""
  rows, width = len(PROMPTS), 16
  tokens = np.zeros((rows, width), np.int32)
  for i, p in enumerate(PROMPTS):
    tokens[i, :len(p)] = p
  lens = np.array([len(p) for p in PROMPTS], np.int32)
  tables = 1 + np.arange(rows, dtype=np.int32)[:, None]
  cache = create_paged_cache(model.config, kv_dtype, rows, 1 + rows, 16, model.dtype,
                             mesh=model.mesh)
  batch = make_step_batch(tokens, np.zeros(rows), lens, tables, np.arange(rows, dtype=np.int32),
                          SamplingParams.make(rows))
  cache, logits, _ = prefill(model.params, cache, batch, config=model.config,
                             backend=kvjax.get_backend("reference") if model.mesh is None
                             else kvjax.attention.backends.on_mesh(kvjax.get_backend("reference"),
                                                         model.mesh))
  if model.mesh is not None:
    assert _spec(cache.k_pages if hasattr(cache, "k_pages") else cache.pages) in (
        (None, M, None, None, None), ()), cache
  return np.asarray(logits)


def check_llama_gqa() -> dict:
  """GQA 8/2: tp 2 splits kv heads, tp 8 replicates them 4x (the same replication code as
  tp 4's 2x, whose tokens check_llama_engine and check_int8_kv compare and whose page
  bytes check_memory_ledger counts)."""
  path = hf_family("llama", num_attention_heads=8, head_dim=16)
  single = load(path, 1)
  want_tokens = kvjax.generate(single, PROMPTS, NEW_TOKENS).tokens
  want_logits = np.asarray(kvjax.forward(single, [PROMPTS[1]]))
  want_prefill = prefill_logits(single)
  out = {}
  for tp in (2, 8):
    model = load(path, tp)
    assert model.config.num_kv_heads == max(2, tp), model.config.num_kv_heads
    leaves = check_layout(model)
    wk = model.params.blocks[0].attn.wk
    assert {s.data.shape[1] for s in wk.addressable_shards} == {1}, wk.shape  # K' / tp
    tokens = kvjax.generate(model, PROMPTS, NEW_TOKENS).tokens
    assert tokens == want_tokens, (tp, tokens, want_tokens)
    forward_diff = float(np.abs(np.asarray(kvjax.forward(model, [PROMPTS[1]])) -
                                want_logits).max())
    prefill_diff = float(np.abs(prefill_logits(model) - want_prefill).max())
    # Float32 sums split over tp devices add in another order: ~40 ulp of the largest
    # logit (5.4 here; tp 8 measured 9.3e-6 / 1.05e-5 on a Xeon); a misplaced head or
    # shard would be off by O(1).
    tolerance = 5e-6 * float(np.abs(want_logits).max())
    assert max(forward_diff, prefill_diff) < tolerance, (tp, forward_diff, prefill_diff)
    out[f"tp{tp}"] = dict(leaves=leaves, forward_diff=forward_diff, prefill_diff=prefill_diff,
                          tolerance=tolerance, kv_heads=model.config.num_kv_heads)
  return out


def check_llama_engine() -> dict:
  """The Engine on tp 4 (replicated kv heads), reference and Pallas kernels under shard_map."""
  path = hf_family("llama", num_attention_heads=8, head_dim=16)
  want = kvjax.generate(load(path, 1), PROMPTS, NEW_TOKENS).tokens
  out = {}
  for backend in ("reference", "pallas_interpret"):
    engine = kvjax.Engine(load(path, 4), max_num_seqs=4, max_model_len=64, page_size=8,
                          backend=backend)
    got = engine.generate(PROMPTS, NEW_TOKENS).tokens
    assert got == want, (backend, got, want)
    k_pages = engine.state.cache.k_pages
    assert _spec(k_pages) == (None, M, None, None, None), k_pages.sharding
    assert engine.config.backend.mesh is load(path, 4).mesh
    out[backend] = dict(k_pages_shard=list(k_pages.addressable_shards[0].data.shape))
  return out


def check_variant() -> dict:
  """An attention variant whose score reads the head index (ALiBi, 8 heads) on tp 4: each
  device's score sees its heads' global indices, reference and Pallas kernels alike."""
  path = hf_family("llama", num_attention_heads=8, head_dim=16)
  slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, 9) / 8), jnp.float32)
  alibi = kvjax.AttentionVariant("alibi8", score=lambda s, q, k, h: s - 8 * slopes[h] * (q - k))
  want = kvjax.generate(load(path, 1), PROMPTS, NEW_TOKENS, attention=alibi).tokens
  assert want != kvjax.generate(load(path, 1), PROMPTS, NEW_TOKENS).tokens, "no change"
  for backend in ("reference", "pallas_interpret"):
    engine = kvjax.Engine(load(path, 4), max_num_seqs=4, max_model_len=64, page_size=8,
                          backend=backend, attention=alibi)
    got = engine.generate(PROMPTS, NEW_TOKENS).tokens
    assert got == want, (backend, got, want)


def check_families() -> dict:
  """Qwen3 (q/k norm), Mistral (window, MQA -> replicated), MLA: tokens equal, logits 1e-5."""
  out = {}
  for name, path, tp in (("qwen3", hf_family("qwen3"), 2), ("mistral", hf_family("mistral"), 2),
                         ("deepseek_v2", mla_dir(), 4)):
    single, model = load(path, 1), load(path, tp)
    check_layout(model)
    want = kvjax.generate(single, PROMPTS, NEW_TOKENS).tokens
    # The engine on the mesh (the static batch on one: check_llama_gqa's).
    engine = kvjax.Engine(model, max_num_seqs=4, max_model_len=64, page_size=8)
    assert engine.generate(PROMPTS, NEW_TOKENS).tokens == want, name
    diff = float(np.abs(prefill_logits(model) - prefill_logits(single)).max())
    assert diff < 1e-5, (name, diff)
    out[name] = dict(tp=tp, prefill_diff=diff, kv_heads=model.config.num_kv_heads)
  return out


def check_int8_kv() -> dict:
  """int8 and int4 pages with their scales split by kv head, tp 4 (replicated heads)."""
  path = hf_family("llama", num_attention_heads=8, head_dim=16)
  want = kvjax.generate(load(path, 1), PROMPTS, NEW_TOKENS, kv_dtype="int8").tokens
  model = load(path, 4)
  assert kvjax.generate(model, PROMPTS, NEW_TOKENS, kv_dtype="int8").tokens == want
  engine = kvjax.Engine(model, max_num_seqs=4, max_model_len=64, page_size=8, kv_dtype="int8")
  assert engine.generate(PROMPTS, NEW_TOKENS).tokens == want
  cache = engine.state.cache
  assert _spec(cache.k_scales) == (None, M, None, None), cache.k_scales.sharding
  # int4 (KIVI): packed pages, per-channel scales and the slots' residual split by kv head,
  # through the Engine (the static loop's quantized pages on the mesh: int8's, above).
  # A page is KIVI's quantization group, so the oracle uses the same page size.
  int4, want4 = (kvjax.Engine(m, max_num_seqs=4, max_model_len=64, page_size=8, kv_dtype="int4")
                 for m in (model, load(path, 1)))
  assert int4.generate(PROMPTS, NEW_TOKENS).tokens == want4.generate(PROMPTS, NEW_TOKENS).tokens
  kivi = int4.state.cache
  assert _spec(kivi.k_residual) == (None, None, None, M, None), kivi.k_residual.sharding
  return dict(scale_shard=list(cache.k_scales.addressable_shards[0].data.shape),
              int4_scale_shard=list(kivi.k_scales.addressable_shards[0].data.shape))


def check_mtp() -> dict:
  """MTP speculation on tp 2: greedy tokens equal the single-device plain decode."""
  single = engine_helpers.mtp_model()
  mesh = sharding.make_mesh(tp=2)
  model = kvjax.Model(single.config, sharding.shard_params(single.params, mesh))
  assert model.mesh is mesh
  prompts = engine_helpers.prompts(3)
  want = kvjax.generate(single, prompts, NEW_TOKENS).tokens
  engine = kvjax.Engine(model, speculative="mtp", num_draft=2, max_num_seqs=4,
                        max_model_len=64, page_size=8)
  result = engine.generate(prompts, NEW_TOKENS)
  assert result.tokens == want, (result.tokens, want)
  return dict(acceptance=result.stats.get("acceptance_rate"))


def _count_all_reduces(model: kvjax.Model) -> int:
  rows = 2
  cache = create_paged_cache(model.config, None, rows, 1 + rows, 16, model.dtype,
                             mesh=model.mesh)
  batch = make_step_batch(np.ones((rows, 8), np.int32), np.zeros(rows),
                          np.full(rows, 8, np.int32), 1 + np.arange(rows)[:, None],
                          np.arange(rows, dtype=np.int32), SamplingParams.make(rows))
  backend = kvjax.attention.backends.on_mesh(kvjax.get_backend("reference"), model.mesh)
  hlo = prefill.lower(model.params, cache, batch, config=model.config,
                      backend=backend).compile().as_text()
  return len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))


def check_collectives() -> dict:
  """All-reduces per dense block from the compiled HLO: count(2 layers) - count(1)."""
  mesh = sharding.make_mesh(tp=2)
  counts = {}
  for layers in (1, 2):  # the smallest programs that differ by one block
    cfg = dataclasses.replace(kvjax.get_preset("tiny"), num_layers=layers)
    params = sharding.init_on_mesh(
        functools.partial(init_params, cfg, jax.random.PRNGKey(0)), mesh)
    counts[layers] = _count_all_reduces(kvjax.Model(cfg, params))
  per_layer = counts[2] - counts[1]
  assert per_layer == 2, counts
  return dict(all_reduces=counts, per_layer=per_layer)


def check_transfer_guard() -> dict:
  """A sharded prefill and decode loop run with host transfers disallowed."""
  model = load(hf_family("llama", num_attention_heads=8, head_dim=16), 4)
  rows = 2
  cache = create_paged_cache(model.config, None, rows, 1 + rows, 16, model.dtype,
                             mesh=model.mesh)
  batch = jax.device_put(make_step_batch(
      np.ones((rows, 8), np.int32), np.zeros(rows), np.full(rows, 8, np.int32),
      1 + np.arange(rows)[:, None], np.arange(rows, dtype=np.int32), SamplingParams.make(rows)),
      jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec()))  # replicated
  backend = kvjax.attention.backends.on_mesh(kvjax.get_backend("pallas_interpret"), model.mesh)
  prefill(model.params, jax.tree.map(lambda x: x.copy(), cache), batch, config=model.config,
          backend=backend)  # compile (and the jit's own constants) outside the guard
  with jax.transfer_guard("disallow"):
    cache, logits, _ = prefill(model.params, cache, batch, config=model.config,
                               backend=backend)
    logits.block_until_ready()
  return dict(logits_shape=list(logits.shape))


def _device_bytes(tree) -> set:
  """Bytes each device holds of a pytree's arrays -> the set over devices (one value if even)."""
  per_device = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return set(per_device.values())


def _memory_json(tp: int, kv_dtype: str) -> dict:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert cli.main(["memory", "--preset", "tiny", "--context", "64", "--tp", str(tp),
                     "--weight-dtype", "fp32", "--kv-dtype", kv_dtype, "--count-scales",
                     "--json"]) == 0
  return json.loads(out.getvalue())["tp"]


def check_memory_ledger() -> dict:
  """Per-device bytes of the placed weights and pages equal `kvjax memory --tp N`."""
  out = {}
  for tp, kv_dtype in ((2, "fp32"), (4, "fp32"), (4, "int8")):
    model = kvjax.load_checkpoint("tiny", mesh=sharding.make_mesh(tp=tp))
    printed = _memory_json(tp, kv_dtype)
    weights = _device_bytes(model.params)
    assert weights == {printed["weight_bytes_per_device"]}, (tp, weights, printed)
    engine = kvjax.Engine(model, max_num_seqs=2, max_model_len=64, page_size=8, num_pages=17,
                          kv_dtype=None if kv_dtype == "fp32" else kv_dtype)
    pages = _device_bytes(engine.state.cache)
    tokens = engine.state.cache.num_pages * engine.state.cache.page_size
    assert pages == {printed["kv_bytes_per_token_per_device"] * tokens}, (tp, pages, printed)
    out[f"tp{tp}_{kv_dtype}"] = dict(weights=weights.pop(), kv_per_token=pages.pop() // tokens,
                                     kv_replication=printed["kv_replication"])
  return out


def check_router_submeshes() -> dict:
  """dp=2 x tp=2: one engine per sub-mesh behind the prefix Router; outputs equal one device."""
  path = hf_family("llama", num_attention_heads=8, head_dim=16)
  want = kvjax.generate(load(path, 1), PROMPTS, NEW_TOKENS).tokens
  rows = sharding.submeshes(sharding.make_mesh(tp=2, dp=2))
  engines = [kvjax.Engine(kvjax.load_checkpoint(path, mesh=row), max_num_seqs=4,
                          max_model_len=64, page_size=8) for row in rows]
  router = kvjax.Router(engines, "least_loaded")
  result = router.generate(PROMPTS, NEW_TOKENS)
  assert result.tokens == want, (result.tokens, want)
  devices = [{s.device.id for s in e.state.cache.k_pages.addressable_shards} for e in engines]
  assert devices == [{0, 1}, {2, 3}], devices
  return dict(replicas=result.stats["replicas"], devices=[sorted(d) for d in devices])


CHECKS = [check_memory_ledger, check_llama_gqa, check_llama_engine, check_variant,
          check_families, check_int8_kv, check_mtp, check_collectives, check_transfer_guard,
          check_router_submeshes]


def main(out_path: str, names: list[str]) -> None:
  assert jax.device_count() == 8, jax.devices()
  results = {}
  for check in CHECKS:
    if names and check.__name__ not in names:
      continue
    start = time.perf_counter()
    try:
      results[check.__name__] = dict(ok=True, **(check() or {}))
    except Exception:  # reported to the pytest side, which fails naming it
      results[check.__name__] = dict(ok=False, error=traceback.format_exc())
    results[check.__name__]["seconds"] = time.perf_counter() - start  # what the suite pays
    with open(out_path, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
