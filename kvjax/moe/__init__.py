"""Mixture-of-experts MLP blocks (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss): params,
routing, the expert matmuls (the grouped path's ragged matmul chosen by name:
kvjax/moe/grouped_matmul.py) and the block that combines them (kvjax/moe/block.py)."""
