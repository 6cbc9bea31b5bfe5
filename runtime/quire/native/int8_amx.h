// int8 activations on the AMX tiles (amx builds), part of quant_matmul.cpp through
// int8_activations.h: included there after q8_quads and Q8Rows, inside its anonymous namespace.
//
// The tile unit's int8 product (tdpbsud: signed xq times unsigned u, four products a 32-bit
// lane, summed exactly in int32; tdpbssd for int8 weights) takes 16 rows of x against a row block's 16 rows per 32-k
// block: the A tile is mt rows of 32 xq bytes (quad_slot order), the B tile the block's 8
// quads of k (q8_quads' two vectors per 8 k, as they are: the tiles' VNNI layout). Each
// block's C tile holds q8_isums' exact isum, which the vector unit then folds as q8_rows does
// (part = d * isum + part in block order; y = o * xs + (s * part + y) at a group's end): every
// row keeps the bits of every other build at any M. Unpacking is ~7 operations per 64 bytes of
// weights against the bfloat16 tiles' ~20 (nibble_pairs); what a row costs here is mostly the
// C tile each 32-k block needs and its fold (a SmolLM2 step's matmuls on the 2-core AMX Xeon:
// 9 rows 1.76x one row, 32 rows 4.1x; the old 4-row vpmaddubsw path 3.1x and 9.5x).
#if defined(__AMX_INT8__)
// Calls of this many rows or more run on the tiles; fewer take the VNNI rows, which were
// faster there (a SmolLM2 step's int4 matmuls, amx build, tiles from 3 against from 9,
// alternated, best of 15, ms: 3 rows 3.61 / 2.56, 4 3.69 / 2.99, 5 3.81 / 3.95, 6 3.96 / 4.18,
// 8 4.42 / 4.48)
constexpr int kQ8AmxMinRows = 5;
constexpr int kQ8AmxBatch = 4;    // 32-k blocks in flight, each in its own C tile
constexpr int kQ8AmxRows = 16;    // rows of x per A tile
constexpr int kQ8Quads = kQ8Block / 4;  // B tile rows per 32-k block
constexpr int kQ8BlockBytes = kQ8Quads * 64;  // one block's B tile (512 bytes)

// Tiles 0-3: C (mt rows of 16 int32); 4, 5: A (mt rows of 32 xq); 6, 7: B (8 quads of 16 rows)
inline void q8_amx_configure(int mt) {
  quire_amx::TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = t == 4 || t == 5 ? kQ8Block : 64;
    c.rows[t] = static_cast<uint8_t>(t < 6 ? mt : kQ8Quads);
  }
  _tile_loadconfig(&c);
}

inline bool q8_amx_takes(int64_t M) {
  return M >= kQ8AmxMinRows && quire_amx::amx_permitted();
}

// `blocks` 32-k blocks of row block `q` (from block k0 / 32) as B tiles into `b`; the same
// lines of the next row block are fetched meanwhile, one with each line unpacked.
template <int Form>
inline void q8_b_tiles(const uint8_t* q, int64_t block_bytes, int64_t k0, int blocks,
                       uint8_t* b) {
  constexpr int64_t kLine = 8 * q8_bytes_per_k<Form>();  // q bytes of 8 k
  for (int i = 0; i < blocks * kQ8Block / 8; ++i) {
    const int64_t at = k0 * q8_bytes_per_k<Form>() + kLine * i;
    __m512i even, odd;
    for (int64_t line = 0; line < kLine; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + block_bytes + at + line), _MM_HINT_T0);
    if constexpr (Form == kInt8) q8_quads_int8<false>(q + at, even, odd);
    else q8_quads<Form>(q + at, even, odd);
    _mm512_store_si512(b + 128 * i, even);
    _mm512_store_si512(b + 128 * i + 64, odd);
  }
}

// C tile C = A x B for one block: A from xq (rows K bytes apart), B from its 512 bytes
// (tdpbssd for int8 weights: both signed)
#define QUIRE_Q8_AMX_BLOCK(C, A, B, xq, K, b) \
  do {                                        \
    _tile_zero(C);                            \
    _tile_loadd(A, xq, K);                    \
    _tile_loadd(B, b, 64);                    \
    if constexpr (Form == kInt8)              \
      _tile_dpbssd(C, A, B);                  \
    else                                      \
      _tile_dpbsud(C, A, B);                  \
  } while (0)

