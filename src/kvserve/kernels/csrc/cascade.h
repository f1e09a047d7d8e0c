// Shared-prefix (cascade) decode attention, compiled once per ISA like impl.h (included after simd.h).
//
// Decode rows that share leading KV blocks (the same physical blocks in their block tables: a prompt
// prefix cached once, or the prompt of n forked samples) form a group. For each group and KV head, the
// queries of every member's heads of that KV head are stacked into one [members x G, D] matrix and
// attend to the shared blocks once, as one matrix product per W-token tile (the K tile is transposed
// once and used by every query), in chunks of blocks that run in parallel; each chunk keeps its running
// max, sum and unnormalised output. Then every row attends to its own blocks after the shared ones
// (rows in no group: their whole context), and the parts are merged by log-sum-exp, as FlashInfer's
// cascade, vLLM's cascade attention and Hydragen do. Rows in no group cost what paged_attention costs.
//
// C entry (kernels.cpp: kv_cascade_attention): q [T, H, D]; K/V pools [blocks, bs, KVH, D]; row t's
// table at tables + t * table_stride, ctx_lens[t] tokens; groups: group_rows[group_offsets[i] ..
// group_offsets[i + 1]) share their first group_shared_blocks[i] blocks (read from the first member's
// table); row_shared_blocks[t] is the number of leading blocks its group covers (0 outside a group).
// out [T, H, D].

constexpr int64_t CASCADE_CHUNK_TOKENS = 256;  // shared tokens per parallel task
constexpr int64_t CASCADE_TRANSPOSE_MIN_QUERIES = 8;  // from this many queries a transposed K tile pays

// Online-softmax state of M queries: running max, sum of exponentials, unnormalised output [M, D].
struct SoftmaxState {
    float* mx;
    float* sum;
    float* acc;
};

static inline void state_reset(SoftmaxState st, int64_t M, int64_t D) {
    for (int64_t j = 0; j < M; ++j) { st.mx[j] = -__builtin_inff(); st.sum[j] = 0.0f; }
    for (int64_t e = 0; e < M * D; ++e) st.acc[e] = 0.0f;
}

// W scores of R queries against one transposed K tile kt [D, W]: R independent FMA chains over D.
template <int R>
static inline void scores_tile(const float* qs, int64_t D, const float* kt, float* s, int64_t BSP) {
    V a[R];
    for (int r = 0; r < R; ++r) a[r] = vzero();
    for (int64_t d = 0; d < D; ++d) {
        const V kv = vload(kt + d * W);
        for (int r = 0; r < R; ++r) a[r] = vfma(vset1(qs[r * D + d]), kv, a[r]);
    }
    for (int r = 0; r < R; ++r) vstore(s + r * BSP, a[r]);
}

// Scores s[j * BSP + i] = qs[j] . K[token i] for the ntok tokens of one block (K rows at kp, stride KVH*D).
static inline void block_scores(const float* qs, int64_t M, int64_t D, const float* kp, int64_t kstride,
                                int64_t ntok, int64_t BSP, float* kt, float* s) {
    const int64_t DV = D / W;
    if (M < CASCADE_TRANSPOSE_MIN_QUERIES) {
        for (int64_t i = 0; i < ntok; ++i) {
            const float* k = kp + i * kstride;
            for (int64_t j = 0; j < M; ++j) {
                V a = vmul(vload(qs + j * D), vload(k));
                for (int64_t e = 1; e < DV; ++e) a = vfma(vload(qs + j * D + e * W), vload(k + e * W), a);
                s[j * BSP + i] = vsum(a);
            }
        }
        return;
    }
    for (int64_t i0 = 0; i0 < ntok; i0 += W) {
        const int64_t n = ntok - i0 < W ? ntok - i0 : W;
        for (int64_t lane = 0; lane < W; ++lane)  // kt[d * W + lane] = K[i0 + lane][d], zero past the block
            for (int64_t d = 0; d < D; ++d) kt[d * W + lane] = lane < n ? kp[(i0 + lane) * kstride + d] : 0.0f;
        int64_t j = 0;
        for (; j + 8 <= M; j += 8) scores_tile<8>(qs + j * D, D, kt, s + j * BSP + i0, BSP);
        for (; j + 4 <= M; j += 4) scores_tile<4>(qs + j * D, D, kt, s + j * BSP + i0, BSP);
        for (; j < M; ++j) scores_tile<1>(qs + j * D, D, kt, s + j * BSP + i0, BSP);
    }
}

