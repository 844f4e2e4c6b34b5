"""LoRA adapters (kvjax/lora/): logits equal transformers + PEFT per adapter on a tiny
random llama, a mixed batch equals each row run alone, a quantized base takes float
adapters, and unsupported adapters are refused by name."""
from __future__ import annotations

import copy
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax.lora.peft import read_adapter, set_slot, with_slots
from kvjax.lora.weight import route
from kvjax.model.decoder import forward
from tests import hf_models

peft = pytest.importorskip("peft")

TOKENS = np.array([[5, 17, 99, 3, 42, 8, 64, 21, 7, 120, 33]], np.int32)
# name -> LoraConfig keywords: every target, rsLoRA on two, three targets of mixed kinds.
ADAPTERS = {
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mixed": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


PROMPT = [3, 77, 12, 9, 101, 45, 6, 88, 30, 2, 64, 19, 50]  # 3 full pages of 4 and one token
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
  """(kvjax Model, {name: adapter dir}, {name: PEFT logits [T, V]}, base logits [T, V],
  {name or None (base): PEFT's greedy continuation of PROMPT})."""
  base_dir = str(tmp_path_factory.mktemp("lora_base"))
  hf_model = hf_models.save_tiny("llama", base_dir)
  dirs, expected, greedy = {}, {}, {}

  def run(model, name):
    with torch.no_grad():
      out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)
      greedy[name] = out[0, len(PROMPT):].tolist()
      return model(torch.tensor(TOKENS, dtype=torch.long)).logits[0].numpy()

  for seed, (name, options) in enumerate(ADAPTERS.items()):
    torch.manual_seed(seed + 1)
    tuned = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        init_lora_weights=False, **options)).eval()  # random B: a non-zero delta
    dirs[name] = str(tmp_path_factory.mktemp(f"lora_{name}"))
    tuned.save_pretrained(dirs[name])
    expected[name] = run(tuned, name)
  base = run(hf_model, None)
  assert len({tuple(t) for t in greedy.values()}) == len(greedy)  # each adapter tells
  return kvjax.load_checkpoint(base_dir), dirs, expected, base, greedy


def _slotted(model, dirs, params=None):
  """Model params with adapter i + 1 in slot i + 1 (ADAPTERS order), slot 0 no adapter."""
  params = with_slots(model.params if params is None else params, model.config,
                      num_slots=len(dirs) + 1, max_rank=8)
  for slot, name in enumerate(ADAPTERS, start=1):
    params = set_slot(params, slot, read_adapter(dirs[name], model.config, model.params))
  return params


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, config, rows, tokens):
  return forward(route(params, rows), config, tokens)


def _logits(params, model, rows, tokens):
  return np.asarray(_forward(params, model.config, jnp.asarray(rows, jnp.int32),
                             jnp.asarray(tokens)))


def test_logits_equal_peft_per_adapter(lora_setup):
  model, dirs, expected, base, _ = lora_setup
  params = _slotted(model, dirs)
  for slot, name in enumerate(ADAPTERS, start=1):
    got = _logits(params, model, [slot], TOKENS)[0]
    assert np.abs(expected[name] - base).max() > 0.1, name  # the adapter changes logits
    np.testing.assert_allclose(got, expected[name], atol=2e-4, rtol=1e-4, err_msg=name)
  np.testing.assert_allclose(_logits(params, model, [0], TOKENS)[0], base, atol=2e-4,
                             rtol=1e-4)


def test_mixed_batch_equals_each_row_alone(lora_setup):
  model, dirs, expected, base, _ = lora_setup
  params = _slotted(model, dirs)
  rows = [2, 0, 3, 1]
  batch = _logits(params, model, rows, np.repeat(TOKENS, len(rows), 0))
  for b, slot in enumerate(rows):
    alone = _logits(params, model, [slot], TOKENS)[0]
    np.testing.assert_allclose(batch[b], alone, atol=1e-5, rtol=1e-5, err_msg=f"row {b}")


