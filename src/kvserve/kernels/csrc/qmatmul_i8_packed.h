// Int8-path weights pre-arranged once, at model load, for the VNNI and AVX2 kernels (included by qmatmul_i8.h
// inside each ISA namespace). The GGUF-layout kernel (qmatmul_i8_interleaved) gathers 16 weight rows into the
// vpdpbusd layout on every call -- 5 (Q4) or 9 (Q8_0) gathers per 16 columns x 32 weights, per call, per row
// pass, per decode step. This layout stores exactly what it builds, so a call only loads:
//
//   groups of 16 output columns, each group's blocks contiguous: [ceil(n/16)][k/32][PACKED_BYTES(qt)], where
//   one (group, block) holds the quants as 4-byte pieces, piece j of column c at j*64 + c*4 (Q4: 4 pieces of
//   packed nibbles, unpacked in registers with and/shift; Q8_0: 8 pieces of int8), then the 16 fp16 scales d,
//   then Q4_1's 16 fp16 m, or Q8_0's 16 int16 sum(qw) (its bias correction, 128 * sum, is a shift away).
//   Columns past n (the last group's) are zero.
//
// A packed weight goes by its GGUF type id | QT_I8_PACKED, which no other kernel accepts (qmatmul, qgemm,
// dequantize and the GGUF-layout int8 kernels return -1): one layout can never be read as the other. Sizes
// equal the GGUF blocks for Q4_0 (288 = 16 x 18) and Q4_1 (320 = 16 x 20); Q8_0 is 576 = 16 x 36 (2 bytes more
// a block). Each output is computed with the GGUF-layout AVX-512 kernel's float operations in its order -- per
// block, acc = fma(dw * dx, isum, acc) then fma(mw, s, acc) -- so results are bit-identical to it; the AVX2
// tile does the same operations, so it gives those bits too.

constexpr int QT_I8_PACKED = 0x100;
constexpr int64_t PACKED_COLS = 16;

static inline bool i8_packable(int qt) { return qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0; }
static constexpr int64_t packed_quant_bytes(int qt) { return qt == QT_Q8_0 ? 512 : 256; }
static constexpr int64_t packed_block_bytes(int qt) { return qt == QT_Q4_0 ? 288 : qt == QT_Q4_1 ? 320 : 576; }
static inline int64_t packed_groups(int64_t n) { return (n + PACKED_COLS - 1) / PACKED_COLS; }

// out: packed_groups(n) * (k / 32) * packed_block_bytes(qt) bytes from the GGUF rows w [n, row_bytes].
static int pack_i8(int qt, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t k, uint8_t* out) {
    if (!i8_packable(qt)) return -1;
    if (k % QK != 0 || k <= 0 || n <= 0 || row_bytes != k / QK * block_bytes(qt)) return -2;
    const int64_t nb = k / QK, bb = block_bytes(qt), pb = packed_block_bytes(qt), qbytes = packed_quant_bytes(qt);
    const int64_t qoff = qt == QT_Q4_1 ? 4 : 2, pieces = qbytes / 64, groups = packed_groups(n);
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t g = 0; g < groups; ++g) {
        __builtin_memset(out + g * nb * pb, 0, nb * pb);
        for (int64_t c = 0; c < PACKED_COLS && g * PACKED_COLS + c < n; ++c) {
            const uint8_t* row = w + (g * PACKED_COLS + c) * row_bytes;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = row + b * bb;
                uint8_t* o = out + (g * nb + b) * pb;
                for (int64_t j = 0; j < pieces; ++j) __builtin_memcpy(o + j * 64 + c * 4, blk + qoff + 4 * j, 4);
                __builtin_memcpy(o + qbytes + c * 2, blk, 2);  // d
                if (qt == QT_Q4_1) __builtin_memcpy(o + qbytes + 32 + c * 2, blk + 2, 2);  // m
                if (qt == QT_Q8_0) {
                    int sum = 0;
                    for (int j = 0; j < QK; ++j) sum += static_cast<int8_t>(blk[qoff + j]);
                    const int16_t s16 = static_cast<int16_t>(sum);  // |sum| <= 32 * 128
                    __builtin_memcpy(o + qbytes + 32 + c * 2, &s16, 2);
                }
            }
        }
    }
    return 0;
}

