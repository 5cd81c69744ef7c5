// Every decoder layer of a step whose rows are all single-token queries, in one call.
//
// A decode step at a few rows is mostly fixed cost: per layer, two norms, four matmuls, RoPE, the
// cache writes, attention and the residual adds are each a torch op or a ctypes call with its own
// dispatch, allocation and argument checks (about 25 per layer, 750 per step for 30 layers: as long
// as the matmuls themselves at batch 1). Here the whole layer stack is a loop over plain buffers that
// calls the block-quantised matmul and the paged attention of this library directly; only the
// embedding, the RoPE tables and the final norm and LM head stay with torch (once per step).
//
// The arithmetic is the torch path's, op for op: float32 RMSNorm (x * rsqrt(mean(x^2) + eps) * w),
// rotate-half RoPE as x * cos + roll(x, d/2) * signed_sin, K/V rounded to the cache's dtype (bfloat16
// round-to-nearest-even, as torch's cast), matmuls with int8 activations, silu(g) * u, float32
// residual adds. Sums run in another order than torch's vectorised reductions, so results agree to
// float rounding, not bit for bit.
//
// Weights come as a table of addresses, NPTR per layer (see LayerPtr), built once at load from the
// model's own buffers; a null "mins" address marks a Q8_0 matmul, otherwise Q4_1.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
void lifecycle_q4_1_matmul(const float* x, int32_t rows, int64_t k, const uint8_t* wq, const uint16_t* wd,
                           const uint16_t* wm, int64_t n, float* out, int64_t out_stride, int32_t threads);
void lifecycle_q8_0_matmul(const float* x, int32_t rows, int64_t k, const int8_t* wq, const uint16_t* wd,
                           int64_t n, float* out, int64_t out_stride, int32_t threads);
void lifecycle_paged_decode_attention(const float* q, int64_t q_seq_stride, const void* k_cache,
                                      const void* v_cache, int32_t cache_bf16, const int32_t* tables,
                                      int32_t table_width, const int32_t* ctx_lens, int32_t num_seqs,
                                      int32_t block_size, int32_t heads, int32_t kv_heads, int32_t head_dim,
                                      float scale, float* out, int32_t num_threads);
}

namespace {

// The per-layer address table, in this order.
enum LayerPtr : int {
  IN_NORM, QKV_Q, QKV_D, QKV_M, O_Q, O_D, O_M, GU_Q, GU_D, GU_M, DOWN_Q, DOWN_D, DOWN_M, POST_NORM,
  K_CACHE, V_CACHE, NPTR
};

template <typename P>
inline P at(const int64_t* layer, int i) {
  return reinterpret_cast<P>(static_cast<intptr_t>(layer[i]));
}

// y = x @ W.T for the matmul whose three buffers start at index q of the layer's table.
void linear(const int64_t* layer, int q, const float* x, int rows, int64_t k, int64_t n, float* out, int threads) {
  const auto* wq = at<const uint8_t*>(layer, q);
  const auto* wd = at<const uint16_t*>(layer, q + 1);
  const auto* wm = at<const uint16_t*>(layer, q + 2);
  if (wm != nullptr) {
    lifecycle_q4_1_matmul(x, rows, k, wq, wd, wm, n, out, n, threads);
  } else {
    lifecycle_q8_0_matmul(x, rows, k, reinterpret_cast<const int8_t*>(wq), wd, n, out, n, threads);
  }
}

// torch's float32 RMSNorm: x * rsqrt(mean(x^2) + eps), then times the weight.
void rms_norm(const float* x, const float* w, int rows, int dim, float eps, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * dim;
    float* o = out + static_cast<int64_t>(r) * dim;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int i = 0; i < dim; ++i) o[i] = (xr[i] * inv) * w[i];
  }
}

