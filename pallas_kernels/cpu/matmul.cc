// Matmuls of a few rows against weights that are read once, for XLA:CPU through
// the XLA FFI:
//
//   y[M, N] = x[M, K] @ w^T          w [N, K] float32 or bfloat16
//   y[M, N] = x[M, K] @ dequant(q)^T q [N, K] int8, dequant(q)[n, k] = q[n, k] * scale[n]
//   y[M, N] = x[M, K] @ dequant(c)^T c [N, K] int4 (packed two a byte, the even column
//                                    in the low nibble), groups of G inputs:
//                                    dequant(c)[n, k] = (c[n, k] - zero[n, g]) * scale[n, g]
//
// x is float32 and y float32. w and q are [N, K]: each output's weights contiguous (an
// embedding table used as the tied LM head; an int8 Linear's kernel, stored [out, in]
// as checkpoints store it), so each weight row is one stream from memory.
//
// Why: a decode step multiplies a few rows by every weight, so its time is the time
// to read the weights. XLA:CPU does not fuse an int8 -> float convert into its dot (it
// writes a float32 copy of the weights first: 4x the bytes of int8 weights, every
// call), and its matrix-vector products of a few rows re-read the weights' panels.
// These kernels read each weight once, convert it in registers and use it for all M
// rows. They are for small M (the caller switches to XLA's GEMM for many rows, which
// is tiled for them and, with them, compute-bound).
//
// Threads: chunks of output rows of w (`ParallelFor`, simd.h). Vector width follows
// the compiler's target (`-march`, native by default): AVX-512 (16 floats), AVX2 + FMA
// (8), or scalar; int8 with AVX-512 VNNI multiplies in integers, int4 with AVX2 (and
// so with AVX-512) too.

#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu;  // NOLINT

// The problem: x [M, K], weights, optional per-output scale [N] (nullptr: none), y [M, N].
template <typename T>
struct Problem {
  const float* x;
  const T* w;
  const float* scale;
  float* y;
  int64_t M, K, N;
};

// ---------------------------------------------------------------- float32, bfloat16

// y[m0:m0+R, n] for R rows of x and row n of w: the row is read once, in order (one
// stream from memory), its products accumulating in kU independent sums per row of
// x so that consecutive FMAs do not wait on each other.
template <int R, typename T>
inline void NkRow(const Problem<T>& p, int64_t m0, int64_t n) {
  constexpr int kU = 4;
  const int64_t K = p.K;
  const T* row = p.w + n * K;
  Vec::F acc[R][kU];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < kU; ++u) acc[i][u] = Vec::Zero();
  int64_t k = 0;
  for (; k + kU * kW <= K; k += kU * kW)
    for (int u = 0; u < kU; ++u) {
      const Vec::F w = LoadW(row + k + u * kW);
      for (int i = 0; i < R; ++i)
        acc[i][u] = Vec::Fma(Vec::Load(p.x + (m0 + i) * K + k + u * kW), w, acc[i][u]);
    }
  for (; k + kW <= K; k += kW) {
    const Vec::F w = LoadW(row + k);
    for (int i = 0; i < R; ++i) acc[i][0] = Vec::Fma(Vec::Load(p.x + (m0 + i) * K + k), w, acc[i][0]);
  }
  for (int i = 0; i < R; ++i) {
    float s = Vec::Sum(Vec::Add(Vec::Add(acc[i][0], acc[i][1]), Vec::Add(acc[i][2], acc[i][3])));
    for (int64_t kk = k; kk < K; ++kk) s += p.x[(m0 + i) * K + kk] * ToFloat(row[kk]);
    p.y[(m0 + i) * p.N + n] = p.scale != nullptr ? s * p.scale[n] : s;
  }
}

// All rows of x against w's rows [n0, n1), Vec::kRows rows of x at a time (w's row is
// re-read from the L1 cache for each group).
template <typename T>
inline void NkRows(const Problem<T>& p, int64_t n0, int64_t n1) {
  constexpr int R = Vec::kRows;
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + R <= p.M; m += R) NkRow<R>(p, m, n);
    for (; m < p.M; ++m) NkRow<1>(p, m, n);
  }
}

