// Exact quantized GEMM for many activation rows on AVX2 (included by qgemm.h in the AVX2 build only):
// y = x @ W.T with the weights as the vector side, as BLIS's Haswell sgemm lays out its operands.
//
// qgemm.h's kernel broadcasts the weights and runs vectors along the activation rows, so every FMA pair
// streams a fresh 64-byte slice of packed x from L2 (a panel's 6 weight rows stay in L1); on a 2-core Zen 3
// sharing its L3 with other tenants it ran at ~100-135 GFLOP/s of the 185 the FMA units do, 10-25% behind
// torch's (MKL's) float32 GEMM on dequantized weights from 512 rows -- that stream the likely limit (no
// hardware counters there to show it). Here a panel of 2W
// output columns is dequantized (the same floats as dequantize()), transposed to [kc][2W] once per row
// block, and held in L1; the micro-kernel broadcasts MR activations per input from the packed x (24 bytes
// from L2 per 12 FMAs) and keeps an MR x 2W tile of y in registers, stored row by row with no horizontal
// sums. Each output's products accumulate in input order, the accumulators starting from y's partial sum
// after the first KC slice: float32, exact to the dequantized weights up to summation order.

#if !KV_AVX512
constexpr int WG_MR = 6;             // activation rows per micro-tile: 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int WG_NR = 2 * W;         // output columns per panel (16)
constexpr int64_t WG_KC = 256;  // inputs per slice: the transposed panel is 256 x 16 floats, 16 KiB (L1)
constexpr int64_t WG_MB = 144;  // rows per row block at most (whole micro-tiles): its x slice, 144 KiB, in L2
constexpr int64_t WG_NG = 2;    // panels per task: one row block against 2 panels (32 columns)

// dst[i * ds + j] = src[j * ss + i] for an 8 x 8 block.
static inline void wg_transpose8(const float* src, int64_t ss, float* dst, int64_t ds) {
    __m256 r[8], t[8], u[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + j * ss);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// The panel of columns n0..n0+nr as [kc][WG_NR] (zero past nr): dequantized row by row into rows_buf
// ([WG_NR][kc], as qgemm.h's panels), then transposed 8 x 8.
template <int QT>
static inline void wg_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int nr, int64_t k0, int64_t kc,
                            float* rows_buf, float* panel) {
    gm_dequant_panel<QT>(w, row_bytes, n0, nr, k0, kc, rows_buf, WG_NR);
    for (int64_t i = 0; i < kc; i += 8)
        for (int g = 0; g < WG_NR; g += 8) wg_transpose8(rows_buf + g * kc + i, kc, panel + i * WG_NR + g, WG_NR);
}

// x's rows packed by micro-tile: xp[(t * k + i) * MR + r] = x[t * MR + r][i] (zero past the last row).
static inline void wg_pack_tile(const float* x, int64_t rows, int64_t k, int64_t t, float* xp) {
    float* dst = xp + t * k * WG_MR;
    for (int r = 0; r < WG_MR; ++r) {
        const int64_t row = t * WG_MR + r;
        if (row >= rows) {
            for (int64_t i = 0; i < k; ++i) dst[i * WG_MR + r] = 0.0f;
            continue;
        }
        const float* src = x + row * k;
        for (int64_t i = 0; i < k; ++i) dst[i * WG_MR + r] = src[i];
    }
}

