"""Mixture-of-experts MLP blocks (Mixtral, Qwen3-MoE, DeepSeek-V3): params, routing,
the expert matmuls and the block that combines them (kvjax/moe/block.py)."""
