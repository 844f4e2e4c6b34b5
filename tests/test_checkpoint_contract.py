"""HF checkpoint contract (issue 33): every mutation of a small saved checkpoint either
loads to transformers' own logits on the same directory or is refused naming the
tensor or config field; kvjax-native (orbax) checkpoints that lost parts name them.

Oracles: transformers (what it loads from the mutated directory is the reference,
its refusals and warnings are the legal cases) and the mutation itself (the error
must name what was changed).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import kvjax
from kvjax.model.params import init_params
from kvjax.weights import checkpoint
from kvjax.weights.hf import load_hf
from tests.hf_models import save_tiny

TOKENS = np.array([[1, 5, 9, 77, 3, 100, 42, 8]])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("qwen3"))
  save_tiny("qwen3", directory)  # untied head, q/k norms, head_dim != hidden / heads
  return directory


@pytest.fixture(scope="module")
def tensors(base_dir):
  return load_file(os.path.join(base_dir, "model.safetensors"))


def _mutated(base_dir, tmp_path, tensors=None, config=None) -> str:
  directory = str(tmp_path / "mutated")
  shutil.copytree(base_dir, directory)
  if tensors is not None:
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  if config is not None:
    with open(os.path.join(directory, "config.json"), "w") as f:
      f.write(config if isinstance(config, str) else json.dumps(config))
  return directory


def _refused_naming(directory: str, *names: str) -> None:
  with pytest.raises((ValueError, FileNotFoundError)) as error:
    load_hf(directory)
  assert any(name in str(error.value) for name in names), str(error.value)


def _transformers_logits(directory: str):
  """transformers' logits from `directory`, or None when it refuses the checkpoint."""
  try:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, torch_dtype=torch.float32, attn_implementation="eager").eval()
  except Exception:  # a checkpoint transformers refuses: not legal
    return None
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.numpy()


def _loads_or_refuses(directory: str, *names: str) -> None:
  """kvjax refuses naming one of `names`, or loads and equals transformers."""
  try:
    cfg, params = load_hf(directory)
  except ValueError as error:
    assert any(name in str(error) for name in names), str(error)
    return
  want = _transformers_logits(directory)
  assert want is not None, "kvjax loaded a checkpoint transformers refuses"
  got = np.asarray(kvjax.forward(kvjax.Model(cfg, params), TOKENS))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_the_unmutated_checkpoint_equals_transformers(base_dir):
  _loads_or_refuses(base_dir)


def test_every_tensor_with_a_wrong_shape_or_dtype_or_missing_is_named(base_dir, tensors,
                                                                       tmp_path):
  for name, array in tensors.items():
    shrunk = array[:-1] if array.shape[0] > 1 else np.zeros((2,) + array.shape[1:], array.dtype)
    for mutation in ({**tensors, name: np.ascontiguousarray(shrunk)},
                     {**tensors, name: array.astype(np.int32)},
                     {k: v for k, v in tensors.items() if k != name}):
      directory = _mutated(base_dir, tmp_path, tensors=mutation)
      _refused_naming(directory, name)
      shutil.rmtree(directory)


def test_an_unused_tensor_is_refused_and_an_ignored_buffer_is_named(base_dir, tensors,
                                                                     tmp_path):
  extra = "model.layers.0.mlp.extra_proj.weight"
  directory = _mutated(base_dir, tmp_path, tensors={**tensors, extra: np.ones((4, 4),
                                                                               np.float32)})
  _refused_naming(directory, extra)
  shutil.rmtree(directory)
  buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"  # older checkpoints carry it
  directory = _mutated(base_dir, tmp_path, tensors={**tensors, buffer: np.ones(16, np.float32)})
  with pytest.warns(UserWarning, match=buffer.replace(".", r"\.")):
    _loads_or_refuses(directory)


@pytest.mark.parametrize("field,new", [
    ("vocab_size", 200), ("hidden_size", 32), ("intermediate_size", 100),
    ("num_hidden_layers", 1), ("num_hidden_layers", 3), ("num_attention_heads", 2),
    ("num_key_value_heads", 1), ("num_key_value_heads", 4), ("head_dim", 16),
    ("rms_norm_eps", 1e-2), ("rope_theta", 500.0), ("tie_word_embeddings", True),
    ("bos_token_id", 500), ("max_position_embeddings", 64)])
def test_every_config_field_change_loads_equal_to_transformers_or_is_named(
    base_dir, tmp_path, field, new):
  with open(os.path.join(base_dir, "config.json")) as f:
    config = json.load(f)
  config[field] = new
  if field == "rope_theta" and "rope_parameters" in config:
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": new}
  # Shapes fail naming the first mismatched tensor; token ids name their field.
  _loads_or_refuses(_mutated(base_dir, tmp_path, config=config), field, "tensor")


def test_config_json_errors_name_the_file(base_dir, tmp_path):
  directory = _mutated(base_dir, tmp_path, config="{not json")
  _refused_naming(directory, os.path.join(directory, "config.json"))
  shutil.rmtree(directory)
  with open(os.path.join(base_dir, "config.json")) as f:
    config = json.load(f)
  del config["hidden_size"]
  directory = _mutated(base_dir, tmp_path, config=config)
  with pytest.raises(ValueError, match="hidden_size") as error:
    load_hf(directory)
  assert os.path.join(directory, "config.json") in str(error.value)


# -- kvjax-native (orbax) checkpoints -------------------------------------------------

@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("native"))
  cfg = kvjax.get_preset("tiny")
  checkpoint.save(directory, cfg, init_params(cfg, jax.random.PRNGKey(0)))
  return directory


def _native_mutated(native_dir, tmp_path, mutate) -> str:
  directory = str(tmp_path / "native")
  shutil.copytree(native_dir, directory)
  mutate(directory)
  return directory


def _truncate_largest(directory: str) -> None:
  files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(directory, "params"))
           for f in names]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(os.path.getsize(largest) // 2)


@pytest.mark.parametrize("mutation,match", [
    (lambda d: shutil.rmtree(os.path.join(d, "params")), "params does not exist"),
    (lambda d: os.remove(os.path.join(d, "params", "_METADATA")), "_METADATA"),
    (lambda d: open(os.path.join(d, "params", "_METADATA"), "w").write("{garbled"),
     "_METADATA"),
    (lambda d: open(os.path.join(d, "config.json"), "w").write("{garbled"), "config.json"),
    (_truncate_largest, "truncated"),
], ids=["no_params", "no_metadata", "garbled_metadata", "garbled_config", "truncated_data"])
def test_native_restore_errors_name_the_path_and_what_is_missing(native_dir, tmp_path,
                                                                 mutation, match):
  directory = _native_mutated(native_dir, tmp_path, mutation)
  with warnings.catch_warnings(), pytest.raises((ValueError, FileNotFoundError)) as error:
    warnings.simplefilter("ignore")
    checkpoint.restore(directory)
  assert directory in str(error.value) and match in str(error.value), str(error.value)
