// Prefill attention through the pool: a chunk of a prompt's tokens (after cached or earlier-chunked
// tokens, or the first chunk) attends causally to its sequence's keys in place, compiled once per ISA
// like impl.h (included after simd.h).
//
// paged_attention (decode_attention.h) treats every query row as its own sequence: each row streams its whole context
// for its G heads -- a decode kernel (the earlier one, one horizontal sum per key: ~11 GMAC/s per core on a 112-token chunk
// over 2,000 keys (this: ~46; gather + torch's flash SDPA: ~36; MKL's fp32 GEMM peak: ~80)). Here a task is (span, KV head, tile of QT tokens): the tile's QT x G queries are stacked,
// transposed once ([D, M], queries in vector lanes) and meet every key of the span as a small matrix
// product -- each key row is loaded once per tile and broadcast against all M queries, softmax max / sum /
// rescale are vector ops across the queries, and P x V runs as a register-blocked rank-1 update. Keys go
// in steps of KEY_STEP (any mix of pool blocks); only steps reaching past the tile's first position need
// the causal mask (a masked probability is set to exactly 0). Tasks run in parallel (dynamic schedule).
// cascade.h runs its shared part (stacked decode queries, no mask) on the same pieces: pf_begin,
// pf_put_query, pf_attend.
//
// C entry (kernels.cpp: kv_prefill_attention): q [T, H, D]; K/V pools [blocks, bs, KVH, D]; span s owns
// query rows [span_start[s], span_start[s] + span_len[s]), ends at context length span_ctx[s] (so row i
// of the span sits at position span_ctx[s] - span_len[s] + i and sees keys 0..that), its block table at
// tables + s * table_stride. out [T, H, D] (rows of no span are left untouched).

constexpr int64_t PREFILL_TILE_TOKENS = 32;  // query tokens per task (x G heads stacked)
constexpr int64_t PREFILL_KEY_STEP = 64;     // keys per online-softmax step (even: keys pair up below)
// Steps whose probabilities the AMX bf16 route keeps before multiplying them by the values (prefill_amx.h's
// pa_step): w.pp holds this many steps' pairs -- or one step's three parts on the exact tiles.
constexpr int64_t PF_PP_SLOTS = 3;

// The attention products (`--attention-dtype`). ATTN_F32: float32 queries and probabilities, the FMAs below.
// ATTN_BF16 (a bf16 pool only): queries and, after the softmax, the unnormalised probabilities rounded to bf16
// (nearest even), every product then exact in float32 and summed in float32 -- llama.cpp's 16-bit KV path and
// torch's bf16 attention round the same operands. On a CPU with AVX512-BF16 the products run as pair dot
// products (vdpbf16ps: two bf16 products a lane per instruction, twice the float32 FMA's rate; queries paired
// along the head dimension for Q x K^T, keys paired for P x V); elsewhere float32 FMAs on the rounded values
// give the same products in another order; on a CPU with AMX-BF16, tiles run both products (prefill_amx.h).
// The running max, the sums and the rescaling stay float32.
enum : int { ATTN_F32 = 0, ATTN_BF16 = 1 };
#if KV_AVX512
constexpr int PF_KR = 4, PF_QV = 4, PF_VR = 4, PF_VC = 4;  // register tiles: 32 zmm registers
#else
// 16 ymm registers. Scores 4 keys x 3 query vectors (12 accumulators, 3 loads + 4 broadcasts per input) ran
// 1.10x the 2 x 4 tiles' 8 (prefill attention of one 512- or 2,048-token span, Zen 3, 2 threads, interleaved;
// the same floats: each score is its own dot in input order either way); values 4 x 3 or 6 x 2 gained ~1%.
constexpr int PF_KR = 4, PF_QV = 3, PF_VR = 2, PF_VC = 4;
#endif

// s[r * Mp + lanes of c] = K row r . queries (qt [D, Mp], vector columns mv..mv+QV) for KR keys.
template <int KR, int QV, typename KT>
static inline void pf_scores_tile(const KT* const* krow, const float* qt, int64_t Mp, int64_t D, int64_t mv,
                                  float* s) {
    V a[KR][QV];
    for (int r = 0; r < KR; ++r)
        for (int c = 0; c < QV; ++c) a[r][c] = vzero();
    for (int64_t d = 0; d < D; ++d) {
        V qv[QV];
        for (int c = 0; c < QV; ++c) qv[c] = vload(qt + d * Mp + (mv + c) * W);
        for (int r = 0; r < KR; ++r) {
            const V kb = vset1(kvscalar(krow[r] + d));
            for (int c = 0; c < QV; ++c) a[r][c] = vfma(kb, qv[c], a[r][c]);
        }
    }
    for (int r = 0; r < KR; ++r)
        for (int c = 0; c < QV; ++c) vstore(s + r * Mp + (mv + c) * W, a[r][c]);
}

template <int N>
struct PfCount {
    static constexpr int value = N;
};

// tile(PfCount<QV>{}, mv) over the MV query vectors: PF_QV at a time, then the 1-3 left.
template <typename Tile>
static inline void pf_query_vectors(int64_t MV, Tile tile) {
    int64_t mv = 0;
    for (; mv + PF_QV <= MV; mv += PF_QV) tile(PfCount<PF_QV>{}, mv);
    if (MV - mv == 3) tile(PfCount<3>{}, mv);
    else if (MV - mv == 2) tile(PfCount<2>{}, mv);
    else if (MV - mv == 1) tile(PfCount<1>{}, mv);
}

