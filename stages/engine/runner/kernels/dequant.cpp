// A layer's dense weights, unpacked from its GGUF blocks just before a prompt chunk's GEMM.
//
// A prompt chunk of 128 rows or more runs its linears as a dense GEMM (oneDNN, bfloat16 where the
// CPU has native bfloat16 dot products): there that beats the block kernel. Keeping a dense copy of
// every layer for it would hold ~2x the model's bytes for the whole life of the process; unpacking
// one layer at a time into a scratch buffer holds one layer's, and the buffer is small enough to
// stay in the CPU's cache for the GEMM that reads it right after. The unpacking streams the Q4_1
// bytes (a quarter of bfloat16's), so a chunk reads less memory than it did from the copies.
//
// Input layout as quant_matmul.cpp's (tiles of 16 output rows; per tile and block of 32 weights,
// 64-byte chunks whose byte 4*r + i is element i of a group of four of row r): Q4_1 has four chunks
// (chunk c's low nibbles are elements 4c..4c+3, its high nibbles 16+4c..16+4c+3), Q8_0 eight (chunk
// g is elements 4g..4g+3, int8); fp16 scales (and Q4_1 mins) [tile][block][16]. Output: row-major
// [n][k], bfloat16 (rounded to nearest, ties to even, as torch's cast) or float32, values exactly
// d * q + m (Q4_1, multiplied then added) or d * q (Q8_0) in float32 before that rounding.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int QK = 32;
constexpr int TILE = 16;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
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

// float32 -> bfloat16, round to nearest even (the weights are finite: no NaN case).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element e (0..31) of row r's block, as an integer, from the chunked layout.
template <bool Q4>
inline int element(const uint8_t* blk, int r, int e) {
  if (Q4) {
    const int c = (e & 15) >> 2, i = e & 3;
    const uint8_t byte = blk[c * 64 + 4 * r + i];
    return e < 16 ? (byte & 0x0f) : (byte >> 4);
  }
  return static_cast<int8_t>(blk[(e >> 2) * 64 + 4 * r + (e & 3)]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Row r's 32 values of one block as two float vectors (elements 0..15, 16..31).
template <bool Q4>
inline void row_block(const uint8_t* blk, int r, float d, float m, __m512& lo, __m512& hi) {
  if (Q4) {
    // The four 4-byte groups of row r sit 64 bytes apart: together, bytes 0..15 are elements 0..15
    // in their low nibbles and 16..31 in their high ones.
    const __m128i v = _mm_set_epi32(*reinterpret_cast<const int32_t*>(blk + 192 + 4 * r),
                                    *reinterpret_cast<const int32_t*>(blk + 128 + 4 * r),
                                    *reinterpret_cast<const int32_t*>(blk + 64 + 4 * r),
                                    *reinterpret_cast<const int32_t*>(blk + 4 * r));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
    // Multiply, then add: two roundings, as the reference (quant.unpack_q4_1) computes it.
    lo = _mm512_add_ps(_mm512_mul_ps(q0, _mm512_set1_ps(d)), _mm512_set1_ps(m));
    hi = _mm512_add_ps(_mm512_mul_ps(q1, _mm512_set1_ps(d)), _mm512_set1_ps(m));
  } else {
    int32_t g[8];
    for (int c = 0; c < 8; ++c) g[c] = *reinterpret_cast<const int32_t*>(blk + c * 64 + 4 * r);
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
    const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 4));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0)), _mm512_set1_ps(d));
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1)), _mm512_set1_ps(d));
  }
}

// Round-to-nearest-even to bfloat16, in integer arithmetic (what to_bf16 does, 16 lanes).
inline __m256i bf16_of(__m512 f) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
#else
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_cvtepi32_epi16(r);
#endif
}
#endif

template <bool Q4, bool BF16>
void unpack_tile(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t k, int64_t t,
                 int64_t n, void* out) {
  const int64_t chunk_bytes = Q4 ? 4 * 64 : 8 * 64;
  const int rows = static_cast<int>(n - t * TILE < TILE ? n - t * TILE : TILE);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wq + (t * nb + b) * chunk_bytes;
    const uint16_t* d16 = wd + (t * nb + b) * TILE;
    const uint16_t* m16 = Q4 ? wm + (t * nb + b) * TILE : nullptr;
    for (int r = 0; r < rows; ++r) {
      const float d = half_to_float(d16[r]), m = Q4 ? half_to_float(m16[r]) : 0.0f;
      const int64_t at = (t * TILE + r) * k + b * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      __m512 lo, hi;
      row_block<Q4>(blk, r, d, m, lo, hi);
      if (BF16) {
        uint16_t* o = static_cast<uint16_t*>(out) + at;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_of(lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), bf16_of(hi));
      } else {
        float* o = static_cast<float*>(out) + at;
        _mm512_storeu_ps(o, lo);
        _mm512_storeu_ps(o + 16, hi);
      }
#else
      for (int e = 0; e < QK; ++e) {
        const float w = Q4 ? d * static_cast<float>(element<true>(blk, r, e)) + m
                           : d * static_cast<float>(element<false>(blk, r, e));
        if (BF16) {
          static_cast<uint16_t*>(out)[at + e] = to_bf16(w);
        } else {
          static_cast<float*>(out)[at + e] = w;
        }
      }
#endif
    }
  }
}

template <bool Q4, bool BF16>
void unpack(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t n, int64_t k, void* out,
            int threads) {
  const int64_t tiles = (n + TILE - 1) / TILE, nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
  for (int64_t t = 0; t < tiles; ++t) unpack_tile<Q4, BF16>(wq, wd, wm, nb, k, t, n, out);
}

}  // namespace

extern "C" {

// Q4_1 blocks in the tile layout -> out [n, k] row-major, bfloat16 (bf16 != 0) or float32.
void lifecycle_unpack_q4_1(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t n, int64_t k,
                           void* out, int32_t bf16, int32_t threads) {
  if (bf16) {
    unpack<true, true>(wq, wd, wm, n, k, out, threads);
  } else {
    unpack<true, false>(wq, wd, wm, n, k, out, threads);
  }
}

// The same for Q8_0 blocks.
void lifecycle_unpack_q8_0(const int8_t* wq, const uint16_t* wd, int64_t n, int64_t k, void* out, int32_t bf16,
                           int32_t threads) {
  const auto* q = reinterpret_cast<const uint8_t*>(wq);
  if (bf16) {
    unpack<false, true>(q, wd, nullptr, n, k, out, threads);
  } else {
    unpack<false, false>(q, wd, nullptr, n, k, out, threads);
  }
}

}  // extern "C"
