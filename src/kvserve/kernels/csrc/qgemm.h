// Wide exact quantized GEMM (compiled once per ISA, after simd.h and impl.h): y = x @ W.T for many activation
// rows (decode batches from a few rows, prefill chunks) with W in GGUF blocks.
//
// impl.h's qmatmul converts every weight block to floats once per 4 activation rows; at 8+ rows that
// conversion is most of its work, and dequantizing the whole matrix for torch's GEMM streams a float32 copy
// of every weight on every call. Here each panel of NR weight rows is dequantized ONCE per call (per row
// block of GM_MB rows, beyond that), a KC-wide slice at a time into a per-thread L1-resident buffer, and an
// outer-product micro-kernel runs over every activation tile against it: vectors run along the activation
// rows (x is packed transposed, once per call), each dequantized weight is a broadcast, so neither side needs
// a transpose of the weights, and the accumulators never need a horizontal sum.
//
// Tiles are 2 vectors; each lane group of P lanes holds one activation row's products with P consecutive
// inputs, fed by a P-float broadcast of the weights (P = 1, 2, 4: 32, 16 or 8 rows per tile on AVX-512),
// and the P partial sums of a row are added when the tile is stored. A 5-24-row decode batch thus fills
// its lanes (padding 8 rows to a 16-row vector did twice the FMAs, at one broadcast per FMA), and every
// tile keeps the 2-vector shape that leaves the FMA units, not the load ports, as the limit.
// Q4 panels are dequantized through a per-block table of the 16 possible weights (one permute per 16
// weights); each task prefetches the next panel's weights while it computes.
//
// Exact to the dequantized weights up to summation order: the panel holds the same floats as dequantize()
// (d*q then + m, separately rounded; -ffp-contract=off), products accumulate in float32.

#if KV_AVX512
constexpr int GM_NR = 12;  // weight rows (output columns) per panel: 2 x 12 accumulators of 32 registers
#else
constexpr int GM_NR = 6;   // 2 x 6 accumulators of 16 registers
#endif
constexpr int GM_MT = 2 * W;       // lanes of a tile: 2 vectors (32 on AVX-512, 16 on AVX2)
constexpr int64_t GM_KC = 128;     // inputs per slice: the panel is dequantized a slice at a time (12 x 128: 6 KiB, in L1)
// Activation rows per row block (L2: 64 x 1536 floats = 384 KiB): 64 beat 128 and 256 by ~3% at 512-2,048 rows
// (each row block dequantizes every panel again, but the block's packed x stays closer), measured paired.
constexpr int64_t GM_MB = 64;
// The micro-kernel prefetches the packed x this many steps ahead into L1: every tile's x slice is evicted
// by the others' between panels, and the hardware prefetchers alone left ~6% of the FMA rate waiting on L2.
constexpr int64_t GM_PF = 16;
// Packed x per superblock (bytes): each panel is dequantized once per superblock of row blocks, which
// stream past it from L2 (more rows would spill them to L3).
constexpr int64_t GM_SB_BYTES = 1 << 20;

// P consecutive floats broadcast to every P-lane group: a plain load-port broadcast (ss, sd, f32x4).
template <int P>
static inline V vbroadcast_group(const float* p) {
    if (P == 1) return vset1(*p);
#if KV_AVX512
    if (P == 2) {
        double pair;
        __builtin_memcpy(&pair, p, sizeof pair);
        return _mm512_castpd_ps(_mm512_set1_pd(pair));
    }
    return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
#else
    if (P == 2) {
        double pair;
        __builtin_memcpy(&pair, p, sizeof pair);
        return _mm256_castpd_ps(_mm256_set1_pd(pair));
    }
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
#endif
}

// A tile of activation rows: 2 vectors of W lanes; lane v*W + rr*P + p holds row r0 + v*(W/P) + rr's
// products with input i + p, so it holds 2W/P rows (P = 1, 2, 4: 32, 16, 8 rows on AVX-512).
struct GmTile {
    int64_t r0, rows;  // first row, rows used (the rest of the tile is zero padding)
    int p;
    int64_t width() const { return GM_MT / p; }
};

// rows split into tiles: P = 1 while over 3W/2 rows are left, then P = 2 while over W/2 are, then P = 4 (only
// the last tile is partly padding). Returns the count; tiles has room for rows / (W/2) + 2.
static inline int64_t gm_tiles(int64_t rows, GmTile* tiles) {
    int64_t count = 0, r = 0;
    while (r < rows) {
        const int64_t left = rows - r;
        GmTile t{r, 0, left > 3 * W / 2 ? 1 : left > W / 2 ? 2 : 4};
        t.rows = left < t.width() ? left : t.width();
        tiles[count++] = t;
        r += t.rows;
    }
    return count;
}

