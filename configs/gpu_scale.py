# python -m experiments.gpu_scale --config=configs/gpu_scale.py
"""Issue 16: a llama3-8b-shaped bf16 model on one H200, end to end.

On the device: experiments/run_gpu_scale_device.sh (the whole script must stay
under 8 minutes).  Sections run in `sections` order; each is skipped, with the
reason in the JSON, once fewer than its estimate remain of `time_budget_s`.
Estimated H200 seconds per section (compiles included; jax 0.11.2, the
compiled Pallas kernels, 8B bf16, 16 GB of weights):
  init         ~15 s  jit(init_params) on the device, no host copy
  decode       ~45 s  batch-1 generate at 1k and 8k context: 2 prefills + 2 decode
                      loops compiled, 1 + repeats runs of 128 tokens (~0.5 s each)
  steps        ~45 s  C9 / C14: 4 decode + 3 verify step programs compiled (~6 s each)
  quant        ~45 s  int8, int4-g128 quantized on the device, 4 step programs
  invariance   ~20 s  2 backends x 3 step programs of 64 rows
  hf           ~60 s  LlamaForCausalLM on the same device buffers: sdpa, static cache,
                      torch.compile, batch 1 and hf_batch, hf_new_tokens each
  engine       ~200 s what is left: engine_runs in order, each warm-up + timed run
                      (~65 / 45 / 90 / 85 s), a run skipped when < 60 s remain
Total ~430 s of the 450 s budget; the shell script's timeout (470 s) is the backstop,
and the JSON is rewritten after every section, so a timeout keeps what finished.

get_config("runlocal"): the same script on this CPU in a few minutes: a
llama3-8b-shaped model (GQA 4:1, SwiGLU 3.5x, untied head, rope 500k) with tiny
dims, interpret-mode kernels, tiny contexts and workloads.  Its timings mean
nothing; it proves every section end to end.  Writes results/gpu_scale_runlocal.*.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.preset = "llama3-8b"  # kvjax.PRESETS name; model_overrides replaces fields
  # No EOS: every request runs to its length (vLLM's random benchmark ignores EOS too).
  config.model_overrides = ml_collections.ConfigDict(dict(eos_token_id=None))
  config.dtype = "bfloat16"  # weights and activations
  config.seed = 0
  config.backend = "pallas"  # the compiled kernels; "pallas_interpret" on the CPU
  config.page_size = 16
  config.peak_bandwidth = 4.8e12  # H200 HBM3e bytes/s (the utilization denominator)
  config.sections = ("init", "decode", "steps", "quant", "invariance", "hf", "engine")
  config.time_budget_s = 450.0
  config.section_estimates_s = ml_collections.ConfigDict(dict(
      init=15.0, decode=45.0, steps=45.0, quant=45.0, invariance=20.0, hf=60.0,
      engine=60.0))
  # decode: batch-1 kvjax.generate; the KV read per step is taken at the mean context.
  config.decode_contexts = (1024, 8192)  # prompt + new tokens
  config.decode_new_tokens = 128
  config.repeats = 2  # timed runs after one warm-up; medians reported
  # steps (C9, C14) and quant (C12): one step program timed on a full paged cache.
  config.step_context = 1024
  config.decode_batches = (1, 8, 10, 64)  # C14 reads 1 vs 10, C9 1 / 8 / 64
  config.verify_batches = (1, 8, 64)
  config.verify_q_len = 3  # last token + 2 drafts
  config.step_repeats = 10
  config.weight_schemes = ("int8", "int4-g128")
  config.quant_batches = (1, 64)
  # invariance: one request alone vs among invariance_batch - 1 others, same shapes.
  config.invariance_batch = 64
  config.invariance_prompt_len = 256  # row width; the others' lengths vary in [1, it]
  config.invariance_backends = ("reference", "pallas")
  # engine: vLLM-style random workloads (kvjax/server/bench/workloads.py), lengths +-range_ratio,
  # (input_len, output_len, concurrency) in order; num_requests = max_num_seqs = concurrency.
  # Each runs twice (warm-up, then timed); H200 estimates: 1000/1000@256 ~65 s,
  # @64 ~45 s, 128/2048@256 ~90 s, @64 ~85 s: the last is skipped if the budget is short.
  config.engine_runs = ((1000, 1000, 256), (1000, 1000, 64), (128, 2048, 256),
                        (128, 2048, 64))
  config.engine_run_estimate_s = 60.0  # a run starts only with this much budget left
  config.range_ratio = 0.5
  config.max_num_batched_tokens = 8192
  config.num_scheduler_steps = 16
  config.engine_max_pages = 45000  # 720k tokens, ~88 GiB of bf16 KV for the 8B shape
  config.equality_requests = 2  # engine greedy vs batch-1 kvjax.generate, first tokens
  config.equality_tokens = 32
  # hf: the first hf_batch requests of engine_runs[0], hf_new_tokens each, one timed run
  # after a warm-up (~3 s per eager call at batch 64; compile ~40 s).
  config.hf_modes = ("sdpa", "static", "compile")
  config.hf_batch = 64
  config.hf_new_tokens = 64
  config.out_dir = "results"
  config.name = "gpu_scale"
  if arg == "runlocal":
    config.model_overrides = ml_collections.ConfigDict(dict(
        name="llama3-8b-shaped-tiny", vocab_size=512, hidden_size=64, intermediate_size=224,
        num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
        max_position_embeddings=512, eos_token_id=None))
    config.backend = "pallas_interpret"
    config.time_budget_s = 600.0
    config.decode_contexts = (64, 128)
    config.decode_new_tokens = 8
    config.repeats = 1
    config.step_context = 64
    config.decode_batches = (1, 2)
    config.verify_batches = (1, 2)
    config.step_repeats = 2
    config.quant_batches = (1, 2)
    config.invariance_batch = 4
    config.invariance_prompt_len = 16
    config.invariance_backends = ("reference", "pallas_interpret")
    config.engine_runs = ((24, 8, 4), (8, 16, 4))
    config.engine_run_estimate_s = 5.0
    config.max_num_batched_tokens = 64
    config.num_scheduler_steps = 4
    config.engine_max_pages = 64
    config.equality_tokens = 6
    config.hf_modes = ("sdpa", "static")
    config.hf_batch = 2
    config.hf_new_tokens = 4
    config.name = "gpu_scale_runlocal"  # never overwrite the device results
  return config
