"""Ledger tests: the seeds' memory figures (claims C4-C6), exactly, in binary units.

Every expected number below is the seed's, with its "GB" of cache or card read as
GiB (see kvjax/parallel/ledger.py for why that convention reproduces them exactly).
"""
import argparse
import json

import pytest

from kvjax.cli import memory as cli_memory
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger
from kvjax.parallel.ledger import GIB, KIB

MHA7, GQA8, GQA70 = get_preset("llama2-7b"), get_preset("llama3-8b"), get_preset("llama3-70b")


# C4: bytes per token and per request.
def test_7b_mha_per_token_and_128k():
  assert ledger.kv_values_per_token(MHA7) == 2 * 32 * 32 * 128 == 262144
  assert ledger.kv_bytes_per_token(MHA7, "fp16") == 512 * KIB
  assert ledger.kv_bytes_per_request(MHA7, 131072, "fp16") == 64 * GIB
  # Batch 8 at 128K is "500+ GiB"; the seed's 13 GiB weights are 7e9 x 2 B.
  assert 8 * ledger.kv_bytes_per_request(MHA7, 131072, "fp16") == 512 * GIB
  assert round(7e9 * 2 / GIB) == 13
  assert ledger.weight_bytes(MHA7, "fp16") == 2 * 6_738_415_616  # published count.


@pytest.mark.parametrize("context,gib", [(4096, 0.5), (8192, 1), (32768, 4), (131072, 16)])
def test_8b_gqa_per_request(context, gib):
  assert ledger.kv_bytes_per_token(GQA8, "fp16") == 131072 == 128 * KIB
  assert ledger.kv_bytes_per_request(GQA8, context, "fp16") == gib * GIB


@pytest.mark.parametrize("context,gib", [(8192, 2.5), (32768, 10), (131072, 40)])
def test_70b_gqa_per_request(context, gib):
  assert ledger.kv_bytes_per_token(GQA70, "fp16") == 327680 == 320 * KIB
  assert ledger.kv_bytes_per_request(GQA70, context, "fp16") == gib * GIB


def test_70b_128k_cache_exceeds_int4_weights():
  cache = ledger.kv_bytes_per_request(GQA70, 131072, "fp16")
  int4 = ledger.weight_bytes(GQA70, "int4")
  assert int4 == ledger.param_count(GQA70) // 2
  assert abs(int4 / 35e9 - 1) < 0.01  # seed: "about 35 GB".
  assert cache > int4 and cache > 35e9
  assert cache < ledger.weight_bytes(GQA70, "fp16") / 3  # "under a third" at fp16.


def test_qwen35_hybrid_counts_only_full_attention_layers():
  cfg = get_preset("qwen3.5-9b")
  assert ledger.kv_bytes_per_token(cfg) == 2 * 8 * 4 * 256 * 2 == 32 * KIB
  assert abs(ledger.kv_bytes_per_token(cfg) / KIB / 32.3 - 1) < 0.02  # measured 32.3 KB.
  every_layer = cfg.replace(layer_types=None, num_full_attention_layers=None)
  assert ledger.kv_bytes_per_token(every_layer) == 4 * ledger.kv_bytes_per_token(cfg)
  # The MTP draft block's pages count only when asked for.
  assert ledger.kv_bytes_per_token(cfg, include_mtp=True) == 9 * 4 * KIB


def test_mla_caches_one_latent_plus_rope_key():
  v2 = get_preset("deepseek-v2")
  assert ledger.kv_values_per_token(v2) == 60 * (512 + 64)
  assert ledger.kv_bytes_per_token(v2) == 60 * 576 * 2
  lite = get_preset("deepseek-v2-lite")
  assert ledger.kv_bytes_per_token(lite) == 27 * 576 * 2


def test_param_counts_match_published_totals():
  for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55),
                         ("deepseek-v2", 235.74), ("deepseek-v2-lite", 15.71),
                         ("deepseek-llm-67b", 67.43)):
    assert round(ledger.param_count(get_preset(name)) / 1e9, 2) == billions, name


def test_param_count_matches_initialized_pytree():
  jax = pytest.importorskip("jax")
  params = pytest.importorskip("kvjax.model.params")
  from kvjax.model.learned_sinks import with_learned_sinks

  gpt_oss_like = with_learned_sinks(get_preset("tiny").replace(
      attention_bias=True, attention_out_bias=True, num_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=16, moe_bias=True, expert_activation="clamped_swiglu"))
  for cfg in (get_preset("tiny"), get_preset("tiny").replace(
      mtp_num_hidden_layers=2, qk_norm=True, attention_bias=True, tie_word_embeddings=True),
      gpt_oss_like):
    tree = jax.eval_shape(lambda key: params.init_params(cfg, key), jax.random.PRNGKey(0))
    assert ledger.param_count(cfg) == params.count_params(tree)