// Calls rows(n0, n1) on the pool's threads for chunks of w's n rows (about 16 a
// thread, so that a thread that finishes early takes more).
template <typename Rows>
void ForOutputChunks(ffi::ThreadPool& pool, int64_t n, Rows rows) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(n, 16 * threads));
  ParallelFor(pool, chunks,
              [rows, n, chunks](int64_t c) { rows(n * c / chunks, n * (c + 1) / chunks); });
}

template <typename T>
void MatmulNk(ffi::ThreadPool& pool, const Problem<T>& p) {
  ForOutputChunks(pool, p.N, [p](int64_t n0, int64_t n1) { NkRows(p, n0, n1); });
}

// ------------------------------------------- rows of x in 16-bit fixed point (integers)

// The scale taking a row of x to 16-bit fixed point, max|x| / 32767 (each value within
// 1/65534 of the row's largest), floored at the smallest normal float so that 1 / scale
// stays finite; NaN for a row with a non-finite value: its products are NaN, as in float
// arithmetic (its fixed-point values are left 0).
inline float Fixed16Scale(const float* x, int64_t K) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  return std::max(amax / 32767.0f, std::numeric_limits<float>::min());
}

// v / scale rounded, given inv = 1 / scale.
inline int16_t ToFixed16(float v, float inv) {
  return static_cast<int16_t>(std::min(32767.0f, std::max(-32767.0f, std::nearbyint(v * inv))));
}

// ------------------------------------------- nk, int8, with AVX-512 VNNI: in integers

#if defined(JAXSERVE_X86) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The rows of x in 16-bit fixed point (a scale per row: max|x| / 32767, so each value
// is within 1/65534 of its row's largest: far below the int8 weights' own error), and
// int16 x int16 products summed in int32 by vpdpwssd (32 products an instruction,
// against 16 multiply-adds and two converts per 16 weights in float). The int32 sums
// go into float32 every kFlush columns, before they could overflow: a lane adds two
// products of at most 32767 * 128 per instruction, 2^31 / (2 * 32767 * 128) = 256
// instructions, and kFlush / 32 = 128 of them run between flushes.
constexpr int64_t kFlush = 4096;

// y[m0:m0+R, n] for R rows of x and one row n of q: the row is read once, in order
// (one stream from memory), its products accumulating in kU independent sums per
// row of x so consecutive vpdpwssd do not wait on each other.
template <int R>
inline void NkVnniRow(const int16_t* xq, const float* xs, int64_t Kp, const Problem<int8_t>& p,
                      int64_t m0, int64_t n) {
  constexpr int kU = 4;
  const int64_t K = p.K;
  const int8_t* row = p.w + n * K;
  __m512 total[R];
  for (int i = 0; i < R; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
    const int64_t k1 = std::min(K, k0 + kFlush);
    __m512i acc[R][kU];
    for (int i = 0; i < R; ++i)
      for (int u = 0; u < kU; ++u) acc[i][u] = _mm512_setzero_si512();
    auto step = [&](int64_t k, int u, __m512i w) {
      for (int i = 0; i < R; ++i)
        acc[i][u] = _mm512_dpwssd_epi32(acc[i][u], _mm512_loadu_si512(xq + (m0 + i) * Kp + k), w);
    };
    int64_t k = k0;
    for (; k + 32 * kU <= k1; k += 32 * kU)
      for (int u = 0; u < kU; ++u)
        step(k + 32 * u, u, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k + 32 * u))));
    // the last columns, masked past the row's end (xq is zero-padded to Kp)
    for (; k < k1; k += 32) {
      const __mmask32 m = k + 32 <= k1 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (k1 - k)) - 1);
      step(k, 0, _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, row + k)));
    }
    for (int i = 0; i < R; ++i) {
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(acc[i][0], acc[i][1]),
                                           _mm512_add_epi32(acc[i][2], acc[i][3]));
      total[i] = _mm512_add_ps(total[i], _mm512_cvtepi32_ps(sum));
    }
  }
  for (int i = 0; i < R; ++i)
    p.y[(m0 + i) * p.N + n] = _mm512_reduce_add_ps(total[i]) * xs[m0 + i] * p.scale[n];
}

