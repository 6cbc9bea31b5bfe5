// Causal attention of a prefill chunk on the AMX tiles: bfloat16 q, k and v in, bfloat16 out,
// float32 scores, softmax and sums. The chunk's L query rows sit at the end of the ctx keys
// (positions ctx - L .. ctx - 1: a fresh prompt has ctx = L, a chunk over a cached prefix
// passes its gathered K/V). No window, soft-capping or sinks.
//
// Why not torch's SDPA: on the 2-core AMX Xeon its CPU flash kernel ran a 512-token SmolLM2
// layer (9 heads, 3 KV heads, head_dim 64) in ~1.0-1.3 ms, ~30% of a bfloat16 prefill; this
// kernel takes ~0.5 ms (benchmarks/prefill_attention.py). At head_dim 64 the products are
// short and the softmax's vector work is as large, so every vector operation here is full
// width and the products stay in the tiles:
// - work items are (head, 32 query rows); for each, the scores of every key it sees are
//   computed first (S = Q . K^T in C tiles, 2 row blocks x 2 key blocks at a time), so each
//   row's max is known before any exp: no running max, no rescaling of partial sums (an
//   earlier online-softmax kernel on the tiles, rescaling per 32 keys, was no faster than
//   SDPA);
// - the softmax walks each row in 16-key vectors (its own exp, below), and writes the row's
//   probabilities as bfloat16 in key order, which is the A tile layout of P . V as it lies;
// - P . V sums every key in the C tiles (2 row blocks x 2 slices of 16 d at a time) and each
//   row is divided by its sum once, at the end.
// K and V are laid out once a call as B tiles (pairs of d down and keys across for K, pairs
// of keys down and d across for V) for every KV head, zero-padded past ctx. Probabilities
// are rounded to bfloat16 for their product with V, as torch's CPU flash kernel does.
//
// Plain C++ with a C ABI, no torch headers, called through ctypes
// (native/prefill_attention.py); a build without AMX says so (quire_prefill_attention_ready).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "amx.h"

#if defined(__AMX_BF16__)
#include <immintrin.h>

namespace {

using quire_amx::TileConfig, quire_amx::amx_permitted;

constexpr int kRows = 16;      // an A tile's rows
constexpr int kKeys = 16;      // keys per score tile: a B tile's columns
constexpr int kItemRows = 32;  // query rows per item: two A tiles
constexpr int kMaxDim = 256;  // head_dim, a multiple of 32

void configure() {  // every tile 16 rows of 64 bytes
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = kRows;
  }
  _tile_loadconfig(&c);
}

// 2^t for t <= 0 (a scaled score less its row's max, in units of log2): t = n + f with
// |f| <= 1/2, 2^f by its Taylor polynomial of degree 6 (within ~1 float32 ulp), times 2^n.
// Below -126 it gives ~1e-38 instead of less: nothing beside the row's max (1) can tell.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.540353039338161e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// KV head hk's K and V as the B tiles of the two products, each tile's 16 rows of 64 bytes
// contiguous (1 KB a tile: a strided tile of rows 2 KB apart ran the products ~2x slower):
// - K: kt[key / 16][d pair][key % 16], the score product's (d pairs down, keys across): each
//   pair of d gathered from 16 keys' rows at once;
// - V: vv[key / 32][d / 16][key pair % 16][d % 16], the value product's (pairs of keys down,
//   d across): two keys' rows interleaved 16 d at a time.
// Keys in [key0, key1) (multiples of 32), those past ctx zeros. (One element at a time this
// took ~30% of a 16-row chunk over 2,048 cached tokens: it is done for every key each call.)
void lay_out_kv(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int hk,
                int D, int64_t ctx, int64_t key0, int64_t key1, uint32_t* kt, uint32_t* vv) {
  const uint16_t* kh = k + int64_t(hk) * D;
  const uint16_t* vh = v + int64_t(hk) * D;
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(k_stride)));  // each key's row, in bfloat16s
  for (int64_t key = key0; key < key1; key += 16) {
    const int64_t real = std::clamp<int64_t>(ctx - key, 0, 16);
    const __mmask16 live = static_cast<__mmask16>((uint32_t{1} << real) - 1);
    const uint16_t* first = kh + std::min(key, ctx - 1) * k_stride;
    uint32_t* dst = kt + key / 16 * (D / 2 * 16);
    for (int i = 0; i < D / 2; ++i)  // (scale 2: rows k_stride bfloat16s apart, odd or even)
      _mm512_storeu_si512(dst + i * 16, _mm512_mask_i32gather_epi32(
                                           _mm512_setzero_si512(), live, rows, first + 2 * i, 2));
  }
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t key = key0; key < key1; key += 2) {
    const uint16_t* even = key < ctx ? vh + key * v_stride : nullptr;
    const uint16_t* odd = key + 1 < ctx ? vh + (key + 1) * v_stride : nullptr;
    uint32_t* dst = vv + key / 32 * (16 * D) + key % 32 / 2 * 16;
    for (int d = 0; d < D; d += 32) {
      const __m512i e = even ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
      const __m512i o = odd ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d / 16 * 256, _mm512_permutex2var_epi16(e, low, o));
      _mm512_storeu_si512(dst + (d / 16 + 1) * 256, _mm512_permutex2var_epi16(e, high, o));
    }
  }
}

