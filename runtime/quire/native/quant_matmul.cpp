// Weight-only quantized matmul for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] in float32, with
// w stored as int8 or int4 and one scale (and offset) per group of G consecutive k of a row.
//
// Weight forms (quant_matmul.py's pack_* picks one and checks it gives the same values):
//   0 int8            w = q * s                  q int8
//   1 int4 symmetric  w = (q - 8) * s            q stored XOR 0x88: each nibble read as a
//   2 int4 zero       w = (q - 8) * s + z        signed 4-bit number is q - 8
//   3 int4 min        w = q * s + m              q as is (GGUF Q4_1: s = d, m = m)
//   4 bfloat16        w = q * 1                  q a bfloat16 weight (one group of K, scale 1:
//                                                a float model's weights, for decode rows)
// Scales and offsets are float32, or float16 where every one of them is exactly a float16
// (GGUF's own d and m always are): half the bytes of the scale traffic.
//
// Layout: output rows padded to a multiple of 16 and cut into row blocks of 16; inside a
// block one k of all 16 rows is contiguous, so one vector load feeds 16 output rows:
//   int8  q[block][k][16]       int4  q[block][k / 2][16] (a row's byte: low nibble k even)
//   scales / offsets [block][k / G][16]
//
// Each group is summed exactly as float32 allows: part = sum_k x[k] * q'[k] with q' the
// small integer (q, or q - 8) converted exactly, then y += s * part (+ offset * sum_k x[k]).
// Against dequantize-then-matmul that only moves where float32 rounds (see the test's
// bound); no value is quantized or rounded to a narrower type. A row's order depends on
// nothing but the weight and x's dtype: not on M, its tile or the threads ("Batch
// invariance" below). Up to kStreamRows rows of x (decode) read the packed weights as they
// go; beyond them (prefill, batched decode) each row block's q' is expanded once into a
// per-thread scratch that every tile of x rows reuses.
//
// Vector paths: AVX-512 (16 lanes), AVX2 (two 8-lane halves), plain C++ otherwise; all three
// share the kernel through the small V type. Where the CPU has AVX512-BF16, bfloat16 x uses
// its dot product instead (int4 always, int8 where G is even; the integers are exact
// bfloat16 values, products exact, sums float32: same rounding, half the instructions); on
// an AMX build, streamed rows (decode) run float32 FMAs in the instruction's order instead,
// for the same bits at twice its issue rate there (bf16_as_float). An
// AMX build runs such calls of 3 rows or more on the tile unit (linear_amx: 16 rows of x per
// tile product, for about the cost of one; prefill 3x the dot product), and a bfloat16
// weight's rows from one row (amx_rows_bf16: nothing to fold). OpenMP over row blocks with the
// thread count the caller passes (torch's: the same libgomp and pool once torch is loaded).
// Plain C++ with a C ABI, called through ctypes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "amx.h"
#include "bf16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Form { kInt8 = 0, kInt4Symmetric = 1, kInt4Zero = 2, kInt4Min = 3, kBf16 = 4 };
// a row block's bytes: int8 one a weight, int4 half, bfloat16 two
constexpr int64_t weight_bytes(int form, int64_t K) {
  return form == kInt8 ? K : form == kBf16 ? 2 * K : K / 2;
}

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
#if defined(__AMX_BF16__)
constexpr const char* kIsa = "amx";  // + bfloat16 x on the tiles (linear_amx)
#elif defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512-bf16";  // + the bfloat16 dot product for int4 x bf16
#else
constexpr const char* kIsa = "avx512";
#endif
// Up to 16 rows of x stream in one pass (16 accumulators of the 32 registers), each k unpacked
// once for all of them, and every streamed tile prefetches its next blocks (stream_rows). One
// SmolLM2 step's matmuls on the 2-core AMX Xeon, avx512_bf16 build, bfloat16 x (float32 x on
// the avx512 build in brackets; builds alternated in one process, best of 5, bit-identical
// outputs), ms:
//   M                            1            3            8            9           16
//   8-row tiles, prefetch <= 2  10.7 (10.2)  26.1 (20.1)  35.8 (24.1)  32.2 (33.2)  42.1 (43.8)
//   16-row tiles, prefetch all  10.1  (9.8)  13.4 (11.9)  20.8 (16.8)  23.5 (17.9)  36.0 (28.8)
constexpr int kTile = 16;   // rows of x per streamed pass over a row block
constexpr int kExpandedTile = 8;  // rows of x per pass over an expanded block (prefill)
constexpr int kStreamRows = kTile;  // calls of up to this many x rows are not expanded
constexpr int kHalfTile = 0;  // (AVX2's stream_halves only)
constexpr int kChains = 4;  // streamed: chains = rows of x times blocks side by side
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
inline V load_bf16(const uint8_t* p) {  // 16 bfloat16: exact as float32 (the high halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// Nibbles to float32 by a 16-entry table (vpermps reads an index's low 4 bits): one
// instruction a nibble where masking and converting took two (decode streams 15-20% faster)
inline void load_int4(const uint8_t* p, V& even, V& odd) {  // unsigned nibbles
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i b = bytes16(p, false);
  even.v = _mm512_permutexvar_ps(b, table);
  odd.v = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
inline void load_sint4(const uint8_t* p, V& even, V& odd) {  // signed nibbles
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i b = bytes16(p, false);
  even.v = _mm512_permutexvar_ps(b, table);
  odd.v = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
// Streamed tiles (x rows read beside the packed weights): up to 6 rows at once over both
// 8-lane halves of a block, 2 * 6 accumulators + the unpacked even / odd k + a broadcast x (one
// register more than the 16: the compiler reloads one, and 6 rows still ran 10-13% faster this
// way than in stream_halves' 6 chains, builds alternated twice, best of 15). M = 1-2 take 2-4
// blocks side by side (their FMA chains: see kChains).
constexpr int kTile = 6;
// an expanded block needs no registers for unpacking: 6 rows of x are 12 accumulators, plus
// the two halves of w and a broadcast x: 15 of the 16 registers (BLIS's 6 x 16 AVX2 shape).
// On the 2-core AVX2 EPYC (builds of each tile size called in turn on the same weights,
// bit-identical outputs) 6 rows ran 1.5-1.8x faster than 4 at M = 8-512; 5 was no better
// than 4, and 7 and 8 (spilling) in between.
constexpr int kExpandedTile = 6;
// Calls of up to 16 rows of x stream: 3-6 rows in one kTile pass, 7-16 through stream_halves
// (one 8-lane half of a block at a time, unpacked once for up to kHalfTile rows). Expanding
// every block costs more than these rows multiply. One SmolLM2 step's 121 matmuls on the
// AVX2 EPYC (Zen 3, 2 threads; builds alternated in one process, best of 9; small_m.py's
// step), ms:
//   M                         1     3     5     6     9    12    16
//   before (tiles of 2 rows  7.1  11.2  16.5  21.6  33.5  36.3  47.2
//     up to 5, then expanded)
//   streamed (1fc9c8c)       7.3   9.1  11.7  15.7  22.1  35.1  43.9
// (M = 6 ran in stream_halves there; one kTile pass now, 10-13% faster than that)
// and beyond 16 rows the 6-row expanded tiles win (M = 24 / 32: 60 / 94 ms streamed against
// 59 / 80 expanded).
constexpr int kStreamRows = 16;
constexpr int kHalfTile = 12;  // stream_halves' rows per pass: 12 accumulators + 3 registers
// (linear splits 7-16 rows into at most two passes of 6-12: halves_tile's cases)
static_assert((kHalfTile + 1) / 2 >= kTile && kStreamRows <= 2 * kHalfTile);
constexpr int kChains = 4;  // at M = 1: 4 blocks x (lo, hi) = 8 chains, FMA latency x 2
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
inline __m256 bf16x8(const uint8_t* p) {  // 8 bfloat16: exact as float32 (the high halves)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load_bf16(const uint8_t* p) { return {bf16x8(p), bf16x8(p + 16)}; }
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
constexpr int kHalfTile = 0;
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
inline V load_bf16(const uint8_t* p) {
  V r;
  for (int i = 0; i < kRows; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    r.f[i] = bf16_to_float(h);
  }
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
  // float x standing in for bfloat16 x (bf16_as_float): each pair of k summed k + 1 first,
  // the AVX512-BF16 dot product's order
  bool odd_first = false;
};

// Row block `block` of a weight: its packed q, and its [groups][16] scales and offsets
template <int Form, typename S>
struct Block {
  const uint8_t* q;
  const S* scales;
  const S* offsets;  // (read only by the forms that have them)
  Block(const Weight& w, int64_t block) {
    const int64_t groups = w.K / w.G;
    q = w.q + block * weight_bytes(Form, w.K) * kRows;
    scales = static_cast<const S*>(w.scales) + block * groups * kRows;
    offsets = static_cast<const S*>(w.offsets ? w.offsets : w.scales) + block * groups * kRows;
  }
};

#if defined(__AVX512BF16__)
// The AVX512-BF16 operands: a row's k and k + 1 side by side in one 32-bit lane, as exact
// bfloat16 values of q' (small integers). int4: a row's byte holds its pair already; each
// nibble is looked up (word 2r = row r's low nibble, word 2r + 1 its high one; vpermw reads 5
// index bits and the table repeats, so the other nibble's bit above does not matter).
template <int Form>
inline __m512i nibble_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const int value = Form == kInt4Min ? (i & 15) : ((i & 15) ^ 8) - 8;
    table[i] = float_to_bf16(static_cast<float>(value));
  }
  return _mm512_load_si512(table);
}

inline __m512i nibble_pairs(const uint8_t* p, __m512i table) {
  const __m512i b = bytes16(p, false);
  return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
}

// Words 0-15 (row r's k) and 16-31 (its k + 1) as pairs: word 2r = k, 2r + 1 = k + 1
inline __m512i pair_order() {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(order);
}

#if defined(__AVX512VBMI__)
// int4 pairs a 64-byte line at a time, where the CPU has VBMI: a line of a row block holds
// pairs kp..kp+3 of k for its 16 rows (16 bytes a pair). vpermt2b takes pair j's byte r from
// the line into word 2r (its low nibble: k) and from the line shifted right by 4 into word
// 2r + 1 (its high nibble: k + 1), and the table looks both up: nibble_pairs' words, so the
// same sums in the same order, in two operations a pair and a shift a line where
// nibble_pairs takes four. Zen 4 (AVX512-BF16, VBMI, no AMX) issues about one 512-bit
// shuffle a cycle, and there the shuffles bound these rows once the weights are in cache:
// 1536 x 576 Q4_1, one thread, hot, bfloat16 x, 1.63 -> 1.06 ns per 16 bytes at one row,
// 5.42 -> 4.52 at nine (probe). From memory the step's rows gain less (HISTORY.md,
// session 33).
struct PairSpread {  // vpermt2b's index per pair j of a line (bytes 64+ are the shifted line)
  alignas(64) uint8_t index[4][64];
  PairSpread() {
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < kRows; ++r) {
        index[j][4 * r] = index[j][4 * r + 1] = static_cast<uint8_t>(16 * j + r);
        index[j][4 * r + 2] = index[j][4 * r + 3] = static_cast<uint8_t>(64 + 16 * j + r);
      }
  }
};
inline __m512i pair_spread(int j) {
  static const PairSpread spread;
  return _mm512_load_si512(spread.index[j]);
}
// one pair of a line's four, as nibble_pairs' words (high: the line shifted right by 4)
inline __m512i line_pair(__m512i line, __m512i high, __m512i spread, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_permutex2var_epi8(line, spread, high), table);
}
#endif

