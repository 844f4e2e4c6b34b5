"""The public surface: load a model, run a full forward, generate.

`Model` bundles a static `ModelConfig` with its `Params` pytree; every function
here is a thin, validating wrapper over the pure functions in kvjax/model/decoder.py
and kvjax/runtime/generation.py.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.variants import with_attention
from kvjax.caches.layout import with_layout_variant
from kvjax.engine.validation import per_prompt_seeds, sampling_options
from kvjax.model.config import DTYPE_SHORT_NAMES, ModelConfig
from kvjax.model.decoder import forward as model_forward
from kvjax.model.params import Params, init_params
from kvjax.model.presets import PRESETS, get_preset
from kvjax.parallel import sharding
from kvjax.runtime import generation
from kvjax.runtime.sampling import SamplingParams
from kvjax.text.hf_tokenizer import load_tokenizer
from kvjax.text.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Model", "load_checkpoint", "forward", "generate", "resolve_dtype", "DTYPES"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Model:
  """A config, its weights and (when the checkpoint has one) its tokenizer.

  `tokenizer` satisfies kvjax.text.tokenizer.Tokenizer: the built-in ByteTokenizer for
  byte-vocabulary models (the default model, the tiny-code preset), the
  checkpoint's own for HF directories with a tokenizer.json, else None (text in
  or out is then an error, never a silent byte encoding).
  """

  config: ModelConfig
  params: Params
  dtype: jnp.dtype = jnp.float32
  tokenizer: Optional[Tokenizer] = dataclasses.field(default=None, compare=False)

  @property
  def mesh(self) -> Optional[jax.sharding.Mesh]:
    """The mesh the params live on (kvjax/parallel/sharding.py: tensor, expert parallel), None on
    one device."""
    return sharding.mesh_of(self.params)


def _byte_tokenizer(cfg: ModelConfig) -> Optional[ByteTokenizer]:
  """The byte tokenizer if cfg's vocabulary is the byte one (same size, BOS and EOS)."""
  byte = ByteTokenizer()
  same = (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (
      byte.vocab_size, byte.bos_id, byte.eos_id)
  return byte if same else None


def resolve_dtype(dtype) -> jnp.dtype:
  """'float32' | 'bfloat16' | 'float16' (or 'fp32', 'bf16', 'fp16', or the jnp dtype)
  -> jnp dtype."""
  long_names = {short: name for name, short in DTYPE_SHORT_NAMES.items()}
  dtype = long_names.get(dtype, dtype) if isinstance(dtype, str) else dtype
  for name, value in DTYPES.items():
    if dtype == name or dtype is value or (not isinstance(dtype, str) and
                                           np.dtype(dtype) == np.dtype(value)):
      return value
  raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)} "
                   f"(or {sorted(DTYPE_SHORT_NAMES.values())})")


