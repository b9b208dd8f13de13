// Ragged paged attention for XLA:CPU, called through the XLA FFI: the CPU path of
// `pallas_kernels.ragged_paged_attention` (same inputs, same result; the pure-jnp
// reference there is its oracle).
//
// Glossary: T tokens, N query heads, K KV heads, G = N / K, H head_dim, P pages,
// S tokens per page, M pages per sequence, B sequences.
//
//   q [T, N, H] f32, kv [P, S, 2K, H] (f32, bf16, int8, fp8; K head k at 2k, V head k
//   at 2k + 1), scales [P, S, 2K] f32 (int8 / fp8 only), kv_lens [B], pages [B, M],
//   cu_q_lens [B + 1], num_seqs [1] -> out [T, N, H] f32. With rows_per_head = 1 the
//   cache is shared, [P, S, K, H] (scales [P, S, K]): row k is head k's key and its
//   value (multi-head latent attention's latent), converted once.
//
// Sequence b owns query rows cu_q_lens[b] .. cu_q_lens[b + 1], its last q_len tokens:
// row i sits at position kv_len - q_len + i and attends to kv positions 0 .. itself
// (and, with a sliding window W, only to those > itself - W). Rows of no sequence
// (padding) are zero.
//
// Why a kernel: XLA compiles the reference's gathers of whole page blocks and the
// transposes its batched dots need (a decode step of 16 sequences spent ~30 ms of
// 150 in them, for the 0.5B model); here each page row is read once, in place.
//
// Work items: (sequence, a tile of up to kQueryTile query rows, KV head), claimed
// by the threads of XLA's pool (`ParallelFor`). An item walks the KV positions its
// rows can see in blocks of kBlock tokens: each block's K and V rows are converted
// to float32 (dequantized) once, into a small buffer, and used for the tile's
// rows x G query heads, with an online softmax. Positions an item must not see
// (past the sequence's length, before the window) are never read: their buffer
// rows are zero, so a NaN in a page another sequence owns cannot leak in.

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_cpu;  // NOLINT

constexpr int kBlock = 16;      // KV positions per block
constexpr int kQueryTile = 4;   // query rows per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// fp8 element types: their bits, decoded through a table.
struct F8E4M3 {
  uint8_t bits;
};
struct F8E5M2 {
  uint8_t bits;
};

float DecodeFp8(uint8_t bits, int exp_bits, int man_bits, bool fn) {
  const int sign = bits >> 7, e = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << man_bits) - 1), bias = (1 << (exp_bits - 1)) - 1;
  float v;
  if (fn && e == (1 << exp_bits) - 1 && m == (1 << man_bits) - 1) {
    v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: only S.1111.111 is NaN
  } else if (!fn && e == (1 << exp_bits) - 1) {
    v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(static_cast<float>((1 << man_bits) + m), e - bias - man_bits);
  }
  return sign ? -v : v;
}

struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = DecodeFp8(static_cast<uint8_t>(i), 4, 3, true);
      e5m2[i] = DecodeFp8(static_cast<uint8_t>(i), 5, 2, false);
    }
  }
};
const Fp8Tables kFp8;

// One row of H elements as float32 times `scale`, into dst.
inline void ConvertRow(const float* src, float scale, float* dst, int64_t H) {
  (void)scale;
  int64_t d = 0;
  for (; d + kW <= H; d += kW) Vec::Store(dst + d, Vec::Load(src + d));
  for (; d < H; ++d) dst[d] = src[d];
}
inline void ConvertRow(const bf16_t* src, float scale, float* dst, int64_t H) {
  (void)scale;
  int64_t d = 0;
  for (; d + kW <= H; d += kW) Vec::Store(dst + d, Vec::LoadBf16(src + d));
  for (; d < H; ++d) dst[d] = ToFloat(src[d]);
}
inline void ConvertRow(const int8_t* src, float scale, float* dst, int64_t H) {
  const Vec::F s = Vec::Set1(scale);
  int64_t d = 0;
  for (; d + kW <= H; d += kW) Vec::Store(dst + d, Vec::Mul(Vec::LoadI8(src + d), s));
  for (; d < H; ++d) dst[d] = static_cast<float>(src[d]) * scale;
}
inline void ConvertRow(const F8E4M3* src, float scale, float* dst, int64_t H) {
  for (int64_t d = 0; d < H; ++d) dst[d] = kFp8.e4m3[src[d].bits] * scale;
}
inline void ConvertRow(const F8E5M2* src, float scale, float* dst, int64_t H) {
  for (int64_t d = 0; d < H; ++d) dst[d] = kFp8.e5m2[src[d].bits] * scale;
}

