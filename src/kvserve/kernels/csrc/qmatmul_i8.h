// Int8-activation matmul (llama.cpp's Q8_1 path, written for kvserve): activation rows are quantized to
// blocks of 32 int8 with a float scale d = max|x| / 127 and s = d * sum(q), then dotted with the GGUF's
// Q4_0 / Q4_1 / Q8_0 weight blocks in integer arithmetic:
//   Q4_1: sum_j (dw*qw_j + m) * (dx*qx_j) = dw*dx * sum(qw*qx) + m * s
//   Q4_0: sum_j dw*(qw_j - 8) * dx*qx_j    = dw*dx * sum(qw*qx) - 8*dw * s
//   Q8_0: dw*dx * sum(qw*qx)  (signed x signed: |qw| times qx with qw's sign, as u8 x s8)
// Two kernels share the quantized activations: AVX-512 (VNNI) interleaves 16 weight rows so one vpdpbusd
// feeds 16 output columns (any number of rows) -- gathered per call from GGUF blocks here, or read as
// stored from weights packed at load (qmatmul_i8_packed.h, qtype | QT_I8_PACKED: what the engine runs on
// either ISA); the GGUF-layout AVX2 kernel dots one block per 256-bit maddubs + madd, per row tile of up to
// 4 rows, unpacking each column chunk once per call for larger batches. Included by kernels.cpp after impl.h
// inside each ISA namespace. The rounding of the quantization (x * (1/d),
// nearest-even, clamp to +-127) is spelt out so `reference.quantize_activations` reproduces it bit for bit.

// Quantized activations: q [rows, k] int8, d and s [rows, k/32] float; for the AVX2 kernel also dv and sv
// [rows, k/32 * 8]: d and s/8 repeated once per int32 lane of a block's dot (s/8 is exact: a power of two),
// so it scales a whole vector of lanes with one load (null for the AVX-512 kernel).
struct Q8Rows {
    int8_t* q;
    float* d;
    float* s;
    float* dv;
    float* sv;
};

// One block: amax, d = amax / 127, q = clamp(nearest-even(x * (1/d)), +-127), s = d * sum(q). Vectorised; every
// value is the same IEEE operation as `reference.quantize_activations` (max is exact whatever the order;
// x * id, the rounding, the clamp and the integer sum are per element).
static inline void quantize_row_block(const float* x, int8_t* q, float* d, float* s) {
#if KV_AVX512
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 1; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    const float amax = vhmax(m);
#endif
    const float dx = amax / 127.0f;
    const float id = dx != 0.0f ? 1.0f / dx : 0.0f;
    constexpr int MODE = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if KV_AVX512
    const __m512 vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(a, vid), MODE), lo), hi));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(b, vid), MODE), lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i iq[4];
    for (int i = 0; i < 4; ++i) {
        const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid), MODE);
        iq[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    }
    // |q| <= 127: the saturating packs are plain narrowings. They work per 128-bit half, leaving the 4-byte
    // groups in the order 0 2 4 6 1 3 5 7 of the wanted one; one dword permute puts them back.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3]));
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    const __m128i pair = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
    const int sum = _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0xB1)));
#endif
    *d = dx;
    *s = dx * static_cast<float>(sum);
}

constexpr int LANES = 8;  // int32 lanes per block's dot (AVX2 kernel)
constexpr int RT = 4;     // activation rows per tile of the AVX2 kernel

static void quantize_rows(const float* x, int64_t rows, int64_t k, Q8Rows out) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (rows * k >= 65536) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < nb; ++b)
            quantize_row_block(x + r * k + b * QK, out.q + r * k + b * QK, out.d + r * nb + b, out.s + r * nb + b);
        if (!out.dv) continue;
        static_assert(LANES == 8, "one ymm of d (and of s/8) per block");
        for (int64_t b = 0; b < nb; ++b) {
            _mm256_storeu_ps(out.dv + (r * nb + b) * LANES, _mm256_set1_ps(out.d[r * nb + b]));
            _mm256_storeu_ps(out.sv + (r * nb + b) * LANES, _mm256_set1_ps(out.s[r * nb + b] * 0.125f));
        }
    }
}

static inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

