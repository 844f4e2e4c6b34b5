"""The BPE models a GGUF vocabulary describes: byte-level (llama.cpp's `gpt2`) and the
SentencePiece family (`llama`, with Phi-3's and Gemma's variants), each built as the
transformers class that transformers' GGUF conversion hands it to builds it (GPT2Tokenizer,
LlamaTokenizer, GemmaTokenizer; transformers/integrations/gguf/gguf_tokenizer_mapping.py).

Every builder takes plain metadata (tokens; merges as pairs or None; scores or None; the
`tokenizer.ggml.pre` name; the file's name for errors) and returns a `tokenizers.Tokenizer`
with model, normalizer, pre-tokenizer and decoder set; kvjax.weights.gguf_tokenizer adds
the special tokens and the post-processor.
"""
from __future__ import annotations

import functools
from typing import Optional

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

__all__ = ["byte_alphabet", "merges_from_scores", "byte_level_bpe", "llama_bpe", "phi3_bpe",
           "gemma_bpe"]

Merges = Optional[list[tuple[str, str]]]

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
  printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
  spelling, extra = [], 0
  for byte in range(256):
    if byte in printable:
      spelling.append(chr(byte))
    else:
      spelling.append(chr(256 + extra))
      extra += 1
  return tuple(spelling)


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


def byte_level_bpe(tokens: list[str], merges: Merges, scores: Optional[list[float]],
                   pre: Optional[str], source: str) -> tokenizers.Tokenizer:
  """GPT2Tokenizer's: tokens in the byte alphabet (a token stored as raw text respelled
  from its UTF-8 bytes), the file's merges, GPT-2's regex or the one `pre` names."""
  if merges is None:
    raise ValueError(f"{source} has no tokenizer.ggml.merges, which a gpt2 (byte-level "
                     "BPE) tokenizer needs")
  spelling = byte_alphabet()
  alphabet = set(spelling)
  vocab = {token if set(token) <= alphabet else
           "".join(spelling[b] for b in token.encode("utf-8")): index
           for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
      end_of_word_suffix="", fuse_unk=False))
  split = _PRE_SPLITS.get(pre)
  if split is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _sentencepiece_merges(tokens: list[str], merges: Merges, scores: Optional[list[float]],
                          source: str) -> list[tuple[str, str]]:
  if merges is not None:
    return merges
  if scores is None:
    raise ValueError(f"{source} has neither tokenizer.ggml.merges nor tokenizer.ggml.scores, "
                     "one of which a SentencePiece tokenizer needs")
  return merges_from_scores(tokens, scores)


def _sentencepiece_decoders() -> list[decoders.Decoder]:
  return [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]


def llama_bpe(tokens: list[str], merges: Merges, scores: Optional[list[float]],
              pre: Optional[str], source: str) -> tokenizers.Tokenizer:
  """LlamaTokenizer's: byte fallback, U+2581 prepended to the first word (Metaspace) and
  one leading space stripped on decode; merges from the file or from the scores."""
  vocab = {token: index for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=_sentencepiece_merges(tokens, merges, scores, source), dropout=None,
      fuse_unk=True, byte_fallback=True))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first", split=False)
  tokenizer.decoder = decoders.Sequence([*_sentencepiece_decoders(),
                                         decoders.Strip(content=" ", left=1)])
  return tokenizer


def phi3_bpe(tokens: list[str], merges: Merges, scores: Optional[list[float]],
             pre: Optional[str], source: str) -> tokenizers.Tokenizer:
  """Llama's, with the prefix U+2581 from a normalizer (Phi-3's tokenizer.json shape): text
  that starts with a space keeps one more U+2581 than Metaspace would give it."""
  tokenizer = llama_bpe(tokens, merges, scores, pre, source)
  tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
  tokenizer.pre_tokenizer = None
  return tokenizer


def gemma_bpe(tokens: list[str], merges: Merges, scores: Optional[list[float]],
              pre: Optional[str], source: str, respell: bool) -> tokenizers.Tokenizer:
  """GemmaTokenizer's: spaces become U+2581 (no prefix), split after each, byte fallback.

  Gemma 1-3 files (`respell`) store a token of two or more spaces as real spaces, and list
  no merges; their merge order is the vocabulary order, not the scores.
  """
  if respell:
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    scores = [-float(index) for index in range(len(tokens))]
  vocab = {token: index for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=_sentencepiece_merges(tokens, merges, scores, source), dropout=None,
      fuse_unk=True, unk_token="<unk>", byte_fallback=True))
  tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
  tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tokenizer.decoder = decoders.Sequence(_sentencepiece_decoders())
  return tokenizer
