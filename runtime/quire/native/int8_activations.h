// int8 activations for int4 weights (opt-in: --activation-quantization int8), part of
// quant_matmul.cpp: included there after its vector type V, Weight, Block, store_rows and
// stream_span, inside its anonymous namespace.
//
// What llama.cpp does with Q8 activations, on the kernel's own int4 layout: each row of x is
// rounded per 32 values of k to int8 (d = max|x| / 127 and xq = round-half-even(x * r) with
// r = 127 / max|x|, both quotients float32; so x ~ d * xq), and a weight's unsigned nibbles u (0..15) meet xq in vpmaddubsw, 32 products
// an instruction, summed exactly in integers. w = u * s + o per group (o = m for GGUF's Q4_1;
// (u - 8) * s + z, stored XOR 8, for the zero and symmetric forms: o = z - 8 s, or -8 s), so
//   y = sum over groups of  s * part + o * xs,   part = sum over its 32-k blocks of d * isum,
// isum = sum u * xq (exact), xs = the group's sum of d * sum(xq). That is dequantized x times
// the exact weight, with float32 rounding only in those folds; every build (AVX2 intrinsics on
// the x86 ones, plain C++ otherwise) gives the same bits, and a row's sums never depend on M,
// its tile or the threads: every M takes this path, prefill too (batch invariance).
//
// Why: decode streams each weight once, and on AVX2 the float path spends ~14 vector
// operations per 32 weights unpacking nibbles to float32 (HISTORY.md, session 18): more than
// the read. Here it is ~5. What it costs: x is rounded to ~2 decimal digits, so greedy output
// is no longer transformers' token for token (benchmarks/README.md states the bound).
// Builds with AVX512-VNNI sum four products a lane (vpdpbusd, q8_quads below) and take int8
// weights too (q8_applies); amx builds run 5 rows or more on the int8 tiles (int8_amx.h): the
// same exact isums, the same bits.

constexpr int kQ8Block = 32;  // x values per int8 scale (and k per integer sum)

#if defined(__AVX512VNNI__)
// AVX512-VNNI builds (avx512_bf16, amx) sum four k of a row in one 32-bit lane (vpdpbusd, and
// the AMX tiles' int8 layout). A row block's bytes hold pairs of k, so q8_quads gives each
// lane a row's k = 0, 2, 4, 6 of 8 (the low nibbles) and, in a second vector, k = 1, 3, 5, 7
// (the high ones); xq is stored in that order within each 8 k, so one broadcast of four bytes
// meets them. An integer sum does not depend on the order of its terms: the bits are the
// other builds'.
#define QUIRE_Q8_QUADS 1
constexpr int quad_slot(int k) { return (k & ~7) | ((k & 1) << 2) | ((k & 7) >> 1); }
#else
constexpr int quad_slot(int k) { return k; }
#endif
// Rows of x per pass over a row block (q8_rows; VNNI builds from 5 rows: q8_through)
constexpr int kQ8Tile = 4;

// Whether a weight can take int8 activations: the int4 forms, whole 32-k blocks in a group;
// int8 weights (GGUF's Q8_0: the default model's LM head) on builds with AVX512-VNNI only.
// Without it signed bytes against signed bytes cost more than the float path beyond one row
// (vpmaddubsw on |q| with x given q's sign, widened each step: the Q8_0 head, avx2 build on
// the AMX Xeon, 9 rows 4.96 ms against 3.48 with float x, 32 rows 16.9 against 12.4), so
// there an int8 weight keeps float x.
inline bool q8_applies(int form, int64_t K, int64_t G) {
#if defined(QUIRE_Q8_QUADS)
  const bool int8 = form == kInt8;
#else
  const bool int8 = false;
#endif
  return (int8 || form == kInt4Symmetric || form == kInt4Zero || form == kInt4Min) &&
         K % kQ8Block == 0 && G % kQ8Block == 0;
}