static inline Q8Rows i8_offset(const Q8Rows& x, int64_t r0, int64_t k, int64_t nb) {
    const int64_t lanes = nb * LANES;
    return Q8Rows{x.q + r0 * k, x.d + r0 * nb, x.s + r0 * nb, x.dv ? x.dv + r0 * lanes : nullptr,
                  x.sv ? x.sv + r0 * lanes : nullptr};
}

// Row passes: both kernels stream every quantized activation row past each column chunk, so a pass's rows
// must stay in the core's L2 while the chunks go by. Unblocked, 2,048 rows at k = 1,536 are ~4 MiB
// (AVX-512) and were re-read from L3 for every 16 columns by both cores (in one 2-thread run, under load,
// no faster than 1 thread at 2,048 rows, 2x at 512: benchmarks/results/kernels_prefill.md). Weights are
// re-unpacked once per pass (a few % at these sizes); each output element is computed exactly as before.
constexpr int64_t I8_ROW_PASS_BYTES = 512 * 1024;  // half a core's L2 on the dev VM (2 MiB)

// Rows per pass, for activations of `bytes_per_row` (q, scales and any per-lane copies): a multiple of 16
// (whole AMX tiles, qmatmul_amx.h).
static inline int64_t i8_pass_rows(int64_t rows, int64_t bytes_per_row) {
    int64_t pass = I8_ROW_PASS_BYTES / bytes_per_row / 16 * 16;
    pass = pass < 64 ? 64 : pass;
    return pass < rows ? pass : rows;
}

#if !KV_AVX512
// One weight block of one weight row, unpacked for the dot: u (unsigned quants: nibbles, or |q| for Q8_0),
// sign (Q8_0's signed quants, whose signs go onto the activations), dw (scale in every lane) and mw (the
// multiplier of s: Q4_1's m, Q4_0's -8*dw; zero for Q8_0).
typedef __m256i VI;
struct Packed {
    VI u, sign;
    V dw, mw;
};

// No saturation in maddubs: |u| <= 128 and |s| <= 127, so a pair sums to at most 32,512.
static inline VI idot(VI u, VI s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

template <int QT>
static inline Packed pack_block(const uint8_t* blk) {
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

// A block as a column chunk keeps it (64 bytes, half of Packed: a chunk of 8 columns at k = 1,536 is 24 KiB
// and stays in L1 while its row tiles go by, where Packed's 48 KiB did not): the quants (Q4: nibbles; Q8_0:
// the signed bytes) and the two scales; block_at widens it back into the same Packed values.
struct Unpacked {
    VI q;
    float d, m;
};

template <int QT>
static inline Unpacked unpack_block(const uint8_t* blk) {
    const Packed p = pack_block<QT>(blk);
    return Unpacked{QT == QT_Q8_0 ? p.sign : p.u, _mm256_cvtss_f32(p.dw), _mm256_cvtss_f32(p.mw)};
}

// Where a tile's weight blocks come from: unpacked once per column chunk (batches: every row tile reuses
// them), or straight from the GGUF blocks (a single row tile, as in decode: packing would only add a copy).
struct WSource {
    const Unpacked* pk;  // [ncols, nb] or null
    const uint8_t* w;
    int64_t row_bytes;
};

template <int QT>
static inline Packed block_at(const WSource& src, int64_t c, int64_t b, int64_t nb) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    if (!src.pk) return pack_block<QT>(src.w + c * src.row_bytes + b * BB);
    const Unpacked& k = src.pk[c * nb + b];
    if (QT == QT_Q8_0) return Packed{_mm256_abs_epi8(k.q), k.q, vset1(k.d), vzero()};
    return Packed{k.q, _mm256_setzero_si256(), vset1(k.d), vset1(k.m)};
}

static inline WSource shifted(const WSource& src, int64_t col, int64_t nb) {
    return src.pk ? WSource{src.pk + col * nb, nullptr, src.row_bytes}
                  : WSource{nullptr, src.w + col * src.row_bytes, src.row_bytes};
}

// out[r * ostride + c] for R activation rows x NC weight rows. Per lane:
// acc += (dw * dx) * sum(qw * qx) [+ mw * s/8], summed over lanes and blocks at the end.
// pf (optional): NC * row_bytes bytes of weights ahead, prefetched NC blocks' worth per block (as impl.h's
// dot_tile: one burst per task left the cores waiting on memory -- a third of a 1-row decode step).
template <int R, int NC, int QT>
static inline void i8_tile(const Q8Rows& x, int64_t k, int64_t nb, const WSource& src, float* out, int64_t ostride,
                           const uint8_t* pf = nullptr) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    V acc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
        if (pf) prefetch_span(pf + b * NC * BB, NC * BB);
        Packed p[NC];
        for (int c = 0; c < NC; ++c) p[c] = block_at<QT>(src, c, b, nb);
        for (int r = 0; r < R; ++r) {
            const VI xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * k + b * QK));
            const V dx = vload(x.dv + (r * nb + b) * LANES);
            for (int c = 0; c < NC; ++c) {
                const VI xs = QT == QT_Q8_0 ? _mm256_sign_epi8(xv, p[c].sign) : xv;
                acc[r][c] = vfma(vmul(p[c].dw, dx), _mm256_cvtepi32_ps(idot(p[c].u, xs)), acc[r][c]);
                if (QT != QT_Q8_0) acc[r][c] = vfma(p[c].mw, vload(x.sv + (r * nb + b) * LANES), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * ostride + c] = vsum(acc[r][c]);
}

