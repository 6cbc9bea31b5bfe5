// Weight-only quantized matmul for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] in float32, where
// w is stored as int8 (w = q * scale) or int4 (w = (q - 8) * scale + zero), one scale (and
// zero) per group of G consecutive k of one output row.
//
// Layout (made by quant_matmul.py's pack_*): output rows are padded to a multiple of 16 and
// cut into row blocks of 16; inside a block the 16 rows are interleaved so one vector load
// holds the same k of all 16 rows:
//   int8  q[block][k][16]       one byte per weight
//   int4  q[block][k / 2][16]   the file's own byte per row: low nibble k even, high k odd
//   scales / zeros [block][k / G][16] float32
// Each weight is dequantized exactly as dequantize-then-matmul does it (q * s, or one fused
// (q - 8) * s + z) and multiplied in float32 with FMA, so the only difference from the
// reference is the summation order. One vector of 16 output rows serves up to kTile rows of x.
//
// Vector paths: AVX-512 (16 lanes), AVX2 (two 8-lane halves), plain C++ otherwise; all three
// share one kernel through the small V type below. OpenMP over row blocks, with the thread
// count the caller passes (torch's), never more. Plain C++ with a C ABI, called via ctypes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

constexpr int kRows = 16;  // output rows per block: one V

// V: 16 float lanes, one per output row of a block.
#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kTile = 8;  // rows of x per pass: 8 accumulators + temporaries fit 32 registers
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V load_int8(const int8_t* p) {  // 16 bytes -> 16 floats
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
inline void load_int4(const uint8_t* p, V& even, V& odd) {  // 16 bytes -> q - 8 of k, k + 1
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i eight = _mm512_set1_epi32(8);
  even.v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), eight));
  odd.v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
