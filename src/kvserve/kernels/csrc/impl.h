// Kernel bodies, compiled once per ISA (see simd.h). Everything here is static: each namespace gets its own copy.

// ggml type ids. BF16 is not a quantization: dense bf16 weights, read as runs of 32 (64 bytes, no scale)
// through the same kernels, so a CPU without native bf16 arithmetic stores bf16 and computes in fp32.
enum : int { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_BF16 = 30 };
constexpr int QK = 32;                                // weights per quantization block

static constexpr int64_t block_bytes(int qt) {
    return qt == QT_Q4_0 ? 18 : qt == QT_Q4_1 ? 20 : qt == QT_BF16 ? 64 : 34;
}
static inline bool float_path_type(int qt) { return qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0 || qt == QT_BF16; }

// Software prefetch of [p, p + bytes) into cache. The matmuls stream each weight byte once per call; the
// hardware prefetchers alone leave the cores waiting on memory for as long as they compute (a decode step
// with cache-resident weights runs ~2x faster), so each task prefetches the next task's weight panel,
// spread over its own blocks: while block b of a tile is computed, the same share of the panel ahead loads.
static inline void prefetch_span(const uint8_t* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// A block scale (fp16) as a float, through the library's table (kernels.cpp): a load, where F16C's convert
// and broadcast cost three or four shuffle-port uops per block and column.
static inline float half_at(const uint8_t* p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return kv_half_table()[h];
}

// A Q4 block's 32 weights as floats, fma(q, d, m) each. AVX-512: the block's 16 possible values are computed
// once and the nibbles pick from them (vpermps reads only an index's low 4 bits, so the low nibbles need no
// mask): 5 vector ops per block instead of 7.
static inline void q4_dequant(const uint8_t* qs, V dv, V mv, V* q) {
#if KV_AVX512
    const V table = vfma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), dv, mv);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    q[0] = _mm512_permutexvar_ps(bytes, table);                         // weights 0..15: low nibbles
    q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // weights 16..31: high nibbles
#else
    q4_1_block(qs, q);
    for (int i = 0; i < QK / W; ++i) q[i] = vfma(q[i], dv, mv);
#endif
}

// out[r * ostride + c] = dot(x row r, weight row c) for R activation rows x NC weight rows (columns of the
// output). Q4_1 / Q4_0 blocks are dequantized in registers once, w = fma(q, d, m) (Q4_0: m = -8d, exactly
// d*(q-8)), and used by all R rows; Q8_0 dots the integer quants first and scales the block's dot by d.
// Two accumulators per (row, column) keep enough FMA chains in flight; every row's arithmetic is the same
// whatever R and NC, so a row's result does not depend on the batch around it.
// pf (optional): NC * row_bytes bytes of weights ahead, prefetched NC blocks' worth per block.
template <int R, int NC, int QT>
static inline void dot_tile(const float* x, int64_t xstride, int64_t nb, const uint8_t* w, int64_t row_bytes,
                            float* out, int64_t ostride, const uint8_t* pf = nullptr) {
    constexpr int64_t BB = block_bytes(QT);
    constexpr int NV = QK / W;
    V acc[R][NC][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c][0] = acc[r][c][1] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
        if (pf) prefetch_span(pf + b * NC * BB, NC * BB);
        for (int c = 0; c < NC; ++c) {
            const uint8_t* blk = w + c * row_bytes + b * BB;
            V q[NV];
            if (QT == QT_Q8_0) {
                const V dv = vset1(half_at(blk));
                q8_0_block(reinterpret_cast<const int8_t*>(blk + 2), q);
                for (int r = 0; r < R; ++r) {
                    const float* xr = x + r * xstride + b * QK;
                    V t = vmul(vload(xr), q[0]);
                    for (int i = 1; i < NV; ++i) t = vfma(vload(xr + i * W), q[i], t);
                    acc[r][c][b & 1] = vfma(dv, t, acc[r][c][b & 1]);
                }
                continue;
            }
            if (QT == QT_BF16) {
                bf16_block(blk, q);  // the weights themselves: no scale
            } else {
                const V dv = vset1(half_at(blk));
                const V mv = QT == QT_Q4_1 ? vset1(half_at(blk + 2)) : vmul(dv, vset1(-8.0f));
                q4_dequant(blk + (QT == QT_Q4_1 ? 4 : 2), dv, mv, q);
            }
            for (int r = 0; r < R; ++r) {
                const float* xr = x + r * xstride + b * QK;
                for (int i = 0; i < NV; ++i) acc[r][c][i & 1] = vfma(vload(xr + i * W), q[i], acc[r][c][i & 1]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * ostride + c] = vsum(vadd(acc[r][c][0], acc[r][c][1]));
}

// Columns [c0, c1); ahead > 0: each tile prefetches the weights `ahead` columns further on (the next task's).
// Column tiles as wide as the registers allow (AVX2 has 16: one column for 3-4 rows).
template <int R, int QT>
static inline void dot_cols(const float* x, int64_t k, int64_t nb, const uint8_t* w, int64_t row_bytes, float* y,
                            int64_t ystride, int64_t c0, int64_t c1, int64_t ahead) {
    constexpr int NC = R == 1 ? 4 : (W == 8 && R > 2) ? 1 : 2;
    int64_t col = c0;
    for (; col + NC <= c1; col += NC)
        dot_tile<R, NC, QT>(x, k, nb, w + col * row_bytes, row_bytes, y + col, ystride,
                            ahead ? w + (col + ahead) * row_bytes : nullptr);
    for (; col < c1; ++col) dot_tile<R, 1, QT>(x, k, nb, w + col * row_bytes, row_bytes, y + col, ystride);
}

constexpr int64_t QMATMUL_CHUNK = 16;  // output columns per task: their weights stay in L1 across row tiles

// Output columns [c0, c1) of every row: one task of qmatmul (and of decode_step.h's phases).
template <int QT>
static void qmatmul_chunk(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                          float* y, int64_t ystride, int64_t c0, int64_t c1) {
    const int64_t nb = k / QK;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t left = rows - r0;
        const float* xr = x + r0 * k;
        float* yr = y + r0 * ystride;
        // The first row tile prefetches the next chunk (the weights are then cache-hot for the rest);
        // never past the matrix's last column.
        const int64_t ahead = r0 == 0 && c1 + QMATMUL_CHUNK <= n ? QMATMUL_CHUNK : 0;
        if (left >= 4) dot_cols<4, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
        else if (left == 3) dot_cols<3, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
        else if (left == 2) dot_cols<2, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
        else dot_cols<1, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
    }
}

static inline void qmatmul_cols(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                                int64_t row_bytes, float* y, int64_t ystride, int64_t c0, int64_t c1) {
    if (qt == QT_Q4_1) qmatmul_chunk<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride, c0, c1);
    else if (qt == QT_Q4_0) qmatmul_chunk<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride, c0, c1);
    else if (qt == QT_BF16) qmatmul_chunk<QT_BF16>(x, rows, k, w, n, row_bytes, y, ystride, c0, c1);
    else qmatmul_chunk<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride, c0, c1);
}

