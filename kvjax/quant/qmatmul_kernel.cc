// One target's band kernel (see qmatmul_kernel.h): -DKVJAX_ISA=Generic builds the
// portable loops only; Avx2 (-mavx2 -mfma) and Avx512 (-mavx512f -mavx512bw) add the
// integer-dot path llama.cpp uses at batch 1.  Per unit of 4 input rows the code rows
// are interleaved so each 32-bit lane holds one column's 4 codes; maddubs + madd with
// the 4 activation codes broadcast give that column's 4-term integer dot, summed in
// int32 over a block, then one f32 multiply-add by the block's activation scale.  int8
// codes go in as |c| against x's codes carrying c's sign (a pair sums to at most
// 2 * 128 * 127 < 2^15, so maddubs never saturates); int4 codes as c + 8 in [0, 15],
// minus 8 * sum(xq) per block after.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qmatmul_kernel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define KVJAX_PASTE(a, b) a##b
#define KVJAX_NAME(a, b) KVJAX_PASTE(a, b)

namespace kvjax_qmatmul {
namespace {

int64_t Blocks(const Problem& p) { return p.groups * p.blocks_per_group; }

// The signed code of input row i, output column o.
inline int32_t Code(const Problem& p, int64_t i, int64_t o) {
  const int8_t byte = p.codes[(p.bits == 8 ? i : i / 2) * p.out + o];
  if (p.bits == 8) return byte;
  if (i % 2) return byte >> 4;
  return static_cast<int8_t>(static_cast<uint8_t>(byte) << 4) >> 4;
}

// Group g on columns [o0, o1) (at most kColumns), every row, in plain loops: the
// generic target, and the ragged last columns of the vector ones.
void GroupColumns(const Problem& p, int64_t g, int64_t o0, int64_t o1) {
  const int64_t g_end = std::min(p.in, (g + 1) * p.group), width = o1 - o0;
  for (int64_t r = 0; r < p.rows; ++r) {
    float acc[kColumns] = {};
    for (int64_t begin = g * p.group, s = 0; begin < g_end; begin += kBlock, ++s) {
      const int64_t block = r * Blocks(p) + g * p.blocks_per_group + s;
      const int8_t* q = p.xq + block * kBlock;
      int32_t dot[kColumns] = {};
      for (int64_t i = begin; i < std::min(g_end, begin + kBlock); ++i) {
        for (int64_t o = 0; o < width; ++o) dot[o] += Code(p, i, o0 + o) * q[i - begin];
      }
      for (int64_t o = 0; o < width; ++o) {
        acc[o] = std::fma(static_cast<float>(dot[o]), p.xscale[block], acc[o]);
      }
    }
    for (int64_t o = 0; o < width; ++o) {
      float& y = p.y[r * p.out + o0 + o];
      y = std::fma(p.scales[g * p.out + o0 + o], acc[o], y);
      if (p.offsets != nullptr) {
        y = std::fma(p.offsets[g * p.out + o0 + o], p.group_sums[r * p.groups + g], y);
      }
    }
  }
}

#if defined(__AVX512BW__) || defined(__AVX2__)

#if defined(__AVX512BW__)
// 64 columns a code load; 16 f32 / int32 lanes a vector.
struct Vec {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t kWidth = 64;
  static I Load(const int8_t* p) { return _mm512_loadu_si512(p); }
  static I Set8(int8_t v) { return _mm512_set1_epi8(v); }
  static I Set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I Lo8(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
  static I Hi8(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
  static I Lo16(I a, I b) { return _mm512_unpacklo_epi16(a, b); }
  static I Hi16(I a, I b) { return _mm512_unpackhi_epi16(a, b); }
  static I And(I a, I b) { return _mm512_and_si512(a, b); }
  static I Xor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I Shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static I Add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I Sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I DotU(I u, I s) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
  static I DotS(I w, I s) {
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const I negated = _mm512_mask_sub_epi8(s, negative, _mm512_setzero_si512(), s);
    return DotU(_mm512_abs_epi8(w), negated);
  }
  static F Float(I a) { return _mm512_cvtepi32_ps(a); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F SetF(float v) { return _mm512_set1_ps(v); }
  static F LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreF(float* p, F v) { _mm512_storeu_ps(p, v); }
  // e[j]'s 128-bit lane m holds columns 16m + 4j .. + 3: a 4x4 transpose of lanes.
  static void Order(F e[4]) {
    const F t0 = _mm512_shuffle_f32x4(e[0], e[1], 0x44);
    const F t1 = _mm512_shuffle_f32x4(e[2], e[3], 0x44);
    const F t2 = _mm512_shuffle_f32x4(e[0], e[1], 0xEE);
    const F t3 = _mm512_shuffle_f32x4(e[2], e[3], 0xEE);
    e[0] = _mm512_shuffle_f32x4(t0, t1, 0x88);
    e[1] = _mm512_shuffle_f32x4(t0, t1, 0xDD);
    e[2] = _mm512_shuffle_f32x4(t2, t3, 0x88);
    e[3] = _mm512_shuffle_f32x4(t2, t3, 0xDD);
  }
};
#else
// 32 columns a code load; 8 f32 / int32 lanes a vector.
struct Vec {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t kWidth = 32;
  static I Load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I Set8(int8_t v) { return _mm256_set1_epi8(v); }
  static I Set32(int32_t v) { return _mm256_set1_epi32(v); }
  static I Lo8(I a, I b) { return _mm256_unpacklo_epi8(a, b); }
  static I Hi8(I a, I b) { return _mm256_unpackhi_epi8(a, b); }
  static I Lo16(I a, I b) { return _mm256_unpacklo_epi16(a, b); }
  static I Hi16(I a, I b) { return _mm256_unpackhi_epi16(a, b); }
  static I And(I a, I b) { return _mm256_and_si256(a, b); }
  static I Xor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I Shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static I Add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I Sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I DotU(I u, I s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static I DotS(I w, I s) { return DotU(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w)); }
  static F Float(I a) { return _mm256_cvtepi32_ps(a); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F SetF(float v) { return _mm256_set1_ps(v); }
  static F LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreF(float* p, F v) { _mm256_storeu_ps(p, v); }
  // e[j]'s low 128-bit lane holds columns 4j .. + 3, its high lane 16 + 4j .. + 3.
  static void Order(F e[4]) {
    const F c0 = _mm256_permute2f128_ps(e[0], e[1], 0x20);
    const F c1 = _mm256_permute2f128_ps(e[2], e[3], 0x20);
    const F c2 = _mm256_permute2f128_ps(e[0], e[1], 0x31);
    const F c3 = _mm256_permute2f128_ps(e[2], e[3], 0x31);
    e[0] = c0, e[1] = c1, e[2] = c2, e[3] = c3;
  }
};
#endif

using I = Vec::I;
using F = Vec::F;

// The codes of input rows [i, i + 4) on Vec::kWidth columns at o0, interleaved: lane k
// of e[j] holds one column's 4 codes (unsigned: |c| for int8, c + 8 for int4).  Rows
// at or past `end` (a block's ragged tail) reuse an earlier row's codes: their
// activation codes are zero.
inline void Unit(const Problem& p, int64_t i, int64_t end, int64_t o0, I e[4]) {
  I r[4];
  if (p.bits == 8) {
    for (int64_t k = 0; k < 4; ++k) {
      r[k] = Vec::Load(p.codes + std::min(i + k, end - 1) * p.out + o0);
    }
  } else {  // i is even: byte rows i / 2 and i / 2 + 1
    const I bias = Vec::Set8(static_cast<int8_t>(0x88)), low = Vec::Set8(0x0F);
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t row = std::min(i / 2 + k, (end - 1) / 2);
      const I bytes = Vec::Xor(Vec::Load(p.codes + row * p.out + o0), bias);
      r[2 * k] = Vec::And(bytes, low);
      r[2 * k + 1] = Vec::And(Vec::Shr4(bytes), low);
    }
  }
  const I a = Vec::Lo8(r[0], r[1]), b = Vec::Hi8(r[0], r[1]);
  const I c = Vec::Lo8(r[2], r[3]), d = Vec::Hi8(r[2], r[3]);
  e[0] = Vec::Lo16(a, c), e[1] = Vec::Hi16(a, c);
  e[2] = Vec::Lo16(b, d), e[3] = Vec::Hi16(b, d);
}

constexpr int64_t kLanes = Vec::kWidth / 4;  // floats a vector: one Unit's e[j]

// Input rows [begin, end) (block s of group g) on the Vec::kWidth columns at o0, rows
// [r0, r0 + kRows): acc[r * stride + j * kLanes] (row r's e[j] lanes) += the block's
// integer dot times its activation scale.
template <int64_t kRows>
void RunBlock(const Problem& p, int64_t g, int64_t s, int64_t begin, int64_t end, int64_t o0,
              int64_t r0, float* acc, int64_t stride) {
  int64_t block[kRows];
  I dot[kRows][4];
  for (int64_t r = 0; r < kRows; ++r) {
    block[r] = (r0 + r) * Blocks(p) + g * p.blocks_per_group + s;
    for (int64_t j = 0; j < 4; ++j) dot[r][j] = Vec::Set32(0);
  }
  for (int64_t i = begin; i < end; i += 4) {
    I e[4];
    Unit(p, i, end, o0, e);
    for (int64_t r = 0; r < kRows; ++r) {
      int32_t four;
      std::memcpy(&four, p.xq + block[r] * kBlock + (i - begin), sizeof(four));
      const I q = Vec::Set32(four);
      for (int64_t j = 0; j < 4; ++j) {
        const I terms = p.bits == 8 ? Vec::DotS(e[j], q) : Vec::DotU(e[j], q);
        dot[r][j] = Vec::Add(dot[r][j], terms);
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    const I bias = Vec::Set32(p.bits == 4 ? 8 * p.xsum[block[r]] : 0);
    const F scale = Vec::SetF(p.xscale[block[r]]);
    for (int64_t j = 0; j < 4; ++j) {
      float* a = acc + r * stride + j * kLanes;
      Vec::StoreF(a, Vec::Fma(Vec::Float(Vec::Sub(dot[r][j], bias)), scale, Vec::LoadF(a)));
    }
  }
}

// Group g's sums acc (RunBlock's layout) on the Vec::kWidth columns at o0, row r, into y.
void Finish(const Problem& p, int64_t g, int64_t o0, int64_t r, const float* acc) {
  F sums[4];
  for (int64_t j = 0; j < 4; ++j) sums[j] = Vec::LoadF(acc + j * kLanes);
  Vec::Order(sums);
  for (int64_t j = 0; j < 4; ++j) {
    const int64_t o = o0 + j * kLanes;
    float* out = p.y + r * p.out + o;
    F y = Vec::Fma(Vec::LoadF(p.scales + g * p.out + o), sums[j], Vec::LoadF(out));
    if (p.offsets != nullptr) {
      y = Vec::Fma(Vec::LoadF(p.offsets + g * p.out + o),
                   Vec::SetF(p.group_sums[r * p.groups + g]), y);
    }
    Vec::StoreF(out, y);
  }
}

// Block by block, the band's columns inside: each of a block's kBlock code rows is read
// along the band (adjacent lines), never down a column block's rows, which lie a whole
// code row apart (48 KB on the tied head, where a per-channel group is every row); a
// group's f32 sums wait in a per-thread buffer, in the order the register sums had.
void RunBandVector(const Problem& p, int64_t o_begin, int64_t o_end) {
  const int64_t chunks = (o_end - o_begin) / Vec::kWidth, stride = chunks * Vec::kWidth;
  const int64_t vector_end = o_begin + stride;  // a ragged tail goes to GroupColumns
  thread_local std::vector<float> sums;
  sums.resize(p.rows * stride);
  for (int64_t g = 0; g < p.groups; ++g) {
    std::fill(sums.begin(), sums.end(), 0.f);
    const int64_t g_end = std::min(p.in, (g + 1) * p.group);
    for (int64_t begin = g * p.group, s = 0; begin < g_end; begin += kBlock, ++s) {
      const int64_t end = std::min(g_end, begin + kBlock);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t o0 = o_begin + c * Vec::kWidth;
        float* acc = sums.data() + c * Vec::kWidth;
        int64_t r = 0;
        for (; r + 2 <= p.rows; r += 2) {
          RunBlock<2>(p, g, s, begin, end, o0, r, acc + r * stride, stride);
        }
        if (r < p.rows) RunBlock<1>(p, g, s, begin, end, o0, r, acc + r * stride, stride);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t r = 0; r < p.rows; ++r) {
        Finish(p, g, o_begin + c * Vec::kWidth, r, sums.data() + r * stride + c * Vec::kWidth);
      }
    }
    if (vector_end < o_end) GroupColumns(p, g, vector_end, o_end);
  }
}

#endif

}  // namespace

void KVJAX_NAME(RunBand, KVJAX_ISA)(const Problem& p, int64_t o_begin, int64_t o_end) {
  for (int64_t r = 0; r < p.rows; ++r) {
    std::fill(p.y + r * p.out + o_begin, p.y + r * p.out + o_end, 0.f);
  }
#if defined(__AVX512BW__) || defined(__AVX2__)
  RunBandVector(p, o_begin, o_end);
#else
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t o0 = o_begin; o0 < o_end; o0 += kColumns) {
      GroupColumns(p, g, o0, std::min(o_end, o0 + kColumns));
    }
  }
#endif
}

}  // namespace kvjax_qmatmul