def test_sliding_window_caps_request_not_per_token():
  mistral = get_preset("mistral-7b")  # window 4096 on every layer.
  assert ledger.kv_bytes_per_token(mistral) == 128 * KIB
  assert (ledger.kv_bytes_per_request(mistral, 32768)
          == ledger.kv_bytes_per_request(mistral, 4096) == 0.5 * GIB)


# C5: concurrency and sizing with the seed's 80 GB card, 16 GB weights, 4 GB reserve.
SEED_CARD = dict(gpu_gib=80, weight_gib=16, reserve_gib=4, kv_dtype="fp16")


def test_concurrency_120_at_4k_15_at_32k():
  at4k, at32k = ledger.plan(GQA8, 4096, **SEED_CARD), ledger.plan(GQA8, 32768, **SEED_CARD)
  assert at4k.free_kv_bytes == 60 * GIB
  assert (at4k.max_concurrency, at32k.max_concurrency) == (120, 15)


@pytest.mark.parametrize("context,total_gib", [(8192, 70), (4096, 45)])
def test_sizing_50_concurrent(context, total_gib):
  result = ledger.plan(GQA8, context, batch=50, **SEED_CARD)
  assert result.total_bytes == total_gib * GIB and result.fits


def test_weights_that_do_not_fit_give_zero_concurrency():
  result = ledger.plan(get_preset("deepseek-v2"), 4096)
  assert result.free_kv_bytes < 0 and result.max_concurrency == 0 and not result.fits


# C6: shrinking the cache.
def _ratio(a, b, a_dtype="fp16", b_dtype="fp16"):
  return ledger.kv_bytes_per_token(a, a_dtype) / ledger.kv_bytes_per_token(b, b_dtype)


def test_mqa_gqa_ratios_vs_mha():
  assert _ratio(MHA7.replace(num_kv_heads=1), MHA7) == 1 / 32
  assert _ratio(GQA8, GQA8.replace(num_kv_heads=32)) == 1 / 4
  assert _ratio(GQA70, GQA70.replace(num_kv_heads=64)) == 1 / 8


def test_mla_93_3_percent_is_6_bit_latent_vs_deepseek_67b():
  # DeepSeek-V2's baseline is DeepSeek 67B (bf16 GQA); V2's cache is ~6 bits/element.
  base = ledger.kv_bytes_per_token(get_preset("deepseek-llm-67b"), "bf16")
  mla = ledger.kv_values_per_token(get_preset("deepseek-v2")) * 6 / 8
  assert round(1 - mla / base, 3) == 0.933
  assert round(base / mla) == 15
  # At bf16 the same comparison is only 1/5.6: the 1/15 needs the quantization.
  assert round(base / ledger.kv_bytes_per_token(get_preset("deepseek-v2"), "bf16"), 1) == 5.6


def test_kv_quantization_ideal_ratios_and_scales():
  assert _ratio(GQA8, GQA8, "int8") == 1 / 2
  assert _ratio(GQA8, GQA8, "int4") == 1 / 4
  assert _ratio(GQA8, MHA7, "int8") == 1 / 8  # GQA 4x times int8 2x.
  # One fp32 scale per (layer, kv head, K|V) vector: 32 x 16 x 4 B per token.
  assert ledger.kv_scale_bytes_per_token(GQA8, "int8") == 32 * 16 * 4
  assert ledger.kv_scale_bytes_per_token(GQA8, "bf16") == 0
  plain = ledger.kv_bytes_per_request(GQA8, 1024, "int4")
  scaled = ledger.kv_bytes_per_request(GQA8, 1024, "int4", count_scales=True)
  # KIVI int4 (the pool kvjax allocates): values a scale and an offset per token per kv
  # head, keys per channel per 16-token page: 32 layers x 8 kv heads x 2 x 4 B x (1 + 128 / 16).
  assert scaled - plain == 1024 * 32 * 8 * 2 * 4 * (1 + 128 // ledger.PAGE_SIZE)


# Bad input.
@pytest.mark.parametrize("call,needle", [
    (lambda: get_preset("llama9-1t"), "llama9-1t"),
    (lambda: ledger.kv_bytes_per_request(GQA8, 0), "0"),
    (lambda: ledger.plan(GQA8, -5), "-5"),
    (lambda: ledger.kv_bytes_per_token(GQA8, "fp8"), "fp8"),
    (lambda: ledger.plan(GQA8, 10, weight_dtype="int3"), "int3"),
    (lambda: ledger.plan(GQA8, 10, batch=0), "batch"),
    (lambda: ledger.plan(GQA8, 10, gpu_gib=0), "gpu_gib"),
])
def test_bad_input_names_the_value(call, needle):
  with pytest.raises(ValueError, match=needle):
    call()


# CLI.
def _cli(argv):
  parser = argparse.ArgumentParser()
  cli_memory.add_parser(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["memory", *argv])
  return args.func(args)


def test_cli_json(capsys):
  rc = _cli(["--preset", "llama3-8b", "--context", "4096", "--kv-dtype", "fp16",
             "--weight-gib", "16", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert rc == 0
  assert out["kv_bytes_per_token"] == 128 * KIB
  assert out["kv_bytes_per_request"] == GIB // 2
  assert out["weight_bytes"] == 16 * GIB
  assert out["max_concurrency"] == 120


def test_cli_text(capsys):
  assert _cli(["--preset", "llama3-70b", "--context", "131072", "--weight-dtype", "int4"]) == 0
  assert "max concurrency" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "nope", "--context", "8"], "'nope'"),
    (["--preset", "tiny", "--context", "0"], "got 0"),
    (["--preset", "tiny", "--context", "8", "--kv-dtype", "fp8"], "'fp8'"),
])
def test_cli_bad_input_exits_2(capsys, argv, needle):
  assert _cli(argv) == 2
  assert needle in capsys.readouterr().err