// Bytes of a row block per k: int8 one a row, int4 half
template <int Form>
constexpr int64_t q8_bytes_per_k() { return Form == kInt8 ? kRows : kRows / 2; }

// x [M][K] rounded: q [M][K], d [M][K / 32], per group xs [M][K / G], and per 32-k block the
// integer sum of q, qs [M][K / 32] (the VNNI int8-weight path's offset).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  std::vector<int32_t> qs;
};

// Rounds one 32-value block of x; returns sum(q). A block whose largest |x| is below 1e-30
// rounds to zeros (127 / max|x| would overflow); one holding inf or NaN gets d = NaN, so the
// rows it feeds are NaN, as the float path's would be.
inline int32_t quantize_block(const float* x, int8_t* q, float* d) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < kQ8Block; ++i) {
    const float a = std::fabs(x[i]);
    finite = finite && a <= 3.4028235e38f;
    amax = a > amax ? a : amax;
  }
  if (!finite || amax < 1e-30f) {
    std::memset(q, 0, kQ8Block);
    *d = finite ? 0.f : NAN;
    return 0;
  }
  const float inverse = 127.f / amax;
  *d = amax / 127.f;
  int32_t sum = 0;
#if defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(inverse), lo = _mm256_set1_ps(-127.f),
               hi = _mm256_set1_ps(127.f);
  alignas(32) int32_t lanes[kQ8Block];
  for (int i = 0; i < kQ8Block; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + i), _mm256_cvtps_epi32(v));
  }
  for (int i = 0; i < kQ8Block; ++i)
    q[quad_slot(i)] = static_cast<int8_t>(lanes[i]), sum += lanes[i];
#else
  for (int i = 0; i < kQ8Block; ++i) {
    const float v = std::min(std::max(__builtin_rintf(x[i] * inverse), -127.f), 127.f);
    q[quad_slot(i)] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
#endif
  return sum;
}

#if defined(__AVX512F__)
// quantize_block on 16 lanes, for a block already in two vectors (bfloat16 x widened as it
// is loaded): the same quotients, roundings and bits, ~10x fewer operations (a 9-row
// verification's x was ~1.8 ms of a 10.5 ms SmolLM2 step's matmuls through the scalar loop).
inline int32_t quantize_block(__m512 x0, __m512 x1, int8_t* q, float* d) {
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 most = _mm512_set1_ps(3.4028235e38f);  // (false for inf and NaN)
  const bool finite = (_mm512_cmp_ps_mask(a0, most, _CMP_LE_OQ) &
                       _mm512_cmp_ps_mask(a1, most, _CMP_LE_OQ)) == 0xffff;
  const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.f;
  if (!finite || amax < 1e-30f) {
    std::memset(q, 0, kQ8Block);
    *d = finite ? 0.f : NAN;
    return 0;
  }
  const float inverse = 127.f / amax;
  *d = amax / 127.f;
  const __m512 scale = _mm512_set1_ps(inverse), lo = _mm512_set1_ps(-127.f),
               hi = _mm512_set1_ps(127.f);
  auto rounded = [&](__m512 v) {
    v = _mm512_roundscale_ps(_mm512_mul_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
  };
  const __m512i r0 = rounded(x0), r1 = rounded(x1);
  __m128i q0 = _mm512_cvtepi32_epi8(r0), q1 = _mm512_cvtepi32_epi8(r1);
  if constexpr (quad_slot(1) != 1) {  // each 8 values in quad_slot order
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    q0 = _mm_shuffle_epi8(q0, order), q1 = _mm_shuffle_epi8(q1, order);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), q0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), q1);
  return _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
}

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // bfloat16: exact as float32 (the high halves)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

