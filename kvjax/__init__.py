"""kvjax: functional pure-state paged-KV LLM inference in JAX and Pallas.

Layers (imports only go down; tests/test_layering.py checks it):
  0  config, presets, pages, xla_options,           static config and named shapes, host page
     quant/symmetric, mesh_axes, invariance         ids, compiler options, mesh axis names,
                                                    the batch-invariant math switch
  1  layers, params, sampling, step_batch,           pure math, weight quantization, the
     logit_processors, attention/, quant/, moe/,    step metadata pytree, vLLM's penalties,
     layer_kinds                                    MoE experts, the layer-kind registry
  2  sharding, backends                              mesh + Megatron placement rules, capability
                                                    records (+ pallas_kernels, shard_map)
  3  caches/                                         KV cache layouts, one attend contract
  4  model, hybrid, learned_sinks                    the decoder and its layer kinds (GQA,
                                                    MLA, DeltaNet, sinks)
  5  steps, speculative                              jitted static-batch steps, drafting, verify
  6  serve_steps, generation, requests,              engine device programs, static generate,
     prefix_cache, state_snapshots, batching,        request vocabulary and checks, prefix
     validation                                      cache and hybrids' state snapshots, packing
  7  scheduler, request_pages, ledger, ledger_tp,    host policy and each request's pages,
     metrics, draft_policy, draft_choice, ngram,     accounting (one device, a mesh), n-gram
     constraints/, output_processor, engine_stats,   drafting, grammar matchers and masks,
     engine_dispatch                                 step outputs -> RequestOutputs, what an
                                                    engine reports of its scheduler, one row
                                                    group's device program
  8  engine_config, engine, router, warm_up,         the serving engine's request API, its
     engine_warm_up, engine_generate, kv_events     warm-up and one-shot generate,
                                                    data-parallel replicas (router), its
                                                    prefix cache's KV events
  9  api, weights/, tokenizer, hf_tokenizer,         public surface, loading, tokenizers
     constraints/vocabulary, chat_template,         and their vocabularies for the matcher,
     tool_calls, tool_formats, training/,           chat templates and tool calls in chat
     distributed, eval/                             text (the formats models write them in),
                                                    training (its corpora and its code
                                                    checks), multi-host start-up, quality evals
  10 server/, bench_client, bench_workloads,        HTTP serving, its load client and the
     diagnose                                       bench's workloads, C18 diagnosis
  11 cli, cli_bench, cli_chat, cli_checkpoint,       command lines and their shared
     cli_memory, cli_serve, cli_diagnose, cli_eval,  model flags
     __main__
Shapes everywhere use one dimension legend: docs/DIMENSIONS.md.
"""
from kvjax.api import Model, forward, generate, load_checkpoint
from kvjax.attention.variants import AttentionVariant, get_variant, register_variant
from kvjax.backends import Backend, get_backend
from kvjax.config import ModelConfig
from kvjax.presets import PRESETS, get_preset
from kvjax.engine import Engine
from kvjax.engine_config import EngineConfig
from kvjax.generation import GenerateResult
from kvjax.router import Router
from kvjax.sharding import make_mesh
from kvjax.tokenizer import ByteTokenizer

__all__ = ["Model", "ModelConfig", "PRESETS", "get_preset", "load_checkpoint", "forward",
           "generate", "GenerateResult", "ByteTokenizer", "Engine", "EngineConfig", "Backend",
           "get_backend", "make_mesh", "Router", "AttentionVariant", "register_variant",
           "get_variant"]