// mt (<= 16) rows of rounded x (from row m0) against row block `block`: out[m][r] = y[m0 + m,
// row r]. B tiles from `expanded` (the whole block's, q8_b_tiles) or, when null, unpacked a
// batch at a time into `buffer` (kQ8AmxBatch blocks' worth, 64-byte aligned).
template <int Form, typename S>
__attribute__((noinline)) void q8_amx_rows(int mt, const Q8Rows& x, const int8_t* rounded,
                                           int64_t m0, const Weight& w, int64_t block,
                                           const uint8_t* expanded, uint8_t* buffer,
                                           float* out) {
  const int64_t K = w.K, G = w.G, groups = K / G, blocks = K / kQ8Block;
  const int64_t per_group = G / kQ8Block, block_bytes = weight_bytes(Form, K) * kRows;
  const Block<Form, S> here(w, block);
  const int8_t* xq = rounded + m0 * K;
  const float* xd = x.d.data() + m0 * blocks;
  const float* xs = x.xs.data() + m0 * groups;
  alignas(64) int32_t isum[kQ8AmxBatch][kQ8AmxRows * kRows];
  alignas(64) float part[kQ8AmxRows * kRows];
  for (int m = 0; m < mt; ++m) vstore(out + m * kRows, vzero());
  for (int64_t b0 = 0; b0 < blocks; b0 += kQ8AmxBatch) {
    const int n = static_cast<int>(std::min<int64_t>(kQ8AmxBatch, blocks - b0));
    const uint8_t* b = expanded ? expanded + b0 * kQ8BlockBytes : buffer;
    if (!expanded) {
      for (int64_t g = b0 / per_group; g <= (b0 + n - 1) / per_group; ++g)
        fetch_group_scales<Form>(here.scales, here.offsets, (groups + g) * kRows);
      q8_b_tiles<Form>(here.q, block_bytes, b0 * kQ8Block, n, buffer);
    }
    const int8_t* a = xq + b0 * kQ8Block;
    QUIRE_Q8_AMX_BLOCK(0, 4, 6, a, K, b);
    if (n > 1) QUIRE_Q8_AMX_BLOCK(1, 5, 7, a + kQ8Block, K, b + kQ8BlockBytes);
    if (n > 2) QUIRE_Q8_AMX_BLOCK(2, 4, 6, a + 2 * kQ8Block, K, b + 2 * kQ8BlockBytes);
    if (n > 3) QUIRE_Q8_AMX_BLOCK(3, 5, 7, a + 3 * kQ8Block, K, b + 3 * kQ8BlockBytes);
    _tile_stored(0, isum[0], 64);
    if (n > 1) _tile_stored(1, isum[1], 64);
    if (n > 2) _tile_stored(2, isum[2], 64);
    if (n > 3) _tile_stored(3, isum[3], 64);
    for (int j = 0; j < n; ++j) {  // folded in block order, as q8_rows folds
      const int64_t k_block = b0 + j, g = k_block / per_group;
      const bool first = k_block % per_group == 0, last = (k_block + 1) % per_group == 0;
      const V s = last ? vload(here.scales + g * kRows) : vzero();
      const V o = last ? q8_offset<Form, S>(here, g, s) : vzero();
      for (int m = 0; m < mt; ++m) {
        const V p = vfma(vset(xd[m * blocks + k_block]), vload_int32(isum[j] + m * kRows),
                         first ? vzero() : vload(part + m * kRows));
        if (last)
          vstore(out + m * kRows,
                 q8_fold<Form>(vload(out + m * kRows), p, s, o, xs[m * groups + g]));
        else
          vstore(part + m * kRows, p);
      }
    }
  }
}
#undef QUIRE_Q8_AMX_BLOCK

// The rounded x as this thread's own copy, 64-byte aligned, for up to 16 rows: the calling
// thread rounds x every call, and the other threads' tile loads of those lines then wait on
// its core (as amx_x_order's copies, quant_matmul.cpp; prefill-sized calls use each line for
// many row blocks and read x as it is)
inline const int8_t* q8_own_copy(const int8_t* q, int64_t n) {
  static thread_local std::vector<int8_t> copy;
  copy.resize(n + 64);
  int8_t* own = reinterpret_cast<int8_t*>(
      (reinterpret_cast<uintptr_t>(copy.data()) + 63) & ~uintptr_t{63});
  std::memcpy(own, q, n);
  return own;
}

// linear_q8 on the tiles: up to 16 rows read the packed weights as they go (a batch of blocks
// unpacked at a time); more rows unpack each row block once, then every 16-row tile of x uses
// it (prefill, batched decode).
template <int Form, typename S>
void linear_q8_amx(const Q8Rows& x, void* y, int64_t M, int dtype, int threads, const Weight& w) {
  const int64_t blocks = (w.N + kRows - 1) / kRows, k_blocks = w.K / kQ8Block;
  const bool expand = M > kQ8AmxRows;
  const int64_t span = stream_span(blocks, threads), units = (blocks + span - 1) / span;
#if defined(_OPENMP)
  omp_set_schedule(omp_sched_guided, 2);
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
    std::vector<uint8_t> scratch((expand ? k_blocks : kQ8AmxBatch) * kQ8BlockBytes + 64);
    uint8_t* aligned = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    int configured = -1;
    alignas(64) float tile[kQ8AmxRows * kRows];
    const int8_t* rounded = expand ? x.q.data() : q8_own_copy(x.q.data(), M * w.K);
#pragma omp for schedule(runtime)
    for (int64_t u = 0; u < units; ++u)
      for (int64_t b = u * span, last = std::min(blocks, b + span); b < last; ++b) {
        if (expand)
          q8_b_tiles<Form>(w.q + b * weight_bytes(Form, w.K) * kRows,
                           weight_bytes(Form, w.K) * kRows, 0, static_cast<int>(k_blocks),
                           aligned);
        for (int64_t m0 = 0; m0 < M; m0 += kQ8AmxRows) {
          const int mt = static_cast<int>(std::min<int64_t>(kQ8AmxRows, M - m0));
          if (configured != mt) q8_amx_configure(mt), configured = mt;
          q8_amx_rows<Form, S>(mt, x, rounded, m0, w, b, expand ? aligned : nullptr, aligned,
                               tile);
          store_rows(tile, mt, static_cast<int>(std::min<int64_t>(kRows, w.N - b * kRows)), y,
                     dtype, w.N, m0, b * kRows);
        }
      }
  }
}
#endif  // __AMX_INT8__