// panel[j * kc + i] = W[n0 + j][k0 + i] for j < nr (as dequantize() computes it); rows nr..height are zero.
template <int QT>
static inline void gm_dequant_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int nr, int64_t k0,
                                    int64_t kc, float* panel, int height = GM_NR) {
    constexpr int64_t BB = block_bytes(QT);
    for (int j = 0; j < height; ++j) {
        float* dst = panel + j * kc;
        if (j >= nr) {
            for (int64_t i = 0; i < kc; i += W) vstore(dst + i, vzero());
            continue;
        }
        const uint8_t* row = w + (n0 + j) * row_bytes + (k0 / QK) * BB;
        if (QT == QT_BF16) {
            V q[QK / W];
            for (int64_t b = 0; b < kc / QK; ++b) {
                bf16_block(row + b * BB, q);
                for (int i = 0; i < QK / W; ++i) vstore(dst + b * QK + i * W, q[i]);
            }
            continue;
        }
#if KV_AVX512
        {
            // The block scales of 16 blocks at a time: one gather of their first 4 bytes (d, and Q4_1's m), one
            // conversion each, then broadcast from memory per block (load ports, not the shuffle port the
            // vector work needs). Q4: a block's 16 possible weights, lut[q] = d*q + m (Q4_0: d*(q - 8)), rounded
            // as dequantize() rounds them, then one permute per 16 weights (vpermps reads the low 4 bits of each
            // lane: the low nibble as loaded, the high one after a shift) -- instead of convert, multiply, add.
            constexpr int64_t QOFF = QT == QT_Q4_1 ? 4 : 2;
            const V iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                         14, 15), _mm512_set1_epi32(BB));
            alignas(64) float dv[16], mv[16];
            const int64_t nb = kc / QK;
            for (int64_t b0 = 0; b0 < nb; b0 += 16) {
                const int64_t count = nb - b0 < 16 ? nb - b0 : 16;
                const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
                const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, row + b0 * BB, 1);
                _mm512_store_ps(dv, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
                if (QT == QT_Q4_1) _mm512_store_ps(mv, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
                for (int64_t b = 0; b < count; ++b) {
                    const uint8_t* blk = row + (b0 + b) * BB;
                    float* out = dst + (b0 + b) * QK;
                    const V d = vset1(dv[b]);
                    if (QT == QT_Q8_0) {
                        V q[QK / W];
                        q8_0_block(reinterpret_cast<const int8_t*>(blk + QOFF), q);
                        for (int i = 0; i < QK / W; ++i) vstore(out + i * W, vmul(d, q[i]));
                        continue;
                    }
                    const V lut = QT == QT_Q4_1 ? vadd(vmul(d, iota), vset1(mv[b])) : vmul(d, vadd(iota, vset1(-8.0f)));
                    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QOFF)));
                    vstore(out, _mm512_permutexvar_ps(bytes, lut));
                    vstore(out + W, _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut));
                }
            }
            continue;
        }
#endif
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

// acc[j][l] (+)= sum over the tile's kc inputs for lane l of xp * panel row j; xp is the tile's packed block
// ([kc / P][GM_MT]), acc its [NR][GM_MT] accumulator. The weights come as P-input broadcasts (see GmTile).
template <int P>
static inline void gm_tile(const float* xp, const float* panel, int64_t pstride, int64_t kc, float* acc, bool first) {
    V c[2][GM_NR];
    for (int j = 0; j < GM_NR; ++j)
        for (int v = 0; v < 2; ++v) c[v][j] = first ? vzero() : vload(acc + j * GM_MT + v * W);
    for (int64_t i = 0; i < kc; i += P) {
        const V a0 = vload(xp + (i / P) * GM_MT), a1 = vload(xp + (i / P) * GM_MT + W);
        _mm_prefetch(reinterpret_cast<const char*>(xp + (i / P + GM_PF) * GM_MT), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(xp + (i / P + GM_PF) * GM_MT + W), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int j = 0; j < GM_NR; ++j) {
            const V b = vbroadcast_group<P>(panel + j * pstride + i);
            c[0][j] = vfma(a0, b, c[0][j]);
            c[1][j] = vfma(a1, b, c[1][j]);
        }
    }
    for (int j = 0; j < GM_NR; ++j)
        for (int v = 0; v < 2; ++v) vstore(acc + j * GM_MT + v * W, c[v][j]);
}