// int8 (8 significant bits: exact in bfloat16): k at p, k + 1 at p + kRows. A small integer's
// bfloat16 is its float32's high half (the low half is zero), so each lane is k's float32
// shifted down, or'd with k + 1's: a shift and an or where converting both to bfloat16 and
// interleaving the words took three operations, two of them on port 5. The Q8_0 lm_head's
// B tiles at 9 rows (49152 x 576, a C++ loop, 2 threads, 2-core AMX Xeon): 44-48 -> 39-41 ns
// a group a thread. (Session 16 saw no gain from this, before the tiles' other costs fell.)
inline __m512i int8_pairs(const uint8_t* p) {
  const __m512i k0 = _mm512_castps_si512(load_int8(p).v);
  const __m512i k1 = _mm512_castps_si512(load_int8(p + kRows).v);
  return _mm512_or_si512(_mm512_srli_epi32(k0, 16), k1);
}

// bfloat16 (form BF16): k at p, k + 1 at p + 2 kRows bytes, 64 contiguous bytes
inline __m512i bf16_pairs(const uint8_t* p, __m512i order) {
  return _mm512_permutexvar_epi16(order, _mm512_loadu_si512(p));
}
#endif

// Batch invariance: every row of y is summed in one order, fixed by the weight and x's dtype
// alone, whatever the number of rows M, the tile a row lands in or the thread count. For each
// group in turn: part = x[k0] q'[k0] + x[k0 + 1] q'[k0 + 1] + ... in one chain (float x: one
// FMA per k; bfloat16 x on the AVX512-BF16 path: one dot-product step per pair of k), then
// acc = s * part + acc and, for forms with an offset, acc = z * xsum + acc (xsum: the group's
// sum of x, summed in order). Calls beyond kStreamRows rows expand each row block once
// (expanded_rows); smaller ones read the packed weights as they go (stream_rows, and AVX2's
// stream_halves): the same operations in the same order. The independent chains that hide
// FMA latency at M = 1 come from B row blocks side by side, never from splitting a row's sum
// into partial sums (that made a row's bits depend on the rows beside it).

// Every path that reads packed weights as it goes fetches the line at byte `at` of a later
// block (`ahead`) as it reads that byte of this one, once a line: one prefetch at a time
// spread over the work, not a group's or a batch's lines at once before it (that burst left
// the weights' read and the work adding up instead of overlapping: amx_rows, stream_rows).
//
// Where those lines go: into L1 on Intel; into L2 on AMD's Zen (native builds), where one
// row's step read ~20 GB/s of weights against 30-43 for a plain read on a 2-core Zen 4 (a
// prefetch into L1 holds one of the core's L1 miss buffers until its line arrives: the
// likely cap). There, one SmolLM2 step's matmuls (small_m.py's, huge pages) at one row of
// bfloat16 x took 3.5-4.1 ms with _MM_HINT_T1 against 4.0-4.8 with _MM_HINT_T0, in 7
// alternated pairs; 2-16 rows about the same; the avx2 build's float32 rows there 4.3-4.5
// against 4.5-4.9 (4 pairs). The int8 activations' kernels (int8_activations.h) keep L1:
// into L2 their one row ran slower there (3.56 against 3.00-3.39 ms). (HISTORY.md, session
// 33; GCC 12 names Zen 4 znver3.)
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) \
    || defined(__znver5__)
constexpr _mm_hint kFetchHint = _MM_HINT_T1;
#elif defined(__AVX512F__) || defined(__AVX2__)
constexpr _mm_hint kFetchHint = _MM_HINT_T0;
#endif
inline void fetch_line(const uint8_t* ahead, int64_t at) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (at % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + at), kFetchHint);
#else
  (void)ahead, (void)at;
#endif
}

#if defined(__AVX512BF16__)
// While pair kp of k of row block q is unpacked, the same line of the next row block (this
// thread's next, mostly) is fetched: batched decode and prefill read each weight once from
// memory too.
template <int Form>
inline void fetch_next_block(const uint8_t* q, int64_t K, int64_t kp) {
  // q bytes of a pair of k
  constexpr int64_t kPairBytes = (Form == kInt8 ? 2 : Form == kBf16 ? 4 : 1) * kRows;
  fetch_line(q + weight_bytes(Form, K) * kRows, kp * kPairBytes);
}
#endif

// Beyond kStreamRows rows of x (prefill, batched decode), a row block is expanded once into a
// per-thread scratch that every tile loads as it is, with no unpacking: q' as float32 [K][16]
// (float x), or as bfloat16 pairs [K / 2][16] (the AVX512-BF16 path).
template <int Form, typename X>
void expand_block(const Weight& w, int64_t block, float* scratch) {
  const int64_t K = w.K;  // (a local: the vector stores may alias w)
  const uint8_t* q = w.q + block * weight_bytes(Form, K) * kRows;
  if constexpr (std::is_same_v<X, float>) {
    if (Form == kBf16) {
      for (int64_t k = 0; k < K; ++k) vstore(scratch + k * kRows, load_bf16(q + 2 * k * kRows));
      return;
    }
    if (Form == kInt8) {
      for (int64_t k = 0; k < K; ++k) vstore(scratch + k * kRows, load_int8(q + k * kRows));
      return;
    }
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      V even, odd;
      if (Form == kInt4Min) load_int4(q + kp * kRows, even, odd);
      else load_sint4(q + kp * kRows, even, odd);
      vstore(scratch + 2 * kp * kRows, even);
      vstore(scratch + (2 * kp + 1) * kRows, odd);
    }
  } else {
#if defined(__AVX512BF16__)
    [[maybe_unused]] const __m512i table = nibble_table<Form>();
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      fetch_next_block<Form>(q, K, kp);
      _mm512_storeu_si512(scratch + kp * kRows, Form == kInt8 ? int8_pairs(q + 2 * kp * kRows)
                                                              : nibble_pairs(q + kp * kRows,
                                                                             table));
    }
#endif
  }
}

// part[m] = sum over k in [k0, k1) of x[m, k] * q'[k] over an expanded block, one chain per
// row (float x: one float32 q' vector per k)
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

// A group's part folded into a row's accumulator: acc = s * part + acc, then (forms with an
// offset) acc = z * xsum + acc.
template <int Form>
inline V fold(V acc, V part, V s, V z, float xsum) {
  acc = vfma(s, part, acc);
  return Form == kInt4Zero || Form == kInt4Min ? vfma(z, vset(xsum), acc) : acc;
}

// Folds a group into MT rows' accumulators, kept in the tile (out + m * kRows): loaded and
// stored once a group, they leave every register to the group's chains (AVX2 has 16).
// `scales` and `offsets` point at the group's 16 rows, xsum at row 0's sum of it (rows
// `groups` apart). (Plain values only: the vector stores may alias anything a Weight holds.)
template <int Form, typename S, int MT>
inline void fold_group(const V* part, const float* xsum, int64_t groups, const S* scales,
                       const S* offsets, float* out) {
  const V s = vload(scales);
  const V z = Form == kInt4Zero || Form == kInt4Min ? vload(offsets) : vzero();
  for (int m = 0; m < MT; ++m) {
    const float xs = Form == kInt4Zero || Form == kInt4Min ? xsum[m * groups] : 0.f;
    vstore(out + m * kRows, fold<Form>(vload(out + m * kRows), part[m], s, z, xs));
  }
}

