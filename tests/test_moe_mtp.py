"""DeepSeek-V3's MTP layer as kvjax's MTP drafter.

transformers drops a DeepSeek-V3 checkpoint's layer num_hidden_layers (enorm, hnorm,
eh_proj, shared_head and a MoE decoder layer), so the checkpoint here is the tiny random
trunk of tests/moe_models.py plus that layer built from a second HF model's MoE layer 0;
the oracle runs it in transformers: h' = layer(eh_proj([enorm(E[x_{t+1}]); hnorm(h_t)])),
logits = lm_head(shared_head.norm(h')), predicting token t+2 at row t.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
import safetensors.torch
import torch

import kvjax
from kvjax.model.decoder import forward_with_mtp
from tests.moe_models import NEW_TOKENS, PROMPTS, build, hf_greedy

_MTP = 3  # the trunk's num_hidden_layers: the MTP layer's index


def _rms_norm(x, weight, eps):
  return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _Oracle:
  """The HF trunk and its MTP layer as an HF model of one MoE layer."""

  def __init__(self):
    self.trunk = build("deepseek_v3")
    self.layer = build("deepseek_v3", seed=1, num_hidden_layers=1, first_k_dense_replace=0)
    d = self.trunk.config.hidden_size
    generator = torch.Generator().manual_seed(2)
    self.enorm = 1 + 0.2 * torch.randn(d, generator=generator)
    self.hnorm = 1 + 0.2 * torch.randn(d, generator=generator)
    self.eh_proj = 0.15 * torch.randn(d, 2 * d, generator=generator)

  def tensors(self) -> dict:
    """The checkpoint DeepSeek would ship: trunk, then model.layers.3.* (copies included),
    named as save_pretrained names them (one tensor per expert)."""
    out = _saved_tensors(self.trunk)
    pre = f"model.layers.{_MTP}."
    for name, tensor in _saved_tensors(self.layer).items():
      if name.startswith("model.layers.0."):
        out[pre + name[len("model.layers.0."):]] = tensor
    out.update({pre + "enorm.weight": self.enorm, pre + "hnorm.weight": self.hnorm,
                pre + "eh_proj.weight": self.eh_proj,
                pre + "shared_head.norm.weight": self.layer.model.norm.weight.detach(),
                pre + "embed_tokens.weight": out["model.embed_tokens.weight"],
                pre + "shared_head.head.weight": out["lm_head.weight"]})
    return {name: tensor.clone().contiguous() for name, tensor in out.items()}

  @torch.no_grad()
  def mtp_logits(self, tokens: np.ndarray) -> np.ndarray:
    """tokens [B, T] -> the MTP layer's logits [B, T-1, V] (row t predicts token t+2)."""
    ids = torch.tensor(tokens)
    captured = {}
    hook = self.trunk.model.norm.register_forward_hook(
        lambda module, args, output: captured.update(hidden=args[0]))
    self.trunk(ids)
    hook.remove()
    eps = self.trunk.config.rms_norm_eps
    e = _rms_norm(self.trunk.model.embed_tokens(ids[:, 1:]), self.enorm, eps)
    h = _rms_norm(captured["hidden"][:, :-1], self.hnorm, eps)
    x = torch.cat([e, h], -1) @ self.eh_proj.T
    hidden = self.layer.model(inputs_embeds=x).last_hidden_state  # through shared_head.norm
    return self.trunk.lm_head(hidden).numpy()


def _saved_tensors(model) -> dict:
  with tempfile.TemporaryDirectory() as directory:
    model.save_pretrained(directory)
    return safetensors.torch.load_file(os.path.join(directory, "model.safetensors"))


def _save(oracle: _Oracle, directory: str, tensors: dict) -> str:
  oracle.trunk.save_pretrained(directory)
  for name in os.listdir(directory):
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
      os.remove(os.path.join(directory, name))
  safetensors.torch.save_file(tensors, os.path.join(directory, "model.safetensors"),
                              metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)
  config["num_nextn_predict_layers"] = 1
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  return directory


@pytest.fixture(scope="module")
def oracle():
  return _Oracle()