// A tile's rows of x, packed: xp[i / P][v*W + rr*P + p] = x[r0 + v*(W/P) + rr][i + p] (zero past its rows).
// Whole tiles follow one another: tile t starts at xp + r0 * k. Writes run contiguously.
template <int P>
static inline void gm_pack_tile(const float* x, int64_t k, const GmTile& t, float* xp) {
    float* dst = xp + t.r0 * k;
    const float* src = x + t.r0 * k;
    constexpr int RV = W / P;  // rows per vector
    for (int64_t i = 0; i < k; i += P) {
        float* d = dst + (i / P) * GM_MT;
        for (int v = 0; v < 2; ++v)
            for (int rr = 0; rr < RV; ++rr) {
                const int64_t r = v * RV + rr;
                for (int p = 0; p < P; ++p) d[v * W + rr * P + p] = r < t.rows ? src[r * k + i + p] : 0.0f;
            }
    }
}

static inline void gm_pack_x(const float* x, int64_t k, const GmTile& t, float* xp) {
    if (t.p == 1) gm_pack_tile<1>(x, k, t, xp);
    else if (t.p == 2) gm_pack_tile<2>(x, k, t, xp);
    else gm_pack_tile<4>(x, k, t, xp);
}

// y[r][j] = sum_p acc[j][lane(r) + p] for the tile's rows and the panel's nr columns.
static inline void gm_store_tile(const float* acc, const GmTile& t, int nr, float* y, int64_t ystride) {
    const int64_t rv = W / t.p;
#if KV_AVX512
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(GM_MT));
    const __mmask16 mask = static_cast<__mmask16>((1u << nr) - 1u);
#endif
    for (int64_t r = 0; r < t.rows; ++r) {
        const int64_t lane = (r / rv) * W + (r % rv) * t.p;
        float* yr = y + (t.r0 + r) * ystride;
#if KV_AVX512
        V s = _mm512_mask_i32gather_ps(vzero(), mask, idx, acc + lane, 4);
        for (int p = 1; p < t.p; ++p) s = vadd(s, _mm512_mask_i32gather_ps(vzero(), mask, idx, acc + lane + p, 4));
        _mm512_mask_storeu_ps(yr, mask, s);
#else
        for (int j = 0; j < nr; ++j) {
            float s = acc[j * GM_MT + lane];
            for (int p = 1; p < t.p; ++p) s += acc[j * GM_MT + lane + p];
            yr[j] = s;
        }
#endif
    }
}

static inline void gm_run_tile(const GmTile& t, const float* xt, const float* panel, int64_t pstride, int64_t kc,
                               float* acc, bool first) {
    if (t.p == 1) gm_tile<1>(xt, panel, pstride, kc, acc, first);
    else if (t.p == 2) gm_tile<2>(xt, panel, pstride, kc, acc, first);
    else gm_tile<4>(xt, panel, pstride, kc, acc, first);
}

