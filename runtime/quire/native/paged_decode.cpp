// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gathered copy), GQA-aware (each K/V row is loaded once and serves its
// whole group of query heads), online softmax in float32. One work item per (sequence, KV
// head), over OpenMP threads (the same runtime, and thread count, as torch's); one per (part of
// a sequence's context, KV head) where a context is long (every 128 tokens on the AVX2 build,
// every 1,024 past 1,024 on AVX-512), merged (decode_in_parts).
// Extend rows (prefill chunks over a cached prefix, verification rows) run in GEMM-shaped
// tiles of up to 16 rows on every AVX2 or AVX-512 build (extend_tile8).
//
// Plain C++ with a C ABI, no torch headers: it compiles in about a second and is called
// through ctypes with tensor data pointers. dtype codes: 0 = float32, 1 = bfloat16.
//
// Two options of newer families, off (0 / null) on the fast paths, which then do exactly
// what they did before: soft-capping (Gemma 2), scores s -> cap * tanh(s / cap) before the
// mask and softmax; sinks (gpt-oss), a learned logit per query head that joins the softmax's
// denominator and adds no value, folded in once a row's running max and sum are final.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <unistd.h>  // (sysconf: the L2's size)

#include <omp.h>

#include "bf16.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using quire_bf16::bf16_to_float;
using quire_bf16::float_to_bf16;

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return bf16_to_float(*p); }
inline void store_scalar(float* p, float x) { *p = x; }
inline void store_scalar(uint16_t* p, float x) { *p = float_to_bf16(x); }

// What a row's output accumulator is multiplied by when its context is done: 1 / l, or with
// a sink (gpt-oss) the sink's exp joins the denominator (both relative to the larger max).
inline float finish_scale(float m, float l, const float* sink) {
  if (sink == nullptr) return 1.f / l;
  const float top = std::max(m, *sink);
  const float a = std::exp(m - top);
  return a / (l * a + std::exp(*sink - top));
}

// Odd Taylor coefficients of tanh (x, x^3, ..., x^15): below |x| = 0.5 they are within 1e-8
// of it, where 1 - 2 / (e^2|x| + 1) would lose bits to cancellation.
constexpr float kTanh[8] = {1.f, -0.333333333333f, 0.133333333333f, -0.0539682539683f,
                            0.0218694885362f, -0.00886323552990f, 0.00359212803657f,
                            -0.00145583438705f};

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
// Soft-capping of scores [t0, n): s = cap * tanh(s / cap), as transformers' Gemma 2 does it.
inline void softcap_scores(float* s, int t0, int n, float cap) {
  for (int t = t0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}
#endif

constexpr int kMaxGroup = 8;     // query heads per KV head on the vector path
constexpr int kMaxChunks = 16;   // head_dim / 16 on the vector path (head_dim <= 256)

template <int N>
using Int = std::integral_constant<int, N>;

// The fixed-shape instance of a kernel for this layout, or nullptr (then the general loop
// runs): query heads per KV head 1-8, head_dim 64 or 128 in kLanes-float chunks, blocks of 16
// tokens. `make(Int<G>, Int<C>)` names the instance, e.g. decode_item16_lse<T, G, C>.
template <int C, typename Make>
auto fixed_shape_for_group(int group, Make make) -> decltype(make(Int<1>{}, Int<C>{})) {
  switch (group) {
    case 1: return make(Int<1>{}, Int<C>{});
    case 2: return make(Int<2>{}, Int<C>{});
    case 3: return make(Int<3>{}, Int<C>{});
    case 4: return make(Int<4>{}, Int<C>{});
    case 5: return make(Int<5>{}, Int<C>{});
    case 6: return make(Int<6>{}, Int<C>{});
    case 7: return make(Int<7>{}, Int<C>{});
    case 8: return make(Int<8>{}, Int<C>{});
    default: return nullptr;
  }
}

template <int kLanes, typename Make>
auto fixed_shape(int group, int head_dim, int block_size, Make make)
    -> decltype(make(Int<1>{}, Int<64 / kLanes>{})) {
  if (block_size != 16) return nullptr;
  switch (head_dim) {
    case 64: return fixed_shape_for_group<64 / kLanes>(group, make);
    case 128: return fixed_shape_for_group<128 / kLanes>(group, make);
    default: return nullptr;
  }
}

// The fixed-shape kernels' types, the same in every build: a decode row (one work item: a
// sequence and a KV head; O float32 for a part of one, merged later by the log-sum-exps it
// writes where lse is not null), and a tile of consecutive rows of one sequence (extend and
// cascade).
struct Ahead;
template <typename T, typename O = T>
using RowFn = void (*)(const T*, const T*, const T*, O*, const int32_t*, int, int, int64_t,
                       int64_t, int64_t, float, float, const float*, float*, Ahead*);

template <typename T, typename O = T>
using TileFn = void (*)(const T*, const T*, const T*, O*, const int32_t*, const int32_t*,
                        const int32_t*, int, int, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float, float, const float*, float*, int64_t);

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The next sequence a thread will take, every KV head's K/V (whole blocks), asked into L2 a
// few lines per key while this one's work items are summed: a batch of short rows otherwise
// starts each sequence on cold memory, and a thread alternates between summing and waiting
// (32 rows of 150 keys over 30 layers' caches, bfloat16: 6.5 ms against 3.0 in cache).
struct Ahead {
  const char* k = nullptr;  // the caches' bases (KV head 0); null: nothing to fetch
  const char* v = nullptr;
  const int32_t* table = nullptr;  // the blocks left to fetch
  int64_t block_bytes = 0, blocks = 0;
  int64_t line = 0;  // the next byte to fetch in the first block left
  int per_key = 0;   // lines (of K, and of V) a key
  bool here = false;  // this sequence was fetched so (its items skip NextBlock)
  void tick() {
    if (blocks == 0) return;
    const int64_t base = int64_t(*table) * block_bytes;
    for (int i = 0; i < per_key; ++i, line += 64) {
      _mm_prefetch(k + base + line, _MM_HINT_T1);
      _mm_prefetch(v + base + line, _MM_HINT_T1);
    }
    if (line >= block_bytes) line = 0, ++table, --blocks;
  }
};

// The rows of the block after this one that this work item will read, asked into L2 a key
// at a time while this block is summed. The block table scatters blocks, and a KV head's
// slice of each row (a third of it for SmolLM2) breaks the hardware prefetcher's streams:
// without this a decode step waited on memory for most of its K/V (1.6-1.8x slower on the
// AVX2 EPYC). L2, not L1: a block's worth of requests at once would overrun L1's queue.
struct NextBlock {
  const char* k = nullptr;  // null: no next block
  const char* v = nullptr;
  int64_t stride = 0;       // bytes between rows
  int bytes = 0;            // bytes of the head's slice of a row
  Ahead* ahead = nullptr;   // where not null, ticked once a key as the values are summed
  void fetch(const char* base, int t) const {
    for (int b = 0; b < bytes; b += 64) _mm_prefetch(base + t * stride + b, _MM_HINT_T1);
  }
};
#endif

#if defined(__AVX512F__)
namespace v16 {  // the AVX-512 build's 16-lane decode rows

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 is the high half of a float32
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for 16 lanes (Cephes' expf polynomial, ~1 ulp): n = round(x / ln 2), r = x - n ln 2,
// e^x = 2^n * p(r).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// tanh for 16 lanes: the Taylor polynomial below |x| = 0.5, 1 - 2 / (e^2|x| + 1) above
// (exp16 saturates: 1 for large |x|), x's sign put back.
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x), x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kTanh[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(kTanh[i]));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 big = _mm512_sub_ps(
      one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp16(_mm512_add_ps(ax, ax)), one)));
  const __m512 t = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.5f), _CMP_LT_OQ), big, _mm512_mul_ps(p, ax));
  return _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(t),
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u)))));
}

// Soft-capping of scores [t0, n): s = cap * tanh(s / cap), as transformers' Gemma 2 does it.
inline void softcap_scores(float* s, int t0, int n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  for (int t = t0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(k, s + t);
    _mm512_mask_storeu_ps(s + t, k, _mm512_mul_ps(c, tanh16(_mm512_div_ps(x, c))));
  }
}

// The online-softmax update for one head over one block of 16 scores (lanes [t0, n) valid):
// the scores become probabilities; returns the factor that rescales what came before.
inline float softmax_block16(float* s, int t0, int n, float& m, float& l) {
  const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << t0) - 1u));
  const __m512 x = _mm512_maskz_loadu_ps(valid, s);
  const float mx = std::max(m, _mm512_mask_reduce_max_ps(valid, x));
  const float correction = std::exp(m - mx);
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
  _mm512_storeu_ps(s, p);
  l = l * correction + _mm512_reduce_add_ps(p);
  m = mx;
  return correction;
}

