// The exact path's wide GEMM on AMX-BF16 tiles (Sapphire Rapids and later), for 16 or more activation rows:
// y = x @ W.T with float32 activations and W in GGUF blocks (Q4_0, Q4_1, Q8_0) or bf16 rows, exact to the
// dequantized weights up to summation order -- as qgemm.h, whose contract it keeps (qgemm dispatches here).
// Included by qgemm.h inside the AVX-512 namespace only; runs only where kv_amx_enable() found AMX-BF16 and
// Linux granted the tile state.
//
// Why a bf16 tile product can be exact here: a bf16 value has an 8-bit significand, and a tile multiplies
// bf16 pairs exactly and sums in float32. Every float32 activation is the sum of three bf16 values (hi: its
// top 8 significant bits, mid: the next 8, lo: the last 8; each remainder is exact in float32). Every
// quantized weight's d * q is exact in float32 with few significant bits -- d is fp16 (11 bits), q a small
// integer (Q4: 0..15 or -8..7, 4 bits; Q8_0: 8 bits) -- so it too is the sum of two (Q4) or three (Q8_0)
// bf16 pieces; bf16 rows are one piece. Then x * (d q) is the sum of 3 x pieces products, each exact, and
// the tile sums them over the whole k in float32: no per-block epilogue (the block scales are inside the
// pieces). Q4_1's + m is sum_b m_b * sum(x over block b): one more tile block per 32 blocks, the m's (fp16,
// two exact pieces) against the block sums (float32, three splits). What differs from qgemm.h is only
// rounding: the order of the float32 sums, and for Q4_1 that d * q + m is not rounded to float32 before it
// multiplies (qgemm.h's panel rounds it).
//
// Measured on a Sapphire-Rapids-class Xeon: TDPBF16PS 5.2 ns, a tile store 4.8 ns, a load 2.5; the tile loop
// alone runs at ~1.4 T bf16 multiply-adds per second per core, which 3 x P products make ~230 G exact ones
// for Q4. A first version (q as bf16, d and m applied per block from a stored tile, as qmatmul_amx.h does)
// reached 1.3-1.9x qgemm.h's rate; this one 1.3-1.7x for Q4 from 64 rows, 2-3x for bf16 rows (unpacking the
// pieces per task is what is left beside the products; Q4_1's m term, first an FMA loop per output after the
// tiles, cost ~20% until it became a tile block). Tried, no faster: 256-row tasks; k slices with the products
// kept in memory between them (so the A tiles of a slice stay in L1).
//
// Layout (the weights are A, so their GGUF rows unpack without a transpose): A (tmm5) is one piece of one
// block of 16 weight rows, 32 bf16 = 64 bytes a row, unpacked per task; B (tmm2..4) is one split of one block
// of 16 activation rows in AMX's pair layout (row t: the 16 activation rows' inputs 2t and 2t + 1), packed
// once per call; C (tmm0, 1, 6, 7) is 16 weight rows x 16 activation rows of float32 for each of up to four
// column tiles, transposed into y when it is stored.

constexpr int64_t GA_ROWS = 16;   // activation rows per tile
constexpr int64_t GA_COLS = 16;   // output columns per tile
constexpr int64_t GA_CHUNK = 4;   // column tiles per task: their A tiles are unpacked once per task
constexpr int64_t GA_SUPER = 128; // activation rows per task: each task's A tiles serve this many (256: slower)

// From how many activation rows the tiles beat qgemm.h's float32 GEMM (benchmarks/amx.py, 2 threads): bf16
// rows from one tile of rows (1.9x at 16); Q4 from three (0.85-1.7x alone at 32, but 32-row decode steps ran
// 3-5% slower end to end; 1.1-1.9x at 64-2,048); Q8_0's three pieces from four (the 49k-row tied head: 0.5x
// at 16, 1.0x at 32, 1.1-1.5x at 64), because each task unpacks its weights once for at most GA_SUPER rows
// and a few rows do not repay that.
static inline bool amx_exact_pays(int qt, int64_t rows) {
    const int64_t least = qt == QT_BF16 ? 16 : qt == QT_Q8_0 ? 64 : qt == QT_Q4_0 || qt == QT_Q4_1 ? 48 : -1;
    return least > 0 && rows >= least && kv_amx_exact();
}

