"""A kvjax tokenizer's vocabulary as llguidance sees it (built once per model).

The byte tokenizer (kvjax/text/tokenizer.py) is one token per byte plus its
specials; an HF tokenizer (kvjax/text/hf_tokenizer.py, also what a GGUF file's
metadata builds: kvjax/weights/gguf_tokenizer.py) hands llguidance its
tokenizer.json, from which llguidance reads every token's bytes.  The EOS is
the model's (`eos_token_id`): the id a finished grammar allows, and the one
that ends a request (kvjax/constraints/book.py).
"""
from __future__ import annotations

from typing import Optional

import llguidance

from kvjax.constraints.book import ConstraintBook
from kvjax.text.hf_tokenizer import HFTokenizer
from kvjax.text.tokenizer import ByteTokenizer

__all__ = ["constraint_vocabulary", "constraint_book"]


class _ByteTokens:
  """llguidance's TokenizerWrapper contract for the byte tokenizer."""

  def __init__(self, tokenizer: ByteTokenizer, eos_token_id: int):
    names = {tokenizer.bos_id: "bos_token", tokenizer.eos_id: "eos_token",
             tokenizer.pad_id: "pad_token"}
    specials = sorted(names)  # the ids right after the bytes
    self.tokens = [bytes([b]) for b in range(tokenizer.num_bytes)] + [
        tokenizer.special_tokens[names[i]].encode() for i in specials]
    self.special_token_ids = specials
    self.eos_token_id = eos_token_id
    self.bos_token_id = tokenizer.bos_id

  def __call__(self, text: bytes) -> list[int]:
    return list(text)


def constraint_vocabulary(tokenizer, eos_token_id: Optional[int]) -> llguidance.LLTokenizer:
  """tokenizer: a ByteTokenizer or HFTokenizer; eos_token_id: the model's EOS."""
  if eos_token_id is None:
    raise ValueError("constrained decoding needs the model's eos_token_id: a finished "
                     "grammar allows only EOS")
  if isinstance(tokenizer, ByteTokenizer):
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer,
                                                                          eos_token_id)))
  if isinstance(tokenizer, HFTokenizer):
    return llguidance.LLTokenizer(tokenizer.to_json(), eos_token=eos_token_id)
  raise ValueError(f"constrained decoding supports the byte and HF tokenizers, got "
                   f"{type(tokenizer).__name__}")


def constraint_book(tokenizer, config) -> ConstraintBook:
  """An engine's ConstraintBook for a model (config: its ModelConfig):
  `engine.constraints = constraint_book(model.tokenizer, model.config)`."""
  vocabulary = constraint_vocabulary(tokenizer, config.eos_token_id)
  return ConstraintBook(vocabulary, config.vocab_size, config.eos_token_id)