// Rounds x (float32 rows, or bfloat16 ones read through bf16_to_float) into `out`, rows
// spread over the threads where there are many (a prefill chunk's: ~2 ns a value; ~0.2 on
// AVX-512).
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t G, int threads, Q8Rows& out) {
  const int64_t blocks = K / kQ8Block, groups = K / G, per_group = G / kQ8Block;
  out.q.resize(M * K);
  out.d.resize(M * blocks);
  out.xs.resize(M * groups);
  out.qs.resize(M * blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    [[maybe_unused]] alignas(32) float converted[kQ8Block];
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;  // the group's sum of d * xq, blocks in order
      for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j) {
        float* d = &out.d[m * blocks + j];
        int8_t* q = out.q.data() + m * K + j * kQ8Block;
#if defined(__AVX512F__)
        const X* at = x + m * K + j * kQ8Block;
        const int32_t sum = quantize_block(load16(at), load16(at + 16), q, d);
#else
        const float* src;
        if constexpr (std::is_same_v<X, float>) {
          src = x + m * K + j * kQ8Block;
        } else {
          for (int i = 0; i < kQ8Block; ++i)
            converted[i] = bf16_to_float(x[m * K + j * kQ8Block + i]);
          src = converted;
        }
        const int32_t sum = quantize_block(src, q, d);
#endif
        out.qs[m * blocks + j] = sum;
        s = __builtin_fmaf(*d, static_cast<float>(sum), s);
      }
      out.xs[m * groups + g] = s;
    }
  }
}

inline V vload_int32(const int32_t* p) {  // exact: the sums stay below 2^24
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_loadu_si512(p))};
#elif defined(__AVX2__)
  return {_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
          _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8)))};
#else
  V r;
  for (int i = 0; i < kRows; ++i) r.f[i] = static_cast<float>(p[i]);
  return r;
#endif
}

#if defined(QUIRE_Q8_QUADS)
// 64 bytes of a row block (pairs p = 0..3 of k, 16 rows: byte 16 p + r holds row r's k = 2p in
// its low nibble and 2p + 1 in its high one) as two vectors of 16 lanes: lane r holds row r's
// u at k = 0, 2, 4, 6 (`even`) and 1, 3, 5, 7 (`odd`), one byte each (XOR 8 for the forms
// stored that way). Dword j of 128-bit lane p (rows 4j..4j + 3 of pair p) moves to dword p of
// lane j, then each lane's 4 x 4 bytes are transposed: 5 operations for 32 weights.
inline __m512i quad_transpose(__m512i v) {  // 128-bit lane p, byte r -> dword r, byte p
  const __m512i lanes = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i rows = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lanes, v), rows);
}

// The same for an int8 row block: 128 bytes (k = 0..7, 16 bytes a k) as `even` (k = 0, 2, 4,
// 6) and `odd` (1, 3, 5, 7), signed bytes; with `unsigned_`, XOR 0x80 (q + 128, for vpdpbusd).
template <bool unsigned_>
inline void q8_quads_int8(const uint8_t* q, __m512i& even, __m512i& odd) {
  const __m512i a = _mm512_loadu_si512(q), b = _mm512_loadu_si512(q + 64);
  even = quad_transpose(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
  odd = quad_transpose(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  if constexpr (unsigned_) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    even = _mm512_xor_si512(even, flip), odd = _mm512_xor_si512(odd, flip);
  }
}

template <int Form>
inline void q8_quads(const uint8_t* q, __m512i& even, __m512i& odd) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i t = quad_transpose(_mm512_loadu_si512(q));
  if constexpr (Form != kInt4Min) t = _mm512_xor_si512(t, _mm512_set1_epi8(static_cast<char>(0x88)));
  even = _mm512_and_si512(t, low);
  odd = _mm512_and_si512(_mm512_srli_epi32(t, 4), low);
}