def load_checkpoint(path_or_preset: Optional[str] = None, dtype="float32", *,
                    seed: int = 0, check_finite: bool = True,
                    available_bytes: Optional[int] = None,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    weight_dtype: Optional[str] = None) -> Model:
  """Load the built-in default model (no argument), a preset (random init from
  `seed`), an HF checkpoint directory, a kvjax-native checkpoint directory, a GGUF
  file (a path ending in .gguf) or a GGUF model installed as a package (a name in
  kvjax.weights.gguf.REGISTRY, such as 'smollm2-135m-instruct').

  `weight_dtype` None keeps float weights at `dtype`; "int8", "int4" (int4-g32) or
  another kvjax.weights.quantize scheme stores the projections as integer codes:
  a GGUF file's own blocks where they fit (kvjax/weights/gguf_quants.py), other
  formats through quantize_params after the float load.

  With a `mesh` (kvjax.make_mesh(tp=..., ep=...)) every tensor is placed shard by
  shard in the Megatron layout of kvjax/parallel/sharding.py, never whole on one device;
  kv heads that tp does not divide are replicated (model.config then counts the
  stored heads); with ep > 1 a MoE model's routed experts split ep ways
  (kvjax/moe/expert_parallel.py).

  Before allocating, the config's weights at `dtype` plus a minimal KV cache
  must fit the device's free memory (`available_bytes` overrides the measured
  figure; kvjax/weights/load_checks.py).  `check_finite` then refuses weights
  with a NaN or inf, naming the first such tensor.
  """
  from kvjax.weights import gguf, hf, hf_config, load_checks
  from kvjax.weights.checkpoint import DEFAULT_MODEL_DIR, read_config, restore
  from kvjax.weights.quantize import weight_scheme

  dtype = resolve_dtype(dtype)
  scheme = weight_scheme(weight_dtype)
  if scheme is not None and mesh is not None:
    raise ValueError(f"weight_dtype={weight_dtype!r} with a mesh is unsupported: quantized "
                     "weights are not placed by kvjax/parallel/sharding.py; pass mesh=None")
  gguf_file = None if path_or_preset in PRESETS else gguf.gguf_path(path_or_preset)
  if gguf_file is not None:
    reader = gguf.open_gguf(gguf_file)
    _check_fits(gguf.config_from_gguf(reader), dtype, available_bytes, mesh)
    cfg, params = gguf.load_gguf(reader, dtype, weight_dtype=scheme,
                                 check_finite=check_finite)
    if mesh is not None:
      params = sharding.shard_params(params, mesh)
    return _model(cfg, params, dtype, _gguf_tokenizer(reader) or _byte_tokenizer(cfg), mesh)
  if path_or_preset in PRESETS:
    cfg = get_preset(path_or_preset)
    _check_fits(cfg, dtype, available_bytes, mesh)
    init, key = functools.partial(init_params, cfg, dtype=dtype), jax.random.PRNGKey(seed)
    params = init(key) if mesh is None else sharding.init_on_mesh(init, mesh, key)
    if check_finite:
      load_checks.check_finite_tree(params, f"preset {path_or_preset}")
    return _model(cfg, _quantized(params, cfg, scheme), dtype, _byte_tokenizer(cfg), mesh)
  if path_or_preset is None:
    path_or_preset = DEFAULT_MODEL_DIR
    if not os.path.isdir(path_or_preset):
      raise FileNotFoundError(
          f"the built-in default model is missing at {path_or_preset}; train it with "
          "experiments/train.py or pass a preset name such as 'tiny'")
  if not os.path.isdir(path_or_preset):
    raise ValueError(f"{path_or_preset!r} is neither a preset ({sorted(PRESETS)}), a GGUF "
                     f"file or GGUF model name ({sorted(gguf.REGISTRY)}) nor a checkpoint "
                     "directory")
  if hf_config.is_hf_checkpoint(path_or_preset):
    _check_fits(hf_config.read_hf_config(path_or_preset)[1], dtype, available_bytes, mesh)
    cfg, params = hf.load_hf(path_or_preset, dtype, check_finite=check_finite, mesh=mesh)
    return _model(cfg, _quantized(params, cfg, scheme), dtype,
                  load_tokenizer(path_or_preset) or _byte_tokenizer(cfg), mesh)
  _check_fits(read_config(path_or_preset), dtype, available_bytes, mesh)
  cfg, params = restore(path_or_preset, dtype, mesh=mesh)
  if check_finite:
    load_checks.check_finite_tree(params, f"kvjax checkpoint {path_or_preset}")
  return _model(cfg, _quantized(params, cfg, scheme), dtype, _byte_tokenizer(cfg), mesh)


def _quantized(params: Params, cfg: ModelConfig, scheme: Optional[str]) -> Params:
  """A float load's params under weight_dtype's scheme (None: as loaded)."""
  from kvjax.weights.quantize import quantize_params

  return params if scheme is None else quantize_params(params, cfg, scheme)


def _gguf_tokenizer(reader) -> Optional[Tokenizer]:
  """The GGUF file's own tokenizer and chat template (kvjax/weights/gguf_tokenizer.py)."""
  from kvjax.weights.gguf_tokenizer import load_gguf_tokenizer

  if "tokenizer.ggml.model" not in reader.fields:  # a file of tensors alone: token ids only
    return None
  return load_gguf_tokenizer(reader)


def _check_fits(cfg: ModelConfig, dtype, available_bytes, mesh) -> None:
  """load_checks.check_fits on one device; on a mesh, this process's share of the
  weights (one device's slice each, kvjax.parallel.ledger_tp.weight_bytes_per_device) against
  its first device's free bytes (on CPU the fake devices share the host's memory)."""
  from kvjax.parallel import ledger_tp
  from kvjax.weights import load_checks

  if mesh is None:
    return load_checks.check_fits(cfg, dtype, available_bytes)
  sharding.check_mesh(cfg, mesh)
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if not local:
    raise ValueError(f"the mesh has no device of this process ({jax.process_index()})")
  free = available_bytes if available_bytes is not None else \
      load_checks.available_device_bytes(local[0])
  tp, ep = sharding.tp_size(mesh), sharding.ep_size(mesh)
  short = DTYPE_SHORT_NAMES[np.dtype(dtype).name]
  sharers = len(local) if local[0].platform == "cpu" else 1
  need = sharers * ledger_tp.weight_bytes_per_device(cfg, tp, short, ep)
  if free is not None and need > free:
    raise ValueError(f"{cfg.name} at {short} needs {need} bytes of weights per "
                     f"{'host' if sharers > 1 else 'device'} at tp={tp}, ep={ep}, {local[0]} "
                     f"has {free} free; use a larger tp or ep (kvjax memory --tp --ep)")


