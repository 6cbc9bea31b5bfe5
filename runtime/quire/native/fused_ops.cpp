// Fused element-wise ops of the Llama decoder layer for the CPU: residual add + RMSNorm,
// RoPE in place on q/k, SiLU-and-mul; and the sampler's greedy pick (argmax_rows). Each one
// replaces a handful of torch ops (and their dispatch and temporaries) with one pass over the
// rows.
//
// Every result is bit-identical to the torch ops it replaces (quire.native.fused_ops has
// them), because greedy parity with transformers is the correctness oracle:
//  - products and sums are rounded to the tensor dtype where torch rounds them (bf16 math
//    is float math rounded to bf16 after each op), and never contracted into an FMA;
//  - RMSNorm's mean of squares sums in the order torch's CPU sum kernel does (cascade_sum:
//    vectors of `width` floats in 4 interleaved accumulators, then the tail, then the lanes);
//  - SiLU's exp is the caller's: torch's own Sleef function (a pointer into libtorch_cpu)
//    on the part torch vectorizes, std::exp on the tail, as torch's cpu_kernel_vec does.
//
// Plain C++ with a C ABI, called through ctypes. dtype codes: 0 = float32, 1 = bfloat16.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("prefer-vector-width=512")
#pragma GCC diagnostic ignored "-Wpsabi"  // (FloatLanes never cross a call)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using quire_bf16::bf16_to_float;
using quire_bf16::float_to_bf16;

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = float_to_bf16(x); }
// a value as the tensor dtype holds it (torch rounds every bf16 op's float result)
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const uint16_t*) { return bf16_to_float(float_to_bf16(x)); }

#if defined(__AVX512BF16__)
// 16 lanes at a time for bfloat16 rows: the instruction rounds to nearest even as
// float_to_bf16 does, except that it reads denormals as zero (and its NaN bits are not
// documented as ours): `odd` collects such lanes, and the caller redoes those 16 elements
// one by one. (The bf16 paths below run ~2x the compiler's vectors of float_to_bf16.)
inline __m256i to_bf16(__m512 x, __mmask16& odd) {
  odd |= _mm512_fpclass_ps_mask(x, 0x20 | 0x01 | 0x80);  // denormal, quiet or signalling NaN
  return (__m256i)_mm512_cvtneps_pbh(x);
}
inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const uint16_t* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(uint16_t* p, __m256i h) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}
#endif

// torch's cascade sum of n floats (SumKernel.cpp, vectorized_inner_sum over Vectorized<float>
// of W lanes): the row is read as n / W vectors; row_sum splits those into 4 interleaved
// accumulators (multi_row_sum with its levels), adds the leftover vectors to the first, folds
// the 4 together; the scalar tail and then the W lanes are added to a float that starts at 0.
template <int W>
float torch_sum(const float* x, int64_t n) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t num_vec = n / W;
  const int64_t size_ilp = num_vec / kIlp;  // rows of 4 vectors
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < size_ilp) ++log2;  // CeilLog2
  const int64_t level_power = log2 / kLevels > 4 ? log2 / kLevels : 4;
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[kLevels][kIlp][W] = {};
  auto add_vec = [](float* dst, const float* src) {
    for (int l = 0; l < W; ++l) dst[l] += src[l];
  };
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], x + (i * kIlp + k) * W);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add_vec(acc[j][k], acc[j - 1][k]);
        for (int l = 0; l < W; ++l) acc[j - 1][k][l] = 0.f;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], x + (i * kIlp + k) * W);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], acc[j][k]);
  for (int64_t v = size_ilp * kIlp; v < num_vec; ++v) add_vec(acc[0][0], x + v * W);
  for (int k = 1; k < kIlp; ++k) add_vec(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t e = num_vec * W; e < n; ++e) total += x[e];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return total;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) per row, as transformers' LlamaRMSNorm; with a
