// y = x @ W.T on the GGUF's own block-quantised weights, with integer dot products.
//
// The activations are quantised per row in blocks of 32 to int8 with one float scale each (what
// llama.cpp calls Q8_1 / Q8_0): dx = max|x| / 127, qx = round(x / dx), sx = dx * sum(qx). Then,
// per block of 32 weights,
//   Q4_1 (w = d * q + m, q in 0..15):  sum w*x ~= d * dx * dot(q, qx) + m * sx
//   Q8_0 (w = d * q, q in -127..127):  sum w*x ~= d * dx * dot(q, qx)
// The only rounding besides the file's own quantisation is qx's, as in llama.cpp.
//
// Layout (repacked at load by quant.py): output rows in tiles of 16, so one integer vector holds
// the partial sums of 16 output rows and no horizontal sums are needed. For tile t and block b,
// 64-byte chunks hold, at byte 4*n + i, element i of a group of four consecutive weights of row n:
//   Q4_1: 4 chunks; chunk c's low nibbles are group c (elements 4c..4c+3), high nibbles group c+4.
//   Q8_0: 8 chunks; chunk g is group g, int8.
// The scales are fp16 [tile][block][16]. A dot product step multiplies a chunk by one group of four
// activations broadcast to all lanes: AVX512-VNNI's vpdpbusd where the CPU has it, AVX-VNNI's on
// 8 lanes, AVX2's maddubs/madd otherwise, plain C without AVX2. Built with -march=native for the machine at hand
// (see __init__.py); accumulation is int32 within a block and float32 across blocks.
//
// With AVX-512, one kernel call covers 4 activation rows against 2 tiles, so each broadcast feeds
// two dot products, and the activations are quantised with vector code (AVX2 too): scalar, that rounding was
// a quarter of a 32-row matmul's time. The arithmetic per block is unchanged (bit-identical output).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 32;    // weights and activations per block
constexpr int TILE = 16;  // output rows per tile

inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

struct Activations {
  std::vector<int8_t> qx;    // [rows][k]
  std::vector<float> dx;     // [rows][k/32]
  std::vector<float> sx;     // [rows][k/32]: dx * sum(qx)
  std::vector<int32_t> qs;   // [rows][k/32]: sum(qx)
};

// Activations to int8 blocks (thread-local scratch, reused across calls). Rounding is to nearest,
// ties to even, in both paths (nearbyint and cvtps2dq under the default MXCSR), so they agree bit for bit.
// Blocks are independent, so a prompt step's many rows split over the matmul's threads (one thread
// took ~10 ms of a 406-token prompt step here, while the matmul after it ran on two); the result is
// the same whatever the split.
Activations& quantize(const float* x, int rows, int64_t k, int threads = 1) {
  thread_local Activations a;
  const int64_t nb = k / QK;
  a.qx.resize(static_cast<size_t>(rows) * k);
  a.dx.resize(static_cast<size_t>(rows) * nb);
  a.sx.resize(static_cast<size_t>(rows) * nb);
  a.qs.resize(static_cast<size_t>(rows) * nb);
  Activations& out = a;  // the caller's scratch, shared with the team (thread_local is per thread)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * nb >= 2048)
  for (int64_t rb = 0; rb < rows * nb; ++rb) {
    const float* xb = x + rb * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // One block is two vectors (four with AVX2): no per-element scalar work (the scalar loop below
    // ran at ~4 ns an element).
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qx.data() + rb * QK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qx.data() + rb * QK + 16), _mm512_cvtsepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
    __m256 v[4];
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                             _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
    // Pack 32 int32 to 32 int8 (the packs interleave 128-bit lanes; the permute restores the order).
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qx.data() + rb * QK),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    const int sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
#else
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < QK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * inv));
      out.qx[rb * QK + i] = static_cast<int8_t>(q);
      sum += q;
    }
#endif
    out.dx[rb] = d;
    out.sx[rb] = d * static_cast<float>(sum);
    out.qs[rb] = sum;
  }
  return a;
}

