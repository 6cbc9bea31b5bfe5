// A whole decode step's decoder layers in one native call: for each layer, residual add +
// RMSNorm, the fused QKV matmul, RoPE on q and k, the KV-cache write, paged attention, the
// output projection, residual add + RMSNorm, gate/up, SiLU-and-mul and down.
//
// At batch 1 a step is ~300 short kernels; called one by one from Python (ctypes argument
// conversion, tensor views, allocations) they cost more than the weights take to read. This
// file adds no arithmetic of its own: it calls the very kernels the Python path calls (their
// addresses come from the caller: fused_ops.cpp, quant_matmul.cpp and
// attention/cpu_kernels/paged_decode.cpp), in the same order, on the same dtypes and strides,
// so its output is bit-identical to that path (tests/quant/test_decode_stack.py). Only the
// orchestration moved.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

using RmsNormFn = int (*)(int, int, void*, void*, const void*, void*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float);
using RopeFn = int (*)(int, void*, const void*, const void*, int64_t, int, int, int64_t,
                       int64_t);
using SiluFn = int (*)(int, int, const void*, void*, int64_t, int64_t, int64_t, int64_t,
                       const void*);
using DecodeFn = int (*)(int, const void*, const void*, const void*, void*, const int32_t*,
                         const int32_t*, int64_t, int, int, int, int, int64_t, int64_t,
                         int64_t, float, int, float, const float*);
using LinearFn = int (*)(const void*, void*, int64_t, int, int, const void*);

inline double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Scratch {
  char* data = nullptr;
  int64_t bytes = 0;
  ~Scratch() { std::free(data); }
};

}  // namespace

