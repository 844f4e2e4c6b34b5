"""Quantized experts (kvjax/weights/quantize.py): every routed and shared expert's
projections become int8 / int4 codes, the router stays float; both expert paths and the
engine equal the float model whose experts hold the dequantized values, and a batch-1
step reads the codes (qmatmul), not float experts."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model.decoder import forward
from kvjax.model.params import init_params
from kvjax.moe.expert_parallel import stack_experts
from kvjax.quant import qmatmul
from kvjax.quant.qweight import QuantizedWeight
from kvjax.weights.quantize import quantize_params
from tests.moe_models import PROMPTS, pair_loader


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
  return pair_loader(tmp_path_factory)


def _dequantized(params):
  """The same pytree with every QuantizedWeight replaced by its float32 values."""
  is_q = lambda x: isinstance(x, QuantizedWeight)
  return jax.tree.map(lambda x: x.dequantize(jnp.float32) if is_q(x) else x, params,
                      is_leaf=is_q)


def _quantized(model, scheme):
  return dataclasses.replace(model, params=quantize_params(model.params, model.config, scheme))


@pytest.mark.parametrize("family, scheme, through_engine", [
    ("deepseek_v3", "int8", False), ("gpt_oss", "int4-g32", False),
    ("qwen3_moe", "int4-g32", True)])  # the engine's paged steps once (compiles dominate)
def test_quantized_experts_equal_their_dequantized_twin(moe_pair, family, scheme,
                                                        through_engine, monkeypatch):
  # To f32 rounding, so through the dequantizing matmul: qmatmul rounds each matmul's
  # input to int8 per 32 values (test_qmatmul bounds that), and on these random tiny
  # MoE models such a change flips router choices (deepseek_v3's first prompt: logits
  # 100% off on a token where the int8 weight rounding alone moves them as much).
  monkeypatch.setattr(qmatmul, "available", lambda: False)
  jax.clear_caches()  # no step traced with qmatmul on is reused
  _, model = moe_pair(family)
  quantized = _quantized(model, scheme)
  layers = [b.moe for b in quantized.params.blocks if b.moe is not None]
  experts = [e for moe in layers for e in moe.experts + ((moe.shared,) if moe.shared else ())]
  assert experts and all(isinstance(getattr(e, k), QuantizedWeight)
                         for e in experts for k in ("w_gate", "w_up", "w_down"))
  assert all(not isinstance(moe.router, QuantizedWeight) for moe in layers)
  twin = dataclasses.replace(model, params=_dequantized(quantized.params))
  prefill = np.array([PROMPTS[1][:16], PROMPTS[1][3:19]], np.int32)  # grouped path
  decode = np.array([[PROMPTS[0][0]]], np.int32)  # 1 token x top-k <= Ne: switched path
  for tokens in (prefill, decode):
    got, want = (np.asarray(kvjax.forward(m, tokens)) for m in (quantized, twin))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
  floats = np.asarray(kvjax.forward(model, prefill))
  assert np.abs(floats - np.asarray(kvjax.forward(twin, prefill))).max() > 1e-4  # rounded
  if through_engine:
    engine = kvjax.Engine(quantized, page_size=8, max_num_seqs=4, max_model_len=64)
    assert engine.generate(PROMPTS, 8).tokens == kvjax.generate(twin, PROMPTS, 8).tokens


def test_batch_one_step_reads_quantized_expert_codes():
  """XLA's cost analysis does not see inside qmatmul's custom call, so the proof is the
  compiled step itself: every expert projection is a qmatmul over the codes, and no
  float [D, Fe] / [Fe, D] expert matrix (a dequantized copy) exists anywhere in it."""
  assert qmatmul.available(), "qmatmul.cc did not build: install g++ (or set $CXX)"
  cfg = kvjax.get_preset("tiny").replace(name="moe", vocab_size=256, num_experts=16,
                                         num_experts_per_tok=2, moe_intermediate_size=192)
  d, fe = cfg.hidden_size, cfg.moe_intermediate_size
  floats = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.zeros((1, 1), jnp.int32)
  compiled = lambda params: jax.jit(forward, static_argnums=1).lower(
      params, cfg, tokens).compile().as_text()
  dequantized_expert = re.compile(rf"f32\[({d},{fe}|{fe},{d})\]")
  assert dequantized_expert.search(compiled(floats))  # the pattern finds float experts
  hlo = compiled(quantize_params(floats, cfg, "int8"))
  calls = hlo.count(f'custom_call_target="{qmatmul.TARGET}"')
  assert calls >= 3 * cfg.num_experts * cfg.num_layers, calls  # one per projection branch
  assert not dequantized_expert.search(hlo)


def test_quantized_experts_refuse_expert_parallel_and_awq(moe_pair):
  _, model = moe_pair("mixtral")
  quantized = _quantized(model, "int8")
  moe = next(b.moe for b in quantized.params.blocks if b.moe is not None)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                           ("data", "expert", "model"))
  with pytest.raises(ValueError, match="ep=1"):
    stack_experts(moe, mesh)
  with pytest.raises(ValueError, match="calibration_tokens"):
    quantize_params(model.params, model.config, "int8",
                    calibration_tokens=np.array([PROMPTS[1][:8]]))
