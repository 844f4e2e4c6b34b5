// What qmatmul.cc hands a band kernel, and the band kernel compiled once per x86 ISA.
//
// qmatmul_kernel.cc is compiled once per target (-DKVJAX_ISA=Generic / Avx2 / Avx512
// with that target's -m flags, kvjax/quant/qmatmul.py's _KERNELS); qmatmul.cc, built
// for the baseline CPU, picks one at run time.  Every target does the same integer
// arithmetic and the same f32 fused multiply-adds in the same order, so their outputs
// are equal bit for bit.
#pragma once

#include <cstdint>

namespace kvjax_qmatmul {

constexpr int64_t kBlock = 32;  // activation rows per int8 scale (llama.cpp's Q8_0 block)
constexpr int64_t kColumns = 64;  // output columns per band block (a cache line of codes)

// y [R, O] = x [R, I] . dequantize(codes), x quantized to int8 in blocks: block s of
// weight group g holds input rows [g * group + s * kBlock, ...), at most kBlock and not
// past the group, x ~ xq * xscale there.
struct Problem {
  const int8_t* xq;  // [R, blocks, kBlock] activation codes, zero past a block's end
  const float* xscale;  // [R, blocks]
  const int32_t* xsum;  // [R, blocks] sum of each block's codes (int4's +8 bias)
  const int8_t* codes;  // [I, O], or [I / 2, O] with rows 2p / 2p + 1 in byte p's nibbles
  const float* scales;  // [G, O]
  const float* offsets;  // [G, O] or nullptr
  const float* group_sums;  // [R, G] f32 sums of x over each group (offsets only)
  float* y;  // [R, O]
  int64_t rows, in, out, group, groups, bits, blocks_per_group;
};

// Writes y[:, o_begin:o_end]; o_begin is a multiple of kColumns.
void RunBandGeneric(const Problem& p, int64_t o_begin, int64_t o_end);
void RunBandAvx2(const Problem& p, int64_t o_begin, int64_t o_end);
void RunBandAvx512(const Problem& p, int64_t o_begin, int64_t o_end);

}  // namespace kvjax_qmatmul
