// Shared by the CPU kernels: a vector type for the compiler's target (AVX-512,
// AVX2 + FMA, or scalar), weight/KV element loads as float32, and a parallel loop
// on XLA's intra-op thread pool.
//
// The x86 intrinsics are compiled only for x86 (JAXSERVE_X86): every other
// architecture (aarch64, ...) builds the portable scalar code, which GCC
// auto-vectorizes for the target's own vector unit where it can.
// -DJAXSERVE_PORTABLE builds that code on x86 too (the tests check with it that
// nothing x86 is left outside the guards).

#ifndef JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_
#define JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_

#if (defined(__x86_64__) || defined(__i386__)) && !defined(JAXSERVE_PORTABLE)
#define JAXSERVE_X86 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

namespace ffi = xla::ffi;

// e^r for r in [-ln 2 / 2, ln 2 / 2] (Cephes' expf polynomial), in V's vectors: the
// vector Exps below scale it by 2^n.
template <typename V>
inline typename V::F ExpPoly(typename V::F r) {
  typename V::F p = V::Set1(1.9875691500e-4f);
  p = V::Fma(p, r, V::Set1(1.3981999507e-3f));
  p = V::Fma(p, r, V::Set1(8.3334519073e-3f));
  p = V::Fma(p, r, V::Set1(4.1665795894e-2f));
  p = V::Fma(p, r, V::Set1(1.6666665459e-1f));
  p = V::Fma(p, r, V::Set1(5.0000001201e-1f));
  return V::Fma(p, V::Mul(r, r), V::Add(r, V::Set1(1.0f)));
}

#if defined(JAXSERVE_X86) && defined(__AVX512F__)
struct Vec {
  using F = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRows = 4;  // rows of x per pass over a weight row
  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float a) { return _mm512_set1_ps(a); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static F LoadI8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F LoadBf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static void Store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static float Sum(F a) { return _mm512_reduce_add_ps(a); }
  // e^x, ~1 ulp (Cephes' expf polynomial); x clamped to [-87.3, 88.0].
  static F Exp(F x) {
    x = _mm512_max_ps(_mm512_min_ps(x, Set1(88.0f)), Set1(-87.3f));
    const F n = _mm512_roundscale_ps(_mm512_mul_ps(x, Set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm512_fnmadd_ps(n, Set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
    return _mm512_scalef_ps(ExpPoly<Vec>(r), n);
  }
};
#elif defined(JAXSERVE_X86) && defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using F = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRows = 2;
  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float a) { return _mm256_set1_ps(a); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static F LoadI8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F LoadBf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static void Store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static float Sum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // e^x, ~1 ulp (Cephes' expf polynomial); x clamped to [-87.3, 88.0].
  static F Exp(F x) {
    x = _mm256_max_ps(_mm256_min_ps(x, Set1(88.0f)), Set1(-87.3f));
    const F n = _mm256_round_ps(_mm256_mul_ps(x, Set1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(n, Set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
    const F p = ExpPoly<Vec>(r);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};
#else
struct Vec {
  using F = float;
  static constexpr int kWidth = 1;
  static constexpr int kRows = 2;
  static F Zero() { return 0.0f; }
  static F Set1(float a) { return a; }
  static F Load(const float* p) { return *p; }
  static F LoadI8(const int8_t* p) { return static_cast<float>(*p); }
  static F LoadBf16(const uint16_t* p) {
    uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static F Fma(F a, F b, F c) { return a * b + c; }
  static F Mul(F a, F b) { return a * b; }
  static F Sub(F a, F b) { return a - b; }
  static F Add(F a, F b) { return a + b; }
  static void Store(float* p, F a) { *p = a; }
  static float Sum(F a) { return a; }
  static F Exp(F x) { return std::exp(x); }
};
#endif

#if defined(JAXSERVE_X86) && defined(__AVX2__)
// The sum of a 256-bit vector's 8 floats (AVX2 code beside an AVX-512 Vec).
inline float Sum256(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int kW = Vec::kWidth;
using bf16_t = uint16_t;  // bfloat16 bits (the upper half of a float32)

// A vector of elements as float32.
inline Vec::F LoadW(const float* p) { return Vec::Load(p); }
inline Vec::F LoadW(const int8_t* p) { return Vec::LoadI8(p); }
inline Vec::F LoadW(const bf16_t* p) { return Vec::LoadBf16(p); }
inline float ToFloat(float v) { return v; }
inline float ToFloat(int8_t v) { return static_cast<float>(v); }
inline float ToFloat(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}


// Runs chunk(c) for c in [0, num_chunks) on the calling thread and the pool.
//
// Chunks are claimed from an atomic counter by the calling thread and by tasks on
// XLA's intra-op thread pool. The calling thread works too and waits only for
// chunks other threads have claimed, so a busy pool delays the call but cannot
// deadlock it; tasks that start after the last chunk is claimed find nothing to do
// (their state is shared, not on the caller's stack).
template <typename Chunk>
void ParallelFor(ffi::ThreadPool& pool, int64_t num_chunks, Chunk chunk) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, num_chunks, chunk]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < num_chunks;) {
      chunk(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = work;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_PALLAS_KERNELS_CPU_SIMD_H_
