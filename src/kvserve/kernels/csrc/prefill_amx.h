// Prefill attention's two products over a bf16 pool on AMX-BF16 tiles (Sapphire Rapids and later): included by
// prefill.h inside the AVX-512 namespace when the compiler has AMX; runs only where kv_amx_exact() found
// AMX-BF16 and Linux granted the tile state (the switch the exact path's wide GEMM uses), for head dims that are
// multiples of 32. S = 1 (PF_TILES, ATTN_BF16): the rounded queries and probabilities, the pair products'
// arithmetic. S = 3 (PF_EXACT_TILES, ATTN_F32): each float32 query and probability as three bf16 parts that sum
// to it exactly (as qgemm_amx.h splits activations), so with bf16 keys and values every product is the FMAs'
// exact float32 one; only the order of the float32 sums differs.
//
// Why: on that CPU vdpbf16ps issues once a cycle (the pair products ran 0.7x the float32 FMAs there), while
// one TDPBF16PS multiplies 16 x 16 x 32 bf16 pairs in ~16 cycles, 16x the FMAs' products per cycle (three
// parts still ~5x). The softmax between the two products stays prefill.h's.
//
// Layouts, per online-softmax step of n <= KEY_STEP keys and the Mp stacked queries:
//   Q x K^T: C (tmm4, 5) = 16 keys x 16 queries of w.s (key-major, as the softmax reads it); A (tmm0) = 16 key
//   rows, 32 dims each, read from the pool in place when the 16 keys sit in one block (else copied into the
//   value-pair buffer, not yet in use); B (tmm1, 2) = 16 dim pairs x 16 queries of qp, as pf_round_queries
//   already lays them out.
//   P x V: C = 16 queries x 16 dims of w.acc (loaded, accumulated, stored back after the correction); A = 16
//   queries x 16 key pairs of the probabilities, query-major (transposed from the key-major softmax through
//   transpose16_dwords into w.pp); B (tmm1, 2) = 16 key pairs x 16 dims of vp (pf_pack_values).

constexpr int64_t PA = 16;  // tile rows, and float32 / bf16-pair columns
constexpr int64_t PA_PAIRS = PREFILL_KEY_STEP / 2;  // probability pairs of a step: a row of query-major pp

static inline bool pa_tiles(int64_t D) { return kv_amx_exact() && D % 32 == 0; }

static inline void pa_begin() {  // this thread's tile configuration (simd.h), before its first tile
    static const AmxBf16TileConfig config;
    _tile_loadconfig(&config);
}

// The bf16 pair of two split_bf16x3 parts (simd.h): each part is exactly a bf16 value, so its bits are the
// float's top half.
static inline __m512i pa_part_pair(V even, V odd) {
    return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                           _mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// PF_EXACT_TILES: the scaled float32 queries (w.qt) as three arrays of bf16 pairs, qp + part * D / 2 * Mp.
static void pa_split_queries(PrefillScratch w, int64_t Mp, int64_t D) {
    for (int64_t d2 = 0; d2 < D / 2; ++d2)
        for (int64_t m = 0; m < Mp; m += W) {
            V even[3], odd[3];
            split_bf16x3(vload(w.qt + 2 * d2 * Mp + m), even);
            split_bf16x3(vload(w.qt + (2 * d2 + 1) * Mp + m), odd);
            for (int part = 0; part < 3; ++part)
                _mm512_storeu_si512(w.qp + (part * D / 2 + d2) * Mp + m, pa_part_pair(even[part], odd[part]));
        }
}

// Query lanes m..m+W's pair i2 of probabilities (keys 2 * i2, 2 * i2 + 1; a key at or past n is 0) as the bf16
// pairs of their three split_bf16x3 parts (S == 3, exact): each split once for all three.
static inline void pa_prob_part_pairs(const float* s, int64_t Mp, int64_t n, int64_t i2, int64_t m, __m512i* out) {
    V even[3], odd[3];
    split_bf16x3(2 * i2 < n ? vload(s + 2 * i2 * Mp + m) : vzero(), even);
    split_bf16x3(2 * i2 + 1 < n ? vload(s + (2 * i2 + 1) * Mp + m) : vzero(), odd);
    for (int part = 0; part < 3; ++part) out[part] = pa_part_pair(even[part], odd[part]);
}

// 16 rows of pairs (one per key pair) transposed into w.pp's query-major rows of `part`: query tile c, pair tile p.
static inline void pa_store_pairs(PrefillScratch w, int64_t Mp, int part, int64_t c, int64_t p, __m512i* r) {
    transpose16_dwords(r);
    for (int64_t j = 0; j < PA; ++j) _mm512_storeu_si512(w.pp + (part * Mp + c * PA + j) * PA_PAIRS + p * PA, r[j]);
}

// w.s[r * Mp + m] = key r . query m (queries in w.qp: S parts) for the step's keys k0..k0+n of block size bs;
// rows n..16 * ceil(n / 16) of w.s get values nobody reads.
// KT: a bf16 pool's rows, read in place where they can be; an fp8 pool's, always copied widened to bf16.
template <int S, typename KT>
static void pa_scores(PrefillScratch w, int64_t Mp, int64_t D, const KT* const* krow, int64_t n, int64_t k0,
                      int64_t bs) {
    bf16_t* copy = reinterpret_cast<bf16_t*>(w.vp);  // [KEY_STEP, D]: free until pf_pack_values
    const int64_t nq = Mp / PA, nk = D / 32;
    for (int64_t r0 = 0; r0 < n; r0 += PA) {
        const int64_t nr = n - r0 < PA ? n - r0 : PA;
        const bf16_t* rows = copy + r0 * D;
        int64_t stride = D * 2;
        if constexpr (sizeof(KT) == 1) {
            for (int64_t i = 0; i < nr; ++i)
                for (int64_t c = 0; c < D; c += W)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(copy + (r0 + i) * D + c),
                                        _mm512_cvtepi32_epi16(pf_bf16_lanes(krow[r0 + i] + c)));
        } else {
            const int64_t apart = (krow[r0 + 1 < n ? r0 + 1 : r0] - krow[r0]) * 2;  // bytes between the rows
            if (nr == PA && (k0 + r0) / bs == (k0 + r0 + PA - 1) / bs && apart > 0) {  // one block's run: in place
                rows = krow[r0];
                stride = apart;
            } else {
                for (int64_t i = 0; i < nr; ++i) __builtin_memcpy(copy + (r0 + i) * D, krow[r0 + i], D * 2);
            }
        }
        for (int64_t c = 0; c < nq; c += 2) {
            const bool two = c + 1 < nq;
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t j = 0; j < nk; ++j) {
                _tile_loadd(0, rows + 32 * j, stride);
                for (int part = 0; part < S; ++part) {
                    const uint32_t* qp = w.qp + (part * D / 2 + PA * j) * Mp;
                    _tile_loadd(1, qp + PA * c, Mp * 4);
                    _tile_dpbf16ps(4, 0, 1);
                    if (two) {
                        _tile_loadd(2, qp + PA * (c + 1), Mp * 4);
                        _tile_dpbf16ps(5, 0, 2);
                    }
                }
            }
            _tile_stored(4, w.s + r0 * Mp + PA * c, Mp * 4);
            if (two) _tile_stored(5, w.s + r0 * Mp + PA * (c + 1), Mp * 4);
        }
    }
}