inline int32_t group4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LIFECYCLE_QUANT_ISA 3
#define LIFECYCLE_MULTI_TILE 1
// RN activation rows against T consecutive tiles (16*T output rows), all blocks. Each broadcast group
// of four activations feeds T dot products: broadcasts, not dot products, bounded the one-tile
// version (measured: with them taken out it ran 2.7x faster on Zen). The int32 sums of a block are
// scaled into float accumulators once per block, as the per-block scales require.
template <int RN, int T, bool Q4>
void tile(const Activations& a, int64_t row0, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
          int64_t t0, float* out, int64_t out_stride, int64_t n) {
  const int64_t nb = k / QK;
  constexpr int CHUNKS = Q4 ? 4 : 8;
  __m512 acc[RN][T];
  for (int r = 0; r < RN; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0f), bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb[RN];
    for (int r = 0; r < RN; ++r) xb[r] = a.qx.data() + ((row0 + r) * nb + b) * QK;
    __m512i s[RN][T];
    for (int r = 0; r < RN; ++r)
      for (int t = 0; t < T; ++t) s[r][t] = _mm512_setzero_si512();
    if (Q4) {
      for (int c = 0; c < 4; ++c) {
        __m512i lo[T], hi[T];
        for (int t = 0; t < T; ++t) {
          const __m512i v = _mm512_loadu_si512(wq + (((t0 + t) * nb + b) * CHUNKS + c) * 64);
          lo[t] = _mm512_and_si512(v, nib);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
        for (int r = 0; r < RN; ++r) {
          const __m512i xl = _mm512_set1_epi32(group4(xb[r] + 4 * c)), xh = _mm512_set1_epi32(group4(xb[r] + 4 * c + 16));
          for (int t = 0; t < T; ++t) {
            s[r][t] = _mm512_dpbusd_epi32(s[r][t], lo[t], xl);
            s[r][t] = _mm512_dpbusd_epi32(s[r][t], hi[t], xh);
          }
        }
      }
    } else {
      // vpdpbusd takes unsigned x signed: w + 128 as unsigned, corrected by 128 * sum(qx) below.
      for (int g = 0; g < 8; ++g) {
        __m512i w[T];
        for (int t = 0; t < T; ++t)
          w[t] = _mm512_xor_si512(_mm512_loadu_si512(wq + (((t0 + t) * nb + b) * CHUNKS + g) * 64), bias128);
        for (int r = 0; r < RN; ++r) {
          const __m512i xg = _mm512_set1_epi32(group4(xb[r] + 4 * g));
          for (int t = 0; t < T; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], w[t], xg);
        }
      }
    }
    __m512 d[T], m[T];
    for (int t = 0; t < T; ++t) {
      const int64_t tb = (t0 + t) * nb + b;
      d[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + tb * TILE)));
      m[t] = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wm + tb * TILE)))
                : _mm512_setzero_ps();
    }
    for (int r = 0; r < RN; ++r) {
      const int64_t rb = (row0 + r) * nb + b;
      const __m512 dx = _mm512_set1_ps(a.dx[rb]), sx = _mm512_set1_ps(a.sx[rb]);
      const __m512i corr = _mm512_set1_epi32(128 * a.qs[rb]);
      for (int t = 0; t < T; ++t) {
        const __m512i si = Q4 ? s[r][t] : _mm512_sub_epi32(s[r][t], corr);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d[t], dx), acc[r][t]);
        if (Q4) acc[r][t] = _mm512_fmadd_ps(m[t], sx, acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t valid = n - (t0 + t) * TILE;
    const __mmask16 mask = valid >= TILE ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < RN; ++r) _mm512_mask_storeu_ps(out + (row0 + r) * out_stride + (t0 + t) * TILE, mask, acc[r][t]);
  }
}
#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define LIFECYCLE_QUANT_ISA 2
#else
#define LIFECYCLE_QUANT_ISA 1
#endif
// The same with two 8-lane halves per tile (maddubs: u8 x s8 -> int16 pair sums). Each broadcast of
// four activations feeds both halves. Q4_1 sums a block's products in int16 and widens once per
// block: a pair sum is at most 2 * 15 * 127 = 3810 and a block adds eight of them per lane (30480),
// so nothing saturates or wraps, and a quarter of the instructions go. Q8_0 uses |w| and moves w's
// sign onto x, so both operands stay within 127 and each pair sum fits; two would not, so it widens
// per group. With AVX-VNNI (Alder Lake and later, Zen 5) one vpdpbusd on 8 lanes does a
// maddubs + madd + add: the same integer sums in int32 throughout (bit-identical output).
template <int RN, bool Q4>
void tile(const Activations& a, int64_t row0, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
          int64_t t, float* out, int64_t out_stride, int64_t n_valid) {
  const int64_t nb = k / QK;
  constexpr int CHUNKS = Q4 ? 4 : 8;
  __m256 acc[RN][2];
  for (int r = 0; r < RN; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t tb = t * nb + b;
    const uint8_t* chunk = wq + tb * CHUNKS * 64;
    const int8_t* xb[RN];
    for (int r = 0; r < RN; ++r) xb[r] = a.qx.data() + ((row0 + r) * nb + b) * QK;
    __m256i s[RN][2];
    for (int r = 0; r < RN; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    if (Q4) {
      for (int c = 0; c < 4; ++c) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + c * 64));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + c * 64 + 32));
        const __m256i lo0 = _mm256_and_si256(v0, nib), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
        const __m256i lo1 = _mm256_and_si256(v1, nib), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
        for (int r = 0; r < RN; ++r) {
          const __m256i xl = _mm256_set1_epi32(group4(xb[r] + 4 * c)), xh = _mm256_set1_epi32(group4(xb[r] + 4 * c + 16));
#if defined(__AVXVNNI__)
          s[r][0] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s[r][0], lo0, xl), hi0, xh);
          s[r][1] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s[r][1], lo1, xl), hi1, xh);