// q8_isums on AVX512-VNNI: the same exact sums, four products a lane per vpdpbusd (weights
// unsigned, xq signed, in quad_slot order). Rows of a short call keep two chains each, so a
// single row's eight steps are not one latency chain.
// int8 weights: q + 128 unsigned against xq, then 128 * sum(xq) (qs: row 0's, `blocks` apart)
// taken off: exact.
template <int Form, int MT>
inline void q8_isums(const int8_t* xq, int64_t K, const uint8_t* q, const uint8_t* ahead,
                     const int32_t* qs, int64_t blocks, int32_t* isum) {
  constexpr int kChainsPerRow = MT <= 2 ? 2 : 1;
  __m512i acc[MT][2 * kChainsPerRow];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < 2 * kChainsPerRow; ++c) acc[m][c] = _mm512_setzero_si512();
  for (int line = 0; line < 4; ++line) {  // 8 k: 64 bytes of int4, 128 of int8
    __m512i even, odd;
    if constexpr (Form == kInt8) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 128 * line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 128 * line + 64), _MM_HINT_T0);
      q8_quads_int8<true>(q + 128 * line, even, odd);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
      q8_quads<Form>(q + 64 * line, even, odd);
    }
    const int c = 2 * (line % kChainsPerRow);
    for (int m = 0; m < MT; ++m) {
      int32_t e, o;
      std::memcpy(&e, xq + m * K + 8 * line, sizeof e);
      std::memcpy(&o, xq + m * K + 8 * line + 4, sizeof o);
      acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], even, _mm512_set1_epi32(e));
      acc[m][c + 1] = _mm512_dpbusd_epi32(acc[m][c + 1], odd, _mm512_set1_epi32(o));
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m512i sum = _mm512_add_epi32(acc[m][0], acc[m][1]);
    if constexpr (kChainsPerRow == 2)
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(acc[m][2], acc[m][3]));
    if constexpr (Form == kInt8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * qs[m * blocks]));
    _mm512_storeu_si512(isum + m * kRows, sum);
  }
}
#else
// isum[m][r] = sum over one 32-k block of u[k] * xq[m][k] (row r of a row block; q: the
// block's 256 bytes of it, xq: row 0's 32 values, rows K apart; u: the nibble read unsigned,
// XOR 8 for the forms stored that way). Exact in any order. `ahead`: the same bytes of the
// next row block, fetched meanwhile (decode streams each weight once from memory).
template <int Form, int MT>
inline void q8_isums(const int8_t* xq, int64_t K, const uint8_t* q, const uint8_t* ahead,
                     const int32_t* qs, int64_t blocks, int32_t* isum) {
  (void)qs, (void)blocks;  // (int4 forms only here: int8 weights need the quads)
#if defined(__AVX2__)
  // 32 bytes = two pairs of k for the block's 16 rows (lane 0: k, k + 1; lane 1: the next
  // two). Unpacking the low and high nibbles side by side gives each row's pair of k in one
  // 16-bit lane (rows 0-7, then 8-15), which vpmaddubsw multiplies by xq's pair and adds.
  // 16-bit sums hold the block's 8 steps: 8 x 2 x 15 x 127 = 30480. One row block at a time:
  // the integer adds leave no latency chain to hide (the float path's blocks side by side).
  const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(static_cast<char>(0x88));
  const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  __m256i acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int line = 0; line < 4; ++line) {  // 64 bytes: 8 k
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {
      const int k = 8 * line + 4 * half;
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8 * k));
      if constexpr (Form != kInt4Min) raw = _mm256_xor_si256(raw, flip);
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      const __m256i rows_lo = _mm256_unpacklo_epi8(lo, hi), rows_hi = _mm256_unpackhi_epi8(lo, hi);
      for (int m = 0; m < MT; ++m) {
        int32_t four;
        std::memcpy(&four, xq + m * K + k, sizeof four);
        const __m256i xv = _mm256_shuffle_epi8(_mm256_set1_epi32(four), pairs);
        acc[m][0] = _mm256_add_epi16(acc[m][0], _mm256_maddubs_epi16(rows_lo, xv));
        acc[m][1] = _mm256_add_epi16(acc[m][1], _mm256_maddubs_epi16(rows_hi, xv));
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) {  // the two pairs' lanes, widened and added
      const __m256i a = acc[m][h];
      const __m256i sum = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                                           _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum + m * kRows + 8 * h), sum);
    }
