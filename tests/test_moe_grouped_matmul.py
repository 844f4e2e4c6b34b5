"""The grouped expert path's ragged-matmul records (kvjax/moe/grouped_matmul.py) vs float64
numpy and jax.lax.ragged_dot, empty groups included.  tokamax is the optional "gpu" extra:
where it is installed its record runs (on the CPU: tokamax's XLA implementation, the dry
run of the GPU kernels' path); where it is not, asking for it names the extra."""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model import config as config_module
from kvjax.model.decoder import forward
from kvjax.model.params import init_params
from kvjax.moe.grouped_matmul import GROUPED_MATMULS, get_grouped_matmul

HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None


def _ragged_f64(lhs, rhs, sizes):
  """Row block g of lhs times rhs[g], float64."""
  out, start = np.zeros((lhs.shape[0], rhs.shape[-1])), 0
  for g, size in enumerate(sizes):
    out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g]
    start += size
  return out


def _groups(seed: int, m: int = 24, g: int = 6):
  """float32 lhs [m, 16], rhs [g, 16, 8] and random group sizes summing to m, at least two
  of them empty."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.integers(0, m + 1, g - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [m]]))
  sizes[rng.choice(g, 2, replace=False)] = 0
  sizes[int(np.argmax(sizes))] += m - sizes.sum()
  lhs = rng.standard_normal((m, 16)).astype(np.float32)
  rhs = rng.standard_normal((g, 16, 8)).astype(np.float32)
  return lhs, rhs, sizes.astype(np.int32)


def test_the_config_names_the_records():
  assert set(config_module.GROUPED_MATMUL_NAMES) == set(GROUPED_MATMULS)
  with pytest.raises(ValueError, match="moe_grouped_matmul 'cutlass'"):
    get_grouped_matmul("cutlass")
  with pytest.raises(ValueError, match="moe_grouped_matmul 'cutlass'"):
    kvjax.ModelConfig(name="m", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=8,
                      max_position_embeddings=8, moe_grouped_matmul="cutlass")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_xla_record_is_ragged_dot(seed):
  lhs, rhs, sizes = _groups(seed)
  out = jax.jit(get_grouped_matmul("xla").ragged_dot)(lhs, rhs, jnp.asarray(sizes))
  np.testing.assert_allclose(out, _ragged_f64(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokamax_record_equals_ragged_dot_or_names_its_extra(seed):
  lhs, rhs, sizes = _groups(seed)
  if not HAVE_TOKAMAX:
    with pytest.raises(ImportError, match=r"kvjax\[gpu\]"):
      get_grouped_matmul("tokamax")
    return
  ours = jax.jit(get_grouped_matmul("tokamax").ragged_dot)(lhs, rhs, jnp.asarray(sizes))
  theirs = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes))
  np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ours, _ragged_f64(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_a_prefill_forward_through_tokamax_equals_xla():
  # 2 x 8 tokens x top-2 = 32 assignments > 8 experts: the grouped path.
  cfg = kvjax.ModelConfig(name="moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          max_position_embeddings=64)
  params = init_params(cfg, jax.random.PRNGKey(0), std=0.2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
  if not HAVE_TOKAMAX:
    with pytest.raises(ImportError, match=r"kvjax\[gpu\]"):
      forward(params, cfg.replace(moe_grouped_matmul="tokamax"), tokens)
    return
  logits = {name: forward(params, cfg.replace(moe_grouped_matmul=name), tokens)
            for name in ("xla", "tokamax")}
  np.testing.assert_allclose(logits["tokamax"], logits["xla"], rtol=1e-5, atol=1e-5)