#else
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh)));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh)));
#endif
        }
      }
#if !defined(__AVXVNNI__)
      for (int r = 0; r < RN; ++r) {
        s[r][0] = _mm256_madd_epi16(s[r][0], ones);
        s[r][1] = _mm256_madd_epi16(s[r][1], ones);
      }
#endif
    } else {
      for (int g = 0; g < 8; ++g) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + g * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + g * 64 + 32));
        const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
        for (int r = 0; r < RN; ++r) {
          const __m256i x = _mm256_set1_epi32(group4(xb[r] + 4 * g));
#if defined(__AVXVNNI__)
          s[r][0] = _mm256_dpbusd_avx_epi32(s[r][0], a0, _mm256_sign_epi8(x, w0));
          s[r][1] = _mm256_dpbusd_avx_epi32(s[r][1], a1, _mm256_sign_epi8(x, w1));
#else
          s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
          s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
#endif
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + tb * TILE + h * 8)));
      __m256 m = _mm256_setzero_ps();
      if (Q4) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + tb * TILE + h * 8)));
      for (int r = 0; r < RN; ++r) {
        const int64_t rb = (row0 + r) * nb + b;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(a.dx[rb])), acc[r][h]);
        if (Q4) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[rb]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < RN; ++r) {
    alignas(32) float tmp[TILE];
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    for (int64_t n = 0; n < n_valid && n < TILE; ++n) out[(row0 + r) * out_stride + t * TILE + n] = tmp[n];
  }
}
#else
#define LIFECYCLE_QUANT_ISA 0
template <int RN, bool Q4>
void tile(const Activations& a, int64_t row0, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
          int64_t t, float* out, int64_t out_stride, int64_t n_valid) {
  const int64_t nb = k / QK;
  constexpr int CHUNKS = Q4 ? 4 : 8;
  for (int r = 0; r < RN; ++r)
    for (int64_t n = 0; n < n_valid && n < TILE; ++n) {
      float total = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t tb = t * nb + b, rb = (row0 + r) * nb + b;
        const int8_t* xb = a.qx.data() + rb * QK;
        const uint8_t* chunk = wq + tb * CHUNKS * 64;
        int s = 0;
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i) {
            const int q = Q4 ? (chunk[(g % 4) * 64 + 4 * n + i] >> (g < 4 ? 0 : 4)) & 0x0f
                             : static_cast<int8_t>(chunk[g * 64 + 4 * n + i]);
            s += q * xb[4 * g + i];
          }
        total += fp16_to_f32(wd[tb * TILE + n]) * a.dx[rb] * static_cast<float>(s);
        if (Q4) total += fp16_to_f32(wm[tb * TILE + n]) * a.sx[rb];
      }
      out[(row0 + r) * out_stride + t * TILE + n] = total;
    }
}
#endif

#ifdef LIFECYCLE_MULTI_TILE
constexpr int RN_MAX = 4;   // rows per kernel call
constexpr int T_MAX = 2;    // tiles per kernel call (each broadcast feeds T_MAX dot products)
// All rows against T tiles from t0.
template <int T, bool Q4>
void rows_x_tiles(const Activations& a, int rows, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                  int64_t t0, float* out, int64_t out_stride, int64_t n) {
  int r = 0;
  for (; r + RN_MAX <= rows; r += RN_MAX) tile<RN_MAX, T, Q4>(a, r, k, wq, wd, wm, t0, out, out_stride, n);
  for (; r + 2 <= rows; r += 2) tile<2, T, Q4>(a, r, k, wq, wd, wm, t0, out, out_stride, n);
  if (r < rows) tile<1, T, Q4>(a, r, k, wq, wd, wm, t0, out, out_stride, n);
}