// ahead > 0 (GGUF-layout source only): each tile prefetches the weights `ahead` columns further on.
template <int R, int QT>
static inline void i8_cols(const Q8Rows& x, int64_t k, int64_t nb, const WSource& src, int64_t ncols, float* y,
                           int64_t ystride, int64_t ahead = 0) {
    constexpr int NC = R == 1 ? 4 : 2;
    int64_t col = 0;
    for (; col + NC <= ncols; col += NC)
        i8_tile<R, NC, QT>(x, k, nb, shifted(src, col, nb), y + col, ystride,
                           ahead && src.w ? src.w + (col + ahead) * src.row_bytes : nullptr);
    for (; col < ncols; ++col) i8_tile<R, 1, QT>(x, k, nb, shifted(src, col, nb), y + col, ystride);
}

template <int QT>
static void qmatmul_i8_t(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                         float* y, int64_t ystride) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    const int64_t nb = k / QK;
    constexpr int64_t CHUNK = 8;  // output columns per task, unpacked once (~50 KB at k = 1536) for all row tiles
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    const int64_t pass = i8_pass_rows(rows, k + 2 * nb * 4 + 2 * nb * LANES * 4);  // q, d, s, dv, sv
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // scratch.h: this thread's
        Unpacked* pk = rows > RT ? own.take<Unpacked>(CHUNK * nb) : nullptr;
        for (int64_t p0 = 0; p0 < rows; p0 += pass) {  // row passes (see i8_pass_rows)
            const int64_t p1 = p0 + pass < rows ? p0 + pass : rows;
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < nchunks; ++c) {  // static: every pass gives a thread the same chunks
                const int64_t c0 = c * CHUNK, ncols = c0 + CHUNK < n ? CHUNK : n - c0;
                const bool next = c0 + 2 * CHUNK <= n;  // the next chunk's weights: prefetched while this one runs
                if (next && pk) prefetch_span(w + (c0 + CHUNK) * row_bytes, CHUNK * row_bytes);
                if (pk)
                    for (int64_t j = 0; j < ncols; ++j)
                        for (int64_t b = 0; b < nb; ++b)
                            pk[j * nb + b] = unpack_block<QT>(w + (c0 + j) * row_bytes + b * BB);
                const WSource src{pk, pk ? nullptr : w + c0 * row_bytes, row_bytes};
                for (int64_t r0 = p0; r0 < p1; r0 += RT) {
                    const int64_t left = p1 - r0;
                    const Q8Rows xr = i8_offset(x, r0, k, nb);
                    float* yr = y + r0 * ystride + c0;
                    const int64_t ahead = next && !pk ? CHUNK : 0;  // spread over the tile's blocks
                    if (left >= 4) i8_cols<4, QT>(xr, k, nb, src, ncols, yr, ystride, ahead);
                    else if (left == 3) i8_cols<3, QT>(xr, k, nb, src, ncols, yr, ystride, ahead);
                    else if (left == 2) i8_cols<2, QT>(xr, k, nb, src, ncols, yr, ystride, ahead);
                    else i8_cols<1, QT>(xr, k, nb, src, ncols, yr, ystride, ahead);
                }
            }
        }
    }
}
#endif  // !KV_AVX512

