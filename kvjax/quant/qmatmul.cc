// kvjax_qmatmul: y [R, O] = x [R, I] . dequantize(codes) for a few rows R, on the CPU.
//
// The weight stays as its integer codes in kvjax's QuantizedWeight layout (codes
// [I, O] int8, or [I/2, O] with rows 2p / 2p+1 in byte p's low / high nibble; scales
// and offsets [G, O] f32 for groups of `group` input rows, the last one ragged) and
// is read once, 1 or 0.5 bytes a weight.  Each task owns a band of output columns;
// group by group it walks the band's code rows in blocks of 64 columns, accumulating
// x[r, i] * code[i, o] in f32 registers, then adds scale[g, o] * acc + offset[g, o] *
// sum(x[r, group g]) into y.  f32 products of exact integer codes: the dequantized
// reference to f32 rounding, no activation quantization.  Bands go to XLA's intra-op
// thread pool; the calling thread claims bands too and returns once every band is
// done, so a busy pool only slows it down.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumns = 64;  // output columns per block (one cache line of codes)
constexpr int64_t kMaxRows = 32;  // activation rows per call (accumulators on the stack)

struct Problem {
  const float* x;  // [R, I]
  const int8_t* codes;  // [I, O] or [I / 2, O]
  const float* scales;  // [G, O]
  const float* offsets;  // [G, O] or nullptr
  const float* group_sums;  // [R, G] sum of x over each group (offsets only)
  float* y;  // [R, O]
  int64_t rows, in, out, group, groups, bits;
};

// GCC / clang vector extensions: 16 lanes, lowered to whatever the host has (-march=native).
typedef float Floats16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16, kVectors = kColumns / kLanes;
constexpr int64_t kBandBlocks = 16;  // blocks per band: 1024 columns, 32 KB of a group's int8 codes

// 16 int8 codes as floats; kNibble 0: the bytes, 1: their low nibbles, 2: their high
// nibbles (each signed).  AVX-512: one sign-extending load, shifts, a convert; elsewhere
// a fixed-trip loop for the compiler to vectorize.
template <int kNibble>
inline Floats16 Convert16(const int8_t* codes) {
#if defined(__AVX512F__)
  __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  if (kNibble == 1) ints = _mm512_srai_epi32(_mm512_slli_epi32(ints, 28), 28);
  if (kNibble == 2) ints = _mm512_srai_epi32(ints, 4);
  return reinterpret_cast<Floats16>(_mm512_cvtepi32_ps(ints));
#else
  float out[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) {
    const int32_t byte = codes[k];
    out[k] = static_cast<float>(kNibble == 0 ? byte : kNibble == 1 ? (byte << 28) >> 28 : byte >> 4);
  }
  Floats16 v;
  std::memcpy(&v, out, sizeof(v));
  return v;
#endif
}

// Group g of rows [r0, r0 + kRows) on the kColumns output columns at o0, added into y:
// accumulators in registers, kVectors per row, codes converted to f32 as they stream by.
template <int64_t kRows>
void RunGroup(const Problem& p, int64_t g, int64_t o0, int64_t r0) {
  const int64_t i0 = g * p.group, i1 = std::min(p.in, i0 + p.group);
  Floats16 acc[kRows][kVectors] = {};
  if (p.bits == 8) {
    for (int64_t i = i0; i < i1; ++i) {
      const int8_t* c = p.codes + i * p.out + o0;
      __builtin_prefetch(c + kColumns);  // this row's line of the next block in the band
      Floats16 w[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) w[v] = Convert16<0>(c + v * kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const float xi = p.x[(r0 + r) * p.in + i];
        for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += xi * w[v];
      }
    }
  } else {  // i is even (int4 needs an even I and an even group)
    for (int64_t i = i0; i < i1; i += 2) {
      const int8_t* c = p.codes + (i / 2) * p.out + o0;
      __builtin_prefetch(c + kColumns);
      Floats16 lo[kVectors], hi[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) {
        lo[v] = Convert16<1>(c + v * kLanes);
        hi[v] = Convert16<2>(c + v * kLanes);
      }
      for (int64_t r = 0; r < kRows; ++r) {
        const float x_lo = p.x[(r0 + r) * p.in + i], x_hi = p.x[(r0 + r) * p.in + i + 1];
        for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += x_lo * lo[v] + x_hi * hi[v];
      }
    }
  }
  for (int64_t v = 0; v < kVectors; ++v) {
    Floats16 s, m, y;
    std::memcpy(&s, p.scales + g * p.out + o0 + v * kLanes, sizeof(s));
    if (p.offsets != nullptr) std::memcpy(&m, p.offsets + g * p.out + o0 + v * kLanes, sizeof(m));
    for (int64_t r = 0; r < kRows; ++r) {
      float* out = p.y + (r0 + r) * p.out + o0 + v * kLanes;
      std::memcpy(&y, out, sizeof(y));
      y += s * acc[r][v];
      if (p.offsets != nullptr) y += m * p.group_sums[(r0 + r) * p.groups + g];
      std::memcpy(out, &y, sizeof(y));
    }
  }
}