extern "C" {

// One decoder layer's weights (the packed weights are quant_matmul.cpp's PackedArgs) and its
// KV cache ([num_blocks, block_size, num_kv_heads, head_dim], contiguous).
struct QuireStackLayer {
  const void* input_norm;
  const void* post_norm;
  const void* qkv;
  const void* o;
  const void* gate_up;
  const void* down;
  void* k_cache;
  void* v_cache;
  int64_t window;  // sliding window, 0 for none
};

struct QuireStackModel {
  int64_t dtype;  // 0 float32, 1 bfloat16
  int64_t width;  // fused_ops' vector width
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  const QuireStackLayer* layers;
  RmsNormFn rms_norm;
  RopeFn rope;
  SiluFn silu_and_mul;
  DecodeFn paged_decode;
  LinearFn linear;
  const void* exp_fn;
  // where non-null, seconds spent per phase are added here (benchmarks/decode_profile.py):
  // input norm, qkv, rope, kv write, attention, o, post norm, gate_up, silu_and_mul, down
  double* timings;
};

// x [T, hidden]: the embeddings in, the last layer's MLP output out; residual [T, hidden]:
// the running sum (their sum is the stack's output, as in the Python path). Every token is a
// decode: token t belongs to sequence t, is written at cache slot slots[t] and attends to its
// sequence's first seq_lens[t] tokens. Returns 0, or the failing step's number.
int quire_decode_stack(const QuireStackModel* m, void* x, void* residual, const void* cos,
                       const void* sin, int64_t cs_stride, const int64_t* slots,
                       const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                       int64_t tokens, int threads) {
  const int64_t es = m->dtype == 0 ? 4 : 2;
  const int64_t h = m->hidden, d = m->head_dim, q_size = m->num_heads * d,
                kv_size = m->num_kv_heads * d, qkv_width = q_size + 2 * kv_size,
                inter = m->intermediate;
  // scratch, grown as needed and kept for the next step (64-byte aligned like torch's); one
  // per calling thread, freed when that thread ends
  static thread_local Scratch held;
  char*& scratch = held.data;
  int64_t& scratch_bytes = held.bytes;
  auto round_up = [](int64_t n) { return (n + 63) / 64 * 64; };
  const int64_t norm_bytes = round_up(tokens * h * es), qkv_bytes = round_up(tokens * qkv_width * es),
                attn_bytes = round_up(tokens * q_size * es),
                gu_bytes = round_up(tokens * 2 * inter * es),
                act_bytes = round_up(tokens * inter * es);
  const int64_t need = norm_bytes + qkv_bytes + attn_bytes + gu_bytes + act_bytes;
  if (need > scratch_bytes) {
    std::free(scratch);
    scratch = static_cast<char*>(std::aligned_alloc(64, need));
    scratch_bytes = scratch ? need : 0;
    if (!scratch) return 100;
  }
  char* normed = scratch;
  char* qkv = normed + norm_bytes;
  char* attn = qkv + qkv_bytes;
  char* gate_up = attn + attn_bytes;
  char* act = gate_up + gu_bytes;
  const int dt = static_cast<int>(m->dtype), width = static_cast<int>(m->width);
  char* xb = static_cast<char*>(x);
  double* timings = m->timings;
  double mark = timings ? seconds() : 0.0;
  auto lap = [&](int phase) {
    if (timings) {
      const double now = seconds();
      timings[phase] += now - mark;
      mark = now;
    }
  };
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const QuireStackLayer& L = m->layers[i];
    // the first layer normalizes the embeddings (x, which is also the residual) into a
    // scratch; later ones add x into the residual and normalize that over x
    char* hin;
    if (i == 0) {
      std::memcpy(residual, x, tokens * h * es);
      if (m->rms_norm(dt, width, x, nullptr, L.input_norm, normed, tokens, h, h, 0, h, m->eps))
        return 1;
      hin = normed;
    } else {
      if (m->rms_norm(dt, width, x, residual, L.input_norm, x, tokens, h, h, h, h, m->eps))
        return 2;
      hin = xb;
    }
    lap(0);
    if (m->linear(hin, qkv, tokens, dt, threads, L.qkv)) return 3;
    lap(1);
    if (m->rope(dt, qkv, cos, sin, tokens, static_cast<int>(m->num_heads), static_cast<int>(d),
                qkv_width, cs_stride))
      return 4;
    if (m->rope(dt, qkv + q_size * es, cos, sin, tokens, static_cast<int>(m->num_kv_heads),
                static_cast<int>(d), qkv_width, cs_stride))
      return 5;
    lap(2);
    for (int64_t t = 0; t < tokens; ++t) {
      const char* row = qkv + t * qkv_width * es;
      std::memcpy(static_cast<char*>(L.k_cache) + slots[t] * kv_size * es, row + q_size * es,
                  kv_size * es);
      std::memcpy(static_cast<char*>(L.v_cache) + slots[t] * kv_size * es,
                  row + (q_size + kv_size) * es, kv_size * es);
    }
    lap(3);
    if (m->paged_decode(dt, qkv, L.k_cache, L.v_cache, attn, block_tables, seq_lens, tokens,
                        static_cast<int>(m->num_heads), static_cast<int>(m->num_kv_heads),
                        static_cast<int>(d), static_cast<int>(m->block_size), qkv_width, q_size,
                        bt_stride, m->scale, static_cast<int>(L.window), 0.f, nullptr))
      return 6;
    lap(4);
    if (m->linear(attn, x, tokens, dt, threads, L.o)) return 7;
    lap(5);
    if (m->rms_norm(dt, width, x, residual, L.post_norm, x, tokens, h, h, h, h, m->eps))
      return 8;
    lap(6);
    if (m->linear(x, gate_up, tokens, dt, threads, L.gate_up)) return 9;
    lap(7);
    if (m->silu_and_mul(dt, width, gate_up, act, tokens, inter, 2 * inter, inter, m->exp_fn))
      return 10;
    lap(8);
    if (m->linear(act, x, tokens, dt, threads, L.down)) return 11;
    lap(9);
  }
  return 0;
}

}  // extern "C"