def _qwen3_moe_per_device(tp: int, ep: int) -> tuple[int, int]:
  """Qwen3-30B-A3B's published shape (config.json) counted by hand on one device of a
  tp x ep mesh -> (params, routed expert params): attention and embeddings split tp ways,
  128 experts ep ways and each expert's width 768 tp ways, norms and router whole."""
  d, n, k, h, v, layers, ne, fe = 2048, 32, 4, 128, 151936, 48, 128, 768
  attention = (2 * d * n * h + 2 * d * k * h) // tp + 2 * h  # wq wo, wk wv; q/k norms
  experts = ne // ep * 3 * d * fe // tp
  layer = attention + 2 * d + d * ne + experts  # + two norms and the router
  return layers * layer + 2 * v * d // tp + d, layers * experts  # + embed, lm_head, norm


def test_cli_ep_per_device_bytes_and_smallest_ep_by_hand(capsys):
  argv = ["--preset", "qwen3-30b-a3b", "--context", "4096", "--tp", "2", "--ep", "4",
          "--gpu-gib", "24"]
  assert _cli(argv + ["--json"]) == 0
  got = json.loads(capsys.readouterr().out)["tp"]
  params, experts = _qwen3_moe_per_device(2, 4)
  assert (got["tp"], got["ep"]) == (2, 4)
  assert got["weight_bytes_per_device"] == 2 * params  # bf16
  assert got["expert_bytes_per_device"] == 2 * experts
  kv = 4096 * 48 * 2 * (4 // 2) * 128 * 2  # context x layers x K,V x kv heads a device x H
  fits = [ep for ep in (1, 2, 4, 8) if 2 * _qwen3_moe_per_device(2, ep)[0] + kv + 4 * GIB
          <= 24 * GIB]
  assert got["smallest_ep"] == fits[0] == 2
  assert _cli(argv) == 0
  text = capsys.readouterr().out
  assert "per device at tp=2, ep=4:" in text and "smallest ep that fits at tp=2: 2" in text
  assert f"experts        {2 * experts / GIB:.3f} GiB of those" in text
  assert "(30.53B params)" in text and "active per token 3.35B params" in text


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "tiny", "--context", "8", "--ep", "2"], "ep=2 splits routed experts, and"),
    (["--preset", "mixtral-8x7b", "--context", "8", "--ep", "3"],
     "num_experts 8 of 'mixtral-8x7b' does not split over ep=3"),
])
def test_cli_bad_ep_exits_2(capsys, argv, needle):
  assert _cli(argv) == 2
  assert needle in capsys.readouterr().err


# gpt-oss-20b's config.json as released (openai/gpt-oss-20b); -120b differs in its layer and
# expert counts.
_GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088}


@pytest.mark.parametrize("size,layers,experts,total_b,active_b",
                         [("20b", 24, 32, 20.91, 3.61), ("120b", 36, 128, 116.83, 5.13)])
def test_gpt_oss_presets_are_the_released_configs(size, layers, experts, total_b, active_b):
  """The presets equal what the HF loader reads from the released config.json, and their
  parameter counts OpenAI's model card: 20.91B / 116.83B in total, 3.61B / 5.13B active.
  The card leaves the input embedding out of "active" (a token reads one row of it); the
  ledger counts the table, as Qwen's figures do (Qwen3-30B-A3B's 3.3B)."""
  from kvjax.weights.hf_config import config_from_hf

  released = {**_GPT_OSS_20B, "num_hidden_layers": layers, "num_local_experts": experts,
              "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
  preset = get_preset(f"gpt-oss-{size}")
  assert config_from_hf(released, f"gpt-oss-{size}") == preset
  embedding = preset.vocab_size * preset.hidden_size
  assert ledger.param_count(preset) / 1e9 == pytest.approx(total_b, abs=0.005)
  assert (ledger.param_count(preset, active=True) - embedding) / 1e9 == pytest.approx(
      active_b, abs=0.005)
