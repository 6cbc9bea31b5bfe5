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

constexpr int kQ8Block = 32;  // x values per int8 scale (and k per integer sum)
constexpr int kQ8Tile = 4;    // rows of x per pass over a row block

// Whether a weight can take int8 activations: the int4 forms, whole 32-k blocks in a group.
inline bool q8_applies(int form, int64_t K, int64_t G) {
  return (form == kInt4Symmetric || form == kInt4Zero || form == kInt4Min) && K % kQ8Block == 0 &&
         G % kQ8Block == 0;
}

// x [M][K] rounded: q [M][K], d [M][K / 32], and per group xs [M][K / G].
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, xs;
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
  for (int i = 0; i < kQ8Block; ++i) q[i] = static_cast<int8_t>(lanes[i]), sum += lanes[i];
#else
  for (int i = 0; i < kQ8Block; ++i) {
    const float v = std::min(std::max(__builtin_rintf(x[i] * inverse), -127.f), 127.f);
    q[i] = static_cast<int8_t>(v);
    sum += q[i];
  }
#endif
  return sum;
}

// Rounds x (float32 rows, or bfloat16 ones read through bf16_to_float) into `out`, rows
// spread over the threads where there are many (a prefill chunk's: ~2 ns a value).
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t G, int threads, Q8Rows& out) {
  const int64_t blocks = K / kQ8Block, groups = K / G, per_group = G / kQ8Block;
  out.q.resize(M * K);
  out.d.resize(M * blocks);
  out.xs.resize(M * groups);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    alignas(32) float converted[kQ8Block];
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;  // the group's sum of d * xq, blocks in order
      for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j) {
        const float* src;
        if constexpr (std::is_same_v<X, float>) {
          src = x + m * K + j * kQ8Block;
        } else {
          for (int i = 0; i < kQ8Block; ++i)
            converted[i] = bf16_to_float(x[m * K + j * kQ8Block + i]);
          src = converted;
        }
        float* d = &out.d[m * blocks + j];
        const int32_t sum = quantize_block(src, out.q.data() + m * K + j * kQ8Block, d);
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

// isum[m][r] = sum over one 32-k block of u[k] * xq[m][k] (row r of a row block; q: the
// block's 256 bytes of it, xq: row 0's 32 values, rows K apart; u: the nibble read unsigned,
// XOR 8 for the forms stored that way). Exact in any order. `ahead`: the same bytes of the
// next row block, fetched meanwhile (decode streams each weight once from memory).
template <int Form, int MT>
inline void q8_isums(const int8_t* xq, int64_t K, const uint8_t* q, const uint8_t* ahead,
                     int32_t* isum) {
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
      const uint8_t* q = here.q + k0 / 2 * kRows;
      q8_isums<Form, MT>(xq + k0, K, q, q + block_bytes, isum);
      for (int m = 0; m < MT; ++m)
        part[m] = vfma(vset(xd[m * blocks + k0 / kQ8Block]), vload_int32(isum + m * kRows),
                       part[m]);
    }
    const V s = vload(here.scales + g * kRows);
    V o;  // the offset per unit of x: m, z - 8 s, or -8 s
    if constexpr (Form == kInt4Min) o = vload(here.offsets + g * kRows);
    else if constexpr (Form == kInt4Zero) o = vfma(vset(-8.f), s, vload(here.offsets + g * kRows));
    else o = vmul(vset(-8.f), s);
    for (int m = 0; m < MT; ++m)
      vstore(out + m * kRows,
             vfma(o, vset(xs[m * groups + g]), vfma(s, part[m], vload(out + m * kRows))));
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

// y [M, N] = dequantized int8 x @ W^T: every M streams the packed weight (a call with more
// rows than kQ8Tile walks each block once a tile while it stays in cache).
template <int Form, typename S>
void linear_q8(const Q8Rows& x, void* y, int64_t M, int dtype, int threads, const Weight& w) {
  const int64_t blocks = (w.N + kRows - 1) / kRows;
  const int64_t span = stream_span(blocks, threads), units = (blocks + span - 1) / span;
#if defined(_OPENMP)
  omp_set_schedule(omp_sched_guided, 2);
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