// One expanded row block against MT rows of x: out[m][r] = y[m, row r of the block].
// xsum[m][g] is the sum of x[m] over group g (forms with an offset). (expanded_rows and
// stream_rows stay out of line: inlined into linear, their loops compiled differently with
// whatever else linear holds; a call per tile costs nothing beside its K steps.)
template <int Form, typename S, int MT, typename X>
__attribute__((noinline)) void expanded_rows(const X* x, const float* xsum, const Weight& w,
                                             int64_t block, const float* expanded, float* out) {
  const int64_t K = w.K, G = w.G, groups = K / G;
  const Block<Form, S> here(w, block);
  const S *scales = here.scales, *offsets = here.offsets;
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, vzero());
  for (int64_t g = 0; g < groups; ++g) {
    V part[MT];
    expanded_sums<MT>(x, K, expanded, g * G, (g + 1) * G, part);
    fold_group<Form, S, MT>(part, xsum ? xsum + g : nullptr, groups, scales + g * kRows,
                            offsets + g * kRows, out);
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Group scales (and offsets) at `at` (a later block's, g's row of 16): fetched beside its q,
// as they are streams of their own (a cold SmolLM2 decode step's matmuls on the AMX Xeon,
// 265 MB of weights: 9.1 -> 10.1 GB/s with 2 threads, 5.4 -> 5.8 with one)
template <int Form, typename S>
inline void fetch_group_scales(const S* scales, const S* offsets, int64_t at) {
  _mm_prefetch(reinterpret_cast<const char*>(scales + at), kFetchHint);
  if constexpr (Form == kInt4Zero || Form == kInt4Min)
    _mm_prefetch(reinterpret_cast<const char*>(offsets + at), kFetchHint);
}
#endif

// B consecutive row blocks against MT rows of x, read from the packed weights as they go
// (decode: each weight comes once from memory): out[b][m][r] = y[m, row r of block b], in
// exactly expanded_rows' order (see "Batch invariance" above).
template <int Form, typename S, int MT, int B, typename X>
__attribute__((noinline)) void stream_rows(const X* x, const float* xsum, const Weight& w,
                                           int64_t block0, float* out) {
  const int64_t K = w.K, G = w.G, groups = K / G;
  const int64_t block_bytes = weight_bytes(Form, K) * kRows;
  const Block<Form, S> first(w, block0);  // the B blocks follow it
  const uint8_t* q = first.q;
  const S *scales = first.scales, *offsets = first.offsets;
  for (int i = 0; i < B * MT; ++i) vstore(out + i * kRows, vzero());
#if defined(__AVX512BF16__)
  [[maybe_unused]] const __m512i table = nibble_table<Form>();
#endif
#if defined(__AVX512VBMI__)
  [[maybe_unused]] const __m512i spread[4] = {pair_spread(0), pair_spread(1), pair_spread(2),
                                              pair_spread(3)};
#endif
  // A decode step streams each weight once from memory: the same lines of the next B row
  // blocks (this thread's next ones under the schedule's contiguous chunks) are fetched
  // meanwhile, as block b's are read (a prefetch past the last block is harmless: it never
  // faults). (Every tile: on the AMX Xeon, 3-8 rows without it ran ~1.8x slower on every
  // build. Fetching a group's lines all at once before its sums, as this did before, one
  // SmolLM2 step's matmuls took 7.52 ms at one row against 7.18 and 8.99 at two against
  // 8.13, the two alternated in one process on the AMX Xeon.)
  const auto fetch_ahead = [&](int b, int64_t at) {
    fetch_line(q + (B + b) * block_bytes, at);
  };
  for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__) || defined(__AVX2__)
    for (int b = 0; b < B; ++b)
      fetch_group_scales<Form>(scales, offsets, ((B + b) * groups + g) * kRows);
#endif
    const int64_t k0 = g * G, k1 = k0 + G;
    V part[B][MT];
    if constexpr (std::is_same_v<X, float>) {
      for (int b = 0; b < B; ++b)
        for (int m = 0; m < MT; ++m) part[b][m] = vzero();
      if (Form == kBf16) {
        for (int64_t k = k0; k < k1; ++k)
          for (int b = 0; b < B; ++b) {
            fetch_ahead(b, 2 * k * kRows);
            const V wk = load_bf16(q + b * block_bytes + 2 * k * kRows);
            for (int m = 0; m < MT; ++m)
              part[b][m] = vfma(vset(x[m * K + k]), wk, part[b][m]);
          }
      } else if (Form == kInt8 && w.odd_first) {  // (G even: bf16_as_float)
        for (int64_t k = k0; k < k1; k += 2)
          for (int b = 0; b < B; ++b) {
            fetch_ahead(b, k * kRows);
            const V odd = load_int8(q + b * block_bytes + (k + 1) * kRows),
                    even = load_int8(q + b * block_bytes + k * kRows);
            for (int m = 0; m < MT; ++m) {
              part[b][m] = vfma(vset(x[m * K + k + 1]), odd, part[b][m]);
              part[b][m] = vfma(vset(x[m * K + k]), even, part[b][m]);
            }
          }
      } else if (Form == kInt8) {
        for (int64_t k = k0; k < k1; ++k)
          for (int b = 0; b < B; ++b) {
            fetch_ahead(b, k * kRows);
            const V wk = load_int8(q + b * block_bytes + k * kRows);
            for (int m = 0; m < MT; ++m)
              part[b][m] = vfma(vset(x[m * K + k]), wk, part[b][m]);
          }
      } else {  // k0, k1 even (groups of 32, 64, 128)
        // each pair of k in k order, or k + 1 first (w.odd_first: bf16_as_float)
        const auto pairs = [&](auto odd_first) {
          constexpr int first = decltype(odd_first)::value ? 1 : 0;
          for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp)
            for (int b = 0; b < B; ++b) {
              V wk[2];  // [even k, odd k]
              fetch_ahead(b, kp * kRows);
              const uint8_t* p = q + b * block_bytes + kp * kRows;
              if (Form == kInt4Min) load_int4(p, wk[0], wk[1]); else load_sint4(p, wk[0], wk[1]);
              for (int m = 0; m < MT; ++m) {
                part[b][m] = vfma(vset(x[m * K + 2 * kp + first]), wk[first], part[b][m]);
                part[b][m] = vfma(vset(x[m * K + 2 * kp + 1 - first]), wk[1 - first], part[b][m]);
              }
            }
        };
        if (w.odd_first) pairs(std::true_type{}); else pairs(std::false_type{});
      }
    } else {
#if defined(__AVX512BF16__)
      __m512 sum[B][MT];
      for (int b = 0; b < B; ++b)
        for (int m = 0; m < MT; ++m) sum[b][m] = _mm512_setzero_ps();
#if defined(__AVX512VBMI__)
      if constexpr (Form != kInt8) {  // (groups of 32, 64, 128: whole lines)
        for (int64_t kp = k0 / 2; kp < k1 / 2; kp += 4)
          for (int b = 0; b < B; ++b) {
            fetch_ahead(b, kp * kRows);
            const __m512i line = _mm512_loadu_si512(q + b * block_bytes + kp * kRows),
                          high = _mm512_srli_epi16(line, 4);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              const __m512bh wk = (__m512bh)line_pair(line, high, spread[j], table);
              for (int m = 0; m < MT; ++m) {
                int32_t pair;
                std::memcpy(&pair, x + m * K + 2 * (kp + j), sizeof pair);
                sum[b][m] = _mm512_dpbf16_ps(sum[b][m], (__m512bh)_mm512_set1_epi32(pair), wk);
              }
            }
          }
      } else
#endif
      for (int64_t k = k0; k < k1; k += 2)  // k0, k1 even (bf16_direct)
        for (int b = 0; b < B; ++b) {
          fetch_ahead(b, Form == kInt8 ? k * kRows : k / 2 * kRows);
          const uint8_t* p = q + b * block_bytes;
          const __m512bh wk = (__m512bh)(Form == kInt8 ? int8_pairs(p + k * kRows)
                                                       : nibble_pairs(p + k / 2 * kRows, table));
          for (int m = 0; m < MT; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * K + k, sizeof pair);
            sum[b][m] = _mm512_dpbf16_ps(sum[b][m], (__m512bh)_mm512_set1_epi32(pair), wk);
          }
        }
      for (int b = 0; b < B; ++b)
        for (int m = 0; m < MT; ++m) part[b][m].v = sum[b][m];
#endif
    }
    for (int b = 0; b < B; ++b)
      fold_group<Form, S, MT>(part[b], xsum ? xsum + g : nullptr, groups,
                              scales + (b * groups + g) * kRows, offsets + (b * groups + g) * kRows,
                              out + b * MT * kRows);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2, 7 to kHalfTile rows of x (6 in the second of two passes) against one row block, read
// from the packed weights as they go: each 8-row half of the block is unpacked once per k and
// used by every row of x, whose accumulators are one 8-lane register each (MT + 3 of the 16
// registers). kTile's passes of both halves hold at most 6 rows; more rows in several such
// passes unpack every k once per pass, which cost more than the FMAs. Each lane is summed in
// exactly stream_rows' order (a half is 8 of its 16 lanes, folded the same way).
template <int Form, typename S, int MT>
__attribute__((noinline)) void stream_halves(const float* x, const float* xsum, const Weight& w,
                                             int64_t block, float* out) {
  const int64_t K = w.K, G = w.G, groups = K / G;
  const int64_t block_bytes = weight_bytes(Form, K) * kRows;
  const Block<Form, S> here(w, block);
  const uint8_t* q = here.q;
  const S *scales = here.scales, *offsets = here.offsets;
  constexpr bool kOffset = Form == kInt4Zero || Form == kInt4Min;
  for (int i = 0; i < MT * kRows; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
  // the next block's line at byte `at` fetched as the first half reads this block's
  const auto fetch_ahead = [&](int h, int64_t at) {
    if (h == 0) fetch_line(q + block_bytes, at);
  };
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G, k1 = k0 + G;
    fetch_group_scales<Form>(scales, offsets, (groups + g) * kRows);
    for (int h = 0; h < kRows; h += 8) {
      __m256 part[MT];
      for (int m = 0; m < MT; ++m) part[m] = _mm256_setzero_ps();
      if (Form == kBf16) {
        for (int64_t k = k0; k < k1; ++k) {
          fetch_ahead(h, 2 * k * kRows);
          const __m256 wk = bf16x8(q + 2 * (k * kRows + h));
          for (int m = 0; m < MT; ++m)
            part[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), wk, part[m]);
        }
      } else if (Form == kInt8) {
        for (int64_t k = k0; k < k1; ++k) {
          fetch_ahead(h, k * kRows);
          const __m256 wk = _mm256_cvtepi32_ps(bytes8(q + k * kRows + h, true));
          for (int m = 0; m < MT; ++m)
            part[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), wk, part[m]);
        }
      } else {  // k0, k1 even (groups of 32, 64, 128)
        for (int64_t kp = k0 / 2; kp < k1 / 2; ++kp) {
          __m256 even, odd;
          fetch_ahead(h, kp * kRows);
          nibbles8(q + kp * kRows + h, Form != kInt4Min, even, odd);
          for (int m = 0; m < MT; ++m) {
            part[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + 2 * kp]), even, part[m]);
            part[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + 2 * kp + 1]), odd, part[m]);
          }
        }
      }
      // fold: acc = s * part + acc, then (forms with an offset) acc = z * xsum + acc
      const int64_t at = g * kRows + h;
      const __m256 s = std::is_same_v<S, float>
          ? _mm256_loadu_ps(reinterpret_cast<const float*>(scales + at))
          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at)));
      __m256 z = _mm256_setzero_ps();
      if (kOffset)
        z = std::is_same_v<S, float>
            ? _mm256_loadu_ps(reinterpret_cast<const float*>(offsets + at))
            : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offsets + at)));
      for (int m = 0; m < MT; ++m) {
        float* acc = out + m * kRows + h;
        __m256 a = _mm256_fmadd_ps(s, part[m], _mm256_loadu_ps(acc));
        if (kOffset) a = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[m * groups + g]), a);
        _mm256_storeu_ps(acc, a);
      }
    }
  }
}

template <int Form, typename S>
void halves_tile(int mt, const float* x, const float* xsum, const Weight& w, int64_t block,
                 float* out) {
  switch (mt) {
    case 6: stream_halves<Form, S, 6>(x, xsum, w, block, out); break;
    case 7: stream_halves<Form, S, 7>(x, xsum, w, block, out); break;
    case 8: stream_halves<Form, S, 8>(x, xsum, w, block, out); break;
    case 9: stream_halves<Form, S, 9>(x, xsum, w, block, out); break;
    case 10: stream_halves<Form, S, 10>(x, xsum, w, block, out); break;
    case 11: stream_halves<Form, S, 11>(x, xsum, w, block, out); break;
    case 12: stream_halves<Form, S, 12>(x, xsum, w, block, out); break;
    default: break;
  }
}
#endif

