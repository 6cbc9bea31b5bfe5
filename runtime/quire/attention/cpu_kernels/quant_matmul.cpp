// Weight-only quantized matmul for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] in float32, with
// w stored as int8 or int4 and one scale (and offset) per group of G consecutive k of a row.
//
// Weight forms (quant_matmul.py's pack_* picks one and checks it gives the same values):
//   0 int8            w = q * s                  q int8
//   1 int4 symmetric  w = (q - 8) * s            q stored XOR 0x88: each nibble read as a
//   2 int4 zero       w = (q - 8) * s + z        signed 4-bit number is q - 8
//   3 int4 min        w = q * s + m              q as is (GGUF Q4_1: s = d, m = m)
// Scales and offsets are float32, or float16 where every one of them is exactly a float16
// (GGUF's own d and m always are): half the bytes of the scale traffic.
//
// Layout: output rows padded to a multiple of 16 and cut into row blocks of 16; inside a
// block one k of all 16 rows is contiguous, so one vector load feeds 16 output rows:
//   int8  q[block][k][16]       int4  q[block][k / 2][16] (a row's byte: low nibble k even)
//   scales / offsets [block][k / G][16]
//
// Up to kStreamRows rows of x (decode), each group is summed exactly as float32 allows:
// part = sum_k x[k] * q'[k] with q' the small integer (q, or q - 8) converted exactly, then
// y += s * part (+ offset * sum_k x[k]). Beyond them (prefill, batched decode), float32 x
// multiplies the dequantized weights (expand_block), the same floats as dequantize(). Against
// dequantize-then-matmul either only moves where float32 rounds (see the test's bound); no
// value is quantized or rounded to a narrower type. Several independent accumulator chains
// per row of x keep the FMA units busy at M = 1 (one chain would wait on FMA latency).
//
// Vector paths: AVX-512 (16 lanes), AVX2 (two 8-lane halves), plain C++ otherwise; all three
// share the kernel through the small V type. Where the CPU has AVX512-BF16, bfloat16 x uses
// its dot product instead (int4 always, int8 beyond 8 rows of x; the integers are exact
// bfloat16 values, products exact, sums float32: same rounding, half the instructions). No AMX. OpenMP over row blocks with the thread count the caller passes
// (torch's: the same libgomp and pool once torch is loaded). Plain C++ with a C ABI, called
// through ctypes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "bf16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Form { kInt8 = 0, kInt4Symmetric = 1, kInt4Zero = 2, kInt4Min = 3 };

using quire_bf16::bf16_to_float;
using quire_bf16::float_to_bf16;