// Group g on the ragged last columns [o0, O) (O not a multiple of kColumns), scalar.
void RunGroupColumns(const Problem& p, int64_t g, int64_t o0) {
  const int64_t i0 = g * p.group, i1 = std::min(p.in, i0 + p.group);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t o = o0; o < p.out; ++o) {
      float acc = 0;
      for (int64_t i = i0; i < i1; ++i) {
        const int8_t byte = p.codes[(p.bits == 8 ? i : i / 2) * p.out + o];
        const int code = p.bits == 8 ? byte
                         : i % 2 ? byte >> 4
                                 : static_cast<int8_t>(static_cast<uint8_t>(byte) << 4) >> 4;
        acc += p.x[r * p.in + i] * static_cast<float>(code);
      }
      float& y = p.y[r * p.out + o];
      y += p.scales[g * p.out + o] * acc;
      if (p.offsets != nullptr) y += p.offsets[g * p.out + o] * p.group_sums[r * p.groups + g];
    }
  }
}

// A band of output columns [o_begin, o_end), group by group: within a group the band's
// blocks walk along each code row (adjacent lines, not a new page a row as a lone
// 64-column block of a wide weight would), and the group's codes stay in cache for
// every chunk of 4 rows.
void RunBand(const Problem& p, int64_t o_begin, int64_t o_end) {
  for (int64_t r = 0; r < p.rows; ++r) std::fill(p.y + r * p.out + o_begin, p.y + r * p.out + o_end, 0.f);
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t o0 = o_begin; o0 < o_end; o0 += kColumns) {
      if (o0 + kColumns > p.out) {
        RunGroupColumns(p, g, o0);
        continue;
      }
      int64_t r = 0;
      for (; r + 4 <= p.rows; r += 4) RunGroup<4>(p, g, o0, r);
      switch (p.rows - r) {
        case 3: RunGroup<3>(p, g, o0, r); break;
        case 2: RunGroup<2>(p, g, o0, r); break;
        case 1: RunGroup<1>(p, g, o0, r); break;
      }
    }
  }
}

// Bands claimed by counter; the caller waits for `finished`, never for a task to start.
struct Shared {
  Problem problem;
  int64_t bands, band_columns;
  std::atomic<int64_t> next{0}, finished{0};
  void Work() {
    for (int64_t b; (b = next.fetch_add(1)) < bands;) {
      RunBand(problem, b * band_columns, std::min(problem.out, (b + 1) * band_columns));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                   ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets, int64_t group,
                   int64_t bits, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("kvjax_qmatmul: x, codes and scales must be 2-D");
  }
  const int64_t rows = xd[0], in = xd[1], out = cd[1], groups = sd[0];
  const bool has_offsets = offsets.element_count() != 0;
  if (rows > kMaxRows || (bits != 8 && bits != 4) || cd[0] * (bits == 4 ? 2 : 1) != in ||
      group <= 0 || (bits == 4 && group % 2) || groups != (in + group - 1) / group ||
      sd[1] != out || (has_offsets && offsets.element_count() != groups * out)) {
    return ffi::Error::InvalidArgument("kvjax_qmatmul: inconsistent shapes or attributes");
  }
  std::vector<float> group_sums(has_offsets ? rows * groups : 0);
  for (int64_t r = 0; has_offsets && r < rows; ++r) {
    for (int64_t i = 0; i < in; ++i) group_sums[r * groups + i / group] += x.typed_data()[r * in + i];
  }
  auto shared = std::make_shared<Shared>();
  shared->problem = Problem{x.typed_data(), codes.typed_data(), scales.typed_data(),
                            has_offsets ? offsets.typed_data() : nullptr, group_sums.data(),
                            y->typed_data(), rows, in, out, group, groups, bits};
  // Bands of up to kBandBlocks blocks, at least two per thread where there are enough.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t blocks = (out + kColumns - 1) / kColumns;
  const int64_t per_band = std::clamp<int64_t>(blocks / (2 * threads), 1, kBandBlocks);
  shared->band_columns = per_band * kColumns;
  shared->bands = (blocks + per_band - 1) / per_band;
  const int64_t helpers = std::min(threads, shared->bands) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  while (shared->finished.load(std::memory_order_acquire) < shared->bands) {
    std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>());
