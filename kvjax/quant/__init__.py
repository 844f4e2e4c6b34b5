"""Quantization: symmetric integer codes (symmetric.py), quantized weights (qweight.py)
and the CPU custom call that multiplies decode rows by their codes (qmatmul.py)."""
