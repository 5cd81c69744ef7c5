// The cores' int8 multiply-accumulate peak, operands in registers: what the instruction set allows
// before memory or a kernel's layout gets in the way. Each thread runs independent accumulator
// chains of the widest int8 dot-product instruction the build targets:
//   AVX-512 VNNI  vpdpbusd zmm   64 u8 x s8 products summed into int32   (128 ops)
//   AVX-VNNI      vpdpbusd ymm   32                                       (64 ops)
//   AVX2          vpmaddubsw ymm 32 products summed pairwise into int16, + vpaddw (64 ops)
// Empty or explicit asm keeps the compiler from hoisting anything out of the loop, and each
// thread's sum goes to sink[thread], so none of it is dead. Returns the int8 operations done (2 per
// product), or 0 where the build has none of these instruction sets.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

extern "C" const char* lifecycle_int8_peak_isa() {
#if defined(__AVX512VNNI__)
    return "avx512-vnni vpdpbusd";
#elif defined(__AVXVNNI__)
    return "avx-vnni vpdpbusd";
#elif defined(__AVX2__)
    return "avx2 vpmaddubsw";
#else
    return "none";
#endif
}

extern "C" int64_t lifecycle_int8_peak(int64_t iters, int32_t threads, int32_t* sink) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512VNNI__)
        __m512i a0 = _mm512_set1_epi8(1), a1 = _mm512_set1_epi8(3);
        __m512i b0 = _mm512_set1_epi8(2), b1 = _mm512_set1_epi8(4), b2 = _mm512_set1_epi8(5), b3 = _mm512_set1_epi8(6);
        __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int64_t i = 0; i < iters; ++i) {
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(b0), "+v"(b1), "+v"(b2), "+v"(b3));
            c0 = _mm512_dpbusd_epi32(c0, a0, b0); c1 = _mm512_dpbusd_epi32(c1, a0, b1);
            c2 = _mm512_dpbusd_epi32(c2, a0, b2); c3 = _mm512_dpbusd_epi32(c3, a0, b3);
            c4 = _mm512_dpbusd_epi32(c4, a1, b0); c5 = _mm512_dpbusd_epi32(c5, a1, b1);
            c6 = _mm512_dpbusd_epi32(c6, a1, b2); c7 = _mm512_dpbusd_epi32(c7, a1, b3);
        }
        __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                     _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
        sink[omp_get_thread_num()] = _mm512_reduce_add_epi32(s);
        total += iters * 8 * 128;
#elif defined(__AVXVNNI__)
        // One instruction per product and accumulator, so two A and two B operands feed 8 chains.
        __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(3), b0 = _mm256_set1_epi8(2), b1 = _mm256_set1_epi8(4);
        __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        for (int64_t i = 0; i < iters; ++i) {
            __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(b0), "+x"(b1));
            c0 = _mm256_dpbusd_avx_epi32(c0, a0, b0); c1 = _mm256_dpbusd_avx_epi32(c1, a0, b1);
            c2 = _mm256_dpbusd_avx_epi32(c2, a1, b0); c3 = _mm256_dpbusd_avx_epi32(c3, a1, b1);
            c4 = _mm256_dpbusd_avx_epi32(c4, a0, b0); c5 = _mm256_dpbusd_avx_epi32(c5, a0, b1);
            c6 = _mm256_dpbusd_avx_epi32(c6, a1, b0); c7 = _mm256_dpbusd_avx_epi32(c7, a1, b1);
        }
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                     _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
        sink[omp_get_thread_num()] = _mm256_extract_epi32(s, 0);
        total += iters * 8 * 64;
#elif defined(__AVX2__)
        // The product is its own instruction, so 6 distinct products (2 A x 3 B) feed 6 accumulators
        // (16 registers: more would spill).
        __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(3);
        __m256i b0 = _mm256_set1_epi8(2), b1 = _mm256_set1_epi8(4), b2 = _mm256_set1_epi8(5);
        __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
        // Written in asm: from C the compiler keeps all six products live at once and spills an
        // accumulator, whose store-to-load latency then bounds the loop.
        for (int64_t i = 0; i < iters; ++i) {
            __asm__ volatile(
                "vpmaddubsw %[b0], %[a0], %%ymm14\n\tvpaddw %%ymm14, %[c0], %[c0]\n\t"
                "vpmaddubsw %[b1], %[a0], %%ymm15\n\tvpaddw %%ymm15, %[c1], %[c1]\n\t"
                "vpmaddubsw %[b2], %[a0], %%ymm14\n\tvpaddw %%ymm14, %[c2], %[c2]\n\t"
                "vpmaddubsw %[b0], %[a1], %%ymm15\n\tvpaddw %%ymm15, %[c3], %[c3]\n\t"
                "vpmaddubsw %[b1], %[a1], %%ymm14\n\tvpaddw %%ymm14, %[c4], %[c4]\n\t"
                "vpmaddubsw %[b2], %[a1], %%ymm15\n\tvpaddw %%ymm15, %[c5], %[c5]"
                : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5)
                : [a0] "x"(a0), [a1] "x"(a1), [b0] "x"(b0), [b1] "x"(b1), [b2] "x"(b2)
                : "xmm14", "xmm15");
        }
        __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                     _mm256_add_epi16(c4, c5));
        sink[omp_get_thread_num()] = _mm256_extract_epi16(s, 0);
        total += iters * 6 * 64;
#else
        (void)iters;
#endif
    }
    return total;
}