struct Scratch {  // one thread's buffers, grown to the call's longest item
  std::vector<float> scores;    // [32 rows][keys]
  std::vector<uint16_t> probs;  // [32 rows][keys] bfloat16
  alignas(64) float acc[kItemRows * kMaxDim];
  alignas(64) uint16_t qpad[kItemRows * kMaxDim];
};

// Scores of 32 query rows (two A tiles of 16: `qrows`, row stride qs elements) against keys
// [0, nk32), into S [32][nk32]: per 32 keys, C tiles 0-3 are (rows 0-15, 16-31) x (keys 0-15,
// 16-31), A tiles 4 and 5 the two row blocks' q 32 wide, B tiles 6 and 7 the two key
// blocks' K: each K tile serves both row blocks (a tile per product from L2 was ~1/4 of
// the kernel). (The tile intrinsics paste their register numbers into the instruction:
// literals.)
void score_rows(const uint16_t* qrows, int64_t qs, const uint32_t* kt, int D, int64_t nk32,
                float* S) {
  for (int64_t key0 = 0; key0 < nk32; key0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* k0 = kt + key0 / kKeys * (D / 2 * 16);
    for (int s = 0; s < D / 32; ++s) {
      _tile_loadd(4, qrows + 32 * s, qs * 2);
      _tile_loadd(6, k0 + s * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, qrows + 16 * qs + 32 * s, qs * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, k0 + (D / 2 * 16) + s * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, S + key0, nk32 * 4);
    _tile_stored(1, S + key0 + kKeys, nk32 * 4);
    _tile_stored(2, S + 16 * nk32 + key0, nk32 * 4);
    _tile_stored(3, S + 16 * nk32 + key0 + kKeys, nk32 * 4);
  }
}

// Row r of S (keys [0, n), n >= 1, the rest masked) into bfloat16 probabilities P[0, n32)
// (n32 a multiple of 32, zeros past n), returning 1 / the row's sum.
float softmax_row(const float* S, int64_t n, int64_t n32, float scale, uint16_t* P) {
  const int64_t full = n / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
  __m512 m0 = lowest, m1 = lowest;
  int64_t j = 0;
  for (; j + 1 < full; j += 2) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(S + 16 * j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(S + 16 * j + 16));
  }
  if (j < full) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(S + 16 * j));
  if (tail) m1 = _mm512_mask_max_ps(m1, tail, m1, _mm512_maskz_loadu_ps(tail, S + 16 * full));
  // the scale is positive: the max of the scaled scores is the scaled max; exp(x) = 2^(x
  // log2 e), the factor taken into the scale (one rounding of s * scale * log2 e - max)
  const float to_log2 = scale * 1.44269504088896341f;
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * to_log2);
  const __m512 scaled = _mm512_set1_ps(to_log2);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t b = 0; b < n32 / 16; b += 2) {
    const __mmask16 k0 = b < full ? __mmask16(0xffff) : b == full ? tail : __mmask16(0);
    const __mmask16 k1 = b + 1 < full ? __mmask16(0xffff) : b + 1 == full ? tail : __mmask16(0);
    const __m512 p0 = _mm512_maskz_mov_ps(
        k0, exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k0, S + 16 * b), scaled, top)));
    const __m512 p1 = _mm512_maskz_mov_ps(
        k1, exp2_nonpositive(
                _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k1, S + 16 * b + 16), scaled, top)));
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    // keys 16b .. 16b + 15 then 16b + 16 .. 16b + 31, in order
    _mm512_storeu_si512(P + 16 * b, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// out rows of one item, acc [32][D]: per 32 d, C tiles 0-3 are (rows 0-15, 16-31) x (d 0-15,
// 16-31), summed over the keys' 32-wide steps: A tiles 4 and 5 the two row blocks' P, B tiles
// 6 and 7 V's pairs of keys for the two slices of d (each V tile serves both row blocks).
void value_rows(const uint16_t* P, int64_t n32, const uint32_t* vv, int D, float* acc) {
  for (int d0 = 0; d0 < D; d0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t key0 = 0; key0 < n32; key0 += 32) {
      const uint32_t* v0 = vv + key0 / 32 * (16 * D) + d0 / 16 * 256;
      _tile_loadd(4, P + key0, n32 * 2);
      _tile_loadd(6, v0, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, P + 16 * n32 + key0, n32 * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, v0 + 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc + d0, D * 4);
    _tile_stored(1, acc + d0 + 16, D * 4);
    _tile_stored(2, acc + 16 * D + d0, D * 4);
    _tile_stored(3, acc + 16 * D + d0 + 16, D * 4);
  }
}

// One item: head h, query rows r0 .. r0 + rows - 1 (rows <= 32) at positions offset + r.
void attend_rows(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, int h,
                 int D, int64_t r0, int64_t rows, int64_t offset, const uint32_t* kt,
                 const uint32_t* vv, float scale, Scratch& w) {
  const int64_t nk = offset + r0 + rows;  // keys the last row sees
  const int64_t nk32 = (nk + 31) / 32 * 32;
  if (static_cast<int64_t>(w.scores.size()) < kItemRows * nk32)
    w.scores.resize(kItemRows * nk32);
  if (static_cast<int64_t>(w.probs.size()) < kItemRows * nk32) w.probs.resize(kItemRows * nk32);
  const uint16_t* qrows = q + r0 * q_stride + int64_t(h) * D;
  int64_t qs = q_stride;
  if (rows < kItemRows) {  // the chunk's last rows: a zero-padded copy (no reads past the end)
    std::fill(w.qpad, w.qpad + kItemRows * D, uint16_t{0});
    for (int64_t r = 0; r < rows; ++r)
      std::copy(qrows + r * q_stride, qrows + r * q_stride + D, w.qpad + r * D);
    qrows = w.qpad;
    qs = D;
  }
  score_rows(qrows, qs, kt, D, nk32, w.scores.data());
  alignas(64) float inv[kItemRows];
  for (int64_t r = 0; r < kItemRows; ++r) {
    uint16_t* prow = w.probs.data() + r * nk32;
    if (r < rows)
      inv[r] = softmax_row(w.scores.data() + r * nk32, offset + r0 + r + 1, nk32, scale, prow);
    else
      std::fill(prow, prow + nk32, uint16_t{0});
  }
  value_rows(w.probs.data(), nk32, vv, D, w.acc);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = out + (r0 + r) * out_stride + int64_t(h) * D;
    const __m512 f = _mm512_set1_ps(inv[r]);
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                              _mm512_loadu_ps(w.acc + r * D + d), f)));
  }
}

}  // namespace
#endif

