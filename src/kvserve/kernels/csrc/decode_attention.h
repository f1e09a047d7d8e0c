// Paged decode attention straight from the pool, compiled once per ISA (included after simd.h).
//
// A decode row has only G = H / KVH queries per KV head (3 for SmolLM2): too few to fill vector lanes with
// queries, as prefill.h does. So keys go in the lanes: a tile of W keys (16 on AVX-512, 8 on AVX2) yields
// one partial-dot vector per key (D / W FMAs each, the query held in registers), and a transpose-reduce
// (in-register interleaves and adds) turns those W vectors into one vector of W scores -- instead of W
// horizontal sums. Softmax is two-pass per task: every score first (K streamed once, maxima as vectors),
// then one vector exp per W keys (sums as vectors), then P x V as register-blocked broadcast-FMAs over D
// (V streamed once) -- no per-tile rescale or horizontal max. Tiles follow the token order through the
// block table (any block size: a tile may span blocks; a short last tile repeats its last key with
// probability exactly 0), and each tile prefetches the rows of the next DA_AHEAD tiles into L2.
//
// A task is a row's queries for a range of KV heads: a whole row (every KV head, so its blocks are read
// front to back once) when rows number at least twice the threads, one KV head otherwise (a single row
// still runs on every thread). Scratch: each thread takes its own from its arena (scratch.h), once per call.
//
// C entry (kernels.cpp: kv_paged_attention): q [T, H, D]; K/V pools [blocks, bs, KVH, D] of KT (simd.h: float32
// or bf16, widened as loaded); row t attends to
// the first ctx_lens[t] tokens of the table at tables + t * table_stride (stride 0: every row shares one
// table, as a prefill chunk's rows); out [T, H, D]. cascade.h runs each row's own blocks, and small
// groups' shared blocks, on da_attend.

#if KV_AVX512
constexpr int DA_VR = 4;  // queries per P x V register tile (x DA_VC vectors of D): 32 zmm registers
#else
constexpr int DA_VR = 2;  // 16 ymm registers
#endif
constexpr int DA_VC = 4;
constexpr int64_t DA_AHEAD = 3;  // tiles of prefetch lead (2, 3 and 4 ran alike; see da_prefetch)