template <int Form, typename S, typename X>
void expanded_tile(int mt, const X* x, const float* xsum, const Weight& w, int64_t block,
                   const float* e, float* out) {
  switch (mt) {
    case 1: expanded_rows<Form, S, 1>(x, xsum, w, block, e, out); break;
    case 2: expanded_rows<Form, S, 2>(x, xsum, w, block, e, out); break;
#if defined(__AVX512F__) || defined(__AVX2__)
    case 3: expanded_rows<Form, S, 3>(x, xsum, w, block, e, out); break;
    case 4: expanded_rows<Form, S, 4>(x, xsum, w, block, e, out); break;
    case 5: expanded_rows<Form, S, 5>(x, xsum, w, block, e, out); break;
    case 6: expanded_rows<Form, S, 6>(x, xsum, w, block, e, out); break;
#endif
#if defined(__AVX512F__)
    case 7: expanded_rows<Form, S, 7>(x, xsum, w, block, e, out); break;
    case 8: expanded_rows<Form, S, 8>(x, xsum, w, block, e, out); break;
#endif
    default: break;
  }
}

// mt rows of x against nb blocks, mt * nb <= kChains (nb = 1 for mt > 2)
template <int Form, typename S, typename X>
void stream_tile(int mt, int nb, const X* x, const float* xsum, const Weight& w, int64_t block,
                 float* out) {
  switch (mt * 8 + nb) {
    case 9: stream_rows<Form, S, 1, 1>(x, xsum, w, block, out); break;
    case 10: stream_rows<Form, S, 1, 2>(x, xsum, w, block, out); break;
#if defined(__AVX512F__) || defined(__AVX2__)
    case 11: stream_rows<Form, S, 1, 3>(x, xsum, w, block, out); break;
    case 12: stream_rows<Form, S, 1, 4>(x, xsum, w, block, out); break;
    case 18: stream_rows<Form, S, 2, 2>(x, xsum, w, block, out); break;
#endif
    case 17: stream_rows<Form, S, 2, 1>(x, xsum, w, block, out); break;
#if defined(__AVX512F__) || defined(__AVX2__)
    case 25: stream_rows<Form, S, 3, 1>(x, xsum, w, block, out); break;
    case 33: stream_rows<Form, S, 4, 1>(x, xsum, w, block, out); break;
    case 41: stream_rows<Form, S, 5, 1>(x, xsum, w, block, out); break;
    case 49: stream_rows<Form, S, 6, 1>(x, xsum, w, block, out); break;
#endif
#if defined(__AVX512F__)
    case 57: stream_rows<Form, S, 7, 1>(x, xsum, w, block, out); break;
    case 65: stream_rows<Form, S, 8, 1>(x, xsum, w, block, out); break;
    case 73: stream_rows<Form, S, 9, 1>(x, xsum, w, block, out); break;
    case 81: stream_rows<Form, S, 10, 1>(x, xsum, w, block, out); break;
    case 89: stream_rows<Form, S, 11, 1>(x, xsum, w, block, out); break;
    case 97: stream_rows<Form, S, 12, 1>(x, xsum, w, block, out); break;
    case 105: stream_rows<Form, S, 13, 1>(x, xsum, w, block, out); break;
    case 113: stream_rows<Form, S, 14, 1>(x, xsum, w, block, out); break;
    case 121: stream_rows<Form, S, 15, 1>(x, xsum, w, block, out); break;
    case 129: stream_rows<Form, S, 16, 1>(x, xsum, w, block, out); break;
#endif
    default: break;
  }
}

#if defined(__AVX512F__)
// the bfloat16 bits of 16 floats, one in the low half of each 32-bit lane (float_to_bf16's
// round to nearest even, NaN kept a NaN)
inline __m512i bf16_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

#endif

void store_rows(const float* tile, int mt, int rows, void* y, int dtype, int64_t N, int64_t m0,
                int64_t n0) {
  for (int m = 0; m < mt; ++m) {
    const float* src = tile + m * kRows;
    if (dtype == 0) {
      std::memcpy(static_cast<float*>(y) + (m0 + m) * N + n0, src, rows * sizeof(float));
    } else {
      uint16_t* dst = static_cast<uint16_t*>(y) + (m0 + m) * N + n0;
#if defined(__AVX512F__)
      if (rows == kRows) {  // (a prefill's whole blocks: the scalar loop was 6% of its time)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                            _mm512_cvtepi32_epi16(bf16_lanes(_mm512_loadu_ps(src))));
        continue;
      }
#endif
      for (int r = 0; r < rows; ++r) dst[r] = float_to_bf16(src[r]);
    }
  }
}

// Row blocks a streaming call takes per iteration (up to kChains: its chains at M = 1): the
// most that leaves no thread more blocks to walk than the fewest would. (Results never depend
// on it: each block is summed the same way alone or beside others.)
inline int64_t stream_span(int64_t blocks, int threads) {
  int64_t span = 1, least = blocks;
  for (int64_t s = 1; s <= kChains; ++s) {
    const int64_t units = (blocks + s - 1) / s, walk = (units + threads - 1) / threads * s;
    if (walk <= least) span = s, least = walk;
  }
  return span;
}

template <int Form, typename S, typename X>
void linear(const X* x, const float* xsum, void* y, int64_t M, int dtype, int threads,
            const Weight& w) {
  const int64_t blocks = (w.N + kRows - 1) / kRows, groups = w.K / w.G;
  const bool expand = M > kStreamRows;
  // Streaming calls take `span` consecutive row blocks per iteration: stream_rows runs them
  // side by side, the independent chains of a call with few rows of x.
  const int64_t span = expand ? 1 : stream_span(blocks, threads),
                units = (blocks + span - 1) / span;
  // Calls that expand their blocks (compute-bound) go in dynamic chunks of about 1/8 of a
  // thread's share: on a shared machine a thread that is descheduled mid-call leaves its
  // remaining chunks to the others instead of stalling the call. Streaming calls (decode, up
  // to kStreamRows rows of x: each weight read once from memory) go in guided chunks: each
  // thread first walks a long contiguous run of blocks, so its prefetch of the next blocks
  // (stream_rows) and the hardware's streams stay on its own data, while the shrinking tail
  // still balances. On the 2-core AVX2 EPYC a SmolLM2 decode step's 120 int4 matmuls ran
  // 15-20% faster than in 1/8 chunks (builds alternated); expanded calls ran the same either
  // way. The schedule is set at run time (schedule(runtime) reads the calling thread's
  // omp_set_schedule) because a second loop in this function, or this body moved into a
  // helper, changed how the 6-row tiles were compiled: expanded calls ran 5-100% slower.
  // Each row block is summed by one thread in one order either way: results don't depend
  // on the schedule.
  const int64_t chunk = std::max<int64_t>(1, units / (8 * threads));
  const int tile_rows = expand ? kExpandedTile : kTile;
  // streaming: the blocks one full tile of rows takes side by side; the tiles of a call
  // with more rows than one tile walk these few blocks in turn (they stay in cache)
  const int64_t side = std::max<int64_t>(1, kChains / std::min<int64_t>(M, tile_rows));
#if defined(_OPENMP)
  omp_set_schedule(expand ? omp_sched_dynamic : omp_sched_guided, expand ? chunk : 2);
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
    std::vector<float> scratch(expand ? w.K * kRows : 0);
#pragma omp for schedule(runtime)
    for (int64_t u = 0; u < units; ++u) {
      alignas(64) float tile[std::max({kTile, kExpandedTile, kChains, kHalfTile}) * kRows];
      const int64_t first = u * span, last = std::min(blocks, first + span);
      if (expand) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, w.N - first * kRows));
        expand_block<Form, X>(w, first, scratch.data());
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
          const int mt = static_cast<int>(std::min<int64_t>(tile_rows, M - m0));
          expanded_tile<Form, S>(mt, x + m0 * w.K, xsum ? xsum + m0 * groups : nullptr, w,
                                 first, scratch.data(), tile);
          store_rows(tile, mt, rows, y, dtype, w.N, m0, first * kRows);
        }
        continue;
      }
#if defined(__AVX2__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<X, float>)
        if (M > kTile) {  // tiles of at most kHalfTile rows, as even as they go
          const int64_t tiles = (M + kHalfTile - 1) / kHalfTile;
          for (int64_t b = first; b < last; ++b)
            for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
              const int mt = static_cast<int>((M - m0) / (tiles - t));
              halves_tile<Form, S>(mt, x + m0 * w.K,
                                   xsum ? xsum + m0 * groups : nullptr, w, b, tile);
              store_rows(tile, mt, static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows)),
                         y, dtype, w.N, m0, b * kRows);
              m0 += mt;
            }
          continue;
        }
#endif
      for (int64_t b0 = first; b0 < last; b0 += side)
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
          const int mt = static_cast<int>(std::min<int64_t>(tile_rows, M - m0));
          for (int64_t b = b0, end = std::min(last, b0 + side); b < end;) {
            const int nb = static_cast<int>(std::min<int64_t>(std::max(1, kChains / mt),
                                                              end - b));
            stream_tile<Form, S>(mt, nb, x + m0 * w.K, xsum ? xsum + m0 * groups : nullptr, w,
                                 b, tile);
            for (int i = 0; i < nb; ++i, ++b)
              store_rows(tile + i * mt * kRows, mt,
                         static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows)), y, dtype,
                         w.N, m0, b * kRows);
          }
        }
    }
  }
}

#include "int8_activations.h"  // (the opt-in int8-activation path: linear_q8)

// Whether bfloat16 x goes to the AVX512-BF16 dot product as it is: int4 always, int8 where
// G is even (pairs of k never straddle a group); everything else runs on float32 rows. Never
// on M: a row's path, and so its bits, must not depend on the rows beside it.
inline bool bf16_direct(int form, int64_t G) {
#if defined(__AVX512BF16__)
  return form != kBf16 && (form != kInt8 || G % 2 == 0);
#else
  (void)form, (void)G;
  return false;
#endif
}

#if defined(__AMX_BF16__)
// AMX: bfloat16 x against int4 / int8 weights on the tile unit. A row block's 16 rows are one
// B tile per 32 k: the AVX512-BF16 path's bfloat16 pairs of q' ([k / 2][16] 32-bit lanes, the
// tile's VNNI layout as they are), unpacked once per block and used by up to 16 rows of x at a
// time (the A tile), so 16 rows cost about one: verification rows and prefill alike. Each
// group's part is summed by the tile (C, float32) and folded by the vector unit as everywhere
// else (acc = s * part + acc, + z * xsum). The tile sums a group in its own order, not the
// dot-product chain's (the hardware's pairs and rounding differ: a few float32 ulps; see
// amx_takes for where each is used).
constexpr int kAmxRows = 16;  // rows of x per A tile
constexpr int kAmxK = 32;     // k per tile product (64 bytes of bfloat16 per row)

using quire_amx::TileConfig, quire_amx::amx_permitted;

