// Matmuls of a few rows against weights that are read once, for XLA:CPU through
// the XLA FFI.
//
//   y[M, N] = x[M, K] @ w          (w float32 or bfloat16)
//   y[M, N] = x[M, K] @ dequant(q) (q int8, dequant(q)[k, n] = q[k, n] * scale[n])
//
// x is float32 and the products accumulate in float32 (for int8: weight-only
// quantization, the same arithmetic as the GPU/TPU path). The weights come in one of
// two layouts:
//   kn: w[K, N], a Linear's kernel [in, out];
//   nk: w[N, K], an embedding table used as the tied LM head (row n is token n).
//
// Why: a decode step multiplies a few rows by every weight, so its time is the
// time to read the weights. XLA:CPU does not fuse an int8 or bfloat16 -> float
// convert into its dot (it writes a float32 copy of the weights first: 4x the bytes
// of int8 weights, every call), and its GEMM re-reads weight panels for every few
// rows. These kernels read each weight once, convert it in registers and use it for
// all M rows. They are for small M (the caller switches to XLA's GEMM for many rows,
// which is tiled for them and, with them, compute-bound).
//
// Threads: chunks of output columns (`ParallelFor`, simd.h). Vector width follows
// the compiler's target (built with -march=native): AVX-512 (16 floats), AVX2 + FMA
// (8), or scalar.

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

// ------------------------------------------------------------------- kn: w[K, N]

// y[m0:m0+R, n0:n0+V*kW] for R rows of x and V vectors of columns.
template <int R, int V, typename T>
inline void KnBlock(const Problem<T>& p, int64_t m0, int64_t n0) {
  Vec::F acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = Vec::Zero();
  const T* col = p.w + n0;
  for (int64_t k = 0; k < p.K; ++k, col += p.N) {
    Vec::F w[V];
    for (int j = 0; j < V; ++j) w[j] = LoadW(col + j * kW);
    for (int i = 0; i < R; ++i) {
      const Vec::F xv = Vec::Set1(p.x[(m0 + i) * p.K + k]);
      for (int j = 0; j < V; ++j) acc[i][j] = Vec::Fma(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) {
      Vec::F out = acc[i][j];
      if (p.scale != nullptr) out = Vec::Mul(out, Vec::Load(p.scale + n0 + j * kW));
      Vec::Store(p.y + (m0 + i) * p.N + n0 + j * kW, out);
    }
}

template <int V, typename T>
inline void KnColumns(const Problem<T>& p, int64_t n0) {
  constexpr int R = Vec::kRows;
  int64_t m = 0;
  for (; m + R <= p.M; m += R) KnBlock<R, V>(p, m, n0);
  for (; m < p.M; ++m) KnBlock<1, V>(p, m, n0);
}

// Columns past the last whole vector: plain loops.
template <typename T>
void KnTail(const Problem<T>& p, int64_t n0) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = n0; n < p.N; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) s += p.x[m * p.K + k] * ToFloat(p.w[k * p.N + n]);
      p.y[m * p.N + n] = p.scale != nullptr ? s * p.scale[n] : s;
    }
}

template <typename T>
void MatmulKn(ffi::ThreadPool& pool, const Problem<T>& p) {
  constexpr int64_t kBlock = Vec::kColVecs * kW;
  const int64_t blocks = p.N / kBlock;
  // About 4 chunks per thread, each a run of whole column blocks.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(blocks, 4 * threads));
  ParallelFor(pool, chunks, [p, blocks, chunks](int64_t c) {
    const int64_t lo = blocks * c / chunks, hi = blocks * (c + 1) / chunks;
    for (int64_t b = lo; b < hi; ++b) KnColumns<Vec::kColVecs>(p, b * kBlock);
    if (c == chunks - 1) {
      int64_t n = blocks * kBlock;
      for (; n + kW <= p.N; n += kW) KnColumns<1>(p, n);
      if (n < p.N) KnTail(p, n);
    }
  });
}

// ------------------------------------------------------------------- nk: w[N, K]