// All rows of x against q's rows [n0, n1), 4 rows of x at a time (q's row is re-read
// from the L1 cache for each 4).
inline void NkVnniRows(const int16_t* xq, const float* xs, int64_t Kp, const Problem<int8_t>& p,
                       int64_t n0, int64_t n1) {
  constexpr int R = 4;
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + R <= p.M; m += R) NkVnniRow<R>(xq, xs, Kp, p, m, n);
    for (; m < p.M; ++m) NkVnniRow<1>(xq, xs, Kp, p, m, n);
  }
}

void MatmulNk(ffi::ThreadPool& pool, const Problem<int8_t>& p) {
  const int64_t Kp = (p.K + 31) / 32 * 32;
  std::vector<int16_t> xq(p.M * Kp, 0);
  std::vector<float> xs(p.M);
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    xs[m] = Fixed16Scale(x, p.K);
    if (std::isnan(xs[m])) continue;
    const float inv = 1.0f / xs[m];
    for (int64_t k = 0; k < p.K; ++k) xq[m * Kp + k] = ToFixed16(x[k], inv);
  }
  const int16_t* xqp = xq.data();
  const float* xsp = xs.data();
  ForOutputChunks(pool, p.N, [p, xqp, xsp, Kp](int64_t n0, int64_t n1) {
    NkVnniRows(xqp, xsp, Kp, p, n0, n1);
  });
}
#endif

// --------------------------------------------------------- nk, int4 groups, in integers

// x [M, K] @ dequant(c [N, K] int4)^T with a scale (and optionally a zero point, in
// code units) per output and group of G inputs.
struct Int4Problem {
  const float* x;
  const uint8_t* c;  // packed: column k of row n in byte (n * K + k) / 2, low nibble if even
  const float* scale;  // [N, K / G]
  const float* zero;   // [N, K / G] or nullptr
  float* y;
  int64_t M, K, N, G;
};

// The rows of x as the int4 products read them: in 16-bit fixed point (a scale per
// row, max|x| / 32767, as the VNNI int8 path's), each group's whole blocks of 32
// columns reordered as a block's 16 packed bytes hold them (its 16 even columns, then
// its 16 odd ones), the rest of a group (G % 32 columns) in order; and each group's
// sum of them (for the zero points).
struct Int4Rows {
  std::vector<int16_t> xq;   // [M, K]
  std::vector<float> xs;     // [M]
  std::vector<int32_t> sum;  // [M, K / G]
};

Int4Rows PrepareInt4Rows(const Int4Problem& p) {
  const int64_t K = p.K, G = p.G, groups = K / G;
  Int4Rows r{std::vector<int16_t>(p.M * K, 0), std::vector<float>(p.M),
             std::vector<int32_t>(p.M * groups, 0)};
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * K;
    r.xs[m] = Fixed16Scale(x, K);
    if (std::isnan(r.xs[m])) continue;
    const float inv = 1.0f / r.xs[m];
    int16_t* xq = r.xq.data() + m * K;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * G, full = k0 + G / 32 * 32;
      int32_t sum = 0;
      for (int64_t k = k0; k < k0 + G; ++k) {
        const int16_t q = ToFixed16(x[k], inv);
        const int64_t j = k - k0;
        // in a whole block: even columns to its first half, odd ones to its second
        const int64_t at = k < full ? k0 + j / 32 * 32 + (j % 2) * 16 + (j % 32) / 2 : k;
        xq[at] = q;
        sum += q;
      }
      r.sum[m * groups + g] = sum;
    }
  }
  return r;
}

// The signed code of column k of a packed row.
inline int Int4Code(const uint8_t* row, int64_t k) {
  const int nibble = (row[k / 2] >> ((k % 2) * 4)) & 0xF;
  return nibble >= 8 ? nibble - 16 : nibble;
}