#else
  (void)ahead;
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kRows; ++r) {
      int32_t sum = 0;
      for (int k = 0; k < kQ8Block; ++k) {
        int u = (q[k / 2 * kRows + r] >> (4 * (k & 1))) & 15;
        if (Form != kInt4Min) u ^= 8;
        sum += u * xq[m * K + k];
      }
      isum[m * kRows + r] = sum;
    }
#endif
}
#endif  // QUIRE_Q8_QUADS

// A group's offset per unit of x: m, z - 8 s, or -8 s (the int4 forms; int8 has none)
template <int Form, typename S>
inline V q8_offset(const Block<Form, S>& here, int64_t g, V s) {
  if constexpr (Form == kInt4Min) return vload(here.offsets + g * kRows);
  else if constexpr (Form == kInt4Zero) return vfma(vset(-8.f), s, vload(here.offsets + g * kRows));
  else if constexpr (Form == kInt8) return vzero();
  else return vmul(vset(-8.f), s);
}

// A group's part folded into a row: acc = o * xs + (s * part + acc); int8: s * part + acc
template <int Form>
inline V q8_fold(V acc, V part, V s, V o, float xs) {
  acc = vfma(s, part, acc);
  return Form == kInt8 ? acc : vfma(o, vset(xs), acc);
}

// One row block against MT rows of rounded x (from row m0): out[m][r] = y[m0 + m, row r]
template <int Form, typename S, int MT>
__attribute__((noinline)) void q8_rows(const Q8Rows& x, int64_t m0, const Weight& w,
                                       int64_t block, float* out) {
  const int64_t K = w.K, G = w.G, groups = K / G, blocks = K / kQ8Block;
  const int64_t block_bytes = weight_bytes(Form, K) * kRows;
  const Block<Form, S> here(w, block);
  const int8_t* xq = x.q.data() + m0 * K;
  const float* xd = x.d.data() + m0 * blocks;
  const float* xs = x.xs.data() + m0 * groups;
  alignas(64) int32_t isum[MT * kRows];
  for (int m = 0; m < MT; ++m) vstore(out + m * kRows, vzero());
  for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__) || defined(__AVX2__)
    fetch_group_scales<Form>(here.scales, here.offsets, (groups + g) * kRows);
#endif
    V part[MT];
    for (int m = 0; m < MT; ++m) part[m] = vzero();
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += kQ8Block) {
      const uint8_t* q = here.q + k0 * q8_bytes_per_k<Form>();
      q8_isums<Form, MT>(xq + k0, K, q, q + block_bytes,
                         x.qs.data() + m0 * blocks + k0 / kQ8Block, blocks, isum);
      for (int m = 0; m < MT; ++m)
        part[m] = vfma(vset(xd[m * blocks + k0 / kQ8Block]), vload_int32(isum + m * kRows),
                       part[m]);
    }
    const V s = vload(here.scales + g * kRows), o = q8_offset<Form, S>(here, g, s);
    for (int m = 0; m < MT; ++m)
      vstore(out + m * kRows,
             q8_fold<Form>(vload(out + m * kRows), part[m], s, o, xs[m * groups + g]));
  }
}

template <int Form, typename S>
void q8_tile(int mt, const Q8Rows& x, int64_t m0, const Weight& w, int64_t block, float* out) {
  switch (mt) {
    case 1: q8_rows<Form, S, 1>(x, m0, w, block, out); break;
    case 2: q8_rows<Form, S, 2>(x, m0, w, block, out); break;
    case 3: q8_rows<Form, S, 3>(x, m0, w, block, out); break;
    default: q8_rows<Form, S, 4>(x, m0, w, block, out); break;
  }
}

