"""The serving engine: requests in, tokens out, over the runtime's device programs.

requests / validation (layer 6) are the request vocabulary and its checks; sched/ (7)
decides which rows and pages each step runs; metrics, stats and output_processor (7)
report, row_group and dispatch (7) pack and run one row group; config, device_state,
engine, warm_up, generate, adapters, router and kv_events (8) are the engine's public API,
its pages and drafts on the device, its warm-up, one-shot generation, LoRA adapters,
data-parallel replicas and KV events.  Imports runtime/, model/ and below; never text/,
weights/, server/ or cli/.
"""
