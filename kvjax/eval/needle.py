"""Needle retrieval (claim C16): a fact planted at a depth of long filler, asked for at the end.

A prompt holds FILLER sentences (a fixed cycle of plain statements) with NEEDLE
inserted before filler sentence round(depth * n) (depth 0: first, 1: last, after
every filler sentence), then a blank line and the question, in one of two modes
(MODES): "chat", the model's chat template around that one user message (QUESTION;
instruct models), or "completion", the plain text followed by COMPLETION_CUE for the
model to continue (base models, which have no chat template).  n is the most
sentences whose whole prompt fits `context_tokens` tokens.  A reply is correct iff one
of its digit runs is exactly ANSWER.  A sliding window of W tokens per layer
cannot attend to a needle more than W tokens back in any one layer, though
stacked layers can relay it further (up to num_layers * W), which is what the
curve measures.
"""
from __future__ import annotations

import re
import sys
import time
from typing import Optional, Sequence

__all__ = ["NEEDLE", "ANSWER", "QUESTION", "COMPLETION_CUE", "FILLER", "MODES",
           "build_prompt", "is_correct", "needle_accuracy"]

ANSWER = "73914"
NEEDLE = f"The secret number is {ANSWER}."
QUESTION = "What is the secret number? Answer with the number only."
# A base model answers by continuing text: the cue ends where the number would start.
COMPLETION_CUE = "Question: What is the secret number?\nAnswer: The secret number is"
MODES = ("chat", "completion")
FILLER = (
    "The river runs past the old mill and on toward the sea.",
    "Farmers in the valley plant wheat in the spring and barley in the autumn.",
    "The library opens at nine and closes when the last reader leaves.",
    "A light wind moved the leaves of the tall oak trees.",
    "The market sells bread, cheese, apples and fresh fish on Saturdays.",
    "Children walked to school along the road beside the hills.",
    "The bridge was painted grey and repaired every few years.",
    "Clouds gathered over the mountains late in the afternoon.",
    "The baker rises early to light the ovens before dawn.",
    "Boats rested in the harbour while the tide went out.",
    "The town hall clock struck the hour across the square.",
    "Sheep grazed quietly on the green slopes above the village.",
)


def _message(num_filler: int, depth: float, mode: str) -> tuple[str, int]:
  """The text with num_filler sentences and the needle -> (text, needle index)."""
  sentences = [FILLER[i % len(FILLER)] for i in range(num_filler)]
  at = round(depth * num_filler)
  sentences.insert(at, NEEDLE)
  question = QUESTION if mode == "chat" else COMPLETION_CUE
  return " ".join(sentences) + "\n\n" + question, at


def _prompt_ids(tokenizer, num_filler: int, depth: float,
                mode: str) -> tuple[list[int], int]:
  text, at = _message(num_filler, depth, mode)
  if mode == "completion":  # the tokenizer's own BOS, as any plain prompt is encoded
    return tokenizer.encode(text), at
  chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
  return tokenizer.encode(chat, add_special_tokens=False), at


def build_prompt(tokenizer, context_tokens: int, depth: float, mode: str = "chat") -> dict:
  """The prompt of at most context_tokens ids with the needle at `depth` in `mode` (module
  doc) -> ids, filler sentence count, the needle's sentence index."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth!r}")
  if mode not in MODES:
    raise ValueError(f"needle prompt mode must be one of {MODES}, got {mode!r}")
  ids, _ = _prompt_ids(tokenizer, 0, depth, mode)
  if len(ids) > context_tokens:
    raise ValueError(f"context_tokens {context_tokens} is shorter than the needle and question "
                     f"alone ({len(ids)} tokens)")
  per_sentence = max(1, len(tokenizer.encode(" " + FILLER[0], add_special_tokens=False)))
  n = max(0, (context_tokens - len(ids)) // per_sentence)
  while n > 0 and len(_prompt_ids(tokenizer, n, depth, mode)[0]) > context_tokens:
    n -= 1
  while len(_prompt_ids(tokenizer, n + 1, depth, mode)[0]) <= context_tokens:
    n += 1
  ids, at = _prompt_ids(tokenizer, n, depth, mode)
  return dict(ids=ids, num_filler=n, needle_index=at)


def is_correct(reply: str, answer: str = ANSWER) -> bool:
  """True iff one digit run of the reply is exactly `answer`."""
  return answer in re.findall(r"\d+", reply)


def needle_accuracy(engine, tokenizer, lengths: Sequence[int], depths: Sequence[float], *,
                    max_new_tokens: int = 12, label: Optional[str] = None,
                    progress: bool = True, mode: str = "chat") -> dict:
  """Every (length, depth) prompt in `mode` through `engine` (greedy) -> accuracy overall
  and per length, and one row per prompt (its reply, correct or not)."""
  built = [(n, d, build_prompt(tokenizer, n, d, mode)) for n in lengths for d in depths]
  start = time.perf_counter()
  stop = list(getattr(tokenizer, "eos_ids", ())) or None
  result = engine.generate([b["ids"] for _, _, b in built], max_new_tokens, stop=stop)
  rows = []
  for (n, d, b), tokens in zip(built, result.tokens):
    reply = tokenizer.decode(tokens)
    rows.append(dict(context=n, depth=d, prompt_tokens=len(b["ids"]), reply=reply,
                     correct=is_correct(reply)))
    if progress:
      print(f"needle{'' if label is None else ' ' + label}: context {n} depth {d:.2f}: "
            f"{'ok' if rows[-1]['correct'] else 'miss'} {reply!r}", file=sys.stderr, flush=True)
  by_length = {str(n): sum(r["correct"] for r in rows if r["context"] == n) / len(depths)
               for n in lengths}
  return dict(accuracy=sum(r["correct"] for r in rows) / len(rows), by_length=by_length,
              seconds=time.perf_counter() - start, rows=rows)
