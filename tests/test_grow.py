"""kvjax.weights.grow: a larger model with the original's logits, MTP drafts and tokens.

The oracle is the original model itself (its own forward is checked against HF
transformers elsewhere): the grown model must compute the same function.  A
random tiny model with a large RMSNorm eps catches a wrong eps or norm rescaling
(the default model's 1e-6 would hide the eps).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model import decoder as model_lib
from kvjax.model.params import count_params, init_params
from kvjax.model.presets import get_preset
from kvjax.training import train as train_lib
from kvjax.weights.grow import grow

SIZES = dict(hidden_size=224, intermediate_size=576, num_kv_heads=3, num_layers=5)


@pytest.fixture(scope="module")
def tiny():
  cfg = get_preset("tiny").replace(rms_norm_eps=0.1, mtp_num_hidden_layers=2)
  return cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2)


@pytest.fixture(scope="module")
def grown_tiny(tiny):
  cfg, params = tiny
  return grow(cfg, params, key=jax.random.PRNGKey(1), hidden_size=cfg.hidden_size + 40,
              intermediate_size=cfg.intermediate_size + 64,
              num_kv_heads=cfg.num_kv_heads + 1, num_layers=cfg.num_layers + 1)


def _tokens(cfg, shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)


def test_grown_model_is_larger_and_computes_the_same_logits(tiny, grown_tiny):
  (cfg, params), (grown_cfg, grown) = tiny, grown_tiny
  assert (grown_cfg.hidden_size, grown_cfg.intermediate_size, grown_cfg.num_kv_heads,
          grown_cfg.num_layers) == (cfg.hidden_size + 40, cfg.intermediate_size + 64,
                                    cfg.num_kv_heads + 1, cfg.num_layers + 1)
  assert grown_cfg.num_heads // grown_cfg.num_kv_heads == cfg.num_heads // cfg.num_kv_heads
  assert count_params(grown) > 1.3 * count_params(params)
  tokens = _tokens(cfg, (2, 24))
  want, want_mtp = model_lib.forward_with_mtp(params, cfg, tokens)
  got, got_mtp = model_lib.forward_with_mtp(grown, grown_cfg, tokens)
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(got, want, atol=1e-4 * scale)
  for g, w in zip(got_mtp, want_mtp):
    np.testing.assert_allclose(g, w, atol=1e-4 * scale)


def test_new_weights_are_real_work_and_all_get_gradients(tiny, grown_tiny):
  # The grown layers and heads compute (random reads) and learn (every zero write
  # weight gets a gradient): the Net2Net starting point the module doc promises.
  (cfg, _), (grown_cfg, grown) = tiny, grown_tiny
  new_layer = next(i for i in range(grown_cfg.num_layers)
                   if not np.any(np.asarray(grown.blocks[i].attn.wo)))
  assert float(jnp.abs(grown.blocks[new_layer].attn.wq).min()) > 0
  batch = _tokens(cfg, (2, 9), seed=3)
  grads = jax.grad(lambda p: train_lib.loss_fn(p, grown_cfg, batch, 0.5)[0])(grown)
  d, f = cfg.hidden_size, cfg.intermediate_size
  for name, g in (("identity layer wo", grads.blocks[new_layer].attn.wo),
                  ("identity layer w_down", grads.blocks[new_layer].w_down),
                  ("new MLP units' w_down rows", grads.blocks[0].w_down[f:]),
                  ("new residual dims of embed", grads.embed[:, d:]),
                  ("new heads' wo rows", grads.blocks[0].attn.wo[cfg.num_heads:]),
                  ("new residual dims of an MTP projection", grads.mtp[0].proj[:, d:])):
    assert float(jnp.abs(g).max()) > 0, name


def test_grown_default_model_serves_the_same_tokens_with_its_drafts_accepted():
  # Paged serving with MTP drafts on the grown shapes (more kv heads, more layers,
  # identity layers' K/V): the original model's plain greedy tokens, and the MTP
  # modules still predict them (a broken draft path would be rejected, not wrong).
  model = kvjax.load_checkpoint()
  cfg, grown = grow(model.config, model.params, key=jax.random.PRNGKey(0), **SIZES)
  prompts = (np.asarray(_tokens(model.config, (2, 16), seed=5)) % 256).tolist()
  reference = kvjax.generate(model, prompts, 24).tokens
  engine = kvjax.Engine(kvjax.Model(cfg, grown, model.dtype), max_num_seqs=2,
                        speculative="mtp", num_draft=2)
  ids = [engine.add_request(p, 24) for p in prompts]
  finals = {out.request_id: out for out in engine.stream() if out.finished}
  assert [finals[i].output_ids for i in ids] == reference
  proposed = sum(sum(out.metrics.proposed) for out in finals.values())
  accepted = sum(sum(out.metrics.accepted) for out in finals.values())
  assert proposed > 0 and accepted / proposed > 0.6, (accepted, proposed)


@pytest.mark.parametrize("change, message", [
    (dict(qk_norm=True), "qk_norm=True"),
    (dict(layer_windows=(None, 8)), "layer_windows"),
])
def test_refuses_models_whose_function_it_cannot_keep(tiny, change, message):
  cfg, params = tiny
  with pytest.raises(ValueError, match=message):
    grow(dataclasses.replace(cfg, **change), params, key=jax.random.PRNGKey(0), **SIZES)


def test_refuses_shrinking(tiny):
  cfg, params = tiny
  with pytest.raises(ValueError, match="num_layers must be an int >= the model's 2, got 1"):
    grow(cfg, params, key=jax.random.PRNGKey(0), **dict(SIZES, num_layers=1))