static_assert(kBlock % kW == 0, "a block of keys is whole vectors");

// s[j] = q . k_j for the block's kBlock keys (rows of H floats).
#if defined(JAXSERVE_X86) && defined(__AVX512F__)
// Each key's products accumulate in a vector of 16 partial sums; the 16 vectors are
// then summed across lanes together, by halving them level by level (so the block
// costs 15 adds and ~30 shuffles, not 16 separate horizontal sums).
inline void Scores(const float* q, const float* const* k, int64_t H, float* s) {
  __m512 a[kBlock];
  for (int j = 0; j < kBlock; ++j) a[j] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= H; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int j = 0; j < kBlock; ++j) a[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[j] + d), a[j]);
  }
  if (d < H) {  // the last H % 16 columns, masked
    const __mmask16 m = static_cast<__mmask16>((1u << (H - d)) - 1);
    const __m512 qd = _mm512_maskz_loadu_ps(m, q + d);
    for (int j = 0; j < kBlock; ++j)
      a[j] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(m, k[j] + d), a[j]);
  }
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: b_i = [key 2i: 8 sums | key 2i+1: 8 sums]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: c_i lane r = key 4i + r, 4 sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  // within lanes: lane r of e_i = [key 8i+r: 2 sums interleaved with key 8i+4+r]
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]),
                         _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  // lane r = [key r, key 4 + r, key 8 + r, key 12 + r]
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x44), _mm512_shuffle_ps(e[0], e[1], 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, f));
}
#else
inline void Scores(const float* q, const float* const* k, int64_t H, float* s) {
  for (int j = 0; j < kBlock; ++j) {
    Vec::F acc = Vec::Zero();
    int64_t d = 0;
    for (; d + kW <= H; d += kW) acc = Vec::Fma(Vec::Load(q + d), Vec::Load(k[j] + d), acc);
    float x = Vec::Sum(acc);
    for (; d < H; ++d) x += q[d] * k[j][d];
    s[j] = x;
  }
}
#endif

// acc = acc * c + sum_j p[j] * v_j  (H floats; p has kBlock entries, 0 where masked,
// and masked rows point at zeros, so nothing unowned is read)
inline void Accumulate(float* acc, float c, const float* p, const float* const* v, int64_t H) {
  int64_t d = 0;
  const Vec::F cv = Vec::Set1(c);
  for (; d + kW <= H; d += kW) {
    Vec::F a = Vec::Mul(Vec::Load(acc + d), cv);
    for (int j = 0; j < kBlock; ++j) a = Vec::Fma(Vec::Set1(p[j]), Vec::Load(v[j] + d), a);
    Vec::Store(acc + d, a);
  }
  for (; d < H; ++d) {
    float a = acc[d] * c;
    for (int j = 0; j < kBlock; ++j) a += p[j] * v[j][d];
    acc[d] = a;
  }
}

// p[j] = exp(s[j] - m) for the kBlock scores (s[j] = -inf gives 0).
inline void ExpShifted(const float* s, float m, float* p) {
  for (int j = 0; j < kBlock; j += kW) {
    const Vec::F x = Vec::Exp(Vec::Sub(Vec::Load(s + j), Vec::Set1(m)));
    Vec::Store(p + j, x);
  }
  for (int j = 0; j < kBlock; ++j)
    if (s[j] == kNegInf) p[j] = 0.0f;
}

struct Attention {
  const float* q;
  const void* kv;
  const float* scales;  // nullptr: float pages
  const int32_t* kv_lens;
  const int32_t* pages;
  const int32_t* cu_q;
  float* out;
  int64_t N, H, S, K, M;
  int64_t R;  // cache rows per KV head: 2 (K, V) or 1 (shared)
  float sm_scale;
  int32_t window;  // 0: none
  float soft_cap;  // 0: none
};

struct Item {
  int32_t seq, row0, row1, head;
};