// y[m0:m0+R, n0:n0+P] for R rows of x and P rows of w (each a dot product over K).
template <int R, int P, typename T>
inline void NkBlock(const Problem<T>& p, int64_t m0, int64_t n0) {
  Vec::F acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < P; ++r) acc[i][r] = Vec::Zero();
  const int64_t K = p.K, kv = K / kW * kW;
  for (int64_t k = 0; k < kv; k += kW) {
    Vec::F w[P];
    for (int r = 0; r < P; ++r) w[r] = LoadW(p.w + (n0 + r) * K + k);
    for (int i = 0; i < R; ++i) {
      const Vec::F xv = Vec::Load(p.x + (m0 + i) * K + k);
      for (int r = 0; r < P; ++r) acc[i][r] = Vec::Fma(xv, w[r], acc[i][r]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < P; ++r) {
      float s = Vec::Sum(acc[i][r]);
      for (int64_t k = kv; k < K; ++k) s += p.x[(m0 + i) * K + k] * ToFloat(p.w[(n0 + r) * K + k]);
      p.y[(m0 + i) * p.N + n0 + r] = p.scale != nullptr ? s * p.scale[n0 + r] : s;
    }
}

template <int P, typename T>
inline void NkRows(const Problem<T>& p, int64_t n0) {
  constexpr int R = Vec::kRows;
  int64_t m = 0;
  for (; m + R <= p.M; m += R) NkBlock<R, P>(p, m, n0);
  for (; m < p.M; ++m) NkBlock<1, P>(p, m, n0);
}

template <typename T>
void MatmulNk(ffi::ThreadPool& pool, const Problem<T>& p) {
  constexpr int64_t kRowsPer = 4;
  const int64_t groups = p.N / kRowsPer;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(groups, 16 * threads));
  ParallelFor(pool, chunks, [p, groups, chunks](int64_t c) {
    const int64_t lo = groups * c / chunks, hi = groups * (c + 1) / chunks;
    for (int64_t g = lo; g < hi; ++g) NkRows<kRowsPer>(p, g * kRowsPer);
    if (c == chunks - 1)
      for (int64_t n = groups * kRowsPer; n < p.N; ++n) NkRows<1>(p, n);
  });
}

// ------------------------------------------------------------------- FFI handlers

// x [M, K], w [K, N] (kn) or [N, K] (nk), scale [N] or none -> y [M, N].
template <bool kKn, ffi::DataType kW_, typename T>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kW_> w,
                      const float* scale, int64_t scale_count, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("cpu matmul: x and w must be 2-D");
  const int64_t K = kKn ? wd[0] : wd[1], N = kKn ? wd[1] : wd[0];
  if (xd[1] != K || (scale != nullptr && scale_count != N))
    return ffi::Error::InvalidArgument("cpu matmul: x [M, K], w and scale [N] do not agree");
  Problem<T> p{x.typed_data(), reinterpret_cast<const T*>(w.untyped_data()), scale,
               y->typed_data(), xd[0], K, N};
  if (kKn)
    MatmulKn(pool, p);
  else
    MatmulNk(pool, p);
  return ffi::Error::Success();
}

template <bool kKn>
ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<kKn, ffi::S8, int8_t>(pool, x, q, scale.typed_data(), scale.element_count(), y);
}

template <bool kKn>
ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<kKn, ffi::F32, float>(pool, x, w, nullptr, 0, y);
}

template <bool kKn>
ffi::Error Bf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<kKn, ffi::BF16, bf16_t>(pool, x, w, nullptr, 0, y);
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

JAXSERVE_SCALED(JaxserveMatmulKnS8, Int8Impl<true>)
JAXSERVE_SCALED(JaxserveMatmulNkS8, Int8Impl<false>)
JAXSERVE_PLAIN(JaxserveMatmulKnF32, F32Impl<true>, ffi::F32)
JAXSERVE_PLAIN(JaxserveMatmulNkF32, F32Impl<false>, ffi::F32)
JAXSERVE_PLAIN(JaxserveMatmulKnBf16, Bf16Impl<true>, ffi::BF16)
JAXSERVE_PLAIN(JaxserveMatmulNkBf16, Bf16Impl<false>, ffi::BF16)
