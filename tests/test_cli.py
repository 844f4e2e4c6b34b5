"""`python -m kvjax generate` agrees with the library and fails cleanly on bad input."""
from __future__ import annotations

import json

import pytest

import kvjax
from kvjax.cli.main import main


def test_generate_json_matches_library(tiny_model, capsys):
  assert main(["generate", "--checkpoint", "tiny", "--prompt-ids", "1,2,3",
               "--max-new-tokens", "6", "--json"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["tokens"] == kvjax.generate(tiny_model, [[1, 2, 3]], 6).tokens[0]
  assert {"ttft_s", "tpot_s", "tokens_per_s", "kv_pages_used"} <= set(printed["stats"])
  # Timed after a warm-up call (compiles); --no-warmup times the first call.
  assert printed["stats"]["warmup_s"] > 0
  assert main(["generate", "--checkpoint", "tiny", "--prompt-ids", "1,2,3",
               "--max-new-tokens", "6", "--json", "--no-warmup"]) == 0
  assert json.loads(capsys.readouterr().out)["stats"]["warmup_s"] is None


def test_generate_bad_input_exits_2_with_the_value(capsys):
  assert main(["generate", "--checkpoint", "tiny", "--prompt-ids", "1,999"]) == 2
  assert "token id 999" in capsys.readouterr().err
  assert main(["generate", "--checkpoint", "nope"]) == 2
  assert "'nope'" in capsys.readouterr().err


def test_generate_text_uses_the_checkpoints_own_tokenizer(tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers
  import transformers

  from tests.hf_models import save_tiny

  save_tiny("llama", str(tmp_path))
  words = ["[UNK]", "<s>", "hello", "world", "def", "f", "():"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  oracle = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hello world def f():",
               "--max-new-tokens", "4", "--json", "--no-warmup"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["prompt_ids"] == oracle.encode("hello world def f():") == [2, 3, 4, 5, 6]
  assert printed["text"] == oracle.decode(printed["tokens"])


def test_generate_text_without_a_tokenizer_is_an_error_not_bytes(capsys):
  assert main(["generate", "--checkpoint", "tiny", "--prompt", "hello"]) == 2
  assert "has no tokenizer" in capsys.readouterr().err


def test_generate_chat_renders_the_template_and_prints_the_reply(capsys):
  assert main(["generate", "--checkpoint", "tiny-code", "--chat", "--system", "Be brief.",
               "--prompt", "hi", "--max-new-tokens", "4", "--json", "--no-warmup"]) == 0
  printed = json.loads(capsys.readouterr().out)
  tokenizer = kvjax.ByteTokenizer()
  assert printed["prompt_ids"] == tokenizer.encode(
      "<|system|>Be brief.\n<|user|>hi\n<|assistant|>")  # the byte template, by hand
  assert printed["text"] == tokenizer.decode(printed["tokens"])
  assert main(["generate", "--checkpoint", "tiny-code", "--chat", "--prompt-ids", "1,2"]) == 2
  assert "--chat: renders --prompt text" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_smollm2_prints_transformers_greedy_text(smollm2, smollm2_hf_tokenizer,
                                                         monkeypatch, capsys):
  import torch

  model, _, hf, _ = smollm2
  hf_tokenizer = smollm2_hf_tokenizer
  question = "What is the capital of France?"
  ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]
  with torch.no_grad():
    out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
  reply = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
  monkeypatch.setattr("kvjax.api.load_checkpoint", lambda *a, **k: model)  # loaded once
  assert main(["generate", "--checkpoint", "smollm2-135m-instruct", "--chat", "--prompt",
               question, "--max-new-tokens", "24", "--no-warmup"]) == 0
  printed = capsys.readouterr().out
  print(f"SmolLM2 generate --chat: {printed!r}")
  assert printed == reply + "\n"


@pytest.mark.parametrize("command", ["generate", "bench", "diagnose", "serve"])
def test_help_states_every_default_in_words_and_no_claim_ids(command, capsys):
  import argparse
  import re

  with pytest.raises(SystemExit):
    main([command, "--help"])
  text = capsys.readouterr().out
  assert not re.findall(r"\bC\d+\b", text), text  # claim ids mean nothing to a newcomer
  assert "(default: None)" not in text
  subparsers = argparse.ArgumentParser().add_subparsers()
  from kvjax.cli import main as cli
  from kvjax.cli import bench as cli_bench
  from kvjax.cli import diagnose as cli_diagnose
  from kvjax.cli import serve as cli_serve
  register = {"generate": cli._add_generate, "bench": cli_bench.add_parser,
              "diagnose": cli_diagnose.add_parser, "serve": cli_serve.add_parser}[command]
  register(subparsers)
  for action in subparsers.choices[command]._actions:
    if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
      continue  # flags: off unless given
    # "this or": one of a required pair, which has no default.
    assert "default" in action.help or "this or" in action.help, action.option_strings


CLI_TEST_WINDOW = kvjax.register_variant(
    kvjax.AttentionVariant("cli-test-window", mask=lambda q, k: q - k < 4))


@pytest.mark.parametrize("command", ["serve", "eval"])
def test_an_unknown_attention_name_exits_2_naming_it_and_the_known_ones(command, monkeypatch,
                                                                         capsys):
  monkeypatch.setattr(kvjax, "load_checkpoint", lambda *a, **k: pytest.fail("model loaded"))
  task = ["perplexity"] if command == "eval" else []
  with pytest.raises(SystemExit) as exited:
    main([command, *task, "--attention", "landmrak"])
  assert exited.value.code == 2
  err = capsys.readouterr().err
  assert "--attention" in err and "'landmrak'" in err
  assert "cli-test-window" in err and "sinks<S>-window<W>" in err


def test_serve_attention_reaches_the_engine_and_its_page_release(tiny_model, monkeypatch):
  from kvjax.attention.variants import sinks_window
  from kvjax.engine.sched.mask_release import MaskRelease
  import kvjax.server

  configs = []

  def capture(models, config, **kwargs):
    configs.append(config)
    raise ValueError("captured")

  monkeypatch.setattr(kvjax.server, "serve_in_thread", capture)
  assert main(["serve", "--checkpoint", "tiny", "--attention", "sinks4-window8",
               "--page-size", "4", "--max-model-len", "64"]) == 2
  engine = kvjax.Engine(tiny_model, configs[0])
  assert engine.model.config.attention_variant == sinks_window(4, 8)
  assert isinstance(engine.scheduler.page_release, MaskRelease)