#if defined(QUIRE_Q8_QUADS)
// From kQ8ThroughRows rows on (batched decode, verification, prefill), a row block's 32-k
// block is unpacked once into 8 registers and every row of a chunk goes through them, 4 rows
// at a time: q8_rows, in tiles of 8 rows, unpacked it again for each tile and kept its sums in
// memory, which ran at ~65% of this (one thread, hot data: 180-190 against 272 G operations a
// second on the Zen 4 EPYC).
// The same exact isums and the same folds in the same order: the same bits.
constexpr int64_t kQ8ThroughRows = 5;
constexpr int64_t kQ8Chunk = 64;  // rows a pass (out and part stay in L1: 4 KB each)

template <int Form, int R>
inline void through_rows(const __m512i* even, const __m512i* odd, const int8_t* xq, int64_t K,
                         const int32_t* qs, int64_t blocks, __m512i* isum) {
  __m512i a0[R], a1[R];  // (two chains a row: the even and the odd k)
  for (int r = 0; r < R; ++r) {
    a0[r] = a1[r] = _mm512_setzero_si512();
    for (int line = 0; line < 4; ++line) {
      int32_t e, o;
      std::memcpy(&e, xq + r * K + 8 * line, sizeof e);
      std::memcpy(&o, xq + r * K + 8 * line + 4, sizeof o);
      a0[r] = _mm512_dpbusd_epi32(a0[r], even[line], _mm512_set1_epi32(e));
      a1[r] = _mm512_dpbusd_epi32(a1[r], odd[line], _mm512_set1_epi32(o));
    }
  }
  for (int r = 0; r < R; ++r) {
    isum[r] = _mm512_add_epi32(a0[r], a1[r]);
    if constexpr (Form == kInt8)
      isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(128 * qs[r * blocks]));
  }
}

// Rows [m0, m1) (at most kQ8Chunk) against row block `block`: out[m - m0][r]; part: scratch
template <int Form, typename S>
__attribute__((noinline)) void q8_through(const Q8Rows& x, int64_t m0, int64_t m1,
                                          const Weight& w, int64_t block, float* out,
                                          float* part) {
  const int64_t K = w.K, G = w.G, groups = K / G, blocks = K / kQ8Block;
  const int64_t per_group = G / kQ8Block, block_bytes = weight_bytes(Form, K) * kRows;
  const Block<Form, S> here(w, block);
  const int64_t rows = m1 - m0;
  for (int64_t m = 0; m < rows; ++m) vstore(out + m * kRows, vzero());
  for (int64_t g = 0; g < groups; ++g) {
    fetch_group_scales<Form>(here.scales, here.offsets, (groups + g) * kRows);
    const V s = vload(here.scales + g * kRows), o = q8_offset<Form, S>(here, g, s);
    for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j) {
      const uint8_t* q = here.q + j * kQ8Block * q8_bytes_per_k<Form>();
      __m512i even[4], odd[4];
      for (int line = 0; line < 4; ++line) {
        if constexpr (Form == kInt8) {
          _mm_prefetch(reinterpret_cast<const char*>(q + block_bytes + 128 * line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(q + block_bytes + 128 * line + 64),
                       _MM_HINT_T0);
          q8_quads_int8<true>(q + 128 * line, even[line], odd[line]);
        } else {
          _mm_prefetch(reinterpret_cast<const char*>(q + block_bytes + 64 * line), _MM_HINT_T0);
          q8_quads<Form>(q + 64 * line, even[line], odd[line]);
        }
      }
      // q8_rows' order: part = d * isum over the group's blocks, then folded into out
      const bool first = j == g * per_group, last = j + 1 == (g + 1) * per_group;
      const auto fold = [&](int64_t m, __m512i isum) {
        const V p = vfma(vset(x.d[(m0 + m) * blocks + j]), V{_mm512_cvtepi32_ps(isum)},
                         first ? vzero() : vload(part + m * kRows));
        if (last)
          vstore(out + m * kRows, q8_fold<Form>(vload(out + m * kRows), p, s, o,
                                                x.xs[(m0 + m) * groups + g]));
        else
          vstore(part + m * kRows, p);
      };
      const auto run = [&](auto rows_at_once, int64_t m) {  // (an integral_constant)
        constexpr int T = decltype(rows_at_once)::value;
        __m512i isum[T];
        through_rows<Form, T>(even, odd, x.q.data() + (m0 + m) * K + j * kQ8Block, K,
                              x.qs.data() + (m0 + m) * blocks + j, blocks, isum);
        for (int r = 0; r < T; ++r) fold(m + r, isum[r]);
      };
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4) run(std::integral_constant<int, 4>{}, m);
      switch (rows - m) {
        case 3: run(std::integral_constant<int, 3>{}, m); break;
        case 2: run(std::integral_constant<int, 2>{}, m); break;
        case 1: run(std::integral_constant<int, 1>{}, m); break;
        default: break;
      }
    }
  }
}
#endif  // QUIRE_Q8_QUADS