// Sixteen per-token dot-product vectors reduced to one vector of sixteen sums (lane t = token
// t) by a shuffle tree: 15 adds instead of 16 horizontal reductions. Lanes never mix tokens,
// so a stale row past the sequence's end only spoils its own (masked) lane.
struct Transposer {
  __m512 quads[4];
  __m512 pairs[2];
  static __m512 pair(__m512 a, __m512 b) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  static __m512 quad(__m512 ab, __m512 cd) {  // per 128-bit lane: partial sums of a, b, c, d
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  }
  static __m512 lanes(__m512 x, __m512 y) {  // adds 128-bit lanes pairwise: x01 x23 y01 y23
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  // tokens 4k..4k+3 of the block
  void add_quad(int k, __m512 d0, __m512 d1, __m512 d2, __m512 d3) {
    quads[k] = quad(pair(d0, d1), pair(d2, d3));
  }
  __m512 sums() const {
    return lanes(lanes(quads[0], quads[1]), lanes(quads[2], quads[3]));
  }
};

#if defined(__AVX512BF16__)
// Scores of one head against a block of 16 bfloat16 keys with the AVX512-BF16 dot product
// (pairs of bf16 products summed in float32): keys are read as stored, never widened.
template <int C>
inline __m512 block_scores_bf16(const __m512bh (&qb)[C / 2], const uint16_t* kb,
                                int64_t row_stride) {
  Transposer tr;
  for (int k = 0; k < 4; ++k) {
    __m512 d[4];
    for (int i = 0; i < 4; ++i) {
      const uint16_t* row = kb + (4 * k + i) * row_stride;
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < C / 2; ++j)
        acc = _mm512_dpbf16_ps(acc, qb[j], (__m512bh)_mm512_loadu_si512(row + 32 * j));
      d[i] = acc;
    }
    tr.add_quad(k, d[0], d[1], d[2], d[3]);
  }
  return tr.sums();
}
#endif

// One (sequence, KV head) with the group size G and head_dim / 16 = C known at compile time:
// q and the output accumulators stay in registers across the whole context. Block size 16.
// lse, where not null: each head's log-sum-exp of its scores (a part of a row's context, merged
// later: decode_in_parts below); O: the output's type (float for such a part).
template <typename T, int G, int C, typename O = T>
void decode_item16_lse(const T* q, const T* k_cache, const T* v_cache, O* out,
                       const int32_t* table, int len, int lo, int64_t block_stride,
                       int64_t row_stride, int64_t q_head_stride, float scale, float softcap,
                       const float* sinks, float* lse, Ahead* ahead) {
  __m512 qv[G][C], acc[G][C];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      qv[g][c] = _mm512_mul_ps(load16(q + g * q_head_stride + c * 16), _mm512_set1_ps(scale));
      acc[g][c] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  alignas(64) float s[G][16];
#if defined(__AVX512BF16__)
  constexpr bool kBf16Dot = std::is_same_v<T, uint16_t>;
  __m512bh qb[G][C / 2];
  if constexpr (kBf16Dot)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < C / 2; ++j)
        qb[g][j] = (__m512bh)_mm512_loadu_si512(q + g * q_head_stride + 32 * j);
#else
  constexpr bool kBf16Dot = false;
#endif
  for (int first = lo / 16 * 16; first < len; first += 16) {
    const int64_t phys = table[first / 16];
    const T* kb = k_cache + phys * block_stride;
    const T* vb = v_cache + phys * block_stride;
    const int t0 = std::max(first, lo) - first;
    const int n = std::min(16, len - first);
    NextBlock next;  // fetched a row at a time while this block's values are summed
    if (first + 16 < len && !(ahead && ahead->here)) {
      const int64_t at = table[first / 16 + 1] * block_stride;
      next = {reinterpret_cast<const char*>(k_cache + at),
              reinterpret_cast<const char*>(v_cache + at), row_stride * int64_t(sizeof(T)),
              int(C * 16 * sizeof(T))};
    }
#if defined(__AVX512BF16__)
    if constexpr (kBf16Dot) {
      for (int g = 0; g < G; ++g)
        _mm512_store_ps(s[g], _mm512_mul_ps(block_scores_bf16<C>(qb[g], kb, row_stride),
                                            _mm512_set1_ps(scale)));
    } else
#endif
    {
      for (int t = t0; t < n; ++t) {
        __m512 d[G];
        for (int g = 0; g < G; ++g) d[g] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) {
          const __m512 kv = load16(kb + t * row_stride + c * 16);
          for (int g = 0; g < G; ++g) d[g] = _mm512_fmadd_ps(qv[g][c], kv, d[g]);
        }
        for (int g = 0; g < G; ++g) s[g][t] = _mm512_reduce_add_ps(d[g]);
      }
    }
    if (softcap > 0.f)
      for (int g = 0; g < G; ++g) softcap_scores(s[g], t0, n, softcap);
    for (int g = 0; g < G; ++g) {
      const float correction = softmax_block16(s[g], t0, n, m[g], l[g]);
      if (correction != 1.f)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(correction));
    }
    for (int t = t0; t < n; ++t) {
      if (next.k) {
        next.fetch(next.k, t);
        next.fetch(next.v, t);
      }
      if (ahead && ahead->k) ahead->tick();
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load16(vb + t * row_stride + c * 16);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][t]), vv, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(finish_scale(m[g], l[g], sinks ? sinks + g : nullptr));
    alignas(64) float row[C * 16];
    for (int c = 0; c < C; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[g][c], inv));
    for (int d = 0; d < C * 16; ++d) store_scalar(out + g * q_head_stride + d, row[d]);
    if (lse) lse[g] = m[g] + std::log(l[g]);
  }
}

// The fixed-shape path for this layout, or nullptr (then the general loop runs).
template <typename T, typename O = T>
RowFn<T, O> fixed_shape_row(int group, int head_dim, int block_size) {
  return fixed_shape<16>(group, head_dim, block_size, [](auto g, auto c) -> RowFn<T, O> {
    return decode_item16_lse<T, decltype(g)::value, decltype(c)::value, O>;
  });
}

}  // namespace v16
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace v8 {
// The 8-lane kernels: on the AVX2 build (no AVX-512) every fixed-shape path, the same
// algorithm as decode_item16_lse on 8-lane vectors (head_dim / 8 = C chunks, blocks of 16 tokens
// scored as two halves of 8); on the AVX-512 builds their GEMM-shaped tiles (extend and the
// cascade's shared prefixes), beside v16's decode rows, with the tiles' products on 16 lanes
// (tile_scores, tile_accumulate) and the rest (transposes, softmax) as on AVX2.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 is the high half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Eight dot-product vectors reduced to one vector of their eight sums (lane t = vector t).
inline __m256 sums8(const __m256 (&d)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// e^x for 8 lanes (the same Cephes polynomial as exp16). x is clamped to [-87, 88] so that
// 2^n stays a normal float; e^-87 is ~1e-38, far below any probability softmax keeps.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// tanh for 8 lanes, as tanh16: the Taylor polynomial below |x| = 0.5, 1 - 2 / (e^2|x| + 1)
// above, x's sign put back.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 ax = _mm256_andnot_ps(sign, x), x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kTanh[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(kTanh[i]));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 big = _mm256_sub_ps(
      one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp8(_mm256_add_ps(ax, ax)), one)));
  const __m256 t = _mm256_blendv_ps(big, _mm256_mul_ps(p, ax),
                                    _mm256_cmp_ps(ax, _mm256_set1_ps(0.5f), _CMP_LT_OQ));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// Soft-capping of scores [t0, n): s = cap * tanh(s / cap), as transformers' Gemma 2 does it.
inline void softcap_scores(float* s, int t0, int n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int t = t0; t < n; t += 8) {
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), lane);
    const __m256 x = _mm256_maskload_ps(s + t, k);
    _mm256_maskstore_ps(s + t, k, _mm256_mul_ps(c, tanh8(_mm256_div_ps(x, c))));
  }
}

// The online-softmax update for one head over one block of 16 scores (lanes [t0, n) valid).
inline float softmax_block16(float* s, int t0, int n, float& m, float& l) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 valid[2], x[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i t = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h));
    valid[h] = _mm256_castsi256_ps(_mm256_and_si256(
        _mm256_cmpgt_epi32(t, _mm256_set1_epi32(t0 - 1)), _mm256_cmpgt_epi32(_mm256_set1_epi32(n), t)));
    x[h] = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                            _mm256_loadu_ps(s + 8 * h), valid[h]);
  }
  const float mx = std::max(m, hmax8(_mm256_max_ps(x[0], x[1])));
  const float correction = m == mx ? 1.f : std::exp(m - mx);  // (the max rarely moves)
  __m256 total = _mm256_setzero_ps();
  for (int h = 0; h < 2; ++h) {
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x[h], _mm256_set1_ps(mx))), valid[h]);
    _mm256_storeu_ps(s + 8 * h, p);
    total = _mm256_add_ps(total, p);
  }
  l = l * correction + hsum8(total);
  m = mx;
  return correction;
}