// w.acc = w.acc x corr + P x V over the step's n keys (probabilities in w.s, key-major; S parts of each).
template <int S, typename KT>
static void pa_values(PrefillScratch w, int64_t Mp, int64_t D, const KT* const* vrow, int64_t n) {
    const int64_t n2 = (n + 1) / 2, np = (n2 + PA - 1) / PA, nq = Mp / PA, nd = D / PA;
    pf_pack_values(w, D, vrow, n);
    for (int64_t e = n2 * D; e < np * PA * D; e += W) _mm512_storeu_si512(w.vp + e, _mm512_setzero_si512());
    for (int64_t c = 0; c < nq; ++c)  // pp[part][m * PA_PAIRS + i2]: query m's probability pair i2
        for (int64_t p = 0; p < np; ++p) {
            __m512i r[PA];
            if (S == 1) {  // rounded (ATTN_BF16)
                for (int64_t i = 0; i < PA; ++i) r[i] = pf_prob_pair(w.s, Mp, n, p * PA + i, c * PA);
                pa_store_pairs(w, Mp, 0, c, p, r);
                continue;
            }
            __m512i later[2][PA];  // parts 1 and 2 wait while part 0's rows are transposed
            for (int64_t i = 0; i < PA; ++i) {
                __m512i parts[3];
                pa_prob_part_pairs(w.s, Mp, n, p * PA + i, c * PA, parts);
                r[i] = parts[0];
                later[0][i] = parts[1];
                later[1][i] = parts[2];
            }
            pa_store_pairs(w, Mp, 0, c, p, r);
            pa_store_pairs(w, Mp, 1, c, p, later[0]);
            pa_store_pairs(w, Mp, 2, c, p, later[1]);
        }
    // acc rows x corr, one query tile's 16 rows ahead of the tiles that load them (a tile load right after vector
    // stores to its rows waits for them); a row whose max held (most, once its first keys are in) keeps its acc.
    const auto rescale = [&](int64_t c) {
        for (int64_t m = c * PA; m < (c + 1) * PA; ++m) {
            if (w.corr[m] == 1.0f) continue;
            const V cr = vset1(w.corr[m]);
            for (int64_t e = 0; e < D; e += W) vstore(w.acc + m * D + e, vmul(vload(w.acc + m * D + e), cr));
        }
    };
    rescale(0);
    for (int64_t c = 0; c < nq; ++c) {
        if (c + 1 < nq) rescale(c + 1);
        for (int64_t d = 0; d < nd; d += 2) {
            const bool two = d + 1 < nd;
            float* out = w.acc + c * PA * D + d * PA;
            _tile_loadd(4, out, D * 4);
            if (two) _tile_loadd(5, out + PA, D * 4);
            for (int64_t p = 0; p < np; ++p) {
                _tile_loadd(1, w.vp + p * PA * D + d * PA, D * 4);
                if (two) _tile_loadd(2, w.vp + p * PA * D + (d + 1) * PA, D * 4);
                for (int part = 0; part < S; ++part) {
                    _tile_loadd(0, w.pp + (part * Mp + c * PA) * PA_PAIRS + p * PA, PA_PAIRS * 4);
                    _tile_dpbf16ps(4, 0, 1);
                    if (two) _tile_dpbf16ps(5, 0, 2);
                }
            }
            _tile_stored(4, out, D * 4);
            if (two) _tile_stored(5, out + PA, D * 4);
        }
    }
}
