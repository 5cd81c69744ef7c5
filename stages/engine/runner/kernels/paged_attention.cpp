// Decode attention straight over the paged KV cache: no gather, no padding mask.
//
// One query token per sequence (a decode step). For sequence b and KV head h, the query heads
// h*G .. h*G+G-1 (G = heads / kv_heads, grouped-query attention) read the K/V rows of positions
// 0 .. context_len[b]-1, found through the block table: slot(p) = table[b][p / bs] * bs + p % bs.
// Each K and V row is read once for all G query heads. Two passes over the scores (max, then
// exp and sum) keep the softmax exact up to float rounding; accumulation is in float32.
//
// With AVX-512 and head_dim 64 (SmolLM2's, and many small models'), groups of 1 to 4 query heads per
// KV head take a path that keeps the G queries and the G output accumulators in registers for the
// whole context: about 0.55-0.8x the time of the generic loops below (measured: 32 sequences of 80 and
// 170 tokens, float32 and bfloat16 caches), whose per-head partial sums go through memory.
//
// Built at run time for the machine at hand (g++ -O3 -march=native, see __init__.py), called
// through ctypes, which releases the GIL for the call. Plain C ABI: no torch headers, so the
// build takes about a second.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t bf16) {  // bfloat16 is the top half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 in a form the compiler vectorises: 2^t = 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by its degree-7 Taylor polynomial (relative error below 1e-8, under float32's epsilon).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// exp(s - m) in place over one head's scores, given their maximum m; returns 1 / their sum.
inline float softmax_in_place(float* sg, int32_t ctx, float m) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int32_t p = 0; p < ctx; ++p) {
    const float e = exp_nonpositive(sg[p] - m);
    sg[p] = e;
    sum += e;
  }
  return 1.0f / sum;
}

// HD > 0: the head dimension as a compile-time constant (fully unrolled dot products); 0: runtime.
template <typename T, int HD>
void decode_one(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                const int32_t* table, int32_t ctx, int32_t block_size, int32_t kv_heads, int32_t kv_head,
                int32_t group, int32_t head_dim_rt, float scale, float* out, int64_t out_head_stride,
                std::vector<float>& scores) {
  const int32_t head_dim = HD > 0 ? HD : head_dim_rt;
  const int64_t row = static_cast<int64_t>(kv_heads) * head_dim;  // one slot's K (or V) row
  scores.resize(static_cast<size_t>(group) * ctx);
  std::vector<float> qs(static_cast<size_t>(group) * head_dim);
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d) qs[g * head_dim + d] = q[g * q_head_stride + d] * scale;

  // Pass 1: scores, block by block (the slots of one block are consecutive rows).
  for (int32_t p0 = 0; p0 < ctx; p0 += block_size) {
    const int64_t base = static_cast<int64_t>(table[p0 / block_size]) * block_size;
    const int32_t n = std::min(block_size, ctx - p0);
    for (int32_t i = 0; i < n; ++i) {
      const T* k = k_cache + (base + i) * row + static_cast<int64_t>(kv_head) * head_dim;
      for (int g = 0; g < group; ++g) {
        const float* qg = qs.data() + g * head_dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int d = 0; d < head_dim; ++d) s += qg[d] * to_f32(k[d]);
        scores[g * ctx + p0 + i] = s;
      }
    }
  }
  // Softmax per query head.
  std::vector<float> inv_sum(group);
  for (int g = 0; g < group; ++g) {
    float* sg = scores.data() + static_cast<int64_t>(g) * ctx;
    float m = sg[0];
    for (int32_t p = 1; p < ctx; ++p) m = std::max(m, sg[p]);
    inv_sum[g] = softmax_in_place(sg, ctx, m);
  }
  // Pass 2: the weighted sum of V rows.
  std::vector<float> acc(static_cast<size_t>(group) * head_dim, 0.0f);
  for (int32_t p0 = 0; p0 < ctx; p0 += block_size) {
    const int64_t base = static_cast<int64_t>(table[p0 / block_size]) * block_size;
    const int32_t n = std::min(block_size, ctx - p0);
    for (int32_t i = 0; i < n; ++i) {
      const T* v = v_cache + (base + i) * row + static_cast<int64_t>(kv_head) * head_dim;
      for (int g = 0; g < group; ++g) {
        const float w = scores[g * ctx + p0 + i];
        float* ag = acc.data() + g * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) ag[d] += w * to_f32(v[d]);
      }
    }
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d) out[g * out_head_stride + d] = acc[g * head_dim + d] * inv_sum[g];
}

#if defined(__AVX512F__)
#define LIFECYCLE_ATTN_FAST 1
// Four float32 vectors of one K or V row (head_dim 64), from float32 or bfloat16.
inline void load_row(const float* p, __m512 r[4]) {
  for (int c = 0; c < 4; ++c) r[c] = _mm512_loadu_ps(p + 16 * c);
}
inline void load_row(const uint16_t* p, __m512 r[4]) {
  for (int c = 0; c < 4; ++c)
    r[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c))), 16));
}