extern "C" {

// 1 where this build runs the kernel on the tiles and the process may use them
int quire_prefill_attention_ready() {
#if defined(__AMX_BF16__)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// out[t, h] = softmax over keys s <= ctx - L + t of scale * q[t, h] . k[s, h / (H / Hk)],
// times v: q [L, H, D] with row stride q_stride (elements), k and v [ctx, Hk, D] with row
// strides k_stride and v_stride, out [L, H, D] with row stride out_stride; each row's heads
// contiguous.
// Returns 0, or 1 where it does not run (no tiles; D not a multiple of 32 or above 256; H not
// a multiple of Hk; ctx < L; scale not positive).
int quire_prefill_attention(const void* q, const void* k, const void* v, void* out, int64_t L,
                            int64_t ctx, int H, int Hk, int D, int64_t q_stride,
                            int64_t k_stride, int64_t v_stride, int64_t out_stride, float scale,
                            int threads) {
#if defined(__AMX_BF16__)
  if (!amx_permitted() || D % 32 != 0 || D <= 0 || D > kMaxDim || Hk <= 0 || H % Hk != 0 ||
      ctx < L || !(scale > 0.f))
    return 1;
  if (L <= 0) return 0;
  const int64_t keys = (ctx + 31) / 32 * 32, blocks = (L + kItemRows - 1) / kItemRows;
  const int64_t kv_size = int64_t(D / 2) * keys;  // uint32 pairs per head, K's and V's alike
  // the caller's thread keeps the layouts' buffer from call to call, up to kKeptLayout
  // elements: a fresh one (~0.4 MB at 512 tokens) cost its page faults and zeroing every
  // layer (574 -> 507 us, 512 tokens); a longer context's (the size of its K and V) is the
  // call's own, so that one long prompt leaves nothing behind
  constexpr int64_t kKeptLayout = int64_t(4) << 20;  // 16 MB
  const int64_t need = 2 * Hk * kv_size;
  static thread_local std::vector<uint32_t> kept;
  std::vector<uint32_t> own;
  std::vector<uint32_t>& layouts = need <= kKeptLayout ? kept : own;
  if (static_cast<int64_t>(layouts.size()) < need) layouts.resize(need);
  uint32_t* const kt = layouts.data();
  uint32_t* const vv = kt + Hk * kv_size;
  const auto* qb = static_cast<const uint16_t*>(q);
  const auto* kb = static_cast<const uint16_t*>(k);
  const auto* vb = static_cast<const uint16_t*>(v);
  auto* ob = static_cast<uint16_t*>(out);
  const int group = H / Hk;
  const int64_t offset = ctx - L;
  const int64_t spans = (keys + 63) / 64;  // K/V laid out in spans of 64 keys per head
#pragma omp parallel num_threads(std::max(1, threads))
  {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < Hk * spans; ++job) {
      const int hk = static_cast<int>(job / spans);
      const int64_t key0 = job % spans * 64;
      lay_out_kv(kb, k_stride, vb, v_stride, hk, D, ctx, key0, std::min(keys, key0 + 64),
                 kt + hk * kv_size, vv + hk * kv_size);
    }
    static thread_local Scratch scratch;
    configure();
    // the longest items (the last rows see the most keys) first
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < H * blocks; ++item) {
      const int64_t block = blocks - 1 - item / H;
      const int h = static_cast<int>(item % H);
      const int64_t r0 = block * kItemRows;
      attend_rows(qb, q_stride, ob, out_stride, h, D, r0, std::min<int64_t>(kItemRows, L - r0),
                  offset, kt + (h / group) * kv_size, vv + (h / group) * kv_size,
                  scale, scratch);
    }
    _tile_release();
  }
  return 0;
#else
  (void)q, (void)k, (void)v, (void)out, (void)L, (void)ctx, (void)H, (void)Hk, (void)D,
      (void)q_stride, (void)k_stride, (void)v_stride, (void)out_stride, (void)scale, (void)threads;
  return 1;
#endif
}

}  // extern "C"
