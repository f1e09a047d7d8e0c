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
// parts still ~5x). The maxima stay prefill.h's (lazily moved: pf_lazy_max); the exponentials, their sums and
// the probabilities' bf16 pairs are one pass here (pa_lane_exp_pairs) that writes P in the layout the tiles
// load, so no probability goes to memory as float32 or through a transpose.
//
// Layouts, per online-softmax step of n <= KEY_STEP keys and the Mp stacked queries:
//   Q x K^T: C (tmm6, 7) = 16 keys x 16 queries of w.s (key-major, as the softmax reads it); A (tmm0-3, kept
//   while every query-tile pair passes) = 16 key rows, 32 dims each, read from the pool in place when the 16
//   keys sit in one block (else copied into the value-pair buffer, not yet in use); B (tmm4, 5) = 16 dim pairs x
//   16 queries of qp, as pf_round_queries already lays them out. (Head dims other than 64 / 128: C tmm4, 5, A
//   tmm0 per pair, B tmm1, 2.)
//   P x V, transposed (out^T = V^T P): C (tmm4-7) = 16 dims x 16 queries of w.acct; A (tmm0, 1) = 16 dims x 16
//   key pairs of the values (pa_pack_values_t: packed once per call for every span and KV head, or per step into
//   w.vp); B (tmm2, 3) = 16 key pairs x 16 queries of w.pp, key-major as the softmax runs, up to three steps of
//   them (PaDefer). Each output sums the same products in the same order as with the operands' roles swapped
//   (the same bits as the untransposed product, checked when it was written); w.acct becomes w.acc [Mp, D] once
//   the keys are done (pa_untranspose).

constexpr int64_t PA = 16;  // tile rows, and float32 / bf16-pair columns

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

// Keys r0..r0 + 15 (rows, stride bytes apart) x every query into w.s. NK = D / 32 of 2 or 4: the keys' NK tiles
// load once (tmm0..) and stay while every query-tile pair passes (B tmm4, 5; C tmm6, 7) -- a key tile loaded once
// per query-tile pair was the scores' largest stall (the pool's rows come from L2).
// (The tile intrinsics take register numbers as literal tokens, hence a macro, not a template.)
#define PA_SCORES_DIMS(J)                                                 \
    for (int part = 0; part < S; ++part) {                                \
        const uint32_t* qp = w.qp + (part * D / 2 + PA * (J)) * Mp;      \
        _tile_loadd(4, qp + PA * c, Mp * 4);                              \
        _tile_dpbf16ps(6, J, 4);                                          \
        if (two) {                                                        \
            _tile_loadd(5, qp + PA * (c + 1), Mp * 4);                    \
            _tile_dpbf16ps(7, J, 5);                                      \
        }                                                                 \
    }
template <int S, int NK>
static void pa_scores_keys(PrefillScratch w, int64_t Mp, int64_t D, const bf16_t* rows, int64_t stride, int64_t r0) {
    _tile_loadd(0, rows, stride);
    _tile_loadd(1, rows + 32, stride);
    if constexpr (NK == 4) {
        _tile_loadd(2, rows + 64, stride);
        _tile_loadd(3, rows + 96, stride);
    }
    const int64_t nq = Mp / PA;
    for (int64_t c = 0; c < nq; c += 2) {
        const bool two = c + 1 < nq;
        _tile_zero(6);
        _tile_zero(7);
        PA_SCORES_DIMS(0)
        PA_SCORES_DIMS(1)
        if constexpr (NK == 4) {
            PA_SCORES_DIMS(2)
            PA_SCORES_DIMS(3)
        }
        _tile_stored(6, w.s + r0 * Mp + PA * c, Mp * 4);
        if (two) _tile_stored(7, w.s + r0 * Mp + PA * (c + 1), Mp * 4);
    }
}
#undef PA_SCORES_DIMS
// Any other head dim: a key tile per 32 dims and query-tile pair.
template <int S>
static void pa_scores_any(PrefillScratch w, int64_t Mp, int64_t D, const bf16_t* rows, int64_t stride, int64_t r0) {
    const int64_t nq = Mp / PA, nk = D / 32;
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

// w.s[r * Mp + m] = key r . query m (queries in w.qp: S parts) for the step's keys k0..k0+n of block size bs;
// rows n..16 * ceil(n / 16) of w.s get values nobody reads.
// KT: a bf16 pool's rows, read in place where they can be; an fp8 pool's, always copied widened to bf16.
template <int S, typename KT>
static void pa_scores(PrefillScratch w, int64_t Mp, int64_t D, const KT* const* krow, int64_t n, int64_t k0,
                      int64_t bs) {
    bf16_t* copy = reinterpret_cast<bf16_t*>(w.vp);  // [KEY_STEP, D]: free until pa_step packs values there
    const int64_t nk = D / 32;
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
        if (nk == 2) pa_scores_keys<S, 2>(w, Mp, D, rows, stride, r0);
        else if (nk == 4) pa_scores_keys<S, 4>(w, Mp, D, rows, stride, r0);
        else pa_scores_any<S>(w, Mp, D, rows, stride, r0);
    }
}

