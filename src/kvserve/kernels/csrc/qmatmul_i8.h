// Int8-activation matmul (llama.cpp's Q8_1 path, written for kvserve): activation rows are quantized to
// blocks of 32 int8 with a float scale d = max|x| / 127 and s = d * sum(q), then dotted with the GGUF's
// Q4_0 / Q4_1 / Q8_0 weight blocks in integer arithmetic:
//   Q4_1: sum_j (dw*qw_j + m) * (dx*qx_j) = dw*dx * sum(qw*qx) + m * s
//   Q4_0: sum_j dw*(qw_j - 8) * dx*qx_j    = dw*dx * sum(qw*qx) - 8*dw * s
//   Q8_0: dw*dx * sum(qw*qx)  (signed x signed: |qw| times qx with qw's sign, as u8 x s8)
// The u8 x s8 block dot is VNNI's vpdpbusd (256-bit, AVX512_VNNI + VL) in the AVX-512 build and
// maddubs + madd in the AVX2 build; the rest of the code is shared. Included by kernels.cpp after impl.h
// inside each ISA namespace. The rounding of the quantization (x * (1/d), nearest-even, clamp to +-127)
// is spelt out so `reference.quantize_activations` reproduces it bit for bit.

// Quantized activations: q [rows, k] int8, d and s [rows, k/32] float.
struct Q8Rows {
    int8_t* q;
    float* d;
    float* s;
};

static inline void quantize_row_block(const float* x, int8_t* q, float* d, float* s) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) {
        const float a = x[j] < 0.0f ? -x[j] : x[j];
        amax = a > amax ? a : amax;
    }
    const float dx = amax / 127.0f;
    const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
        float v = __builtin_nearbyintf(x[j] * id);  // the default rounding mode: nearest, ties to even
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[j] = static_cast<int8_t>(v);
        sum += q[j];
    }
    *d = dx;
    *s = dx * static_cast<float>(sum);
}

static void quantize_rows(const float* x, int64_t rows, int64_t k, Q8Rows out) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (rows * k >= 65536) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b)
            quantize_row_block(x + r * k + b * QK, out.q + r * k + b * QK, out.d + r * nb + b, out.s + r * nb + b);
}

// 32 nibbles (low nibbles = weights 0..15, high = 16..31) as 32 unsigned bytes in weight order.
static inline __m256i i8_unpack_q4(const uint8_t* qs) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// Eight int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes). No saturation in the AVX2 form:
// |u| <= 128 and |s| <= 127, so a pair sums to at most 32,512.
static inline __m256i i8_dot(__m256i u, __m256i s) {
#if KV_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float i8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// out[r * ostride + c] for R activation rows x NC weight rows: each weight block is unpacked once and
// used by all R rows; NC columns keep independent accumulation chains in flight.
template <int R, int NC, int QT>
static inline void i8_tile(const Q8Rows& x, int64_t k, int64_t nb, const uint8_t* w, int64_t row_bytes,
                           float* out, int64_t ostride) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    __m256 acc[R][NC];
    float macc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) { acc[r][c] = _mm256_setzero_ps(); macc[r][c] = 0.0f; }
    for (int64_t b = 0; b < nb; ++b) {
        for (int c = 0; c < NC; ++c) {
            const uint8_t* blk = w + c * row_bytes + b * BB;
            const float dw = half_to_float(blk);
            float m = 0.0f;
            __m256i u, wq = _mm256_setzero_si256();
            if (QT == QT_Q4_1) { m = half_to_float(blk + 2); u = i8_unpack_q4(blk + 4); }
            else if (QT == QT_Q4_0) { m = -8.0f * dw; u = i8_unpack_q4(blk + 2); }
            else {
                wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
                u = _mm256_abs_epi8(wq);
            }
            for (int r = 0; r < R; ++r) {
                __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * k + b * QK));
                if (QT == QT_Q8_0) xv = _mm256_sign_epi8(xv, wq);
                const __m256 isum = _mm256_cvtepi32_ps(i8_dot(u, xv));
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[r * nb + b]), isum, acc[r][c]);
                if (QT != QT_Q8_0) macc[r][c] += m * x.s[r * nb + b];
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * ostride + c] = i8_hsum(acc[r][c]) + macc[r][c];
}

template <int R, int QT>
static inline void i8_cols(const Q8Rows& x, int64_t k, int64_t nb, const uint8_t* w, int64_t row_bytes, float* y,
                           int64_t ystride, int64_t c0, int64_t c1) {
    constexpr int NC = R == 1 ? 4 : 2;
    int64_t col = c0;
    for (; col + NC <= c1; col += NC)
        i8_tile<R, NC, QT>(x, k, nb, w + col * row_bytes, row_bytes, y + col, ystride);
    for (; col < c1; ++col) i8_tile<R, 1, QT>(x, k, nb, w + col * row_bytes, row_bytes, y + col, ystride);
}

static inline Q8Rows i8_offset(const Q8Rows& x, int64_t r0, int64_t k, int64_t nb) {
    return Q8Rows{x.q + r0 * k, x.d + r0 * nb, x.s + r0 * nb};
}

template <int QT>
static void qmatmul_i8_t(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                         float* y, int64_t ystride) {
    const int64_t nb = k / QK;
    constexpr int64_t CHUNK = 16;  // output columns per task: their weight blocks stay in L1 across row tiles
    constexpr int RT = 4;          // activation rows per tile
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t c0 = c * CHUNK, c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int64_t r0 = 0; r0 < rows; r0 += RT) {
            const int64_t left = rows - r0;
            const Q8Rows xr = i8_offset(x, r0, k, nb);
            float* yr = y + r0 * ystride;
            if (left >= 4) i8_cols<4, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1);
            else if (left == 3) i8_cols<3, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1);
            else if (left == 2) i8_cols<2, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1);
            else i8_cols<1, QT>(xr, k, nb, w, row_bytes, yr, ystride, c0, c1);
        }
    }
}

// Activation rows quantized into caller-provided buffers (q [rows, k], d and s [rows, k/32]).
static int quantize_i8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
    if (k % QK != 0) return -2;
    quantize_rows(x, rows, k, Q8Rows{q, d, s});
    return 0;
}

// y[r * ystride + c] = dot(x row r, weight row c) with x quantized to int8 blocks first (same signature as
// qmatmul; the quantized activations live in a scratch buffer for the call).
static int qmatmul_i8(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                      int64_t row_bytes, float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0) return -1;
    if (rows <= 0 || n <= 0) return 0;
    const int64_t nb = k / QK;
    int8_t* q = new int8_t[rows * k];
    float* ds = new float[2 * rows * nb];
    const Q8Rows xq{q, ds, ds + rows * nb};
    quantize_rows(x, rows, k, xq);
    if (qt == QT_Q4_1) qmatmul_i8_t<QT_Q4_1>(xq, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_i8_t<QT_Q4_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    else qmatmul_i8_t<QT_Q8_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    delete[] q;
    delete[] ds;
    return 0;
}
