# python -m experiments.variant_quality --config=configs/variant_quality.py
"""What each KV and weight variant costs in quality on SmolLM2-135M-Instruct (C6, C12, C16).

get_config("gemma3"): Gemma 3 270M (a base model: HumanEval and needle prompts in
completion mode), its own local / global layers beside every layer local.
A variant name: "float" (the GGUF's Q4_1 weights dequantized to float32, fp32 KV
pages), "kv-<bf16|int8|int4>", "window-<N>" (every layer's sliding window),
"sinks<S>-window<W>" (S attention sinks + the last W tokens: the sinks_window
attention variant as a kv_dtype) or "weights-<int8|int4|int4-g64|int4-g128>" (int4 =
int4-g32, the GGUF's own Q4_1 blocks kept as codes; g64 / g128 re-quantized) or
"weights-awq-<scheme>" (AWQ: activation-aware scales calibrated on text the perplexity
does not score).  get_config("runlocal"): a smoke run of a few variants, short text, two
problems, one needle length, two engines timed twice.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.model = "smollm2-135m-instruct"
  config.model_label = "SmolLM2-135M"  # how the claims name the model
  config.variants = ("float", "kv-bf16", "kv-int8", "kv-int4", "window-256", "window-1024",
                     "sinks4-window252", "sinks4-window1020", "weights-int8", "weights-int4",
                     "weights-int4-g64", "weights-int4-g128", "weights-awq-int4-g128")
  config.awq_calibration_tokens = 512  # AWQ's calibration text: past the scored tokens
  config.page_size = 16
  # Perplexity (kvjax/eval/perplexity.py) of the stdlib text (kvjax/eval/text_set.py).
  config.ppl_context = 1280  # > 1024: window-1024 drops context
  config.ppl_tokens = 1280
  config.ppl_chunk = 128
  config.ppl_decode_tokens = 2  # each one a chunk-wide step
  config.ppl_batch_size = 1
  # HumanEval pass@1 (greedy) on the first humaneval_limit problems, these variants.
  config.humaneval_variants = ("float", "kv-int8", "kv-int4", "weights-int8",
                               "weights-int4-g128", "weights-awq-int4-g128")
  config.humaneval_limit = 16
  config.humaneval_new_tokens = 256  # a chat reply writes the whole function
  config.humaneval_mode = "chat"  # kvjax/eval/humaneval.py MODES: an instruct model
  config.humaneval_timeout_s = 10.0
  # Needle retrieval (C16), these variants.
  config.needle_variants = ("float", "window-256", "window-1024", "sinks4-window252",
                            "sinks4-window1020")
  config.needle_lengths = (512, 1280)
  config.needle_depths = (0.0, 0.5, 1.0)
  config.needle_mode = "chat"  # kvjax/eval/needle.py MODES
  config.max_num_seqs = 16
  # Decode speed: these variants' engines in interleaved rounds, batch speed_batch.
  config.speed_variants = config.variants
  config.speed_batch = 8
  config.speed_prompt_len = 64
  config.speed_new_tokens = 32
  config.speed_repeats = 5
  config.out_dir = "results"
  config.name = "variant_quality"
  if arg == "gemma3":  # a base model trained with local (window 512) and global layers
    config.model = "gemma3-270m"
    config.model_label = "Gemma 3 270M"
    config.variants = ("float", "kv-int8", "window-512")  # window-512: every layer local
    config.humaneval_variants = ("float",)
    config.humaneval_limit = 164
    config.humaneval_mode = "completion"  # a base model continues the signature
    config.humaneval_new_tokens = 192  # a completion is cut at the next top-level line
    config.needle_variants = ("float", "window-512")
    config.needle_lengths = (512, 1024, 2048, 4096, 8192)
    config.needle_mode = "completion"
    config.speed_variants = ()  # batch-1 speed: experiments/real_model_bench.py :gemma3
    config.name = "variant_quality_gemma3"
  if arg == "runlocal":
    config.variants = ("float", "kv-int8", "window-256", "sinks4-window252")
    config.ppl_context = 256
    config.ppl_tokens = 256
    config.humaneval_variants = ("float",)
    config.speed_variants = ("float", "kv-int8")
    config.speed_repeats = 2
    config.humaneval_limit = 2
    config.humaneval_new_tokens = 32
    config.needle_variants = ("float", "window-256", "sinks4-window252")
    config.needle_lengths = (512,)
    config.needle_depths = (0.0, 1.0)
    config.name = "variant_quality_runlocal"  # never overwrite the committed results
  return config