template <int KR, typename KT>
static inline void pf_scores_keys(const KT* const* krow, const float* qt, int64_t Mp, int64_t D, float* s) {
    pf_query_vectors(Mp / W, [&](auto qv, int64_t mv) {
        pf_scores_tile<KR, decltype(qv)::value>(krow, qt, Mp, D, mv, s);
    });
}

// a = acc[m..m+R, vectors c0..c0+C) x corr (the values tiles' accumulators), and back.
template <int R, int C>
static inline void pf_acc_load(V (&a)[R][C], const float* acc, const float* corr, int64_t m, int64_t c0, int64_t D) {
    for (int r = 0; r < R; ++r) {
        const V cr = vset1(corr[m + r]);
        for (int c = 0; c < C; ++c) a[r][c] = vmul(vload(acc + (m + r) * D + (c0 + c) * W), cr);
    }
}
template <int R, int C>
static inline void pf_acc_store(V (&a)[R][C], float* acc, int64_t m, int64_t c0, int64_t D) {
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) vstore(acc + (m + r) * D + (c0 + c) * W, a[r][c]);
}

// acc[m, vectors c0..c0+C) = acc * corr[m] + sum_i p[i, m] * V[i] for R query rows starting at m.
template <int R, int C, typename KT>
static inline void pf_values_tile(const float* p, int64_t Mp, const KT* const* vrow, int64_t n, int64_t m,
                                  int64_t c0, const float* corr, float* acc, int64_t D) {
    V a[R][C];
    pf_acc_load(a, acc, corr, m, c0, D);
    for (int64_t i = 0; i < n; ++i) {
        V v[C];
        for (int c = 0; c < C; ++c) v[c] = kvload(vrow[i] + (c0 + c) * W);
        for (int r = 0; r < R; ++r) {
            const V pr = vset1(p[i * Mp + m + r]);
            for (int c = 0; c < C; ++c) a[r][c] = vfma(pr, v[c], a[r][c]);
        }
    }
    pf_acc_store(a, acc, m, c0, D);
}

// Lanes [0, count) of p zeroed (count clamped to [0, W]).
static inline V pf_zero_below(V p, int64_t count) {
#if KV_AVX512
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(count))), p);
#else
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i keep = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(count) - 1));
    return _mm256_and_ps(p, _mm256_castsi256_ps(keep));
#endif
}

// One probability vector of the online softmax, exp(x - max): `neg` is pf_neg_max's. EXP2 (ATTN_BF16, whose
// probabilities are rounded to bf16): 2^(x log2 e - max log2 e) through vexp2, one FMA and ~60% of vexp's uops
// (the exp pass was a third of a chat turn's attention). MASKED: lanes below `below` are the causal mask's,
// exactly 0 (the exp clamps -inf to ~1e-38). Shared with prefill_amx.h's one-pass softmax.
constexpr float PF_LOG2E = 1.44269504088896341f;
template <bool EXP2>
static inline V pf_neg_max(const float* mx) { return vmul(vload(mx), vset1(EXP2 ? -PF_LOG2E : -1.0f)); }
template <bool MASKED, bool EXP2>
static inline V pf_prob(V x, V neg, int64_t below) {
    const V p = EXP2 ? vexp2(vfma(x, vset1(PF_LOG2E), neg)) : vexp(vadd(x, neg));
    return MASKED ? pf_zero_below(p, below) : p;
}

// The running max of ATTN_BF16 and of the AMX routes (FlashAttention-4's lazy rescaling): a lane's max moves
// only when the step's exceeds it by more than PF_LAZY_MAX (probabilities up to 256 otherwise), so after a
// sequence's first keys almost every step's correction is exactly 1 and the accumulators are left alone (on
// the tiles, 16 queries a vector: pa_rescale_vector). Any max gives the same softmax; the first step (max -inf)
// always moves. Every route of one arithmetic keeps the same maxima, so they round the same probabilities.
constexpr float PF_LAZY_MAX = 5.5451774f;  // ln 256
static inline V pf_lazy_max(V mold, V step_max) {
#if KV_AVX512
    const __mmask16 moves = _mm512_cmp_ps_mask(step_max, vadd(mold, vset1(PF_LAZY_MAX)), _CMP_GT_OQ);
    return _mm512_mask_blend_ps(moves, mold, step_max);
#else
    return _mm256_blendv_ps(mold, step_max, _mm256_cmp_ps(step_max, vadd(mold, vset1(PF_LAZY_MAX)), _CMP_GT_OQ));
#endif
}

// A lane's correction when its max moves from mold to mnew, exp(mold - mnew) (the first step: mold -inf, ~1e-38,
// times a zero accumulator). One expression for pf_attend and prefill_amx.h's pa_step, so they round alike.
static inline V pf_correction(V mold, V mnew) { return vexp(vadd(mold, vmul(mnew, vset1(-1.0f)))); }

// rows[i] = KV head g's row of token k0 + i in `pool` [blocks, bs, KVH, D] through a block table, i < n: the
// slots walked without a division per token (one per key was ~7% of prefill attention under perf).
template <typename KT>
static inline void pf_rows(const KT* pool, const int64_t* table, int64_t bs, int64_t KVH, int64_t g, int64_t D,
                           int64_t k0, int64_t n, const KT** rows) {
    for (int64_t i = 0, b = k0 / bs, off = k0 % bs; i < n; ++i) {
        rows[i] = pool + ((table[b] * bs + off) * KVH + g) * D;
        if (++off == bs) off = 0, ++b;
    }
}