def _model(cfg: ModelConfig, params: Params, dtype, tokenizer, mesh) -> Model:
  """The loaded Model; on a mesh, with kv heads replicated where tp does not divide them."""
  if mesh is not None:
    cfg, params = sharding.replicate_kv_heads(cfg, params, mesh)
  return Model(cfg, params, dtype, tokenizer)


@functools.partial(jax.jit, static_argnames=("config",))
def _forward(params: Params, tokens: jax.Array, *, config: ModelConfig) -> jax.Array:
  return model_forward(params, config, tokens)


def forward(model: Model, tokens, *, attention=None) -> jax.Array:
  """int32 tokens [B, T] -> float32 logits [B, T, V]: full causal forward, no cache.
  `attention`: an attention variant (kvjax.AttentionVariant, a registered name, or a
  function (cfg, layer) -> variant or None) on top of the model's own attention."""
  model = with_attention(model, attention)
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be an integer array [B, T], got shape {tokens.shape} "
                     f"dtype {tokens.dtype}")
  bad = tokens[(tokens < 0) | (tokens >= model.config.vocab_size)]
  if bad.size:
    raise ValueError(f"token id {int(bad[0])} outside [0, vocab_size={model.config.vocab_size})")
  if tokens.shape[1] > model.config.max_position_embeddings:
    raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model context "
                     f"{model.config.max_position_embeddings}")
  return _forward(model.params, jnp.asarray(tokens, jnp.int32), config=model.config)


def generate(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: Union[int, Sequence[int]] = 0,
             cache: str = "paged", page_size: int = 16,
             backend: str = "reference",
             kv_dtype: Optional[str] = None, attention=None,
             **engine_options) -> generation.GenerateResult:
  """Generate `max_new_tokens` per prompt (fewer if EOS comes first).

  `seed` is one int for every prompt or one per prompt; a prompt's samples depend
  only on its own seed and tokens, never on the rest of the batch.  `kv_dtype`
  (None = model dtype, "bf16", "int8", "int4", ...; kvjax/caches/) is how the
  paged cache stores K/V, in the static batch and the Engine alike.  Engine
  keywords (speculative, num_draft, prefix_cache, prefix_match, max_num_seqs,
  max_num_batched_tokens, num_pages, ...; see kvjax.Engine) run the prompts
  through a one-shot continuous-batching Engine instead of the static batch.
  `attention`: an attention variant, as in `forward`, on every path.
  """
  model = with_layout_variant(with_attention(model, attention), kv_dtype)
  prompts = generation.validate_prompts(model.config, prompts, max_new_tokens)
  if cache not in generation.CACHE_KINDS:
    raise ValueError(f"unknown cache {cache!r}; use one of {generation.CACHE_KINDS}")
  if engine_options:
    if cache != "paged":
      raise ValueError(f"engine options {sorted(engine_options)} need cache='paged', "
                       f"got cache={cache!r}")
    from kvjax.engine.engine import Engine
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine_options.setdefault("max_num_seqs", min(len(prompts), 64))
    engine_options.setdefault("max_model_len", min(model.config.max_position_embeddings,
                                                   generation.next_pow2(longest)))
    engine = Engine(model, page_size=page_size, backend=backend, kv_dtype=kv_dtype,
                    **engine_options)
    return engine.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed)
  seeds = per_prompt_seeds(seed, len(prompts))
  for s in seeds:  # the Engine's checks: types, ranges, finite values
    sampling_options(model.config.vocab_size, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=s)
  sampling = SamplingParams.make(len(prompts), temperature=temperature, top_k=top_k,
                                 top_p=top_p, seeds=seeds)
  return generation.generate_static(model.params, model.config, prompts, max_new_tokens,
                                    sampling, cache=cache, page_size=page_size,
                                    backend=backend, dtype=model.dtype, kv_dtype=kv_dtype)
