"""Issue 12, defects 4-5: loads that cannot work fail early and say what to do instead.

Non-finite weights are named by tensor (HF name or Params path) with their exact
count; a model too big for the device is refused before any allocation with
the numbers (checked against HF's own parameter count and hand arithmetic);
malformed --prompt-ids and a flat list of ids get errors saying what to write.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.api import _forward
from kvjax.cli.main import main
from kvjax.weights import checkpoint, load_checks
from tests import hf_models

GIB, MIB = 1 << 30, 1 << 20
LLAMA3_8B_PARAMS = 8_030_261_248  # the published count of Meta-Llama-3-8B
# One 2048-token request of llama3-8b: K and V x 8 kv heads x 128 x 32 layers.
LLAMA3_8B_KV_VALUES = 2 * 8 * 128 * 32 * 2048
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """(directory, HF model) of a tiny random HF llama checkpoint."""
  directory = str(tmp_path_factory.mktemp("llama"))
  return directory, hf_models.save_tiny("llama", directory)


@pytest.fixture(scope="module")
def default_model():
  return kvjax.load_checkpoint()


def _poisoned_copy(source: str, target: str, poison: dict) -> None:
  """Copy an HF checkpoint, writing poison[name] = [(flat index, value)] into its tensors."""
  from safetensors.torch import load_file, save_file

  shutil.copytree(source, target)
  path = os.path.join(target, "model.safetensors")
  tensors = load_file(path)
  for name, writes in poison.items():
    flat = tensors[name].view(-1)
    for index, value in writes:
      flat[index] = value
  save_file(tensors, path, metadata={"format": "pt"})


def test_hf_nonfinite_tensor_is_named_with_its_count(llama_dir, tmp_path):
  source, _ = llama_dir
  bad = str(tmp_path / "bad")
  _poisoned_copy(source, bad, {
      "model.layers.1.mlp.down_proj.weight": [(0, float("nan")), (7, float("nan")),
                                              (100, float("inf"))],
      "lm_head.weight": [(3, float("-inf"))]})
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has 3 "
                     r"non-finite values \(NaN or inf\) of 8192 \(1 more tensors"):
    kvjax.load_checkpoint(bad)
  # check_finite=False loads it as it is: numpy counts the poison in the loaded weights.
  loaded = kvjax.load_checkpoint(bad, check_finite=False)
  assert int(np.sum(~np.isfinite(np.asarray(loaded.params.blocks[1].w_down)))) == 3
  assert int(np.sum(~np.isfinite(np.asarray(loaded.params.blocks[0].w_down)))) == 0


def test_float16_overflow_is_caught_after_the_cast(llama_dir, tmp_path):
  source, _ = llama_dir
  big = str(tmp_path / "big")
  _poisoned_copy(source, big, {"model.layers.0.self_attn.k_proj.weight": [(5, 1e6)]})
  kvjax.load_checkpoint(big)  # finite in float32
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has 1 "):
    kvjax.load_checkpoint(big, dtype="float16")  # 1e6 > float16 max 65504: inf


def test_clean_hf_checkpoint_loads(llama_dir):
  source, hf_model = llama_dir
  model = kvjax.load_checkpoint(source)
  np.testing.assert_array_equal(np.asarray(model.params.embed),
                                hf_model.model.embed_tokens.weight.detach().numpy())


def test_native_nonfinite_tensor_is_named_by_param_path(default_model, tmp_path):
  w_down = np.asarray(default_model.params.blocks[2].w_down).copy()
  w_down[0, 0], w_down[5, 3] = np.inf, np.nan
  blocks = list(default_model.params.blocks)
  blocks[2] = blocks[2].replace(w_down=jax.numpy.asarray(w_down))
  params = default_model.params.replace(blocks=tuple(blocks))
  checkpoint.save(str(tmp_path / "native"), default_model.config, params)
  with pytest.raises(ValueError, match=r"blocks\[2\]\.w_down has 2 non-finite values "
                     rf"\(NaN or inf\) of {w_down.size};"):
    kvjax.load_checkpoint(str(tmp_path / "native"))
  loaded = kvjax.load_checkpoint(str(tmp_path / "native"), check_finite=False)
  assert int(np.sum(~np.isfinite(np.asarray(loaded.params.blocks[2].w_down)))) == 2


def test_too_big_preset_is_refused_before_allocating():
  live_before = len(jax.live_arrays())
  start = time.perf_counter()
  with pytest.raises(ValueError) as refused:
    kvjax.load_checkpoint("llama3-8b", available_bytes=GIB)
  assert time.perf_counter() - start < 1.0
  assert len(jax.live_arrays()) == live_before  # nothing was allocated
  fp32_weights, fp32_kv = LLAMA3_8B_PARAMS * 4 / GIB, LLAMA3_8B_KV_VALUES * 4 / MIB
  assert (f"llama3-8b needs {fp32_weights:.1f} GiB of fp32 weights + {fp32_kv:.1f} MiB of KV "
          f"cache (one 2048-token request) = {fp32_weights + fp32_kv / 1024:.1f} GiB, but "
          f"available_bytes={GIB} gives 1.0 GiB available") in str(refused.value)


def test_refusal_names_what_would_fit():
  llama = kvjax.get_preset("llama3-8b")
  bf16_total = (LLAMA3_8B_PARAMS + LLAMA3_8B_KV_VALUES) * 2 / GIB
  with pytest.raises(ValueError) as refused:
    load_checks.check_fits(llama, jnp.float32, available_bytes=GIB, platform="gpu")
  message = str(refused.value)
  assert f"no dtype kvjax loads fits; kvjax places the whole model on one device, so use one " \
      f"with at least {bf16_total:.1f} GiB free" in message
  assert f"int8 {LLAMA3_8B_PARAMS / GIB:.1f} GiB, int4 {LLAMA3_8B_PARAMS / 2 / GIB:.1f}" \
      in message
  with pytest.raises(ValueError) as refused:
    load_checks.check_fits(llama, jnp.float32, available_bytes=20 * GIB, platform="gpu")
  assert f"would fit: dtype='bfloat16' (--dtype bfloat16) needs {bf16_total:.1f} GiB; " \
      f"dtype='float16' (--dtype float16) needs {bf16_total:.1f} GiB" in str(refused.value)


def test_cpu_counts_the_float32_copy_xla_multiplies_16_bit_weights_with(default_model):
  """XLA's own buffer assignment is the oracle: a bfloat16 forward on CPU needs a
  temp buffer larger than the bfloat16 weights, and the estimate covers it."""
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16),
                                                 default_model.params), cpu)
  tokens = jax.device_put(jnp.zeros((1, 8), jnp.int32), cpu)
  compiled = _forward.lower(params, tokens, config=default_model.config).compile()
  xla_temp = compiled.memory_analysis().temp_size_in_bytes
  bf16_weights = 2 * sum(x.size for x in jax.tree_util.tree_leaves(params))
  assert xla_temp > bf16_weights
  on_cpu, on_gpu = (sum(load_checks.needed_bytes(default_model.config, "bf16", p).values())
                    for p in ("cpu", "gpu"))
  assert on_cpu - on_gpu >= xla_temp


def test_small_models_load_on_a_small_device():
  model = kvjax.load_checkpoint(available_bytes=GIB)
  assert model.config.name == "tiny-code"


def test_hf_fit_boundary_is_hf_parameter_bytes_plus_kv(llama_dir):
  source, hf_model = llama_dir
  cfg = hf_model.config
  head_dim = cfg.hidden_size // cfg.num_attention_heads
  kv = 2 * cfg.num_key_value_heads * head_dim * cfg.num_hidden_layers * 4 * min(
      cfg.max_position_embeddings, 2048)
  needed = hf_model.num_parameters() * 4 + kv
  with pytest.raises(ValueError, match="available"):
    kvjax.load_checkpoint(source, available_bytes=needed - 1)
  kvjax.load_checkpoint(source, available_bytes=needed)
  with pytest.raises(ValueError, match="available_bytes must be an int >= 0, got -1"):
    kvjax.load_checkpoint(source, available_bytes=-1)


def _mem_available_bytes() -> int:
  with open("/proc/meminfo") as f:
    line = next(line for line in f if line.startswith("MemAvailable:"))
  return int(line.split()[1]) * 1024


@pytest.mark.parametrize("dtype,needed", [
    ("float32", LLAMA3_8B_PARAMS * 4),
    # bf16 weights + XLA CPU's float32 copy of all but the embedding table.
    ("bfloat16", LLAMA3_8B_PARAMS * 2 + (LLAMA3_8B_PARAMS - 128256 * 4096) * 4)],
    ids=["float32", "bfloat16"])
def test_cli_refuses_llama3_8b_in_seconds(dtype, needed):
  # The repro needs a machine whose free memory cannot hold llama3-8b at `dtype`.
  assert _mem_available_bytes() < needed, "this machine could load it"
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, "-m", "kvjax", "generate", "--checkpoint", "llama3-8b",
       "--prompt-ids", "1,2,3", "--dtype", dtype], cwd=REPO_ROOT, capture_output=True,
      text=True, timeout=120)
  elapsed = time.perf_counter() - start
  assert done.returncode == 2, done.stderr
  assert elapsed < 30, elapsed  # the OOM killer took 102 s (float32), 138 s (bfloat16)
  weights = LLAMA3_8B_PARAMS * (4 if dtype == "float32" else 2) / GIB
  assert f"kvjax generate: error: llama3-8b needs {weights:.1f} GiB" in done.stderr
  assert "GiB available" in done.stderr


@pytest.mark.parametrize("ids,field", [("1,,2", "field 2 ('')"), ("1, 2,", "field 3 ('')"),
                                       ("a,b", "field 1 ('a')"), ("", "field 1 ('')"),
                                       ("-1", "field 1 ('-1')"), ("1,2.5", "field 2 ('2.5')")])
def test_malformed_prompt_ids_say_what_to_write(ids, field, capsys):
  with pytest.raises(SystemExit) as exited:
    main(["generate", f"--prompt-ids={ids}"])
  assert exited.value.code == 2
  err = capsys.readouterr().err
  assert f"argument --prompt-ids: {ids!r}: {field} is not a token id" in err
  assert "--prompt-ids 1,2,3" in err


def test_prompt_id_outside_vocab_names_id_and_vocab(capsys):
  assert main(["generate", "--prompt-ids", "1, 2,259"]) == 2
  assert "token id 259 is outside the vocabulary of tiny-code (vocab_size 259" in \
      capsys.readouterr().err


@pytest.mark.parametrize("flat", [[100, 101, 102], np.array([100, 101, 102])])
def test_flat_list_of_ids_says_wrap_it(default_model, flat):
  hint = r"prompts must be a list of prompts \(lists of token ids\).*for one prompt write \[ids\]"
  with pytest.raises(ValueError, match=r"flat list of 3 ints \[100, 101, 102\]"):
    kvjax.generate(default_model, flat, 4)
  with pytest.raises(ValueError, match=hint):
    kvjax.generate(default_model, flat, 4)
  with pytest.raises(ValueError, match=hint):
    kvjax.Engine(default_model, max_num_seqs=1, max_model_len=64).generate(flat, 4)


def test_flat_list_of_encoded_text_is_refused(default_model):
  ids = kvjax.ByteTokenizer().encode("def f():")
  with pytest.raises(ValueError, match=rf"flat list of {len(ids)} ints"):
    kvjax.generate(default_model, ids, 4)
