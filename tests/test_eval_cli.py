"""`python -m kvjax eval`: the options reach the task, JSON + PNG land in --out-dir, and a
model that cannot run a task is a clear error (exit 2)."""
from __future__ import annotations

import json
import os

import pytest

from kvjax import cli


@pytest.mark.slow  # over a minute on 2 busy cores (the whole text tokenized, two compiles)
def test_eval_perplexity_writes_json_and_png(tmp_path, capsys):
  out_dir = str(tmp_path)
  code = cli.main(["eval", "perplexity", "--checkpoint", "tiny-code", "--kv-dtype", "int8",
                   "--sliding-window", "32", "--page-size", "8", "--context", "64",
                   "--chunk", "32", "--decode-tokens", "4", "--max-tokens", "128",
                   "--batch-size", "2", "--out-dir", out_dir])
  assert code == 0
  with open(os.path.join(out_dir, "perplexity.json")) as f:
    saved = json.load(f)
  result = saved["result"]
  assert (result["kv_dtype"], result["sliding_window"], result["page_size"]) == ("int8", 32, 8)
  assert (result["tokens"], result["context"], result["decode_tokens"]) == (128, 64, 4)
  assert result["bytes"] == 128  # the byte tokenizer: one byte per token
  assert saved["options"]["checkpoint"] == "tiny-code" and saved["device"]
  assert os.path.getsize(os.path.join(out_dir, "perplexity.png")) > 0
  assert "bits/byte" in capsys.readouterr().out


def test_eval_needs_a_tokenizer(tmp_path, capsys):
  code = cli.main(["eval", "perplexity", "--checkpoint", "tiny", "--out-dir", str(tmp_path)])
  assert code == 2
  assert "has no tokenizer" in capsys.readouterr().err
