"""Issue 53 items 4 and 8: a checkpoint's config field out of bounds (GGUF metadata, HF
config.json, a truncated safetensors) is a ValueError naming the file, the field and the
value, raised in well under a second before any loop or allocation it sizes."""
from __future__ import annotations

import json
import math
import os
import shutil
import time

import jax
import pytest
from gguf import GGUFValueType

import kvjax
from kvjax.model.params import init_params
from kvjax.weights import gguf as gguf_weights
from tests import hf_models
from tests.test_gguf import write_tiny_gguf

U32, U64, F32 = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.FLOAT32
# GGUF metadata key: (value, type) written over the tiny file's, fragment of the error.
BAD_GGUF = {
    "llama.block_count": (
        (10**9, U64), r"llama\.block_count must be in \[1, 4096\], got 1000000000"),
    "llama.attention.head_count": (
        (0, U32), r"llama\.attention\.head_count must be a positive"),
    "llama.context_length": (
        (2**31 - 1, U32), r"llama\.context_length must be in \[1, 16777216\]"),
    "llama.rope.freq_base": (
        (math.nan, F32), r"llama\.rope\.freq_base must be a finite number"),
    "llama.attention.layer_norm_rms_epsilon": (
        (math.inf, F32), r"llama\.attention\.layer_norm_rms_epsilon must be a finite number"),
    "llama.embedding_length": (
        ("256", GGUFValueType.STRING), r"llama\.embedding_length must be an int, got '256'"),
}


@pytest.mark.parametrize("key", list(BAD_GGUF))
def test_bad_gguf_metadata_is_refused_by_name_in_a_second(tmp_path, key):
  value, fragment = BAD_GGUF[key]
  path = str(tmp_path / "bad.gguf")
  write_tiny_gguf(path, "llama", "F16", metadata={key: value})
  start = time.perf_counter()
  with pytest.raises(ValueError, match=f"{path}: {fragment}"):
    kvjax.load_checkpoint(path)
  assert time.perf_counter() - start < 5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("llama_src"))
  hf_models.save_tiny("llama", directory)
  return directory


def _with_config(llama_dir: str, directory: str, text: str) -> str:
  shutil.copytree(llama_dir, directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    f.write(text)
  return os.path.join(directory, "config.json")


@pytest.mark.parametrize("field,value,fragment", [
    ("num_hidden_layers", 10**9, r"num_hidden_layers must be in \[1, 4096\], got 1000000000"),
    ("max_position_embeddings", 2**40, r"max_position_embeddings must be in \[1, 16777216\]"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive int, got 0"),
    ("rope_theta", math.nan, "rope_theta must be a finite number > 0, got nan"),
    ("rms_norm_eps", math.inf, "rms_norm_eps must be a finite number > 0, got inf")])
def test_bad_hf_config_field_is_refused_by_name_in_a_second(llama_dir, tmp_path, field, value,
                                                            fragment):
  with open(os.path.join(llama_dir, "config.json")) as f:
    config = json.load(f)
  file = _with_config(llama_dir, str(tmp_path / "bad"), json.dumps({**config, field: value}))
  start = time.perf_counter()
  with pytest.raises(ValueError, match=f"{file}: {fragment}"):
    kvjax.load_checkpoint(os.path.dirname(file))
  assert time.perf_counter() - start < 5


def test_malformed_config_json_names_the_file(llama_dir, tmp_path):
  file = _with_config(llama_dir, str(tmp_path / "bad"), '{"model_type": "llama",')
  with pytest.raises(ValueError, match=f"{file} is not valid JSON"):
    kvjax.load_checkpoint(os.path.dirname(file))


def test_truncated_safetensors_names_the_file(llama_dir, tmp_path):
  broken = str(tmp_path / "cut")
  shutil.copytree(llama_dir, broken)
  file = os.path.join(broken, "model.safetensors")
  data = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"{file} is not a complete safetensors file"):
    kvjax.load_checkpoint(broken)


def test_engine_over_a_context_past_int32_names_max_model_len():
  cfg = kvjax.get_preset("tiny").replace(max_position_embeddings=2**40)
  model = kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match=r"max_model_len=1099511627776 \(the model's "
                                       r"max_position_embeddings\) with num_pages="):
    kvjax.Engine(model)
  with pytest.raises(ValueError, match="num_pages must be an int"):
    kvjax.Engine(model, max_model_len=64, num_pages="9")


def test_gguf_config_reads_the_good_file(tmp_path):
  path = str(tmp_path / "good.gguf")
  write_tiny_gguf(path, "llama", "F16")
  cfg = gguf_weights.read_gguf_config(path)
  assert (cfg.num_layers, cfg.num_heads, cfg.max_position_embeddings) == (2, 4, 128)
