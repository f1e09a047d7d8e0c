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

// Quantized activations: q [rows, k] int8, d and s [rows, k/32] float; dv and sv [rows, nbp * 8] are d and
// s/8 repeated once per int32 lane of a block's dot (s/8 is exact: a power of two), so the kernel scales a
// whole vector of lanes with one load; nbp is k/32 rounded up to the blocks per vector, padded with zeros.
struct Q8Rows {
    int8_t* q;
    float* d;
    float* s;
    float* dv;
    float* sv;
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

#if KV_AVX512
constexpr int BPV = 2;  // weight blocks per integer vector: one 512-bit vpdpbusd covers two blocks
#else
constexpr int BPV = 1;
#endif
constexpr int LANES = 8;  // int32 lanes per block's dot

static inline int64_t padded_blocks(int64_t nb) { return (nb + BPV - 1) / BPV * BPV; }

static void quantize_rows(const float* x, int64_t rows, int64_t k, Q8Rows out) {
    const int64_t nb = k / QK, nbp = padded_blocks(nb);
#pragma omp parallel for schedule(static) if (rows * k >= 65536) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b)
            quantize_row_block(x + r * k + b * QK, out.q + r * k + b * QK, out.d + r * nb + b, out.s + r * nb + b);
        if (!out.dv) continue;
        for (int64_t b = 0; b < nbp; ++b)
            for (int l = 0; l < LANES; ++l) {
                out.dv[(r * nbp + b) * LANES + l] = b < nb ? out.d[r * nb + b] : 0.0f;
                out.sv[(r * nbp + b) * LANES + l] = b < nb ? out.s[r * nb + b] * 0.125f : 0.0f;
            }
    }
}

// One group of BPV weight blocks of one weight row, unpacked for the dot: u (unsigned quants: nibbles, or
// |q| for Q8_0), sign (Q8_0's signed quants, whose signs go onto the activations), dw (scale per lane) and
// mw (the multiplier of s per lane: Q4_1's m, Q4_0's -8*dw; zero for Q8_0). A short tail group is zero-filled.
#if KV_AVX512
typedef __m512i VI;
#else
typedef __m256i VI;
#endif
struct Packed {
    VI u, sign;
    V dw, mw;
};

static inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

#if KV_AVX512
static inline VI xload(const int8_t* p, int count) {
    if (count == 2) return _mm512_loadu_si512(p);
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline VI idot(VI u, VI s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }
static inline VI apply_sign(VI x, VI sign) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(sign), _mm512_setzero_si512(), x);
}
static inline V icvt(VI v) { return _mm512_cvtepi32_ps(v); }

