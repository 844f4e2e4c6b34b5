# python -m experiments.perplexity_peers --config=configs/perplexity_peers.py \
#     --config.peers_dir=/work/peers
"""Perplexity of the same text and GGUF file through kvjax, transformers and llama.cpp
(issue 50): SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M, float32 weights, every
engine scoring the same token ids in segments of `context` + 1.

llama.cpp comes from `bash experiments/install_cpu_peers.sh PEERS_DIR` (skipped, with the
command printed, when missing).  `get_config("runlocal")`: SmolLM2 alone, one 64-token
segment, kvjax and transformers, writing results/perplexity_peers_runlocal.*.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoints = ("smollm2-135m-instruct", "gemma3-270m")  # load_checkpoint's names
  config.context = 1024  # > 512: Gemma 3's local layers see a window of what the global see
  config.max_segments = 2  # segments of context + 1 ids from the text's start
  config.chunk = 128  # kvjax's prefill chunk width
  config.batch_size = 1  # kvjax's segments per step
  config.transformers = True
  config.threads = 2  # torch threads and llama.cpp's n_threads
  config.peers_dir = "peers"  # install_cpu_peers.sh's PREFIX
  config.out_dir = "results"
  config.name = "perplexity_peers"
  if arg == "runlocal":
    config.checkpoints = ("smollm2-135m-instruct",)
    config.context = 64
    config.max_segments = 1
    config.chunk = 32
    config.name = "perplexity_peers_runlocal"
  return config