@pytest.fixture(scope="module")
def mtp_model(oracle, tmp_path_factory):
  directory = _save(oracle, str(tmp_path_factory.mktemp("deepseek_mtp")), oracle.tensors())
  return kvjax.load_checkpoint(directory)


def test_mtp_layer_loads_as_kvjax_mtp_module(mtp_model):
  assert mtp_model.config.mtp_num_hidden_layers == 1
  assert len(mtp_model.params.mtp) == 1
  assert mtp_model.config.is_moe_layer(_MTP)  # the MTP layer's MLP is routed, as HF's layer 0


def test_mtp_logits_match_hf(oracle, mtp_model):
  tokens = np.array([PROMPTS[1]], np.int32)
  _, mtp_logits = forward_with_mtp(mtp_model.params, mtp_model.config, tokens)
  expected = oracle.mtp_logits(tokens)
  ours = np.asarray(mtp_logits[0])[:, :-1]
  np.testing.assert_allclose(ours, expected, atol=1e-4 * np.abs(expected).max())


def _accepted_drafts(mtp_argmax: np.ndarray, sequence: list[int], prompt_len: int) -> int:
  """One draft a step, verified greedily: the draft for token p+1 is the MTP's argmax
  from row p-1 (h_{p-1}, x_p); accepted, two tokens land, else one."""
  accepted, p = 0, prompt_len
  while p + 1 < len(sequence):
    if mtp_argmax[p - 1] == sequence[p + 1]:
      accepted, p = accepted + 1, p + 2
    else:
      p += 1
  return accepted


def test_speculative_greedy_equals_hf_and_accepts_the_oracles_drafts(oracle, mtp_model):
  expected = hf_greedy(oracle.trunk, PROMPTS, NEW_TOKENS)
  accepted = 0
  for prompt, out in zip(PROMPTS, expected):
    sequence = prompt + out
    mtp_argmax = oracle.mtp_logits(np.array([sequence]))[0].argmax(-1)
    accepted += _accepted_drafts(mtp_argmax, sequence, len(prompt))
  assert accepted > 0  # the check below can tell drafts apart from no drafts
  result = kvjax.generate(mtp_model, PROMPTS, NEW_TOKENS, speculative="mtp", num_draft=1,
                          page_size=8)
  assert result.tokens == expected
  assert round(result.stats["acceptance_rate"] * result.stats["num_verify_steps"]) == accepted


def test_engine_serves_the_mtp_model(oracle, mtp_model):
  expected = hf_greedy(oracle.trunk, PROMPTS, NEW_TOKENS)
  engine = kvjax.Engine(mtp_model, speculative="mtp", num_draft=1, page_size=8,
                        max_num_seqs=4, max_model_len=64)
  assert engine.generate(PROMPTS, NEW_TOKENS).tokens == expected
  again = engine.generate(PROMPTS, NEW_TOKENS)  # the prompts' full pages come from the cache
  assert again.tokens == expected and again.stats["prefix_hit_tokens"] > 0


def test_saved_without_mtp_layer_loads_the_trunk(oracle, tmp_path):
  directory = str(tmp_path / "trunk")
  oracle.trunk.save_pretrained(directory)  # HF drops the MTP layer; config says 1
  model = kvjax.load_checkpoint(directory)
  assert model.config.mtp_num_hidden_layers == 0 and not model.params.mtp


@pytest.mark.parametrize("name", ["shared_head.head.weight", "embed_tokens.weight"])
def test_a_copy_that_differs_from_the_trunk_is_refused(oracle, tmp_path, name):
  tensors = oracle.tensors()
  tensors[f"model.layers.{_MTP}.{name}"] = tensors[f"model.layers.{_MTP}.{name}"] + 1e-3
  directory = _save(oracle, str(tmp_path / "bad"), tensors)
  with pytest.raises(ValueError, match=f"model.layers.{_MTP}.{name} differs"):
    kvjax.load_checkpoint(directory)


def test_a_partial_mtp_layer_is_refused(oracle, tmp_path):
  tensors = oracle.tensors()
  missing = f"model.layers.{_MTP}.hnorm.weight"
  del tensors[missing]
  directory = _save(oracle, str(tmp_path / "partial"), tensors)
  with pytest.raises(ValueError, match=f"{missing} is missing"):
    kvjax.load_checkpoint(directory)
