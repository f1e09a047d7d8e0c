// Wide exact quantized GEMM (compiled once per ISA, after simd.h and impl.h): y = x @ W.T for many activation
// rows (prefill chunks, decode batches beyond the per-row kernel's range) with W in GGUF blocks.
//
// impl.h's qmatmul converts every weight block to floats once per 4 activation rows; at 32+ rows that
// conversion is most of its work, and dequantizing the whole matrix for torch's GEMM streams a float32 copy
// of every weight on every call. Here each panel of NR weight rows is dequantized ONCE per call into a
// per-thread float buffer (NR x K: L2-resident; each KC-wide slice of it stays in L1 while used), and an
// outer-product micro-kernel runs over every activation tile against it: vectors run along the activation rows (x is packed transposed,
// [k][MT rows], once per call), each dequantized weight is a broadcast, so neither side needs a transpose of
// the weights, and the accumulators never need a horizontal sum. Threads split the panels (output columns).
//
// Exact to the dequantized weights up to summation order: the panel holds the same floats as dequantize()
// (d*q then + m, separately rounded; -ffp-contract=off), products accumulate in float32.

#if KV_AVX512
constexpr int GM_NR = 12;  // weight rows (output columns) per panel: 2 x 12 accumulators of 32 registers
#else
constexpr int GM_NR = 6;   // 2 x 6 accumulators of 16 registers
#endif
constexpr int GM_MV = 2;           // vectors per activation tile (tiles of fewer rows run with 1)
constexpr int GM_MT = GM_MV * W;   // activation rows per tile (32 on AVX-512, 16 on AVX2)
constexpr int64_t GM_KC = 128;     // inputs per block: that slice of the panel (6 KiB) and of MC rows of x (32 KiB) in L1
constexpr int64_t GM_MC = 64;      // activation rows per M block (a multiple of GM_MT)

// panel[j * kc + i] = W[n0 + j][k0 + i] for j < nr (as dequantize() computes it); rows nr..NR are zero.
template <int QT>
static inline void gm_dequant_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int nr, int64_t k0,
                                    int64_t kc, float* panel) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    for (int j = 0; j < GM_NR; ++j) {
        float* dst = panel + j * kc;
        if (j >= nr) {
            for (int64_t i = 0; i < kc; i += W) vstore(dst + i, vzero());
            continue;
        }
        const uint8_t* row = w + (n0 + j) * row_bytes + (k0 / QK) * BB;
        for (int64_t b = 0; b < kc / QK; ++b) {
            const uint8_t* blk = row + b * BB;
            V q[QK / W];
            const V d = vset1(half_to_float(blk));
            float* out = dst + b * QK;
            if (QT == QT_Q8_0) {
                q8_0_block(reinterpret_cast<const int8_t*>(blk + 2), q);
                for (int i = 0; i < QK / W; ++i) vstore(out + i * W, vmul(d, q[i]));
            } else if (QT == QT_Q4_1) {
                q4_1_block(blk + 4, q);
                const V m = vset1(half_to_float(blk + 2));
                for (int i = 0; i < QK / W; ++i) vstore(out + i * W, vadd(vmul(d, q[i]), m));
            } else {
                q4_1_block(blk + 2, q);
                for (int i = 0; i < QK / W; ++i) vstore(out + i * W, vmul(d, vadd(q[i], vset1(-8.0f))));
            }
        }
    }
}

// acc[j][r] (+)= sum_i xp[i][r] * panel[j * pstride + i] for one tile of MV*W activation rows and the panel's
// NR weight rows over kc inputs; xp is the tile's packed block ([kc][GM_MT]), acc its [NR][GM_MT] accumulator.
template <int MV>
static inline void gm_tile(const float* xp, const float* panel, int64_t pstride, int64_t kc, float* acc, bool first) {
    V c[MV][GM_NR];
    for (int j = 0; j < GM_NR; ++j)
        for (int v = 0; v < MV; ++v) c[v][j] = first ? vzero() : vload(acc + j * GM_MT + v * W);
    for (int64_t i = 0; i < kc; ++i) {
        V a[MV];
#pragma GCC unroll 4
        for (int v = 0; v < MV; ++v) a[v] = vload(xp + i * GM_MT + v * W);
#pragma GCC unroll 16
        for (int j = 0; j < GM_NR; ++j) {
            const V b = vset1(panel[j * pstride + i]);
#pragma GCC unroll 4
            for (int v = 0; v < MV; ++v) c[v][j] = vfma(a[v], b, c[v][j]);
        }
    }
    for (int j = 0; j < GM_NR; ++j)
        for (int v = 0; v < MV; ++v) vstore(acc + j * GM_MT + v * W, c[v][j]);
}