#if KV_AVX512
// out[r * ystride + g * 16 + c] for R activation rows x NG column groups (pw: the first group's blocks,
// gstride bytes apart). Each broadcast activation piece feeds NG vpdpbusd; the weight scales are loaded and
// converted once per block per tile. last: columns of the last group to store. pf (optional): the next
// NG * gstride weight bytes, prefetched a block's share per block (impl.h's prefetch_span).
template <int R, int NG, int QT>
static inline void packed_tile(const Q8Rows& x, int64_t k, int64_t nb, const uint8_t* pw, int64_t gstride, float* y,
                               int64_t ystride, int64_t last, const uint8_t* pf) {
    constexpr int64_t PB = packed_block_bytes(QT), QB = packed_quant_bytes(QT);
    __m512 acc[R][NG];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q) + b * QK;
        const uint8_t* wb = pw + b * PB;
        if (pf) prefetch_span(pf + b * NG * PB, NG * PB);
        __m512i isum[R][NG];
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < NG; ++g) isum[r][g] = _mm512_setzero_si512();
        if (QT == QT_Q8_0) {
            for (int j = 0; j < 8; ++j) {
                __m512i wq[NG];
                for (int g = 0; g < NG; ++g) wq[g] = _mm512_loadu_si512(wb + g * gstride + j * 64);
                for (int r = 0; r < R; ++r) {
                    const __m512i xv =
                        _mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(load_u32(xb + r * k + 4 * j))), bias);
                    for (int g = 0; g < NG; ++g) isum[r][g] = _mm512_dpbusd_epi32(isum[r][g], xv, wq[g]);
                }
            }
        } else {
            for (int t = 0; t < 4; ++t) {
                __m512i lo[NG], hi[NG];
                for (int g = 0; g < NG; ++g) {
                    const __m512i raw = _mm512_loadu_si512(wb + g * gstride + t * 64);
                    lo[g] = _mm512_and_si512(raw, nibble);                      // weights 4t .. 4t+3
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);  // weights 16+4t ..
                }
                for (int r = 0; r < R; ++r) {
                    const __m512i xl = _mm512_set1_epi32(static_cast<int>(load_u32(xb + r * k + 4 * t)));
                    const __m512i xh = _mm512_set1_epi32(static_cast<int>(load_u32(xb + r * k + 16 + 4 * t)));
                    for (int g = 0; g < NG; ++g) {
                        isum[r][g] = _mm512_dpbusd_epi32(isum[r][g], lo[g], xl);
                        isum[r][g] = _mm512_dpbusd_epi32(isum[r][g], hi[g], xh);
                    }
                }
            }
        }
        for (int g = 0; g < NG; ++g) {
            const uint8_t* sc = wb + g * gstride + QB;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
            const __m256i extra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32));
            const __m512 mw = QT == QT_Q4_1   ? _mm512_cvtph_ps(extra)
                              : QT == QT_Q4_0 ? _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f))
                                              : _mm512_setzero_ps();
            const __m512i corr = _mm512_slli_epi32(_mm512_cvtepi16_epi32(extra), 7);  // Q8_0: 128 * sum(qw)
            for (int r = 0; r < R; ++r) {
                __m512i is = isum[r][g];
                if (QT == QT_Q8_0) is = _mm512_sub_epi32(is, corr);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r * nb + b]));
                acc[r][g] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(is), acc[r][g]);
                if (QT != QT_Q8_0) acc[r][g] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[r * nb + b]), acc[r][g]);
            }
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __mmask16 keep = g == NG - 1 ? static_cast<__mmask16>((1u << last) - 1u) : static_cast<__mmask16>(0xFFFF);
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ystride + g * PACKED_COLS, keep, acc[r][g]);
    }
}
#else
// AVX2: the same layout read as 8-column halves (bytes [0, 32) of a 64-byte piece row are columns 0..7, [32, 64)
// columns 8..15), one broadcast activation piece per maddubs. Q4: nibble x int8 pairs are at most 2 * 15 * 127,
// so a block's 8 pieces add up in int16 (<= 30,480) and one madd widens them; Q8_0: |qw| x (qx with qw's sign),
// at most 2 * 128 * 127 a pair, widened per piece. Either way each column's block sum is the exact integer the
// VNNI kernel forms, and the float epilogue is the AVX-512 tile's, operation for operation, per column and
// block: the AVX2 and AVX-512 int8 paths give the same bits. The GGUF-layout AVX2 kernel (qmatmul_i8.h) summed
// 8 lanes of partial dots per block instead: ~3.5 vector ops per 8 weights against ~1 here.
template <int R, int NG, int QT>
static inline void packed_tile(const Q8Rows& x, int64_t k, int64_t nb, const uint8_t* pw, int64_t gstride, float* y,
                               int64_t ystride, int64_t last, const uint8_t* pf) {
    constexpr int64_t PB = packed_block_bytes(QT), QB = packed_quant_bytes(QT);
    constexpr int NH = 2 * NG;  // 8-column halves
    __m256 acc[R][NH];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q) + b * QK;
        const uint8_t* wb = pw + b * PB;
        if (pf) prefetch_span(pf + b * NG * PB, NG * PB);
        __m256i isum[R][NH];
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < NH; ++h) isum[r][h] = _mm256_setzero_si256();
        if (QT == QT_Q8_0) {
            for (int j = 0; j < 8; ++j) {
                __m256i wq[NH], wu[NH];
                for (int h = 0; h < NH; ++h) {
                    wq[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (h >> 1) * gstride + j * 64 +
                                                                                 (h & 1) * 32));
                    wu[h] = _mm256_abs_epi8(wq[h]);
                }
                for (int r = 0; r < R; ++r) {
                    const __m256i xv = _mm256_set1_epi32(static_cast<int>(load_u32(xb + r * k + 4 * j)));
                    for (int h = 0; h < NH; ++h)
                        isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wu[h], _mm256_sign_epi8(xv, wq[h])), ones));
                }
            }
        } else {
            for (int t = 0; t < 4; ++t) {
                __m256i lo[NH], hi[NH];
                for (int h = 0; h < NH; ++h) {
                    const __m256i raw = _mm256_loadu_si256(
                        reinterpret_cast<const __m256i*>(wb + (h >> 1) * gstride + t * 64 + (h & 1) * 32));
                    lo[h] = _mm256_and_si256(raw, nibble);                      // weights 4t .. 4t+3
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);  // weights 16+4t ..
                }
                for (int r = 0; r < R; ++r) {
                    const __m256i xl = _mm256_set1_epi32(static_cast<int>(load_u32(xb + r * k + 4 * t)));
                    const __m256i xh = _mm256_set1_epi32(static_cast<int>(load_u32(xb + r * k + 16 + 4 * t)));
                    for (int h = 0; h < NH; ++h) {
                        isum[r][h] = _mm256_add_epi16(isum[r][h], _mm256_maddubs_epi16(lo[h], xl));
                        isum[r][h] = _mm256_add_epi16(isum[r][h], _mm256_maddubs_epi16(hi[h], xh));
                    }
                }
            }
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < NH; ++h) isum[r][h] = _mm256_madd_epi16(isum[r][h], ones);
        }
        for (int h = 0; h < NH; ++h) {
            const uint8_t* sc = wb + (h >> 1) * gstride + QB + (h & 1) * 16;
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
            const __m128i extra = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32));  // Q4_1: m
            const __m256 mw = QT == QT_Q4_1   ? _mm256_cvtph_ps(extra)
                              : QT == QT_Q4_0 ? _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f))
                                              : _mm256_setzero_ps();
            for (int r = 0; r < R; ++r) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * nb + b]));
                acc[r][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[r][h]), acc[r][h]);
                if (QT != QT_Q8_0) acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[r * nb + b]), acc[r][h]);
            }
        }
    }
    for (int h = 0; h < NH; ++h) {
        const int64_t cols = h < NH - 2 ? 8 : h == NH - 2 ? (last < 8 ? last : 8) : (last > 8 ? last - 8 : 0);
        for (int r = 0; r < R; ++r) {
            float* out = y + r * ystride + h * 8;
            if (cols == 8) {
                _mm256_storeu_ps(out, acc[r][h]);
            } else if (cols > 0) {
                float tmp[8];
                _mm256_storeu_ps(tmp, acc[r][h]);
                for (int64_t c = 0; c < cols; ++c) out[c] = tmp[c];
            }
        }
    }
}
#endif  // KV_AVX512