// Scratch of one thread: every buffer sized for the widest tile (Mp query lanes).
struct PrefillScratch {
    float* qt;    // [D, Mp] scaled queries, transposed
    float* s;     // [KEY_STEP, Mp] scores, then probabilities
    float* acc;   // [Mp, D] unnormalised outputs
    float* mx;    // [Mp] running maxima
    float* sum;   // [Mp] running sums
    float* corr;  // [Mp]
    uint32_t* qp;  // ATTN_BF16 pair products: [D / 2, Mp] bf16 query pairs (dims 2d, 2d + 1); exact tiles: 3 of
                   // them, the queries' three bf16 parts (prefill_amx.h)
    uint32_t* pp;  // [KEY_STEP / 2, Mp] bf16 probability pairs (keys 2i, 2i + 1); 3 of them: the exact tiles' three
                   // parts, or PF_PP_SLOTS steps' pairs on the bf16 tiles (prefill_amx.h's pa_step)
    uint32_t* vp;  // [KEY_STEP / 2, D] bf16 value pairs (keys 2i, 2i + 1); AMX tiles: first the step's keys, then
                   // its values as transposed tiles where the call packed none (prefill_amx.h)
    float* acct;  // [D, Mp] the AMX tiles' unnormalised outputs, transposed (acc once the keys are done)
};

// Taken from `scope` (scratch.h: the calling thread's arena), valid until it ends.
static PrefillScratch pf_scratch_new(ScratchScope& scope, int64_t Mp, int64_t D) {
    float* buf = scope.take<float>(D * Mp + PREFILL_KEY_STEP * Mp + Mp * D + 3 * Mp + D * Mp);
    float* mx = buf + D * Mp + PREFILL_KEY_STEP * Mp + Mp * D;
    static_assert(PF_PP_SLOTS <= 3, "w.pp holds three parts or PF_PP_SLOTS steps of one");
    const int64_t pp_size = 3 * PREFILL_KEY_STEP / 2 * Mp;
    uint32_t* pairs = scope.take<uint32_t>(3 * D / 2 * Mp + pp_size + PREFILL_KEY_STEP / 2 * D);
    uint32_t* pp = pairs + 3 * D / 2 * Mp;
    return PrefillScratch{buf, buf + D * Mp, buf + D * Mp + PREFILL_KEY_STEP * Mp, mx, mx + Mp, mx + 2 * Mp,
                          pairs, pp, pp + pp_size, mx + 3 * Mp};
}

// Whether ATTN_BF16 runs as pair dot products here: a bf16 pool, the AVX-512 build, a CPU with AVX512-BF16 where
// they pay (kv_bf16_pairs).
template <typename KT>
static inline bool pf_pair_products() {
#if KV_AVX512 && KV_HAS_BF16
    return sizeof(KT) == 2 && kv_pairs_on();
#else
    return false;
#endif
}