// Two blocks (or one, count == 1) starting at blk: the first 4 bytes of a block are fp16 d then (Q4_1) m.
template <int QT>
static inline Packed pack_group(const uint8_t* blk, int count) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    constexpr int64_t QOFF = QT == QT_Q4_1 ? 4 : 2;
    const uint8_t* next = blk + BB;
    __m128i halves = _mm_cvtsi32_si128(static_cast<int>(load_u32(blk)));
    if (count == 2) halves = _mm_insert_epi32(halves, static_cast<int>(load_u32(next)), 1);
    const __m512 scales = _mm512_castps128_ps512(_mm_cvtph_ps(halves));  // d0, m0, d1, m1
    const __mmask16 upper = 0xFF00;
    Packed out;
    out.dw = _mm512_permutexvar_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0), upper, _mm512_set1_epi32(2)), scales);
    if (QT == QT_Q8_0) {
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QOFF));
        const __m256i q1 = count == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next + QOFF))
                                      : _mm256_setzero_si256();
        out.sign = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        out.u = _mm512_abs_epi8(out.sign);
        out.mw = _mm512_setzero_ps();
        return out;
    }
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QOFF));
    const __m128i r1 = count == 2 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(next + QOFF)) : _mm_setzero_si128();
    const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(r0), r1, 1);
    const __m512i both = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), _mm512_set1_epi8(0x0F));
    // both: lo0 lo1 hi0 hi1 (16 bytes each) -> lo0 hi0 lo1 hi1, the weight order of the two blocks
    out.u = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), both);
    out.sign = _mm512_setzero_si512();
    out.mw = QT == QT_Q4_1
        ? _mm512_permutexvar_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(1), upper, _mm512_set1_epi32(3)), scales)
        : _mm512_mul_ps(out.dw, _mm512_set1_ps(-8.0f));
    return out;
}
#else
static inline VI xload(const int8_t* p, int) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// No saturation in maddubs: |u| <= 128 and |s| <= 127, so a pair sums to at most 32,512.
static inline VI idot(VI u, VI s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
static inline VI apply_sign(VI x, VI sign) { return _mm256_sign_epi8(x, sign); }
static inline V icvt(VI v) { return _mm256_cvtepi32_ps(v); }

template <int QT>
static inline Packed pack_group(const uint8_t* blk, int) {
    constexpr int64_t QOFF = QT == QT_Q4_1 ? 4 : 2;
    const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(blk))));  // d, m
    Packed out;
    out.dw = _mm256_broadcastss_ps(scales);
    if (QT == QT_Q8_0) {
        out.sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + QOFF));
        out.u = _mm256_abs_epi8(out.sign);
        out.mw = _mm256_setzero_ps();
        return out;
    }
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + QOFF));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    out.u = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    out.sign = _mm256_setzero_si256();
    out.mw = QT == QT_Q4_1 ? _mm256_broadcastss_ps(_mm_movehdup_ps(scales)) : _mm256_mul_ps(out.dw, vset1(-8.0f));
    return out;
}
#endif

// The groups of `ncols` weight rows, unpacked once per call and reused by every row tile.
template <int QT>
static void pack_columns(const uint8_t* w, int64_t row_bytes, int64_t ncols, int64_t nb, Packed* out) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    const int64_t groups = padded_blocks(nb) / BPV;
    for (int64_t c = 0; c < ncols; ++c)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t b = g * BPV;
            out[c * groups + g] = pack_group<QT>(w + c * row_bytes + b * BB, nb - b < BPV ? int(nb - b) : BPV);
        }
}

// Where a tile's weight groups come from: packed once per chunk (batches: every row tile reuses them), or
// unpacked straight from the GGUF blocks (a single row tile, as in decode: packing would only add a copy).
struct WSource {
    const Packed* pk;
    const uint8_t* w;
    int64_t row_bytes, groups;
};

template <int QT>
static inline Packed group_at(const WSource& src, int64_t c, int64_t g, int64_t nb) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    if (src.pk) return src.pk[c * src.groups + g];
    const int64_t b = g * BPV;
    return pack_group<QT>(src.w + c * src.row_bytes + b * BB, nb - b < BPV ? int(nb - b) : BPV);
}

static inline WSource shifted(const WSource& src, int64_t col) {
    return src.pk ? WSource{src.pk + col * src.groups, nullptr, src.row_bytes, src.groups}
                  : WSource{nullptr, src.w + col * src.row_bytes, src.row_bytes, src.groups};
}

