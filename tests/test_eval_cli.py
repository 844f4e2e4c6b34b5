"""`python -m kvjax eval`: the options reach the task, JSON + PNG land in --out-dir, and a
model that cannot run a task is a clear error (exit 2)."""
from __future__ import annotations

import json
import os

import pytest

from kvjax.cli import main as cli


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


_BAD_ARGS = [  # (flags, what the error names)
    (["--context", "0"], "--context"), (["--chunk", "0"], "--chunk"),
    (["--decode-tokens", "-1"], "--decode-tokens"),
    (["--context", "64", "--decode-tokens", "65"], "--decode-tokens"),
    (["--batch-size", "0"], "--batch-size"), (["--max-tokens", "0"], "--max-tokens"),
    (["--limit", "0"], "--limit"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--timeout", "-1"], "--timeout"), (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"), (["--lengths", "512,0"], "--lengths"),
    (["--depths", "0,1.5"], "--depths"), (["--sliding-window", "0"], "--sliding-window"),
    (["--page-size", "0"], "--page-size"), (["--num-pages", "1"], "--num-pages"),
    (["--max-model-len", "0"], "--max-model-len"),
]


@pytest.mark.parametrize("task", ["perplexity", "humaneval", "needle"])
@pytest.mark.parametrize("flags,named", _BAD_ARGS)
def test_a_bad_argument_fails_before_any_model_loads(task, flags, named, tmp_path,
                                                     monkeypatch, capsys):
  import kvjax

  def no_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")

  monkeypatch.setattr(kvjax, "load_checkpoint", no_load)
  code = cli.main(["eval", task, "--checkpoint", "tiny-code", "--out-dir", str(tmp_path),
                   *flags])
  assert code == 2
  err = capsys.readouterr().err
  assert named in err and flags[-1].split(",")[-1] in err


def test_an_unwritable_out_dir_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
  import kvjax

  def no_load(*args, **kwargs):
    raise AssertionError("a model was loaded before --out-dir was checked")

  monkeypatch.setattr(kvjax, "load_checkpoint", no_load)
  blocker = tmp_path / "a-file"
  blocker.write_text("not a directory")
  out_dir = str(blocker / "results")
  code = cli.main(["eval", "perplexity", "--out-dir", out_dir])
  assert code == 2
  err = capsys.readouterr().err
  assert "--out-dir" in err and out_dir in err


def test_eval_attention_reaches_the_model_every_task_runs(tmp_path, monkeypatch):
  from kvjax.attention.variants import sliding_window
  from kvjax.eval import perplexity

  models = []

  def capture(model, *args, **kwargs):
    models.append(model)
    raise ValueError("captured")

  monkeypatch.setattr(perplexity, "perplexity", capture)
  code = cli.main(["eval", "perplexity", "--checkpoint", "tiny-code", "--attention", "window8",
                   "--out-dir", str(tmp_path)])
  assert code == 2
  assert models[0].config.attention_variant == sliding_window(8)


@pytest.mark.parametrize("template, mode", [(True, "chat"), (False, "completion")])
def test_prompt_mode_auto_is_completion_for_a_model_without_a_chat_template(
    template, mode, tmp_path, monkeypatch):
  import kvjax
  from kvjax.eval import needle

  load = kvjax.load_checkpoint

  def load_base(*args, **kwargs):  # tiny-code's byte tokenizer, its template taken away
    model = load(*args, **kwargs)
    if not template:
      model.tokenizer.chat_template = None
    return model

  modes = []

  def capture(engine, tokenizer, lengths, depths, mode):
    modes.append(mode)
    raise ValueError("captured")

  monkeypatch.setattr(kvjax, "load_checkpoint", load_base)
  monkeypatch.setattr(needle, "needle_accuracy", capture)
  code = cli.main(["eval", "needle", "--checkpoint", "tiny-code", "--lengths", "64",
                   "--out-dir", str(tmp_path)])
  assert code == 2 and modes == [mode]