// Two barriers per call whatever the row count (on a busy machine each one can wait out a descheduled peer):
// every tile of x is packed, then each thread takes (row block, panel) tasks: it dequantizes the panel
// one KC slice at a time into an L1-resident buffer and runs every tile of the row block against the slice
// (the tiles' accumulators live in a small per-thread buffer between slices).
template <int QT>
static void qgemm_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                    float* y, int64_t ystride) {
    const int64_t npanels = (n + GM_NR - 1) / GM_NR;
    ScratchScope scope;  // scratch.h
    GmTile* tiles = scope.take<GmTile>(rows / (W / 2) + 2);
    const int64_t ntiles = gm_tiles(rows, tiles);
    const int64_t padded = tiles[ntiles - 1].r0 + tiles[ntiles - 1].width();
    float* xp = scope.take<float>(padded * k);
    constexpr int64_t MAX_BLOCK_TILES = GM_MB / (W / 2) + 2;
    // Row blocks of up to GM_MB rows (whole tiles): each task is one panel against one row block, so the block's
    // packed x (GM_MB x k floats) stays in the core's L2 while the panels stream past it; a panel is dequantized
    // once per row block (once per call up to GM_MB rows: a decode batch).
    int64_t* block_tiles = scope.take<int64_t>(ntiles + 1);
    int64_t nblocks = 0;
    for (int64_t t = 0; t < ntiles; ++t)
        if (t == 0 || tiles[t].r0 + tiles[t].width() - tiles[block_tiles[nblocks - 1]].r0 > GM_MB) block_tiles[nblocks++] = t;
    block_tiles[nblocks] = ntiles;
    // Superblocks of GM_SB / GM_MB row blocks: a task is one panel against a superblock, the panel dequantized
    // once per task (kept, slice by slice, in a per-thread buffer of NR x k floats) and reused by its blocks.
    const int64_t sb_rows = GM_SB_BYTES / (k * static_cast<int64_t>(sizeof(float)));
    // Superblocks of equal size (8 blocks that fit 7 split 4 + 4, not 7 + 1): the static schedule deals the
    // tasks out in order, so unequal superblocks gave one thread most of the work (512 rows ran at ~0.75x).
    const int64_t SB_MAX = sb_rows >= 2 * GM_MB ? sb_rows / GM_MB : 1;
    const int64_t nsuper = (nblocks + SB_MAX - 1) / SB_MAX, nslices = (k + GM_KC - 1) / GM_KC;
    const int64_t SB = (nblocks + nsuper - 1) / nsuper;
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // this thread's
        float* panel = own.take<float>(nslices * GM_NR * GM_KC);
        float* acc = own.take<float>(MAX_BLOCK_TILES * GM_NR * GM_MT);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; ++t) gm_pack_x(x, k, tiles[t], xp);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < nsuper * npanels; ++task) {
            const int64_t p = task % npanels, b0 = (task / npanels) * SB;
            const int64_t b1 = b0 + SB < nblocks ? b0 + SB : nblocks;
            const int64_t n0 = p * GM_NR;
            const int nr = static_cast<int>(n - n0 < GM_NR ? n - n0 : GM_NR);
            // The next panel's weights (contiguous rows), prefetched a share per KC slice (impl.h's
            // prefetch_span: the hardware prefetchers alone leave the dequantization waiting on them).
            const int64_t next_end = n0 + 2 * GM_NR < n ? n0 + 2 * GM_NR : n;
            const int64_t next_bytes = next_end > n0 + GM_NR ? (next_end - n0 - GM_NR) * row_bytes : 0;
            const int64_t share = (next_bytes / nslices + 63) / 64 * 64;
            const uint8_t* next = w + (n0 + GM_NR) * row_bytes;
            for (int64_t b = b0; b < b1; ++b) {
                const int64_t first = block_tiles[b], last = block_tiles[b + 1];
                for (int64_t k0 = 0; k0 < k; k0 += GM_KC) {
                    const int64_t kc = k - k0 < GM_KC ? k - k0 : GM_KC;
                    float* slice = panel + (k0 / GM_KC) * GM_NR * GM_KC;  // [NR][kc]
                    if (b == b0) {  // the first block dequantizes each slice just before it uses it (L1)
                        gm_dequant_panel<QT>(w, row_bytes, n0, nr, k0, kc, slice);
                        const int64_t from = (k0 / GM_KC) * share;
                        if (from < next_bytes)
                            prefetch_span(next + from, next_bytes - from < share ? next_bytes - from : share);
                    }
                    for (int64_t t = first; t < last; ++t) {
                        const GmTile& tile = tiles[t];
                        const float* xt = xp + tile.r0 * k + k0 * tile.width();  // = (k0 / P) * GM_MT
                        gm_run_tile(tile, xt, slice, kc, kc, acc + (t - first) * GM_NR * GM_MT, k0 == 0);
                    }
                }
                for (int64_t t = first; t < last; ++t)
                    gm_store_tile(acc + (t - first) * GM_NR * GM_MT, tiles[t], nr, y + n0, ystride);
            }
        }
    }
}

#if KV_AVX512
#include "qgemm_amx.h"
#else
#include "qgemm_wide.h"
#endif

static int qgemm(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                 float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (rows <= 0 || n <= 0) return 0;
#if KV_AVX512
    if (amx_exact_pays(qt, rows)) {  // AMX-BF16 tiles where the CPU has them (qgemm_amx.h): the same contract
        qgemm_amx(qt, x, rows, k, w, n, row_bytes, y, ystride);
        return 0;
    }
#endif
#if !KV_AVX512
    if (rows >= kv_wide_rows()) {  // weights as the vector side (qgemm_wide.h, from 48 rows): the same contract
        qgemm_wide(qt, x, rows, k, w, n, row_bytes, y, ystride);
        return 0;
    }
#endif
    if (qt == QT_Q4_1) qgemm_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qgemm_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qgemm_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_BF16) qgemm_t<QT_BF16>(x, rows, k, w, n, row_bytes, y, ystride);
    else return -1;
    return 0;
}
