"""kvjax: functional pure-state paged-KV LLM inference in JAX and Pallas.

Layers (imports only go down; tests/test_layering.py checks it):
  0  model/config, model/presets, model/invariance,       static config and named shapes,
     engine/sched/pages, runtime/xla_options,             host page ids, compiler options,
     quant/symmetric, parallel/mesh_axes                  mesh axis names, the
                                                         batch-invariant math switch
  1  model/layers, model/params, model/layer_kinds,       pure math, weight quantization,
     runtime/sampling, runtime/step_batch,                the step metadata pytree, vLLM's
     runtime/logit_processors, attention/, quant/, moe/,  penalties, MoE experts, layer kinds,
     lora/                                                LoRA adapter slots
  2  parallel/sharding, attention/backends                mesh + Megatron placement rules,
                                                         capability records (+ pallas_kernels)
  3  caches/                                              KV cache layouts, one attend contract
  4  model/decoder, model/hybrid, model/learned_sinks     the decoder and its layer kinds
  5  runtime/steps, runtime/speculative                   jitted static-batch steps, verify
  6  runtime/serve_steps, runtime/generation,             engine device programs, static
     engine/requests, engine/validation,                  generate, request vocabulary and
     engine/sched/prefix_cache,                           checks, prefix cache and hybrids'
     engine/sched/state_snapshots, engine/sched/batching  state snapshots, packing
  7  engine/sched/, parallel/ledger, parallel/ledger_tp,  host policy and each request's
     engine/metrics, engine/stats, constraints/,          pages, accounting, n-gram drafting,
     engine/output_processor, engine/dispatch,            grammar matchers, step outputs ->
     engine/row_group                                     RequestOutputs, one row group's run
  8  engine/config, engine/engine, engine/router,         the engine's request API, warm-up
     engine/warm_up, engine/generate, engine/kv_events,   and one-shot generate, data-parallel
     engine/adapters, engine/device_state                 replicas, prefix-cache KV events,
                                                         LoRA adapters, the device state
  9  api, weights/, text/, constraints/vocabulary,        public surface, loading, tokenizers,
     training/, parallel/distributed, eval/               chat and tool text, training,
                                                         multi-host start-up, quality evals
  10 server/                                              HTTP serving, its load bench
  11 cli/, __main__                                       command lines
Shapes everywhere use one dimension legend: docs/DIMENSIONS.md.
"""
from kvjax.api import Model, forward, generate, load_checkpoint
from kvjax.attention.backends import Backend, get_backend
from kvjax.attention.variants import AttentionVariant, get_variant, register_variant
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.engine.router import Router
from kvjax.model.config import ModelConfig
from kvjax.model.presets import PRESETS, get_preset
from kvjax.parallel.sharding import make_mesh
from kvjax.runtime.generation import GenerateResult
from kvjax.text.tokenizer import ByteTokenizer

__all__ = ["Model", "ModelConfig", "PRESETS", "get_preset", "load_checkpoint", "forward",
           "generate", "GenerateResult", "ByteTokenizer", "Engine", "EngineConfig", "Backend",
           "get_backend", "make_mesh", "Router", "AttentionVariant", "register_variant",
           "get_variant"]