inline float half_to_float(uint16_t h) {  // exact: every float16 is a float32
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int kRows = 16;  // output rows per block: one V

// V: 16 float lanes, one per output row of a block.
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512-bf16";  // + the bfloat16 dot product for int4 x bf16
#else
constexpr const char* kIsa = "avx512";
#endif
constexpr int kTile = 8;    // rows of x per pass over a row block
constexpr int kExpandedTile = 8;  // the same over an expanded block (prefill)
constexpr int kStreamRows = kTile;  // calls of up to this many x rows are not expanded
constexpr int kChains = 4;  // independent accumulators per pass (FMA latency x throughput)
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vload(const uint16_t* p) {  // float16
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline __m512i bytes16(const uint8_t* p, bool sign) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}
inline V load_int8(const uint8_t* p) { return {_mm512_cvtepi32_ps(bytes16(p, true))}; }
inline void load_int4(const uint8_t* p, V& even, V& odd) {  // unsigned nibbles
  const __m512i b = bytes16(p, false);
  even.v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  odd.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline void load_sint4(const uint8_t* p, V& even, V& odd) {  // signed nibbles
  const __m512i b = bytes16(p, true);
  even.v = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28));
  odd.v = _mm512_cvtepi32_ps(_mm512_srai_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
constexpr int kTile = 2;    // 16 registers: accumulators of two 8-lane halves each
// an expanded block needs no registers for unpacking: 6 rows of x are 12 accumulators, plus
// the two halves of w and a broadcast x: 15 of the 16 registers (BLIS's 6 x 16 AVX2 shape).
// On the 2-core AVX2 EPYC (builds of each tile size called in turn on the same weights,
// bit-identical outputs) 6 rows ran 1.5-1.8x faster than 4 at M = 8-512; 5 was no better
// than 4, and 7 and 8 (spilling) in between.
constexpr int kExpandedTile = 6;
// Calls of up to 5 rows of x stream too, in tiles of 2 (the block's bytes stay in L1 for the
// next tile): expanding every block costs ~10 ms over SmolLM2's 120 int4 matmuls, more than
// these few rows multiply. On the AVX2 EPYC (builds alternated, medians of 9) M = 3 / 4 / 5
// ran 18.8 / 21.5 / 14.7 ms expanded and 11.9 / 11.1 / 12.6 streamed; at 6 they tie.
constexpr int kStreamRows = 5;
constexpr int kChains = 4;  // at M = 1: 4 x (lo, hi) = 8 chains, FMA latency x 2 pipes
struct V {
  __m256 lo, hi;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vload(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256i bytes8(const uint8_t* p, bool sign) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
inline V load_int8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(bytes8(p, true)), _mm256_cvtepi32_ps(bytes8(p + 8, true))};
}
inline void nibbles8(const uint8_t* p, bool sign, __m256& even, __m256& odd) {
  const __m256i b = bytes8(p, sign);
  if (sign) {
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 4));
  } else {
    even = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
}
inline void load_int4(const uint8_t* p, V& even, V& odd) {
  nibbles8(p, false, even.lo, odd.lo);
  nibbles8(p + 8, false, even.hi, odd.hi);
}
inline void load_sint4(const uint8_t* p, V& even, V& odd) {
  nibbles8(p, true, even.lo, odd.lo);
  nibbles8(p + 8, true, even.hi, odd.hi);
}
#else
constexpr const char* kIsa = "scalar";
constexpr int kTile = 2;
constexpr int kExpandedTile = 2;
constexpr int kStreamRows = kTile;
constexpr int kChains = 2;
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
inline V vload(const uint16_t* p) {
  V r;
  for (int i = 0; i < kRows; ++i) r.f[i] = half_to_float(p[i]);
  return r;
}
inline void vstore(float* p, V a) { std::memcpy(p, a.f, sizeof a.f); }
inline V vadd(V a, V b) {
  for (int i = 0; i < kRows; ++i) a.f[i] += b.f[i];
  return a;
}
inline V vmul(V a, V b) {
  for (int i = 0; i < kRows; ++i) a.f[i] *= b.f[i];
  return a;
}
inline V vfma(V a, V b, V c) {
  for (int i = 0; i < kRows; ++i) c.f[i] = __builtin_fmaf(a.f[i], b.f[i], c.f[i]);
  return c;
}
inline V load_int8(const uint8_t* p) {
  V r;
  for (int i = 0; i < kRows; ++i) r.f[i] = static_cast<int8_t>(p[i]);
  return r;
}
inline void load_int4(const uint8_t* p, V& even, V& odd) {
  for (int i = 0; i < kRows; ++i) {
    even.f[i] = float(p[i] & 15);
    odd.f[i] = float(p[i] >> 4);
  }
}
inline void load_sint4(const uint8_t* p, V& even, V& odd) {  // nibble n holds (q - 8) ^ 8
  for (int i = 0; i < kRows; ++i) {
    even.f[i] = float(((p[i] & 15) ^ 8) - 8);
    odd.f[i] = float(((p[i] >> 4) ^ 8) - 8);
  }
}
#endif

struct Weight {
  const uint8_t* q;
  const void* scales;   // float or uint16_t (float16)
  const void* offsets;  // z or m, same type; unused by forms 0 and 1
  int64_t N, K, G;
};

// part[m] += sum over k in [k0, k1) of x[m, k] * q'[k] (one row block), U chains per row.
template <int Form, int MT>
inline void group_sums(const float* x, int64_t K, const uint8_t* q, int64_t k0, int64_t k1,
                       V* part) {
  constexpr int U = kChains / MT > 1 ? kChains / MT : 1;
  V chain[U][MT];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m) chain[u][m] = vzero();
  if (Form == kInt8) {
    int64_t k = k0;
    for (; k + U <= k1; k += U)
      for (int u = 0; u < U; ++u) {
        const V w = load_int8(q + (k + u) * kRows);
        for (int m = 0; m < MT; ++m) chain[u][m] = vfma(vset(x[m * K + k + u]), w, chain[u][m]);
      }
    for (; k < k1; ++k) {  // a per-channel G that U does not divide
      const V w = load_int8(q + k * kRows);
      for (int m = 0; m < MT; ++m) chain[0][m] = vfma(vset(x[m * K + k]), w, chain[0][m]);
    }
  } else {  // k0, k1 even and G a multiple of 2 U (groups of 32, 64, 128)
    for (int64_t k = k0; k < k1; k += 2 * U)
      for (int u = 0; u < U; ++u) {
        V even, odd;
        const uint8_t* p = q + (k / 2 + u) * kRows;
        if (Form == kInt4Min) load_int4(p, even, odd); else load_sint4(p, even, odd);
        const int64_t kk = k + 2 * u;
        for (int m = 0; m < MT; ++m) {
          chain[u][m] = vfma(vset(x[m * K + kk]), even, chain[u][m]);
          chain[u][m] = vfma(vset(x[m * K + kk + 1]), odd, chain[u][m]);
        }
      }
  }
  for (int m = 0; m < MT; ++m) {
    V sum = chain[0][m];
    for (int u = 1; u < U; ++u) sum = vadd(sum, chain[u][m]);
    part[m] = sum;
  }
}

