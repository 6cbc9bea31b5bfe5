// A probe, not a Quire kernel (benchmarks/int8_activations.py builds it): what multiplying
// int4 weights by int8 activations would buy on AVX2, as llama.cpp does with Q8_1 activations.
// u8 weights (0..15) x s8 activations with vpmaddubsw; a group of 32 values of k fits its
// 16-bit sums (8 steps x 2 x 15 x 127 < 32767), then one vpmaddwd to 32 bits and the group's
// scales in float: acc += (sum of q x_q) s_w d_x + m_w (sum of the group's activations).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// R rows of x by one block of 16 output columns. W: [K/4][16][4] u8 (four values of k per
// column, the vpmaddubsw pair layout); sw / mw: [K/32][16] float scale and min.
template <int R>
void tile(const int8_t* a, const float* da, const float* xs, const uint8_t* w, const float* sw,
          const float* mw, float* c, int k, int n, int row0, int block) {
  const int groups = k / 32;
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wb = w + int64_t(block) * (k / 4) * 64;
  const float* sb = sw + int64_t(block) * groups * 16;
  const float* mb = mw + int64_t(block) * groups * 16;
  for (int g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int kk = 0; kk < 8; ++kk) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + (g * 8 + kk) * 64));
      const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + (g * 8 + kk) * 64 + 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a + int64_t(row0 + r) * k + g * 32 + kk * 4, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xb));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xb));
      }
    }
    const __m256 s0 = _mm256_load_ps(sb + g * 16), s1 = _mm256_load_ps(sb + g * 16 + 8);
    const __m256 m0 = _mm256_load_ps(mb + g * 16), m1 = _mm256_load_ps(mb + g * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(da[int64_t(row0 + r) * groups + g]);
      const __m256 x = _mm256_set1_ps(xs[int64_t(row0 + r) * groups + g]);
      const __m256 i0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][0], ones));
      const __m256 i1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][1], ones));
      f[r][0] = _mm256_fmadd_ps(i0, _mm256_mul_ps(s0, d), _mm256_fmadd_ps(m0, x, f[r][0]));
      f[r][1] = _mm256_fmadd_ps(i1, _mm256_mul_ps(s1, d), _mm256_fmadd_ps(m1, x, f[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + int64_t(row0 + r) * n + block * 16, f[r][0]);
    _mm256_storeu_ps(c + int64_t(row0 + r) * n + block * 16 + 8, f[r][1]);
  }
}

}  // namespace

// c [m, n] = x w^T with x [m, k] as int8 a and per-(row, group) scales da and sums xs
extern "C" void probe_int8_gemm(const int8_t* a, const float* da, const float* xs,
                                const uint8_t* w, const float* sw, const float* mw, float* c,
                                int m, int k, int n) {
#pragma omp parallel for schedule(static)
  for (int block = 0; block < n / 16; ++block) {
    int r = 0;
    for (; r + 4 <= m; r += 4) tile<4>(a, da, xs, w, sw, mw, c, k, n, r, block);
    for (; r < m; ++r) tile<1>(a, da, xs, w, sw, mw, c, k, n, r, block);
  }
}
