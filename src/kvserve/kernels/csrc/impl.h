// Kernel bodies, compiled once per ISA (see simd.h). Everything here is static: each namespace gets its own copy.

enum : int { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8 };  // ggml type ids
constexpr int QK = 32;                                // weights per quantization block

static inline int64_t block_bytes(int qt) { return qt == QT_Q4_0 ? 18 : qt == QT_Q4_1 ? 20 : 34; }

// Software prefetch of [p, p + bytes) into cache. The matmuls stream each weight byte once per call; the
// hardware prefetchers alone leave the cores waiting on memory for as long as they compute (a decode step
// with cache-resident weights runs ~2x faster), so each task prefetches the next task's weight panel,
// spread over its own blocks: while block b of a tile is computed, the same share of the panel ahead loads.
static inline void prefetch_span(const uint8_t* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// out[r * ostride + c] = dot(x row r, weight row c) for R activation rows x NC weight rows (columns of the
// output). Each block is converted to floats once and used by all R rows; NC independent columns keep
// several FMA chains in flight. Q4_0 / Q4_1 fold their offset into a per-block sum of x: d*(x.q) + m*sum(x).
// pf (optional): NC * row_bytes bytes of weights ahead, prefetched NC blocks' worth per block.
template <int R, int NC, int QT>
static inline void dot_tile(const float* x, int64_t xstride, const float* xsum, int64_t nb, const uint8_t* w,
                            int64_t row_bytes, float* out, int64_t ostride, const uint8_t* pf = nullptr) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    V acc[R][NC];
    float macc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) { acc[r][c] = vzero(); macc[r][c] = 0.0f; }
    for (int64_t b = 0; b < nb; ++b) {
        if (pf) prefetch_span(pf + b * NC * BB, NC * BB);
        for (int c = 0; c < NC; ++c) {
            const uint8_t* blk = w + c * row_bytes + b * BB;
            V q[QK / W];
            // d (and Q4_1's m, the next half) converted in one instruction; d broadcast from the vector.
            uint32_t dm_bits = 0;
            __builtin_memcpy(&dm_bits, blk, QT == QT_Q4_1 ? 4 : 2);
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));
            const float d = _mm_cvtss_f32(dm);
            float m = 0.0f;
            if (QT == QT_Q4_1) { m = _mm_cvtss_f32(_mm_movehdup_ps(dm)); q4_1_block(blk + 4, q); }
            else if (QT == QT_Q4_0) { m = -8.0f * d; q4_1_block(blk + 2, q); }
            else { q8_0_block(reinterpret_cast<const int8_t*>(blk + 2), q); }
            const V dv = vbroadcast0(dm);
            for (int r = 0; r < R; ++r) {
                const float* xr = x + r * xstride + b * QK;
                V t = vmul(vload(xr), q[0]);
                for (int i = 1; i < QK / W; ++i) t = vfma(vload(xr + i * W), q[i], t);
                acc[r][c] = vfma(dv, t, acc[r][c]);
                if (QT != QT_Q8_0) macc[r][c] += m * xsum[r * nb + b];
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * ostride + c] = vsum(acc[r][c]) + macc[r][c];
}

// Columns [c0, c1); ahead > 0: each tile prefetches the weights `ahead` columns further on (the next task's).
template <int R, int QT>
static inline void dot_cols(const float* x, int64_t k, const float* xs, int64_t nb, const uint8_t* w,
                            int64_t row_bytes, float* y, int64_t ystride, int64_t c0, int64_t c1, int64_t ahead) {
    constexpr int NC = R == 1 ? 4 : 2;
    int64_t col = c0;
    for (; col + NC <= c1; col += NC)
        dot_tile<R, NC, QT>(x, k, xs, nb, w + col * row_bytes, row_bytes, y + col, ystride,
                            ahead ? w + (col + ahead) * row_bytes : nullptr);
    for (; col < c1; ++col) dot_tile<R, 1, QT>(x, k, xs, nb, w + col * row_bytes, row_bytes, y + col, ystride);
}

template <int QT>
static void qmatmul_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                      float* y, int64_t ystride) {
    const int64_t nb = k / QK;
    float* xsum = nullptr;
    if (QT != QT_Q8_0) {
        xsum = new float[rows * nb];
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                float s = 0.0f;
                for (int j = 0; j < QK; ++j) s += x[r * k + b * QK + j];
                xsum[r * nb + b] = s;
            }
    }
    constexpr int64_t CHUNK = 16;  // output columns per task: their weights stay in L1 across row tiles
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t c0 = c * CHUNK, c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t left = rows - r0;
            const float* xr = x + r0 * k;
            const float* xs = xsum ? xsum + r0 * nb : nullptr;
            float* yr = y + r0 * ystride;
            // The first row tile prefetches the next chunk (the weights are then cache-hot for the rest);
            // never past the matrix's last column.
            const int64_t ahead = r0 == 0 && c1 + CHUNK <= n ? CHUNK : 0;
            if (left >= 4) dot_cols<4, QT>(xr, k, xs, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
            else if (left == 3) dot_cols<3, QT>(xr, k, xs, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
            else if (left == 2) dot_cols<2, QT>(xr, k, xs, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
            else dot_cols<1, QT>(xr, k, xs, nb, w, row_bytes, yr, ystride, c0, c1, ahead);
        }
    }
    delete[] xsum;
}

static int qmatmul(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                   float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (qt == QT_Q4_1) qmatmul_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qmatmul_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else return -1;
    return 0;
}

// Rows of a quantized matrix as float32, computed exactly as gguf's numpy dequantizer does (d*q + m with
// separate roundings; built with -ffp-contract=off). ids (optional) selects rows, e.g. an embedding lookup.
static int dequantize(int qt, const uint8_t* w, int64_t row_bytes, int64_t k, const int64_t* ids, int64_t nrows,
                      float* out) {
    if (k % QK != 0) return -2;
    if (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0) return -1;
    const int64_t nb = k / QK, bb = block_bytes(qt);
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t r = 0; r < nrows; ++r) {
        const uint8_t* src = w + (ids ? ids[r] : r) * row_bytes;
        float* dst = out + r * k;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = src + b * bb;
            V q[QK / W];
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

// y = w * rms_norm(x) row by row (float32 statistics, as HF), optionally adding `residual` into x first
// (x += residual; the sum is kept in x for the next residual).
static int rms_norm(float* x, const float* residual, const float* weight, int64_t rows, int64_t n, float eps,
                    float* y) {
    if (n % W != 0) return -2;
#pragma omp parallel for schedule(static) if (rows > 8) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * n;
        V ss = vzero();
        for (int64_t e = 0; e < n; e += W) {
            V v = vload(xr + e);
            if (residual) { v = vadd(v, vload(residual + r * n + e)); vstore(xr + e, v); }
            ss = vfma(v, v, ss);
        }
        const float inv = 1.0f / __builtin_sqrtf(vsum(ss) / static_cast<float>(n) + eps);
        for (int64_t e = 0; e < n; e += W)
            vstore(y + r * n + e, vmul(vload(weight + e), vmul(vload(xr + e), vset1(inv))));
    }
    return 0;
}
