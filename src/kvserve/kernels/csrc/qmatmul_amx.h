// The int8 path's packed matmul on AMX tiles (Sapphire Rapids and later), for 16 or more activation rows.
// Included by qmatmul_i8.h after qmatmul_i8_packed.h, inside the AVX-512 namespace only; runs only where
// kv_amx_enable() succeeded (the CPU has AMX-INT8 and Linux granted the tile state, ARCH_REQ_XCOMP_PERM).
//
// One tile product per (16 rows, 16 output columns, one 32-weight block): A is 16 quantized activation rows
// x 32 bytes, read in place from Q8Rows::q (row stride k); B is the block's quants in the packed layout,
// which already is AMX's "4 bytes of K per column" arrangement (piece j of column c at j*64 + c*4): Q8_0's
// 8 pieces load as they are; Q4's 4 pieces of nibbles are split once per call into 8 rows of unsigned bytes
// (low nibbles are weights 4t..4t+3 = B row t, high nibbles weights 16+4t.. = B row 4+t). TDPBSSD (signed
// activations x nibbles, which as bytes below 128 read alike signed or unsigned) gives exactly the int32
// sums the VNNI kernel forms (its u8/s8 swap and 128 * sum(qw) correction cancel in integer arithmetic), and
// the float epilogue is packed_tile's, operation for operation and block by block: bit-identical to it.
//
// One TDPBSSD is 8,192 multiply-adds where vpdpbusd is 64; what remains is the per-block float epilogue
// (the block scales forbid summing blocks in the tile), 3-4 vector operations per 16 outputs -- which is
// what bounds it (see amx_pays).

constexpr int64_t AMX_ROWS = 16;  // activation rows per tile (and the fewest rows worth a tile)

// Where tiles run: Q8_0 weights from one whole tile of rows (the tied head: 1.2-1.85x the VNNI kernel's
// multiply-adds per second at 16-2,048 rows, 2 threads; benchmarks/results/amx.md). Q4_0/Q4_1 only when
// asked (kv_amx_enable mode 2: the benchmark and the tests): their extra epilogue work (Q4_1's m * s, one
// more broadcast load) left tiles no faster than VNNI (0.71-1.05x on the default model's projections) --
// the per-block float epilogue, not the tile product, bounds this kernel, and VNNI unpacks nibbles in
// registers for free.
template <int QT>
static inline bool amx_pays(int64_t rows) {
    return rows >= AMX_ROWS && kv_amx_mode() >= (QT == QT_Q8_0 ? 1 : 2);
}

#if KV_HAS_AMX
// Palette 1: tmm0/tmm1 the int32 products (16 x 64 bytes), tmm2 the activations (16 x 32), tmm3/tmm4 weights
// (8 x 64). Loaded per call by each thread that runs tiles: the configuration is per thread.
struct alignas(64) AmxTileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 32, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 8, 8};
};

// B tiles of one column group for the whole k: nb blocks x 512 bytes. Q8_0's pieces are the tile as packed.
template <int QT>
static inline void amx_unpack_group(const uint8_t* pw, int64_t nb, uint8_t* out) {
    constexpr int64_t PB = packed_block_bytes(QT);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        for (int t = 0; t < 4; ++t) {
            const __m512i raw = _mm512_loadu_si512(pw + b * PB + t * 64);
            _mm512_storeu_si512(out + b * 512 + t * 64, _mm512_and_si512(raw, nibble));
            _mm512_storeu_si512(out + b * 512 + (4 + t) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
        }
    }
}

// One block's epilogue for 16 rows, packed_tile's operations: acc = fma(dw * dx, isum, acc), then for Q4
// fma(mw, s, acc). isum: the block's int32 products as stored from the tile (row r at r * 16).
template <int QT>
static inline void amx_epilogue(const int32_t* isum, const Q8Rows& x, int64_t nb, int64_t b, __m512 dw, __m512 mw,
                                __m512* acc) {
    for (int r = 0; r < AMX_ROWS; ++r) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * nb + b]));
        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(isum + r * 16)), acc[r]);
        if (QT != QT_Q8_0) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[r * nb + b]), acc[r]);
    }
}

template <int QT>
static inline void amx_scales(const uint8_t* wb, __m512* dw, __m512* mw) {
    const uint8_t* sc = wb + packed_quant_bytes(QT);
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    *mw = QT == QT_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)))
          : QT == QT_Q4_0 ? _mm512_mul_ps(*dw, _mm512_set1_ps(-8.0f))
                          : _mm512_setzero_ps();
}