template <bool Q4>
void matmul(const float* x, int rows, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
            int64_t n, float* out, int64_t out_stride, int threads) {
  const Activations& a = quantize(x, rows, k, threads);
  const int64_t tiles = (n + TILE - 1) / TILE;
  if (rows == 1) {
    // One row is bound by streaming the weights, not by broadcasts: one tile at a time, one stream
    // (what batch-1 decode measured best with).
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) tile<1, 1, Q4>(a, 0, k, wq, wd, wm, t, out, out_stride, n);
    return;
  }
  const int64_t groups = (tiles + T_MAX - 1) / T_MAX;
  // Static split of the tile groups: each thread streams its own contiguous part of the weights.
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 1)
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t t0 = gi * T_MAX;
    if (t0 + T_MAX <= tiles) {
      rows_x_tiles<T_MAX, Q4>(a, rows, k, wq, wd, wm, t0, out, out_stride, n);
    } else {
      for (int64_t t = t0; t < tiles; ++t) rows_x_tiles<1, Q4>(a, rows, k, wq, wd, wm, t, out, out_stride, n);
    }
  }
}
#else
template <bool Q4>
void matmul(const float* x, int rows, int64_t k, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
            int64_t n, float* out, int64_t out_stride, int threads) {
  const Activations& a = quantize(x, rows, k, threads);
  const int64_t tiles = (n + TILE - 1) / TILE;
  // Static split of the tiles: each thread streams its own contiguous part of the weights.
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t valid = n - t * TILE;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) tile<4, Q4>(a, r, k, wq, wd, wm, t, out, out_stride, valid);
    switch (rows - r) {
      case 3: tile<3, Q4>(a, r, k, wq, wd, wm, t, out, out_stride, valid); break;
      case 2: tile<2, Q4>(a, r, k, wq, wd, wm, t, out, out_stride, valid); break;
      case 1: tile<1, Q4>(a, r, k, wq, wd, wm, t, out, out_stride, valid); break;
      default: break;
    }
  }
}

#endif

}  // namespace

extern "C" {

// x: [rows, k] float32 contiguous, k a multiple of 32. wq: [ceil(n/16), k/32, 4, 64] (Q4_1 nibbles,
// the tile layout above); wd, wm: [ceil(n/16), k/32, 16] fp16. out: [rows, n] float32, row stride
// out_stride.
void lifecycle_q4_1_matmul(const float* x, int32_t rows, int64_t k, const uint8_t* wq, const uint16_t* wd,
                           const uint16_t* wm, int64_t n, float* out, int64_t out_stride, int32_t threads) {
  matmul<true>(x, rows, k, wq, wd, wm, n, out, out_stride, threads);
}

// The same for Q8_0: wq [ceil(n/16), k/32, 8, 64] int8, wd [ceil(n/16), k/32, 16] fp16.
void lifecycle_q8_0_matmul(const float* x, int32_t rows, int64_t k, const int8_t* wq, const uint16_t* wd,
                           int64_t n, float* out, int64_t out_stride, int32_t threads) {
  matmul<false>(x, rows, k, reinterpret_cast<const uint8_t*>(wq), wd, nullptr, n, out, out_stride, threads);
}

// The activation quantisation alone (for the parity tests' reference): qx [rows, k], dx [rows, k/32].
void lifecycle_quantize_q8(const float* x, int32_t rows, int64_t k, int8_t* qx, float* dx) {
  const Activations& a = quantize(x, rows, k);
  std::memcpy(qx, a.qx.data(), a.qx.size());
  std::memcpy(dx, a.dx.data(), a.dx.size() * sizeof(float));
}

// Which dot-product path this build uses: 3 AVX512-VNNI, 1 AVX2, 0 plain C.
int32_t lifecycle_quant_isa() { return LIFECYCLE_QUANT_ISA; }

// The library's ABI version (kernels/__init__.py checks it).
int32_t lifecycle_kernels_abi_version() { return 2; }

}  // extern "C"