// int4 weights' B tiles a 64-byte line at a time. A line of a row block holds pairs kp..kp+3
// of k for its 16 rows (16 bytes a pair); vpermb gathers each row's four bytes (its eight k, a
// nibble each, in k order) into one 32-bit lane, and B row j of the four (j = 0-3) is then
// each lane's nibbles j and j + 4 in its two words: a shift and the table (vpermw reads a
// word's low 5 bits). Two operations a B row where nibble_pairs takes four (two of them on
// port 5). The tiles then pair k as (0, 4) (1, 5) (2, 6) (3, 7) of every eight, so their A
// tiles come from x in that order (amx_x_order). Nine rows of Q4_1 weights on the 2-core AMX
// Xeon (a C++ loop over 56 MB of them, 2 threads), ns a group of 16 rows x 32 k a thread:
// 37.9 -> 28.8 with each thread's own copy of x (one row on the FMAs: 17-18).
struct LineRows {  // vpermb's index: byte 4r + i <- byte 16i + r (built once)
  alignas(64) uint8_t index[64];
  LineRows() {
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) index[4 * r + i] = static_cast<uint8_t>(16 * i + r);
  }
};
inline __m512i line_rows() {
  static const LineRows rows;
  return _mm512_load_si512(rows.index);
}
inline void nibble_lines(const uint8_t* p, __m512i rows, __m512i table, uint32_t* out) {
  const __m512i line = _mm512_permutexvar_epi8(rows, _mm512_loadu_si512(p));
#pragma GCC unroll 4
  for (unsigned j = 0; j < 4; ++j)
    _mm512_storeu_si512(out + j * kRows,
                        _mm512_permutexvar_epi16(_mm512_srli_epi32(line, 4 * j), table));
}

// x [M][K] as this thread's 64-byte-aligned copy, in nibble_lines' order where `Reorder`
// (within every eight k: 0 4 1 5 2 6 3 7). Decode-sized calls give each thread its own: tile
// loads of lines another core just wrote are slow (one copy made by the calling thread and
// read by the other's tiles cost that thread 46-49 ns a group of nine int4 rows instead of
// 31), and x straight from the previous kernel costs the same way, so the other forms copy it
// too (bf16-32 steps 31.4 -> 29.9 ms, decode_profile.py --baseline). Prefill-sized calls
// share the calling thread's copy: each line then serves many row blocks' tiles, and a copy
// a thread would hold M x K for every thread.
template <bool Reorder>
inline const uint16_t* amx_x_order(const uint16_t* x, int64_t n) {
  static thread_local std::vector<uint16_t> copy;
  alignas(64) static const uint16_t order[32] = {0,  4,  1,  5,  2,  6,  3,  7,  8,  12, 9,
                                                 13, 10, 14, 11, 15, 16, 20, 17, 21, 18, 22,
                                                 19, 23, 24, 28, 25, 29, 26, 30, 27, 31};
  const __m512i index = _mm512_load_si512(order);
  copy.resize(n + 32);
  uint16_t* ordered = reinterpret_cast<uint16_t*>(  // (64-byte rows for the tile loads)
      (reinterpret_cast<uintptr_t>(copy.data()) + 63) & ~uintptr_t{63});
  for (int64_t i = 0; i < n; i += 32) {  // (n: whole 32-k tiles)
    const __m512i v = _mm512_loadu_si512(x + i);
    _mm512_store_si512(ordered + i, Reorder ? _mm512_permutexvar_epi16(index, v) : v);
  }
  return ordered;
}

// Up to kAmxGroups groups are in flight at once, each in its own tiles: group j of a batch
// sums into C tile j from A tile 4 + j % 2 (mt rows of 32 bfloat16 x) and B tile 6 + j % 2
// (16 pairs of k of the block's 16 rows). One C tile for every group serialized each group's
// unpack, load, product, store and fold (the tiles are not renamed): M = 1 ran 35% slower
// than the AVX512-BF16 chain. (Per thread, and again after anything else used the tiles:
// oneDNN configures its own.)
constexpr int kAmxGroups = 4;
inline void amx_configure(int mt) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t < 6 ? mt : kAmxK / 2);
  }
  _tile_loadconfig(&c);
}

// Group j of a batch: C_j = sum over its 32-k tiles of A x B, B from `pairs` (G / 32 tiles of
// [16][16] pairs, consecutive). (The tile intrinsics paste their register numbers into the
// instruction's text: literals, hence a macro.)
#define QUIRE_AMX_GROUP(C, A, B)                                       \
  [](const uint16_t* x, int64_t K, int64_t k0, int64_t G, const uint32_t* pairs) { \
    _tile_zero(C);                                                     \
    for (int64_t k = 0; k < G; k += kAmxK) {                           \
      _tile_loadd(A, x + k0 + k, K * sizeof(uint16_t));                \
      _tile_loadd(B, pairs + k / 2 * kRows, 64);                       \
      _tile_dpbf16ps(C, A, B);                                         \
    }                                                                  \
  }

// mt (<= 16) rows of x against row block `block`: out[m][r] = y[m, row r of the block]. The
// B tiles come from `expanded` (the whole block's pairs, expand_block's bfloat16 layout) or,
// when it is null, are unpacked a batch of groups at a time into a small buffer (decode,
// verification, batched decode: each 16-row tile of x reads the block as it goes).
// MT (1-16, the A tile's rows: amx_rows_for picks it) is known at compile time, so the rows'
// accumulators stay in registers across the groups (kept in `out` instead, a load and a store
// a row and group cost ~8% of a SmolLM2 step's matmuls at 9 rows on the AMX Xeon).
template <int Form, typename S, int MT>
__attribute__((noinline)) void amx_rows(const uint16_t* x, const float* xsum, const Weight& w,
                                        int64_t block, const uint32_t* expanded,
                                        uint32_t* buffer, float* out) {
  static_assert(MT >= 1 && MT <= kAmxRows);
  const int64_t K = w.K, G = w.G, groups = K / G;
  const Block<Form, S> here(w, block);
  constexpr bool kOffset = Form == kInt4Zero || Form == kInt4Min;
  [[maybe_unused]] const __m512i table = nibble_table<Form>(), rows = line_rows();
  alignas(64) float part[kAmxGroups][kAmxRows * kRows];
  V acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = vzero();
  for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxGroups, groups - g0));
    const uint32_t* pairs = expanded ? expanded + g0 * G / 2 * kRows : buffer;
    if (!expanded) {  // the batch's G / 2 pairs of k per group, in k order
      // the same lines of the next row block (this thread's next, mostly) are fetched
      // meanwhile, one with each line unpacked: each weight comes once from memory (a
      // prefetch past the end never faults). The batch's 16 lines fetched at once, before
      // its unpacking, left the read and the tiles' work adding up instead of overlapping:
      // one SmolLM2 step's matmuls at 9 rows 11.95 -> 10.60 ms (2-core AMX Xeon, alternated
      // in one process; a C++ probe of the unpacking alone from memory: 56-59 -> 47-49 ns a
      // 16 x 32 block, against 15 hot and 34-36 for the read alone)
      for (int j = 0; j < n; ++j)
        fetch_group_scales<Form>(here.scales, here.offsets, (groups + g0 + j) * kRows);
      if constexpr (Form == kInt8)
        for (int64_t i = 0; i < n * G / 2; ++i) {
          const int64_t kp = g0 * G / 2 + i;
          fetch_next_block<Form>(here.q, K, kp);
          _mm512_store_si512(buffer + i * kRows, int8_pairs(here.q + 2 * kp * kRows));
        }
      else
        for (int64_t i = 0; i < n * G / 2; i += 4) {
          const int64_t kp = g0 * G / 2 + i;
          fetch_next_block<Form>(here.q, K, kp);
          nibble_lines(here.q + kp * kRows, rows, table, buffer + i * kRows);
        }
    }
    const int64_t stride = G / 2 * kRows;  // one group's pairs
    QUIRE_AMX_GROUP(0, 4, 6)(x, K, g0 * G, G, pairs);
    if (n > 1) QUIRE_AMX_GROUP(1, 5, 7)(x, K, (g0 + 1) * G, G, pairs + stride);
    if (n > 2) QUIRE_AMX_GROUP(2, 4, 6)(x, K, (g0 + 2) * G, G, pairs + 2 * stride);
    if (n > 3) QUIRE_AMX_GROUP(3, 5, 7)(x, K, (g0 + 3) * G, G, pairs + 3 * stride);
    _tile_stored(0, part[0], 64);
    if (n > 1) _tile_stored(1, part[1], 64);
    if (n > 2) _tile_stored(2, part[2], 64);
    if (n > 3) _tile_stored(3, part[3], 64);
    for (int j = 0; j < n; ++j) {  // folded in group order
      const int64_t g = g0 + j;
      const V s = vload(here.scales + g * kRows);
      const V z = kOffset ? vload(here.offsets + g * kRows) : vzero();
      for (int m = 0; m < MT; ++m)
        acc[m] = fold<Form>(acc[m], vload(part[j] + m * kRows), s, z,
                            kOffset ? xsum[m * groups + g] : 0.f);
    }
  }
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, acc[m]);
}

// Row block `block`'s B tiles, all of K, in amx_rows' order (prefill, batched decode)
template <int Form>
void amx_expand_block(const Weight& w, int64_t block, float* scratch) {
  if constexpr (Form == kInt8) {  // (k paired in order: the dot-product path's expansion)
    expand_block<Form, uint16_t>(w, block, scratch);
  } else {
    const int64_t K = w.K;
    const uint8_t* q = w.q + block * weight_bytes(Form, K) * kRows;
    const __m512i table = nibble_table<Form>(), rows = line_rows();
    uint32_t* pairs = reinterpret_cast<uint32_t*>(scratch);
    for (int64_t kp = 0; kp < K / 2; kp += 4) {
      fetch_next_block<Form>(q, K, kp);
      nibble_lines(q + kp * kRows, rows, table, pairs + kp * kRows);
    }
  }
}

// amx_rows for mt rows (1-16)
template <int Form, typename S>
using AmxRowsFn = void (*)(const uint16_t*, const float*, const Weight&, int64_t,
                           const uint32_t*, uint32_t*, float*);
template <int Form, typename S, int... MT>
AmxRowsFn<Form, S> amx_rows_pick(int mt, std::integer_sequence<int, MT...>) {
  static constexpr AmxRowsFn<Form, S> fixed[] = {amx_rows<Form, S, MT + 1>...};
  return fixed[mt - 1];
}
template <int Form, typename S>
AmxRowsFn<Form, S> amx_rows_for(int mt) {
  return amx_rows_pick<Form, S>(mt, std::make_integer_sequence<int, kAmxRows>{});
}