#if KV_AVX512
// AVX-512 (any number of rows): 16 weight rows interleaved by 4-byte groups, so that one vpdpbusd
// of a weight vector with 4 broadcast activation bytes adds a 4-weight partial dot to 16 output columns at
// once; a block's 8 groups finish 16 exact block dots with no horizontal sum, and the block scales are
// applied per 16 columns: acc += (dw * dx) * isum + mw * s. Per block and chunk: 8 int vectors (the groups,
// unsigned nibbles for Q4, signed quants for Q8_0), dw, and mw (Q4) or 128 * sum(qw) (Q8_0, whose
// activations go in biased by +128 as the unsigned operand: sum((qx + 128) * qw) - 128 * sum(qw)).
constexpr int64_t ICOLS = 16;

struct Interleaved {
    __m512i q[8];
    __m512 dw, mw;
    __m512i corr;
};

// pf (optional): the next chunk's ICOLS * row_bytes bytes, prefetched a block's share per block (impl.h).
template <int QT>
static void interleave_columns(const uint8_t* w, int64_t row_bytes, int64_t ncols, int64_t nb, Interleaved* out,
                               const uint8_t* pf) {
    constexpr int64_t BB = QT == QT_Q4_0 ? 18 : QT == QT_Q4_1 ? 20 : 34;
    constexpr int64_t QOFF = QT == QT_Q4_1 ? 4 : 2;
    // Lanes past ncols repeat the last column (their outputs are never stored).
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i cols = _mm512_min_epi32(lane, _mm512_set1_epi32(static_cast<int>(ncols - 1)));
    const __m512i offsets = _mm512_mullo_epi32(cols, _mm512_set1_epi32(static_cast<int>(row_bytes)));
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        if (pf) prefetch_span(pf + b * ICOLS * BB, ICOLS * BB);
        const uint8_t* base = w + b * BB;
        Interleaved& o = out[b];
        const __m512i scales = _mm512_i32gather_epi32(offsets, base, 1);  // d | m << 16 per column
        o.dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(scales));
        if (QT == QT_Q8_0) {
            __m512i sum = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) {
                o.q[j] = _mm512_i32gather_epi32(offsets, base + QOFF + 4 * j, 1);
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), o.q[j]);
            }
            o.corr = _mm512_slli_epi32(sum, 7);
            o.mw = _mm512_setzero_ps();
            continue;
        }
        for (int t = 0; t < 4; ++t) {
            const __m512i raw = _mm512_i32gather_epi32(offsets, base + QOFF + 4 * t, 1);
            o.q[t] = _mm512_and_si512(raw, nibble);                              // weights 4t .. 4t+3
            o.q[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);  // weights 16+4t ..
        }
        o.mw = QT == QT_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(scales, 16)))
                             : _mm512_mul_ps(o.dw, _mm512_set1_ps(-8.0f));
        o.corr = _mm512_setzero_si512();
    }
}

template <int R, int QT>
static inline void interleaved_tile(const Q8Rows& x, int64_t k, int64_t nb, const Interleaved* pk, float* y,
                                    int64_t ystride, int64_t ncols) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b) {
        const Interleaved& p = pk[b];
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
            for (int r = 0; r < R; ++r) {
                __m512i xb = _mm512_set1_epi32(static_cast<int>(load_u32(
                    reinterpret_cast<const uint8_t*>(x.q + r * k + b * QK + 4 * j))));
                if (QT == QT_Q8_0) isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_xor_si512(xb, bias), p.q[j]);
                else isum[r] = _mm512_dpbusd_epi32(isum[r], p.q[j], xb);
            }
        }
        for (int r = 0; r < R; ++r) {
            if (QT == QT_Q8_0) isum[r] = _mm512_sub_epi32(isum[r], p.corr);
            const __m512 scale = _mm512_mul_ps(p.dw, _mm512_set1_ps(x.d[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum[r]), acc[r]);
            if (QT != QT_Q8_0) acc[r] = _mm512_fmadd_ps(p.mw, _mm512_set1_ps(x.s[r * nb + b]), acc[r]);
        }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << ncols) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ystride, keep, acc[r]);
}