// Rows [m0, m0 + mc) of x into xp[tile][k][GM_MT] (tile t holds rows m0 + t*GM_MT ...), zero-padded. Writes run
// contiguously; the reads walk GM_MT rows side by side, each row's cache line serving 16 consecutive i.
static inline void gm_pack_x(const float* x, int64_t k, int64_t m0, int64_t mc, float* xp, int64_t tile) {
    float* dst = xp + tile * k * GM_MT;
    const int64_t r0 = tile * GM_MT;
    const int64_t rows = mc - r0 < GM_MT ? mc - r0 : GM_MT;
    const float* src = x + (m0 + r0) * k;
    for (int64_t i = 0; i < k; ++i) {
        float* d = dst + i * GM_MT;
        for (int64_t r = 0; r < rows; ++r) d[r] = src[r * k + i];
        for (int64_t r = rows; r < GM_MT; ++r) d[r] = 0.0f;
    }
}

// y[r][j] = acc[j][r] for the tile's rows and the panel's nr columns.
static inline void gm_store_tile(const float* acc, int64_t nrows, int nr, float* y, int64_t ystride) {
#if KV_AVX512
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(GM_MT));
    const __mmask16 mask = static_cast<__mmask16>((1u << nr) - 1u);
    for (int64_t r = 0; r < nrows; ++r)
        _mm512_mask_storeu_ps(y + r * ystride, mask, _mm512_mask_i32gather_ps(vzero(), mask, idx, acc + r, 4));
#else
    for (int64_t r = 0; r < nrows; ++r)
        for (int j = 0; j < nr; ++j) y[r * ystride + j] = acc[j * GM_MT + r];
#endif
}

// Two barriers per call whatever the row count (on a busy machine each one can wait out a descheduled peer):
// every tile of x is packed, then each thread dequantizes each of its panels once, over the whole width, and
// runs it against every M block.
template <int QT>
static void qgemm_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                    float* y, int64_t ystride) {
    const int64_t npanels = (n + GM_NR - 1) / GM_NR;
    const int64_t tiles_all = (rows + GM_MT - 1) / GM_MT;
    constexpr int64_t TILES_MC = GM_MC / GM_MT;
    float* xp = static_cast<float*>(_mm_malloc(tiles_all * k * GM_MT * sizeof(float) + 64, 64));
#pragma omp parallel num_threads(kv_threads())
    {
        float* panel = static_cast<float*>(_mm_malloc(GM_NR * k * sizeof(float) + 64, 64));
        float* acc = static_cast<float*>(_mm_malloc(TILES_MC * GM_NR * GM_MT * sizeof(float) + 64, 64));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles_all; ++t) gm_pack_x(x, k, 0, rows, xp, t);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npanels; ++p) {
            const int64_t n0 = p * GM_NR;
            const int nr = static_cast<int>(n - n0 < GM_NR ? n - n0 : GM_NR);
            gm_dequant_panel<QT>(w, row_bytes, n0, nr, 0, k, panel);  // once per call: [NR][k], L2-resident
            for (int64_t m0 = 0; m0 < rows; m0 += GM_MC) {
                const int64_t mc = rows - m0 < GM_MC ? rows - m0 : GM_MC;
                const int64_t tiles = (mc + GM_MT - 1) / GM_MT;
                const float* xb = xp + (m0 / GM_MT) * k * GM_MT;
                for (int64_t k0 = 0; k0 < k; k0 += GM_KC) {
                    const int64_t kc = k - k0 < GM_KC ? k - k0 : GM_KC;
                    for (int64_t t = 0; t < tiles; ++t) {
                        const float* xt = xb + t * k * GM_MT + k0 * GM_MT;
                        float* at = acc + t * GM_NR * GM_MT;
                        if (mc - t * GM_MT > W) gm_tile<GM_MV>(xt, panel + k0, k, kc, at, k0 == 0);
                        else gm_tile<1>(xt, panel + k0, k, kc, at, k0 == 0);
                    }
                }
                for (int64_t t = 0; t < tiles; ++t) {
                    const int64_t r0 = t * GM_MT, nrows = mc - r0 < GM_MT ? mc - r0 : GM_MT;
                    gm_store_tile(acc + t * GM_NR * GM_MT, nrows, nr, y + (m0 + r0) * ystride + n0, ystride);
                }
            }
        }
        _mm_free(panel);
        _mm_free(acc);
    }
    _mm_free(xp);
}

static int qgemm(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                 float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (rows <= 0 || n <= 0) return 0;
    if (qt == QT_Q4_1) qgemm_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qgemm_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qgemm_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else return -1;
    return 0;
}
