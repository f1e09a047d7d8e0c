// Shared-prefix (cascade) decode attention, compiled once per ISA like impl.h (included after simd.h).
//
// Decode rows that share leading KV blocks (the same physical blocks in their block tables: a prompt
// prefix cached once, or the prompt of n forked samples) form a group. For each group and KV head, the
// queries of every member's heads of that KV head are stacked into one [members x G, D] matrix and
// attend to the shared blocks once, as one matrix product (prefill.h's tiles: the stacked queries in
// vector lanes against each shared key row), in chunks of blocks that run in parallel; each chunk keeps its running
// max, sum and unnormalised output. Then every row attends to its own blocks after the shared ones
// (rows in no group: their whole context) with decode_attention.h's kernel, and the parts are merged by
// log-sum-exp, as FlashInfer's cascade, vLLM's cascade attention and Hydragen do. Rows in no group cost what
// paged_attention costs. prod (prefill.h's ATTN_*) applies to the shared parts on prefill.h's tiles; the
// decode kernel's parts (own blocks, small groups) always run float32 products.
//
// C entry (kernels.cpp: kv_cascade_attention): q [T, H, D]; K/V pools [blocks, bs, KVH, D]; row t's
// table at tables + t * table_stride, ctx_lens[t] tokens; groups: group_rows[group_offsets[i] ..
// group_offsets[i + 1]) share their first group_shared_blocks[i] blocks (read from the first member's
// table); row_shared_blocks[t] is the number of leading blocks its group covers (0 outside a group).
// out [T, H, D].

constexpr int64_t CASCADE_CHUNK_TOKENS = 256;  // shared tokens per parallel task
// A group's shared part with fewer stacked queries than one vector (e.g. 2 rows x 3 heads) runs on the
// decode kernel (keys in lanes) instead of prefill.h's tiles (queries in lanes, mostly empty lanes then).
constexpr int64_t CASCADE_LANE_TILE_MIN_QUERIES = W;

// Folds state `part` (query j) into the running merge (m, l, acc): log-sum-exp rescaling of both sides.
static inline void merge_into(float& m, float& l, float* acc, float pm, float pl, const float* pacc, int64_t D) {
    if (pm == -__builtin_inff()) return;
    const float mnew = pm > m ? pm : m;
    const float a = m == -__builtin_inff() ? 0.0f : __builtin_expf(m - mnew), b = __builtin_expf(pm - mnew);
    for (int64_t e = 0; e < D; e += W)
        vstore(acc + e, vfma(vload(pacc + e), vset1(b), vmul(vload(acc + e), vset1(a))));
    l = l * a + pl * b;
    m = mnew;
}