#if KV_HAS_AMX
static inline __m512i ga_bf16_pair(__m512 lo16, __m512 hi16) {  // 2 x 16 floats (bf16 already) -> 32 bf16
    const __m256i a = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo16), 16));
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi16), 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Tile blocks of k: its nb blocks, and for Q4_1 ceil(nb / 32) more that carry sum_b m_b * sum(x over block b)
// as one more product (A: the blocks' m, B: the activations' block sums).
template <int QT>
static inline int64_t ga_blocks(int64_t nb) { return nb + (QT == QT_Q4_1 ? (nb + 31) / 32 : 0); }

// 16 x 32 floats (row r at src + r * stride) as their three bf16 splits in AMX's B layout, at dst + s KiB.
static inline void ga_pack_b(const float* src, int64_t stride, uint8_t* dst) {
    __m512i part[3][GA_ROWS];
    for (int64_t r = 0; r < GA_ROWS; ++r) {
        __m512 lo[3], hi[3];
        split_bf16x3(_mm512_loadu_ps(src + r * stride), lo);
        split_bf16x3(_mm512_loadu_ps(src + r * stride + 16), hi);
        for (int s = 0; s < 3; ++s) part[s][r] = ga_bf16_pair(lo[s], hi[s]);
    }
    for (int s = 0; s < 3; ++s) {
        transpose16_dwords(part[s]);
        for (int t = 0; t < 16; ++t) _mm512_store_si512(dst + s * 1024 + t * 64, part[s][t]);
    }
}

// x's rows [16 g, 16 g + 16) (rows past `rows` zero) as B tiles: tile block b, split s at xb + (b * 3 + s)
// KiB. Q4_1's extra blocks hold each row's block sums (float32), through `sums` (16 x nbp, zero padded).
template <int QT>
static inline void ga_pack_rows(const float* x, int64_t g, int64_t rows, int64_t k, uint8_t* xb, float* sums) {
    const int64_t nb = k / QK, nbp = (ga_blocks<QT>(nb) - nb) * 32;
    alignas(64) float block[GA_ROWS][QK];
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t r = 0; r < GA_ROWS; ++r) {
            const int64_t row = g * GA_ROWS + r;
            for (int64_t i = 0; i < QK; i += 16)
                _mm512_store_ps(block[r] + i, row < rows ? _mm512_loadu_ps(x + row * k + b * QK + i) : _mm512_setzero_ps());
            if (QT == QT_Q4_1)
                sums[r * nbp + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_load_ps(block[r]), _mm512_load_ps(block[r] + 16)));
        }
        ga_pack_b(block[0], QK, xb + b * 3 * 1024);
    }
    if (QT == QT_Q4_1) {
        for (int64_t r = 0; r < GA_ROWS; ++r)
            for (int64_t b = nb; b < nbp; ++b) sums[r * nbp + b] = 0.0f;
        for (int64_t e = 0; e < nbp / 32; ++e) ga_pack_b(sums + e * 32, nbp, xb + (nb + e) * 3 * 1024);
    }
}

// bf16 pieces of each weight's d * q (bf16 rows: the weight itself) per block.
template <int QT>
constexpr int ga_pieces() { return QT == QT_BF16 ? 1 : QT == QT_Q8_0 ? 3 : 2; }

// One weight row's block as its bf16 pieces, 32 bf16 each in input order. Q4: the block's 16 possible values
// of d * q, split, then one permute per piece.
template <int QT>
static inline void ga_block_pieces(const uint8_t* blk, const float* half, __m512i* piece) {
    if (QT == QT_BF16) {
        piece[0] = _mm512_loadu_si512(blk);
        return;
    }
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    const __m512 d = _mm512_set1_ps(half[h]);
    if (QT == QT_Q8_0) {
        const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
        __m512 lo[3], hi[3];
        split_bf16x3(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)))), lo);
        split_bf16x3(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)))), hi);
        for (int p = 0; p < 3; ++p) piece[p] = ga_bf16_pair(lo[p], hi[p]);
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_mul_ps(d, QT == QT_Q4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)) : iota);
    __m512 part[3];
    split_bf16x3(values, part);  // d * q has at most 15 significant bits: hi + mid, lo is zero
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == QT_Q4_1 ? 4 : 2)));
    const __m128i low = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), high = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1));
    for (int p = 0; p < 2; ++p) {
        const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(part[p]), 16)));
        piece[p] = _mm512_permutexvar_epi16(q, table);
    }
}

