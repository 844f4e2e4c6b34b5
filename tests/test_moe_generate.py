"""Greedy MoE generation vs HF's argmax under every cache: Mixtral, Qwen3-MoE and gpt-oss
(its sliding layers' window 8 is shorter than the prompts and continuations)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvjax
from tests.moe_models import NEW_TOKENS, PROMPTS, hf_greedy, pair_loader


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
  return pair_loader(tmp_path_factory)


@pytest.mark.parametrize("family, caches", [
    ("mixtral", ("paged", "contiguous", "none")), ("qwen3_moe", ("paged", "contiguous", "none")),
    ("gpt_oss", ("paged", "contiguous", "none"))])
def test_greedy_generate_matches_hf(moe_pair, family, caches):
  # Decode: 3 rows x top-2 = 6 <= 8 experts, the switched path; prefill: grouped.
  hf_model, model = moe_pair(family)
  expected = hf_greedy(hf_model, PROMPTS, NEW_TOKENS)
  for cache in caches:
    assert kvjax.generate(model, PROMPTS, NEW_TOKENS, cache=cache, page_size=8).tokens == \
        expected, cache


def test_engine_counts_the_tokens_each_layer_routed_to_each_expert(moe_pair):
  """Qwen3-MoE (layer 1 dense): the Engine's [L, Ne] expert token counts (serve_step's and
  serve_burst's side output) equal a numpy recount of HF's router top-2 over the tokens
  fed (each prompt and its outputs but the last), sum to tokens x 2 on the MoE layers,
  and /metrics shows them, with each layer's max / mean."""
  from prometheus_client.parser import text_string_to_metric_families

  from kvjax.server.prom import ServerMetrics

  hf_model, model = moe_pair("qwen3_moe")
  engine = kvjax.Engine(model, max_num_seqs=2, max_model_len=64, page_size=8)
  metrics = ServerMetrics("m", max_model_len=64, max_num_seqs=2)
  before = engine.stats()
  metrics.observe_engine(before)
  tokens = engine.generate(PROMPTS, NEW_TOKENS).tokens
  assert max(engine.steps.num_steps) > 1  # a burst ran
  after = engine.stats()
  metrics.observe_engine(after)
  got = after.expert_tokens - before.expert_tokens
  cfg = hf_model.config
  want = np.zeros((cfg.num_hidden_layers, cfg.num_experts), np.int64)
  moe_layers = [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers]
  fed = [prompt + out[:-1] for prompt, out in zip(PROMPTS, tokens)]
  for seq in fed:
    with torch.no_grad():
      routers = hf_model(torch.tensor([seq]), output_router_logits=True).router_logits
    assert len(routers) == len(moe_layers)
    for layer, logits in zip(moe_layers, routers):
      chosen = torch.topk(logits.reshape(len(seq), -1), cfg.num_experts_per_tok).indices
      want[layer] += np.bincount(chosen.numpy().ravel(), minlength=cfg.num_experts)
  np.testing.assert_array_equal(got, want)
  assert got[1].sum() == 0 and all(
      got[i].sum() == sum(map(len, fed)) * cfg.num_experts_per_tok for i in moe_layers)
  families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
  shown = {(s.labels["layer"], s.labels["expert"]): s.value
           for s in families["kvjax:moe_expert_tokens"].samples if s.name.endswith("_total")}
  assert shown == {(str(i), str(e)): float(want[i, e]) for i in moe_layers
                   for e in range(cfg.num_experts)}
  imbalance = {s.labels["layer"]: s.value
               for s in families["kvjax:moe_expert_load_imbalance"].samples}
  assert imbalance == pytest.approx({str(i): want[i].max() / want[i].mean()
                                     for i in moe_layers})