def test_quantized_base_takes_float_adapters(lora_setup):
  """int8 codes + adapters equal the dequantized float base + the same adapters."""
  from kvjax.weights.quantize import quantize_params

  model, dirs, *_ = lora_setup
  quantized = quantize_params(model.params, model.config, "int8")
  dequantized = jax.tree_util.tree_map(
      lambda w: w.dequantize(jnp.float32) if hasattr(w, "dequantize") else w, quantized,
      is_leaf=lambda w: hasattr(w, "dequantize"))
  rows = [1, 2, 3, 0]
  tokens = np.repeat(TOKENS, len(rows), 0)
  got = _logits(_slotted(model, dirs, quantized), model, rows, tokens)
  want = _logits(_slotted(model, dirs, dequantized), model, rows, tokens)
  np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3)
  assert np.abs(got[0] - got[3]).max() > 0.1  # the adapter acted on the quantized base


def _write_config(directory, **changes):
  file = os.path.join(directory, "adapter_config.json")
  with open(file) as f:
    config = json.load(f)
  with open(file, "w") as f:
    json.dump(dict(config, **changes), f)


@pytest.mark.parametrize("changes, field", [
    (dict(r=128), "r=128"), (dict(use_dora=True), "use_dora"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    (dict(target_modules="q_proj|v_proj"), "target_modules"), (dict(bias="all"), "bias"),
    (dict(peft_type="IA3"), "peft_type")])
def test_unsupported_adapters_are_refused_by_name(lora_setup, tmp_path, changes, field):
  import shutil

  model, dirs, *_ = lora_setup
  directory = str(tmp_path / "adapter")
  shutil.copytree(dirs["rslora"], directory)
  _write_config(directory, **changes)
  with pytest.raises(ValueError, match=field):
    read_adapter(directory, model.config, model.params)


def test_other_families_and_missing_files_are_refused(lora_setup, tmp_path):
  model, dirs, *_ = lora_setup
  with pytest.raises(FileNotFoundError, match="adapter_config.json"):
    read_adapter(str(tmp_path), model.config, model.params)
  with pytest.raises(ValueError, match="layer 0 is 'mla'"):  # checked before any weight
    read_adapter(dirs["all"], kvjax.get_preset("deepseek-v2-lite"), None)


def _engine(model, dirs, **options):
  engine = kvjax.Engine(model, max_loras=3, max_lora_rank=8, page_size=4, max_num_seqs=4,
                        **options)
  for name in ADAPTERS:
    engine.load_adapter(name, dirs[name])
  return engine


def _finished(engine, loras) -> list:
  """Greedy PROMPT under each of `loras` (None: the base model), one engine run ->
  their final RequestOutputs."""
  ids = [engine.add_request(PROMPT, NEW_TOKENS, lora=lora) for lora in loras]
  final = {out.request_id: out for out in engine.stream() if out.finished}
  return [final[i] for i in ids]


def test_engine_batches_adapters_as_peft_generates(lora_setup):
  model, dirs, _, _, greedy = lora_setup
  engine = _engine(model, dirs, prefix_cache=False)
  loras = ["mixed", None, "all", "rslora"]
  for lora, out in zip(loras, _finished(engine, loras)):
    assert out.output_ids == greedy[lora], lora


def test_prefix_cache_keys_the_adapter_and_unload_frees_it(lora_setup):
  model, dirs, _, _, greedy = lora_setup
  engine = _engine(model, dirs)
  cache = engine.scheduler.prefix_cache
  hits = lambda lora: _finished(engine, [lora])[0].metrics.prefix_hit_tokens
  assert hits("all") == 0
  assert hits("rslora") == 0 and hits(None) == 0  # never the other adapter's pages
  assert hits("all") == 12  # its own: 3 full pages
  cached = cache.num_cached_pages
  engine.unload_adapter("all")
  assert cache.num_cached_pages == cached - 4  # its prompt's 3 pages and 1 of output
  assert "all" not in engine.adapters
  engine.load_adapter("again", dirs["mixed"])  # the freed slot takes another adapter
  assert _finished(engine, ["again"])[0].output_ids == greedy["mixed"]
  engine.unload_adapter("again")
  engine.load_adapter("all", dirs["all"])
  assert hits("all") == 0  # a reload never reads the old load's pages
  assert hits("rslora") == 12


def test_engine_refuses_bad_adapter_requests_by_name(lora_setup, tmp_path):
  model, dirs, *_ = lora_setup
  engine = _engine(model, dirs)
  with pytest.raises(ValueError, match="lora 'nope' is not a loaded adapter"):
    engine.add_request(PROMPT, 2, lora="nope")
  with pytest.raises(ValueError, match="lora must be a string"):
    engine.add_request(PROMPT, 2, lora=3)
  with pytest.raises(ValueError, match="already loaded"):
    engine.load_adapter("all", dirs["all"])
  engine.unload_adapter("mixed")
  with pytest.raises(ValueError, match="lora_path .*adapter_config.json"):
    engine.load_adapter("missing", str(tmp_path))
  engine.load_adapter("mixed", dirs["mixed"])
  with pytest.raises(ValueError, match="slots are taken"):
    engine.load_adapter("fourth", dirs["all"])
  engine.add_request(PROMPT, 2, lora="rslora")
  with pytest.raises(ValueError, match="in use"):
    engine.unload_adapter("rslora")
  with pytest.raises(ValueError, match="lora 'nope'"):
    engine.unload_adapter("nope")
  assert len(engine.scheduler.requests) == 1  # the refused requests queued nothing
  bad = [(dict(max_loras=-1), "max_loras"), (dict(max_lora_rank=65), "max_lora_rank"),
         (dict(batch_invariant=True), "batch_invariant")]
  for options, field in bad:
    with pytest.raises(ValueError, match=field):
      kvjax.Engine(model, **{"max_loras": 1, **options})


def test_server_serves_adapters_by_model_name(lora_setup):
  import httpx

  from kvjax.server import serve_in_thread

  model, dirs, _, _, greedy = lora_setup
  config = kvjax.EngineConfig(max_loras=2, max_lora_rank=8, page_size=4, max_num_seqs=4)
  with serve_in_thread(model, config, served_model_name="base",
                       loras={"all": dirs["all"]}) as server:
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=120)

    def complete(name):
      return post("/completions", {"model": name, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                   "temperature": 0})

    def refused(response, status, param):
      assert response.status_code == status, response.text
      assert response.json()["error"]["param"] == param, response.text

    assert complete("all").json()["choices"][0]["token_ids"] == greedy["all"]
    assert complete("all").json()["model"] == "all"
    refused(complete("rslora"), 404, "model")
    refused(post("/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}), 400,
            "lora_path")
    loaded = post("/load_lora_adapter", {"lora_name": "rslora", "lora_path": dirs["rslora"]})
    assert loaded.status_code == 200, loaded.text
    models = httpx.get(server.url + "/models").json()["data"]
    assert [(m["id"], m.get("root")) for m in models] == [
        ("base", None), ("all", dirs["all"]), ("rslora", dirs["rslora"])]
    assert complete("rslora").json()["choices"][0]["token_ids"] == greedy["rslora"]
    assert complete("base").json()["choices"][0]["token_ids"] == greedy[None]
    refused(post("/load_lora_adapter", {"lora_name": 3, "lora_path": dirs["mixed"]}), 400,
            "lora_name")
    refused(post("/load_lora_adapter", {"lora_name": "mixed", "lora_path": dirs["mixed"]}),
            400, "lora_name")  # both slots taken
    assert post("/unload_lora_adapter", {"lora_name": "all"}).status_code == 200
    refused(complete("all"), 404, "model")
    refused(post("/unload_lora_adapter", {"lora_name": "all"}), 404, "lora_name")


def test_serve_lora_flag_takes_name_equals_dir():
  import argparse

  from kvjax.cli import serve as cli_serve

  parser = argparse.ArgumentParser()
  cli_serve.add_parser(parser.add_subparsers())
  args = parser.parse_args(["serve", "--lora", "sql=/a/b", "--lora", "chat=c=d"])
  assert (args.lora, args.max_loras) == ([("sql", "/a/b"), ("chat", "c=d")], 0)
  with pytest.raises(SystemExit):
    parser.parse_args(["serve", "--lora", "no-directory"])