#if defined(__AVX512BF16__)
// The same sums for int4 weights and bfloat16 x with the AVX512-BF16 dot product: a nibble is
// looked up as the bfloat16 of q' (exact: a small integer), x[k] * q' is exact in float32 (8 +
// 4 significant bits) and each pair is added in float32 with round-to-nearest, so this
// path rounds like the float one, at half the instructions. (The instruction reads subnormal
// inputs, below 1.2e-38, as zero.) A row's byte holds its k and k + 1, which is the
// instruction's pair layout already.
template <int Form>
inline __m512i nibble_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const int value = Form == kInt4Min ? (i & 15) : ((i & 15) ^ 8) - 8;
    table[i] = float_to_bf16(static_cast<float>(value));
  }
  return _mm512_load_si512(table);
}

template <int Form, int MT>
inline void group_sums(const uint16_t* x, int64_t K, const uint8_t* q, int64_t k0, int64_t k1,
                       V* part, __m512i table) {
  constexpr int U = kChains / MT > 1 ? kChains / MT : 1;
  __m512 chain[U][MT];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m) chain[u][m] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2 * U)
    for (int u = 0; u < U; ++u) {
      // word 2r = row r's low nibble, word 2r + 1 its high one (vpermw reads 5 index bits:
      // the table repeats, so the other nibble's bit above does not matter)
      const __m512i b = bytes16(q + (k / 2 + u) * kRows, false);
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(
          _mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
      const int64_t kk = k + 2 * u;
      for (int m = 0; m < MT; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + kk, sizeof pair);
        chain[u][m] = _mm512_dpbf16_ps(chain[u][m], (__m512bh)_mm512_set1_epi32(pair), w);
      }
    }
  for (int m = 0; m < MT; ++m) {
    __m512 sum = chain[0][m];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, chain[u][m]);
    part[m].v = sum;
  }
}
#endif

// w = q' * s, or q' * s + offset rounded once (an FMA): the floats dequantize() gives, whose
// torch.addcmul rounds once too (the test checks them bit for bit).
inline V dequant(V qv, V s) { return vmul(qv, s); }
inline V dequant(V qv, V s, V offset) { return vfma(qv, s, offset); }

