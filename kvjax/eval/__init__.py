"""kvjax.eval: what a variant (KV store, window, weights, backend) costs in quality.

One module per task, each over any kvjax.Model and the engine options it serves with:
  variant.py     a Model with a sliding window applied, EngineConfig checks, KV bytes/token
  text_set.py    the perplexity text: installed standard-library files fixed by a manifest
  perplexity.py  teacher-forced nats/token and bits/byte through the paged cache
  humaneval.py   HumanEval pass@1 (greedy): Engine completions, sandboxed checks
  sandbox.py     runs an untrusted Python program contained (bubblewrap, rlimits)
  needle.py      needle retrieval (claim C16): accuracy by context length and depth
  choice.py      multiple choice by loglikelihood (lm-eval's multiple_choice): acc, acc_norm
`python -m kvjax eval` (kvjax/cli/eval.py) runs them and writes JSON + PNG.
"""
