"""kvjax.eval.needle: the prompt builder puts the needle at the asked depth within the
length, and the scoring counts exactly the replies that name the number."""
from __future__ import annotations

import pytest

from kvjax.eval import needle
from kvjax.runtime.generation import GenerateResult


class _CharTokenizer:
  """One id per character; a two-tag chat template."""
  eos_ids = (0,)

  def encode(self, text, add_special_tokens=True):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(map(chr, ids))

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "<u>" + messages[0]["content"] + "<a>"


def _sentences(prompt: dict, tok) -> list[str]:
  text = tok.decode(prompt["ids"])
  assert text.startswith("<u>") and text.endswith("\n\n" + needle.QUESTION + "<a>")
  return text[3:-len("\n\n" + needle.QUESTION + "<a>")].split(" ")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_needle_sits_at_its_depth_and_the_prompt_fills_the_length(depth):
  tok = _CharTokenizer()
  prompt = needle.build_prompt(tok, 1000, depth)
  n = prompt["num_filler"]
  text = " ".join(_sentences(prompt, tok))
  before = text.split(needle.NEEDLE)[0]
  assert text.count(needle.NEEDLE) == 1
  filler_before = sum(before.count(s) for s in needle.FILLER)
  assert filler_before == round(depth * n) == prompt["needle_index"]
  assert len(prompt["ids"]) <= 1000
  longer = len(" " + needle.FILLER[n % len(needle.FILLER)])
  assert len(prompt["ids"]) + longer > 1000  # one more filler sentence would not fit
  assert n > 10


def test_prompt_builder_refuses_what_cannot_fit():
  tok = _CharTokenizer()
  with pytest.raises(ValueError, match="depth must be in"):
    needle.build_prompt(tok, 1000, 1.5)
  with pytest.raises(ValueError, match="context_tokens 20"):
    needle.build_prompt(tok, 20, 0.5)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_completion_mode_is_plain_text_ending_in_the_cue(depth):
  """A base model's prompt: no chat template, the filler and needle, then the cue the
  number continues."""
  tok = _CharTokenizer()
  tok.apply_chat_template = None  # a base model's tokenizer cannot render a chat
  prompt = needle.build_prompt(tok, 1000, depth, mode="completion")
  text = tok.decode(prompt["ids"])
  assert "<u>" not in text and text.endswith("\n\n" + needle.COMPLETION_CUE)
  body = text[:-len("\n\n" + needle.COMPLETION_CUE)]
  before = body.split(needle.NEEDLE)[0]
  assert body.count(needle.NEEDLE) == 1
  assert sum(before.count(s) for s in needle.FILLER) == prompt["needle_index"] == round(
      depth * prompt["num_filler"])
  following = needle.FILLER[prompt["num_filler"] % len(needle.FILLER)]
  assert len(prompt["ids"]) <= 1000 < len(prompt["ids"]) + len(" " + following)
  with pytest.raises(ValueError, match="needle prompt mode must be one of"):
    needle.build_prompt(tok, 1000, depth, mode="instruct")


def test_scoring():
  assert needle.is_correct("73914")
  assert needle.is_correct("The secret number is 73914.")
  assert not needle.is_correct("739140")
  assert not needle.is_correct("7391")
  assert not needle.is_correct("I do not know.")


def test_accuracy_by_length_and_depth():
  tok = _CharTokenizer()

  class Engine:  # answers right only for prompts under 600 characters
    def generate(self, prompts, max_new_tokens, stop=None):
      assert stop == [0]
      return GenerateResult(tokens=[tok.encode("73914" if len(p) < 600 else "42")
                                    for p in prompts], stats={})

  out = needle.needle_accuracy(Engine(), tok, [500, 1000], [0.0, 1.0], progress=False)
  assert out["by_length"] == {"500": 1.0, "1000": 0.0}
  assert out["accuracy"] == 0.5
  assert [(r["context"], r["depth"], r["correct"]) for r in out["rows"]] == [
      (500, 0.0, True), (500, 1.0, True), (1000, 0.0, False), (1000, 1.0, False)]
