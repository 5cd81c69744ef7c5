// Greedy decoding's argmax over each row of the logits, as one vector scan per row.
//
// Why: torch's CPU argmax over a decode step's logits ([32, 49,152] for SmolLM2 at 32 streams)
// took 1.5-1.9 ms on one thread, about 1 ns an element, 2-3% of the whole step; this scan reads
// each element once with 16-lane compares (0.21 ms, measured).
//
// Semantics are torch's, so the tokens cannot change: the first index of the maximum, and a NaN
// counts as the maximum (the first NaN's index). Built for the machine at hand (see __init__.py):
// 16 lanes with AVX-512, 8 with AVX2; a plain C build leaves torch's argmax in place
// (:func:`lifecycle_argmax_vectorized`).

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

// The lanes' maxima to one: the greatest value, the lowest index among equals.
[[maybe_unused]] inline void best_of_lanes(const float* vals, const int32_t* ids, int lanes, float& best,
                                           int64_t& best_i) {
  best = vals[0];
  best_i = ids[0];
  for (int l = 1; l < lanes; ++l)
    if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) {
      best = vals[l];
      best_i = ids[l];
    }
}

int64_t argmax_row(const float* x, int64_t n) {
  if (n <= 0) return 0;
  int64_t i = 0, best_i = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 bv = _mm512_loadu_ps(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = bi;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);  // strictly greater: the first index stays
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, idx);
    }
    if (nan) return first_nan(x, n);
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, bv);
    _mm512_store_si512(ids, bi);
    best_of_lanes(vals, ids, 16, best, best_i);
  } else {
    i = 1;
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    // The same scan in 8 lanes: compares give all-ones lanes, blends take the greater ones.
    __m256 bv = _mm256_loadu_ps(x);
    __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i idx = bi;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
      bv = _mm256_blendv_ps(bv, v, gt);
      bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(idx), gt));
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, n);
    alignas(32) float vals[8];
    alignas(32) int32_t ids[8];
    _mm256_store_ps(vals, bv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ids), bi);
    best_of_lanes(vals, ids, 8, best, best_i);
  } else {
    i = 1;
  }
#else
  i = 1;
#endif
  if (std::isnan(best)) return first_nan(x, n);
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return first_nan(x, n);
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  return best_i;
}

}  // namespace

extern "C" {

// out[r] = the argmax of row r of x ([rows, n] float32, rows ``stride`` floats apart).
void lifecycle_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t stride, int64_t* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, n);
}

// 1 where this build scans with vectors (else the scan is scalar: no faster than torch's).
int32_t lifecycle_argmax_vectorized() {
#if defined(__AVX512F__) || defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}


}  // extern "C"