// Weight rows [n0, n0 + 16) (rows past n are zero): each block's pieces as A tiles of 1 KiB (tile block b,
// piece p at (b * P + p) KiB). Q4_1's extra blocks hold the rows' m (fp16: 11 significant bits, so hi + mid is
// exact), gathered through `m` (16 x nbp).
template <int QT>
static inline void ga_unpack_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n, int64_t nb,
                                  uint8_t* at, float* m) {
    constexpr int64_t BB = block_bytes(QT);
    constexpr int P = ga_pieces<QT>();
    const float* half = kv_half_table();
    const int64_t live = n - n0 < GA_COLS ? n - n0 : GA_COLS, nbp = (ga_blocks<QT>(nb) - nb) * 32;
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t c = 0; c < GA_COLS; ++c) {
            __m512i piece[P];
            if (c < live) {
                const uint8_t* blk = w + (n0 + c) * row_bytes + b * BB;
                ga_block_pieces<QT>(blk, half, piece);
                if (QT == QT_Q4_1) {
                    uint16_t h;
                    __builtin_memcpy(&h, blk + 2, 2);
                    m[c * nbp + b] = half[h];
                }
            } else {
                for (int p = 0; p < P; ++p) piece[p] = _mm512_setzero_si512();
                if (QT == QT_Q4_1) m[c * nbp + b] = 0.0f;
            }
            for (int p = 0; p < P; ++p) _mm512_store_si512(at + (b * P + p) * 1024 + c * 64, piece[p]);
        }
    if (QT == QT_Q4_1)
        for (int64_t c = 0; c < GA_COLS; ++c) {
            for (int64_t b = nb; b < nbp; ++b) m[c * nbp + b] = 0.0f;
            for (int64_t e = 0; e < nbp / 32; ++e) {
                __m512 lo[3], hi[3];
                split_bf16x3(_mm512_loadu_ps(m + c * nbp + e * 32), lo);
                split_bf16x3(_mm512_loadu_ps(m + c * nbp + e * 32 + 16), hi);
                for (int p = 0; p < P; ++p)
                    _mm512_store_si512(at + ((nb + e) * P + p) * 1024 + c * 64, ga_bf16_pair(lo[p], hi[p]));
            }
        }
}

// GCC's tile intrinsics need literal tile numbers: column tile t's product is tmm0, 1, 6 or 7.
#define GA_DP3(C)                    \
    do {                             \
        _tile_dpbf16ps(C, 5, 2);     \
        _tile_dpbf16ps(C, 5, 3);     \
        _tile_dpbf16ps(C, 5, 4);     \
    } while (0)

static inline void ga_accumulate(int64_t t) {
    if (t == 0) GA_DP3(0);
    else if (t == 1) GA_DP3(1);
    else if (t == 2) GA_DP3(6);
    else GA_DP3(7);
}

// 16 activation rows (their B tiles xb) x the task's column tiles [0, nt), every tile block (nbt) and piece,
// into acc (nt tiles of 16 weight rows x 16 activation rows).
template <int QT>
static inline void ga_tile_rows(const uint8_t* xb, int64_t nbt, int64_t nt, const uint8_t* at, float* acc) {
    constexpr int P = ga_pieces<QT>();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t b = 0; b < nbt; ++b) {
        _tile_loadd(2, xb + (b * 3) * 1024, 64);
        _tile_loadd(3, xb + (b * 3 + 1) * 1024, 64);
        _tile_loadd(4, xb + (b * 3 + 2) * 1024, 64);
        for (int64_t t = 0; t < nt; ++t)
            for (int p = 0; p < P; ++p) {
                _tile_loadd(5, at + ((t * nbt + b) * P + p) * 1024, 64);
                ga_accumulate(t);
            }
    }
    _tile_stored(0, acc, 64);
    if (nt > 1) _tile_stored(1, acc + 256, 64);
    if (nt > 2) _tile_stored(6, acc + 512, 64);
    if (nt > 3) _tile_stored(7, acc + 768, 64);
}