// One query row's state while it walks its context: its G query heads and their output
// accumulators in registers, the online softmax's running max and sum.
template <int G, int C>
struct RowState {
  __m256 q[G][C];
  __m256 acc[G][C];
  float m[G], l[G];
};

template <typename T, int G, int C>
inline void row_block(RowState<G, C>& st, const T* kb, const T* vb, int t0, int n,
                      int64_t row_stride, const NextBlock& next, float softcap) {
  alignas(32) float s[G][16];
  for (int g = 0; g < G; ++g) {
    __m256 qg[C];
    for (int c = 0; c < C; ++c) qg[c] = st.q[g][c];
    for (int half = 0; half < 2 && 8 * half < n; ++half) {
      const int rows = std::min(8, n - 8 * half);
      __m256 d[8];
      for (int t = 0; t < 8; ++t) {
        d[t] = _mm256_setzero_ps();
        if (t >= rows) continue;
        if (g == 0 && next.k) next.fetch(next.k, 8 * half + t);
        const T* kr = kb + (8 * half + t) * row_stride;
        for (int c = 0; c < C; ++c) d[t] = _mm256_fmadd_ps(qg[c], load8(kr + c * 8), d[t]);
      }
      _mm256_store_ps(s[g] + 8 * half, sums8(d));
    }
    if (softcap > 0.f) softcap_scores(s[g], t0, n, softcap);
    const float correction = softmax_block16(s[g], t0, n, st.m[g], st.l[g]);
    if (correction != 1.f)
      for (int c = 0; c < C; ++c) st.acc[g][c] = _mm256_mul_ps(st.acc[g][c], _mm256_set1_ps(correction));
  }
  // CU chunks at once: G * CU independent accumulator chains keep both FMA pipes busy (G
  // alone, 3 for SmolLM2, would wait on FMA latency); G * CU + G + 1 <= 16 registers
  constexpr int kUnroll = G >= 5 ? 1 : (G >= 3 ? 4 : (G == 2 ? 4 : 8));
  constexpr int CU = kUnroll < C ? kUnroll : C;
  for (int c0 = 0; c0 < C; c0 += CU) {
    __m256 a[G][CU];
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < CU; ++u) a[g][u] = st.acc[g][c0 + u];
    for (int t = t0; t < n; ++t) {
      if (c0 == 0 && next.v) next.fetch(next.v, t);
      if (c0 == 0 && next.ahead) next.ahead->tick();
      for (int u = 0; u < CU; ++u) {
        const __m256 vv = load8(vb + t * row_stride + (c0 + u) * 8);
        for (int g = 0; g < G; ++g) a[g][u] = _mm256_fmadd_ps(_mm256_set1_ps(s[g][t]), vv, a[g][u]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < CU; ++u) st.acc[g][c0 + u] = a[g][u];
  }
}

// bfloat16 rows [0, n) of a K or V block widened once into float32 rows of C * 8 (every
// query head, and every row of a tile, would widen them again)
template <typename T, int C>
inline void widen_rows(const T* src, int64_t row_stride, int n, float* dst) {
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) _mm256_store_ps(dst + (t * C + c) * 8, load8(src + t * row_stride + c * 8));
}

// One query row (a decode step's, or a tile of one) walks its context block by block: its G
// query heads and their accumulators stay in registers, scores are per-key dot products.
// lse, where not null: each head's log-sum-exp of its scores (lse[g]), for merging this
// part of the context with another (a shared prefix's, see cascade below). sinks, where not
// null: this KV head's query heads' sinks (a part's caller leaves them to the merge). O: the
// output's type (float for a part that is merged later, whatever T is).
template <typename T, int G, int C, typename O = T>
void decode_item8_lse(const T* q, const T* k_cache, const T* v_cache, O* out,
                      const int32_t* table, int len, int lo, int64_t block_stride,
                      int64_t row_stride, int64_t q_head_stride, float scale, float softcap,
                      const float* sinks, float* lse, Ahead* ahead) {
  RowState<G, C> st;
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      st.q[g][c] = _mm256_mul_ps(load8(q + g * q_head_stride + c * 8), _mm256_set1_ps(scale));
      st.acc[g][c] = _mm256_setzero_ps();
    }
    st.m[g] = -std::numeric_limits<float>::infinity();
    st.l[g] = 0.f;
  }
  alignas(32) float kf[std::is_same_v<T, float> ? 1 : 16 * C * 8];
  alignas(32) float vf[std::is_same_v<T, float> ? 1 : 16 * C * 8];
  for (int first = lo / 16 * 16; first < len; first += 16) {
    const int64_t phys = table[first / 16];
    const T* kb = k_cache + phys * block_stride;
    const T* vb = v_cache + phys * block_stride;
    const int t0 = std::max(first, lo) - first, n = std::min(16, len - first);
    NextBlock next;
    if (first + 16 < len && !(ahead && ahead->here)) {
      const int64_t at = table[first / 16 + 1] * block_stride;
      next = {reinterpret_cast<const char*>(k_cache + at),
              reinterpret_cast<const char*>(v_cache + at), row_stride * int64_t(sizeof(T)),
              int(C * 8 * sizeof(T))};
    }
    if (ahead && ahead->k) next.ahead = ahead;
    if constexpr (std::is_same_v<T, float>) {
      row_block<float, G, C>(st, kb, vb, t0, n, row_stride, next, softcap);
    } else {
      widen_rows<T, C>(kb, row_stride, n, kf);
      widen_rows<T, C>(vb, row_stride, n, vf);
      row_block<float, G, C>(st, kf, vf, t0, n, C * 8, next, softcap);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(finish_scale(st.m[g], st.l[g], sinks ? sinks + g : nullptr));
    alignas(32) float row[C * 8];
    for (int c = 0; c < C; ++c) _mm256_store_ps(row + c * 8, _mm256_mul_ps(st.acc[g][c], inv));
    for (int d = 0; d < C * 8; ++d) store_scalar(out + g * q_head_stride + d, row[d]);
    if (lse) lse[g] = st.m[g] + std::log(st.l[g]);
  }
}

inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kt[d][t] = key t's dimension d for t < n, 0 past n: 8 x 8 transposes in registers
template <typename T, int D>
inline void transpose_keys(const T* kb, int64_t row_stride, int n, float (*kt)[16]) {
  for (int h = 0; h < 2; ++h)
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = 8 * h + i < n ? load8(kb + (8 * h + i) * row_stride + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(kt[d0 + i] + 8 * h, r[i]);
    }
}

#if defined(__AVX512F__)
// Scores of J query vectors against a block's 16 transposed keys, and P @ V for them
// (tile_accumulate, below), on 16 lanes (the AVX-512 builds): one accumulator per query vector,
// twelve of them sharing each load. Each lane sums the same products in the
// same order as the 8-lane forms: the same bits.
template <int J, int D>
inline void tile_scores(const float (*qs)[D], const float (*kt)[16], float (*s)[16]) {
  __m512 a[J];
  for (int j = 0; j < J; ++j) a[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m512 k = _mm512_load_ps(kt[d]);
    for (int j = 0; j < J; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(qs[j][d]), k, a[j]);
  }
  for (int j = 0; j < J; ++j) _mm512_store_ps(s[j], a[j]);
}

template <int J, int D>
inline void tile_accumulate(float (*acc)[D], const float (*p)[16], const float* v,
                            int64_t v_stride, int t0, int t1) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512 a[J];
    for (int j = 0; j < J; ++j) a[j] = _mm512_load_ps(acc[j] + d0);
    for (int t = t0; t < t1; ++t) {
      const __m512 vv = _mm512_loadu_ps(v + t * v_stride + d0);
      for (int j = 0; j < J; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j][t]), vv, a[j]);
    }
    for (int j = 0; j < J; ++j) _mm512_store_ps(acc[j] + d0, a[j]);
  }
}
constexpr int kTileGroup = 12;  // query vectors a pass (accumulators)
#else
// The same on 8 lanes (the AVX2 build): 2 x J accumulators
template <int J, int D>
inline void tile_scores(const float (*qs)[D], const float (*kt)[16], float (*s)[16]) {
  __m256 a[J][2];
  for (int j = 0; j < J; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt[d]), k1 = _mm256_load_ps(kt[d] + 8);
    for (int j = 0; j < J; ++j) {
      const __m256 b = _mm256_broadcast_ss(&qs[j][d]);
      a[j][0] = _mm256_fmadd_ps(b, k0, a[j][0]);
      a[j][1] = _mm256_fmadd_ps(b, k1, a[j][1]);
    }
  }
  for (int j = 0; j < J; ++j) {
    _mm256_store_ps(s[j], a[j][0]);
    _mm256_store_ps(s[j] + 8, a[j][1]);
  }
}

