// The CPU's float32 FMA peak (benchmarks/machine.py builds it): independent FMA chains, enough
// of them to hide the latency, on every thread at once; nothing read from memory. What a
// compute-bound kernel can reach at most, beside torch's GEMM (which reaches part of it).
#include <immintrin.h>
#include <omp.h>

#include <chrono>

namespace {
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float first(Vec a) { return _mm512_cvtss_f32(a); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vset(float a) { return _mm256_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float first(Vec a) { return _mm256_cvtss_f32(a); }
#else
using Vec = float;
constexpr int kLanes = 1;
inline Vec vset(float a) { return a; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float first(Vec a) { return a; }
#endif
constexpr int kChains = 12;  // > latency (4-5 cycles) x FMA pipes (2)
}  // namespace

extern "C" {

// GFLOP/s of `steps` rounds of kChains FMAs on each of `threads` threads (2 FLOP a lane)
double quire_fma_peak_gflops(int threads, long steps) {
  float sink = 0.f;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    Vec acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = vset(0.001f * i);
    const Vec b = vset(0.999f), c = vset(1e-4f);
    for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = vfma(acc[i], b, c);
    }
    for (int i = 1; i < kChains; ++i) acc[0] = vfma(acc[i], b, acc[0]);
    sink += first(acc[0]);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return sink == 12345.f ? 0.0 : 2.0 * kLanes * kChains * steps * threads / seconds / 1e9;
}
}