// A bfloat16 weight (form BF16: one group of K, scale 1) needs no fold: mt rows of x against
// row block `block` sum every k in one C tile, 32 k a product in k order, after the block's
// pairs are interleaved kBf16Steps products at a time into `buffer` (a pair of rows is 64
// contiguous bytes: one permute). The same products in the same order as
// linear_amx_dequantized's C tiles, so a row has one set of bits from one row to a prefill.
constexpr int kBf16Steps = 4;  // 32-k products unpacked ahead of the tiles (4 KiB of pairs)
__attribute__((noinline)) void amx_rows_bf16(int mt, const uint16_t* x, const Weight& w,
                                             int64_t block, uint32_t* buffer, float* out) {
  const __m512i order = pair_order();
  const int64_t K = w.K;
  const uint8_t* q = w.q + block * weight_bytes(kBf16, K) * kRows;
  _tile_zero(0);
  for (int64_t k0 = 0; k0 < K; k0 += kBf16Steps * kAmxK) {
    const int steps = static_cast<int>(std::min<int64_t>(kBf16Steps, (K - k0) / kAmxK));
    for (int64_t i = 0; i < steps * kAmxK / 2; ++i) {
      const int64_t kp = k0 / 2 + i;
      fetch_next_block<kBf16>(q, K, kp);
      _mm512_store_si512(buffer + i * kRows, bf16_pairs(q + 4 * kp * kRows, order));
    }
    for (int j = 0; j < steps; ++j) {
      _tile_loadd(4, x + k0 + j * kAmxK, K * sizeof(uint16_t));
      _tile_loadd(6, buffer + j * kAmxK / 2 * kRows, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
  }
  _tile_stored(0, out, 64);
}

// Whether a bfloat16 weight's bfloat16 rows run on the tiles (amx_rows_bf16): from one row,
// wherever K is whole tiles. With no fold, one row costs what the FMAs cost (the weight's read:
// a SmolLM2 step's 269 MB, 2-core AMX Xeon, medians of 15 alternated: 24.3 ms on the tiles,
// 24.9 on the FMAs; small_m.py --weights bfloat16, 9 rows 26.8 against 34.9, 32 rows 36.8
// against 80.2), and a row then has the prefill tiles' bits whatever its M.
inline bool bf16_weight_tiles(int form, int64_t G) {
  return form == kBf16 && G % kAmxK == 0 && amx_permitted();
}

// Whether a bfloat16-x call runs on the tiles: a weight whose groups are whole tiles, and
// kAmxMinRows rows of x or more. One or two rows (single-sequence decode) keep the
// AVX512-BF16 chain's sums, which read them faster: each 32-k tile costs 16 vector stores of
// the unpacked pairs before the tile unit can load them. One SmolLM2 step's quantized
// matmuls on the 2-core AMX Xeon (builds alternated in one process, best of 7; ms):
//   M                   1     2     3     4     6     9    16
//   AVX512-BF16 chain  8.6   9.7  24.6  25.8  31.1  29.0  38.1
//   AMX tiles         11.1  11.4  11.9  11.6  12.5  13.3  14.8
// (On AMX builds the chain is now float32 FMAs in the instruction's order, bf16_as_float: small_m.py,
// 2026-11-30, ms: M = 1 6.4, 2 7.5 on it; 3 9.9, 9 11.1, 16 12.7 on the tiles; with
// QUIRE_AMX_MIN_ROWS=17 the FMAs took 3 9.6, 4 9.9, 5 11.0, 9 14.8: no threshold moves.)
// So a row's bits depend on whether its call had fewer than 3 rows (the tile sums a group in
// its own order, a few float32 ulps from the chain's): batch invariance holds within each
// side (tests/runtime/test_quant_matmul.py bounds the difference). $QUIRE_AMX_MIN_ROWS=1
// (quant_matmul.py sets it here) puts every row on the tiles: one order for every M, so that
// speculative verification rows have the bits of decode rows, at the single row's cost.
constexpr int kAmxMinRows = 3;
std::atomic<int> amx_min_rows{kAmxMinRows};
inline bool amx_takes(int64_t M, int64_t G) {
  return M >= amx_min_rows.load(std::memory_order_relaxed) && G % kAmxK == 0 &&
         amx_permitted();
}

// linear's AMX form: up to kAmxStreamRows rows of x read the packed weights as they go (one
// batch of B tiles at a time, unpacked again for each 16-row tile of x: the block's bytes are
// in cache by then); more rows expand each row block once, then every 16-row tile of x uses
// it. Expanding for 17-32 rows (batched decode) ran slower than unpacking twice: the 18 KiB
// block and 16 rows of x (another 18 KiB at K = 576) crowd the 48 KiB L1 that the 4 KiB
// batch leaves to x. One SmolLM2 step's matmuls (small_m.py's), 2-core AMX Xeon, best of 5:
//   M                 20     24     32     48     64
//   expanded          23.1   23.8   25.0   32.8   41.8 ms
//   streamed          22.2   22.6   23.2   32.8   44.0
constexpr int kAmxStreamRows = 32;
template <int Form, typename S>
void linear_amx(const uint16_t* x, const float* xsum, void* y, int64_t M, int dtype,
                int threads, const Weight& w) {
  const int64_t blocks = (w.N + kRows - 1) / kRows, groups = w.K / w.G;
  const bool expand = Form != kBf16 && M > kAmxStreamRows;  // (BF16: interleaving is cheap)
  constexpr bool kReorder = Form != kBf16 && Form != kInt8;
  const bool own = M <= kAmxStreamRows;  // a copy of x a thread (amx_x_order)
  const uint16_t* shared = kReorder && !own ? amx_x_order<true>(x, M * w.K) : x;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
  {
    const uint16_t* xo = own ? amx_x_order<kReorder>(x, M * w.K) : shared;
    std::vector<float> scratch(expand ? w.K * kRows / 2 : 0);
    std::vector<uint32_t> buffer(
        expand ? 0 : (Form == kBf16 ? kBf16Steps * kAmxK : kAmxGroups * w.G) / 2 * kRows + 16);
    uint32_t* aligned = reinterpret_cast<uint32_t*>(  // (64-byte stores)
        (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    int configured = -1;
    alignas(64) float tile[kAmxRows * kRows];
    // Guided chunks, as linear's streaming calls take: each thread first walks a long
    // contiguous run of blocks, so the next block amx_rows fetches is mostly its own. In
    // dynamic chunks of 1/8 of a thread's share (2 blocks of a 576-row weight) half of those
    // fetches were the other thread's blocks: one SmolLM2 step's matmuls at 9 rows took
    // 12.2-13.2 ms against 11.1-11.8 guided (2-core AMX Xeon, alternated in one process;
    // 64-128 rows 2-4% faster too). Results don't depend on the schedule.
#pragma omp for schedule(guided, 2)
    for (int64_t b = 0; b < blocks; ++b) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows));
      if (expand) amx_expand_block<Form>(w, b, scratch.data());
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kAmxRows, M - m0));
        if (mt != configured) amx_configure(configured = mt);
        if constexpr (Form == kBf16)
          amx_rows_bf16(mt, xo + m0 * w.K, w, b, aligned, tile);
        else
          amx_rows_for<Form, S>(mt)(
              xo + m0 * w.K, xsum ? xsum + m0 * groups : nullptr, w, b,
              expand ? reinterpret_cast<const uint32_t*>(scratch.data()) : nullptr, aligned,
              tile);
        store_rows(tile, mt, rows, y, dtype, w.N, m0, b * kRows);
      }
    }
    _tile_release();
  }
}

// --- Prefill over dequantized weights (matrix_engine.py's road, on this library's tiles) --
// A prefill chunk's rows are many: there the per-group fold above (each 32-k tile product
// stored and folded by the vector unit) costs several times the product. So matrix_engine.py
// multiplies by the weight dequantized to bfloat16, which needs no fold: each C tile sums a
// whole row of K. Here each pair of row blocks is dequantized into cache (the value
// quire_dequantize_bf16 gives, bit for bit) and multiplied there by 2 x 2 tiles (32 rows of x
// against 32 output rows: four loads a k step for four products), instead of a whole
// bfloat16 copy of the weight through memory and then oneDNN's GEMM.

// Row block `block` as bfloat16 pairs of w = s * q' (+ z), [K / 2][16] 32-bit lanes (the B
// tile's layout): float32 product, then sum, then rounding, as quire_dequantize_bf16 does
// (-std=c++17: no contraction into one FMA). The next block is fetched meanwhile.
template <int Form, typename S>
void expand_dequantized(const Weight& w, int64_t block, uint32_t* pairs) {
  const int64_t K = w.K, G = w.G;
  if constexpr (Form == kBf16) {  // a float model's weight: only the pairs' interleaving
    const __m512i order = pair_order();
    const uint8_t* q = w.q + block * weight_bytes(Form, K) * kRows;
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      fetch_next_block<Form>(q, K, kp);
      _mm512_store_si512(pairs + kp * kRows, bf16_pairs(q + 4 * kp * kRows, order));
    }
    return;
  }
  const Block<Form, S> here(w, block);
  constexpr bool kOffset = Form == kInt4Zero || Form == kInt4Min;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    fetch_next_block<Form>(here.q, K, kp);
    const int64_t g = 2 * kp / G;  // (G even: a pair never straddles two groups)
    const V s = vload(here.scales + g * kRows);
    V even, odd;
    if (Form == kInt8) {
      even = load_int8(here.q + 2 * kp * kRows);
      odd = load_int8(here.q + (2 * kp + 1) * kRows);
    } else if (Form == kInt4Min) {
      load_int4(here.q + kp * kRows, even, odd);
    } else {
      load_sint4(here.q + kp * kRows, even, odd);
    }
    even = vmul(even, s);
    odd = vmul(odd, s);
    if (kOffset) {
      const V z = vload(here.offsets + g * kRows);
      even = vadd(even, z);
      odd = vadd(odd, z);
    }
    _mm512_store_si512(pairs + kp * kRows,
                       _mm512_or_si512(bf16_lanes(even.v),
                                       _mm512_slli_epi32(bf16_lanes(odd.v), 16)));
  }
}

// A gated MLP's activation in the tiles' epilogue (gate|up weights: y = silu(gate) * up,
// [M, N / 2], the gate|up product never stored): fused_ops.cpp's silu_and_mul of the
// bfloat16 product, bit for bit. `exp16` is Sleef's 16-lane exp, which fused_ops.py has
// checked gives torch's 8-lane one's bits on every bfloat16 input (at a third of the cost
// here: two 8-lane calls made this epilogue ~0.5 ms of a 1.4 ms gate|up at 512 rows), on the
// columns before `vec_end` (those torch's silu vectorizes); std::exp after.
struct Glu {
  using Exp16 = __m512 (*)(__m512);
  Exp16 exp16;
  int64_t vec_end;
};

