#include <immintrin.h>
#include <chrono>
#include <cstdio>
#define D(a) a=_mm512_dpbusd_epi32(a,w,x);
int main(){
  __m512i a0=_mm512_set1_epi32(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0;
  __m512i w=_mm512_set1_epi8(3), x=_mm512_set1_epi8(1);
  long N=50000000;
  auto t0=std::chrono::steady_clock::now();
  for(long n=0;n<N;n++){ D(a0)D(a1)D(a2)D(a3)D(a4)D(a5)D(a6)D(a7)D(a8)D(a9) }
  auto t1=std::chrono::steady_clock::now();
  double s=std::chrono::duration<double>(t1-t0).count();
  __m512i t=_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(_mm512_add_epi32(a6,a7),_mm512_add_epi32(a8,a9))));
  printf("%d dpbusd zmm/s %.2f G -> %.0f GOP/s; per cycle at 2.6GHz %.2f\n", _mm512_reduce_add_epi32(t)&1, N*10/s/1e9, N*10*128/s/1e9, N*10/s/2.6e9);
}