// out[r * ostride + c] for R activation rows x NC weight rows. Per lane:
// acc += (dw * dx) * sum(qw * qx) [+ mw * s/8], summed over lanes and blocks at the end.
template <int R, int NC, int QT>
static inline void i8_tile(const Q8Rows& x, int64_t k, int64_t nb, const WSource& src, float* out, int64_t ostride) {
    const int64_t nbp = padded_blocks(nb), groups = nbp / BPV;
    V acc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g * BPV;
        const int count = nb - b < BPV ? static_cast<int>(nb - b) : BPV;
        Packed p[NC];
        for (int c = 0; c < NC; ++c) p[c] = group_at<QT>(src, c, g, nb);
        for (int r = 0; r < R; ++r) {
            const VI xv = xload(x.q + r * k + b * QK, count);
            const V dx = vload(x.dv + (r * nbp + b) * LANES);
            for (int c = 0; c < NC; ++c) {
                const VI xs = QT == QT_Q8_0 ? apply_sign(xv, p[c].sign) : xv;
                acc[r][c] = vfma(vmul(p[c].dw, dx), icvt(idot(p[c].u, xs)), acc[r][c]);
                if (QT != QT_Q8_0) acc[r][c] = vfma(p[c].mw, vload(x.sv + (r * nbp + b) * LANES), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * ostride + c] = vsum(acc[r][c]);
}

template <int R, int QT>
static inline void i8_cols(const Q8Rows& x, int64_t k, int64_t nb, const WSource& src, int64_t ncols, float* y,
                           int64_t ystride) {
    constexpr int NC = R == 1 ? 4 : 2;
    int64_t col = 0;
    for (; col + NC <= ncols; col += NC) i8_tile<R, NC, QT>(x, k, nb, shifted(src, col), y + col, ystride);
    for (; col < ncols; ++col) i8_tile<R, 1, QT>(x, k, nb, shifted(src, col), y + col, ystride);
}

static inline Q8Rows i8_offset(const Q8Rows& x, int64_t r0, int64_t k, int64_t nb) {
    const int64_t lanes = padded_blocks(nb) * LANES;
    return Q8Rows{x.q + r0 * k, x.d + r0 * nb, x.s + r0 * nb, x.dv + r0 * lanes, x.sv + r0 * lanes};
}

template <int QT>
static void qmatmul_i8_t(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                         float* y, int64_t ystride) {
    const int64_t nb = k / QK, groups = padded_blocks(nb) / BPV;
    constexpr int64_t CHUNK = 8;  // output columns per task, packed once (~50 KB at k = 1536) for all row tiles
    constexpr int RT = 4;         // activation rows per tile
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(kv_threads())
    {
        Packed* pk = rows > RT ? new Packed[CHUNK * groups] : nullptr;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t c0 = c * CHUNK, ncols = c0 + CHUNK < n ? CHUNK : n - c0;
            const WSource src = rows > RT ? WSource{pk, nullptr, row_bytes, groups}
                                          : WSource{nullptr, w + c0 * row_bytes, row_bytes, groups};
            if (rows > RT) pack_columns<QT>(w + c0 * row_bytes, row_bytes, ncols, nb, pk);
            for (int64_t r0 = 0; r0 < rows; r0 += RT) {
                const int64_t left = rows - r0;
                const Q8Rows xr = i8_offset(x, r0, k, nb);
                float* yr = y + r0 * ystride + c0;
                if (left >= 4) i8_cols<4, QT>(xr, k, nb, src, ncols, yr, ystride);
                else if (left == 3) i8_cols<3, QT>(xr, k, nb, src, ncols, yr, ystride);
                else if (left == 2) i8_cols<2, QT>(xr, k, nb, src, ncols, yr, ystride);
                else i8_cols<1, QT>(xr, k, nb, src, ncols, yr, ystride);
            }
        }
        delete[] pk;
    }
}

// Activation rows quantized into caller-provided buffers (q [rows, k], d and s [rows, k/32]).
static int quantize_i8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
    if (k % QK != 0) return -2;
    quantize_rows(x, rows, k, Q8Rows{q, d, s, nullptr, nullptr});
    return 0;
}

// y[r * ystride + c] = dot(x row r, weight row c) with x quantized to int8 blocks first (same signature as
// qmatmul; the quantized activations live in a scratch buffer for the call).
static int qmatmul_i8(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                      int64_t row_bytes, float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    if (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0) return -1;
    if (rows <= 0 || n <= 0) return 0;
    const int64_t nb = k / QK, lanes = padded_blocks(nb) * LANES;
    // One scratch allocation: q (padded by a vector so a tail block's load stays inside), d, s, dv, sv.
    int8_t* q = new int8_t[rows * k + 64];
    float* ds = new float[2 * rows * nb + 2 * rows * lanes];
    const Q8Rows xq{q, ds, ds + rows * nb, ds + 2 * rows * nb, ds + 2 * rows * nb + rows * lanes};
    quantize_rows(x, rows, k, xq);
    if (qt == QT_Q4_1) qmatmul_i8_t<QT_Q4_1>(xq, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_i8_t<QT_Q4_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    else qmatmul_i8_t<QT_Q8_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    delete[] q;
    delete[] ds;
    return 0;
}