// y[m0:m0+R, n] for R rows of x and row n of c: the row is read once, in order; each
// group's products are summed in int32 (flushed to float every kFlush4 columns), then
// scaled, and the zero point's share (zero * the group's sum of x) taken off.
constexpr int64_t kFlush4 = 4096;  // per lane: 4096 / 8 products of at most 32767 * 8

template <int R>
inline void NkInt4Row(const Int4Problem& p, const Int4Rows& r, int64_t m0, int64_t n) {
  const int64_t K = p.K, G = p.G, groups = K / G;
  const uint8_t* row = p.c + n * K / 2;
  const float* scale = p.scale + n * groups;
  const float* zero = p.zero == nullptr ? nullptr : p.zero + n * groups;
  float rest[R];  // what is summed outside the vectors: the tails and the zero points
  for (int i = 0; i < R; ++i) rest[i] = 0.0f;
#if defined(JAXSERVE_X86) && defined(__AVX2__) && defined(__FMA__)
  __m256 total[R];
  for (int i = 0; i < R; ++i) total[i] = _mm256_setzero_ps();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G, full = k0 + G / 32 * 32;
    const float s = scale[g];
    int64_t k = k0;
#if defined(JAXSERVE_X86) && defined(__AVX2__) && defined(__FMA__)
    while (k < full) {
      const int64_t stop = std::min(full, k + kFlush4);
      __m256i acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_si256();
      for (; k < stop; k += 32) {
        // the row 512 bytes ahead (the next outputs' rows: one stream from memory)
        _mm_prefetch(reinterpret_cast<const char*>(row + k / 2) + 512, _MM_HINT_T0);
        // each byte sign-extended is 16 * odd + (even's low 4 bits, unsigned): the odd
        // code is its arithmetic shift by 4, the even one its low 4 bits' sign-extension
        const __m256i v = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
        const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(v, 12), 12);
        const __m256i odd = _mm256_srai_epi16(v, 4);
        for (int i = 0; i < R; ++i) {
          const int16_t* xq = r.xq.data() + (m0 + i) * K + k;
          const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
          acc[i] = _mm256_add_epi32(acc[i], _mm256_add_epi32(_mm256_madd_epi16(even, xe),
                                                             _mm256_madd_epi16(odd, xo)));
        }
      }
      const __m256 sv = _mm256_set1_ps(s);
      for (int i = 0; i < R; ++i) total[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), sv, total[i]);
    }
#else
    for (; k < full; k += 32) {
      int64_t acc[R] = {};
      for (int64_t j = 0; j < 16; ++j) {
        const int even = Int4Code(row, k + 2 * j), odd = Int4Code(row, k + 2 * j + 1);
        for (int i = 0; i < R; ++i) {
          const int16_t* xq = r.xq.data() + (m0 + i) * K + k;
          acc[i] += even * xq[j] + odd * xq[16 + j];
        }
      }
      for (int i = 0; i < R; ++i) rest[i] += s * static_cast<float>(acc[i]);
    }
#endif
    for (; k < k0 + G; ++k) {  // the group's columns past its whole blocks, in order
      const int code = Int4Code(row, k);
      for (int i = 0; i < R; ++i) rest[i] += s * static_cast<float>(code * r.xq[(m0 + i) * K + k]);
    }
    if (zero != nullptr)
      for (int i = 0; i < R; ++i)
        rest[i] -= s * zero[g] * static_cast<float>(r.sum[(m0 + i) * groups + g]);
  }
  for (int i = 0; i < R; ++i) {
#if defined(JAXSERVE_X86) && defined(__AVX2__) && defined(__FMA__)
    const float sum = Sum256(total[i]) + rest[i];
#else
    const float sum = rest[i];
#endif
    p.y[(m0 + i) * p.N + n] = sum * r.xs[m0 + i];
  }
}