// Rotate-half RoPE in place over `count` heads of one row: x * cos + roll(x, d/2) * sin, where sin
// carries the sign of rotate_half (its first half negated).
void rope(float* x, int count, int d, const float* cos, const float* sin, float* tmp) {
  const int half = d / 2;
  for (int h = 0; h < count; ++h) {
    float* v = x + static_cast<int64_t>(h) * d;
    for (int i = 0; i < d; ++i) tmp[i] = v[i < half ? i + half : i - half];
#pragma omp simd
    for (int i = 0; i < d; ++i) v[i] = v[i] * cos[i] + tmp[i] * sin[i];
  }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's cast; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void store_kv(void* cache, int cache_bf16, int64_t slot, const float* src, int n) {
  if (cache_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(cache) + slot * n;
    for (int i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
  } else {
    std::memcpy(static_cast<float*>(cache) + slot * n, src, sizeof(float) * static_cast<size_t>(n));
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

extern "C" {

// x: [rows, hidden] float32, the residual stream after the embedding; updated in place to the last
// layer's output. layers: [num_layers][NPTR] addresses. cos, sin: [rows, head_dim] float32 (sin
// signed, see rope). slots: [rows] int64 cache slots of the rows' own tokens. tables, ctx_lens,
// block_size: as lifecycle_paged_decode_attention. The caches are [slots, kv_heads, head_dim].
void lifecycle_decode_layers(float* x, int32_t rows, int32_t hidden, int32_t heads, int32_t kv_heads,
                             int32_t head_dim, int32_t intermediate, int32_t num_layers, const int64_t* layers,
                             float eps, const float* cos, const float* sin, const int64_t* slots,
                             int32_t cache_bf16, const int32_t* tables, int32_t table_width,
                             const int32_t* ctx_lens, int32_t block_size, float scale, int32_t threads) {
  const int q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_n = q_size + 2 * kv_size;
  thread_local std::vector<float> h, qkv, attn, gu, act, y, tmp;
  const size_t r = static_cast<size_t>(rows);
  h.resize(r * hidden);
  qkv.resize(r * qkv_n);
  attn.resize(r * q_size);
  gu.resize(r * 2 * intermediate);
  act.resize(r * intermediate);
  y.resize(r * hidden);
  tmp.resize(head_dim);
  for (int l = 0; l < num_layers; ++l) {
    const int64_t* layer = layers + static_cast<int64_t>(l) * NPTR;
    void* k_cache = at<void*>(layer, K_CACHE);
    void* v_cache = at<void*>(layer, V_CACHE);
    rms_norm(x, at<const float*>(layer, IN_NORM), rows, hidden, eps, h.data());
    linear(layer, QKV_Q, h.data(), rows, hidden, qkv_n, qkv.data(), threads);
    for (int b = 0; b < rows; ++b) {
      float* row = qkv.data() + static_cast<int64_t>(b) * qkv_n;
      rope(row, heads + kv_heads, head_dim, cos + static_cast<int64_t>(b) * head_dim,
           sin + static_cast<int64_t>(b) * head_dim, tmp.data());
      // Written before attention reads the cache, so each row sees its own token.
      store_kv(k_cache, cache_bf16, slots[b], row + q_size, kv_size);
      store_kv(v_cache, cache_bf16, slots[b], row + q_size + kv_size, kv_size);
    }
    lifecycle_paged_decode_attention(qkv.data(), qkv_n, k_cache, v_cache, cache_bf16, tables, table_width, ctx_lens,
                                     rows, block_size, heads, kv_heads, head_dim, scale, attn.data(), threads);
    linear(layer, O_Q, attn.data(), rows, q_size, hidden, y.data(), threads);
    for (size_t i = 0; i < r * hidden; ++i) x[i] += y[i];
    rms_norm(x, at<const float*>(layer, POST_NORM), rows, hidden, eps, h.data());
    linear(layer, GU_Q, h.data(), rows, hidden, 2 * intermediate, gu.data(), threads);
    for (int b = 0; b < rows; ++b) {
      const float* g = gu.data() + static_cast<int64_t>(b) * 2 * intermediate;
      float* a = act.data() + static_cast<int64_t>(b) * intermediate;
      for (int i = 0; i < intermediate; ++i) a[i] = silu(g[i]) * g[intermediate + i];
    }
    linear(layer, DOWN_Q, act.data(), rows, intermediate, hidden, y.data(), threads);
    for (size_t i = 0; i < r * hidden; ++i) x[i] += y[i];
  }
}

int32_t lifecycle_decode_layers_nptr() { return NPTR; }

}  // extern "C"