// acc[j][d0 .. d0 + 16) += sum over t in [t0, t1) of p[j][t] * v[t][d0 ..]
template <int J, int D>
inline void tile_accumulate(float (*acc)[D], const float (*p)[16], const float* v,
                            int64_t v_stride, int t0, int t1) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 a[J][2];
    for (int j = 0; j < J; ++j) {
      a[j][0] = _mm256_load_ps(acc[j] + d0);
      a[j][1] = _mm256_load_ps(acc[j] + d0 + 8);
    }
    for (int t = t0; t < t1; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * v_stride + d0);
      const __m256 v1 = _mm256_loadu_ps(v + t * v_stride + d0 + 8);
      for (int j = 0; j < J; ++j) {
        const __m256 b = _mm256_broadcast_ss(&p[j][t]);
        a[j][0] = _mm256_fmadd_ps(b, v0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(b, v1, a[j][1]);
      }
    }
    for (int j = 0; j < J; ++j) {
      _mm256_store_ps(acc[j] + d0, a[j][0]);
      _mm256_store_ps(acc[j] + d0 + 8, a[j][1]);
    }
  }
}

constexpr int kTileGroup = 6;
#endif

// f(j, Int<J>) for the last group, of `left` < kTileGroup query vectors from j
template <int J, typename F>
inline void last_group(int j, int left, F f) {
  if constexpr (J > 0) {
    if (left == J) return f(j, Int<J>{});
    last_group<J - 1>(j, left, f);
  }
}

// f(j, Int<J>) over query vectors [q0, q1) in groups of kTileGroup, the rest in one smaller
template <typename F>
inline void by_groups(int q0, int q1, F f) {
  int j = q0;
  for (; j + kTileGroup <= q1; j += kTileGroup) f(j, Int<kTileGroup>{});
  last_group<kTileGroup - 1>(j, q1 - j, f);
}

// Extend (prefill chunks over a cached prefix, or fresh): a tile of up to kTileRows
// consecutive query rows of one sequence walks the context block by block, GEMM-shaped: its
// count * G query vectors meet each K/V block together. The block's keys are transposed once
// (kt[d] holds dimension d of its 16 keys), so scores are outer-product FMAs, kTileGroup query
// vectors by 16 keys (6 in 12 accumulators on AVX2, 12 in 12 on AVX-512), with no horizontal
// sums; P @ V is the same shape, kTileGroup query vectors by 16 dimensions. Each K/V element
// loaded feeds up to kTileGroup query vectors.
// rows[r] / lens[r] for r < count: the tile's rows (lens ascending by one); q and out point
// at this KV head's first query head of row 0.
constexpr int kTileRows = 16;

// lse, where not null: row rows[r]'s heads' log-sum-exps at lse + rows[r] * lse_stride.
// sinks as in decode_item8_lse.
template <typename T, int G, int C, typename O = T>
void extend_tile8(const T* q, const T* k_cache, const T* v_cache, O* out, const int32_t* table,
                  const int32_t* rows, const int32_t* lens, int count, int window,
                  int64_t block_stride, int64_t row_stride, int64_t q_stride, int64_t out_stride,
                  int64_t q_head_stride, float scale, float softcap, const float* sinks,
                  float* lse, int64_t lse_stride) {
  constexpr int D = C * 8, NQ = kTileRows * G;
  static_assert(D % 16 == 0, "P @ V takes 16 dimensions at a time");
  if (count == 1) {  // a tile of one: the decode row's form, which transposes nothing
    const int lo = window > 0 ? std::max(0, lens[0] - window) : 0;
    return decode_item8_lse<T, G, C, O>(q + int64_t(rows[0]) * q_stride, k_cache, v_cache,
                                     out + int64_t(rows[0]) * out_stride, table, lens[0], lo,
                                     block_stride, row_stride, q_head_stride, scale, softcap,
                                     sinks, lse ? lse + int64_t(rows[0]) * lse_stride : nullptr,
                                     nullptr);
  }
  alignas(32) float qs[NQ][D];
  alignas(32) float acc[NQ][D];
  alignas(32) float s[NQ][16];
  alignas(32) float kt[D][16];
  alignas(32) float vf[std::is_same_v<T, float> ? 1 : 16 * D];
  float m[NQ], l[NQ];
  int len[kTileRows], lo[kTileRows];
  for (int r = 0; r < count; ++r) {
    const T* qr = q + int64_t(rows[r]) * q_stride;
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        _mm256_store_ps(qs[r * G + g] + c * 8,
                        _mm256_mul_ps(load8(qr + g * q_head_stride + c * 8), _mm256_set1_ps(scale)));
    len[r] = lens[r];
    lo[r] = window > 0 ? std::max(0, lens[r] - window) : 0;
  }
  const int nq = count * G;
  std::memset(acc, 0, sizeof(float) * nq * D);
  std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nq, 0.f);
  // lens and lo rise with the row: the rows a block serves are a contiguous run
  for (int first = lo[0] / 16 * 16; first < len[count - 1]; first += 16) {
    int ra = 0, rb = count;
    while (ra < count && len[ra] <= first) ++ra;
    while (rb > ra && lo[rb - 1] >= first + 16) --rb;
    if (ra == rb) continue;
    const int64_t phys = table[first / 16];
    const T* kb = k_cache + phys * block_stride;
    const T* vb = v_cache + phys * block_stride;
    const int n = std::min(16, len[rb - 1] - first);  // keys any row of the run reads
    transpose_keys<T, D>(kb, row_stride, n, kt);
    const float* v = nullptr;
    int64_t v_stride = row_stride;
    if constexpr (std::is_same_v<T, float>) {
      v = vb;
    } else {
      widen_rows<T, C>(vb, row_stride, n, vf);
      v = vf;
      v_stride = D;
    }
    const int qa = ra * G, qb = rb * G;
    by_groups(qa, qb, [&](int j, auto J) {
      tile_scores<decltype(J)::value, D>(qs + j, kt, s + j);
    });
    for (int r = ra; r < rb; ++r) {
      const int t0 = std::max(first, lo[r]) - first, nr = std::min(16, len[r] - first);
      for (int g = 0; g < G; ++g) {
        const int j = r * G + g;
        if (softcap > 0.f) softcap_scores(s[j], t0, nr, softcap);
        const float correction = softmax_block16(s[j], t0, nr, m[j], l[j]);
        if (correction != 1.f)
          for (int c = 0; c < C; ++c)
            _mm256_store_ps(acc[j] + c * 8,
                            _mm256_mul_ps(_mm256_load_ps(acc[j] + c * 8), _mm256_set1_ps(correction)));
      }
    }
    // lanes outside a row's [t0, nr) hold p = 0: the run's union of lanes serves every row
    const int t_lo = std::max(first, lo[ra]) - first;
    by_groups(qa, qb, [&](int j, auto J) {
      tile_accumulate<decltype(J)::value, D>(acc + j, s + j, v, v_stride, t_lo, n);
    });
  }
  for (int r = 0; r < count; ++r) {
    O* dst = out + int64_t(rows[r]) * out_stride;
    for (int g = 0; g < G; ++g) {
      const int j = r * G + g;
      const float inv = finish_scale(m[j], l[j], sinks ? sinks + g : nullptr);
      for (int d = 0; d < D; ++d) store_scalar(dst + g * q_head_stride + d, acc[j][d] * inv);
      if (lse) lse[int64_t(rows[r]) * lse_stride + g] = m[j] + std::log(l[j]);
    }
  }
}

template <typename T, typename O = T>
RowFn<T, O> fixed_shape_row(int group, int head_dim, int block_size) {
  return fixed_shape<8>(group, head_dim, block_size, [](auto g, auto c) -> RowFn<T, O> {
    return decode_item8_lse<T, decltype(g)::value, decltype(c)::value, O>;
  });
}

// O: the output's type (float for the cascade's prefix part, merged later, whatever T is)
template <typename T, typename O = T>
TileFn<T, O> fixed_shape_tile(int group, int head_dim, int block_size) {
  return fixed_shape<8>(group, head_dim, block_size, [](auto g, auto c) -> TileFn<T, O> {
    return extend_tile8<T, decltype(g)::value, decltype(c)::value, O>;
  });
}

}  // namespace v8
#endif

