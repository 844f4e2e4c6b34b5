// kvjax_qmatmul: y [R, O] = x [R, I] . dequantize(codes) for a few rows R, on the CPU.
//
// The weight stays as its integer codes in kvjax's QuantizedWeight layout (codes
// [I, O] int8, or [I/2, O] with rows 2p / 2p+1 in byte p's low / high nibble; scales
// and offsets [G, O] f32 for groups of `group` input rows, the last one ragged) and
// is read once, 1 or 0.5 bytes a weight.  x is quantized once per call to int8 in
// blocks of kBlock rows inside each group (absmax scale per block, as llama.cpp's
// Q8_0), then each block's integer dot with the codes costs one f32 multiply-add, and
// each group's sum one by scale[g, o] and one by offset[g, o] * sum(x[r, group g]) (the
// f32 sum of x, not of its codes).  The error against the dequantized weight is x's
// rounding: at most scale_b / 2 an input, scale_b = max |x| over the block / 127.
// The band kernels (qmatmul_kernel.cc) are compiled per ISA and picked at run time by
// the `isa` attribute (0: the best this CPU runs, 1 generic, 2 AVX2, 3 AVX-512).
// Bands go to XLA's intra-op thread pool; the calling thread claims bands too and
// returns once every band is done, so a busy pool only slows it down.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "qmatmul_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kvjax_qmatmul {
namespace {

constexpr int64_t kMaxRows = 32;  // activation rows per call (qmatmul.py's MAX_ROWS)
constexpr int64_t kBandBlocks = 16;  // blocks a band: 1024 columns, 32 KB of a group's codes

using Kernel = void (*)(const Problem&, int64_t, int64_t);
enum Isa : int64_t { kBest = 0, kGeneric = 1, kAvx2 = 2, kAvx512 = 3 };

bool Supported(int64_t isa) {
  switch (isa) {
    case kGeneric: return true;
#if defined(__x86_64__)
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    default: return false;
  }
}

// The band kernel for `isa` (kBest: the widest this CPU runs), or nullptr.
Kernel Pick(int64_t isa) {
  if (isa == kBest) isa = Supported(kAvx512) ? kAvx512 : Supported(kAvx2) ? kAvx2 : kGeneric;
  if (!Supported(isa)) return nullptr;
#if defined(__x86_64__)
  if (isa == kAvx512) return RunBandAvx512;
  if (isa == kAvx2) return RunBandAvx2;
#endif
  return RunBandGeneric;
}

// x's int8 blocks (Problem's xq, xscale, xsum), and its f32 group sums for offsets.
struct Activations {
  std::vector<int8_t> codes;
  std::vector<float> scales, group_sums;
  std::vector<int32_t> sums;
};

Activations Quantize(const float* x, int64_t rows, int64_t in, int64_t group, int64_t groups,
                     int64_t per_group, bool sums_of_groups) {
  Activations a;
  a.codes.assign(rows * groups * per_group * kBlock, 0);
  a.scales.assign(rows * groups * per_group, 0.f);
  a.sums.assign(rows * groups * per_group, 0);
  a.group_sums.assign(sums_of_groups ? rows * groups : 0, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g_end = std::min(in, (g + 1) * group);
      for (int64_t begin = g * group, s = 0; begin < g_end; begin += kBlock, ++s) {
        const float* xs = x + r * in + begin;
        const int64_t n = std::min(g_end, begin + kBlock) - begin;
        const int64_t block = (r * groups + g) * per_group + s;
        float max = 0.f;
        bool finite = true;
        for (int64_t i = 0; i < n; ++i) {
          max = std::max(max, std::fabs(xs[i]));
          finite = finite && std::isfinite(xs[i]);
        }
        for (int64_t i = 0; sums_of_groups && i < n; ++i) a.group_sums[r * groups + g] += xs[i];
        if (!finite) {  // inf / nan in x: nan out, as a float dot's
          a.scales[block] = std::nanf("");
          continue;
        }
        if (max == 0.f) continue;  // codes 0, scale 0
        const float inverse = 127.f / max;
        a.scales[block] = max / 127.f;
        for (int64_t i = 0; i < n; ++i) {
          const int8_t q = static_cast<int8_t>(std::nearbyint(xs[i] * inverse));
          a.codes[block * kBlock + i] = q;
          a.sums[block] += q;
        }
      }
    }
  }
  return a;
}

// Bands claimed by counter; the caller waits for `finished`, never for a task to start.
struct Shared {
  Problem problem;
  Kernel kernel;
  int64_t bands, band_columns;
  std::atomic<int64_t> next{0}, finished{0};
  void Work() {
    for (int64_t b; (b = next.fetch_add(1)) < bands;) {
      kernel(problem, b * band_columns, std::min(problem.out, (b + 1) * band_columns));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                   ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets, int64_t group,
                   int64_t bits, int64_t isa, ffi::ResultBuffer<ffi::F32> y) {
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
  const Kernel kernel = Pick(isa);
  if (kernel == nullptr) {
    return ffi::Error::InvalidArgument("kvjax_qmatmul: isa " + std::to_string(isa) +
                                       " is not one this CPU runs (or not built)");
  }
  const int64_t per_group = (std::min(group, in) + kBlock - 1) / kBlock;  // blocks a group
  const Activations a = Quantize(x.typed_data(), rows, in, group, groups, per_group,
                                 has_offsets);
  auto shared = std::make_shared<Shared>();
  shared->kernel = kernel;
  shared->problem = Problem{a.codes.data(), a.scales.data(), a.sums.data(),
                            codes.typed_data(), scales.typed_data(),
                            has_offsets ? offsets.typed_data() : nullptr,
                            a.group_sums.data(), y->typed_data(), rows, in, out, group,
                            groups, bits, per_group};
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
}  // namespace kvjax_qmatmul

// Whether `isa` (the attribute's numbering) runs here: qmatmul.py's supported_isas().
extern "C" int64_t KvjaxQMatmulSupports(int64_t isa) {
  return kvjax_qmatmul::Supported(isa) && isa != kvjax_qmatmul::kBest;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxQMatmul, kvjax_qmatmul::QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("isa")
                                  .Ret<ffi::Buffer<ffi::F32>>());