template <int QT>
static void interleaved_rows(const Q8Rows& x, int64_t rows, int64_t k, int64_t nb, const Interleaved* pk, float* y,
                             int64_t ystride, int64_t ncols) {
    constexpr int RI = 8;
    int64_t r0 = 0;
    for (; r0 + RI <= rows; r0 += RI)
        interleaved_tile<RI, QT>(i8_offset(x, r0, k, nb), k, nb, pk, y + r0 * ystride, ystride, ncols);
    const Q8Rows xr = i8_offset(x, r0, k, nb);
    float* yr = y + r0 * ystride;
    switch (rows - r0) {
        case 7: interleaved_tile<7, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 6: interleaved_tile<6, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 5: interleaved_tile<5, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 4: interleaved_tile<4, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 3: interleaved_tile<3, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 2: interleaved_tile<2, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        case 1: interleaved_tile<1, QT>(xr, k, nb, pk, yr, ystride, ncols); break;
        default: break;
    }
}

template <int QT>
static void qmatmul_i8_interleaved(const Q8Rows& x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                                   int64_t row_bytes, float* y, int64_t ystride) {
    const int64_t nb = k / QK, nchunks = (n + ICOLS - 1) / ICOLS;
    const int64_t pass = i8_pass_rows(rows, k + 2 * nb * 4);  // q, d, s
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // scratch.h: this thread's
        Interleaved* pk = own.take<Interleaved>(nb);
        for (int64_t p0 = 0; p0 < rows; p0 += pass) {  // row passes (see i8_pass_rows)
            const int64_t np = p0 + pass < rows ? pass : rows - p0;
            const Q8Rows xp = i8_offset(x, p0, k, nb);
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < nchunks; ++c) {  // static: every pass gives a thread the same chunks
                const int64_t c0 = c * ICOLS, ncols = c0 + ICOLS < n ? ICOLS : n - c0;
                const bool next_full = c0 + 2 * ICOLS <= n;
                interleave_columns<QT>(w + c0 * row_bytes, row_bytes, ncols, nb, pk,
                                       next_full ? w + (c0 + ICOLS) * row_bytes : nullptr);
                interleaved_rows<QT>(xp, np, k, nb, pk, y + p0 * ystride + c0, ystride, ncols);
            }
        }
    }
}
#endif

#include "qmatmul_i8_packed.h"

// Output columns [c0, c1) of rows <= RT quantized rows (c0 a multiple of I8_CHUNK): one task of
// decode_step.h's int8 phases, the same arithmetic per column as qmatmul_i8. scratch: i8_chunk_scratch(nb)
// bytes of the calling thread's own.
constexpr int64_t I8_CHUNK = 16;
static inline int64_t i8_chunk_scratch(int64_t nb) {
#if KV_AVX512
    return nb * static_cast<int64_t>(sizeof(Interleaved));
#else
    (void)nb;
    return 0;
#endif
}

template <int QT>
static void qmatmul_i8_chunk(const Q8Rows& xq, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                             int64_t row_bytes, float* y, int64_t ystride, int64_t c0, int64_t c1, void* scratch) {
    const int64_t nb = k / QK;
#if KV_AVX512
    Interleaved* pk = static_cast<Interleaved*>(scratch);
    for (int64_t g = c0; g < c1; g += ICOLS) {
        const int64_t ncols = g + ICOLS < n ? ICOLS : n - g;
        interleave_columns<QT>(w + g * row_bytes, row_bytes, ncols, nb, pk,
                               g + 2 * ICOLS <= n ? w + (g + ICOLS) * row_bytes : nullptr);
        interleaved_rows<QT>(xq, rows, k, nb, pk, y + g, ystride, ncols);
    }
#else
    (void)scratch;
    const int64_t ahead = c1 + I8_CHUNK <= n ? I8_CHUNK : 0;  // the next task's weights, spread over the tiles
    const WSource src{nullptr, w + c0 * row_bytes, row_bytes};
    float* yc = y + c0;
    if (rows >= 4) i8_cols<4, QT>(xq, k, nb, src, c1 - c0, yc, ystride, ahead);
    else if (rows == 3) i8_cols<3, QT>(xq, k, nb, src, c1 - c0, yc, ystride, ahead);
    else if (rows == 2) i8_cols<2, QT>(xq, k, nb, src, c1 - c0, yc, ystride, ahead);
    else i8_cols<1, QT>(xq, k, nb, src, c1 - c0, yc, ystride, ahead);
#endif
}

