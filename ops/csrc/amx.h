/* AMX tiles, shared by the kernels that use them (small_gemm.c, paged_attention.c): whether
 * this process may use them, and the tile configuration's layout. Only where the build targets
 * a CPU with AMX-BF16. */
#ifndef DSPARK_CSRC_AMX_H
#define DSPARK_CSRC_AMX_H
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this process may use the tiles (Linux grants the tile state on request; asked once
 * per file that includes this, every answer the same), 0 where not */
static inline int amx_allowed(void) {
    static int state = -1; /* benign race: every thread computes the same answer */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* this thread's eight tiles: tile t `rows[t]` rows of 64 bytes */
static inline void amx_load_config(const uint8_t rows[8]) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif
#endif