// Row tiles: KV_I8P_ROWS2 rows x 2 groups (24 accumulators: 12 float, 12 int32 of the block), or
// KV_I8P_ROWS1 rows x 1 group; the remainder in one narrower tile. Measured (1 thread, Ice Lake, real shapes,
// benchmarks/int8_packed.py): 6 x 2 ran ~5% faster than 4 x 2 and 12-20% faster than 4 x 3 or 8 x 1 at 32-512
// rows; 5 and 7 rows ran no faster. AVX2 (16 registers; the default model's layer shapes, Zen 3, 2 threads,
// every shape in the same rounds, the same bits): Q4 4 x 2 took 0.80 / 1.44 / 5.42 ms per layer at 16 / 32 /
// 128 rows against 0.96 / 1.72 / 6.20 for 2 x 2 (3 x 2 within 2% of 4 x 2); Q8_0, whose block needs the weights
// and their magnitudes in registers, stays at 2 x 2 (3 or 4 rows: 4-14% slower at 16-128). The -D overrides
// exist for such measurements only.
#ifndef KV_I8P_ROWS1
#define KV_I8P_ROWS1 (KV_AVX512 ? 8 : 4)
#endif
#ifndef KV_I8P_ROWS2
#define KV_I8P_ROWS2 (KV_AVX512 ? 6 : 4)
#endif
#ifndef KV_I8P_ROWS2_Q8
#define KV_I8P_ROWS2_Q8 (KV_AVX512 ? 6 : 2)
#endif
template <int NG, int QT>
struct PackedTileRows {
    static constexpr int value = NG == 1 ? KV_I8P_ROWS1 : QT == QT_Q8_0 ? KV_I8P_ROWS2_Q8 : KV_I8P_ROWS2;
};