// One block's tile product, stored: product tile `c` (0 or 1; its weight tile 3 + c) = A (16 rows of block
// b) x B (the block's tile). Two spelled-out branches: GCC's tile intrinsics paste their tile numbers into the
// instruction text, so they must be literals (not even template parameters).
static inline void amx_product(const Q8Rows& x, int64_t k, int64_t b, const uint8_t* bt, int64_t bstride,
                               int32_t* out, int c) {
    _tile_loadd(2, x.q + b * QK, k);
    if (c == 0) {
        _tile_zero(0);
        _tile_loadd(3, bt + b * bstride, 64);
        _tile_dpbssd(0, 2, 3);  // Q4's nibbles are below 128: signed and unsigned bytes read alike
        _tile_stored(0, out, 64);
    } else {
        _tile_zero(1);
        _tile_loadd(4, bt + b * bstride, 64);
        _tile_dpbssd(1, 2, 4);
        _tile_stored(1, out, 64);
    }
}

// 16 rows x one column group. Software-pipelined by one block: block b + 1's product is stored while block
// b's is read back for its epilogue, so no epilogue waits on the tile store just issued (the two product
// tiles alternate, and so do their buffers). bt: the group's B tiles (amx_unpack_group's, or the packed
// weight for Q8_0, whose blocks are PB bytes apart); cbuf: 2 x 1 KiB, 64-byte aligned.
template <int QT>
static inline void amx_tile_rows(const Q8Rows& x, int64_t k, int64_t nb, const uint8_t* pw, const uint8_t* bt,
                                 int64_t bstride, int32_t* cbuf, float* y, int64_t ystride, __mmask16 keep) {
    constexpr int64_t PB = packed_block_bytes(QT);
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
    __m512 dw, mw;
    amx_product(x, k, 0, bt, bstride, cbuf, 0);
    for (int64_t b = 0; b < nb; ++b) {
        if (b + 1 < nb) amx_product(x, k, b + 1, bt, bstride, cbuf + ((b + 1) & 1) * 256, (b + 1) & 1);
        amx_scales<QT>(pw + b * PB, &dw, &mw);
        amx_epilogue<QT>(cbuf + (b & 1) * 256, x, nb, b, dw, mw, acc);
    }
    for (int r = 0; r < AMX_ROWS; ++r) _mm512_mask_storeu_ps(y + r * ystride, keep, acc[r]);
}

// packed_groups_run's contract on tiles: groups [g0, g1) for `rows` (>= AMX_ROWS) quantized rows; the rows
// past the last whole tile go through the VNNI kernel (bit-identical, so the seam cannot show).
template <int QT>
static void amx_groups_run(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* pw, int64_t n, int64_t gstride,
                           float* y, int64_t ystride, int64_t g0, int64_t g1) {
    const int64_t nb = k / QK, full = rows / AMX_ROWS * AMX_ROWS;
    ScratchScope scope;  // scratch.h: this thread's
    int32_t* cbuf = scope.take<int32_t>(2 * 256);
    uint8_t* bt = QT == QT_Q8_0 ? nullptr : scope.take<uint8_t>(nb * 512);
    static const AmxTileConfig config;
    _tile_loadconfig(&config);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* pg = pw + g * gstride;
        const int64_t last = n - g * PACKED_COLS < PACKED_COLS ? n - g * PACKED_COLS : PACKED_COLS;
        const __mmask16 keep = static_cast<__mmask16>((1u << last) - 1u);
        if (QT != QT_Q8_0) amx_unpack_group<QT>(pg, nb, bt);
        const uint8_t* tiles = QT == QT_Q8_0 ? pg : bt;
        const int64_t bstride = QT == QT_Q8_0 ? packed_block_bytes(QT) : 512;
        for (int64_t r0 = 0; r0 < full; r0 += AMX_ROWS)
            amx_tile_rows<QT>(i8_offset(x, r0, k, nb), k, nb, pg, tiles, bstride, cbuf,
                              y + r0 * ystride + g * PACKED_COLS, ystride, keep);
        if (full < rows)
            packed_rows<1, QT>(i8_offset(x, full, k, nb), rows - full, k, nb, pg, gstride,
                               y + full * ystride + g * PACKED_COLS, ystride, last, nullptr);
    }
    _tile_release();
}
#else
template <int QT>
static void amx_groups_run(const Q8Rows&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t,
                           int64_t, int64_t) {}  // never called: amx_pays is false without kv_amx_enable
#endif  // KV_HAS_AMX