template <typename T>
void AttendItem(const Attention& a, const Item& it, std::vector<float>& scratch) {
  const int64_t H = a.H, G = a.N / a.K, rows = it.row1 - it.row0, pairs = rows * G;
  const int64_t q_len = a.cu_q[it.seq + 1] - a.cu_q[it.seq], kv_len = a.kv_lens[it.seq];
  const int64_t first_pos = kv_len - q_len + (it.row0 - a.cu_q[it.seq]);
  const int64_t hi = first_pos + rows;  // one past the last position any row sees
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  // scratch: queries [pairs][H], acc [pairs][H], the block's keys and values
  // converted to float32 [kBlock][H] each (unless the pages are float32), a zero row
  scratch.resize((2 * pairs + 2 * kBlock + 1) * H);
  float* qs = scratch.data();
  float* acc = qs + pairs * H;
  float* kb = acc + pairs * H;
  float* vb = kb + kBlock * H;
  float* zeros = vb + kBlock * H;
  std::fill(zeros, zeros + H, 0.0f);
  const float* krows[kBlock];
  const float* vrows[kBlock];
  float m[kQueryTile * 64], l[kQueryTile * 64];  // G <= 64
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + ((it.row0 + r) * a.N + it.head * G + g) * H;
      float* dst = qs + (r * G + g) * H;
      for (int64_t d = 0; d < H; ++d) dst[d] = src[d] * a.sm_scale;
    }
  std::fill(acc, acc + pairs * H, 0.0f);
  std::fill(m, m + pairs, kNegInf);
  std::fill(l, l + pairs, 0.0f);
  const T* kv = static_cast<const T*>(a.kv);
  const int32_t* seq_pages = a.pages + it.seq * a.M;
  alignas(64) float s[kBlock], p[kBlock];
  for (int64_t t0 = lo / kBlock * kBlock; t0 < hi; t0 += kBlock) {
    for (int j = 0; j < kBlock; ++j) {
      const int64_t t = t0 + j;
      if (t < lo || t >= hi) {  // never read: another sequence's page, or unwritten
        krows[j] = vrows[j] = zeros;
        continue;
      }
      const int64_t row = (static_cast<int64_t>(seq_pages[t / a.S]) * a.S + t % a.S) * a.R * a.K;
      const int64_t key = row + a.R * it.head, value = key + a.R - 1;
      if constexpr (std::is_same_v<T, float>) {  // read in place
        krows[j] = kv + key * H;
        vrows[j] = kv + value * H;
      } else {
        ConvertRow(kv + key * H, a.scales ? a.scales[key] : 1.0f, kb + j * H, H);
        krows[j] = kb + j * H;
        vrows[j] = krows[j];  // (shared: the key is the value)
        if (value != key) {
          ConvertRow(kv + value * H, a.scales ? a.scales[value] : 1.0f, vb + j * H, H);
          vrows[j] = vb + j * H;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r;
      const int64_t see_from = a.window > 0 ? pos - a.window + 1 : 0;
      const int64_t from = std::max({t0, see_from, lo}), to = std::min(t0 + kBlock - 1, pos);
      if (from > to) continue;  // nothing of this block is visible to the row
      for (int64_t g = 0; g < G; ++g) {
        const int64_t pi = r * G + g;
        Scores(qs + pi * H, krows, H, s);
        float block_max = kNegInf;
        for (int j = 0; j < kBlock; ++j) {
          const int64_t t = t0 + j;
          if (t < from || t > to) {
            s[j] = kNegInf;
            continue;
          }
          if (a.soft_cap > 0.0f) s[j] = a.soft_cap * std::tanh(s[j] / a.soft_cap);
          block_max = std::max(block_max, s[j]);
        }
        const float m_new = std::max(m[pi], block_max);
        const float correction = m[pi] == kNegInf ? 0.0f : std::exp(m[pi] - m_new);
        ExpShifted(s, m_new, p);
        float sum = 0.0f;
        for (int j = 0; j < kBlock; ++j) sum += p[j];
        l[pi] = l[pi] * correction + sum;
        Accumulate(acc + pi * H, correction, p, vrows, H);
        m[pi] = m_new;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t pi = r * G + g;
      float* dst = a.out + ((it.row0 + r) * a.N + it.head * G + g) * H;
      const float inv = l[pi] > 0.0f ? 1.0f / l[pi] : 0.0f;
      for (int64_t d = 0; d < H; ++d) dst[d] = acc[pi * H + d] * inv;
    }
}

template <typename E>
ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                         const float* scales, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                         float sm_scale, int32_t sliding_window, float soft_cap, int32_t R) {
  auto qd = q.dimensions(), kd = kv.dimensions(), pd = pages.dimensions();
  if (R != 1 && R != 2)
    return ffi::Error::InvalidArgument("cpu attention: rows_per_head must be 1 or 2");
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || kd[2] % R || kd[3] != qd[2])
    return ffi::Error::InvalidArgument("cpu attention: want q [T, N, H], kv [P, S, R * K, H]");
  const int64_t T = qd[0], N = qd[1], H = qd[2], K = kd[2] / R;
  if (N % K || N / K > 64)
    return ffi::Error::InvalidArgument("cpu attention: N must be a multiple of K, N / K <= 64");
  Attention a{q.typed_data(), kv.untyped_data(), scales, kv_lens.typed_data(), pages.typed_data(),
              cu_q_lens.typed_data(), out->typed_data(), N, H, kd[1], K, pd[1], R, sm_scale,
              sliding_window, soft_cap};
  const int32_t b_count = std::min<int32_t>(num_seqs.typed_data()[0], pd[0]);
  std::vector<Item> items;
  for (int32_t b = 0; b < b_count; ++b)
    for (int32_t r = a.cu_q[b]; r < a.cu_q[b + 1]; r += kQueryTile)
      for (int32_t h = 0; h < K; ++h)
        items.push_back({b, r, std::min<int32_t>(r + kQueryTile, a.cu_q[b + 1]), h});
  const int64_t covered = b_count > 0 ? a.cu_q[b_count] : 0;
  std::fill(a.out + covered * N * H, a.out + T * N * H, 0.0f);  // padding rows
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&a, &items](int64_t i) {
    thread_local std::vector<float> scratch;
    AttendItem<E>(a, items[i], scratch);
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error FloatKv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                   ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> pages,
                   ffi::Buffer<ffi::S32> cu, ffi::Buffer<ffi::S32> n, ffi::ResultBuffer<ffi::F32> out,
                   float sm_scale, int32_t window, float cap, int32_t rows_per_head) {
  return AttentionImpl<T>(pool, q, kv, nullptr, kv_lens, pages, cu, n, out, sm_scale, window, cap,
                          rows_per_head);
}

template <typename T>
ffi::Error ScaledKv(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                    ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> kv_lens,
                    ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> cu, ffi::Buffer<ffi::S32> n,
                    ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t window, float cap,
                    int32_t rows_per_head) {
  return AttentionImpl<T>(pool, q, kv, scales.typed_data(), kv_lens, pages, cu, n, out, sm_scale,
                          window, cap, rows_per_head);
}

}  // namespace