// acc (nt tiles of 16 weight rows x 16 activation rows) into y, transposed: the rows that exist, the columns
// below n.
static inline void ga_store(const float* acc, int64_t nt, int64_t n0, int64_t n, int64_t rows_left, float* y,
                            int64_t ystride) {
    const int64_t live = rows_left < GA_ROWS ? rows_left : GA_ROWS;
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t c0 = n0 + t * GA_COLS, last = n - c0 < GA_COLS ? n - c0 : GA_COLS;
        const __mmask16 keep = static_cast<__mmask16>((1u << last) - 1u);
        __m512i r[16];
        for (int c = 0; c < 16; ++c) r[c] = _mm512_load_si512(acc + t * 256 + c * 16);
        transpose16_dwords(r);
        for (int64_t j = 0; j < live; ++j) _mm512_mask_storeu_ps(y + j * ystride + c0, keep, _mm512_castsi512_ps(r[j]));
    }
}

template <int QT>
static void qgemm_amx_t(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, int64_t row_bytes,
                        float* y, int64_t ystride) {
    constexpr int P = ga_pieces<QT>();
    const int64_t nb = k / QK, groups = (rows + GA_ROWS - 1) / GA_ROWS;
    const int64_t ntiles = (n + GA_COLS - 1) / GA_COLS, nchunks = (ntiles + GA_CHUNK - 1) / GA_CHUNK;
    const int64_t per_super = GA_SUPER / GA_ROWS, nsuper = (groups + per_super - 1) / per_super;
    const int64_t nbt = ga_blocks<QT>(nb), nbp = (nbt - nb) * 32, group_bytes = nbt * 3 * 1024;
    ScratchScope scope;  // scratch.h
    uint8_t* xb = scope.take<uint8_t>(groups * group_bytes);
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // this thread's
        uint8_t* at = own.take<uint8_t>(GA_CHUNK * nbt * P * 1024);
        float* sums = QT == QT_Q4_1 ? own.take<float>(GA_ROWS * nbp) : nullptr;
        float* m = QT == QT_Q4_1 ? own.take<float>(GA_COLS * nbp) : nullptr;
        float* acc = own.take<float>(GA_CHUNK * 256);
        static const AmxBf16TileConfig config;  // simd.h
        _tile_loadconfig(&config);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) ga_pack_rows<QT>(x, g, rows, k, xb + g * group_bytes, sums);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < nsuper * nchunks; ++task) {
            const int64_t s = task / nchunks, ch = task % nchunks;
            const int64_t t0 = ch * GA_CHUNK, nt = t0 + GA_CHUNK < ntiles ? GA_CHUNK : ntiles - t0;
            for (int64_t t = 0; t < nt; ++t)
                ga_unpack_tile<QT>(w, row_bytes, (t0 + t) * GA_COLS, n, nb, at + t * nbt * P * 1024, m);
            const int64_t g1 = (s + 1) * per_super < groups ? (s + 1) * per_super : groups;
            for (int64_t g = s * per_super; g < g1; ++g) {
                ga_tile_rows<QT>(xb + g * group_bytes, nbt, nt, at, acc);
                ga_store(acc, nt, t0 * GA_COLS, n, rows - g * GA_ROWS, y + g * GA_ROWS * ystride, ystride);
            }
        }
        _tile_release();
    }
}

static inline void qgemm_amx(int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                             int64_t row_bytes, float* y, int64_t ystride) {
    if (qt == QT_Q4_1) qgemm_amx_t<QT_Q4_1>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q4_0) qgemm_amx_t<QT_Q4_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else if (qt == QT_Q8_0) qgemm_amx_t<QT_Q8_0>(x, rows, k, w, n, row_bytes, y, ystride);
    else qgemm_amx_t<QT_BF16>(x, rows, k, w, n, row_bytes, y, ystride);
}
#undef GA_DP3
#else
static inline void qgemm_amx(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                             int64_t) {}  // never called: amx_exact_pays is false without kv_amx_enable
#endif  // KV_HAS_AMX