template <int R, int NG, int QT>
static inline void packed_rest(const Q8Rows& x, int64_t rows, int64_t k, int64_t nb, const uint8_t* pw,
                               int64_t gstride, float* y, int64_t ystride, int64_t last, const uint8_t* pf) {
    if constexpr (R > 0) {
        if (rows == R) packed_tile<R, NG, QT>(x, k, nb, pw, gstride, y, ystride, last, pf);
        else packed_rest<R - 1, NG, QT>(x, rows, k, nb, pw, gstride, y, ystride, last, pf);
    }
}

// pf: as packed_tile's, requested during the first row tile only.
template <int NG, int QT>
static void packed_rows(const Q8Rows& x, int64_t rows, int64_t k, int64_t nb, const uint8_t* pw, int64_t gstride,
                        float* y, int64_t ystride, int64_t last, const uint8_t* pf) {
    constexpr int RT = PackedTileRows<NG, QT>::value;
    int64_t r0 = 0;
    for (; r0 + RT <= rows; r0 += RT, pf = nullptr)
        packed_tile<RT, NG, QT>(i8_offset(x, r0, k, nb), k, nb, pw, gstride, y + r0 * ystride, ystride, last, pf);
    packed_rest<RT - 1, NG, QT>(i8_offset(x, r0, k, nb), rows - r0, k, nb, pw, gstride, y + r0 * ystride, ystride,
                                last, pf);
}

#if KV_AVX512
#include "qmatmul_amx.h"
#endif

// The packed weight's groups [g, g + ng) if they exist, else null: what a tile prefetches ahead.
static inline const uint8_t* packed_ahead(const uint8_t* pw, int64_t n, int64_t gstride, int64_t g, int64_t ng) {
    return g + ng <= packed_groups(n) ? pw + g * gstride : nullptr;
}

// Groups [g0, g1) of the packed weight for `rows` quantized rows: two groups per tile, then one; each tile
// prefetches the groups after its own (the next task's, at the end of a task).
template <int QT>
static inline void packed_groups_run(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* pw, int64_t n,
                                     int64_t gstride, float* y, int64_t ystride, int64_t g0, int64_t g1) {
#if KV_AVX512
    if (amx_pays<QT>(rows)) {  // tiles where the CPU has them and they are faster (qmatmul_amx.h): bit-identical
        amx_groups_run<QT>(x, rows, k, pw, n, gstride, y, ystride, g0, g1);
        return;
    }
#endif
    const int64_t nb = k / QK;
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) {
        const int64_t last = n - (g + 1) * PACKED_COLS < PACKED_COLS ? n - (g + 1) * PACKED_COLS : PACKED_COLS;
        packed_rows<2, QT>(x, rows, k, nb, pw + g * gstride, gstride, y + g * PACKED_COLS, ystride, last,
                           packed_ahead(pw, n, gstride, g + 2, 2));
    }
    if (g < g1) {
        const int64_t last = n - g * PACKED_COLS < PACKED_COLS ? n - g * PACKED_COLS : PACKED_COLS;
        packed_rows<1, QT>(x, rows, k, nb, pw + g * gstride, gstride, y + g * PACKED_COLS, ystride, last,
                           packed_ahead(pw, n, gstride, g + 1, 1));
    }
}