// Values for P x V, transposed: A tiles of 16 dims x 16 key pairs, tile (dt, pt) -- dims 16 dt.., keys 32 pt.. --
// at vt + (dt * tiles + pt) * PA_TILE (rows of 16 dwords: dim d's bf16 values of keys 2i, 2i + 1). Keys of pair
// tile pt at or past `count` are 0 (never NaN: the probabilities there are 0, and 0 x NaN is not).
constexpr int64_t PA_TILE = PA * PA;  // dwords of a 16 x 64-byte tile
template <typename KT>
static void pa_pack_values_t(const KT* const* vrow, int64_t count, int64_t D, uint32_t* vt, int64_t tiles,
                             int64_t pt) {
    for (int64_t dt = 0; dt < D / PA; ++dt) {
        __m512i r[PA];
        for (int64_t i2 = 0; i2 < PA; ++i2) {
            const int64_t k = 2 * i2;
            const __m512i lo = k < count ? pf_bf16_lanes(vrow[k] + dt * PA) : _mm512_setzero_si512();
            const __m512i hi = k + 1 < count ? pf_bf16_lanes(vrow[k + 1] + dt * PA) : _mm512_setzero_si512();
            r[i2] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        transpose16_dwords(r);
        for (int64_t j = 0; j < PA; ++j) _mm512_storeu_si512(vt + (dt * tiles + pt) * PA_TILE + j * PA, r[j]);
    }
}

// Every span's values as pa_pack_values_t's tiles, each (span, KV head) once for all its query tiles (a task
// packing its own would repeat it for each): span s, head g from vt + (s_offset[s] + g * tiles_s) * (D / 16)
// * PA_TILE, tiles_s = s_offset's step / KVH. Runs inside the caller's parallel region (a worksharing loop).
template <typename KT>
static void pa_pack_spans(const KT* vpool, int64_t KVH, int64_t D, int64_t bs, int64_t num_spans,
                          const int64_t* span_ctx, const int64_t* tables, int64_t table_stride,
                          const int64_t* s_offset, uint32_t* vt) {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < s_offset[num_spans]; ++job) {  // (span, head, pair tile)
        int64_t s = 0;
        while (s_offset[s + 1] <= job) ++s;
        const int64_t tiles = (s_offset[s + 1] - s_offset[s]) / KVH, g = (job - s_offset[s]) / tiles;
        const int64_t pt = (job - s_offset[s]) % tiles, k0 = 32 * pt;
        const int64_t count = span_ctx[s] - k0 < 32 ? span_ctx[s] - k0 : 32;
        const KT* vrow[32];
        pf_rows(vpool, tables + s * table_stride, bs, KVH, g, D, k0, count, vrow);
        pa_pack_values_t(vrow, count, D, vt + (s_offset[s] + g * tiles) * (D / PA) * PA_TILE, tiles, pt);
    }
}