void MatmulInt4(ffi::ThreadPool& pool, const Int4Problem& p) {
  const Int4Rows rows = PrepareInt4Rows(p);
  const Int4Rows* r = &rows;
  ForOutputChunks(pool, p.N, [p, r](int64_t n0, int64_t n1) {
    constexpr int R = 4;
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m = 0;
      for (; m + R <= p.M; m += R) NkInt4Row<R>(p, *r, m, n);
      for (; m < p.M; ++m) NkInt4Row<1>(p, *r, m, n);
    }
  });
}

// ------------------------------------------------------------------- FFI handlers

// x [M, K], w [N, K], scale [N] or none -> y [M, N].
template <ffi::DataType kW_, typename T>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kW_> w,
                      const float* scale, int64_t scale_count, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || (scale != nullptr && scale_count != wd[0]))
    return ffi::Error::InvalidArgument("cpu matmul: want x [M, K], w [N, K], scale [N]");
  Problem<T> p{x.typed_data(), reinterpret_cast<const T*>(w.untyped_data()), scale,
               y->typed_data(), xd[0], xd[1], wd[0]};
  MatmulNk(pool, p);
  return ffi::Error::Success();
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<ffi::S8, int8_t>(pool, x, q, scale.typed_data(), scale.element_count(), y);
}

ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<ffi::F32, float>(pool, x, w, nullptr, 0, y);
}

ffi::Error Bf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<ffi::BF16, bf16_t>(pool, x, w, nullptr, 0, y);
}


// x [M, K], c [N, K] int4, scale [N, K / G], zero [N, K / G] or none -> y [M, N].
ffi::Error Int4Call(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer c,
                    ffi::Buffer<ffi::F32> scale, const float* zero, int64_t zero_count,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), cd = c.dimensions(), sd = scale.dimensions();
  if (c.element_type() != ffi::DataType::S4 || xd.size() != 2 || cd.size() != 2 ||
      sd.size() != 2 || xd[1] != cd[1] || sd[0] != cd[0] ||
      sd[1] == 0 || cd[1] % sd[1] != 0 || (cd[1] / sd[1]) % 2 != 0 ||
      (zero != nullptr && zero_count != scale.element_count()))
    return ffi::Error::InvalidArgument(
        "cpu int4 matmul: want x [M, K], c [N, K], scale and zero [N, K / G] with G even");
  // (the buffer's size_bytes counts a byte an element: the codes are packed two a byte)
  Int4Problem p{x.typed_data(), reinterpret_cast<const uint8_t*>(c.untyped_data()),
                scale.typed_data(), zero, y->typed_data(), xd[0], xd[1], cd[0], cd[1] / sd[1]};
  MatmulInt4(pool, p);
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer c,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Int4Call(pool, x, c, scale, nullptr, 0, y);
}

ffi::Error Int4ZeroImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer c,
                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zero,
                        ffi::ResultBuffer<ffi::F32> y) {
  return Int4Call(pool, x, c, scale, zero.typed_data(), zero.element_count(), y);
}
}  // namespace

#define JAXSERVE_SCALED(name, impl)                                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, ffi::Ffi::Bind()                                  \
                                                .Ctx<ffi::ThreadPool>()                       \
                                                .Arg<ffi::Buffer<ffi::F32>>()                 \
                                                .Arg<ffi::Buffer<ffi::S8>>()                  \
                                                .Arg<ffi::Buffer<ffi::F32>>()                 \
                                                .Ret<ffi::Buffer<ffi::F32>>());
#define JAXSERVE_PLAIN(name, impl, dtype)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, ffi::Ffi::Bind()                                  \
                                                .Ctx<ffi::ThreadPool>()                       \
                                                .Arg<ffi::Buffer<ffi::F32>>()                 \
                                                .Arg<ffi::Buffer<dtype>>()                    \
                                                .Ret<ffi::Buffer<ffi::F32>>());

JAXSERVE_SCALED(JaxserveMatmulS8, Int8Impl)
JAXSERVE_PLAIN(JaxserveMatmulF32, F32Impl, ffi::F32)
JAXSERVE_PLAIN(JaxserveMatmulBf16, Bf16Impl, ffi::BF16)
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulS4, Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulS4Zero, Int4ZeroImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
