"""Quantization: symmetric integer codes (symmetric.py), affine ones for KIVI's int4 KV
(affine.py), quantized weights (qweight.py) and the CPU custom call that multiplies
decode rows by their codes (qmatmul.py)."""