// Each build's kernels: decode rows and extend tiles on its widest vectors. A decode row is
// summed in parts (below) once its context passes kPartsFrom tokens: every row on AVX2 (parts
// of 128 tokens); on the AVX-512 builds, whose 16-lane rows cost less, rows past 1,024 tokens,
// in parts of 1,024 (parts of 128 for every row ran a batch of 32 rows of 200-700 tokens
// 1.24x slower there; 1,024 from 1,024: a lone row of 8,192 tokens 0.76x, 32 rows of
// 1,500-2,500 0.88-0.95x, rows under 1,024 as before; 2-core AMX Xeon, HISTORY.md, session 26).
#if defined(__AVX512F__)
using namespace v16;
#define QUIRE_FIXED_SHAPE_PATH 1
constexpr int kPartsFrom = 1024;
#if defined(__AVX2__) && defined(__FMA__)
using v8::fixed_shape_tile;
using v8::kTileRows;
#endif
#elif defined(__AVX2__) && defined(__FMA__)
using namespace v8;
#define QUIRE_FIXED_SHAPE_PATH 1
constexpr int kPartsFrom = 0;
#endif

#if defined(QUIRE_FIXED_SHAPE_PATH) && defined(__AVX2__) && defined(__FMA__)
// Decode rows in parts. A row's context [lo, len), once longer than kPartsFrom tokens, is
// summed in parts that end at fixed multiples of kPartTokens (counted from the sequence's first
// token, so they depend on the row alone, not on the batch or the threads), each KV head's
// part a work item of its own: one sequence with a long context keeps every thread busy (its
// 3 KV heads, SmolLM2's, left one of two threads idle half the time, and a KV head's slice of
// each row is a third of the row, so one thread read it at ~7 GB/s). The parts merge by their log-sum-exps, in order, sinks
// joining the denominator there. A row of one part (len <= kPartTokens, or a context of
// kPartsFrom tokens or fewer) is summed as before, straight into `out`.
//
// shared (cascade, or null): tokens of each row already summed by tiles, whose outputs and
// log-sum-exps (prefix_out [row][head][d], prefix_lse [row][head]) come first in its merge;
// `tiles` work items, run by run_tile(work), go ahead of the parts in the same loop.
// Returns false, having done nothing, where the layout has no fixed shape or no row (and no
// tile) needs a merge: the caller's one-item-per-row path then gives the same bits.
constexpr int kPartTokens = kPartsFrom == 0 ? 128 : 1024;
constexpr int kMaxHeadDim = 128;  // the fixed shapes' largest head_dim

// A batch of decode rows taken a sequence (every KV head, every part) a grab, where there are
// at least two a thread: each thread takes its next sequence before summing this one and
// fetches that one's K/V meanwhile (Ahead), where it fits in ahead_bytes() (the L2 then holds
// this sequence and the next). A row's sums do not depend on who takes it: the same bits as
// items taken one by one. 32 rows over 30 layers' caches, bfloat16, 150 / 400 keys: 6.5 / 20.5
// ms -> 5.0 / 15.3 (avx512_bf16 build, 2-core AMX Xeon; 3.0 / 5.6 with the caches in L2).
// Sequences of fewer blocks are not fetched: their cold start costs less than the fetches'
// instructions (32 rows of 20 keys: 1.29 ms fetched against 1.12 not; cached, 1.06 against
// 0.79).
constexpr int kAheadMinBlocks = 3;

// A fifth of the L2, at most 384 KiB (the Xeon's 2 MiB; measured there only: a Zen's 512 KiB
// or 1 MiB L2 gets 100 or 200 KiB).
inline int64_t ahead_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::min<int64_t>(384 << 10, l2 / 5) : int64_t(384) << 10;
  }();
  return bytes;
}

inline bool by_sequence(int64_t num_seqs) { return num_seqs >= 2 * omp_get_max_threads(); }

// Inside a parallel region: run(i, ahead) for every sequence i, the next one's keys [lo(i),
// seq_lens[i]) fetched meanwhile (block_bytes: a block of every KV head, of K or of V).
template <typename Lo, typename Run>
void grab_sequences(const char* k_cache, const char* v_cache, const int32_t* block_tables,
                    int64_t bt_stride, const int32_t* seq_lens, int64_t num_seqs,
                    int num_kv_heads, int64_t block_bytes, int64_t& taken, Lo lo, Run run) {
  auto take = [&] {
    int64_t i;
#pragma omp atomic capture
    i = taken++;
    return i;
  };
  bool fetched = false;
  for (int64_t i = take(); i < num_seqs;) {
    const int64_t after = take();
    Ahead ahead;
    ahead.here = fetched;
    if (after < num_seqs) {
      const int first = lo(after) / 16, blocks = (seq_lens[after] + 15) / 16 - first;
      if (blocks >= kAheadMinBlocks && 2 * blocks * block_bytes <= ahead_bytes()) {
        ahead.k = k_cache;
        ahead.v = v_cache;
        ahead.table = block_tables + after * bt_stride + first;
        ahead.block_bytes = block_bytes;
        ahead.blocks = blocks;
        // a whole number of ticks a block, so that a block's lines end on a tick
        const int64_t keys = std::max<int64_t>(1, int64_t(seq_lens[i] - lo(i)) * num_kv_heads);
        const int64_t lines = (block_bytes + 63) / 64;
        const int64_t ticks = std::max<int64_t>(1, keys / blocks);
        ahead.per_key = int((lines + ticks - 1) / ticks);
      }
    }
    fetched = ahead.k != nullptr;
    run(i, &ahead);
    i = after;
  }
}

template <typename T>
void decode_ahead(RowFn<T> item, const T* q, const T* k_cache, const T* v_cache, T* out,
                  const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                  int group, int num_kv_heads, int head_dim, int64_t q_stride,
                  int64_t out_stride, int64_t bt_stride, float scale, float softcap,
                  const float* sinks, int64_t block_stride, int64_t row_stride) {
  int64_t taken = 0;
#pragma omp parallel
  grab_sequences(reinterpret_cast<const char*>(k_cache), reinterpret_cast<const char*>(v_cache),
                 block_tables, bt_stride, seq_lens, num_seqs, num_kv_heads,
                 block_stride * int64_t(sizeof(T)), taken, [](int64_t) { return 0; },
                 [&](int64_t i, Ahead* ahead) {
                   for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                     const int64_t head = int64_t(kv_head) * group * head_dim;
                     item(q + i * q_stride + head, k_cache + int64_t(kv_head) * head_dim,
                          v_cache + int64_t(kv_head) * head_dim, out + i * out_stride + head,
                          block_tables + i * bt_stride, seq_lens[i], 0, block_stride,
                          row_stride, head_dim, scale, softcap,
                          sinks ? sinks + kv_head * group : nullptr, nullptr, ahead);
                   }
                 });
}