// The step's probabilities of query vector v (lanes 16 v..) as bf16 pairs of keys (2 i2, 2 i2 + 1), key-pair-major
// -- pp + part * PA_PART + i2 * Mp: the P x V tiles' B operand as it is -- and their float32 sum, returned (summed
// key by key in order as pf_lane_exp does): one pass over w.s, no probability stored as float32 or transposed.
// S = 1: rounded to nearest even; S = 3: the three exact parts. Pairs past the step's keys up to a whole pair tile
// are 0. MASKED / EXP2: pf_lane_exp's. TRACK: also the step's maxima of the raw scores, into *step_max (pa_step's
// speculation: the probabilities against the running max as it stands).
constexpr int64_t PA_PART = PREFILL_KEY_STEP / 2;  // times Mp: the dwords of one part's pairs
template <int S, bool MASKED, bool EXP2, bool TRACK = false>
static V pa_lane_exp_pairs(PrefillScratch w, int64_t Mp, int64_t n, int64_t v, int64_t hidden0, int64_t G,
                           V* step_max = nullptr) {
    const V neg = pf_neg_max<EXP2>(w.mx + v * W);
    V top = vset1(-__builtin_inff());
    const auto prob = [&](int64_t r) {
        const V x = vload(w.s + r * Mp + v * W);
        if constexpr (TRACK) top = vmax(top, x);
        return pf_prob<MASKED, EXP2>(x, neg, hidden0 + r * G - v * W);
    };
    V total = vzero();
    const int64_t n2 = (n + 1) / 2, padded = (n2 + PA - 1) / PA * PA;
    for (int64_t i2 = 0; i2 < n2; ++i2) {
        const V lo = prob(2 * i2);
        total = vadd(total, lo);
        V hi = vzero();
        if (2 * i2 + 1 < n) {
            hi = prob(2 * i2 + 1);
            total = vadd(total, hi);
        }
        uint32_t* dst = w.pp + i2 * Mp + v * W;
        if constexpr (S == 1) {
            _mm512_storeu_si512(dst, pf_pair_bf16(lo, hi));
        } else {
            V even[3], odd[3];
            split_bf16x3(lo, even);
            split_bf16x3(hi, odd);
            for (int part = 0; part < 3; ++part)
                _mm512_storeu_si512(dst + part * PA_PART * Mp, pa_part_pair(even[part], odd[part]));
        }
    }
    for (int64_t i2 = n2; i2 < padded; ++i2)
        for (int part = 0; part < S; ++part)
            _mm512_storeu_si512(w.pp + (part * PA_PART + i2) * Mp + v * W, _mm512_setzero_si512());
    if constexpr (TRACK) *step_max = top;
    return total;
}

// pa_lane_exp_pairs by route: exact (S = 3, vexp) or not (S = 1, vexp2), masked or not; the step's sum returned.
template <bool TRACK>
static V pa_lane_exps(PrefillScratch w, int64_t Mp, int64_t n, int64_t v, int64_t hidden0, int64_t G, bool exact,
                      bool masked, V* step_max = nullptr) {
    if (exact && masked) return pa_lane_exp_pairs<3, true, false, TRACK>(w, Mp, n, v, hidden0, G, step_max);
    if (exact) return pa_lane_exp_pairs<3, false, false, TRACK>(w, Mp, n, v, hidden0, G, step_max);
    if (masked) return pa_lane_exp_pairs<1, true, true, TRACK>(w, Mp, n, v, hidden0, G, step_max);
    return pa_lane_exp_pairs<1, false, true, TRACK>(w, Mp, n, v, hidden0, G, step_max);
}

// Query vector v's rows of w.acct x corr, where any of its lanes' maxima moved (most hold once their first keys
// are in).
static void pa_rescale_vector(PrefillScratch w, int64_t Mp, int64_t D, int64_t v, V corr) {
    if (_mm512_cmpneq_ps_mask(corr, vset1(1.0f)) == 0) return;
    for (int64_t d = 0; d < D; ++d) vstore(w.acct + d * Mp + v * W, vmul(vload(w.acct + d * Mp + v * W), corr));
}

