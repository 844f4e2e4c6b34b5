"""GGUF tokenizers: the tokenizer and chat template a GGUF file's `tokenizer.*` metadata
describes, built with the `tokenizers` package (no transformers at run time).

A GGUF has no tokenizer.json; llama.cpp stores the vocabulary, merges, token types and
special ids as metadata. This builds the `tokenizers.Tokenizer` that transformers' GGUF
conversion builds (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so that
`load_gguf_tokenizer(path)` encodes, decodes and renders chats exactly as
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` does. `tokenizer.ggml.model` picks
the BPE model (kvjax.weights.gguf_vocab builds it):

  gpt2    byte-level BPE (SmolLM2, Qwen2/3, Llama 3), the split regex `tokenizer.ggml.pre`
          names (GPT-2's for names transformers does not map); encode adds no BOS unless
          the file says so
  llama   SentencePiece BPE with byte fallback (Llama 2, Mistral); Phi-3's and Gemma 1-3's
          variants by `general.architecture`; BOS unless the file says otherwise
  gemma4  Gemma's SentencePiece BPE; no BOS whatever the file says, as transformers
Any other model (t5's Unigram, rwkv, ...) is a ValueError naming it. As in transformers,
`tokenizer.ggml.add_space_prefix` is not read (the llama flavour always prefixes the first
word; llama.cpp honours the flag) and named templates (`tokenizer.chat_template.<name>`)
are not either.

Added tokens: control tokens (token type 3) become special (except, in a byte-level
vocabulary, a "control" token not spelled in the byte alphabet: a llama.cpp mislabel,
skipped as transformers skips it); user-defined tokens (type 4) become plain added tokens
(matched whole in text, kept by skip_special_tokens); the bos / eos / unk / padding tokens
the ids name become special, and so do the default specials of the transformers class the
conversion goes through (GPT2Tokenizer's <|endoftext|>, LlamaTokenizer's <unk> <s> </s>,
GemmaTokenizer's <unk> <bos> <eos> <pad> <mask>) when the vocabulary has them. The one
deliberate difference: transformers appends such a default as a new id when the vocabulary
lacks it (past the model's embedding rows, an id the model can never read or write); kvjax
does not. EOS is added when `tokenizer.ggml.add_eos_token` says so.

Stop ids: the eos id, then `eot_token_id` / `eom_token_id`, then every vocabulary token
whose text is one of llama.cpp's end-of-generation names (<|im_end|>, <|eot_id|>,
<|endoftext|>, <end_of_turn>, ...). llama.cpp stops on all of them, and a chat must stop at
its turn end even when the file's eos is the document end (Qwen2's eos is <|endoftext|>,
its turns end in <|im_end|>): a chat that never stops is worse than one that stops at a
marker the model only writes to end its turn.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Optional, Union

import gguf
import tokenizers
from tokenizers import AddedToken, processors

from kvjax.text.hf_tokenizer import HFTokenizer
from kvjax.weights.gguf_reader import GGUFArrayReader
from kvjax.weights.gguf_vocab import (byte_alphabet, byte_level_bpe, gemma_bpe, llama_bpe,
                                      phi3_bpe)

__all__ = ["load_gguf_tokenizer"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 6 byte, ...)
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
# llama.cpp's end-of-generation token texts (llama-vocab.cpp), beside the eos/eot/eom ids.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
              "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
              "<|end_of_text|>", "<end_of_utterance>")


def _open(path_or_reader: Union[str, os.PathLike, gguf.GGUFReader]) -> tuple[gguf.GGUFReader, str]:
  if isinstance(path_or_reader, gguf.GGUFReader):
    # The reader keeps no path; its memory map knows the file's.
    return path_or_reader, str(getattr(path_or_reader.data, "filename", None) or "GGUF file")
  path = os.fspath(path_or_reader)
  if not os.path.isfile(path):
    raise ValueError(f"GGUF path {path!r} is not a file")
  try:
    return GGUFArrayReader(path, "r"), path
  except Exception as e:  # the reader raises ValueError, struct.error, ... on a bad file
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


class _Metadata:
  """Typed access to a GGUF's key-value fields; errors name the file and the key."""

  def __init__(self, reader: gguf.GGUFReader, source: str):
    self._fields, self.source = reader.fields, source

  def get(self, key: str, kind: type, default: Any = None) -> Any:
    field = self._fields.get(key)
    if field is None:
      return default
    value = field.contents()
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
      raise ValueError(f"{key} in {self.source} must be a {kind.__name__}, got {value!r}")
    return value

  def require(self, key: str, kind: type) -> Any:
    value = self.get(key, kind)
    if value is None:
      raise ValueError(f"{self.source} has no {key}")
    return value

  def array(self, key: str, kind: type, length: Optional[int] = None) -> Optional[list]:
    """A list-valued field with `kind` items (`length` of them, when given), or None."""
    value = self.get(key, list)
    if value is None:
      return None
    if kind is float:
      value = [float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    bad = next((i for i, v in enumerate(value) if not isinstance(v, kind)
                or (kind is int and isinstance(v, bool))), None)
    if bad is not None:
      raise ValueError(f"{key}[{bad}] in {self.source} must be a {kind.__name__}, "
                       f"got {value[bad]!r}")
    if length is not None and len(value) != length:
      raise ValueError(f"{key} in {self.source} has {len(value)} entries for {length} tokens")
    return value


def _merges(meta: _Metadata) -> Optional[list[tuple[str, str]]]:
  merges = meta.array("tokenizer.ggml.merges", str)
  if merges is None:
    return None
  pairs = [tuple(merge.split(" ")) for merge in merges]
  bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
  if bad is not None:
    raise ValueError(f"tokenizer.ggml.merges[{bad}] in {meta.source} must be two tokens "
                     f"separated by one space, got {merges[bad]!r}")
  return pairs


class _Flavour(NamedTuple):
  """How one kind of GGUF vocabulary becomes a tokenizer."""

  build: Callable[..., tokenizers.Tokenizer]  # a kvjax.weights.gguf_vocab builder
  add_bos: bool  # whether encode adds BOS when the file does not say
  class_specials: tuple[str, ...]  # the transformers class's default special tokens
  bos_from_file: bool = True  # False: `add_bos` whatever the file says
  byte_level: bool = False  # tokens spelled in GPT-2's byte alphabet


_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
_GEMMA_SPECIALS = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")
_GEMMA = _Flavour(functools.partial(gemma_bpe, respell=True), True, _GEMMA_SPECIALS)
# tokenizer.ggml.model -> flavour, and a `llama` (SentencePiece) one by architecture.
_FLAVOURS = {
    "gpt2": _Flavour(byte_level_bpe, False, ("<|endoftext|>",), byte_level=True),
    "llama": _Flavour(llama_bpe, True, _LLAMA_SPECIALS),
    # Gemma 4 sets add_bos_token, but its chat template writes <bos> itself: transformers
    # follows the reference tokenizer and adds none (llama.cpp adds one).
    "gemma4": _Flavour(functools.partial(gemma_bpe, respell=False), False, _GEMMA_SPECIALS,
                       bos_from_file=False),
}
_LLAMA_BY_ARCHITECTURE = {"gemma": _GEMMA, "gemma2": _GEMMA, "gemma3": _GEMMA,
                          "phi3": _Flavour(phi3_bpe, True, _LLAMA_SPECIALS)}


def _flavour(meta: _Metadata) -> _Flavour:
  model = meta.require("tokenizer.ggml.model", str)
  architecture = meta.get("general.architecture", str)
  if model == "llama" and architecture in _LLAMA_BY_ARCHITECTURE:
    return _LLAMA_BY_ARCHITECTURE[architecture]
  if model not in _FLAVOURS:
    raise ValueError(f"tokenizer.ggml.model {model!r} in {meta.source} is not supported; "
                     f"kvjax reads {sorted(_FLAVOURS)}")
  return _FLAVOURS[model]


def _add_typed_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str],
                      token_types: Optional[list[int]], class_specials: tuple[str, ...],
                      byte_level: bool) -> None:
  """The converting class's default specials (those in the vocabulary: transformers would
  append a Llama 3 GGUF's missing "<|endoftext|>" as id 128256), control tokens as special
  added tokens, user-defined ones as plain added tokens."""
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in class_specials if tokenizer.token_to_id(t) is not None])
  if not token_types:
    return
  alphabet = set(byte_alphabet())
  control = [AddedToken(token, normalized=False, special=True)
             for token, kind in zip(tokens, token_types)
             if kind == _CONTROL and (not byte_level or set(token) <= alphabet)]
  tokenizer.add_special_tokens(control)
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in zip(tokens, token_types)
                        if kind == _USER_DEFINED and token in vocab])