// rows of one C tile pair (gate, up: 16 columns from `col`) -> y's bfloat16 rows, in passes
// (the exps in one run of calls)
inline void glu_rows(const float* gate, const float* up, int rows, uint16_t* y, int64_t ld,
                     int64_t row0, int64_t col, const Glu& glu) {
  const auto as_stored = [](__m512 v) {  // the bfloat16 the plain product would store
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_lanes(v), 16));
  };
  alignas(64) float g[kAmxRows * kRows], e[kAmxRows * kRows];
  for (int r = 0; r < rows; ++r) {
    const __m512 v = as_stored(_mm512_loadu_ps(gate + r * kRows));
    _mm512_store_ps(g + r * kRows, v);
    _mm512_store_ps(e + r * kRows, _mm512_castsi512_ps(  // -g, as the scalar negation
        _mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))));
  }
  if (col + kRows <= glu.vec_end) {  // (vec_end a multiple of 32: blocks fall on one side)
    for (int r = 0; r < rows; ++r)
      _mm512_store_ps(e + r * kRows, glu.exp16(_mm512_load_ps(e + r * kRows)));
  } else {
    for (int i = 0; i < rows * kRows; ++i) e[i] = std::exp(e[i]);
  }
  const __m512 one = _mm512_set1_ps(1.f);
  for (int r = 0; r < rows; ++r) {
    const __m512 silu = as_stored(_mm512_div_ps(
        _mm512_load_ps(g + r * kRows), _mm512_add_ps(one, _mm512_load_ps(e + r * kRows))));
    const __m512 u = as_stored(_mm512_loadu_ps(up + r * kRows));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (row0 + r) * ld + col),
                        _mm512_cvtepi32_epi16(bf16_lanes(_mm512_mul_ps(silu, u))));
  }
}

// y = x @ bfloat16(dequant(W))^T, bfloat16 x [M, K] (K a multiple of 32), on the tiles: each
// unit of two row blocks is dequantized once, then every 32 rows of x (16 in the last tile
// when they run out; rows past M read a zeroed copy) sum whole rows of K in C tiles 0-3:
// C0 = A4 B6, C1 = A4 B7, C2 = A5 B6, C3 = A5 B7. With `glu` a unit is gate block u and up
// block u + N / 32 (N / 2 a multiple of 16), and the epilogue stores silu(gate) * up.
template <int Form, typename S>
void linear_amx_dequantized(const uint16_t* x, uint16_t* y, int64_t M, int threads,
                            const Weight& w, const Glu* glu) {
  const int64_t K = w.K, N = w.N, blocks = (N + kRows - 1) / kRows;
  const int64_t padded_rows = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::vector<uint16_t> padded;
  const uint16_t* xp = x;
  if (padded_rows != M) {  // the last tile's rows past M: zeros (their outputs are dropped)
    padded.assign(padded_rows * K, 0);
    std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
    xp = padded.data();
  }
  const int64_t units = glu ? blocks / 2 : (blocks + 1) / 2;
  const int64_t chunk = std::max<int64_t>(1, units / (8 * threads));
  const int64_t stride = K * sizeof(uint16_t);
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
    std::vector<uint32_t> scratch(K * kRows + 16);  // two blocks' K / 2 pairs of 16 rows
    uint32_t* b0 = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    uint32_t* b1 = b0 + K / 2 * kRows;
    alignas(64) float tile[4][kAmxRows * kRows];
    amx_configure(kAmxRows);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t first = glu ? u : 2 * u, second = glu ? u + units : first + 1;
      const bool two = second < blocks;
      expand_dequantized<Form, S>(w, first, b0);
      if (two) expand_dequantized<Form, S>(w, second, b1);
      for (int64_t m0 = 0; m0 < padded_rows; m0 += 2 * kAmxRows) {
        const bool both = m0 + kAmxRows < padded_rows;
        const uint16_t* a0 = xp + m0 * K;
        const uint16_t* a1 = a0 + kAmxRows * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += kAmxK) {
          _tile_loadd(4, a0 + k, stride);
          _tile_loadd(6, b0 + k / 2 * kRows, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            _tile_loadd(7, b1 + k / 2 * kRows, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (both) {
            _tile_loadd(5, a1 + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, tile[0], 64);
        _tile_stored(1, tile[1], 64);
        _tile_stored(2, tile[2], 64);
        _tile_stored(3, tile[3], 64);
        if (glu) {
          for (int t = 0; t < 4; t += 2) {
            const int64_t rows0 = m0 + (t >= 2 ? kAmxRows : 0);
            if (rows0 < M)
              glu_rows(tile[t], tile[t + 1],
                       static_cast<int>(std::min<int64_t>(kAmxRows, M - rows0)), y, N / 2,
                       rows0, first * kRows, *glu);
          }
          continue;
        }
        for (int t = 0; t < 4; ++t) {
          const int64_t rows0 = m0 + (t >= 2 ? kAmxRows : 0), block = first + (t & 1);
          if (rows0 >= M || block >= blocks) continue;
          store_rows(tile[t], static_cast<int>(std::min<int64_t>(kAmxRows, M - rows0)),
                     static_cast<int>(std::min<int64_t>(kRows, N - block * kRows)), y,
                     1 /* bfloat16 */, N, rows0, block * kRows);
        }
      }
    }
    _tile_release();
  }
}

// (float32 or float16 scales, as linear_form picks them)
template <int Form>
void dequantized_form(const uint16_t* x, uint16_t* y, int64_t M, int threads, bool half,
                      const Weight& w, const Glu* glu) {
  if (half) linear_amx_dequantized<Form, uint16_t>(x, y, M, threads, w, glu);
  else linear_amx_dequantized<Form, float>(x, y, M, threads, w, glu);
}
#endif

#if defined(__AMX_BF16__)
// Streaming rows of bfloat16 x (decode) on an AMX build: the AVX512-BF16 path's sums on float32
// FMAs. vdpbf16ps adds a pair's two products in turn (k + 1 first), each product exact in
// float32 (8-bit by at most 8-bit significands) and each sum rounded to nearest even: an FMA
// chain in that order gives the same bits. The instruction also reads denormal inputs as zero
// (done here, once a call) and flushes denormal results, which a float32 sum keeps: those
// arise only where a group's products are all below ~1e-36, and there the last bits may
// differ. On the AMX Xeon vdpbf16ps issues one per ~2 cycles to the FMA's two a cycle, so a
// decode step ran 10% faster (benchmarks/decode_profile.py --baseline). Only there: AMD's
// AVX512-BF16 CPUs (Zen 4 / 5, no AMX) issue it at the FMA's rate, where the instruction's one
// operation a pair of k should win, and were not measured with this.
inline const std::vector<float>& bf16_as_float(const uint16_t* xb, int64_t n) {
  static thread_local std::vector<float> xd;  // (read by this call's threads only)
  xd.resize(n);
  for (int64_t i = 0; i < n; ++i) xd[i] = (xb[i] & 0x7f80) ? bf16_to_float(xb[i]) : 0.f;
  return xd;
}
#endif

// bfloat16 x goes to the AVX512-BF16 path as it is (bf16_direct), everything else as float32
template <int Form>
void linear_form(const void* x, const float* xf, const float* xsum, void* y, int64_t M,
                 int dtype, int threads, bool half, const Weight& w) {
#if defined(__AMX_BF16__)
  if (dtype == 1 && bf16_weight_tiles(Form, w.G)) {
    if (half) linear_amx<kBf16, uint16_t>(static_cast<const uint16_t*>(x), nullptr, y, M, dtype,
                                          threads, w);
    else linear_amx<kBf16, float>(static_cast<const uint16_t*>(x), nullptr, y, M, dtype,
                                  threads, w);
    return;
  }
#endif
#if defined(__AVX512BF16__)
  if (Form != kBf16 && dtype == 1 && bf16_direct(Form, w.G)) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
#if defined(__AMX_BF16__)
    if (amx_takes(M, w.G)) {
      if (half) linear_amx<Form, uint16_t>(xb, xsum, y, M, dtype, threads, w);
      else linear_amx<Form, float>(xb, xsum, y, M, dtype, threads, w);
      return;
    }
    if (M <= kStreamRows) {  // streaming rows: float FMAs in the dot product's order
      const std::vector<float>& xd = bf16_as_float(xb, M * w.K);
      Weight pairs = w;
      pairs.odd_first = true;
      if (half) linear<Form, uint16_t>(xd.data(), xsum, y, M, dtype, threads, pairs);
      else linear<Form, float>(xd.data(), xsum, y, M, dtype, threads, pairs);
      return;
    }
#endif
    if (half) linear<Form, uint16_t>(xb, xsum, y, M, dtype, threads, w);
    else linear<Form, float>(xb, xsum, y, M, dtype, threads, w);
    return;
  }
#endif
  (void)x;
  if (half) linear<Form, uint16_t>(xf, xsum, y, M, dtype, threads, w);
  else linear<Form, float>(xf, xsum, y, M, dtype, threads, w);
}

