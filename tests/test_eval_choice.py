"""`kvjax eval choice`: multiple choice by loglikelihood through the engine's prompt logprobs.

Oracle: each choice's continuation log p summed from a float64 log-softmax of kvjax.forward's
logits (the dense, cache-free forward) over the same ids; acc / acc_norm recounted here."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kvjax
from kvjax.cli import main as cli
from kvjax.eval import choice


def _oracle_ll(model, ids, num_context):
  logits = np.asarray(kvjax.forward(model, [ids]), np.float64)[0]
  top = logits.max(-1, keepdims=True)
  log_p = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  return float(log_p[np.arange(num_context - 1, len(ids) - 1), ids[num_context:]].sum())


def test_eval_choice_equals_a_float64_forward(tmp_path, capsys):
  code = cli.main(["eval", "choice", "--checkpoint", "tiny-code", "--limit", "4",
                   "--max-num-batched-tokens", "16", "--out-dir", str(tmp_path)])
  assert code == 0
  with open(os.path.join(tmp_path, "choice.json")) as f:
    result = json.load(f)["result"]
  model = kvjax.load_checkpoint("tiny-code")
  questions = choice.load_questions(limit=4)
  assert result["count"] == 4
  right = right_norm = 0
  for q, row in zip(questions, result["rows"]):
    want = [_oracle_ll(model, *choice.encode_pair(model.tokenizer, q["context"], c))
            for c in q["choices"]]
    np.testing.assert_allclose(row["loglikelihoods"], want, atol=1e-3)
    right += int(np.argmax(want)) == q["answer"]
    right_norm += int(np.argmax(np.array(want) / [len(c) for c in q["choices"]])) == q["answer"]
  assert (result["acc"], result["acc_norm"]) == (right / 4, right_norm / 4)
  assert os.path.getsize(os.path.join(tmp_path, "choice.png")) > 0
  assert "acc_norm" in capsys.readouterr().out


def test_encode_pair_moves_the_context_spaces_to_the_continuation():
  tok = kvjax.load_checkpoint("tiny-code").tokenizer  # bytes: one id per character
  whole, n = choice.encode_pair(tok, "x = ", "1")
  assert whole == tok.encode("x = 1", add_special_tokens=True)
  assert n == len(tok.encode("x =", add_special_tokens=True))


def test_a_bad_task_file_is_refused_by_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"context": "a", "choices": ["b"], "answer": 0}\n'
                  '{"context": "a", "choices": ["b"], "answer": 3}\n')
  with pytest.raises(ValueError, match="line 2"):
    choice.load_questions(str(path))