// Beyond kStreamRows rows of x (prefill, batched decode), a row block is expanded once into a
// per-thread scratch that every tile loads as it is. The float path stores the dequantized
// weights, float32 [K][16], the same values as dequantize(): its tiles are then a plain
// float32 GEMM, with no per-group scale and offset to apply (on the AVX2 EPYC that took
// ~12% of a prefill-sized call). The BF16 path stores q' as bfloat16 pairs [K / 2][16] and
// applies each group's scale after its sums, as the streaming path does.
template <int Form, typename S, typename X>
void expand_block(const Weight& w, int64_t block, float* scratch) {
  const uint8_t* q = w.q + block * (Form == kInt8 ? w.K : w.K / 2) * kRows;
  if constexpr (std::is_same_v<X, float>) {
    const int64_t groups = w.K / w.G;
    const S* scales = static_cast<const S*>(w.scales) + block * groups * kRows;
    const S* offsets = w.offsets ? static_cast<const S*>(w.offsets) + block * groups * kRows
                                 : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      const V s = vload(scales + g * kRows);
      const int64_t k0 = g * w.G, k1 = k0 + w.G;
      if (Form == kInt8) {
        for (int64_t k = k0; k < k1; ++k)
          vstore(scratch + k * kRows, dequant(load_int8(q + k * kRows), s));
        continue;
      }
      const V z = offsets ? vload(offsets + g * kRows) : vzero();
      for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp) {
        V even, odd;
        if (Form == kInt4Min) load_int4(q + kp * kRows, even, odd);
        else load_sint4(q + kp * kRows, even, odd);
        if (Form == kInt4Symmetric) {
          vstore(scratch + 2 * kp * kRows, dequant(even, s));
          vstore(scratch + (2 * kp + 1) * kRows, dequant(odd, s));
        } else {
          vstore(scratch + 2 * kp * kRows, dequant(even, s, z));
          vstore(scratch + (2 * kp + 1) * kRows, dequant(odd, s, z));
        }
      }
    }
  } else if constexpr (Form == kInt8) {
#if defined(__AVX512BF16__)
    // int8 is exact in bfloat16 (8 significant bits): pairs (k, k + 1) of each row
    alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                   6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                   12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(pairs);
    for (int64_t kp = 0; kp < w.K / 2; ++kp) {
      const __m512bh both = _mm512_cvtne2ps_pbh(load_int8(q + (2 * kp + 1) * kRows).v,
                                                load_int8(q + 2 * kp * kRows).v);
      _mm512_storeu_si512(scratch + kp * kRows,
                          _mm512_permutexvar_epi16(order, (__m512i)both));
    }
#endif
  } else {
#if defined(__AVX512BF16__)
    const __m512i table = nibble_table<Form>();
    for (int64_t kp = 0; kp < w.K / 2; ++kp) {
      const __m512i b = bytes16(q + kp * kRows, false);
      _mm512_storeu_si512(scratch + kp * kRows,
                          _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)),
                                                   table));
    }
#endif
  }
}

// group_sums over an expanded block (float x: one float32 q' vector per k)
template <int MT>
inline void expanded_sums(const float* x, int64_t K, const float* e, int64_t k0, int64_t k1,
                          V* part) {
  for (int m = 0; m < MT; ++m) part[m] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    const V w = vload(e + k * kRows);
    for (int m = 0; m < MT; ++m) part[m] = vfma(vset(x[m * K + k]), w, part[m]);
  }
}

#if defined(__AVX512BF16__)
// (bfloat16 x: one vector of bfloat16 pairs per two k)
template <int MT>
inline void expanded_sums(const uint16_t* x, int64_t K, const float* e, int64_t k0, int64_t k1,
                          V* part) {
  __m512 sum[MT];
  for (int m = 0; m < MT; ++m) sum[m] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(e + (k / 2) * kRows);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof pair);
      sum[m] = _mm512_dpbf16_ps(sum[m], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  for (int m = 0; m < MT; ++m) part[m].v = sum[m];
}
#endif

