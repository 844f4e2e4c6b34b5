# python -m experiments.real_model_bench --config=configs/real_model_bench.py --config.peers_dir=/work/peers
"""The CPU peers side by side on the real model (issue 27 item 5): SmolLM2-135M-Instruct
Q4_1, the same GGUF file and chat prompts for every engine.

(a) batch-1 decode tok/s and TTFT, greedy, a fixed number of new tokens: kvjax per
    weight dtype (float32 = the blocks dequantized, int8, int4 = Q4_1 blocks kept),
    HF transformers on the file dequantized (float32, torch threads hf_threads) and
    llama.cpp through llama-cpp-python (n_threads 1 and 2, the faster counts);
(b) output tokens/s at each concurrency: kvjax's HTTP server against llama-server
    with as many slots, the same streaming client (kvjax/server/bench/client.py), a fixed
    max_tokens and EOS ignored by both.
The peers come from `bash experiments/install_cpu_peers.sh PEERS_DIR`; a peer that is
not there is skipped (the run says the install command).
`get_config("gemma3")` runs the same on Gemma 3 270M Q4_K_M (a base model: the prompts are
texts it continues), writing results/real_model_bench_gemma3.*.
`get_config("runlocal")` is a kvjax-only smoke run on `checkpoint` (a tiny GGUF in the
tests): one repeat, short outputs, concurrency 2, writing
results/real_model_bench_runlocal.*.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = "smollm2-135m-instruct"  # a kvjax GGUF name or a .gguf path
  config.peers_dir = "peers"  # install_cpu_peers.sh's PREFIX
  config.seed = 0
  # One user message each, rendered with the checkpoint's own chat template.
  config.prompts = (
      "What is the capital of France? Answer in one sentence.",
      "Write a short poem about the sea.",
      "Explain in two sentences why the sky is blue.",
  )
  config.weight_dtypes = ("float32", "int8", "int4")  # kvjax at batch 1
  # Per prompt at batch 1, EOS ignored: 31 decode steps time TPOT; more only lengthens a
  # run whose kvjax step compilations already take minutes on 2 shared cores.
  config.new_tokens = 32
  config.transformers = True  # HF transformers at batch 1
  config.hf_threads = 2  # torch.set_num_threads
  config.llamacpp_threads = (1, 2)  # llama-cpp-python n_threads; the best counts
  config.repeats = 3  # interleaved rounds; the median round is reported
  # (b) throughput: one wave of requests_per_slot x concurrency requests per round.
  config.concurrency = (8, 32)
  config.requests_per_slot = 1
  config.max_tokens = 64
  # One kvjax server each (each compiles its own step programs: minutes apiece here).
  config.serve_weight_dtypes = ("float32",)
  config.server_threads = 2  # llama-server --threads / --threads-batch
  config.max_num_batched_tokens = 512  # kvjax's step token budget
  config.max_tries = 3  # a kvjax round that compiled a step program runs again
  config.out_dir = "results"
  config.name = "real_model_bench"
  if arg == "gemma3":  # the base model (no chat template): it continues each text
    config.checkpoint = "gemma3-270m"
    config.prompts = (
        "def fibonacci(n):",
        "The capital of France is",
        "The sky is blue because",
    )
    config.name = "real_model_bench_gemma3"
  if arg == "runlocal":
    config.prompts = config.prompts[:2]
    config.weight_dtypes = ("float32",)
    config.transformers = False  # kvjax alone: importing torch is most of a smoke run
    config.new_tokens = 8
    config.repeats = 1
    config.concurrency = (2,)
    config.max_tokens = 8
    config.max_num_batched_tokens = 128
    config.name = "real_model_bench_runlocal"
  return config
