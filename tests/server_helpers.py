"""Shared pieces of the server tests: the served model and engine shapes, offline
oracles (kvjax.generate / a separate Engine, decoded with the tokenizer), SSE and
/metrics readers."""
from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

import kvjax

NAME = "tiny-code-test"
# One shape set for every server of the suite: 8 rows, 64-token chunks, 8-page tables.
CONFIG = kvjax.EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                            page_size=16)
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "# sort a list\ndef sort(xs):", "x = [1, 2, 3]\n"]


def ids_of(tok, text: str) -> list[int]:
  """A completions text prompt's ids: encoded with the tokenizer's special tokens (BOS)."""
  return tok.encode(text, add_special_tokens=True)


def chat_ids(tok, messages) -> list[int]:
  """A chat prompt's ids: the rendered template, no special tokens added (it writes its own)."""
  return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                    add_special_tokens=False)


def expected(tok, tokens: list[int], max_tokens: int, stops=()) -> dict:
  """OpenAI's answer for generated `tokens`: text cut before the first stop string,
  the completion tokens up to the one that completed it, the finish reason."""
  for k in range(1, len(tokens) + 1):
    text = tok.decode(tokens[:k])
    cuts = [text.find(s) for s in stops if s in text]
    if cuts:
      return {"text": text[:min(cuts)], "tokens": k, "finish_reason": "stop"}
  reason = "length" if len(tokens) == max_tokens and tokens[-1] not in tok.eos_ids else "stop"
  return {"text": tok.decode(tokens), "tokens": len(tokens), "finish_reason": reason}


def sse_events(lines) -> list:
  """`data:` payloads of an SSE body (its lines), JSON-decoded; [DONE] kept as a str."""
  out = []
  for line in lines:
    if line.startswith("data: "):
      payload = line[len("data: "):]
      out.append(payload if payload == "[DONE]" else json.loads(payload))
  return out


def scrape(root: str) -> dict:
  """/metrics parsed by prometheus_client's own parser -> {(name, labels): value}."""
  text = httpx.get(root + "/metrics", timeout=10).text
  return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
          s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
  return samples.get((name, tuple(sorted(labels.items()))), 0.0)
