"""HF Qwen3.5 / Qwen3-Next hybrids loaded by kvjax.load_checkpoint, transformers as the oracle."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import kvjax

# Hybrid layout 3 x linear + 1 full; GQA 4/2 with partial rope (a quarter of 16
# dims), linear 2 key / 4 value heads.  std 0.05: at 0.2, 8 such layers amplify float32
# rounding past 1e-4 (HF float32 itself is 5e-4 from HF float64 there); at 0.05 kvjax
# is 1e-5 from HF while a 0.1 shift of one layer's A_log moves the logits by 1e-2.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, max_position_embeddings=256, initializer_range=0.05,
               rms_norm_eps=1e-6, attn_implementation="eager")
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}),
    # Dense: no experts, so every layer is the plain MLP.
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(num_experts=0)),
}


def save_tiny(family: str, directory: str, seed: int = 0):
  """Random tiny model whose norms, dt_bias and A_log are far from their init values
  (HF initializes the zero-centred norms to 0: a missing +1 would go unseen)."""
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**_COMMON, **extra)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or "dt_bias" in name or "A_log" in name:
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (directory, HF model, kvjax model), each saved and loaded once."""
  built = {}

  def get(family):
    if family not in built:
      directory = str(tmp_path_factory.mktemp(family))
      hf = save_tiny(family, directory)
      built[family] = directory, hf, kvjax.load_checkpoint(directory)
    return built[family]

  return get


@pytest.fixture(params=sorted(FAMILIES))
def pair(request, saved):
  return saved(request.param)


def _hf_logits(hf, ids) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.tensor(ids)).logits.numpy()


def test_full_forward_logits_match_hf(pair):
  """80 tokens: the chunked rule crosses a 64-token chunk boundary in both."""
  _, hf, model = pair
  ids = np.random.default_rng(0).integers(0, 128, (2, 80))
  want = _hf_logits(hf, ids)
  got = np.asarray(kvjax.forward(model, ids))
  assert np.abs(got - want).max() < 1e-4
  assert model.config.num_full_attention_layers == 1 and model.config.num_linear_layers == 3


@pytest.mark.parametrize("family, cache", [("qwen3_5", "paged"), ("qwen3_5", "contiguous"),
                                           ("qwen3_5", "none"), ("qwen3_next", "paged")])
def test_greedy_generation_is_hf_argmax(saved, family, cache):
  """Mixed-length prompts; each new token is HF's argmax given kvjax's own prefix.
  (Qwen3-Next differs from Qwen3.5 only in its tensor layout: one cache suffices.)"""
  _, hf, model = saved(family)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 128, n).tolist() for n in (3, 18, 35)]
  result = kvjax.generate(model, prompts, 10, cache=cache, page_size=8)
  for prompt, new in zip(prompts, result.tokens):
    assert len(new) == 10
    logits = _hf_logits(hf, [prompt + new])[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == new


def _with_mtp(src: str, dst: str, hf_model) -> dict:
  """Copy the checkpoint adding a Qwen3.5-style mtp.* head (one full-attention layer,
  its tensors taken from the trunk's layer 3) -> the added tensors."""
  shutil.copytree(src, dst)
  tensors = load_file(os.path.join(dst, "model.safetensors"))
  rng = np.random.default_rng(2)
  d = hf_model.config.hidden_size
  added = {"mtp.fc.weight": rng.normal(size=(d, 2 * d)).astype(np.float32),
           "mtp.pre_fc_norm_embedding.weight": rng.normal(size=d).astype(np.float32),
           "mtp.pre_fc_norm_hidden.weight": rng.normal(size=d).astype(np.float32),
           "mtp.norm.weight": rng.normal(size=d).astype(np.float32)}
  for name, value in tensors.items():
    if name.startswith("model.layers.3."):
      added["mtp.layers.0." + name[len("model.layers.3."):]] = value
  save_file({**tensors, **added}, os.path.join(dst, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(dst, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump({**config, "mtp_num_hidden_layers": 1}, f)
  return added


def test_mtp_tensors_are_read(saved, tmp_path):
  directory, hf, model = saved("qwen3_5")
  added = _with_mtp(directory, str(tmp_path / "with_mtp"), hf)
  loaded = kvjax.load_checkpoint(str(tmp_path / "with_mtp"))
  assert loaded.config.mtp_num_hidden_layers == 1 and len(loaded.params.mtp) == 1
  m = loaded.params.mtp[0]
  np.testing.assert_array_equal(m.proj, added["mtp.fc.weight"].T)
  np.testing.assert_allclose(m.embed_norm, added["mtp.pre_fc_norm_embedding.weight"] + 1)
  np.testing.assert_allclose(m.hidden_norm, added["mtp.pre_fc_norm_hidden.weight"] + 1)
  np.testing.assert_allclose(m.out_norm, added["mtp.norm.weight"] + 1)
  trunk = model.params.blocks[3]  # the same tensors, loaded the same way
  for got, want in ((m.block.attn.wq, trunk.attn.wq), (m.block.attn.wg, trunk.attn.wg),
                    (m.block.attn.k_norm, trunk.attn.k_norm), (m.block.w_down, trunk.w_down)):
    np.testing.assert_array_equal(got, want)
  # HF's save_pretrained drops mtp.*: a config that declares MTP without tensors loads none.
  assert model.config.mtp_num_hidden_layers == 0 and model.params.mtp == ()


def test_qwen3_next_moe_is_refused_naming_its_fields(tmp_path):
  config = transformers.Qwen3NextConfig(**{**_COMMON, "num_hidden_layers": 4}, num_experts=4,
                                        num_experts_per_tok=2, mlp_only_layers=[0, 1])
  config.save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match=r"MoE layers \[2, 3\].*num_experts=4.*"
                                       r"decoder_sparse_step=1.*mlp_only_layers=\[0, 1\]"):
    kvjax.load_checkpoint(str(tmp_path))