// `scales` is empty for float pages and `.Arg<ffi::Buffer<ffi::F32>>()` (the page
// rows' scales) for int8 / fp8 ones.
#define JAXSERVE_ATTENTION(name, impl, scales)                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                            \
                                ffi::Ffi::Bind()                       \
                                    .Ctx<ffi::ThreadPool>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()      \
                                    .Arg<ffi::AnyBuffer>() scales      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>()      \
                                    .Attr<float>("sm_scale")           \
                                    .Attr<int32_t>("sliding_window")   \
                                    .Attr<float>("soft_cap")           \
                                    .Attr<int32_t>("rows_per_head"));
#define JAXSERVE_SCALES .Arg<ffi::Buffer<ffi::F32>>()

JAXSERVE_ATTENTION(JaxserveAttentionF32, FloatKv<float>, )
JAXSERVE_ATTENTION(JaxserveAttentionBf16, FloatKv<bf16_t>, )
JAXSERVE_ATTENTION(JaxserveAttentionS8, ScaledKv<int8_t>, JAXSERVE_SCALES)
JAXSERVE_ATTENTION(JaxserveAttentionF8e4m3fn, ScaledKv<F8E4M3>, JAXSERVE_SCALES)
JAXSERVE_ATTENTION(JaxserveAttentionF8e5m2, ScaledKv<F8E5M2>, JAXSERVE_SCALES)
