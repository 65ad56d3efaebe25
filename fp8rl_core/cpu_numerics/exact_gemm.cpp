// The exact GEMM's operand grid and its output's rounding, one pass over memory each
// (fp8rl_core/cpu_numerics/portable_math.py computes the same values tensor by tensor).
//
// Every operation here is exact or one IEEE-754 rounding of the same operands as the tensor-by-tensor
// path, so the bits are the same by construction:
//   grid:   the BF16 value of an operand (round to nearest even, as ATen's conversion), the largest
//           magnitude of each row or column (an integer max of the magnitude's bits: monotone for
//           floats), frexp of it, the scale 2**(GRID_BITS - e) built from its bits, the product (one IEEE
//           multiplication, exact but where a row holding inf overflows), round half to even to an integer ((|s| + 2**23) - 2**23
//           below 2**23), the float64 conversion (exact);
//   finish: float64 -> float32 (one rounding), two divisions by powers of two (one rounding each,
//           in that order), and optionally float32 -> BF16 (round to nearest even).
// Compiled without -ffast-math and with -ffp-contract=off, so the compiler keeps each operation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kGridBits = 19;
constexpr float kTwo23 = 8388608.0f;  // 2**23
constexpr int64_t kGrainElements = 32768;  // work below this runs on the calling thread (a parallel region costs more)

inline int64_t grain(int64_t per_item) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_item)); }

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// A float32 rounded to its BF16 value (round to nearest even; a NaN becomes a quiet NaN, as ATen's
// vectorized conversion gives), held in float32.
inline float bf16_value(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t nan = -static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  const uint32_t rounded = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  return from_bits((rounded & ~nan) | (0xFFFF0000u & nan));
}

inline uint16_t bf16_bits(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t nan = -static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  return static_cast<uint16_t>((((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & ~nan) | (0xFFFFu & nan));
}

inline float scale_of(uint32_t max_magnitude_bits) {  // 2**(GRID_BITS - e) for the largest |x| = m * 2**e
  const float amax = from_bits(max_magnitude_bits);
  int e = 0;
  if (std::isfinite(amax)) std::frexp(amax, &e);  // frexp(0): 0; inf and NaN: 0, as ATen's frexp gives
  e = kGridBits - e;
  e = e < -126 ? -126 : (e > 127 ? 127 : e);
  return from_bits(static_cast<uint32_t>(e + 127) << 23);
}

// torch.round (half to even): for 0 <= a < 2**23, (a + 2**23) - 2**23 is a rounded to an integer; from
// 2**23 up (and for inf and NaN) a float32 is its own rounding. The sign is put back from the bits, so
// -0.3 gives -0.0 as torch.round does. A finite operand's scaled value is below 2**19; a row holding an
// infinity or a NaN is scaled by 2**19 whatever its values, so the other branch is needed there.
inline float round_even(float s) {
  const float a = std::fabs(s);
  const uint32_t big = -static_cast<uint32_t>(!(a < kTwo23));
  const uint32_t r = (to_bits((a + kTwo23) - kTwo23) & ~big) | (to_bits(a) & big);
  return from_bits(r | (to_bits(s) & 0x80000000u));
}

// x * u rounded to float32, as a float32 multiplication gives it: the product in float64 is exact (a
// 24-bit significand times a power of two), so its one rounding to float32 is that result. Taken through
// float64 because a float32 multiplication with a subnormal operand costs a microcode assist on x86 (~100x
// a normal one), and gradients hold many subnormals. ``u64`` is the scale built as a float64 from its bits,
// so the compiler cannot narrow the product back to a float32 multiplication.
inline float scaled(float x, double u64) {
  return static_cast<float>(static_cast<double>(x) * u64);
}

inline double as_f64(float u) {  // a power of two 2**k, k in [-126, 127], rebuilt as float64 from its bits
  const int64_t k = static_cast<int64_t>((to_bits(u) >> 23) & 0xFFu) - 127;
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

template <bool ToBf16>
inline float load(const float* p, int64_t i) {
  return ToBf16 ? bf16_value(p[i]) : p[i];
}

template <bool ToBf16>
inline float load(const uint16_t* p, int64_t i) {
  return from_bits(static_cast<uint32_t>(p[i]) << 16);
}

template <typename T, bool ToBf16, bool TwoLevels>
void grid_kernel(const T* xp, int64_t B, int64_t R, int64_t C, int64_t axis, float* upp, double* p0, double* p1) {
  const float high = static_cast<float>(1 << kGridBits);
  if (axis == 2) {  // along each row
    at::parallel_for(0, B * R, grain(C), [&](int64_t lo, int64_t hi) {
      for (int64_t row = lo; row < hi; ++row) {
        const int64_t base = row * C;
        uint32_t m = 0;
        for (int64_t c = 0; c < C; ++c) {
          const uint32_t a = to_bits(load<ToBf16>(xp, base + c)) & 0x7FFFFFFFu;
          m = a > m ? a : m;
        }
        const float u = scale_of(m);
        const double u64 = as_f64(u);
        upp[row] = u;
        for (int64_t c = 0; c < C; ++c) {
          const float s = scaled(load<ToBf16>(xp, base + c), u64);
          const float r = round_even(s);
          p0[base + c] = static_cast<double>(r);
          if (TwoLevels) p1[base + c] = static_cast<double>(round_even((s - r) * high));
        }
      }
    });
    return;
  }
  // along each column
  at::parallel_for(0, B, grain(R * C), [&](int64_t lo, int64_t hi) {
    std::vector<uint32_t> m(C);
    std::vector<double> ub64(C);
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t base = b * R * C;
      std::fill(m.begin(), m.end(), 0u);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const uint32_t a = to_bits(load<ToBf16>(xp, base + r * C + c)) & 0x7FFFFFFFu;
          m[c] = a > m[c] ? a : m[c];
        }
      float* ub = upp + b * C;
      for (int64_t c = 0; c < C; ++c) {
        ub[c] = scale_of(m[c]);
        ub64[c] = as_f64(ub[c]);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const int64_t i = base + r * C + c;
          const float s = scaled(load<ToBf16>(xp, i), ub64[c]);
          const float q = round_even(s);
          p0[i] = static_cast<double>(q);
          if (TwoLevels) p1[i] = static_cast<double>(round_even((s - q) * high));
        }
    }
  });
}

// x: [batch, rows, cols] float32 or BF16; the grid along axis 2 (each row) or 1 (each column).
// Returns [scale, level 0, (level 1)]: scale [batch, rows, 1] or [batch, 1, cols] float32, levels float64.
std::vector<at::Tensor> grid(const at::Tensor& x_in, int64_t axis, int64_t levels, bool to_bf16) {
  TORCH_CHECK(x_in.device().is_cpu(), "fp8rl_exact::grid: a CPU tensor");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "fp8rl_exact::grid: float32 or bfloat16");
  TORCH_CHECK(x_in.dim() == 3 && (axis == 1 || axis == 2), "fp8rl_exact::grid: [batch, rows, cols], axis 1 or 2");
  TORCH_CHECK(levels == 1 || levels == 2, "fp8rl_exact::grid: 1 or 2 levels");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), R = x.size(1), C = x.size(2);
  at::Tensor up = at::empty(axis == 2 ? std::vector<int64_t>{B, R, 1} : std::vector<int64_t>{B, 1, C},
                            x.options().dtype(at::kFloat));
  at::Tensor l0 = at::empty({B, R, C}, x.options().dtype(at::kDouble));
  at::Tensor l1 = levels > 1 ? at::empty({B, R, C}, x.options().dtype(at::kDouble)) : at::Tensor();
  double* p1 = levels > 1 ? l1.data_ptr<double>() : nullptr;
  float* upp = up.data_ptr<float>();
  double* p0 = l0.data_ptr<double>();
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (p1) grid_kernel<uint16_t, false, true>(xp, B, R, C, axis, upp, p0, p1);
    else grid_kernel<uint16_t, false, false>(xp, B, R, C, axis, upp, p0, p1);
  } else {
    const float* xp = x.data_ptr<float>();
    if (p1 && to_bf16) grid_kernel<float, true, true>(xp, B, R, C, axis, upp, p0, p1);
    else if (p1) grid_kernel<float, false, true>(xp, B, R, C, axis, upp, p0, p1);
    else if (to_bf16) grid_kernel<float, true, false>(xp, B, R, C, axis, upp, p0, p1);
    else grid_kernel<float, false, false>(xp, B, R, C, axis, upp, p0, p1);
  }
  std::vector<at::Tensor> out{up, l0};
  if (levels > 1) out.push_back(l1);
  return out;
}

