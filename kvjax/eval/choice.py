"""Multiple choice by loglikelihood (lm-evaluation-harness's multiple_choice output type).

A task file is JSON lines {"context": str, "choices": [str, ...], "answer": int}: what an
lm-eval multiple_choice task's doc_to_text, doc_to_choice and doc_to_target give
(kvjax/assets/eval_choice_tiny.jsonl is a tiny one).  A choice's loglikelihood is scored as
lm-eval's local-completions scores it against `kvjax serve`: the context's trailing spaces
move to the continuation, context + continuation is encoded whole (the tokenizer's special
tokens added, as the server encodes a text prompt), the continuation's ids are those past
the context's own encoding, and their log p given everything before them are summed, read
from the engine's prompt logprobs (Engine.add_request(prompt_logprobs=0): one request per
choice, its prefill chunks scored as they run).  acc picks the likeliest choice, acc_norm the
likeliest per character (lm-eval's two metrics).
"""
from __future__ import annotations

import json
from importlib import resources
from typing import Optional, Sequence

import numpy as np

__all__ = ["TINY_TASK", "load_questions", "encode_pair", "loglikelihoods", "evaluate"]

TINY_TASK = str(resources.files("kvjax") / "assets" / "eval_choice_tiny.jsonl")


def load_questions(path: Optional[str] = None, limit: Optional[int] = None) -> list[dict]:
  """The task file's questions (default: TINY_TASK), the first `limit` of them."""
  path = path or TINY_TASK
  with open(path) as f:
    questions = [json.loads(line) for line in f if line.strip()]
  for i, q in enumerate(questions):
    choices, answer = q.get("choices"), q.get("answer")
    if not (isinstance(q.get("context"), str) and isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)
            and isinstance(answer, int) and 0 <= answer < len(choices)):
      raise ValueError(f"{path} line {i + 1}: need {{'context': str, 'choices': [non-empty "
                       f"str, ...], 'answer': index of a choice}}, got {q!r:.200}")
  return questions[:limit]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
  """-> (ids of context + continuation, how many lead ids are the context's), as lm-eval
  splits a pair (module doc)."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = tokenizer.encode(context + continuation, add_special_tokens=True)
  num_context = len(tokenizer.encode(context, add_special_tokens=True))
  if not 0 < num_context < len(whole):
    raise ValueError(f"the continuation {continuation!r} adds no token to {context!r}")
  return whole, num_context


def loglikelihoods(engine, requests: Sequence[tuple[list[int], int]]) -> list[float]:
  """(ids, num_context) pairs -> the sum of log p of ids[num_context:], each given the ids
  before it (the engine's prompt logprobs; all requests queued at once)."""
  ids = [engine.add_request(whole, 1, prompt_logprobs=0) for whole, _ in requests]
  scores = {}
  for out in engine.stream():
    if out.prompt_logprobs is not None:
      scores[out.request_id] = out.prompt_logprobs
  return [sum(s.logprob for s in scores[rid][n:]) for rid, (_, n) in zip(ids, requests)]


def evaluate(engine, tokenizer, questions: Sequence[dict]) -> dict:
  """acc and acc_norm over `questions` (load_questions), each question's loglikelihoods."""
  pairs = [(q, c) for q in questions for c in q["choices"]]
  lls = iter(loglikelihoods(engine, [encode_pair(tokenizer, q["context"], c)
                                     for q, c in pairs]))
  rows = []
  for q in questions:
    ll = np.array([next(lls) for _ in q["choices"]])
    per_char = ll / np.array([len(c) for c in q["choices"]])
    rows.append(dict(context=q["context"], answer=q["answer"], loglikelihoods=ll.tolist(),
                     pick=int(ll.argmax()), pick_norm=int(per_char.argmax())))
  count = len(rows)
  return dict(count=count, acc=sum(r["pick"] == r["answer"] for r in rows) / count,
              acc_norm=sum(r["pick_norm"] == r["answer"] for r in rows) / count, rows=rows)