// residual, first x = residual = x + residual (the pre-norm layer's running sum).
template <typename T, int W>
void rms_norm(T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n,
              int64_t x_stride, int64_t res_stride, int64_t out_stride, float eps) {
#pragma omp parallel for if (rows > 8)
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * x_stride;
    float buf[8192];
    float sq[8192];
    if (residual != nullptr) {
      T* rr = residual + r * res_stride;
      int64_t e = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        for (; e + 16 <= n; e += 16) {
          __mmask16 odd = 0;
          const __m256i h = to_bf16(_mm512_add_ps(load16(xr + e), load16(rr + e)), odd);
          if (odd) break;  // this block and the rest one by one
          store16(rr + e, h);
          _mm512_storeu_ps(buf + e, widen(h));
        }
      }
#endif
      for (; e < n; ++e) {
        const float s = load(xr + e) + load(rr + e);
        store(rr + e, s);
        buf[e] = round_to(s, xr);
      }
    } else {
      for (int64_t e = 0; e < n; ++e) buf[e] = load(xr + e);
    }
    for (int64_t e = 0; e < n; ++e) sq[e] = buf[e] * buf[e];
    const float variance = torch_sum<W>(sq, n) / static_cast<float>(n);
    const float inv = 1.f / std::sqrt(variance + eps);
    T* o = out + r * out_stride;
    int64_t e = 0;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      const __m512 f = _mm512_set1_ps(inv);
      for (; e + 16 <= n; e += 16) {
        __mmask16 odd = 0;
        const __m512 normed = widen(to_bf16(_mm512_mul_ps(_mm512_loadu_ps(buf + e), f), odd));
        const __m256i h = to_bf16(_mm512_mul_ps(load16(weight + e), normed), odd);
        if (odd) break;
        store16(o + e, h);
      }
    }
#endif
    for (; e < n; ++e)
      store(o + e, load(weight + e) * round_to(buf[e] * inv, o));
  }
}

// q/k rows [tokens, heads, head_dim] in place: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to the dtype (torch's order: q * cos, rotate_half(q) * sin, then +).
template <typename T>
void rope(T* x, const T* cos, const T* sin, int64_t tokens, int heads, int head_dim,
          int64_t token_stride, int64_t cs_stride) {
  const int half = head_dim / 2;
#pragma omp parallel for if (tokens > 16)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * cs_stride;
    const T* s = sin + t * cs_stride;
    for (int h = 0; h < heads; ++h) {
      T* v = x + t * token_stride + int64_t(h) * head_dim;
      int d = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        const __m512 sign = _mm512_set1_ps(-0.f);
        for (; d + 16 <= half; d += 16) {
          const __m512 a = load16(v + d), b = load16(v + d + half);
          __mmask16 odd = 0;
          const __m512 ac = widen(to_bf16(_mm512_mul_ps(a, load16(c + d)), odd));
          const __m512 bs =
              widen(to_bf16(_mm512_mul_ps(_mm512_xor_ps(b, sign), load16(s + d)), odd));
          const __m512 bc = widen(to_bf16(_mm512_mul_ps(b, load16(c + d + half)), odd));
          const __m512 as = widen(to_bf16(_mm512_mul_ps(a, load16(s + d + half)), odd));
          const __m256i lo = to_bf16(_mm512_add_ps(ac, bs), odd);
          const __m256i hi = to_bf16(_mm512_add_ps(bc, as), odd);
          if (odd) break;  // this block and the rest one by one
          store16(v + d, lo);
          store16(v + d + half, hi);
        }
      }
#endif
      for (; d < half; ++d) {
        const float a = load(v + d), b = load(v + d + half);
        const float lo = round_to(round_to(a * load(c + d), v) +
                                  round_to(-b * load(s + d), v), v);
        const float hi = round_to(round_to(b * load(c + d + half), v) +
                                  round_to(a * load(s + d + half), v), v);
        store(v + d, lo);
        store(v + d + half, hi);
      }
    }
  }
}

// Sleef's exp as torch calls it, over W floats (a pointer into libtorch_cpu).
template <int W>
void vector_exp(const void* fn, const float* in, float* out) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    using Fn = __m512 (*)(__m512);
    _mm512_storeu_ps(out, reinterpret_cast<Fn>(fn)(_mm512_loadu_ps(in)));
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) {
    using Fn = __m256 (*)(__m256);
    _mm256_storeu_ps(out, reinterpret_cast<Fn>(fn)(_mm256_loadu_ps(in)));
    return;
  }
#endif
}