// out: [..., m, n] float64; ua: [..., m, 1] and ub: [..., 1, n] float32 powers of two (the batch dimensions
// expanded). float32(out) / ua / ub, as float32, or rounded on to BF16 when to_bf16, in out's shape: a new
// tensor, not a view (a module's output that is a view limits what autograd lets callers do in place).
at::Tensor finish(const at::Tensor& out_in, const at::Tensor& ua_in, const at::Tensor& ub_in, bool to_bf16) {
  TORCH_CHECK(out_in.device().is_cpu() && out_in.scalar_type() == at::kDouble && out_in.dim() >= 2,
              "fp8rl_exact::finish: [..., m, n] float64 on the CPU");
  const at::Tensor out = out_in.contiguous(), ua = ua_in.contiguous(), ub = ub_in.contiguous();
  const int64_t M = out.size(-2), N = out.size(-1), B = M * N == 0 ? 0 : out.numel() / (M * N);
  TORCH_CHECK(ua.scalar_type() == at::kFloat && ub.scalar_type() == at::kFloat && ua.numel() == B * M &&
                  ub.numel() == B * N,
              "fp8rl_exact::finish: float32 scales [..., m, 1] and [..., 1, n]");
  at::Tensor res = at::empty(out.sizes(), out.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  const double* op = out.data_ptr<double>();
  const float* pa = ua.data_ptr<float>();
  const float* pb = ub.data_ptr<float>();
  float* rf = to_bf16 ? nullptr : res.data_ptr<float>();
  uint16_t* rb = to_bf16 ? reinterpret_cast<uint16_t*>(res.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, B * M, grain(N), [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const float a = pa[row];
      const float* bb = pb + (row / M) * N;
      const double* src = op + row * N;
      if (rf) {
        float* dst = rf + row * N;
        for (int64_t j = 0; j < N; ++j) dst[j] = (static_cast<float>(src[j]) / a) / bb[j];
      } else {
        uint16_t* dst = rb + row * N;
        for (int64_t j = 0; j < N; ++j) dst[j] = bf16_bits((static_cast<float>(src[j]) / a) / bb[j]);
      }
    }
  });
  return res;
}

}  // namespace

TORCH_LIBRARY(fp8rl_exact, m) {
  m.def("grid(Tensor x, int axis, int levels, bool to_bf16) -> Tensor[]");
  m.def("finish(Tensor out, Tensor ua, Tensor ub, bool to_bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(fp8rl_exact, CPU, m) {
  m.impl("grid", &grid);
  m.impl("finish", &finish);
}
