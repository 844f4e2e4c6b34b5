"""GGUF tokenizers: the tokenizer and chat template a GGUF file's `tokenizer.*` metadata
describes, built with the `tokenizers` package (no transformers at run time).

A GGUF has no tokenizer.json; llama.cpp stores the vocabulary, merges, token types and
special ids as metadata. This builds the `tokenizers.Tokenizer` that transformers' GGUF
conversion builds (transformers/integrations/gguf/gguf_tokenizer_mapping.py), so that
`load_gguf_tokenizer(path)` encodes, decodes and renders chats exactly as
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` does:

  gpt2 (byte-level BPE: SmolLM2, Qwen2/3, Llama 3)  tokens spelled in GPT-2's byte alphabet
      (a token written as raw text is respelled from its UTF-8 bytes), the file's merges,
      a ByteLevel pre-tokenizer (GPT-2's regex, or the split regex `tokenizer.ggml.pre`
      names, for the names transformers knows) and decoder.
  llama (SentencePiece BPE: Llama 2, Mistral)  tokens as spelled, with byte fallback
      (<0xNN> tokens), a Metaspace pre-tokenizer prepending U+2581 to the first word; the
      file's merges, or merges recovered from the scores when the file has none.

Both: control tokens (token type 3) become special added tokens (except, in a byte-level
vocabulary, a "control" token not spelled in the byte alphabet: a llama.cpp mislabel,
skipped as transformers skips it); user-defined tokens (type 4) become plain added tokens
(matched whole in text, kept by skip_special_tokens); the bos / eos / unk / padding tokens
the ids name become special too, and so do the default specials of the transformers class
the conversion goes through (gpt2: <|endoftext|>; llama: <unk> <s> </s>) when the vocabulary
has them. One deliberate difference: transformers appends such a default as a new id when
the vocabulary lacks it (past the model's embedding rows); kvjax does not. encode adds BOS
when `tokenizer.ggml.add_bos_token` says so (default: true for llama, false for gpt2) and
EOS when `add_eos_token` says so.

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
from typing import Any, Optional, Union

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from kvjax.hf_tokenizer import HFTokenizer

__all__ = ["load_gguf_tokenizer", "byte_alphabet", "merges_from_scores"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 6 byte, ...)
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
# llama.cpp's end-of-generation token texts (llama-vocab.cpp), beside the eos/eot/eom ids.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
              "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
              "<|end_of_text|>", "<end_of_utterance>")

# Split regexes of the `tokenizer.ggml.pre` names transformers maps (the rest keep GPT-2's).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
  """GPT-2's byte -> character spelling: printable Latin-1 bytes stand for themselves, the
  other bytes take the characters from U+0100 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  spelling, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      spelling[byte] = chr(byte)
    else:
      spelling[byte] = chr(256 + extra)
      extra += 1
  return tuple(spelling[byte] for byte in range(256))


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
  vocabulary tokens, best score first (ties: the longer left part, then the longer right
  part, then the order found), as transformers' generate_merges recovers them."""
  ids = {token: index for index, token in enumerate(tokens)}
  merges = []
  for token, score in dict(zip(tokens, scores)).items():
    splits = [(token[:k], token[k:], score) for k in range(1, len(token))
              if token[:k] in ids and token[k:] in ids]
    merges += sorted(splits, key=lambda m: (ids[m[0]], ids[m[1]]))
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _open(path_or_reader: Union[str, os.PathLike, gguf.GGUFReader]) -> tuple[gguf.GGUFReader, str]:
  if isinstance(path_or_reader, gguf.GGUFReader):
    # The reader keeps no path; its memory map knows the file's.
    return path_or_reader, str(getattr(path_or_reader.data, "filename", None) or "GGUF file")
  path = os.fspath(path_or_reader)
  if not os.path.isfile(path):
    raise ValueError(f"GGUF path {path!r} is not a file")
  try:
    return gguf.GGUFReader(path, "r"), path
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


def _byte_level_tokenizer(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
  merges = _merges(meta)
  if merges is None:
    raise ValueError(f"{meta.source} has no tokenizer.ggml.merges, which a gpt2 (byte-level "
                     "BPE) tokenizer needs")
  spelling = byte_alphabet()
  alphabet = set(spelling)
  vocab = {token if set(token) <= alphabet else
           "".join(spelling[b] for b in token.encode("utf-8")): index
           for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
      end_of_word_suffix="", fuse_unk=False))
  split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", str))
  if split is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _sentencepiece_tokenizer(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
  merges = _merges(meta)
  if merges is None:
    scores = meta.array("tokenizer.ggml.scores", float, len(tokens))
    if scores is None:
      raise ValueError(f"{meta.source} has neither tokenizer.ggml.merges nor "
                       "tokenizer.ggml.scores, one of which a llama (SentencePiece) "
                       "tokenizer needs")
    merges = merges_from_scores(tokens, scores)
  vocab = {token: index for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                              fuse_unk=True, byte_fallback=True))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first", split=False)
  tokenizer.decoder = decoders.Sequence([
      decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
      decoders.Strip(content=" ", left=1)])
  return tokenizer


# tokenizer.ggml.model -> (builder, whether encode adds BOS when the file does not say, the
# special tokens of the transformers class the conversion goes through: GPT2Tokenizer's
# and LlamaTokenizer's defaults, which transformers makes special whatever the file says).
_BUILDERS = {"gpt2": (_byte_level_tokenizer, False, ("<|endoftext|>",)),
             "llama": (_sentencepiece_tokenizer, True, ("<unk>", "<s>", "</s>"))}


def _add_typed_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str],
                      token_types: Optional[list[int]], model: str) -> None:
  """The converting class's default specials, control tokens as special added tokens,
  user-defined ones as plain added tokens.

  A default special missing from the vocabulary is not added: transformers appends it
  as a new id (a Llama 3 GGUF gains an "<|endoftext|>" 128256), past the model's
  embedding rows, an id the model can never produce or read.
  """
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in _BUILDERS[model][2]
                                if tokenizer.token_to_id(t) is not None])
  if not token_types:
    return
  byte_level = model == "gpt2"
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
  tokenizer.ggml.model, missing merges (gpt2) or merges and scores (llama), metadata of the
  wrong type or length, a special id outside the vocabulary.
  """
  reader, source = _open(path_or_reader)
  meta = _Metadata(reader, source)
  model = meta.require("tokenizer.ggml.model", str)
  if model not in _BUILDERS:
    raise ValueError(f"tokenizer.ggml.model {model!r} in {source} is not supported; kvjax "
                     f"reads {sorted(_BUILDERS)}")
  build, add_bos_default, _ = _BUILDERS[model]
  tokens = meta.array("tokenizer.ggml.tokens", str)
  if not tokens:
    raise ValueError(f"{source} has no tokenizer.ggml.tokens")
  tokenizer = build(meta, tokens)
  _add_typed_tokens(tokenizer, tokens, meta.array("tokenizer.ggml.token_type", int, len(tokens)),
                    model)
  named = _named_special_tokens(meta, tokens)
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in named.values()])
  tokenizer.post_processor = _post_processor(
      tokenizer, named, meta.get("tokenizer.ggml.add_bos_token", bool, add_bos_default),
      meta.get("tokenizer.ggml.add_eos_token", bool, False))
  tokenizer.no_truncation()
  tokenizer.no_padding()
  # Both models are BPE, whose decode transformers v5 never cleans up.
  return HFTokenizer(tokenizer, named, _stop_ids(meta, tokenizer, tokens),
                     meta.get("tokenizer.chat_template", str), clean_up=False, source=source,
                     template_keys="tokenizer.chat_template metadata")