// ATTN_BF16's rounding of the Mp x D queries: in place (float32 FMAs), or into bf16 pairs (pair products, tiles).
static void pf_round_queries(PrefillScratch w, int64_t Mp, int64_t D, bool pairs) {
    if (!pairs) {
        for (int64_t e = 0; e < D * Mp; e += W) vstore(w.qt + e, vround_bf16(vload(w.qt + e)));
        return;
    }
#if KV_AVX512
    for (int64_t d2 = 0; d2 < D / 2; ++d2)
        for (int64_t m = 0; m < Mp; m += W) {
            const __m512i lo = vbf16_bits(vload(w.qt + 2 * d2 * Mp + m));
            const __m512i hi = vbf16_bits(vload(w.qt + (2 * d2 + 1) * Mp + m));
            _mm512_storeu_si512(w.qp + d2 * Mp + m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
#endif
}

#if KV_AVX512 && KV_HAS_BF16
static inline __m512bh as_bf16x32(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// pf_scores_tile with bf16 pair products: lane m of qp row d2 holds query m's dims 2 * d2 and 2 * d2 + 1.
template <int KR, int QV>
static inline void pf_scores_tile_pairs(const bf16_t* const* krow, const uint32_t* qp, int64_t Mp, int64_t D,
                                        int64_t mv, float* s) {
    V a[KR][QV];
    for (int r = 0; r < KR; ++r)
        for (int c = 0; c < QV; ++c) a[r][c] = vzero();
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
        __m512bh qv[QV];
        for (int c = 0; c < QV; ++c) qv[c] = as_bf16x32(_mm512_loadu_si512(qp + d2 * Mp + (mv + c) * W));
        for (int r = 0; r < KR; ++r) {
            uint32_t pair;
            __builtin_memcpy(&pair, krow[r] + 2 * d2, 4);
            const __m512bh kb = as_bf16x32(_mm512_set1_epi32(static_cast<int>(pair)));
            for (int c = 0; c < QV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], kb, qv[c]);
        }
    }
    for (int r = 0; r < KR; ++r)
        for (int c = 0; c < QV; ++c) vstore(s + r * Mp + (mv + c) * W, a[r][c]);
}

template <int KR>
static inline void pf_scores_keys_pairs(const bf16_t* const* krow, const uint32_t* qp, int64_t Mp, int64_t D,
                                        float* s) {
    pf_query_vectors(Mp / W, [&](auto qv, int64_t mv) {
        pf_scores_tile_pairs<KR, decltype(qv)::value>(krow, qp, Mp, D, mv, s);
    });
}

// W pool elements at p as bf16 bits in the low halves of 32-bit lanes: a bf16 pool's as stored; an fp8 pool's
// widened (simd.h) and truncated, exactly -- every e4m3 value is a bf16 value.
static inline __m512i pf_bf16_lanes(const bf16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512i pf_bf16_lanes(const fp8_t* p) { return _mm512_srli_epi32(_mm512_castps_si512(kvload(p)), 16); }

// The step's n value rows as pairs of keys (2i, 2i + 1), vp [KEY_STEP / 2, D]; an odd last key pairs with 0.
template <typename KT>
static void pf_pack_values(PrefillScratch w, int64_t D, const KT* const* vrow, int64_t n) {
    for (int64_t i2 = 0; 2 * i2 < n; ++i2) {
        const bool odd = 2 * i2 + 1 == n;
        for (int64_t c = 0; c < D; c += W) {
            const __m512i lo = pf_bf16_lanes(vrow[2 * i2] + c);
            const __m512i hi = odd ? _mm512_setzero_si512() : pf_bf16_lanes(vrow[2 * i2 + 1] + c);
            _mm512_storeu_si512(w.vp + i2 * D + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// The bf16 pairs of two keys' probabilities (lo: key 2i's, hi: key 2i + 1's) of 16 query lanes: one
// vcvtne2ps2bf16 (nearest even, as vbf16_bits; it flushes float32 denormals, probabilities under 1.2e-38, to 0
// where vbf16_bits keeps a bf16 denormal) and one permute interleaving the two keys (5.6x fewer uops).
static inline __m512i pf_pair_bf16(V lo, V hi) {
    const __m512bh rounded = _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16, then hi's
    __m512i both;
    __builtin_memcpy(&both, &rounded, sizeof both);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, both);
}

// The bf16 pair of probabilities (keys 2 * i2, 2 * i2 + 1; a key at or past n is 0) of query lanes m..m+W.
static inline __m512i pf_prob_pair(const float* s, int64_t Mp, int64_t n, int64_t i2, int64_t m) {
    return pf_pair_bf16(2 * i2 < n ? vload(s + 2 * i2 * Mp + m) : vzero(),
                        2 * i2 + 1 < n ? vload(s + (2 * i2 + 1) * Mp + m) : vzero());
}

// The step's n probabilities [n, Mp] as pairs of keys, pp [KEY_STEP / 2, Mp], and its value rows (above).
static void pf_pack_step(PrefillScratch w, int64_t Mp, int64_t D, const bf16_t* const* vrow, int64_t n) {
    for (int64_t i2 = 0; 2 * i2 < n; ++i2)
        for (int64_t m = 0; m < Mp; m += W) _mm512_storeu_si512(w.pp + i2 * Mp + m, pf_prob_pair(w.s, Mp, n, i2, m));
    pf_pack_values(w, D, vrow, n);
}

// pf_values_tile with bf16 pair products over n2 key pairs.
template <int R, int C>
static inline void pf_values_tile_pairs(const uint32_t* pp, int64_t Mp, const uint32_t* vp, int64_t n2, int64_t m,
                                        int64_t c0, const float* corr, float* acc, int64_t D) {
    V a[R][C];
    pf_acc_load(a, acc, corr, m, c0, D);
    for (int64_t i2 = 0; i2 < n2; ++i2) {
        __m512bh v[C];
        for (int c = 0; c < C; ++c) v[c] = as_bf16x32(_mm512_loadu_si512(vp + i2 * D + (c0 + c) * W));
        for (int r = 0; r < R; ++r) {
            const __m512bh pr = as_bf16x32(_mm512_set1_epi32(static_cast<int>(pp[i2 * Mp + m + r])));
            for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pr, v[c]);
        }
    }
    pf_acc_store(a, acc, m, c0, D);
}
#if KV_HAS_AMX
#include "prefill_amx.h"
#endif
#endif

// Resets the online-softmax state of all Mp lanes.
static void pf_reset(PrefillScratch w, int64_t Mp, int64_t D) {
    for (int64_t m = 0; m < Mp; ++m) { w.mx[m] = -__builtin_inff(); w.sum[m] = 0.0f; }
    for (int64_t e = 0; e < Mp * D; e += W) vstore(w.acc + e, vzero());
}

// Zeroes the padded query lanes [M, Mp) and resets the online-softmax state of all Mp lanes.
static void pf_begin(PrefillScratch w, int64_t M, int64_t Mp, int64_t D) {
    for (int64_t d = 0; d < D; ++d)
        for (int64_t m = M; m < Mp; ++m) w.qt[d * Mp + m] = 0.0f;
    pf_reset(w, Mp, D);
}

// Query lane m <- src (D floats) x scale, into the transposed tile.
static inline void pf_put_query(PrefillScratch w, int64_t Mp, int64_t D, int64_t m, const float* src, float scale) {
    for (int64_t d = 0; d < D; ++d) w.qt[d * Mp + m] = src[d] * scale;
}

// Lanes [0, M) of the transposed tile <- row(m) (D floats each) x scale, and lanes [M, Mp) <- 0: pf_begin's
// padding and pf_put_query's products (the same bits), 16 x 16 blocks through one transpose where AVX-512 has
// it -- the lane-by-lane stores with a stride of Mp floats were ~7% of a 2,048-token prefill's attention (perf).
template <typename Row>
static inline void pf_put_queries(PrefillScratch w, int64_t M, int64_t Mp, int64_t D, float scale, Row row) {
#if KV_AVX512
    const V sc = vset1(scale);
    for (int64_t m0 = 0; m0 < Mp; m0 += W)
        for (int64_t d0 = 0; d0 < D; d0 += W) {
            __m512i r[W];
            for (int64_t i = 0; i < W; ++i)
                r[i] = m0 + i < M ? _mm512_castps_si512(vmul(vload(row(m0 + i) + d0), sc)) : _mm512_setzero_si512();
            transpose16_dwords(r);
            for (int64_t i = 0; i < W; ++i) vstore(w.qt + (d0 + i) * Mp + m0, _mm512_castsi512_ps(r[i]));
        }
#else
    for (int64_t d = 0; d < D; ++d)
        for (int64_t m = M; m < Mp; ++m) w.qt[d * Mp + m] = 0.0f;
    for (int64_t m = 0; m < M; ++m) pf_put_query(w, Mp, D, m, row(m), scale);
#endif
}

// The max over a step's n keys (rows of s, stride Mp) of nv <= PF_LANE_VECTORS adjacent query vectors: keys
// outer, vectors inner, so the nv dependency chains (4-cycle vmax) run side by side -- one chain at a
// time was most of the softmax's time (perf, 2,048-token prefill). Each lane sees its keys in the same order as
// one chain would: the same bits.
constexpr int64_t PF_LANE_VECTORS = 8;
template <int NV>  // NV known when compiled, so the NV maxima stay in registers
static inline void pf_lane_max_of(const float* s, int64_t Mp, int64_t n, V* out) {
    V m[NV];
    for (int v = 0; v < NV; ++v) m[v] = vload(s + v * W);
    for (int64_t r = 1; r < n; ++r)
        for (int v = 0; v < NV; ++v) m[v] = vmax(m[v], vload(s + r * Mp + v * W));
    for (int v = 0; v < NV; ++v) out[v] = m[v];
}
static inline void pf_lane_max(const float* s, int64_t Mp, int64_t n, int64_t nv, V* out) {
    switch (nv) {
        case 1: return pf_lane_max_of<1>(s, Mp, n, out);
        case 2: return pf_lane_max_of<2>(s, Mp, n, out);
        case 3: return pf_lane_max_of<3>(s, Mp, n, out);
        case 4: return pf_lane_max_of<4>(s, Mp, n, out);
        case 5: return pf_lane_max_of<5>(s, Mp, n, out);
        case 6: return pf_lane_max_of<6>(s, Mp, n, out);
        case 7: return pf_lane_max_of<7>(s, Mp, n, out);
        default: return pf_lane_max_of<PF_LANE_VECTORS>(s, Mp, n, out);
    }
}

// Query vector v's probabilities of the step's n keys: s <- exp(s - max) (w.mx, already this step's), their sum
// folded into w.sum (w.sum x corr + the step's sum) -- one pass where an exp pass and a sum pass each read s.
// Each lane sums its keys in order from 0, as the separate pass did: the same bits (the add chain hides behind
// each key's exp, so one vector at a time suffices here, unlike pf_lane_max). MASKED: key r's lanes below
// hidden0 + r * G are hidden.
template <bool MASKED, bool EXP2>
static inline void pf_lane_exp(PrefillScratch w, int64_t Mp, int64_t n, int64_t v, int64_t hidden0, int64_t G) {
    const V neg = pf_neg_max<EXP2>(w.mx + v * W);
    V total = vzero();
    for (int64_t r = 0; r < n; ++r) {
        float* s = w.s + r * Mp + v * W;
        const V p = pf_prob<MASKED, EXP2>(vload(s), neg, hidden0 + r * G - v * W);
        vstore(s, p);
        total = vadd(total, p);
    }
    vstore(w.sum + v * W, vfma(vload(w.sum + v * W), vload(w.corr + v * W), total));
}
static inline void pf_lane_exp(PrefillScratch w, int64_t Mp, int64_t n, int64_t v, bool masked, int64_t hidden0,
                               int64_t G, bool exp2) {
    if (exp2 && masked) pf_lane_exp<true, true>(w, Mp, n, v, hidden0, G);
    else if (exp2) pf_lane_exp<false, true>(w, Mp, n, v, hidden0, G);
    else if (masked) pf_lane_exp<true, false>(w, Mp, n, v, hidden0, G);
    else pf_lane_exp<false, false>(w, Mp, n, v, hidden0, G);
}

// How the products run: float32 FMAs (ATTN_F32, or ATTN_BF16 on the rounded values), AVX512-BF16 pair dot
// products or AMX-BF16 tiles (ATTN_BF16), or AMX tiles on three bf16 parts of each float32 query and
// probability (ATTN_F32 over a bf16 pool: exact products, as the FMAs; prefill_amx.h).
enum : int { PF_FMA = 0, PF_PAIRS = 1, PF_TILES = 2, PF_EXACT_TILES = 3 };

template <typename KT>
static inline int pf_route(int prod, int64_t D) {
#if KV_AVX512 && KV_HAS_AMX
    // An fp8 pool (ATTN_F32 only) takes the exact tiles too, its rows widened to bf16 as they are packed.
    if (sizeof(KT) <= 2 && kv_cpu_dpbf16() && pa_tiles(D)) return prod == ATTN_BF16 ? PF_TILES : PF_EXACT_TILES;
#endif
    (void)D;
    return prod == ATTN_BF16 && pf_pair_products<KT>() ? PF_PAIRS : PF_FMA;
}

// Q x K^T of the step's n keys k0.. into w.s (block size bs), by `route`.
template <typename KT>
static inline void pf_step_scores(PrefillScratch w, int64_t Mp, int64_t D, const KT* const* krow, int64_t n,
                                  int route, int64_t k0, int64_t bs) {
#if KV_AVX512 && KV_HAS_BF16
#if KV_HAS_AMX
    if constexpr (sizeof(KT) <= 2) {
        if (route == PF_TILES) return pa_scores<1>(w, Mp, D, krow, n, k0, bs);
        if (route == PF_EXACT_TILES) return pa_scores<3>(w, Mp, D, krow, n, k0, bs);
    }
#endif
    if constexpr (sizeof(KT) == 2) {
        const bf16_t* const* kb = reinterpret_cast<const bf16_t* const*>(krow);
        if (route == PF_PAIRS) {
            int64_t i = 0;
            for (; i + PF_KR <= n; i += PF_KR) pf_scores_keys_pairs<PF_KR>(kb + i, w.qp, Mp, D, w.s + i * Mp);
            for (; i < n; ++i) pf_scores_keys_pairs<1>(kb + i, w.qp, Mp, D, w.s + i * Mp);
            return;
        }
    }
#endif
    (void)route, (void)k0, (void)bs;
    int64_t i = 0;
    for (; i + PF_KR <= n; i += PF_KR) pf_scores_keys<PF_KR>(krow + i, w.qt, Mp, D, w.s + i * Mp);
    for (; i < n; ++i) pf_scores_keys<1>(krow + i, w.qt, Mp, D, w.s + i * Mp);
}

// acc = acc x corr + P x V over the step's n keys (P rounded to bf16 under ATTN_BF16), by `route` (not the AMX
// tiles': pa_step).
template <typename KT>
static inline void pf_step_values(PrefillScratch w, int64_t Mp, int64_t D, const KT* const* vrow, int64_t n,
                                  int prod, int route) {
    const int64_t DV = D / W;
#if KV_AVX512 && KV_HAS_BF16
    if constexpr (sizeof(KT) == 2) {
        const bf16_t* const* vb = reinterpret_cast<const bf16_t* const*>(vrow);
        if (route == PF_PAIRS) {
            pf_pack_step(w, Mp, D, vb, n);
            const int64_t n2 = (n + 1) / 2;
            for (int64_t m = 0; m < Mp; m += PF_VR) {
                int64_t c0 = 0;
                for (; c0 + PF_VC <= DV; c0 += PF_VC)
                    pf_values_tile_pairs<PF_VR, PF_VC>(w.pp, Mp, w.vp, n2, m, c0, w.corr, w.acc, D);
                for (; c0 < DV; ++c0) pf_values_tile_pairs<PF_VR, 1>(w.pp, Mp, w.vp, n2, m, c0, w.corr, w.acc, D);
            }
            return;
        }
    }
#endif
    (void)route;
    if (prod == ATTN_BF16)
        for (int64_t e = 0; e < n * Mp; e += W) vstore(w.s + e, vround_bf16(vload(w.s + e)));
    for (int64_t m = 0; m < Mp; m += PF_VR) {
        int64_t c0 = 0;
        for (; c0 + PF_VC <= DV; c0 += PF_VC) pf_values_tile<PF_VR, PF_VC>(w.s, Mp, vrow, n, m, c0, w.corr, w.acc, D);
        for (; c0 < DV; ++c0) pf_values_tile<PF_VR, 1>(w.s, Mp, vrow, n, m, c0, w.corr, w.acc, D);
    }
}

// The Mp stacked queries attend to tokens [k0_begin, end) of the sequence with block table `table`, KV head
// g. Causal when first >= 0: lane m is the query of token m / G at position first + m / G and sees keys up
// to it (so k0_begin must be 0, and key 0 is seen by all); first < 0: every lane sees every key. Each lane
// must see at least one key in the first step (its max is then finite). prod: ATTN_F32 or ATTN_BF16 (a bf16
// pool); a lane's arithmetic depends only on its own query and the keys, never on the tile it shares.
// vt (the AMX routes, k0_begin 0; else null): the sequence's values for head g already packed by the call
// (prefill_amx.h's pa_pack_spans, `vt_tiles` pair tiles a dim tile); null: each step packs its own.
template <typename KT>
static void pf_attend(PrefillScratch w, int64_t Mp, int64_t D, int64_t G, const KT* kpool, const KT* vpool,
                      int64_t KVH, int64_t g, int64_t bs, const int64_t* table, int64_t k0_begin, int64_t end,
                      int64_t first, int prod, const uint32_t* vt = nullptr, int64_t vt_tiles = 0) {
    const int64_t MV = Mp / W;
    const int route = pf_route<KT>(prod, D);
    const bool tiles = route == PF_TILES || route == PF_EXACT_TILES, lazy = tiles || prod == ATTN_BF16;
    if (prod == ATTN_BF16) pf_round_queries(w, Mp, D, route != PF_FMA);
#if KV_AVX512 && KV_HAS_AMX
    if (route == PF_EXACT_TILES) pa_split_queries(w, Mp, D);
    if (tiles) {  // the tiles accumulate in w.acct from zero: callers attend once per pf_reset (its zeroed w.acc)
        pa_begin();
        for (int64_t e = 0; e < Mp * D; e += W) vstore(w.acct + e, vzero());
    }
    PaDefer defer(Mp, vt != nullptr, route == PF_EXACT_TILES);
#endif
    const KT* krow[PREFILL_KEY_STEP];
    const KT* vrow[PREFILL_KEY_STEP];
    for (int64_t k0 = k0_begin; k0 < end; k0 += PREFILL_KEY_STEP) {
        const int64_t n = end - k0 < PREFILL_KEY_STEP ? end - k0 : PREFILL_KEY_STEP;
        pf_rows(kpool, table, bs, KVH, g, D, k0, n, krow);
        pf_rows(vpool, table, bs, KVH, g, D, k0, n, vrow);
        pf_step_scores(w, Mp, D, krow, n, route, k0, bs);
        // Causal mask: key k0 + r is hidden from the tile's tokens before it, i.e. lanes m < (k0 + r - first) * G.
        const bool masked = first >= 0 && k0 + n - 1 > first;
        if (masked)
            for (int64_t r = 0; r < n; ++r)
                for (int64_t m = 0, lim = (k0 + r - first) * G; m < lim; ++m) w.s[r * Mp + m] = -__builtin_inff();
        const int64_t hidden0 = masked ? (k0 - first) * G : 0;
        // The tiles' later steps find their maxima in the exponentials' pass (pa_step's speculation).
        const bool speculate = tiles && k0 > k0_begin;
        for (int64_t v0 = 0; v0 < MV && !speculate; v0 += PF_LANE_VECTORS) {
            const int64_t nv = MV - v0 < PF_LANE_VECTORS ? MV - v0 : PF_LANE_VECTORS;
            V bm[PF_LANE_VECTORS];
            pf_lane_max(w.s + v0 * W, Mp, n, nv, bm);
            for (int64_t v = v0; v < v0 + nv; ++v) {
                const V mold = vload(w.mx + v * W);
                const V mnew = lazy ? pf_lazy_max(mold, bm[v - v0]) : vmax(mold, bm[v - v0]);
                vstore(w.corr + v * W, pf_correction(mold, mnew));  // mnew is finite (see above)
                vstore(w.mx + v * W, mnew);
            }
            if (tiles) continue;  // below, after the accumulators' rescaling
            for (int64_t v = v0; v < v0 + nv; ++v) pf_lane_exp(w, Mp, n, v, masked, hidden0, G, prod == ATTN_BF16);
        }
#if KV_AVX512 && KV_HAS_AMX
        if constexpr (sizeof(KT) <= 2) {
            if (tiles) {
                pa_step(w, Mp, D, G, vrow, n, masked, hidden0, route == PF_EXACT_TILES, vt, vt_tiles, k0, defer,
                        speculate, k0 + PREFILL_KEY_STEP >= end);
                continue;
            }
        }
#endif
        pf_step_values(w, Mp, D, vrow, n, prod, route);
    }
#if KV_AVX512 && KV_HAS_AMX
    if (tiles) pa_untranspose(w, Mp, D);  // pa_step's last step multiplied all it held
#endif
}

// One task: tokens [row0, row0 + nq) of a span at positions first..first+nq-1, KV head g, keys 0..first+nq-1.
// Where prefill_attention's outputs go: out [T, H, D] float32, or (tiles non-null, the AVX-512 build) the next
// GEMM's bf16 A tiles (gemm_bf16.h's layout, k = H * D, rows counted from row_base) -- rounded to nearest even as
// gb_round_rows would round the float32 rows: the same bits, without them in memory.
struct PrefillOut {
    float* out;
    uint16_t* tiles;
    int64_t row_base;
    PrefillOut(float* o, uint16_t* t = nullptr, int64_t base = 0) : out(o), tiles(t), row_base(base) {}
};

// Query lane m's normalised output (acc row m / sum) of token row `row`, head h, into `o`.
static inline void pf_emit(PrefillScratch w, int64_t m, int64_t D, int64_t H, int64_t row, int64_t h,
                           const PrefillOut& o) {
    const V inv = vset1(1.0f / w.sum[m]);
#if KV_AVX512 && KV_HAS_BF16
    if (o.tiles != nullptr) {
        const int64_t nb = H * D / 32, r = row - o.row_base;
        for (int64_t e = 0; e < D; e += 32)
            _mm512_store_si512(a_tile_row(o.tiles, nb, r, (h * D + e) / 32),
                               (__m512i)_mm512_cvtne2ps_pbh(vmul(vload(w.acc + m * D + e + 16), inv),
                                                            vmul(vload(w.acc + m * D + e), inv)));
        return;
    }
#endif
    float* dst = o.out + (row * H + h) * D;
    for (int64_t e = 0; e < D; e += W) vstore(dst + e, vmul(vload(w.acc + m * D + e), inv));
}

template <typename KT>
static void prefill_tile(const float* q, int64_t H, int64_t KVH, int64_t D, int64_t G, const KT* kpool,
                         const KT* vpool, int64_t bs, const int64_t* table, int64_t row0, int64_t nq,
                         int64_t first, int64_t g, float scale, int prod, PrefillScratch w, const PrefillOut& out,
                         const uint32_t* vt, int64_t vt_tiles) {
    const int64_t M = nq * G, Mp = (M + W - 1) / W * W;
    pf_reset(w, Mp, D);
    pf_put_queries(w, M, Mp, D, scale, [&](int64_t m) { return q + ((row0 + m / G) * H + g * G + m % G) * D; });
    pf_attend(w, Mp, D, G, kpool, vpool, KVH, g, bs, table, 0, first + nq, first, prod, vt, vt_tiles);
    for (int64_t m = 0; m < M; ++m) pf_emit(w, m, D, H, row0 + m / G, g * G + m % G, out);
}

constexpr int64_t PF_SHARED_VALUES_BYTES = int64_t{64} << 20;

template <typename KT>
static int prefill_attention(const float* q, int64_t H, int64_t KVH, int64_t D, const KT* kpool,
                             const KT* vpool, int64_t bs, int64_t num_spans, const int64_t* span_start,
                             const int64_t* span_len, const int64_t* span_ctx, const int64_t* tables,
                             int64_t table_stride, float scale, int prod, const PrefillOut& out) {
    if (D % W != 0 || H % KVH != 0 || (out.tiles != nullptr && D % 32 != 0)) return -2;
    if (prod != ATTN_F32 && (prod != ATTN_BF16 || sizeof(KT) != 2)) return -5;  // bf16 products: a bf16 pool
    const int64_t G = H / KVH, QT = PREFILL_TILE_TOKENS;
    const int64_t Mp = (QT * G + W - 1) / W * W;
    ScratchScope scope;
    int64_t* task_offset = scope.take<int64_t>(num_spans + 1);  // first task of each span: KVH x tiles
    task_offset[0] = 0;
    for (int64_t s = 0; s < num_spans; ++s) task_offset[s + 1] = task_offset[s] + KVH * ((span_len[s] + QT - 1) / QT);
    // The order tasks are handed out: spans last to first, each head-major (a thread's next task is most often
    // the same KV head's, its keys and values still in L2: head-minor, a turn's attention ran ~4% slower and a
    // 2,048-token prefill's ~2%), each head's last (longest) tiles first -- and a span's partial last tiles
    // after every full one, so the dynamic schedule ends on small tasks (a chat turn of 100 tokens: 9 tiles of
    // 32 tokens and 3 of 4; the small ones first left one thread a whole tile behind).
    const int64_t num_tasks = task_offset[num_spans];
    int64_t* order = scope.take<int64_t>(num_tasks);
    int64_t placed = 0;
    for (int pass = 0; pass < 2; ++pass)
        for (int64_t s = num_spans - 1; s >= 0; --s) {
            const int64_t tiles = (task_offset[s + 1] - task_offset[s]) / KVH;
            for (int64_t local = KVH * tiles - 1; local >= 0; --local) {
                const bool partial = (local % tiles + 1) * QT > span_len[s];
                if (partial == (pass == 1)) order[placed++] = task_offset[s] + local;
            }
        }
    // The AMX routes' values, packed once per (span, KV head) for all its query tiles (pa_pack_spans), up to
    // PF_SHARED_VALUES_BYTES; past that each step packs its own.
    int64_t* vt_offset = scope.take<int64_t>(num_spans + 1);
    uint32_t* vt = nullptr;
    vt_offset[0] = 0;
    for (int64_t s = 0; s < num_spans; ++s) vt_offset[s + 1] = vt_offset[s] + KVH * ((span_ctx[s] + 31) / 32);
    const int route = pf_route<KT>(prod, D);
    if ((route == PF_TILES || route == PF_EXACT_TILES) && vt_offset[num_spans] * D * 64 <= PF_SHARED_VALUES_BYTES)
        vt = scope.take<uint32_t>(vt_offset[num_spans] * D * 16);  // per pair tile: D / 16 tiles of 256 dwords
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;  // this thread's
        PrefillScratch w = pf_scratch_new(own, Mp, D);
#if KV_AVX512 && KV_HAS_AMX
        if constexpr (sizeof(KT) <= 2)
            if (vt != nullptr)
                pa_pack_spans(vpool, KVH, D, bs, num_spans, span_ctx, tables, table_stride, vt_offset, vt);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; ++i) {
            const int64_t task = order[i];
            int64_t s = 0;
            while (task_offset[s + 1] <= task) ++s;
            const int64_t tiles = (task_offset[s + 1] - task_offset[s]) / KVH;
            const int64_t local = task - task_offset[s], g = local / tiles, tile = local % tiles;
            const int64_t a = tile * QT, nq = span_len[s] - a < QT ? span_len[s] - a : QT;
            const int64_t first = span_ctx[s] - span_len[s] + a;
            const int64_t vt_tiles = (vt_offset[s + 1] - vt_offset[s]) / KVH;
            prefill_tile(q, H, KVH, D, G, kpool, vpool, bs, tables + s * table_stride, span_start[s] + a, nq, first,
                         g, scale, prod, w, out, vt ? vt + (vt_offset[s] + g * vt_tiles) * D * 16 : nullptr, vt_tiles);
        }
    }
    return 0;
}