// P x V deferred: the steps' probabilities stay in w.pp's PF_PP_SLOTS slots (step s in slot s % slots) until a
// query-tile pair multiplies all it holds at once, so its accumulator tiles are loaded and stored once per
// several steps, not once a step (that traffic was ~18% of the turn's attention). Pair q multiplies at the
// steps where (s + q) % slots == slots - 1 -- staggered, so every step still runs about one step's products
// beside its exponentials -- before its lanes' running max moves (the held probabilities are relative to the
// old one) and in the last step. Each output sums the same products in the same order as multiplying every
// step: the same bits. One slot (every pair multiplies every step) where the call packed no values (each step
// packs its own into w.vp), where a task has more query-tile pairs than PA_MAX_PAIRS (G > 64, or cascade's
// shared parts), and on the exact tiles (S = 3: three parts a step, three times the products per accumulator
// load; held there, 2,048 tokens ran 4-8% slower than multiplied every step, a chat turn's shape within noise).
constexpr int64_t PA_MAX_PAIRS = 64;
struct PaDefer {
    int64_t slots = 1, step = 0;    // steps begun
    int64_t first[PA_MAX_PAIRS];    // with slots > 1: pair q's first step not yet multiplied
    int64_t pt0[PF_PP_SLOTS], np[PF_PP_SLOTS];  // slot j's step: its first pair tile in vt, its pair tiles
    PaDefer(int64_t Mp, bool packed, bool exact) {
        const int64_t pairs = (Mp / PA + 1) / 2;
        if (!packed || exact || pairs > PA_MAX_PAIRS) return;
        slots = PF_PP_SLOTS;
        for (int64_t q = 0; q < pairs; ++q) first[q] = 0;
    }
    // Pair q's first step not yet multiplied (one slot: the step under way, whatever the pair).
    int64_t held_from(int64_t q) const { return slots == 1 ? step : first[q]; }
};

// Query tiles c, c + 1 of w.acct [D, Mp] += V^T x P over steps [from, to) held in w.pp (values: vt's tiles,
// `tiles` a dim tile; probabilities: S parts a slot). 2 x 2 blocking: dim tiles dt, dt + 1 x the two query
// tiles in tmm4-7 (D is a multiple of 32).
template <int S>
static void pa_values_t(PrefillScratch w, int64_t Mp, int64_t D, const uint32_t* vt, int64_t tiles,
                        const PaDefer& d, int64_t from, int64_t to, int64_t c) {
    const bool two = c + 1 < Mp / PA;
    for (int64_t dt = 0; dt < D / PA; dt += 2) {
        float* out = w.acct + dt * PA * Mp + c * PA;
        _tile_loadd(4, out, Mp * 4);
        _tile_loadd(5, out + PA * Mp, Mp * 4);
        if (two) _tile_loadd(6, out + PA, Mp * 4);
        if (two) _tile_loadd(7, out + PA * Mp + PA, Mp * 4);
        for (int64_t step = from; step < to; ++step) {
            const int64_t slot = step % d.slots, pt0 = d.pt0[slot];
            const uint32_t* pp = w.pp + slot * S * PA_PART * Mp;
            for (int64_t p = 0; p < d.np[slot]; ++p) {
                _tile_loadd(0, vt + (dt * tiles + pt0 + p) * PA_TILE, 64);
                _tile_loadd(1, vt + ((dt + 1) * tiles + pt0 + p) * PA_TILE, 64);
                for (int part = 0; part < S; ++part) {
                    const uint32_t* b = pp + (part * PA_PART + p * PA) * Mp + c * PA;
                    _tile_loadd(2, b, Mp * 4);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 1, 2);
                    if (two) {
                        _tile_loadd(3, b + PA, Mp * 4);
                        _tile_dpbf16ps(6, 0, 3);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                }
            }
        }
        _tile_stored(4, out, Mp * 4);
        _tile_stored(5, out + PA * Mp, Mp * 4);
        if (two) _tile_stored(6, out + PA, Mp * 4);
        if (two) _tile_stored(7, out + PA * Mp + PA, Mp * 4);
    }
}

// Pair q's held steps [first, to) into w.acct.
static void pa_flush(PrefillScratch w, int64_t Mp, int64_t D, bool exact, const uint32_t* vt, int64_t tiles,
                     PaDefer& d, int64_t q, int64_t to) {
    const int64_t from = d.held_from(q);
    if (from >= to) return;
    if (exact) pa_values_t<3>(w, Mp, D, vt, tiles, d, from, to, 2 * q);
    else pa_values_t<1>(w, Mp, D, vt, tiles, d, from, to, 2 * q);
    if (d.slots > 1) d.first[q] = to;
}