static inline void qmatmul_i8_cols(int qt, const Q8Rows& xq, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                                   int64_t row_bytes, float* y, int64_t ystride, int64_t c0, int64_t c1,
                                   void* scratch) {
    if (qt & QT_I8_PACKED) {  // row_bytes: one group's bytes (decode_step.h checked the layout)
        qmatmul_i8_packed_cols(qt & ~QT_I8_PACKED, xq, rows, k, w, n, row_bytes, y, ystride, c0, c1);
        return;
    }
    if (qt == QT_Q4_1) qmatmul_i8_chunk<QT_Q4_1>(xq, rows, k, w, n, row_bytes, y, ystride, c0, c1, scratch);
    else if (qt == QT_Q4_0) qmatmul_i8_chunk<QT_Q4_0>(xq, rows, k, w, n, row_bytes, y, ystride, c0, c1, scratch);
    else qmatmul_i8_chunk<QT_Q8_0>(xq, rows, k, w, n, row_bytes, y, ystride, c0, c1, scratch);
}

// Activation rows quantized into caller-provided buffers (q [rows, k], d and s [rows, k/32]).
static int quantize_i8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
    if (k % QK != 0) return -2;
    quantize_rows(x, rows, k, Q8Rows{q, d, s, nullptr, nullptr});
    return 0;
}

// qmatmul_i8 for a weight packed by pack_i8 (qt: its GGUF type; gstride: one group's bytes, nb * the packed
// block's).
static int qmatmul_i8_prepacked(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* pw, int64_t n,
                                int64_t gstride, float* y, int64_t ystride) {
    if (!i8_packable(qt)) return -1;
    if (gstride != k / QK * packed_block_bytes(qt)) return -2;
    if (rows <= 0 || n <= 0) return 0;
    const int64_t nb = k / QK;
    ScratchScope scope;  // scratch.h
    int8_t* q = scope.take<int8_t>(rows * k);
    float* ds = scope.take<float>(2 * rows * nb);
    const Q8Rows xq{q, ds, ds + rows * nb, nullptr, nullptr};
    quantize_rows(x, rows, k, xq);
    qmatmul_i8_packed(qt, xq, rows, k, pw, n, gstride, y, ystride);
    return 0;
}

// y[r * ystride + c] = dot(x row r, weight row c) with x quantized to int8 blocks first (same signature as
// qmatmul; the quantized activations live in a scratch buffer for the call).
static int qmatmul_i8(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                      int64_t row_bytes, float* y, int64_t ystride) {
    if (k % QK != 0) return -2;
    const int64_t nb = k / QK, lanes = nb * LANES;
    if (qt & QT_I8_PACKED) return qmatmul_i8_prepacked(qt & ~QT_I8_PACKED, x, rows, k, w, n, row_bytes, y, ystride);
    if (qt != QT_Q4_0 && qt != QT_Q4_1 && qt != QT_Q8_0) return -1;
    if (row_bytes > (int64_t(1) << 26)) return -2;  // the AVX-512 path gathers 16 rows by int32 offsets
    if (rows <= 0 || n <= 0) return 0;
    // Scratch for the call: q, then d, s (and the AVX2 kernel's dv, sv) in one float buffer.
    ScratchScope scope;  // scratch.h
    int8_t* q = scope.take<int8_t>(rows * k);
    float* ds = scope.take<float>(2 * rows * nb + 2 * rows * lanes);
#if KV_AVX512
    const Q8Rows xq{q, ds, ds + rows * nb, nullptr, nullptr};  // the interleaved kernel scales by d and s
#else
    const Q8Rows xq{q, ds, ds + rows * nb, ds + 2 * rows * nb, ds + 2 * rows * nb + rows * lanes};
#endif
    quantize_rows(x, rows, k, xq);
#if KV_AVX512
    if (qt == QT_Q4_1) qmatmul_i8_interleaved<QT_Q4_1>(xq, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_i8_interleaved<QT_Q4_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    else qmatmul_i8_interleaved<QT_Q8_0>(xq, rows, k, w, n, row_bytes, y, ystride);
#else
    if (qt == QT_Q4_1) qmatmul_i8_t<QT_Q4_1>(xq, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qmatmul_i8_t<QT_Q4_0>(xq, rows, k, w, n, row_bytes, y, ystride);
    else qmatmul_i8_t<QT_Q8_0>(xq, rows, k, w, n, row_bytes, y, ystride);
#endif
    return 0;
}