// The greedy pick: the index of a row's first maximum, as torch's max(dim=-1).indices gives it
// (a NaN counts as the maximum: the first NaN's index; ties: the first; a row of -inf: 0).
// kLanes lanes (GCC's vector types, one register of the build: AVX-512 16, AVX2 8, SSE2 4)
// keep a running maximum and the index where each lane first reached it (`>`: a tie keeps
// the earlier one); the first maximum is the least index among the lanes that hold the row's
// maximum. A 49152-token bfloat16 row: ~11 us against torch max()'s ~44 (AMX Xeon, hot).
// (Vectors wider than the build's registers are lowered lane by lane: 16 lanes on the AVX2
// EPYC took 5.8 ms for 32 such float32 rows, against torch's 1.9 and 0.5 at 8 lanes.)
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
using FloatLanes = float __attribute__((vector_size(kLanes * 4)));
using IntLanes = int32_t __attribute__((vector_size(kLanes * 4)));
using HalfLanes = uint16_t __attribute__((vector_size(kLanes * 2)));
inline FloatLanes load_lanes(const float* p) {
  FloatLanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline FloatLanes load_lanes(const uint16_t* p) {  // bfloat16: the high halves of float32
  HalfLanes h;
  std::memcpy(&h, p, sizeof h);
  const IntLanes bits = __builtin_convertvector(h, IntLanes) << 16;
  FloatLanes v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <typename T>
int64_t first_max(const T* x, int64_t n) {
  constexpr int L = kLanes, kChains = 4;  // 4 independent maxima: each compare-and-blend
                                          // waits on its chain's last (latency-bound on one)
  FloatLanes top[kChains];
  IntLanes at[kChains], nan = {};
  for (int c = 0; c < kChains; ++c) {
    top[c] = FloatLanes{} - INFINITY;
    at[c] = IntLanes{};
  }
  IntLanes here;
  for (int j = 0; j < L; ++j) here[j] = j;
  const int64_t full = n / (L * kChains) * (L * kChains);
  for (int64_t i = 0; i < full; i += L * kChains)
    for (int c = 0; c < kChains; ++c, here += L) {
      const FloatLanes v = load_lanes(x + i + c * L);
      const IntLanes up = v > top[c];
      top[c] = up ? v : top[c];
      at[c] = up ? here : at[c];
      nan |= v != v;
    }
  bool any_nan = false;
  for (int j = 0; j < L; ++j) any_nan |= nan[j] != 0;
  for (int64_t i = full; i < n; ++i) any_nan |= load(x + i) != load(x + i);
  if (any_nan)
    for (int64_t i = 0; i < n; ++i)
      if (load(x + i) != load(x + i)) return i;
  float best = -INFINITY;
  int64_t index = 0;
  if (full) {  // the lanes' maximum, then its least index (each lane kept its first)
    for (int c = 0; c < kChains; ++c)
      for (int j = 0; j < L; ++j)
        if (top[c][j] > best) best = top[c][j];
    index = full;
    for (int c = 0; c < kChains; ++c)
      for (int j = 0; j < L; ++j)
        if (top[c][j] == best && at[c][j] < index) index = at[c][j];
  }
  for (int64_t i = full; i < n; ++i)  // the tail: later than every lane's index
    if (const float v = load(x + i); v > best) best = v, index = i;
  return index;
}

// out = silu(gate) * up per row (gate and up are the two halves of each gate_up row). torch's
// silu vectorizes each row's first multiple of 2 vectors of T (2 * 64 bytes / sizeof T
// elements) with Sleef's exp and does the rest with std::exp; the silu result is rounded to
// the dtype before the multiply. In passes over a row buffer, so that the compiler vectorizes
// all but the exp calls.
constexpr int64_t kMaxSiluRow = 16384;

template <typename T, int W>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t n, int64_t in_stride,
                  int64_t out_stride, const void* exp_fn) {
  const int64_t step = 2 * (W * 4 / int64_t(sizeof(T)));  // 2 * Vectorized<T>::size()
  const int64_t vec_end = n / step * step;
#pragma omp parallel for if (rows > 4)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * in_stride;
    const T* u = g + n;
    T* o = out + r * out_stride;
    alignas(64) float x[kMaxSiluRow], e[kMaxSiluRow];
    for (int64_t i = 0; i < n; ++i) x[i] = load(g + i);
    for (int64_t i = 0; i < vec_end; ++i) e[i] = -x[i];
    for (int64_t i = 0; i < vec_end; i += W) vector_exp<W>(exp_fn, e + i, e + i);
    for (int64_t i = vec_end; i < n; ++i) e[i] = std::exp(-x[i]);
    for (int64_t i = 0; i < n; ++i)
      store(o + i, round_to(x[i] / (1.f + e[i]), o) * load(u + i));
  }
}

}  // namespace

// The widths this build can serve (torch's Vectorized<float> lanes): 16 needs AVX-512, 8 AVX2.
extern "C" int quire_fused_supports_width(int width) {
#if defined(__AVX512F__)
  if (width == 16) return 1;
#endif
#if defined(__AVX2__)
  if (width == 8) return 1;
#endif
  return 0;
}