// One row block against MT rows of x: out[m][r] = y[m, row r of the block]. xsum[m][g] is
// the sum of x[m] over group g (forms with an offset).
template <int Form, typename S, int MT, typename X>
void row_block(const X* x, const float* xsum, const Weight& w, int64_t block,
               const float* expanded, float* out) {
  const int64_t groups = w.K / w.G;
  const uint8_t* q = w.q + block * (Form == kInt8 ? w.K : w.K / 2) * kRows;
  const S* scales = static_cast<const S*>(w.scales) + block * groups * kRows;
  const S* offsets = w.offsets ? static_cast<const S*>(w.offsets) + block * groups * kRows
                               : nullptr;
  V acc[MT], part[MT];
  if constexpr (std::is_same_v<X, float>)
    if (expanded) {  // dequantized weights: y = x . w over the whole row
      expanded_sums<MT>(x, w.K, expanded, 0, w.K, acc);
      for (int m = 0; m < MT; ++m) vstore(out + m * kRows, acc[m]);
      return;
    }
  for (int m = 0; m < MT; ++m) acc[m] = vzero();
#if defined(__AVX512BF16__)
  const __m512i table = nibble_table<Form>();
#endif
  const int64_t block_bytes = (Form == kInt8 ? w.K : w.K / 2) * kRows,
                group_bytes = block_bytes / groups;
  for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__) || defined(__AVX2__)
    // a decode step streams each weight once from memory: fetch the same group of the next
    // row block (this thread's next one under the schedule's contiguous chunks) meanwhile
    // (a prefetch past the last block is harmless: it never faults)
    if (!expanded && MT <= 2)
      for (int64_t off = 0; off < group_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + block_bytes + g * group_bytes + off),
                     _MM_HINT_T0);
