"""Weight-only quantization: reconstruction bounds per scheme, AWQ, bytes, end to end."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.caches import create_paged_cache
from kvjax.quant import qmatmul
from kvjax.quant.qweight import QuantizedWeight, quantize_weight
from kvjax.runtime import generation
from kvjax.runtime.sampling import SamplingParams
from kvjax.runtime.step_batch import make_step_batch
from kvjax.weights.quantize import (SCHEMES, decode_step_weight_bytes, quantize_params,
                                    weight_bytes)

# Relative Frobenius reconstruction error of a Gaussian [256, 64] weight: rounding
# error is uniform, step/sqrt(12), step = absmax/qmax of each group.
BOUNDS = {"int8": 0.02, "int4-g32": 0.13, "int4-g64": 0.14, "int4-g128": 0.15}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_reconstruction_error_bounds(scheme):
  bits, group = SCHEMES[scheme]
  w = jax.random.normal(jax.random.PRNGKey(0), (256, 4, 16))
  q = quantize_weight(w, num_in=1, bits=bits, group_size=group)
  rel = float(jnp.linalg.norm(q.dequantize(jnp.float32) - w) / jnp.linalg.norm(w))
  assert rel < BOUNDS[scheme], (scheme, rel)
  # Bytes: codes at bits/8 per value plus one f32 scale per group per output.
  per_value = bits / 8 + 4 / (group or 256)
  assert q.nbytes == pytest.approx(w.size * per_value)


def test_smaller_groups_are_more_accurate():
  w = jax.random.normal(jax.random.PRNGKey(1), (256, 64))
  errors = [float(jnp.linalg.norm(quantize_weight(w, num_in=1, bits=4, group_size=g)
                                  .dequantize(jnp.float32) - w)) for g in (32, 64, 128)]
  assert errors[0] < errors[1] < errors[2]


def test_awq_protects_salient_input_channels():
  # Calibration-like activations: a few input channels carry most of the magnitude.
  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  x = jax.random.normal(keys[0], (512, 128)) * jnp.where(jnp.arange(128) % 16 == 0, 20.0, 1.0)
  w = jax.random.normal(keys[1], (128, 64))
  plain = quantize_weight(w, num_in=1, bits=4, group_size=128)
  s = jnp.mean(jnp.abs(x), 0) ** 0.5
  awq = quantize_weight(w, num_in=1, bits=4, group_size=128,
                        in_scale=s / jnp.sqrt(s.max() * s.min()))
  err = lambda q: float(jnp.linalg.norm(x @ q.dequantize(jnp.float32) - x @ w))
  assert err(awq) < 0.8 * err(plain), (err(awq), err(plain))


def test_quantized_model_runs_through_the_unchanged_model_code(tiny_model):
  cfg = tiny_model.config
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32))
  want = np.asarray(kvjax.forward(tiny_model, tokens))
  errors = {}
  for awq in (False, True):
    params = quantize_params(tiny_model.params, cfg, "int4-g32",
                             calibration_tokens=tokens if awq else None)
    assert isinstance(params.blocks[0].attn.wo, QuantizedWeight)
    got = np.asarray(kvjax.forward(kvjax.Model(cfg, params), tokens))
    errors[awq] = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert errors[False] < 0.3
  assert errors[True] <= errors[False]  # on its own calibration text
  # float32 -> int4-g128: 8x fewer bytes per decode step, less 4 B of scale per 128 weights.
  f32 = decode_step_weight_bytes(tiny_model.params)
  q4 = decode_step_weight_bytes(quantize_params(tiny_model.params, cfg, "int4-g128"))
  assert 6.0 < f32 / q4 < 8.0
  assert weight_bytes(tiny_model.params) - f32 == cfg.vocab_size * cfg.hidden_size * 4


def test_quantized_model_generates_with_paged_cache(tiny_model):
  """The jitted paged steps agree with the no-cache forward on quantized weights."""
  model = kvjax.Model(tiny_model.config,
                      quantize_params(tiny_model.params, tiny_model.config, "int8"))
  prompt = [5, 9, 11]
  new = kvjax.generate(model, [prompt], 6).tokens[0]
  seq = prompt + new
  for i in range(len(new)):
    length = len(prompt) + i
    logits = kvjax.forward(model, [seq[:length] + [0] * (16 - length)])  # one shape
    assert int(np.argmax(logits[0, length - 1])) == new[i]


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_decode_loop_dequantizes_inside_each_step(tiny_model, scheme, monkeypatch):
  """A decode loop's weights are loop-invariant: hoisted out of the loop (or all to the
  front of its body), their float copies would stay live, temp >= every float weight;
  dequantized beside each matmul, at most a few of them are live at once.  (Where the
  qmatmul custom call runs, decode reads the codes and dequantizes nothing: off here.)"""
  monkeypatch.setattr(qmatmul, "available", lambda: False)
  cfg = tiny_model.config
  params = quantize_params(tiny_model.params, cfg, scheme)
  leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
  quantized = [w for w in leaves if isinstance(w, QuantizedWeight)]
  float_bytes = [4 * int(np.prod(w.shape)) for w in quantized]
  kv = create_paged_cache(cfg, None, 1, 5, 16, jnp.float32)
  sampling = SamplingParams.make(1, temperature=0.0, top_k=None, top_p=None, seeds=[0])
  batch = make_step_batch(np.ones((1, 1), np.int32), [5], [1], np.arange(1, 5)[None],
                          [0], sampling)
  compiled = generation._decode_loop.lower(
      params, kv, batch, jnp.int32(15), jnp.int32(-1), config=cfg,
      backend=get_backend("reference"), max_steps=16, use_filter=False).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 3 * max(float_bytes) < sum(float_bytes), (temp, float_bytes)


def test_errors_unknown_scheme_and_odd_int4_input(tiny_model):
  with pytest.raises(ValueError, match="unknown weight quantization scheme"):
    quantize_params(tiny_model.params, tiny_model.config, "int3")
  with pytest.raises(ValueError, match="even input size"):
    quantize_weight(jnp.ones((47, 8)), num_in=1, bits=4, group_size=32)


def test_ragged_last_group():
  w = jax.random.normal(jax.random.PRNGKey(3), (192, 8))
  q = quantize_weight(w, num_in=1, bits=4, group_size=128)
  assert q.scales.shape == (2, 8) and q.codes.shape == (96, 8)
  rel = float(jnp.linalg.norm(q.dequantize(jnp.float32) - w) / jnp.linalg.norm(w))
  assert rel < BOUNDS["int4-g128"]