template <int QT>
static void qmatmul_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                      float* y, int64_t ystride) {
    const int64_t nchunks = (n + QMATMUL_CHUNK - 1) / QMATMUL_CHUNK;
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t c0 = c * QMATMUL_CHUNK, c1 = c0 + QMATMUL_CHUNK < n ? c0 + QMATMUL_CHUNK : n;
        qmatmul_chunk<QT>(x, rows, k, w, n, row_bytes, y, ystride, c0, c1);
    }
}

static int qmatmul(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                   float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (qt == QT_Q4_1) qmatmul_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qmatmul_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_BF16) qmatmul_t<QT_BF16>(x, rows, k, w, n, row_bytes, y, ystride);
    else return -1;
    return 0;
}

// Rows of a quantized matrix as float32, computed exactly as gguf's numpy dequantizer does (d*q + m with
// separate roundings; built with -ffp-contract=off). ids (optional) selects rows, e.g. an embedding lookup.
static int dequantize(int qt, const uint8_t* w, int64_t row_bytes, int64_t k, const int64_t* ids, int64_t nrows,
                      float* out) {
    if (k % QK != 0) return -2;
    if (!float_path_type(qt)) return -1;
    const int64_t nb = k / QK, bb = block_bytes(qt);
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* src = w + (ids ? ids[r] : r) * row_bytes;
        float* dst = out + r * k;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = src + b * bb;
            V q[QK / W];
            if (qt == QT_BF16) {
                bf16_block(blk, q);
                for (int i = 0; i < QK / W; ++i) vstore(dst + b * QK + i * W, q[i]);
                continue;
            }
            const float d = half_to_float(blk);
            if (qt == QT_Q8_0) {
                q8_0_block(reinterpret_cast<const int8_t*>(blk + 2), q);
                for (int i = 0; i < QK / W; ++i) vstore(dst + b * QK + i * W, vmul(vset1(d), q[i]));
            } else if (qt == QT_Q4_1) {
                q4_1_block(blk + 4, q);
                const V m = vset1(half_to_float(blk + 2));
                for (int i = 0; i < QK / W; ++i) vstore(dst + b * QK + i * W, vadd(vmul(vset1(d), q[i]), m));
            } else {
                q4_1_block(blk + 2, q);
                for (int i = 0; i < QK / W; ++i)
                    vstore(dst + b * QK + i * W, vmul(vset1(d), vadd(q[i], vset1(-8.0f))));
            }
        }
    }
    return 0;
}

// One row's statistics: xr += rr (when given), then 1 / sqrt(mean(xr^2) + eps); element e of the normed row is
// rms_norm_at(xr, weight, inv, e).
static inline float rms_norm_inverse(float* xr, const float* rr, int64_t n, float eps) {
    V ss = vzero();
    for (int64_t e = 0; e < n; e += W) {
        V v = vload(xr + e);
        if (rr) { v = vadd(v, vload(rr + e)); vstore(xr + e, v); }
        ss = vfma(v, v, ss);
    }
    return 1.0f / __builtin_sqrtf(vsum(ss) / static_cast<float>(n) + eps);
}
static inline V rms_norm_at(const float* xr, const float* weight, float inv, int64_t e) {
    return vmul(vload(weight + e), vmul(vload(xr + e), vset1(inv)));
}

// y = w * rms_norm(x) row by row (float32 statistics, as HF), optionally adding `residual` into x first
// (x += residual; the sum is kept in x for the next residual).
static int rms_norm(float* x, const float* residual, const float* weight, int64_t rows, int64_t n, float eps,
                    float* y) {
    if (n % W != 0) return -2;
#pragma omp parallel for schedule(static) if (rows > 8) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = rms_norm_inverse(x + r * n, residual ? residual + r * n : nullptr, n, eps);
        for (int64_t e = 0; e < n; e += W) vstore(y + r * n + e, rms_norm_at(x + r * n, weight, inv, e));
    }
    return 0;
}
