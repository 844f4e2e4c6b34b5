"""kvjax.eval's sinks + window variant ("sinks<S>-window<W>", the streaming KV layout):
its paged perplexity equals transformers' float64 forward of the same tiny random model
under a sinks + window mask written from the definition (key j visible to the query at p
iff j <= p and (j < S or j > p - W)), and it is neither full attention nor a plain window."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvjax.eval import perplexity, variant
from tests.test_eval_perplexity import CONTEXT, _kvjax_nats, token_ids  # noqa: F401 (fixture)

SINKS, WINDOW = 4, 12


def _hf_sinks_window_nats(hf_model, windows: np.ndarray) -> np.ndarray:
  """-log p of windows[:, 1:] from transformers in float64, attention masked to the sinks
  and the window by an additive 4D mask -> [S, C]."""
  model = hf_model.to(torch.float64)
  p = np.arange(CONTEXT)[:, None]
  j = np.arange(CONTEXT)[None, :]
  visible = (j <= p) & ((j < SINKS) | (j > p - WINDOW))
  mask = torch.zeros(visible.shape, dtype=torch.float64)
  mask[~torch.tensor(visible)] = torch.finfo(torch.float64).min
  mask = mask[None, None].expand(len(windows), 1, CONTEXT, CONTEXT)
  with torch.no_grad():
    logits = model(torch.tensor(windows[:, :-1], dtype=torch.long), attention_mask=mask).logits
  logp = torch.log_softmax(logits, dim=-1)
  targets = torch.tensor(windows[:, 1:], dtype=torch.long)
  return -torch.gather(logp, -1, targets[..., None])[..., 0].numpy()


def test_sinks_window_perplexity_matches_a_masked_float64_forward(hf_pair, token_ids):
  hf_model, model = hf_pair("llama")
  options = variant.parse_variant(f"sinks{SINKS}-window{WINDOW}")
  assert options == dict(weight_dtype=None, kv_dtype=f"sinks{SINKS}-window{WINDOW}",
                         sliding_window=None)
  windows = perplexity.segments(token_ids, CONTEXT)
  ours = _kvjax_nats(model, windows, kv_dtype=options["kv_dtype"])
  theirs = _hf_sinks_window_nats(hf_model, windows)
  np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3)  # every chunk and step
  full = _kvjax_nats(model, windows)
  plain = _kvjax_nats(variant.with_window(model, SINKS + WINDOW), windows)
  np.testing.assert_allclose(ours[:, :SINKS + WINDOW], full[:, :SINKS + WINDOW], rtol=1e-4, atol=1e-4)
  assert np.abs(ours[:, SINKS + WINDOW:] - full[:, SINKS + WINDOW:]).max() > 0.01
  assert np.abs(ours[:, SINKS + WINDOW:] - plain[:, SINKS + WINDOW:]).max() > 0.01


def test_the_report_names_the_layout_and_its_float_bytes(hf_pair, token_ids):
  _, model = hf_pair("llama")
  name = variant.parse_variant(f"sinks{SINKS}-window{WINDOW}")["kv_dtype"]
  result = perplexity.perplexity(model, token_ids, context=CONTEXT, chunk=16, decode_tokens=8,
                                 page_size=8, kv_dtype=name, batch_size=2, progress=False)
  assert result["kv_dtype"] == name and result["tokens"] == len(token_ids) - 1
  assert result["kv_bytes_per_token"] == variant.kv_bytes_per_token(model, None, 8)


@pytest.mark.parametrize("name", ["sinks4-window", "sinks0-window8", "sinks-4-window8"])
def test_bad_sinks_window_names_are_refused(name):
  with pytest.raises(ValueError, match=name):
    variant.parse_variant(name)
