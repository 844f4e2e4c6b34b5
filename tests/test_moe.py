"""MoE models vs HF transformers on tiny random checkpoints: Mixtral, Qwen3-MoE, DeepSeek-V3,
gpt-oss."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import kvjax
from tests.moe_models import FAMILIES, NEW_TOKENS, PROMPTS, hf_greedy, pair_loader, save_tiny



@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
  return pair_loader(tmp_path_factory)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_layers_where_hf_puts_them(moe_pair, family):
  hf_model, model = moe_pair(family)
  theirs = [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers]
  assert [model.config.is_moe_layer(i) for i in range(model.config.num_layers)] == theirs
  assert [b.moe is not None for b in model.params.blocks] == theirs
  assert True in theirs and (family in ("mixtral", "gpt_oss") or False in theirs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_logits_match_hf(moe_pair, family):
  hf_model, model = moe_pair(family)
  tokens = np.array([PROMPTS[1][:16], PROMPTS[1][3:19]], np.int32)  # 64 assignments: grouped
  ours = np.asarray(kvjax.forward(model, tokens))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_deepseek_v3_greedy_generate_matches_hf(moe_pair):
  # Decode: 3 rows x top-2 = 6 <= 8 experts, the switched path; prefill: grouped.
  hf_model, model = moe_pair("deepseek_v3")
  expected = hf_greedy(hf_model, PROMPTS, NEW_TOKENS)
  for cache in ("paged", "none"):
    assert kvjax.generate(model, PROMPTS, NEW_TOKENS, cache=cache, page_size=8).tokens == \
        expected, cache


def test_engine_matches_hf(moe_pair):
  hf_model, model = moe_pair("qwen3_moe")
  engine = kvjax.Engine(model, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                        max_model_len=64)
  assert engine.generate(PROMPTS, NEW_TOKENS).tokens == hf_greedy(hf_model, PROMPTS, NEW_TOKENS)


def test_tied_router_logits_resolved_as_hf(tmp_path):
  # Experts 2 and 5 get the same router row: equal logits for every token, different
  # weights; whenever the pair competes for one slot, HF's torch.topk picks one of them.
  hf_model = save_tiny("mixtral", str(tmp_path / "tied"))
  chosen = []
  with torch.no_grad():
    for layer in hf_model.model.layers:
      router = layer.mlp.gate.weight
      router[5] = router[2]
      layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
  hf_model.save_pretrained(str(tmp_path / "tied"))
  model = kvjax.load_checkpoint(str(tmp_path / "tied"))
  tokens = np.array([PROMPTS[1][:16], PROMPTS[1][3:19]], np.int32)
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  picks = torch.cat(chosen)
  split = ((picks == 2).any(-1) ^ (picks == 5).any(-1)).sum().item()
  assert split > 0, "no token had the tie decide a slot"
  np.testing.assert_allclose(np.asarray(kvjax.forward(model, tokens)), theirs, atol=1e-4, rtol=0)


def test_gpt_oss_tensor_contract_names_each_tensor(tmp_path):
  # The tensors only gpt-oss has, each shrunk or dropped, are refused naming it before
  # any is read (kvjax/weights/hf_contract.py): the interleaved gate_up's 2 Fe included.
  from safetensors.numpy import load_file, save_file

  from kvjax.weights.hf_config import read_hf_config
  from kvjax.weights.hf_contract import check_hf_tensors

  source = str(tmp_path / "gpt_oss")
  save_tiny("gpt_oss", source)
  hf_config, cfg = read_hf_config(source)
  tensors = load_file(os.path.join(source, "model.safetensors"))
  pre = "model.layers.1."
  names = [pre + "self_attn." + n for n in ("sinks", "o_proj.bias", "q_proj.bias")] + [
      pre + "mlp." + n for n in ("router.weight", "router.bias", "experts.gate_up_proj",
                                 "experts.gate_up_proj_bias", "experts.down_proj",
                                 "experts.down_proj_bias")]
  for name in names:
    shrunk = np.ascontiguousarray(tensors[name][..., :-1])
    for mutation in ({**tensors, name: shrunk}, {k: v for k, v in tensors.items() if k != name}):
      directory = str(tmp_path / "mutated")
      shutil.copytree(source, directory)
      save_file(mutation, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
      with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        check_hf_tensors(directory, hf_config, cfg)
      shutil.rmtree(directory)
