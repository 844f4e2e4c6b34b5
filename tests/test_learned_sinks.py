"""The "gqa_sinks" layer kind (kvjax/model/learned_sinks.py) against HF's GptOssAttention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
from transformers import GptOssConfig  # noqa: E402

import kvjax  # noqa: E402
from kvjax.model.config import ModelConfig  # noqa: E402
from kvjax.model.decoder import _dense_attend, _inv_freq, forward  # noqa: E402
from kvjax.model.layer_kinds import layer_kind  # noqa: E402
from kvjax.model.learned_sinks import with_learned_sinks  # noqa: E402
from kvjax.model.params import init_params  # noqa: E402

D, N, K, H, T = 32, 4, 2, 8, 7


@pytest.fixture(scope="module")
def cfg():
  return with_learned_sinks(ModelConfig(
      name="tiny-gpt-oss", vocab_size=64, hidden_size=D, intermediate_size=64, num_layers=2,
      num_heads=N, num_kv_heads=K, head_dim=H, max_position_embeddings=64,
      attention_bias=True, attention_out_bias=True, rope_theta=10000.0))


def _hf_attention(p):
  config = GptOssConfig(
      hidden_size=D, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
      num_hidden_layers=1, layer_types=["full_attention"], attention_bias=True,
      max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  config._attn_implementation = "eager"
  hf = gpt_oss.GptOssAttention(config, layer_idx=0).double().eval()
  f64 = lambda x: torch.tensor(np.asarray(x, np.float64))
  with torch.no_grad():
    for name, w, b in (("q_proj", p.attn.wq, p.attn.bq), ("k_proj", p.attn.wk, p.attn.bk),
                       ("v_proj", p.attn.wv, p.attn.bv)):
      getattr(hf, name).weight.copy_(f64(w).reshape(D, -1).T)
      getattr(hf, name).bias.copy_(f64(b).reshape(-1))
    hf.o_proj.weight.copy_(f64(p.attn.wo).reshape(-1, D).T)
    hf.o_proj.bias.copy_(f64(p.attn.bo))
    hf.sinks.copy_(f64(p.sinks))
  return hf, gpt_oss.GptOssRotaryEmbedding(config).double()


def test_sinks_layer_matches_hf_gpt_oss_attention(cfg):
  assert layer_kind(cfg, 0).name == "gqa_sinks"
  params = init_params(cfg, jax.random.PRNGKey(0), std=0.3)
  p = params.blocks[0].attn
  p = p.replace(sinks=jnp.asarray([2.0, -1.0, 0.5, 3.0]))  # large enough to matter
  h = jax.random.normal(jax.random.PRNGKey(1), (1, T, D))
  positions = jnp.arange(T)[None]
  _, ours = layer_kind(cfg, 0).step(cfg, p, h, positions, _inv_freq(cfg, 0), None, 0,
                                    _dense_attend(cfg, positions))
  hf, rotary = _hf_attention(p)
  x = torch.tensor(np.asarray(h, np.float64))
  pos = torch.arange(T)[None]
  mask = torch.triu(torch.full((T, T), float("-inf"), dtype=torch.float64), 1)[None, None]
  with torch.no_grad():
    want, _ = hf(x, rotary(x, pos), mask)
  np.testing.assert_allclose(np.asarray(ours), want.numpy(), rtol=2e-4, atol=2e-5)
  # the sinks matter: plain GQA on the same weights is far off
  _, plain = layer_kind(cfg.replace(name="tiny"), 0).step(
      cfg, p.attn, h, positions, _inv_freq(cfg, 0), None, 0, _dense_attend(cfg, positions))
  assert np.max(np.abs(np.asarray(plain) - want.numpy())) > 1e-2


def _greedy_without_cache(model, prompt, max_new):
  """Greedy decoding by the full no-cache forward (the path checked against HF above)."""
  seq = list(prompt)
  for _ in range(max_new):
    logits = forward(model.params, model.config, jnp.asarray([seq], jnp.int32))
    seq.append(int(np.argmax(np.asarray(logits[0, -1]))))
  return seq[len(prompt):]


def test_sinks_model_generates_through_paged_cache_and_engine(cfg):
  params = init_params(cfg, jax.random.PRNGKey(2), std=0.3)
  sinks = jnp.asarray([3.0, -1.0, 2.0, 4.0])
  params = params.replace(blocks=tuple(b.replace(attn=b.attn.replace(sinks=sinks))
                                       for b in params.blocks))
  model = kvjax.Model(cfg, params)
  prompts = [[1, 5, 9, 3, 7], [2, 4, 6]]
  want = [_greedy_without_cache(model, p, 6) for p in prompts]
  assert kvjax.generate(model, prompts, 6, page_size=4).tokens == want
  assert kvjax.generate(model, prompts, 6, page_size=4, max_num_seqs=2).tokens == want
  # without its sinks the same weights decode differently (the check can fail)
  plain = kvjax.Model(cfg.replace(name="tiny"), params.replace(
      blocks=tuple(b.replace(attn=b.attn.attn) for b in params.blocks)))
  assert [_greedy_without_cache(plain, p, 6) for p in prompts] != want