// acc[r, c-th vector] += sum_i p[r, i] * V[i] for R query rows and C vectors of D, kept in registers over
// the block's tokens (the same order of additions as one row at a time).
template <int R, int C>
static inline void values_tile(const float* s, int64_t BSP, const float* vp, int64_t vstride, int64_t ntok,
                               float* acc, int64_t D) {
    V a[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) a[r][c] = vload(acc + r * D + c * W);
    for (int64_t i = 0; i < ntok; ++i) {
        V v[C];
        for (int c = 0; c < C; ++c) v[c] = vload(vp + i * vstride + c * W);
        for (int r = 0; r < R; ++r) {
            const V p = vset1(s[r * BSP + i]);
            for (int c = 0; c < C; ++c) a[r][c] = vfma(p, v[c], a[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) vstore(acc + r * D + c * W, a[r][c]);
}

template <int R>
static inline void values_rows(const float* s, int64_t BSP, const float* vp, int64_t vstride, int64_t ntok,
                               float* acc, int64_t D) {
    const int64_t DV = D / W;
    int64_t e = 0;
    for (; e + 4 <= DV; e += 4) values_tile<R, 4>(s, BSP, vp + e * W, vstride, ntok, acc + e * W, D);
    for (; e < DV; ++e) values_tile<R, 1>(s, BSP, vp + e * W, vstride, ntok, acc + e * W, D);
}

// acc [M, D] += P [M, ntok] (rows of s, stride BSP) x V [ntok, D] (rows at vp, stride vstride).
static inline void block_values(const float* s, int64_t M, int64_t BSP, const float* vp, int64_t vstride,
                                int64_t ntok, float* acc, int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= M; j += 4) values_rows<4>(s + j * BSP, BSP, vp, vstride, ntok, acc + j * D, D);
    if (M - j == 3) values_rows<3>(s + j * BSP, BSP, vp, vstride, ntok, acc + j * D, D);
    else if (M - j == 2) values_rows<2>(s + j * BSP, BSP, vp, vstride, ntok, acc + j * D, D);
    else if (M - j == 1) values_rows<1>(s + j * BSP, BSP, vp, vstride, ntok, acc + j * D, D);
}

// M pre-scaled queries qs [M, D] attend to tokens [tok0, tok1) (tok0 a multiple of bs) of the sequence
// whose block table is `table`, KV head g; the online-softmax state is updated in place.
static void attend_range(const float* qs, int64_t M, int64_t D, const float* kpool, const float* vpool,
                         int64_t KVH, int64_t g, int64_t bs, const int64_t* table, int64_t tok0, int64_t tok1,
                         float* s, float* kt, SoftmaxState st) {
    const int64_t BSP = (bs + W - 1) / W * W, DV = D / W, kstride = KVH * D;
    for (int64_t start = tok0; start < tok1; start += bs) {
        const int64_t ntok = tok1 - start < bs ? tok1 - start : bs;
        const int64_t base = table[start / bs] * bs;
        block_scores(qs, M, D, kpool + (base * KVH + g) * D, kstride, ntok, BSP, kt, s);
        const bool full = ntok == BSP;  // a whole block of whole vectors: max and sum stay in vectors
        for (int64_t j = 0; j < M; ++j) {
            float* sj = s + j * BSP;
            float bmax = sj[0];
            if (full) {
                V m = vload(sj);
                for (int64_t i = W; i < BSP; i += W) m = vmax(m, vload(sj + i));
                bmax = vhmax(m);
            } else {
                for (int64_t i = 1; i < ntok; ++i) bmax = sj[i] > bmax ? sj[i] : bmax;
            }
            const float mnew = bmax > st.mx[j] ? bmax : st.mx[j];
            for (int64_t i = ntok; i < BSP; ++i) sj[i] = mnew;  // defined padding lanes
            V vs = vzero();
            for (int64_t i = 0; i < BSP; i += W) {
                const V e = vexp(vadd(vload(sj + i), vset1(-mnew)));
                vstore(sj + i, e);
                vs = vadd(vs, e);
            }
            float bsum = 0.0f;
            if (full) bsum = vsum(vs);
            else
                for (int64_t i = 0; i < ntok; ++i) bsum += sj[i];
            if (mnew > st.mx[j]) {
                const float corr = st.mx[j] == -__builtin_inff() ? 0.0f : __builtin_expf(st.mx[j] - mnew);
                for (int64_t e = 0; e < DV; ++e)
                    vstore(st.acc + j * D + e * W, vmul(vload(st.acc + j * D + e * W), vset1(corr)));
                st.sum[j] *= corr;
                st.mx[j] = mnew;
            }
            st.sum[j] += bsum;
        }
        block_values(s, M, BSP, vpool + (base * KVH + g) * D, kstride, ntok, st.acc, D);
    }
}

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

static int cascade_attention(const float* q, int64_t T, int64_t H, int64_t KVH, int64_t D, const float* kpool,
                             const float* vpool, int64_t bs, const int64_t* tables, int64_t table_stride,
                             const int64_t* ctx_lens, int64_t num_groups, const int64_t* group_offsets,
                             const int64_t* group_rows, const int64_t* group_shared_blocks,
                             const int64_t* row_shared_blocks, float scale, float* out) {
    if (D % W != 0 || H % KVH != 0) return -2;
    const int64_t G = H / KVH, BSP = (bs + W - 1) / W * W;
    const int64_t chunk_blocks = CASCADE_CHUNK_TOKENS / bs > 0 ? CASCADE_CHUNK_TOKENS / bs : 1;
    // Phase 1 tasks: (group, KV head, chunk of shared blocks); each writes mx/sum [M] and acc [M, D].
    int64_t* task_offset = new int64_t[num_groups + 1];  // first task of each group
    int64_t* state_offset = new int64_t[num_groups + 1];  // first float of each group's partial states
    int64_t* row_slot = new int64_t[T];  // row -> (group, position in group), -1 outside a group
    int64_t* row_group = new int64_t[T];
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
    float* states = new float[state_offset[num_groups] > 0 ? state_offset[num_groups] : 1];
#pragma omp parallel num_threads(kv_threads())
    {
        PrefillScratch pw = pf_scratch_new((max_m + W - 1) / W * W, D);
        float* qs = new float[G * D];
        float* s = new float[G * BSP];
        float* kt = new float[D * W];
        float* acc = new float[G * D];
        float* mx = new float[G];
        float* sum = new float[G];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < task_offset[num_groups]; ++task) {
            int64_t i = 0;
            while (task_offset[i + 1] <= task) ++i;
            const int64_t members = group_offsets[i + 1] - group_offsets[i], M = members * G;
            const int64_t chunks = (task_offset[i + 1] - task_offset[i]) / KVH;
            const int64_t g = (task - task_offset[i]) / chunks, c = (task - task_offset[i]) % chunks;
            const int64_t* table = tables + group_rows[group_offsets[i]] * table_stride;
            // The stacked queries in lanes against each shared key row (prefill.h's tiles, no mask).
            const int64_t Mp = (M + W - 1) / W * W;
            pf_begin(pw, M, Mp, D);
            for (int64_t r = 0; r < members; ++r)
                for (int64_t j = 0; j < G; ++j)
                    pf_put_query(pw, Mp, D, r * G + j, q + (group_rows[group_offsets[i] + r] * H + g * G + j) * D, scale);
            const int64_t b0 = c * chunk_blocks;
            const int64_t b1 = b0 + chunk_blocks < group_shared_blocks[i] ? b0 + chunk_blocks : group_shared_blocks[i];
            pf_attend(pw, Mp, D, G, kpool, vpool, KVH, g, bs, table, b0 * bs, b1 * bs, -1);
            float* base = states + state_offset[i] + (g * chunks + c) * M * (D + 2);
            for (int64_t m = 0; m < M; ++m) { base[m] = pw.mx[m]; base[M + m] = pw.sum[m]; }
            for (int64_t e = 0; e < M * D; ++e) base[2 * M + e] = pw.acc[e];
        }
        // Phase 2: each row's own blocks, then the merge with its group's shared chunks.
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t g = 0; g < KVH; ++g) {
                for (int64_t j = 0; j < G; ++j) {
                    const float* src = q + (t * H + g * G + j) * D;
                    for (int64_t e = 0; e < D; e += W) vstore(qs + j * D + e, vmul(vload(src + e), vset1(scale)));
                }
                SoftmaxState st{mx, sum, acc};
                state_reset(st, G, D);
                attend_range(qs, G, D, kpool, vpool, KVH, g, bs, tables + t * table_stride,
                             row_shared_blocks[t] * bs, ctx_lens[t], s, kt, st);
                const int64_t i = row_group[t];
                if (i >= 0) {
                    const int64_t members = group_offsets[i + 1] - group_offsets[i], M = members * G;
                    const int64_t chunks = (task_offset[i + 1] - task_offset[i]) / KVH;
                    for (int64_t c = 0; c < chunks; ++c) {
                        const float* part = states + state_offset[i] + (g * chunks + c) * M * (D + 2);
                        for (int64_t j = 0; j < G; ++j) {
                            const int64_t qj = row_slot[t] * G + j;
                            merge_into(mx[j], sum[j], acc + j * D, part[qj], part[M + qj], part + 2 * M + qj * D, D);
                        }
                    }
                }
                for (int64_t j = 0; j < G; ++j) {
                    float* oj = out + (t * H + g * G + j) * D;
                    const V inv = vset1(1.0f / sum[j]);
                    for (int64_t e = 0; e < D; e += W) vstore(oj + e, vmul(vload(acc + j * D + e), inv));
                }
            }
        }
        delete[] qs; delete[] s; delete[] kt; delete[] acc; delete[] mx; delete[] sum;
        pf_scratch_free(pw);
    }
    delete[] task_offset; delete[] state_offset; delete[] row_slot; delete[] row_group; delete[] states;
    return 0;
}
