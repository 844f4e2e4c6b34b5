"""The model: its config and presets, parameters, the math of one layer, and the decoder.

config / presets / invariance (layer 0) describe a model and switch the batch-invariant
math; layers / params / layer_kinds (1) are pure math and the layer-kind registry;
decoder / hybrid / learned_sinks (4) run the layers over a KV cache (kvjax/caches/,
layer 3), so they may import attention/, caches/ and parallel/sharding, never the
runtime, the engine or anything above.
"""