template <typename T, typename RunTile>
bool decode_in_parts(const T* q, const T* k_cache, const T* v_cache, T* out,
                     const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int64_t q_stride,
                     int64_t out_stride, int64_t bt_stride, float scale, int window,
                     float softcap, const float* sinks, int64_t block_stride,
                     int64_t row_stride, const int32_t* shared, const float* prefix_out,
                     const float* prefix_lse, int64_t tiles, RunTile run_tile) {
  const int group = num_heads / num_kv_heads;
  const RowFn<T> whole = fixed_shape_row<T>(group, head_dim, 16);
  const RowFn<T, float> part = fixed_shape_row<T, float>(group, head_dim, 16);
  if (!whole || !part) return false;
  // parts [first[i], first[i + 1]) are row i's, in order; row_of[p]: part p's row
  static thread_local std::vector<int64_t> first_part;
  static thread_local std::vector<int32_t> part_row;
  auto first_key = [&](int64_t i) {  // row i's first token to sum here
    const int len = seq_lens[i];
    return std::max(window > 0 ? std::max(0, len - window) : 0, shared ? shared[i] : 0);
  };
  first_part.resize(num_seqs + 1);
  part_row.clear();
  bool merges = tiles > 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int len = seq_lens[i], lo = first_key(i);
    const int n = len - lo > kPartsFrom ? (len - 1) / kPartTokens - lo / kPartTokens + 1 : 1;
    first_part[i] = int64_t(part_row.size());
    part_row.insert(part_row.end(), n, int32_t(i));
    merges = merges || n > 1;
  }
  first_part[num_seqs] = int64_t(part_row.size());
  if (!merges) return false;
  const int64_t parts = first_part[num_seqs], width = int64_t(num_heads) * head_dim;
  static thread_local std::vector<float> parts_out, parts_lse;
  parts_out.resize(parts * width);
  parts_lse.resize(parts * num_heads);
  // raw pointers: the parallel region's other threads would see their own thread_locals
  float* const po = parts_out.data();
  float* const pl = parts_lse.data();
  const int64_t* const first = first_part.data();
  const int32_t* const row_of = part_row.data();
  const int64_t items = tiles + parts * num_kv_heads;
  const int grab = tiles == 0 && items >= 64 ? 4 : 1;  // items a grab (as the one-item path)
  const bool sequences = tiles == 0 && shared == nullptr && by_sequence(num_seqs);
  int64_t taken = 0;
  // part p of row i for one KV head
  auto run_part = [&](int64_t p, int kv_head, Ahead* ahead) {
    const int64_t i = row_of[p];
    const int len = seq_lens[i], lo = first_key(i);
    const int64_t head = int64_t(kv_head) * group * head_dim;
    const T* qh = q + i * q_stride + head;
    const T* kc = k_cache + int64_t(kv_head) * head_dim;
    const T* vc = v_cache + int64_t(kv_head) * head_dim;
    const int32_t* table = block_tables + i * bt_stride;
    const bool alone = first[i + 1] - first[i] == 1 && !(shared && shared[i]);
    if (alone) {  // the whole context, straight into out, as the one-item path sums it
      whole(qh, kc, vc, out + i * out_stride + head, table, len, lo, block_stride, row_stride,
            head_dim, scale, softcap, sinks ? sinks + kv_head * group : nullptr, nullptr,
            ahead);
      return;
    }
    const int begin = (lo / kPartTokens + int(p - first[i])) * kPartTokens;
    const bool in_parts = len - lo > kPartsFrom;
    const int end = in_parts ? std::min(len, begin + kPartTokens) : len;
    part(qh, kc, vc, po + p * width + head, table, end, in_parts ? std::max(lo, begin) : lo,
         block_stride, row_stride, head_dim, scale, softcap, nullptr,
         pl + p * num_heads + kv_head * group, ahead);
  };
#pragma omp parallel
  {
    if (sequences) {
      grab_sequences(reinterpret_cast<const char*>(k_cache),
                     reinterpret_cast<const char*>(v_cache), block_tables, bt_stride, seq_lens,
                     num_seqs, num_kv_heads, block_stride * int64_t(sizeof(T)), taken, first_key,
                     [&](int64_t i, Ahead* ahead) {
                       for (int64_t p = first[i]; p < first[i + 1]; ++p)
                         for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)
                           run_part(p, kv_head, ahead);
                     });
#pragma omp barrier
    } else {
#pragma omp for schedule(dynamic, grab)
      for (int64_t work = 0; work < items; ++work) {
        if (work < tiles) run_tile(work);
        else run_part((work - tiles) / num_kv_heads, int((work - tiles) % num_kv_heads), nullptr);
      }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_seqs; ++i) {
      const bool prefix = shared && shared[i];
      if (first[i + 1] - first[i] == 1 && !prefix) continue;
      for (int h = 0; h < num_heads; ++h) {
        // weights relative to the largest log-sum-exp (or sink), summed in the parts' order
        float top = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
        if (prefix) top = std::max(top, prefix_lse[i * num_heads + h]);
        for (int64_t p = first[i]; p < first[i + 1]; ++p) top = std::max(top, pl[p * num_heads + h]);
        float acc[kMaxHeadDim], total = sinks ? std::exp(sinks[h] - top) : 0.f;
        std::fill(acc, acc + head_dim, 0.f);
        auto add = [&](const float* o, float lse) {
          const float w = std::exp(lse - top);
          total += w;
          for (int d = 0; d < head_dim; ++d) acc[d] += w * o[d];
        };
        if (prefix) add(prefix_out + i * width + int64_t(h) * head_dim, prefix_lse[i * num_heads + h]);
        for (int64_t p = first[i]; p < first[i + 1]; ++p)
          add(po + p * width + int64_t(h) * head_dim, pl[p * num_heads + h]);
        const float inv = 1.f / total;
        T* dst = out + i * out_stride + int64_t(h) * head_dim;
        for (int d = 0; d < head_dim; ++d) store_scalar(dst + d, acc[d] * inv);
      }
    }
  }
  return true;
}

template <typename T>
bool split_decode(const T* q, const T* k_cache, const T* v_cache, T* out,
                  const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                  int num_heads, int num_kv_heads, int head_dim, int64_t q_stride,
                  int64_t out_stride, int64_t bt_stride, float scale, int window, float softcap,
                  const float* sinks, int64_t block_stride, int64_t row_stride) {
  return decode_in_parts<T>(q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs,
                            num_heads, num_kv_heads, head_dim, q_stride, out_stride, bt_stride,
                            scale, window, softcap, sinks, block_stride, row_stride, nullptr,
                            nullptr, nullptr, 0, [](int64_t) {});
}

// Cascade decode. Rows whose block tables start with the same physical blocks (a cached
// prefix that several requests share, e.g. one system prompt) read that prefix once for all
// of them, in GEMM-shaped tiles of up to kTileRows rows: each K/V block then feeds count * G
// query vectors instead of G. Each row reads its own tail alone, and the two parts merge by
// their log-sum-exps (the parts stay float32 until merged, whatever the cache's dtype). No
// sliding window, decode rows only (row i is sequence i). Sinks join at the merge (a row read
// alone takes its own). Returns false, having done nothing, where no group of rows qualifies.
constexpr int kCascadeMinRows = 4;    // rows sharing a prefix, for its tiles to pay
// blocks they share: 64 tokens on AVX2; 384 on AVX-512, whose 16-lane rows read alone cost
// less against the tiles and merges (32 float32 rows sharing 256 tokens ran 1.06x slower
// through the cascade, sharing 512 0.92x, 1,024 0.65x; HISTORY.md, session 26)
constexpr int kCascadeMinBlocks = kPartsFrom == 0 ? 4 : 24;