// decode_one for head_dim 64 and a compile-time group G: the G queries and the G output
// accumulators live in registers for the whole context (4 G vectors each), so a K or V row is
// loaded once and used G times with no memory traffic for the partial sums.
template <typename T, int G>
void decode_one_64(const float* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                   const int32_t* table, int32_t ctx, int32_t block_size, int32_t kv_heads, int32_t kv_head,
                   float scale, float* out, int64_t out_head_stride, std::vector<float>& scores) {
  constexpr int HD = 64;
  const int64_t row = static_cast<int64_t>(kv_heads) * HD;
  scores.resize(static_cast<size_t>(G) * ctx);
  __m512 qv[G][4];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_head_stride + 16 * c), sc);
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int32_t p0 = 0; p0 < ctx; p0 += block_size) {
    const int64_t base = static_cast<int64_t>(table[p0 / block_size]) * block_size;
    const int32_t n = std::min(block_size, ctx - p0);
    for (int32_t i = 0; i < n; ++i) {
      __m512 k[4];
      load_row(k_cache + (base + i) * row + static_cast<int64_t>(kv_head) * HD, k);
      for (int g = 0; g < G; ++g) {
        __m512 t = _mm512_mul_ps(qv[g][0], k[0]);
        t = _mm512_fmadd_ps(qv[g][1], k[1], t);
        t = _mm512_fmadd_ps(qv[g][2], k[2], t);
        t = _mm512_fmadd_ps(qv[g][3], k[3], t);
        const float s = _mm512_reduce_add_ps(t);
        scores[g * ctx + p0 + i] = s;
        mx[g] = std::max(mx[g], s);
      }
    }
  }
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_in_place(scores.data() + static_cast<int64_t>(g) * ctx, ctx, mx[g]);
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int32_t p0 = 0; p0 < ctx; p0 += block_size) {
    const int64_t base = static_cast<int64_t>(table[p0 / block_size]) * block_size;
    const int32_t n = std::min(block_size, ctx - p0);
    for (int32_t i = 0; i < n; ++i) {
      __m512 v[4];
      load_row(v_cache + (base + i) * row + static_cast<int64_t>(kv_head) * HD, v);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * ctx + p0 + i]);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * out_head_stride + 16 * c, _mm512_mul_ps(acc[g][c], inv));
  }
}
#endif

template <typename T, int HD>
void decode_all(const float* q, int64_t q_seq_stride, const void* k_cache, const void* v_cache,
                const int32_t* tables, int32_t table_width, const int32_t* ctx_lens, int32_t num_seqs,
                int32_t block_size, int32_t heads, int32_t kv_heads, int32_t head_dim, float scale,
                float* out, int32_t num_threads) {
  const int32_t group = heads / kv_heads;
  const int64_t work = static_cast<int64_t>(num_seqs) * kv_heads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work > 1)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
      const int32_t b = static_cast<int32_t>(w / kv_heads), h = static_cast<int32_t>(w % kv_heads);
      const int64_t first_head = static_cast<int64_t>(h) * group;
      const float* qb = q + b * q_seq_stride + first_head * head_dim;
      float* ob = out + (static_cast<int64_t>(b) * heads + first_head) * head_dim;
      const int32_t* tb = tables + static_cast<int64_t>(b) * table_width;
#ifdef LIFECYCLE_ATTN_FAST
#define LIFECYCLE_FAST_GROUP(G)                                                                          \
  if (HD == 64 && group == G) {                                                                          \
    decode_one_64<T, G>(qb, head_dim, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), tb, \
                        ctx_lens[b], block_size, kv_heads, h, scale, ob, head_dim, scores);              \
    continue;                                                                                            \
  }
      LIFECYCLE_FAST_GROUP(1) LIFECYCLE_FAST_GROUP(2) LIFECYCLE_FAST_GROUP(3) LIFECYCLE_FAST_GROUP(4)
#undef LIFECYCLE_FAST_GROUP
#endif
      decode_one<T, HD>(qb, head_dim, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), tb,
                        ctx_lens[b], block_size, kv_heads, h, group, head_dim, scale, ob, head_dim, scores);
    }
  }
}

}  // namespace

extern "C" {

// q: [num_seqs, heads, head_dim] float32, sequence stride q_seq_stride (elements; heads are
// contiguous within a sequence). k_cache, v_cache: [slots, kv_heads, head_dim], contiguous, float32
// (cache_bf16 = 0) or bfloat16 (cache_bf16 = 1). tables: [num_seqs, table_width] int32. ctx_lens:
// [num_seqs] int32, each >= 1. out: [num_seqs, heads, head_dim] float32, contiguous.
void lifecycle_paged_decode_attention(const float* q, int64_t q_seq_stride, const void* k_cache,
                                      const void* v_cache, int32_t cache_bf16, const int32_t* tables,
                                      int32_t table_width, const int32_t* ctx_lens, int32_t num_seqs,
                                      int32_t block_size, int32_t heads, int32_t kv_heads, int32_t head_dim,
                                      float scale, float* out, int32_t num_threads) {
#define LIFECYCLE_DECODE(T, HD)                                                                    \
  decode_all<T, HD>(q, q_seq_stride, k_cache, v_cache, tables, table_width, ctx_lens, num_seqs, block_size, heads, \
                    kv_heads, head_dim, scale, out, num_threads)
  if (cache_bf16) {
    if (head_dim == 64) LIFECYCLE_DECODE(uint16_t, 64);
    else if (head_dim == 128) LIFECYCLE_DECODE(uint16_t, 128);
    else LIFECYCLE_DECODE(uint16_t, 0);
  } else {
    if (head_dim == 64) LIFECYCLE_DECODE(float, 64);
    else if (head_dim == 128) LIFECYCLE_DECODE(float, 128);
    else LIFECYCLE_DECODE(float, 0);
  }
#undef LIFECYCLE_DECODE
}


}  // extern "C"