#endif
    if constexpr (std::is_same_v<X, float>) {  // (an expanded float block returned above)
      group_sums<Form, MT>(x, w.K, q, g * w.G, (g + 1) * w.G, part);
    } else if (expanded) {  // bfloat16 pairs of q'
      expanded_sums<MT>(x, w.K, expanded, g * w.G, (g + 1) * w.G, part);
    } else if constexpr (Form != kInt8) {  // (bfloat16 x with int8 is always expanded)
#if defined(__AVX512BF16__)
      group_sums<Form, MT>(x, w.K, q, g * w.G, (g + 1) * w.G, part, table);
#endif
    }
    const V s = vload(scales + g * kRows);
    for (int m = 0; m < MT; ++m) acc[m] = vfma(s, part[m], acc[m]);
    if (Form == kInt4Zero || Form == kInt4Min) {
      const V z = vload(offsets + g * kRows);
      for (int m = 0; m < MT; ++m) acc[m] = vfma(z, vset(xsum[m * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, acc[m]);
}

template <int Form, typename S, typename X>
void row_block_tile(int mt, const X* x, const float* xsum, const Weight& w, int64_t block,
                    const float* e, float* out) {
  switch (mt) {
    case 1: row_block<Form, S, 1>(x, xsum, w, block, e, out); break;
    case 2: row_block<Form, S, 2>(x, xsum, w, block, e, out); break;
#if defined(__AVX512F__) || defined(__AVX2__)
    case 3: row_block<Form, S, 3>(x, xsum, w, block, e, out); break;
    case 4: row_block<Form, S, 4>(x, xsum, w, block, e, out); break;
    case 5: row_block<Form, S, 5>(x, xsum, w, block, e, out); break;
    case 6: row_block<Form, S, 6>(x, xsum, w, block, e, out); break;
#endif
#if defined(__AVX512F__)
    case 7: row_block<Form, S, 7>(x, xsum, w, block, e, out); break;
    case 8: row_block<Form, S, 8>(x, xsum, w, block, e, out); break;
#endif
    default: break;
  }
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

template <int Form, typename S, typename X>
void linear(const X* x, const float* xsum, void* y, int64_t M, int dtype, int threads,
            const Weight& w) {
  const int64_t blocks = (w.N + kRows - 1) / kRows, groups = w.K / w.G;
  // Calls that expand their blocks (compute-bound) go in dynamic chunks of about 1/8 of a
  // thread's share: on a shared machine a thread that is descheduled mid-call leaves its
  // remaining chunks to the others instead of stalling the call. Streaming calls (decode, up
  // to kStreamRows rows of x: each weight read once from memory) go in guided chunks: each
  // thread first walks a long contiguous run of blocks, so its prefetch of the next block
  // (row_block) and the hardware's streams stay on its own data, while the shrinking tail
  // still balances. On the 2-core AVX2 EPYC a SmolLM2 decode step's 120 int4 matmuls ran
  // 15-20% faster than in 1/8 chunks (builds alternated); expanded calls ran the same either
  // way. The schedule is set at run time (schedule(runtime) reads the calling thread's
  // omp_set_schedule) because a second loop in this function, or this body moved into a
  // helper, changed how the 6-row tiles were compiled: expanded calls ran 5-100% slower.
  // Each row block is summed by one thread in one order either way: results don't depend
  // on the schedule.
  const int64_t chunk = std::max<int64_t>(1, blocks / (8 * threads));
  const bool expand = M > kStreamRows;
  const int tile_rows = expand ? kExpandedTile : kTile;
#if defined(_OPENMP)
  omp_set_schedule(expand ? omp_sched_dynamic : omp_sched_guided, expand ? chunk : 2);
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
  {
    std::vector<float> scratch(expand ? w.K * kRows : 0);
#pragma omp for schedule(runtime)
    for (int64_t b = 0; b < blocks; ++b) {
      alignas(64) float tile[std::max(kTile, kExpandedTile) * kRows];
      const int rows = static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows));
      if (expand) expand_block<Form, S, X>(w, b, scratch.data());
      for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
        const int mt = static_cast<int>(std::min<int64_t>(tile_rows, M - m0));
        row_block_tile<Form, S>(mt, x + m0 * w.K, xsum ? xsum + m0 * groups : nullptr, w, b,
                                expand ? scratch.data() : nullptr, tile);
        store_rows(tile, mt, rows, y, dtype, w.N, m0, b * kRows);
      }
    }
  }
}

// Whether bfloat16 x goes to the AVX512-BF16 dot product as it is: int4 always, int8 beyond
// one tile (where its block is expanded to bfloat16 pairs once; even G keeps pairs in a
// group); everything else runs on float32 rows.
inline bool bf16_direct(int form, int64_t M, int64_t G) {
#if defined(__AVX512BF16__)
  return form != kInt8 || (M > kTile && G % 2 == 0);
#else
  (void)form, (void)M, (void)G;
  return false;
#endif
}

// bfloat16 x goes to the AVX512-BF16 path as it is (bf16_direct), everything else as float32
template <int Form>
void linear_form(const void* x, const float* xf, const float* xsum, void* y, int64_t M,
                 int dtype, int threads, bool half, const Weight& w) {
#if defined(__AVX512BF16__)
  if (dtype == 1 && bf16_direct(Form, M, w.G)) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    if (half) linear<Form, uint16_t>(xb, xsum, y, M, dtype, threads, w);
    else linear<Form, float>(xb, xsum, y, M, dtype, threads, w);
    return;
  }
#endif
  (void)x;
  if (half) linear<Form, uint16_t>(xf, xsum, y, M, dtype, threads, w);
  else linear<Form, float>(xf, xsum, y, M, dtype, threads, w);
}

}  // namespace