template <typename T>
bool cascade_decode(const T* q, const T* k_cache, const T* v_cache, T* out,
                    const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                    int num_heads, int num_kv_heads, int head_dim, int64_t q_stride,
                    int64_t out_stride, int64_t bt_stride, float scale, float softcap,
                    const float* sinks, int64_t block_stride, int64_t row_stride) {
  const int group = num_heads / num_kv_heads;
  const TileFn<T, float> tile = fixed_shape_tile<T, float>(group, head_dim, 16);
  if (!tile || num_seqs < kCascadeMinRows) return false;  // (its tails: the same shapes)
  // candidate rows (those with at least kCascadeMinBlocks blocks before their last token),
  // sorted by their block tables, so that rows sharing a prefix lie side by side and a run of
  // rows shares the least common prefix of its neighbouring pairs
  std::vector<int32_t> rows;
  std::vector<int> limit(num_seqs);  // blocks a row may share: every tail keeps its last token
  for (int64_t i = 0; i < num_seqs; ++i) {
    limit[i] = (seq_lens[i] - 1) / 16;
    if (limit[i] >= kCascadeMinBlocks) rows.push_back(int32_t(i));
  }
  if (rows.size() < size_t(kCascadeMinRows)) return false;
  auto common = [&](int32_t a, int32_t b) {  // leading blocks rows a and b both may share
    const int32_t* ta = block_tables + int64_t(a) * bt_stride;
    const int32_t* tb = block_tables + int64_t(b) * bt_stride;
    const int n = std::min(limit[a], limit[b]);
    int j = 0;
    while (j < n && ta[j] == tb[j]) ++j;
    return j;
  };
  std::sort(rows.begin(), rows.end(), [&](int32_t a, int32_t b) {
    const int j = common(a, b);
    if (j < std::min(limit[a], limit[b]))
      return block_tables[int64_t(a) * bt_stride + j] < block_tables[int64_t(b) * bt_stride + j];
    return limit[a] != limit[b] ? limit[a] < limit[b] : a < b;
  });
  std::vector<int> lcp(rows.size() - 1);
  for (size_t i = 0; i + 1 < rows.size(); ++i) lcp[i] = common(rows[i], rows[i + 1]);
  // Partition the sorted rows into groups, each reading its common prefix once. A run of
  // rows either forms one group (sharing the least of its pairs' prefixes) or splits where
  // that least prefix ends, into runs that share more: whichever saves more block reads
  // ((members - 1) x shared blocks). So a long system prompt behind a short common header
  // (a chat template) is shared by the rows that have it, not cut to the header.
  struct Group { size_t begin, end; int shared; };
  std::vector<Group> groups;
  auto best = [&](auto&& self, size_t a, size_t b, std::vector<Group>& out) -> int64_t {
    if (b - a < size_t(kCascadeMinRows)) return 0;
    const int least = *std::min_element(lcp.begin() + a, lcp.begin() + (b - 1));
    std::vector<Group> split;
    int64_t split_saves = 0;
    for (size_t i = a; i < b;) {
      size_t j = i;
      while (j + 1 < b && lcp[j] > least) ++j;
      split_saves += self(self, i, j + 1, split);
      i = j + 1;
    }
    const int64_t whole_saves = least >= kCascadeMinBlocks ? int64_t(b - a - 1) * least : 0;
    if (whole_saves >= split_saves && whole_saves > 0) {
      out.push_back({a, b, least});
      return whole_saves;
    }
    out.insert(out.end(), split.begin(), split.end());
    return split_saves;
  };
  best(best, 0, rows.size(), groups);
  // tiles of rows sharing `shared` tokens: rows, and their (equal) lengths for the tile
  std::vector<int32_t> tile_rows, tile_lens;
  std::vector<int64_t> tile_start;
  std::vector<int32_t> shared_of(num_seqs, 0);  // tokens read in a tile, 0 = none
  for (const Group& g : groups)
    for (size_t i = g.begin; i < g.end; ++i) {
      if ((i - g.begin) % kTileRows == 0) tile_start.push_back(int64_t(tile_rows.size()));
      tile_rows.push_back(rows[i]);
      tile_lens.push_back(g.shared * 16);
      shared_of[rows[i]] = g.shared * 16;
    }
  if (tile_start.empty()) return false;
  tile_start.push_back(int64_t(tile_rows.size()));
  // the prefix part's outputs and log-sum-exps (raw pointers: the parallel region's other
  // threads would see their own thread_locals), kept for the next call
  static thread_local std::vector<float> prefix_out, prefix_lse;
  const int64_t width = int64_t(num_heads) * head_dim;
  prefix_out.resize(num_seqs * width);
  prefix_lse.resize(num_seqs * num_heads);
  float* const part_out = prefix_out.data();
  float* const part_lse = prefix_lse.data();
  const int64_t tiles = int64_t(tile_start.size() - 1) * num_kv_heads;
  auto run_tile = [&](int64_t work) {  // a tile of the shared prefix
    const int64_t t = work / num_kv_heads;
    const int kv_head = int(work % num_kv_heads);
    const int64_t head = int64_t(kv_head) * group * head_dim;
    const int32_t* members = tile_rows.data() + tile_start[t];
    tile(q + head, k_cache + int64_t(kv_head) * head_dim, v_cache + int64_t(kv_head) * head_dim,
         part_out + head, block_tables + int64_t(members[0]) * bt_stride, members,
         tile_lens.data() + tile_start[t], int(tile_start[t + 1] - tile_start[t]), 0,
         block_stride, row_stride, q_stride, width, head_dim, scale, softcap, nullptr,
         part_lse + kv_head * group, num_heads);
  };
  return decode_in_parts<T>(q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs,
                                num_heads, num_kv_heads, head_dim, q_stride, out_stride,
                                bt_stride, scale, 0, softcap, sinks, block_stride, row_stride,
                                shared_of.data(), part_out, part_lse, tiles, run_tile);
}
#define QUIRE_EXTEND_TILES 1
#endif

#if defined(QUIRE_EXTEND_TILES)
// An extend's tiles, as the rows where each begins (and num_rows at the end): runs of rows of
// one sequence at consecutive positions, each cut into near-equal tiles of at most kTileRows,
// or of fewer where that leaves a thread idle (a sequence's 9 verification rows over
// SmolLM2's 3 KV heads made 3 work items for 2 threads: the call ran 1.5x its share). Never
// below 2 rows a tile where a run has 2: a row's sums do not depend on its tile's size from
// 2 rows on, while a tile of one takes the decode row's form.
inline std::vector<int64_t> tile_starts(const int32_t* row_seq, const int32_t* lens,
                                        int64_t num_rows, int num_kv_heads) {
  std::vector<int64_t> runs;  // where each run begins
  for (int64_t i = 0; i < num_rows; ++i)
    if (i == 0 || row_seq[i] != row_seq[i - 1] || lens[i] != lens[i - 1] + 1) runs.push_back(i);
  runs.push_back(num_rows);
  auto cut = [&](int64_t most) {
    std::vector<int64_t> starts;
    for (size_t r = 0; r + 1 < runs.size(); ++r) {
      const int64_t n = runs[r + 1] - runs[r];
      const int64_t pieces = std::max<int64_t>(1, std::min((n + most - 1) / most, n / 2));
      for (int64_t j = 0; j < pieces; ++j) starts.push_back(runs[r] + j * n / pieces);
    }
    starts.push_back(num_rows);
    return starts;
  };
  std::vector<int64_t> starts = cut(kTileRows);
  const int64_t busy = 2 * int64_t(omp_get_max_threads());  // work items that keep threads busy
  const int64_t tiles = int64_t(starts.size()) - 1;
  if (tiles * num_kv_heads < busy) {
    const int64_t want = (busy + num_kv_heads - 1) / num_kv_heads;
    const int64_t most = std::max<int64_t>(2, (num_rows + want - 1) / want);
    if (most < kTileRows) starts = cut(most);
  }
  return starts;
}
#endif

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* block_tables,
            const int32_t* seq_lens, int64_t num_seqs, int num_heads, int num_kv_heads,
            int head_dim, int block_size, int64_t q_stride, int64_t out_stride,
            int64_t bt_stride, float scale, int window, const int32_t* rows,
            const int32_t* row_seq, float softcap, const float* sinks) {
  const int group = num_heads / num_kv_heads;
  const int64_t row_stride = int64_t(num_kv_heads) * head_dim;  // between tokens of a block
  const int64_t block_stride = block_size * row_stride;
  [[maybe_unused]] const int chunks = head_dim / 16;
  // work items per grab: 4 amortizes the scheduler over a batch, but one sequence has only
  // num_kv_heads items (3 for SmolLM2), which a chunk of 4 would give to a single thread
  const int64_t items = num_seqs * num_kv_heads;
  const int chunk = items >= 32 ? 4 : 1;
#if defined(QUIRE_EXTEND_TILES)
  if (rows == nullptr && window <= 0 && block_size == 16 &&
      cascade_decode(q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs, num_heads,
                     num_kv_heads, head_dim, q_stride, out_stride, bt_stride, scale, softcap,
                     sinks, block_stride, row_stride))
    return;
  if (rows == nullptr && block_size == 16 &&
      split_decode(q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs, num_heads,
                   num_kv_heads, head_dim, q_stride, out_stride, bt_stride, scale, window,
                   softcap, sinks, block_stride, row_stride))
    return;
  if (rows != nullptr)
    if (const TileFn<T> tile = fixed_shape_tile<T>(group, head_dim, block_size)) {
      const std::vector<int64_t> starts = tile_starts(row_seq, seq_lens, num_seqs, num_kv_heads);
      const int64_t tile_items = int64_t(starts.size() - 1) * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t work = 0; work < tile_items; ++work) {
        const int64_t i0 = starts[work / num_kv_heads], i1 = starts[work / num_kv_heads + 1];
        const int kv_head = work % num_kv_heads;
        const int64_t head = int64_t(kv_head) * group * head_dim;
        tile(q + head, k_cache + int64_t(kv_head) * head_dim, v_cache + int64_t(kv_head) * head_dim,
             out + head, block_tables + int64_t(row_seq[i0]) * bt_stride, rows + i0,
             seq_lens + i0, int(i1 - i0), window, block_stride, row_stride, q_stride, out_stride,
             head_dim, scale, softcap, sinks ? sinks + kv_head * group : nullptr, nullptr, 0);
      }
      return;
    }