#include "int8_amx.h"  // (linear_q8_amx: 5 rows or more on an amx build's tiles)

// y [M, N] = dequantized int8 x @ W^T: every M streams the packed weight (a call with more
// rows than kQ8Tile walks each block once a tile while it stays in cache).
template <int Form, typename S>
void linear_q8(const Q8Rows& x, void* y, int64_t M, int dtype, int threads, const Weight& w) {
#if defined(__AMX_INT8__)
  if (q8_amx_takes(M)) return linear_q8_amx<Form, S>(x, y, M, dtype, threads, w);
#endif
  const int64_t blocks = (w.N + kRows - 1) / kRows;
  const int64_t span = stream_span(blocks, threads), units = (blocks + span - 1) / span;
#if defined(_OPENMP)
  omp_set_schedule(omp_sched_guided, 2);
#endif
#if defined(QUIRE_Q8_QUADS)
  if (M >= kQ8ThroughRows) {
#pragma omp parallel for num_threads(threads) schedule(runtime) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; ++u) {
      alignas(64) float tile[kQ8Chunk * kRows], part[kQ8Chunk * kRows];
      for (int64_t b = u * span, last = std::min(blocks, b + span); b < last; ++b)
        for (int64_t m0 = 0; m0 < M; m0 += kQ8Chunk) {
          const int64_t m1 = std::min(M, m0 + kQ8Chunk);
          q8_through<Form, S>(x, m0, m1, w, b, tile, part);
          store_rows(tile, static_cast<int>(m1 - m0),
                     static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows)), y, dtype, w.N,
                     m0, b * kRows);
        }
    }
    return;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(runtime) if (threads > 1 && units > 1)
  for (int64_t u = 0; u < units; ++u) {
    alignas(64) float tile[kQ8Tile * kRows];
    for (int64_t b = u * span, last = std::min(blocks, b + span); b < last; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += kQ8Tile) {
        const int mt = static_cast<int>(std::min<int64_t>(kQ8Tile, M - m0));
        q8_tile<Form, S>(mt, x, m0, w, b, tile);
        store_rows(tile, mt, static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows)), y,
                   dtype, w.N, m0, b * kRows);
      }
  }
}

// The int8-activation call for a weight that q8_applies to
template <int Form>
void q8_form(const void* x, int64_t M, int dtype, int threads, bool half, const Weight& w,
             void* y) {
  static thread_local Q8Rows rounded;  // (reused: a decode step makes a few hundred calls)
  if (dtype == 1) quantize_rows(static_cast<const uint16_t*>(x), M, w.K, w.G, threads, rounded);
  else quantize_rows(static_cast<const float*>(x), M, w.K, w.G, threads, rounded);
  if (half) linear_q8<Form, uint16_t>(rounded, y, M, dtype, threads, w);
  else linear_q8<Form, float>(rounded, y, M, dtype, threads, w);
}