#if KV_AVX512
// Lane i of the result = the sum of p[i]'s lanes (W = 16 vectors): pairs interleaved by 32 and 64 bits
// within 128-bit lanes (4 keys per 128-bit lane, each lane a quarter of the sums: da_reduce4), then the 128-bit
// lanes transposed and added (da_finish). 30 shuffles + 15 adds, natural key order.
constexpr int DA_QUADS = 4;  // groups of 4 keys in a tile
static inline V da_reduce4(const V* x) {
    const V a = vadd(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const V b = vadd(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    return vadd(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
}
static inline V da_finish(const V* u) {
    const V w01 = vadd(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const V w23 = vadd(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return vadd(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// x in lanes [0, n), fill in the others.
static inline V da_keep_first(V x, int64_t n, float fill) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>((1u << n) - 1u), vset1(fill), x);
}
#else
// As above for W = 8: two interleave levels, then the two 128-bit lanes added across.
constexpr int DA_QUADS = 2;
static inline V da_reduce4(const V* x) {
    const V a = vadd(_mm256_unpacklo_ps(x[0], x[1]), _mm256_unpackhi_ps(x[0], x[1]));
    const V b = vadd(_mm256_unpacklo_ps(x[2], x[3]), _mm256_unpackhi_ps(x[2], x[3]));
    const __m256d ad = _mm256_castps_pd(a), bd = _mm256_castps_pd(b);
    return vadd(_mm256_castpd_ps(_mm256_unpacklo_pd(ad, bd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ad, bd)));
}
static inline V da_finish(const V* u) {
    return vadd(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

static inline V da_keep_first(V x, int64_t n, float fill) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
    return _mm256_blendv_ps(vset1(fill), x, keep);
}
#endif

static inline V da_transpose_sum(const V* p) {
    V u[DA_QUADS];
    for (int k = 0; k < DA_QUADS; ++k) u[k] = da_reduce4(p + 4 * k);
    return da_finish(u);
}

// The W scores of each of G queries sharing a KV head (q: G rows of D = DV * W floats, pre-scaled) against the
// keys at krow[i] + off, into s + g * ks: as da_scores for each query -- the same FMA chains and reduction
// tree, so the same bits -- but each key vector is loaded (and widened, from a bf16 or fp8 pool) once for the
// G queries instead of G times, four keys at a time (their partial vectors reduced as soon as they exist, so
// the G x W partials never need registers at once).
template <int DV, int G, typename KT>
static inline void da_scores_group(const float* q, const KT* const* krow, int64_t off, float* s, int64_t ks) {
    V u[G][DA_QUADS];
    for (int quad = 0; quad < DA_QUADS; ++quad) {
        V part[G][4];
        for (int j = 0; j < 4; ++j) {
            const KT* k = krow[4 * quad + j] + off;
            V kv = kvload(k);
            for (int g = 0; g < G; ++g) part[g][j] = vmul(vload(q + g * DV * W), kv);
            for (int e = 1; e < DV; ++e) {
                kv = kvload(k + e * W);
                for (int g = 0; g < G; ++g) part[g][j] = vfma(vload(q + g * DV * W + e * W), kv, part[g][j]);
            }
        }
        for (int g = 0; g < G; ++g) u[g][quad] = da_reduce4(part[g]);
    }
    for (int g = 0; g < G; ++g) vstore(s + g * ks, da_finish(u[g]));
}

// W scores of one query (D = DV * W floats at q, pre-scaled) against the keys at krow[i] + off: per key one
// chain of DV FMAs (the query held in registers), then the transpose-reduce. DV fixed: the W partial vectors
// stay in registers.
template <int DV, typename KT>
static inline V da_scores_fixed(const float* q, const KT* const* krow, int64_t off) {
    V qv[DV], part[W];
    for (int e = 0; e < DV; ++e) qv[e] = vload(q + e * W);
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) {
        const KT* k = krow[i] + off;
        V a = vmul(qv[0], kvload(k));
        for (int e = 1; e < DV; ++e) a = vfma(qv[e], kvload(k + e * W), a);
        part[i] = a;
    }
    return da_transpose_sum(part);
}

template <typename KT>
static inline V da_scores(const float* q, int64_t DV, const KT* const* krow, int64_t off) {
    if (DV == 4) return da_scores_fixed<4>(q, krow, off);
    if (DV == 8) return da_scores_fixed<8>(q, krow, off);
    if (DV == 2) return da_scores_fixed<2>(q, krow, off);
    V part[W];
    for (int i = 0; i < W; ++i) {
        const KT* k = krow[i] + off;
        V a = vmul(vload(q), kvload(k));
        for (int64_t e = 1; e < DV; ++e) a = vfma(vload(q + e * W), kvload(k + e * W), a);
        part[i] = a;
    }
    return da_transpose_sum(part);
}

// acc[r, vectors c0..c0+C) += sum_i p[r * pstride + i] * V[vrow[i] + off] for R queries and the W keys.
template <int R, int C, typename KT>
static inline void da_values_tile(const float* p, int64_t pstride, const KT* const* vrow, int64_t off,
                                  int64_t c0, float* acc, int64_t D) {
    V a[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) a[r][c] = vload(acc + r * D + (c0 + c) * W);
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) {
        V v[C];
        for (int c = 0; c < C; ++c) v[c] = kvload(vrow[i] + off + (c0 + c) * W);
        for (int r = 0; r < R; ++r) {
            const V pr = vset1(p[r * pstride + i]);
            for (int c = 0; c < C; ++c) a[r][c] = vfma(pr, v[c], a[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) vstore(acc + r * D + (c0 + c) * W, a[r][c]);
}

template <int R, typename KT>
static inline void da_values_rows(const float* p, int64_t pstride, const KT* const* vrow, int64_t off,
                                  float* acc, int64_t D) {
    const int64_t DV = D / W;
    int64_t c = 0;
    for (; c + DA_VC <= DV; c += DA_VC) da_values_tile<R, DA_VC>(p, pstride, vrow, off, c, acc, D);
    for (; c < DV; ++c) da_values_tile<R, 1>(p, pstride, vrow, off, c, acc, D);
}

// Scratch and softmax state of one task's M queries (one thread's, reused across its tasks).
struct DecodeScratch {
    float* qs;    // [M, D] scaled queries
    float* acc;   // [M, D] unnormalised outputs
    float* mx;    // [M] maxima
    float* sum;   // [M] sums of exponentials
    float* s;     // [M, keys] scores, then probabilities (keys: the longest range rounded up to W)
    int64_t keys;
};

// Taken from `scope` (scratch.h: the calling thread's arena), valid until it ends.
static DecodeScratch da_scratch_new(ScratchScope& scope, int64_t M, int64_t D, int64_t max_tokens) {
    const int64_t keys = (max_tokens + W - 1) / W * W;
    float* buf = scope.take<float>(M * (2 * D + 2 + keys));
    return DecodeScratch{buf, buf + M * D, buf + 2 * M * D, buf + 2 * M * D + M, buf + 2 * M * D + 2 * M, keys};
}

// Loads query rows src[m * D] x scale as the task's M queries.
static void da_load_queries(DecodeScratch w, const float* src, int64_t M, int64_t D, float scale) {
    for (int64_t e = 0; e < M * D; e += W) vstore(w.qs + e, vmul(vload(src + e), vset1(scale)));
}

// Pool rows (K at krow, V at vrow: slot * kstride) of the n tokens from position k0 of the table, padded to W
// with the last one (its probability is set to 0).
template <typename KT>
static inline void da_rows(const int64_t* table, int64_t bs, int64_t kstride, const KT* kpool, const KT* vpool,
                           int64_t k0, int64_t n, const KT** krow, const KT** vrow) {
    int64_t blk = k0 / bs, in_blk = k0 % bs;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = table[blk] * bs + in_blk;
        krow[i] = kpool + slot * kstride;
        vrow[i] = vpool + slot * kstride;
        if (++in_blk == bs) { in_blk = 0; ++blk; }
    }
    for (int64_t i = n; i < W; ++i) { krow[i] = krow[n - 1]; vrow[i] = vrow[n - 1]; }
}

// Prefetches elements [off, off + len) of the W pool rows (one line per 64 bytes) with prefetcht2 (into L2,
// not L1): the next tile's, while this one computes, and (da_prefetch_tokens) the tiles up to DA_AHEAD
// ahead. A tile's rows sit in up to W different blocks, which the hardware prefetchers do not follow across,
// and one tile of lead time into L1 hid too little of DRAM's latency: 32 rows x 204 tokens over a 4 GiB
// pool, 30 layers, one Zen 4 core, ran at 6.5 GB/s that way (46 ms), 11 GB/s with these (27 ms; 2 threads
// 24.6 -> 15 ms; one request after 2,000 tokens decodes 1.47x faster, benchmarks/results/long_decode.md).
template <typename KT>
static inline void da_prefetch_row(const KT* row, int64_t len) {
    constexpr int64_t line = 64 / sizeof(KT);
    for (int64_t e = 0; e < len; e += line) __builtin_prefetch(row + e, 0, 1);
}

template <typename KT>
static inline void da_prefetch(const KT* const* rows, int64_t off, int64_t len) {
    for (int i = 0; i < W; ++i) da_prefetch_row(rows[i] + off, len);
}

// As da_prefetch, for the pool rows of tokens [tok, tok + n) of the table (n <= 0: nothing).
template <typename KT>
static inline void da_prefetch_tokens(const int64_t* table, int64_t bs, int64_t kstride, const KT* pool,
                                      int64_t tok, int64_t n, int64_t off, int64_t len) {
    if (n <= 0) return;
    for (int64_t i = 0, blk = tok / bs, in_blk = tok % bs; i < n; ++i) {  // no division per token (as da_rows)
        da_prefetch_row(pool + (table[blk] * bs + in_blk) * kstride + off, len);
        if (++in_blk == bs) { in_blk = 0; ++blk; }
    }
}

// One tile's scores of the M queries in w.qs (query m of KV head g0 + m / G) into w.s at key offset k: over a
// bf16 or fp8 pool by KV head for the common shapes (da_scores_group: D 64 or 128, G 1-4 on AVX-512; D 32 or 64,
// G 1-4 on AVX2), else query by query (the same bits either way).
template <int DV, typename KT>
static inline bool da_tile_scores_fixed(DecodeScratch w, int64_t M, int64_t G, int64_t g0, int64_t D,
                                        const KT* const* krow, int64_t k) {
    if (G < 1 || G > 4) return false;
    for (int64_t h = 0; h < M / G; ++h) {
        const float* q = w.qs + h * G * D;
        float* s = w.s + h * G * w.keys + k;
        const int64_t off = (g0 + h) * D;
        if (G == 1) da_scores_group<DV, 1>(q, krow, off, s, w.keys);
        else if (G == 2) da_scores_group<DV, 2>(q, krow, off, s, w.keys);
        else if (G == 3) da_scores_group<DV, 3>(q, krow, off, s, w.keys);
        else da_scores_group<DV, 4>(q, krow, off, s, w.keys);
    }
    return true;
}

template <typename KT>
static inline void da_tile_scores(DecodeScratch w, int64_t M, int64_t G, int64_t g0, int64_t D,
                                  const KT* const* krow, int64_t k) {
    const int64_t DV = D / W;
    if constexpr (sizeof(KT) < 4) {  // float32 keys cost no widening: query by query measured the same or faster
        if (DV == 4 && da_tile_scores_fixed<4>(w, M, G, g0, D, krow, k)) return;
        if (DV == 8 && da_tile_scores_fixed<8>(w, M, G, g0, D, krow, k)) return;
    }
    for (int64_t m = 0; m < M; ++m) vstore(w.s + m * w.keys + k, da_scores(w.qs + m * D, DV, krow, (g0 + m / G) * D));
}

// The M queries in w.qs (query m belongs to KV head g0 + m / G) attend to tokens [tok0, tok1) of the
// sequence whose block table is `table` (tok1 - tok0 <= w.keys). Leaves each query's max, sum of
// exponentials and unnormalised output in w (no tokens: max -inf, sum 0, output 0). Two passes: every
// score first (K streamed once, maxima as vectors), then exponentials, then P x V (V streamed once) --
// no per-tile rescaling or horizontal max.
template <typename KT>
static void da_attend(DecodeScratch w, int64_t M, int64_t G, int64_t g0, int64_t D, int64_t KVH,
                      const KT* kpool, const KT* vpool, int64_t bs, const int64_t* table, int64_t tok0,
                      int64_t tok1) {
    const int64_t DV = D / W, kstride = KVH * D, len = tok1 - tok0, padded = (len + W - 1) / W * W;
    const int64_t ks = w.keys, span = M / G * D, off0 = g0 * D;  // the task's heads: floats [off0, off0 + span)
    const KT* rows[2][2][W];  // [tile parity][K, V][key]
    for (int64_t e = 0; e < M * D; ++e) w.acc[e] = 0.0f;
    for (int64_t m = 0; m < M; ++m) { w.mx[m] = -__builtin_inff(); w.sum[m] = 0.0f; }
    if (len <= 0) return;
    const int64_t last = padded - W, tail = len - last;  // the last tile's offset and its keys
    da_rows(table, bs, kstride, kpool, vpool, tok0, last ? W : tail, rows[0][0], rows[0][1]);
    for (int64_t k = 0, b = 0; k < padded; k += W, b ^= 1) {
        const KT* const* krow = rows[b][0];
        if (k < last) {
            da_rows(table, bs, kstride, kpool, vpool, tok0 + k + W, k + W == last ? tail : W, rows[b ^ 1][0],
                    rows[b ^ 1][1]);
            da_prefetch(rows[b ^ 1][0], off0, span);
            for (int64_t a = k ? DA_AHEAD : 2; a <= DA_AHEAD; ++a)
                da_prefetch_tokens(table, bs, kstride, kpool, tok0 + k + a * W, std::min<int64_t>(W, len - k - a * W),
                                   off0, span);
        } else {  // the last K tile: P x V's first V tile next
            da_rows(table, bs, kstride, kpool, vpool, tok0, last ? W : tail, rows[b ^ 1][0], rows[b ^ 1][1]);
            da_prefetch(rows[b ^ 1][1], off0, span);
        }
        da_tile_scores(w, M, G, g0, D, krow, k);
    }
    for (int64_t m = 0; m < M; ++m) {
        float* sm = w.s + m * ks;
        if (tail < W) vstore(sm + last, da_keep_first(vload(sm + last), tail, -__builtin_inff()));
        V vm = vload(sm);
        for (int64_t k = W; k < padded; k += W) vm = vmax(vm, vload(sm + k));
        const float mx = vhmax(vm);
        const V neg = vset1(-mx);
        V total = vzero();
        for (int64_t k = 0; k < padded; k += W) {
            V p = vexp(vadd(vload(sm + k), neg));
            if (k == last && tail < W) p = da_keep_first(p, tail, 0.0f);  // exp clamps -inf to ~1e-38: exactly 0
            vstore(sm + k, p);
            total = vadd(total, p);
        }
        w.mx[m] = mx;
        w.sum[m] = vsum(total);
    }
    da_rows(table, bs, kstride, kpool, vpool, tok0, last ? W : tail, rows[0][0], rows[0][1]);
    for (int64_t k = 0, b = 0; k < padded; k += W, b ^= 1) {
        const KT* const* vrow = rows[b][1];
        if (k < last) {
            da_rows(table, bs, kstride, kpool, vpool, tok0 + k + W, k + W == last ? tail : W, rows[b ^ 1][0],
                    rows[b ^ 1][1]);
            da_prefetch(rows[b ^ 1][1], off0, span);
            for (int64_t a = k ? DA_AHEAD : 2; a <= DA_AHEAD; ++a)
                da_prefetch_tokens(table, bs, kstride, vpool, tok0 + k + a * W, std::min<int64_t>(W, len - k - a * W),
                                   off0, span);
        }
        for (int64_t h = 0; h < M / G; ++h) {  // P x V per KV head: its G queries in register tiles
            const int64_t off = (g0 + h) * D;
            for (int64_t r0 = h * G, r1 = (h + 1) * G; r0 < r1;) {
                const int64_t R = r1 - r0 < DA_VR ? r1 - r0 : DA_VR;
                const float* p = w.s + r0 * ks + k;
                float* acc = w.acc + r0 * D;
                if (R == 4) da_values_rows<4>(p, ks, vrow, off, acc, D);
                else if (R == 3) da_values_rows<3>(p, ks, vrow, off, acc, D);
                else if (R == 2) da_values_rows<2>(p, ks, vrow, off, acc, D);
                else da_values_rows<1>(p, ks, vrow, off, acc, D);
                r0 += R;
            }
        }
    }
}

template <typename KT>
static int paged_attention(const float* q, int64_t T, int64_t H, int64_t KVH, int64_t D, const KT* kpool,
                           const KT* vpool, int64_t bs, const int64_t* tables, int64_t table_stride,
                           const int64_t* ctx_lens, float scale, float* out) {
    if (D % W != 0 || H % KVH != 0) return -2;
    const int64_t G = H / KVH;
    const int threads = kv_threads();
    const int64_t heads_per_task = T >= 2 * threads ? KVH : 1;  // whole rows once every thread has two
    const int64_t parts = KVH / heads_per_task, M = heads_per_task * G;
    int64_t max_ctx = 1;
    for (int64_t t = 0; t < T; ++t) max_ctx = ctx_lens[t] > max_ctx ? ctx_lens[t] : max_ctx;
#pragma omp parallel num_threads(threads)
    {
        ScratchScope scope;  // this thread's
        DecodeScratch w = da_scratch_new(scope, M, D, max_ctx);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * parts; ++task) {
            const int64_t t = task / parts, g0 = (task % parts) * heads_per_task;
            da_load_queries(w, q + (t * H + g0 * G) * D, M, D, scale);
            da_attend(w, M, G, g0, D, KVH, kpool, vpool, bs, tables + t * table_stride, 0, ctx_lens[t]);
            for (int64_t m = 0; m < M; ++m) {
                float* o = out + (t * H + g0 * G + m) * D;
                const V inv = vset1(1.0f / w.sum[m]);
                for (int64_t e = 0; e < D; e += W) vstore(o + e, vmul(vload(w.acc + m * D + e), inv));
            }
        }
    }
    return 0;
}
