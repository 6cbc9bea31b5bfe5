// The AMX tile state for the native kernels that use the tiles (quant_matmul.cpp,
// prefill_attention.cpp): the tile configuration's layout and the process's permission.
#pragma once
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace quire_amx {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The kernel lets a process use the tile registers only after it asks (Linux 5.16+); torch's
// oneDNN asks too. Once per process; false where the kernel or the VM refuses.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

}  // namespace quire_amx
#endif