// 1 if Sleef's 16-lane exp (exp16) gives the 8-lane one's (exp8: torch's silu) bits on every
// bfloat16 input: then kernels on bfloat16 values may take the cheaper exp16
// (quant_matmul.cpp's fused gate|up epilogue); 0 if one differs or this build has no AVX-512.
extern "C" int quire_exp16_matches_exp8(const void* exp8, const void* exp16) {
#if defined(__AVX512F__)
  using Exp8 = __m256 (*)(__m256);
  using Exp16 = __m512 (*)(__m512);
  const Exp8 e8 = reinterpret_cast<Exp8>(const_cast<void*>(exp8));
  const Exp16 e16 = reinterpret_cast<Exp16>(const_cast<void*>(exp16));
  for (uint32_t first = 0; first < 65536; first += 16) {
    alignas(64) uint32_t in[16], a[16], b[16];
    for (uint32_t i = 0; i < 16; ++i) in[i] = (first + i) << 16;
    const __m512 v = _mm512_load_ps(reinterpret_cast<const float*>(in));
    _mm256_store_ps(reinterpret_cast<float*>(a), e8(_mm512_castps512_ps256(v)));
    _mm256_store_ps(reinterpret_cast<float*>(a + 8), e8(_mm512_extractf32x8_ps(v, 1)));
    _mm512_store_ps(reinterpret_cast<float*>(b), e16(v));
    if (std::memcmp(a, b, sizeof a) != 0) return 0;
  }
  return 1;
#else
  (void)exp8, (void)exp16;
  return 0;
#endif
}

extern "C" int quire_rms_norm(int dtype, int width, void* x, void* residual, const void* weight,
                              void* out, int64_t rows, int64_t n, int64_t x_stride,
                              int64_t res_stride, int64_t out_stride, float eps) {
  if (n > 8192 || (width != 8 && width != 16)) return 1;
#define QUIRE_RMS(T, W)                                                                        \
  rms_norm<T, W>(static_cast<T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight), \
                 static_cast<T*>(out), rows, n, x_stride, res_stride, out_stride, eps)
  if (dtype == 0 && width == 16) QUIRE_RMS(float, 16);
  else if (dtype == 0) QUIRE_RMS(float, 8);
  else if (dtype == 1 && width == 16) QUIRE_RMS(uint16_t, 16);
  else if (dtype == 1) QUIRE_RMS(uint16_t, 8);
  else return 1;
#undef QUIRE_RMS
  return 0;
}

extern "C" int quire_rope(int dtype, void* x, const void* cos, const void* sin, int64_t tokens,
                          int heads, int head_dim, int64_t token_stride, int64_t cs_stride) {
  if (dtype == 0)
    rope(static_cast<float*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin),
         tokens, heads, head_dim, token_stride, cs_stride);
  else if (dtype == 1)
    rope(static_cast<uint16_t*>(x), static_cast<const uint16_t*>(cos),
         static_cast<const uint16_t*>(sin), tokens, heads, head_dim, token_stride, cs_stride);
  else
    return 1;
  return 0;
}

extern "C" int quire_silu_and_mul(int dtype, int width, const void* gate_up, void* out,
                                  int64_t rows, int64_t n, int64_t in_stride, int64_t out_stride,
                                  const void* exp_fn) {
  if (!quire_fused_supports_width(width) || exp_fn == nullptr || n > kMaxSiluRow) return 1;
#define QUIRE_SILU(T, W)                                                                   \
  silu_and_mul<T, W>(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, n, in_stride, \
                     out_stride, exp_fn)
  if (dtype == 0 && width == 16) QUIRE_SILU(float, 16);
  else if (dtype == 0) QUIRE_SILU(float, 8);
  else if (dtype == 1 && width == 16) QUIRE_SILU(uint16_t, 16);
  else if (dtype == 1) QUIRE_SILU(uint16_t, 8);
  else return 1;
#undef QUIRE_SILU
  return 0;
}

// out[r] = the index of row r's first maximum (first_max) for x [rows, n] (row stride
// `stride` elements); dtype 0 float32, 1 bfloat16. Returns 0, or 1 for an unknown dtype.
extern "C" int quire_argmax_rows(int dtype, const void* x, int64_t rows, int64_t n,
                                 int64_t stride, int64_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == 0) out[r] = first_max(static_cast<const float*>(x) + r * stride, n);
    else if (dtype == 1) out[r] = first_max(static_cast<const uint16_t*>(x) + r * stride, n);
    else return 1;
  }
  return 0;
}