def _named_special_tokens(meta: _Metadata, tokens: list[str]) -> dict[str, str]:
  named = {}
  for name, key in _SPECIAL_IDS:
    index = meta.get(f"tokenizer.ggml.{key}", int)
    if index is None:
      continue
    if not 0 <= index < len(tokens):
      raise ValueError(f"tokenizer.ggml.{key} in {meta.source} must be an id in "
                       f"[0, {len(tokens)}), got {index}")
    named[name] = tokens[index]
  return named


def _post_processor(tokenizer: tokenizers.Tokenizer, named: dict[str, str], add_bos: bool,
                    add_eos: bool) -> processors.TemplateProcessing:
  """transformers' update_post_processor: BOS / EOS around each sequence as asked."""
  bos = named.get("bos_token") if add_bos else None
  eos = named.get("eos_token") if add_eos else None
  single = [*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])]
  pair = [*single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])]
  specials = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
  try:
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(specials)))
  except Exception as e:  # the template's pieces are "text:type_id"; a ':' in text breaks it
    raise ValueError(f"cannot add BOS {bos!r} / EOS {eos!r} around a sequence: {e}") from e


def _stop_ids(meta: _Metadata, tokenizer: tokenizers.Tokenizer, tokens: list[str]
              ) -> tuple[int, ...]:
  ids = [meta.get(f"tokenizer.ggml.{key}", int)
         for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
  for index in ids:
    if index is not None and not 0 <= index < len(tokens):
      raise ValueError(f"a stop id in {meta.source} must be in [0, {len(tokens)}), got {index}")
  ids += [tokenizer.token_to_id(text) for text in _EOG_TEXTS]
  return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_gguf_tokenizer(path_or_reader: Union[str, os.PathLike, gguf.GGUFReader]) -> HFTokenizer:
  """The tokenizer of a GGUF file (a path, or a GGUFReader already open on it).

  ValueError names the file and the problem: not a GGUF, no or an unsupported
  tokenizer.ggml.model, missing merges (gpt2) or merges and scores (SentencePiece),
  metadata of the wrong type or length, a special id outside the vocabulary.
  """
  reader, source = _open(path_or_reader)
  meta = _Metadata(reader, source)
  flavour = _flavour(meta)
  tokens = meta.array("tokenizer.ggml.tokens", str)
  if not tokens:
    raise ValueError(f"{source} has no tokenizer.ggml.tokens")
  tokenizer = flavour.build(tokens, _merges(meta),
                            meta.array("tokenizer.ggml.scores", float, len(tokens)),
                            meta.get("tokenizer.ggml.pre", str), source)
  _add_typed_tokens(tokenizer, tokens, meta.array("tokenizer.ggml.token_type", int, len(tokens)),
                    flavour.class_specials, flavour.byte_level)
  named = _named_special_tokens(meta, tokens)
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in named.values()])
  add_bos = flavour.add_bos
  if flavour.bos_from_file:
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool, add_bos)
  tokenizer.post_processor = _post_processor(
      tokenizer, named, add_bos, meta.get("tokenizer.ggml.add_eos_token", bool, False))
  tokenizer.no_truncation()
  tokenizer.no_padding()
  # Every flavour is a BPE model, whose decode transformers v5 never cleans up.
  return HFTokenizer(tokenizer, named, _stop_ids(meta, tokenizer, tokens),
                     meta.get("tokenizer.chat_template", str), clean_up=False, source=source,
                     template_keys="tokenizer.chat_template metadata")