template <typename KT>
static int cascade_attention(const float* q, int64_t T, int64_t H, int64_t KVH, int64_t D, const KT* kpool,
                             const KT* vpool, int64_t bs, const int64_t* tables, int64_t table_stride,
                             const int64_t* ctx_lens, int64_t num_groups, const int64_t* group_offsets,
                             const int64_t* group_rows, const int64_t* group_shared_blocks,
                             const int64_t* row_shared_blocks, float scale, int prod, float* out) {
    if (D % W != 0 || H % KVH != 0) return -2;
    if (prod != ATTN_F32 && (prod != ATTN_BF16 || sizeof(KT) != 2)) return -5;  // bf16 products: a bf16 pool
    const int64_t G = H / KVH;
    const int64_t chunk_blocks = CASCADE_CHUNK_TOKENS / bs > 0 ? CASCADE_CHUNK_TOKENS / bs : 1;
    // Phase 1 tasks: (group, KV head, chunk of shared blocks); each writes mx/sum [M] and acc [M, D].
    ScratchScope scope;  // scratch.h
    int64_t* task_offset = scope.take<int64_t>(num_groups + 1);  // first task of each group
    int64_t* state_offset = scope.take<int64_t>(num_groups + 1);  // first float of each group's partial states
    int64_t* row_slot = scope.take<int64_t>(T);  // row -> (group, position in group), -1 outside a group
    int64_t* row_group = scope.take<int64_t>(T);
    int64_t max_m = G;  // most queries stacked in one task
    for (int64_t t = 0; t < T; ++t) { row_slot[t] = -1; row_group[t] = -1; }
    task_offset[0] = state_offset[0] = 0;
    for (int64_t i = 0; i < num_groups; ++i) {
        const int64_t members = group_offsets[i + 1] - group_offsets[i];
        const int64_t chunks = (group_shared_blocks[i] + chunk_blocks - 1) / chunk_blocks;
        task_offset[i + 1] = task_offset[i] + KVH * chunks;
        state_offset[i + 1] = state_offset[i] + KVH * chunks * members * G * (D + 2);
        for (int64_t r = 0; r < members; ++r) {
            row_slot[group_rows[group_offsets[i] + r]] = r;
            row_group[group_rows[group_offsets[i] + r]] = i;
        }
        max_m = members * G > max_m ? members * G : max_m;
    }
    float* states = scope.take<float>(state_offset[num_groups]);
    // Phase 2 tasks as paged_attention's: a row's KV heads together once every thread has two rows.
    const int threads = kv_threads();
    const int64_t heads_per_task = T >= 2 * threads ? KVH : 1, parts = KVH / heads_per_task;
    int64_t max_keys = chunk_blocks * bs;  // the decode scratch serves shared chunks and own parts
    for (int64_t t = 0; t < T; ++t) {
        const int64_t own = ctx_lens[t] - row_shared_blocks[t] * bs;
        max_keys = own > max_keys ? own : max_keys;
    }
    const int64_t max_da = max_m > heads_per_task * G ? max_m : heads_per_task * G;
#pragma omp parallel num_threads(threads)
    {
        ScratchScope own;  // this thread's
        PrefillScratch pw = pf_scratch_new(own, (max_m + W - 1) / W * W, D);
        DecodeScratch dw = da_scratch_new(own, max_da, D, max_keys);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < task_offset[num_groups]; ++task) {
            int64_t i = 0;
            while (task_offset[i + 1] <= task) ++i;
            const int64_t members = group_offsets[i + 1] - group_offsets[i], M = members * G;
            const int64_t chunks = (task_offset[i + 1] - task_offset[i]) / KVH;
            const int64_t g = (task - task_offset[i]) / chunks, c = (task - task_offset[i]) % chunks;
            const int64_t* table = tables + group_rows[group_offsets[i]] * table_stride;
            const int64_t b0 = c * chunk_blocks;
            const int64_t b1 = b0 + chunk_blocks < group_shared_blocks[i] ? b0 + chunk_blocks : group_shared_blocks[i];
            float* base = states + state_offset[i] + (g * chunks + c) * M * (D + 2);
            const float *mx, *sum, *acc;
            if (M < CASCADE_LANE_TILE_MIN_QUERIES) {  // keys in lanes: the M queries all of KV head g
                for (int64_t r = 0; r < members; ++r)
                    for (int64_t j = 0; j < G; ++j) {
                        const float* src = q + (group_rows[group_offsets[i] + r] * H + g * G + j) * D;
                        for (int64_t e = 0; e < D; e += W)
                            vstore(dw.qs + (r * G + j) * D + e, vmul(vload(src + e), vset1(scale)));
                    }
                da_attend(dw, M, M, g, D, KVH, kpool, vpool, bs, table, b0 * bs, b1 * bs);
                mx = dw.mx; sum = dw.sum; acc = dw.acc;
            } else {  // the stacked queries in lanes against each shared key row (prefill.h's tiles, no mask)
                const int64_t Mp = (M + W - 1) / W * W;
                pf_begin(pw, M, Mp, D);
                for (int64_t r = 0; r < members; ++r)
                    for (int64_t j = 0; j < G; ++j)
                        pf_put_query(pw, Mp, D, r * G + j, q + (group_rows[group_offsets[i] + r] * H + g * G + j) * D,
                                     scale);
                pf_attend(pw, Mp, D, G, kpool, vpool, KVH, g, bs, table, b0 * bs, b1 * bs, -1, prod);
                mx = pw.mx; sum = pw.sum; acc = pw.acc;
            }
            for (int64_t m = 0; m < M; ++m) { base[m] = mx[m]; base[M + m] = sum[m]; }
            for (int64_t e = 0; e < M * D; ++e) base[2 * M + e] = acc[e];
        }
        // Phase 2: each row's own blocks, then the merge with its group's shared chunks.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * parts; ++task) {
            const int64_t t = task / parts, g0 = (task % parts) * heads_per_task, M = heads_per_task * G;
            da_load_queries(dw, q + (t * H + g0 * G) * D, M, D, scale);
            da_attend(dw, M, G, g0, D, KVH, kpool, vpool, bs, tables + t * table_stride, row_shared_blocks[t] * bs,
                      ctx_lens[t]);
            const int64_t i = row_group[t];
            for (int64_t m = 0; m < M; ++m) {
                const int64_t g = g0 + m / G, j = m % G;
                float* acc = dw.acc + m * D;
                if (i >= 0) {
                    const int64_t members = group_offsets[i + 1] - group_offsets[i], GM = members * G;
                    const int64_t chunks = (task_offset[i + 1] - task_offset[i]) / KVH, qj = row_slot[t] * G + j;
                    for (int64_t c = 0; c < chunks; ++c) {
                        const float* part = states + state_offset[i] + (g * chunks + c) * GM * (D + 2);
                        merge_into(dw.mx[m], dw.sum[m], acc, part[qj], part[GM + qj], part + 2 * GM + qj * D, D);
                    }
                }
                float* o = out + (t * H + g * G + j) * D;
                const V inv = vset1(1.0f / dw.sum[m]);
                for (int64_t e = 0; e < D; e += W) vstore(o + e, vmul(vload(acc + e), inv));
            }
        }
    }
    return 0;
}
