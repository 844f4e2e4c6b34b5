"""Quantization: symmetric integer codes (symmetric.py) and quantized KV pages (kv.py)."""