template <int QT>
static void qmatmul_i8_packed_t(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* pw, int64_t n,
                                int64_t gstride, float* y, int64_t ystride) {
    constexpr int64_t TASK_GROUPS = 2;  // 32 output columns per task
    const int64_t nb = k / QK, groups = packed_groups(n), tasks = (groups + TASK_GROUPS - 1) / TASK_GROUPS;
    const int64_t pass = i8_pass_rows(rows, k + 2 * nb * 4);  // q, d, s
#pragma omp parallel num_threads(kv_threads())
    for (int64_t p0 = 0; p0 < rows; p0 += pass) {  // row passes (see i8_pass_rows)
        const int64_t np = p0 + pass < rows ? pass : rows - p0;
        const Q8Rows xp = i8_offset(x, p0, k, nb);
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tasks; ++t) {  // static: every pass gives a thread the same groups
            const int64_t g0 = t * TASK_GROUPS, g1 = g0 + TASK_GROUPS < groups ? g0 + TASK_GROUPS : groups;
            packed_groups_run<QT>(xp, np, k, pw, n, gstride, y + p0 * ystride, ystride, g0, g1);
        }
    }
}

static int qmatmul_i8_packed(int qt, const Q8Rows& xq, int64_t rows, int64_t k, const uint8_t* pw, int64_t n,
                             int64_t gstride, float* y, int64_t ystride) {
    if (qt == QT_Q4_1) qmatmul_i8_packed_t<QT_Q4_1>(xq, rows, k, pw, n, gstride, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_i8_packed_t<QT_Q4_0>(xq, rows, k, pw, n, gstride, y, ystride);
    else qmatmul_i8_packed_t<QT_Q8_0>(xq, rows, k, pw, n, gstride, y, ystride);
    return 0;
}

// Output columns [c0, c1) of decode_step.h's int8 phases for a packed weight. Whole groups are computed in
// place; a group [c0, c1) only partly covers (gate_up's second half when the intermediate size is no multiple
// of 16) goes through a small buffer, so a task never writes another task's columns.
template <int QT>
static inline void packed_cols_t(const Q8Rows& xq, int64_t rows, int64_t k, const uint8_t* pw, int64_t n,
                                 int64_t gstride, float* y, int64_t ystride, int64_t c0, int64_t c1) {
    const int64_t nb = k / QK;
    int64_t g = c0 / PACKED_COLS;
    for (; g * PACKED_COLS < c1; ++g) {
        const int64_t lo = g * PACKED_COLS, hi = lo + PACKED_COLS < n ? lo + PACKED_COLS : n;
        if (lo >= c0 && hi <= c1) {
            packed_groups_run<QT>(xq, rows, k, pw, n, gstride, y, ystride, g, g + 1);
            continue;
        }
        constexpr int64_t TR = 8;
        float tmp[TR * PACKED_COLS];
        for (int64_t r0 = 0; r0 < rows; r0 += TR) {
            const int64_t nr = rows - r0 < TR ? rows - r0 : TR;
            packed_rows<1, QT>(i8_offset(xq, r0, k, nb), nr, k, nb, pw + g * gstride, gstride, tmp, PACKED_COLS,
                               hi - lo, nullptr);
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t c = lo > c0 ? lo : c0; c < (hi < c1 ? hi : c1); ++c)
                    y[(r0 + r) * ystride + c] = tmp[r * PACKED_COLS + c - lo];
        }
    }
}

static inline void qmatmul_i8_packed_cols(int qt, const Q8Rows& xq, int64_t rows, int64_t k, const uint8_t* pw,
                                          int64_t n, int64_t gstride, float* y, int64_t ystride, int64_t c0,
                                          int64_t c1) {
    if (qt == QT_Q4_1) packed_cols_t<QT_Q4_1>(xq, rows, k, pw, n, gstride, y, ystride, c0, c1);
    else if (qt == QT_Q4_0) packed_cols_t<QT_Q4_0>(xq, rows, k, pw, n, gstride, y, ystride, c0, c1);
    else packed_cols_t<QT_Q8_0>(xq, rows, k, pw, n, gstride, y, ystride, c0, c1);
}