// y[r][0..nr) (+)= sum over the slice of xp[i][r] * panel[i][...] for the tile's `rows` rows: the
// accumulators start from y after the first slice, so each output sums its products in input order.
static inline void wg_tile(const float* xp, const float* panel, int64_t kc, float* y, int64_t ystride, int rows,
                           int nr, bool first) {
    V c[WG_MR][2];
    alignas(32) float part[WG_NR];
    for (int r = 0; r < WG_MR; ++r) {
        if (first || r >= rows) {
            c[r][0] = c[r][1] = vzero();
        } else if (nr == WG_NR) {
            c[r][0] = vload(y + r * ystride);
            c[r][1] = vload(y + r * ystride + W);
        } else {
            for (int j = 0; j < WG_NR; ++j) part[j] = j < nr ? y[r * ystride + j] : 0.0f;
            c[r][0] = vload(part);
            c[r][1] = vload(part + W);
        }
    }
    for (int64_t i = 0; i < kc; ++i) {
        const V b0 = vload(panel + i * WG_NR), b1 = vload(panel + i * WG_NR + W);
#pragma GCC unroll 6
        for (int r = 0; r < WG_MR; ++r) {
            const V a = vset1(xp[i * WG_MR + r]);
            c[r][0] = vfma(a, b0, c[r][0]);
            c[r][1] = vfma(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        if (nr == WG_NR) {
            vstore(y + r * ystride, c[r][0]);
            vstore(y + r * ystride + W, c[r][1]);
            continue;
        }
        vstore(part, c[r][0]);
        vstore(part + W, c[r][1]);
        for (int j = 0; j < nr; ++j) y[r * ystride + j] = part[j];
    }
}

// Two barriers per call, as qgemm.h: x is packed by micro-tile, then each task -- one row block of WG_MB
// rows against WG_NG panels -- runs slice by slice: each panel's slice dequantized and transposed into L1,
// then every micro-tile of the block against it.
template <int QT>
static void qgemm_wide_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                         float* y, int64_t ystride) {
    const int64_t ntiles = (rows + WG_MR - 1) / WG_MR;
    // Row blocks of equal size (whole micro-tiles, at most WG_MB rows): the static schedule deals the tasks out
    // in order, so a short last block would leave one thread idle (128 rows as 96 + 32 ran at ~0.75x).
    const int64_t max_tiles = WG_MB / WG_MR, nblocks = (ntiles + max_tiles - 1) / max_tiles;
    const int64_t tiles_per_block = (ntiles + nblocks - 1) / nblocks;
    const int64_t npanels = (n + WG_NR - 1) / WG_NR, ngroups = (npanels + WG_NG - 1) / WG_NG;
    ScratchScope scope;  // scratch.h
    float* xp = scope.take<float>(ntiles * k * WG_MR);
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // this thread's
        float* rows_buf = own.take<float>(WG_NR * WG_KC);
        float* panel = own.take<float>(WG_KC * WG_NR);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; ++t) wg_pack_tile(x, rows, k, t, xp);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < nblocks * ngroups; ++task) {
            const int64_t b = task / ngroups, g = task % ngroups;
            const int64_t t0 = b * tiles_per_block, t1 = t0 + tiles_per_block < ntiles ? t0 + tiles_per_block : ntiles;
            const int64_t p0 = g * WG_NG, p1 = p0 + WG_NG < npanels ? p0 + WG_NG : npanels;
            for (int64_t k0 = 0; k0 < k; k0 += WG_KC) {
                const int64_t kc = k - k0 < WG_KC ? k - k0 : WG_KC;
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t n0 = p * WG_NR;
                    const int nr = static_cast<int>(n - n0 < WG_NR ? n - n0 : WG_NR);
                    wg_panel<QT>(w, row_bytes, n0, nr, k0, kc, rows_buf, panel);
                    for (int64_t t = t0; t < t1; ++t) {
                        const int64_t r0 = t * WG_MR;
                        const int tr = static_cast<int>(rows - r0 < WG_MR ? rows - r0 : WG_MR);
                        wg_tile(xp + (t * k + k0) * WG_MR, panel, kc, y + r0 * ystride + n0, ystride, tr, nr,
                                k0 == 0);
                    }
                }
            }
        }
    }
}

static void qgemm_wide(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                       int64_t row_bytes, float* y, int64_t ystride) {
    if (qt == QT_Q4_1) qgemm_wide_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qgemm_wide_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qgemm_wide_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else qgemm_wide_t<QT_BF16>(x, rows, k, w, n, row_bytes, y, ystride);
}
#endif
