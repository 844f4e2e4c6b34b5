"""lm-evaluation-harness scores `kvjax serve` with no change on its side (issue 54).

What a user runs, end to end:
  1. lm-eval in a venv of its own (--venv; made here with `python -m venv
     --system-site-packages` + `pip install "lm-eval[api]"` when it has none yet: the
     system site reuses this machine's torch, lm-eval is never a kvjax dependency);
  2. the HF tokenizer lm-eval encodes with (its `tokenizer=` argument): an HF checkpoint's
     own directory, or, for a GGUF model, one transformers writes from the GGUF file
     (AutoTokenizer.from_pretrained(dir, gguf_file=name).save_pretrained(out));
  3. `python -m kvjax serve` in a child process;
  4. `lm_eval --model local-completions` on two tiny local tasks: kvjax_tiny_choice
     (multiple_choice: kvjax/assets/eval_choice_tiny.jsonl, scored with echo + logprobs +
     max_tokens 1) and kvjax_tiny_gen (generate_until: the right choice as the target);
  5. lm-eval's per-choice loglikelihoods (--log_samples) against kvjax's offline ones
     (kvjax/eval/choice.py through an Engine in this process): the largest difference.
Prints the command and both accuracies; writes <out>/lm_eval_run.json.

  python -m experiments.lm_eval_run --checkpoint smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from experiments import common

TASKS = """\
task: kvjax_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
# The choices carry their own leading space; lm-eval's default delimiter " " would add
# a second one (scoring "  Paris", not " Paris").
target_delimiter: ""
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """\
task: kvjax_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
"""


def _lm_eval(venv: str) -> str:
  """The venv's lm_eval command, the venv made and lm-eval[api] (its API models need the
  extra) installed if need be."""
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
  if subprocess.run([python, "-c", "import lm_eval, tenacity, aiohttp"]).returncode:
    subprocess.run([python, "-m", "pip", "install", "-q", "lm-eval[api]"], check=True)
  return os.path.join(venv, "bin", "lm_eval")


def _hf_tokenizer(checkpoint: str, out_dir: str) -> str:
  """A directory lm-eval's HF tokenizer loads for `checkpoint` (module doc, step 2)."""
  from kvjax.weights.gguf import gguf_path

  path = gguf_path(checkpoint)
  if path is None:
    return checkpoint  # an HF checkpoint directory holds its tokenizer
  from transformers import AutoTokenizer

  target = os.path.join(out_dir, "tokenizer")
  AutoTokenizer.from_pretrained(os.path.dirname(path),
                                gguf_file=os.path.basename(path)).save_pretrained(target)
  return target


def model_args(name: str, root: str, tokenizer: str) -> str:
  """lm-eval's --model_args for `kvjax serve` at `root`: ids encoded by lm-eval with the
  tokenizer's special tokens (add_bos_token), as the server encodes a text prompt and
  kvjax/eval/choice.py encodes a pair (lm-eval's API models add none by default)."""
  return (f"model={name},base_url={root}/v1/completions,tokenizer={tokenizer},"
          "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,"
          "num_concurrent=1")


def _lm_eval_loglikelihoods(out_dir: str) -> list[list[float]]:
  """Per question (doc_id order), lm-eval's loglikelihood of each choice."""
  [path] = glob.glob(os.path.join(out_dir, "**", "samples_kvjax_tiny_choice_*.jsonl"),
                     recursive=True)
  with open(path) as f:
    samples = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
  return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def _offline(checkpoint: str) -> dict:
  import kvjax
  from kvjax.eval import choice

  model = kvjax.load_checkpoint(checkpoint)
  engine = kvjax.Engine(model, max_model_len=512)
  return choice.evaluate(engine, model.tokenizer, choice.load_questions())


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
  parser.add_argument("--venv", default="/tmp/lmeval-venv")
  parser.add_argument("--port", type=int, default=8765)
  parser.add_argument("--out", default="results/lm_eval_run")
  args = parser.parse_args()
  from kvjax.eval.choice import TINY_TASK

  os.makedirs(args.out, exist_ok=True)
  lm_eval = _lm_eval(args.venv)
  tokenizer = _hf_tokenizer(args.checkpoint, args.out)
  tasks = tempfile.mkdtemp(prefix="kvjax-lm-eval-tasks-")
  for name, text in (("choice", TASKS), ("gen", GEN_TASK)):
    with open(os.path.join(tasks, f"kvjax_tiny_{name}.yaml"), "w") as f:
      f.write(text.format(data=TINY_TASK))
  name, root = "kvjax", f"http://127.0.0.1:{args.port}"
  server = subprocess.Popen([sys.executable, "-m", "kvjax", "serve", "--checkpoint",
                             args.checkpoint, "--port", str(args.port), "--served-model-name",
                             name, "--max-model-len", "512", "--warm-up", "minimal"])
  try:
    common.wait_healthy(root, server, 600, "kvjax serve")
    command = [lm_eval, "--model", "local-completions", "--model_args",
               model_args(name, root, tokenizer),
               "--tasks", "kvjax_tiny_choice,kvjax_tiny_gen", "--include_path", tasks,
               "--output_path", args.out, "--log_samples"]
    print(" ".join(command), flush=True)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    subprocess.run(command, check=True, env=env)
  finally:
    server.terminate()
    server.wait(60)
  served = _lm_eval_loglikelihoods(args.out)
  offline = _offline(args.checkpoint)
  diffs = [abs(a - b) for row, s in zip(offline["rows"], served)
           for a, b in zip(row["loglikelihoods"], s)]
  assert len(served) == offline["count"] and len(diffs) == sum(map(len, served))
  result = dict(checkpoint=args.checkpoint, command=command, questions=offline["count"],
                offline_acc=offline["acc"], offline_acc_norm=offline["acc_norm"],
                max_abs_loglikelihood_diff=max(diffs), lm_eval_loglikelihoods=served,
                offline_loglikelihoods=[r["loglikelihoods"] for r in offline["rows"]])
  with open(os.path.join(args.out, "lm_eval_run.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"offline acc {offline['acc']:.3f} acc_norm {offline['acc_norm']:.3f}; lm-eval's "
        f"loglikelihoods vs kvjax's offline ones: max |diff| {max(diffs):.2e} over "
        f"{len(diffs)} choices")
  return 0


if __name__ == "__main__":
  sys.exit(main())
