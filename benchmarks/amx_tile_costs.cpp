// What the tile unit's fixed steps cost a group (16 weight rows x 32 k) of mt rows of x, on one
// thread with hot data (benchmarks/small_m.py --tile-costs builds it for the amx build):
// quant_matmul.cpp's amx_rows without the unpacking's arithmetic and the folds' FMAs. A
// quantized weight's group has its own scales, so each group needs its own C tile, stored and
// read back by the vector unit, and its 16 B rows stored as bfloat16 pairs before the tile
// unit can load them: the floor under nine verification rows that no unpacking or fold
// arithmetic can lower.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

namespace {
#if defined(__AMX_BF16__)
struct TileConfig {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kGroups = 4;   // groups in flight, each in its own C tile (amx_rows' kAmxGroups)
constexpr int kBatches = 20000;

alignas(64) uint16_t x[16 * 576];               // mt rows of x, K = 576
alignas(64) uint32_t pairs[2][kGroups][16 * 16];  // a batch's B tiles (16 pairs x 16 rows)
alignas(64) float part[kGroups][16 * 16];         // its C tiles
float sink;

// Group C of a batch, as amx_rows runs it: C = A (mt rows of x, K = 576 apart) x B. (The tile
// intrinsics paste their register numbers into the instruction: literals, hence a macro.)
#define QUIRE_GROUP(C, A, B, a, b) \
  do {                             \
    _tile_zero(C);                 \
    _tile_loadd(A, a, 1152);       \
    _tile_loadd(B, b, 64);         \
    _tile_dpbf16ps(C, A, B);       \
  } while (0)

// One batch of kGroups groups: `Stores` the B rows (16 vector stores a group), `Products`
// (zero, load A, load B, dot product), `StoreC` the C tiles, `LoadC` their mt rows back.
template <bool Stores, bool Products, bool StoreC, bool LoadC>
double batch_ns(int mt) {
  double best = 1e30;
  for (int round = 0; round < 9; ++round) {
    __m512 acc = _mm512_setzero_ps();
    const auto start = std::chrono::steady_clock::now();
    for (int b = 0; b < kBatches; ++b) {
      uint32_t(*B)[16 * 16] = pairs[b & 1];
      if constexpr (Stores) {
        const __m512i v = _mm512_set1_epi32(b);
        for (int g = 0; g < kGroups; ++g)
          for (int r = 0; r < 16; ++r) _mm512_store_si512(B[g] + 16 * r, v);
      }
      if constexpr (Products) {
        const uint16_t* a = x + 32 * (b % 16);
        QUIRE_GROUP(0, 4, 6, a, B[0]);
        QUIRE_GROUP(1, 5, 7, a + 32, B[1]);
        QUIRE_GROUP(2, 4, 6, a + 64, B[2]);
        QUIRE_GROUP(3, 5, 7, a + 96, B[3]);
      }
      if constexpr (StoreC) {
        _tile_stored(0, part[0], 64);
        _tile_stored(1, part[1], 64);
        _tile_stored(2, part[2], 64);
        _tile_stored(3, part[3], 64);
      }
      if constexpr (LoadC)
        for (int g = 0; g < kGroups; ++g)
          for (int m = 0; m < mt; ++m) acc = _mm512_add_ps(acc, _mm512_load_ps(part[g] + 16 * m));
    }
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - start).count();
    sink += _mm512_reduce_add_ps(acc);
    best = ns < best ? ns : best;
  }
  return best / (kBatches * kGroups);
}
#endif
}  // namespace

// ns a group for mt (1-16) rows: [0] the products alone, [1] + the C stores, [2] + the C loads,
// [3] the B rows' stores alone, [4] all of it. 1 when measured, 0 without usable tiles.
extern "C" int quire_amx_tile_costs(int mt, double* ns) {
#if defined(__AMX_BF16__)
  if (mt < 1 || mt > 16 || syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t < 6 ? mt : 16);
  }
  _tile_loadconfig(&c);
  ns[0] = batch_ns<false, true, false, false>(mt);
  ns[1] = batch_ns<false, true, true, false>(mt);
  ns[2] = batch_ns<false, true, true, true>(mt);
  ns[3] = batch_ns<true, false, false, false>(mt);
  ns[4] = batch_ns<true, true, true, true>(mt);
  _tile_release();
  return 1;
#else
  (void)mt, (void)ns;
  return 0;
#endif
}
