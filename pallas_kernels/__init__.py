"""Pallas GPU kernels for kvjax, standalone (no import of kvjax).

Each module holds a kernel, its jitted wrapper and a pure-jnp reference (paged
attention's reference and input contract sit beside it, in their own file):
  paged_attention  ragged paged attention (decode, speculative verify, chunked
                   prefill in one call; GQA packing, int8 KV, position rules
                   (mask / score / kv_range: windows, sinks, ALiBi), soft cap,
                   batch-invariant split-K); paged_attention_reference
  spec_verify      fused rejection-sampling verification (claim C10)
  mosaic_decode    full-context paged decode in Mosaic GPU (Hopper: TMA page
                   ring, wgmma); Mosaic GPU is imported on first use
"""
from pallas_kernels.mosaic_decode import mosaic_paged_decode
from pallas_kernels.mosaic_decode import mosaic_paged_decode_reference
from pallas_kernels.paged_attention import ragged_paged_attention
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference
from pallas_kernels.spec_verify import greedy_verify
from pallas_kernels.spec_verify import rejection_sample
from pallas_kernels.spec_verify import rejection_sample_reference

__all__ = [
    "greedy_verify",
    "mosaic_paged_decode",
    "mosaic_paged_decode_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "rejection_sample",
    "rejection_sample_reference",
]