constexpr int kTile = 4;  // 16 registers: 4 x 2 accumulators + temporaries
struct V {
  __m256 lo, hi;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline V load_int8(const int8_t* p) { return {int8x8(p), int8x8(p + 8)}; }
inline void int4x8(const uint8_t* p, __m256& even, __m256& odd) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i eight = _mm256_set1_epi32(8);
  even = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
  odd = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
inline void load_int4(const uint8_t* p, V& even, V& odd) {
  int4x8(p, even.lo, odd.lo);
  int4x8(p + 8, even.hi, odd.hi);
}
#else
constexpr const char* kIsa = "scalar";
constexpr int kTile = 4;
struct V {
  float f[kRows];
};
inline V vzero() { return V{}; }
inline V vset(float a) {
  V r;
  for (int i = 0; i < kRows; ++i) r.f[i] = a;
  return r;
}
inline V vload(const float* p) {
  V r;
  std::memcpy(r.f, p, sizeof r.f);
  return r;
}
inline void vstore(float* p, V a) { std::memcpy(p, a.f, sizeof a.f); }
inline V vmul(V a, V b) {
  for (int i = 0; i < kRows; ++i) a.f[i] *= b.f[i];
  return a;
}
inline V vfma(V a, V b, V c) {
  for (int i = 0; i < kRows; ++i) c.f[i] = __builtin_fmaf(a.f[i], b.f[i], c.f[i]);
  return c;
}
inline V load_int8(const int8_t* p) {
  V r;
  for (int i = 0; i < kRows; ++i) r.f[i] = p[i];
  return r;
}
inline void load_int4(const uint8_t* p, V& even, V& odd) {
  for (int i = 0; i < kRows; ++i) {
    even.f[i] = float(int(p[i] & 15) - 8);
    odd.f[i] = float(int(p[i] >> 4) - 8);
  }
}
#endif

// One row block against MT rows of x (x rows K floats apart): acc[m][r] = y[m, block row r].
template <int MT>
void int8_block(const float* x, int64_t K, int G, const int8_t* q, const float* scales,
                float* out) {
  V acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += G) {
    const V s = vload(scales + (k0 / G) * kRows);
    for (int64_t k = k0; k < k0 + G; ++k) {
      const V w = vmul(load_int8(q + k * kRows), s);
      for (int m = 0; m < MT; ++m) acc[m] = vfma(vset(x[m * K + k]), w, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, acc[m]);
}

template <int MT>
void int4_block(const float* x, int64_t K, int G, const uint8_t* q, const float* scales,
                const float* zeros, float* out) {
  V acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += G) {
    const V s = vload(scales + (k0 / G) * kRows), z = vload(zeros + (k0 / G) * kRows);
    for (int64_t k = k0; k < k0 + G; k += 2) {
      V even, odd;
      load_int4(q + (k / 2) * kRows, even, odd);
      even = vfma(even, s, z);
      odd = vfma(odd, s, z);
      for (int m = 0; m < MT; ++m) {
        acc[m] = vfma(vset(x[m * K + k]), even, acc[m]);
        acc[m] = vfma(vset(x[m * K + k + 1]), odd, acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, acc[m]);
}

// Calls Block<MT>::run for MT = mt (1..kTile) with the rest of the arguments.
template <template <int> class Block, typename... Args>
void dispatch_tile(int mt, Args... args) {
  switch (mt) {
    case 1: Block<1>::run(args...); break;
    case 2: Block<2>::run(args...); break;
    case 3: Block<3>::run(args...); break;
    case 4: Block<4>::run(args...); break;
#if defined(__AVX512F__)
    case 5: Block<5>::run(args...); break;
    case 6: Block<6>::run(args...); break;
    case 7: Block<7>::run(args...); break;
    case 8: Block<8>::run(args...); break;
#endif
    default: break;
  }
}

template <int MT>
struct Int8Block {
  static void run(const float* x, int64_t K, int G, const int8_t* q, const float* s,
                  const float* /*zeros*/, float* out) {
    int8_block<MT>(x, K, G, q, s, out);
  }
};

template <int MT>
struct Int4Block {
  static void run(const float* x, int64_t K, int G, const uint8_t* q, const float* s,
                  const float* z, float* out) {
    int4_block<MT>(x, K, G, q, s, z, out);
  }
};

// x as float32 rows: the caller's own memory when it is float32, else a converted copy.
const float* float_rows(const void* x, int dtype, int64_t count, std::vector<float>& copy) {
  if (dtype == 0) return static_cast<const float*>(x);
  copy.resize(count);
  const uint16_t* src = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < count; ++i) copy[i] = bf16_to_float(src[i]);
  return copy.data();
}

void store_rows(const float* tile, int mt, int rows, void* y, int dtype, int64_t N, int64_t m0,
                int64_t n0) {
  for (int m = 0; m < mt; ++m) {
    const float* src = tile + m * kRows;
    if (dtype == 0) {
      std::memcpy(static_cast<float*>(y) + (m0 + m) * N + n0, src, rows * sizeof(float));
    } else {
      uint16_t* dst = static_cast<uint16_t*>(y) + (m0 + m) * N + n0;
      for (int r = 0; r < rows; ++r) dst[r] = float_to_bf16(src[r]);
    }
  }
}

// QBytes: bytes of q per k per row block (16 for int8, 8 for int4).
template <template <int> class Block, typename Q>
int linear(const void* x, void* y, int64_t M, int dtype, int threads, const Q* q,
           const float* scales, const float* zeros, int64_t N, int64_t K, int64_t G,
           int64_t q_block_stride) {
  if (dtype != 0 && dtype != 1) return 1;
  if (M <= 0 || N <= 0) return 0;
  std::vector<float> copy;
  const float* xf = float_rows(x, dtype, M * K, copy);
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t s_block_stride = (K / G) * kRows;
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    alignas(64) float tile[kTile * kRows];
    const int rows = static_cast<int>(std::min<int64_t>(kRows, N - b * kRows));
    for (int64_t m0 = 0; m0 < M; m0 += kTile) {
      const int mt = static_cast<int>(std::min<int64_t>(kTile, M - m0));
      dispatch_tile<Block>(mt, xf + m0 * K, K, static_cast<int>(G), q + b * q_block_stride,
                           scales + b * s_block_stride,
                           zeros ? zeros + b * s_block_stride : nullptr, tile);
      store_rows(tile, mt, rows, y, dtype, N, m0, b * kRows);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Which vector path this build took: "avx512", "avx2" or "scalar".
const char* quire_quant_matmul_isa() { return kIsa; }

// y [M, N] (dtype 0 = float32, 1 = bfloat16, like x [M, K]) = x @ dequant(W)^T. Returns 0, or
// 1 for an unknown dtype. K % G == 0 (and G even for int4) is checked by the caller.
int quire_int8_linear(const void* x, void* y, int64_t M, int dtype, int threads,
                      const int8_t* q, const float* scales, int64_t N, int64_t K, int64_t G) {
  return linear<Int8Block>(x, y, M, dtype, threads, q, scales, nullptr, N, K, G, K * kRows);
}

int quire_int4_linear(const void* x, void* y, int64_t M, int dtype, int threads,
                      const uint8_t* q, const float* scales, const float* zeros, int64_t N,
                      int64_t K, int64_t G) {
  return linear<Int4Block>(x, y, M, dtype, threads, q, scales, zeros, N, K, G, K / 2 * kRows);
}

}  // extern "C"