#endif
#if defined(QUIRE_FIXED_SHAPE_PATH)
  if (const RowFn<T> item = fixed_shape_row<T>(group, head_dim, block_size)) {
    if (rows == nullptr && window <= 0 && by_sequence(num_seqs)) {
      decode_ahead(item, q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs, group,
                   num_kv_heads, head_dim, q_stride, out_stride, bt_stride, scale, softcap,
                   sinks, block_stride, row_stride);
      return;
    }
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t work = 0; work < items; ++work) {
      const int64_t i = work / num_kv_heads;
      const int64_t qrow = rows ? rows[i] : i, seq = row_seq ? row_seq[i] : i;
      const int kv_head = work % num_kv_heads;
      const int len = seq_lens[i];
      const int64_t head = int64_t(kv_head) * group * head_dim;
      item(q + qrow * q_stride + head, k_cache + int64_t(kv_head) * head_dim,
           v_cache + int64_t(kv_head) * head_dim, out + qrow * out_stride + head,
           block_tables + seq * bt_stride, len, window > 0 ? std::max(0, len - window) : 0,
           block_stride, row_stride, head_dim, scale, softcap,
           sinks ? sinks + kv_head * group : nullptr, nullptr, nullptr);
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  const bool vector_path = head_dim % 16 == 0 && chunks <= kMaxChunks && group <= kMaxGroup;
#endif

#pragma omp parallel
  {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim);
    std::vector<float> scores(group * block_size), m(group), l(group);
#if defined(__AVX512F__)
    std::vector<__m512> qv(vector_path ? group * chunks : 0);
#endif
#pragma omp for schedule(dynamic, chunk)
    for (int64_t work = 0; work < items; ++work) {
      const int64_t i = work / num_kv_heads;
      const int64_t qrow = rows ? rows[i] : i, seq = row_seq ? row_seq[i] : i;
      const int kv_head = work % num_kv_heads;
      const int len = seq_lens[i];
      const int lo = window > 0 ? std::max(0, len - window) : 0;
      for (int g = 0; g < group; ++g) {
        const T* src = q + qrow * q_stride + int64_t(kv_head * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load_scalar(src + d) * scale;
      }
#if defined(__AVX512F__)
      if (vector_path)
        for (int i = 0; i < group * chunks; ++i) qv[i] = _mm512_loadu_ps(qf.data() + i * 16);
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int first = lo / block_size * block_size; first < len; first += block_size) {
        const int64_t phys = block_tables[seq * bt_stride + first / block_size];
        const T* kb = k_cache + phys * block_stride + int64_t(kv_head) * head_dim;
        const T* vb = v_cache + phys * block_stride + int64_t(kv_head) * head_dim;
        const int t0 = std::max(first, lo) - first;
        const int n = std::min(block_size, len - first);
        // scores[g][t] = q_g . k_t
        for (int t = t0; t < n; ++t) {
          const T* kr = kb + t * row_stride;
#if defined(__AVX512F__)
          if (vector_path) {
            __m512 dots[kMaxGroup];
            for (int g = 0; g < group; ++g) dots[g] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; ++c) {
              const __m512 kv = load16(kr + c * 16);
              for (int g = 0; g < group; ++g)
                dots[g] = _mm512_fmadd_ps(qv[g * chunks + c], kv, dots[g]);
            }
            for (int g = 0; g < group; ++g) scores[g * block_size + t] = _mm512_reduce_add_ps(dots[g]);
            continue;
          }
#endif
          for (int d = 0; d < head_dim; ++d) row[d] = load_scalar(kr + d);
          for (int g = 0; g < group; ++g) {
            float sum = 0.f;
            for (int d = 0; d < head_dim; ++d) sum += qf[g * head_dim + d] * row[d];
            scores[g * block_size + t] = sum;
          }
        }
        if (softcap > 0.f)
          for (int g = 0; g < group; ++g)
            softcap_scores(scores.data() + g * block_size, t0, n, softcap);
        // online softmax: rescale what came before
#if defined(__AVX512F__)
        if (vector_path && block_size == 16) {
          for (int g = 0; g < group; ++g) {
            const float correction = softmax_block16(scores.data() + g * 16, t0, n, m[g], l[g]);
            if (correction != 1.f) {
              float* a = acc.data() + g * head_dim;
              for (int d = 0; d < head_dim; ++d) a[d] *= correction;
            }
          }
        } else
#endif
        for (int g = 0; g < group; ++g) {
          float* s = scores.data() + g * block_size;
          float mx = m[g];
          for (int t = t0; t < n; ++t) mx = std::max(mx, s[t]);
          const float correction = std::exp(m[g] - mx);
          l[g] *= correction;
          float* a = acc.data() + g * head_dim;
          for (int d = 0; d < head_dim; ++d) a[d] *= correction;
          for (int t = t0; t < n; ++t) {
            s[t] = std::exp(s[t] - mx);
            l[g] += s[t];
          }
          m[g] = mx;
        }
        // acc_g += p_g,t * v_t
        for (int t = t0; t < n; ++t) {
          const T* vr = vb + t * row_stride;
#if defined(__AVX512F__)
          if (vector_path) {
            for (int c = 0; c < chunks; ++c) {
              const __m512 vv = load16(vr + c * 16);
              for (int g = 0; g < group; ++g) {
                float* a = acc.data() + g * head_dim + c * 16;
                const __m512 p = _mm512_set1_ps(scores[g * block_size + t]);
                _mm512_storeu_ps(a, _mm512_fmadd_ps(p, vv, _mm512_loadu_ps(a)));
              }
            }
            continue;
          }
#endif
          for (int d = 0; d < head_dim; ++d) row[d] = load_scalar(vr + d);
          for (int g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* a = acc.data() + g * head_dim;
            for (int d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        const int64_t h = int64_t(kv_head) * group + g;
        T* dst = out + qrow * out_stride + h * head_dim;
        const float inv = finish_scale(m[g], l[g], sinks ? sinks + h : nullptr);
        for (int d = 0; d < head_dim; ++d) store_scalar(dst + d, acc[g * head_dim + d] * inv);
      }
    }
  }
}

// Decode (rows == row_seq == nullptr: row i is sequence i, seq_lens per sequence) or extend:
// row i of the work list is query row rows[i], reads the block table of sequence row_seq[i]
// and attends to its first seq_lens[i] tokens (its position + 1: causal over the cached prefix
// and the chunk's own tokens, which are already in the cache).
template <typename T>
int run(const void* q, const void* k_cache, const void* v_cache, void* out,
        const int32_t* block_tables, const int32_t* seq_lens, int64_t num_rows, int num_heads,
        int num_kv_heads, int head_dim, int block_size, int64_t q_stride, int64_t out_stride,
        int64_t bt_stride, float scale, int window, const int32_t* rows,
        const int32_t* row_seq, float softcap, const float* sinks) {
  decode(static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
         static_cast<T*>(out), block_tables, seq_lens, num_rows, num_heads, num_kv_heads,
         head_dim, block_size, q_stride, out_stride, bt_stride, scale, window, rows, row_seq,
         softcap, sinks);
  return 0;
}

}  // namespace

// softcap: 0 for none, else scores become softcap * tanh(score / softcap); sinks: null for
// none, else one float32 logit per query head.
extern "C" int quire_paged_extend(int dtype, const void* q, const void* k_cache,
                                  const void* v_cache, void* out, const int32_t* block_tables,
                                  const int32_t* row_lens, int64_t num_rows, int num_heads,
                                  int num_kv_heads, int head_dim, int block_size,
                                  int64_t q_stride, int64_t out_stride, int64_t bt_stride,
                                  float scale, int window, const int32_t* rows,
                                  const int32_t* row_seq, float softcap, const float* sinks) {
  if (dtype == 0)
    return run<float>(q, k_cache, v_cache, out, block_tables, row_lens, num_rows, num_heads,
                      num_kv_heads, head_dim, block_size, q_stride, out_stride, bt_stride, scale,
                      window, rows, row_seq, softcap, sinks);
  if (dtype == 1)
    return run<uint16_t>(q, k_cache, v_cache, out, block_tables, row_lens, num_rows, num_heads,
                         num_kv_heads, head_dim, block_size, q_stride, out_stride, bt_stride,
                         scale, window, rows, row_seq, softcap, sinks);
  return 1;
}

extern "C" int quire_paged_decode(int dtype, const void* q, const void* k_cache,
                                  const void* v_cache, void* out, const int32_t* block_tables,
                                  const int32_t* seq_lens, int64_t num_seqs, int num_heads,
                                  int num_kv_heads, int head_dim, int block_size,
                                  int64_t q_stride, int64_t out_stride, int64_t bt_stride,
                                  float scale, int window, float softcap,
                                  const float* sinks) {
  return quire_paged_extend(dtype, q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs,
                            num_heads, num_kv_heads, head_dim, block_size, q_stride, out_stride,
                            bt_stride, scale, window, nullptr, nullptr, softcap, sinks);
}

// 1 where quire_paged_extend runs this layout in GEMM-shaped tiles (the fixed shapes of the AVX2
// and AVX-512 builds), 0 where it walks each row alone (then long chunks are faster through
// SDPA).
extern "C" int quire_paged_extend_tiled(int num_heads, int num_kv_heads, int head_dim,
                                        int block_size) {
#if defined(QUIRE_EXTEND_TILES)
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
         fixed_shape_tile<float>(num_heads / num_kv_heads, head_dim, block_size) != nullptr;
#else
  (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size;
  return 0;
#endif
}