extern "C" {

// Which vector path this build took: "avx512-bf16", "avx512", "avx2" or "scalar".
const char* quire_quant_matmul_isa() { return kIsa; }

// y [M, N] = x [M, K] @ dequant(W)^T for a packed weight of `form` (above); x and y float32
// (dtype 0) or bfloat16 (1); scales / offsets float16 when `half`. Returns 0, or 1 for an
// unknown dtype or form. The caller checks shapes (K % G == 0; G a multiple of 8 for int4).
int quire_quant_linear(const void* x, void* y, int64_t M, int dtype, int threads, int form,
                       int half, const void* q, const void* scales, const void* offsets,
                       int64_t N, int64_t K, int64_t G) {
  if ((dtype != 0 && dtype != 1) || form < kInt8 || form > kInt4Min) return 1;
  if (M <= 0 || N <= 0) return 0;
  threads = std::max(1, threads);
  // x as float32 rows (the caller's memory when it is float32; the AVX512-BF16 int4 path
  // reads bfloat16 x directly), and each group's sum of x (forms with an offset)
  std::vector<float> copy, xsum;
  const float* xf = static_cast<const float*>(x);
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  const bool direct_bf16 = dtype == 1 && bf16_direct(form, M, G);
  if (dtype == 1 && !direct_bf16) {
    copy.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) copy[i] = bf16_to_float(xb[i]);
    xf = copy.data();
  }
  // (float32 x beyond one tile multiplies dequantized weights: no offset term to add)
  if ((form == kInt4Zero || form == kInt4Min) && (M <= kStreamRows || direct_bf16)) {
    xsum.resize(M * (K / G));
    for (int64_t i = 0; i < M * (K / G); ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < G; ++k)
        sum += dtype == 1 ? bf16_to_float(xb[i * G + k]) : xf[i * G + k];
      xsum[i] = sum;
    }
  }
  const Weight w{static_cast<const uint8_t*>(q), scales, offsets, N, K, G};
  switch (form) {
    case kInt8: linear_form<kInt8>(x, xf, xsum.data(), y, M, dtype, threads, half, w); break;
    case kInt4Symmetric:
      linear_form<kInt4Symmetric>(x, xf, xsum.data(), y, M, dtype, threads, half, w);
      break;
    case kInt4Zero:
      linear_form<kInt4Zero>(x, xf, xsum.data(), y, M, dtype, threads, half, w);
      break;
    default: linear_form<kInt4Min>(x, xf, xsum.data(), y, M, dtype, threads, half, w); break;
  }
  return 0;
}

// The same with the weight's arguments in one struct, made once by pack_*: a ctypes call
// costs per argument, and a decode step makes a few hundred of these.
struct PackedArgs {
  int32_t form, half;
  const void* q;
  const void* scales;
  const void* offsets;
  int64_t N, K, G;
};

int quire_quant_linear_packed(const void* x, void* y, int64_t M, int dtype, int threads,
                              const PackedArgs* w) {
  return quire_quant_linear(x, y, M, dtype, threads, w->form, w->half, w->q, w->scales,
                            w->offsets, w->N, w->K, w->G);
}

// Reads `bytes` (a multiple of 64) once with `threads` threads and returns a checksum: the
// benchmark's measure of the machine's read bandwidth, the bound of a memory-bound matmul.
uint64_t quire_stream_read(const void* data, int64_t bytes, int threads) {
  const uint64_t* p = static_cast<const uint64_t*>(data);
  const int64_t lines = bytes / 64;
  uint64_t total = 0;
#pragma omp parallel num_threads(std::max(1, threads)) reduction(+ : total)
  {
#if defined(__AVX512F__)
    __m512i acc = _mm512_setzero_si512();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < lines; ++i) acc = _mm512_add_epi64(acc, _mm512_loadu_si512(p + i * 8));
    total += static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
#else
    uint64_t acc[8] = {};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < lines; ++i)
      for (int j = 0; j < 8; ++j) acc[j] += p[i * 8 + j];
    for (int j = 0; j < 8; ++j) total += acc[j];
#endif
  }
  return total;
}

}  // extern "C"