// xsum[i] = the sum of x's group i (G values from x + i * G) in k order: the fold's xsum,
// one chain a group as every path sums it, for `n` groups of x float32 (dtype 0) or bfloat16.
// Groups side by side in vector lanes (a gather of each k), so one chain does not wait on
// the last one's adds: the same sums, bit for bit. It runs on the calling thread before the
// matmul's threads start, in each of a SmolLM2 step's 121 calls: a chain a group took 1.75
// us of 9 rows x 576 k alone (0.40 gathered), and one step's matmuls at 9 rows 6.8-7.1 ->
// 5.9-6.1 ms (small_m.py, 2-core AMX Xeon, the two trees alternated).
void group_sums_chained(const void* x, int dtype, int64_t n, int64_t G, float* xsum) {
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0.f;
    for (int64_t k = 0; k < G; ++k)
      sum += dtype == 1 ? bf16_to_float(static_cast<const uint16_t*>(x)[i * G + k])
                        : static_cast<const float*>(x)[i * G + k];
    xsum[i] = sum;
  }
}
#if defined(__AVX512F__)
constexpr int kSumLanes = 16;
using SumVector = __m512;
using WordVector = __m512i;
inline __m512i lane_offsets(int stride) {  // lane j: j * stride 32-bit words on
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(stride));
}
inline __m512i gather_words(__m512i at, const void* base) {
  return _mm512_i32gather_epi32(at, base, 4);
}
inline __m512 add_words(__m512 a, __m512i b) { return _mm512_add_ps(a, _mm512_castsi512_ps(b)); }
inline __m512i low_bf16(__m512i v) { return _mm512_slli_epi32(v, 16); }
inline __m512i high_bf16(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(-65536)); }
inline void store_sums(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline __m512 sum_zero() { return _mm512_setzero_ps(); }
#elif defined(__AVX2__)
constexpr int kSumLanes = 8;
using SumVector = __m256;
using WordVector = __m256i;
inline __m256i lane_offsets(int stride) {
  return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
}
inline __m256i gather_words(__m256i at, const void* base) {
  return _mm256_i32gather_epi32(static_cast<const int*>(base), at, 4);
}
inline __m256 add_words(__m256 a, __m256i b) { return _mm256_add_ps(a, _mm256_castsi256_ps(b)); }
inline __m256i low_bf16(__m256i v) { return _mm256_slli_epi32(v, 16); }
inline __m256i high_bf16(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(-65536)); }
inline void store_sums(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline __m256 sum_zero() { return _mm256_setzero_ps(); }
#endif
void group_sums(const void* x, int dtype, int64_t n, int64_t G, float* xsum) {
  int64_t i0 = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  // whole lanes of groups; G is even for every int4 form, so a bfloat16 pair of k is one
  // 32-bit word
  const WordVector at = lane_offsets(static_cast<int>(dtype == 1 ? G / 2 : G));
  for (; i0 + kSumLanes <= n; i0 += kSumLanes) {
    SumVector sum = sum_zero();
    if (dtype == 1) {
      const uint16_t* base = static_cast<const uint16_t*>(x) + i0 * G;
      for (int64_t k = 0; k < G; k += 2) {
        const WordVector pair = gather_words(at, base + k);
        sum = add_words(sum, low_bf16(pair));
        sum = add_words(sum, high_bf16(pair));
      }
    } else {
      const float* base = static_cast<const float*>(x) + i0 * G;
      for (int64_t k = 0; k < G; ++k) sum = add_words(sum, gather_words(at, base + k));
    }
    store_sums(xsum + i0, sum);
  }
#endif
  // the last groups (and every group on builds without the vectors): a chain each
  const int64_t bytes = dtype == 1 ? 2 : 4;
  group_sums_chained(static_cast<const char*>(x) + i0 * G * bytes, dtype, n - i0, G, xsum + i0);
}

}  // namespace

extern "C" {

// Whether this build rounds x to int8 for a weight of this form and shape (q8_applies): 1 or 0
int quire_q8_applies(int form, int64_t K, int64_t G) { return q8_applies(form, K, G) ? 1 : 0; }

// Which vector path this build took: "amx", "avx512-bf16", "avx512", "avx2" or "scalar".
const char* quire_quant_matmul_isa() { return kIsa; }

// Calls of at least `rows` bfloat16 rows go to the AMX tiles (kAmxMinRows by default; an
// AMX build only). Returns the value in force.
int quire_quant_matmul_set_amx_min_rows(int rows) {
#if defined(__AMX_BF16__)
  if (rows >= 1) amx_min_rows.store(rows, std::memory_order_relaxed);
  return amx_min_rows.load(std::memory_order_relaxed);
#else
  (void)rows;
  return 0;
#endif
}

// 1 where this build multiplies on the AMX tiles and the kernel lets this process use them
int quire_quant_matmul_amx_ready() {
#if defined(__AMX_BF16__)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// y [M, N] = x [M, K] @ dequant(W)^T for a packed weight of `form` (above); x and y float32
// (dtype 0) or bfloat16 (1); scales / offsets float16 when `half`. Returns 0, or 1 for an
// unknown dtype or form. The caller checks shapes (K % G == 0; G a multiple of 8 for int4).
int quire_quant_linear(const void* x, void* y, int64_t M, int dtype, int threads, int form,
                       int half, const void* q, const void* scales, const void* offsets,
                       int64_t N, int64_t K, int64_t G) {
  if ((dtype != 0 && dtype != 1) || form < kInt8 || form > kBf16) return 1;
  if (M <= 0 || N <= 0) return 0;
  threads = std::max(1, threads);
  // x as float32 rows (the caller's memory when it is float32; the AVX512-BF16 path reads
  // bfloat16 x directly), and each group's sum of x (forms with an offset)
  std::vector<float> copy, xsum;
  const float* xf = static_cast<const float*>(x);
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  bool direct_bf16 = dtype == 1 && bf16_direct(form, G);
#if defined(__AMX_BF16__)
  direct_bf16 = direct_bf16 || (dtype == 1 && bf16_weight_tiles(form, G));  // (no copy)
#endif
  if (dtype == 1 && !direct_bf16) {
    copy.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) copy[i] = bf16_to_float(xb[i]);
    xf = copy.data();
  }
  if (form == kInt4Zero || form == kInt4Min) {
    xsum.resize(M * (K / G));
    group_sums(x, dtype, M * (K / G), G, xsum.data());
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
    case kInt4Min:
      linear_form<kInt4Min>(x, xf, xsum.data(), y, M, dtype, threads, half, w);
      break;
    default: linear_form<kBf16>(x, xf, xsum.data(), y, M, dtype, threads, half, w); break;
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
  int32_t activations;  // 1: round x to int8 where q8_applies (int8_activations.h), else 0
};

int quire_quant_linear_packed(const void* x, void* y, int64_t M, int dtype, int threads,
                              const PackedArgs* w) {
  if (w->activations == 1 && q8_applies(w->form, w->K, w->G) && (dtype == 0 || dtype == 1)) {
    if (M <= 0 || w->N <= 0) return 0;
    const Weight weight{static_cast<const uint8_t*>(w->q), w->scales, w->offsets, w->N, w->K,
                        w->G};
    threads = std::max(1, threads);
    switch (w->form) {
#if defined(QUIRE_Q8_QUADS)
      case kInt8: q8_form<kInt8>(x, M, dtype, threads, w->half, weight, y); break;
#endif
      case kInt4Symmetric: q8_form<kInt4Symmetric>(x, M, dtype, threads, w->half, weight, y); break;
      case kInt4Zero: q8_form<kInt4Zero>(x, M, dtype, threads, w->half, weight, y); break;
      default: q8_form<kInt4Min>(x, M, dtype, threads, w->half, weight, y); break;
    }
    return 0;
  }
  return quire_quant_linear(x, y, M, dtype, threads, w->form, w->half, w->q, w->scales,
                            w->offsets, w->N, w->K, w->G);
}

// y [M, N] = bfloat16 x [M, K] @ bfloat16(dequant(W))^T (quire_dequantize_bf16's values),
// float32 sums, on the AMX tiles without a copy of the weight (linear_amx_dequantized): what
// matrix_engine.py takes for prefill chunks where this build has the tiles (a bfloat16
// weight, form BF16, is only laid out as pairs). Returns 0, or 1 where it does not apply (no
// AMX here, K not whole tiles): the caller then dequantizes and calls torch.
// With `exp16` (Sleef_expf16_u10's address, see Glu; nullptr: the plain product), y [M, N / 2]
// = silu(gate) * up of the gate|up product instead, fused_ops' silu_and_mul bit for bit
// (`vec_end`: where torch's silu stops vectorizing a row); 1 also where N / 2 is not whole
// row blocks.
int quire_quant_linear_dequantized(const void* x, void* y, int64_t M, int threads,
                                   const PackedArgs* w, const void* exp16, int64_t vec_end) {
#if defined(__AMX_BF16__)
  if (w->form < kInt8 || w->form > kBf16 || w->K % kAmxK != 0 || w->G % 2 != 0 ||
      !amx_permitted() || (exp16 && w->N % (2 * kRows) != 0))
    return 1;
  if (M <= 0 || w->N <= 0) return 0;
  const Glu glu{reinterpret_cast<Glu::Exp16>(const_cast<void*>(exp16)), vec_end};
  const Glu* fused = exp16 ? &glu : nullptr;
  threads = std::max(1, threads);
  const Weight weight{static_cast<const uint8_t*>(w->q), w->scales, w->offsets, w->N, w->K,
                      w->G};
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  uint16_t* yb = static_cast<uint16_t*>(y);
  switch (w->form) {
    case kInt8: dequantized_form<kInt8>(xb, yb, M, threads, w->half, weight, fused); break;
    case kInt4Symmetric:
      dequantized_form<kInt4Symmetric>(xb, yb, M, threads, w->half, weight, fused);
      break;
    case kInt4Zero:
      dequantized_form<kInt4Zero>(xb, yb, M, threads, w->half, weight, fused);
      break;
    case kInt4Min:
      dequantized_form<kInt4Min>(xb, yb, M, threads, w->half, weight, fused);
      break;
    default: dequantized_form<kBf16>(xb, yb, M, threads, w->half, weight, fused); break;
  }
  return 0;
#else
  (void)x, (void)y, (void)M, (void)threads, (void)w, (void)exp16, (void)vec_end;
  return 1;
#endif
}

// out [N, K] bfloat16 (round to nearest even) = the packed weight's values, as dequantize()
// computes them in float32: q * s, (q - 8) * s, (q - 8) * s + z or q * s + m. For a matrix
// engine's GEMM (matrix_engine.py: prefill through AMX), never for the kernel's own sums.
int quire_dequantize_bf16(const PackedArgs* w, uint16_t* out, int threads) {
  if (w->form < kInt8 || w->form > kBf16) return 1;
  const int64_t N = w->N, K = w->K, G = w->G, groups = K / G;
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t block_bytes = weight_bytes(w->form, K) * kRows;
  const uint8_t* q = static_cast<const uint8_t*>(w->q);
  auto value = [&](const void* t, int64_t i) {
    return w->half ? half_to_float(static_cast<const uint16_t*>(t)[i])
                   : static_cast<const float*>(t)[i];
  };
#pragma omp parallel for num_threads(std::max(1, threads)) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = q + b * block_bytes;
    for (int r = 0; r < kRows && b * kRows + r < N; ++r) {
      uint16_t* row = out + (b * kRows + r) * K;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (b * groups + g) * kRows + r;
        const float s = value(w->scales, at);
        const float z =
            w->form == kInt4Zero || w->form == kInt4Min ? value(w->offsets, at) : 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          float v;
          if (w->form == kBf16) {
            uint16_t h;
            std::memcpy(&h, qb + 2 * (k * kRows + r), sizeof h);
            row[k] = h;  // (scale 1: the weight as it is)
            continue;
          }
          if (w->form == kInt8) {
            v = static_cast<float>(static_cast<int8_t>(qb[k * kRows + r])) * s;
          } else {
            const int nibble = (qb[(k / 2) * kRows + r] >> (4 * (k & 1))) & 15;
            const float qv = static_cast<float>(w->form == kInt4Min ? nibble : (nibble ^ 8) - 8);
            const float prod = qv * s;
            v = w->form == kInt4Symmetric ? prod : prod + z;
          }
          row[k] = float_to_bf16(v);
        }
      }
    }
  }
  return 0;
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