// w.acc [Mp, D] <- w.acct [D, Mp], 16 x 16 at a time: the outputs as the FMA routes leave them.
static void pa_untranspose(PrefillScratch w, int64_t Mp, int64_t D) {
    for (int64_t v = 0; v < Mp / W; ++v)
        for (int64_t d0 = 0; d0 < D; d0 += W) {
            __m512i r[W];
            for (int64_t i = 0; i < W; ++i) r[i] = _mm512_loadu_si512(w.acct + (d0 + i) * Mp + v * W);
            transpose16_dwords(r);
            for (int64_t j = 0; j < W; ++j) _mm512_storeu_si512(w.acc + (v * W + j) * D + d0, r[j]);
        }
}

// One online-softmax step's rescaling, probabilities and P x V on the tiles: S = 1 (PF_TILES, ATTN_BF16: vexp2)
// or 3 (PF_EXACT_TILES, ATTN_F32: vexp). vt null: the step packs its values into w.vp; else the call's tiles
// (pf_attend), this step's from pair tile k0 / 32. P x V as PaDefer says, and every pair's in the `last` step
// (each beside the next pair's exponentials, not all after them).
// The maxima: the first step's come from pf_attend (w.mx, w.corr; nothing is held yet and w.acct is still zero,
// so nothing to multiply or rescale first); later steps speculate (`speculate`): each
// query vector's probabilities are computed against its running max as it stands while the same pass finds the
// step's maxima, and only a vector whose max moves (pf_lazy_max: rarely after the first keys) is computed again
// against the new one -- after its pair's held products and its accumulator's rescaling, as every step did them
// before. The same maxima, corrections and probabilities as a separate max pass: the same bits, one pass over
// the scores fewer.
template <typename KT>
static void pa_step(PrefillScratch w, int64_t Mp, int64_t D, int64_t G, const KT* const* vrow, int64_t n,
                    bool masked, int64_t hidden0, bool exact, const uint32_t* vt, int64_t vt_tiles, int64_t k0,
                    PaDefer& d, bool speculate, bool last) {
    const int64_t nq = Mp / PA, s = d.step, slot = s % d.slots, S = exact ? 3 : 1;
    const int64_t np = ((n + 1) / 2 + PA - 1) / PA;
    const uint32_t* packed = vt;
    d.pt0[slot] = k0 / 32, d.np[slot] = np;
    if (vt == nullptr) {  // one slot: every pair multiplies this step below, before the next packs
        vt_tiles = PREFILL_KEY_STEP / 32, d.pt0[slot] = 0;
        for (int64_t pt = 0; pt < np; ++pt)
            pa_pack_values_t(vrow + 32 * pt, n - 32 * pt < 32 ? n - 32 * pt : 32, D, w.vp, vt_tiles, pt);
        vt = w.vp;
    }
    PrefillScratch ws = w;
    ws.pp = w.pp + slot * S * PA_PART * Mp;
    // Query tiles c, c + 1's probabilities, then the previous pair's products where due: the tiles load rows the
    // vector stores wrote one pair earlier.
    for (int64_t c = 0; c < nq + 2; c += 2) {
        for (int64_t v = c; v < c + 2 && v < nq; ++v) {
            float* sum = w.sum + v * W;
            if (!speculate) {
                const V total = pa_lane_exps<false>(ws, Mp, n, v, hidden0, G, exact, masked);
                vstore(sum, vfma(vload(sum), vload(w.corr + v * W), total));
                continue;
            }
            V top;
            const V total = pa_lane_exps<true>(ws, Mp, n, v, hidden0, G, exact, masked, &top);
            const V mold = vload(w.mx + v * W), mnew = pf_lazy_max(mold, top);
            if (_mm512_cmpneq_ps_mask(mnew, mold) == 0) {  // corr 1: w.sum x 1 + total
                vstore(sum, vadd(vload(sum), total));
                continue;
            }
            pa_flush(w, Mp, D, exact, packed, vt_tiles, d, v / 2, s);  // vt null: nothing held
            const V corr = pf_correction(mold, mnew);
            vstore(w.mx + v * W, mnew);
            pa_rescale_vector(w, Mp, D, v, corr);
            vstore(sum, vfma(vload(sum), corr, pa_lane_exps<false>(ws, Mp, n, v, hidden0, G, exact, masked)));
        }
        if (c == 0) continue;
        const int64_t q = (c - 2) / 2;
        if (last || (s + q) % d.slots == d.slots - 1) pa_flush(w, Mp, D, exact, vt, vt_tiles, d, q, s + 1);
    }
    d.step = s + 1;
}
