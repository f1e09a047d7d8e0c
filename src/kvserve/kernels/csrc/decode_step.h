// The decode step of the layer loop (up to DECODE_MAX_ROWS rows), compiled once per ISA and included by
// layer.h. Per layer the kernels are those of layer_forward, in the same order and with the same per-row
// arithmetic (bit-identical results): norm, qkv, RoPE + KV write, paged (or cascade) attention, o proj,
// residual + norm, gate_up with SwiGLU fused per column chunk, down; then the final norm. The whole step
// runs in ONE OpenMP region, where layer_forward opens ~5 a layer (~150 a step, each ending in a barrier).
//
// Inside the region each kernel is a phase of chunks (16 output columns of a matmul; one row of a norm, of
// RoPE; one (row, KV head) of attention, as decode_attention.h runs it), dealt in contiguous lanes,
// one per thread; a thread runs its own lane in order (its prefetches of the next chunk stay on its core),
// then takes what is left of the others'. A phase ends when all its chunks are done, whoever ran them, not
// when every thread has arrived: on a loaded machine a thread the OS has descheduled no longer stalls every
// kernel; the others do its share and move on (only the region's end, once a step, waits for every thread).

struct alignas(64) WorkLane {
    std::atomic<int64_t> next;
    int64_t end;
};
struct alignas(64) WorkCount {
    std::atomic<int64_t> value;
};

struct Phase {
    WorkLane* lanes;  // [team]
    WorkCount* done;  // [team]: chunks finished by each thread
    int team;
    int64_t n;
};

static void phase_reset(Phase& p, int64_t n) {
    p.n = n;
    for (int t = 0; t < p.team; ++t) {
        p.lanes[t].next.store(n * t / p.team, std::memory_order_relaxed);
        p.lanes[t].end = n * (t + 1) / p.team;
        p.done[t].value.store(0, std::memory_order_relaxed);
    }
}

// Weights a thread will read next, prefetched while it waits for a phase (one row's norm, RoPE or attention
// is a single chunk: the other threads would only spin), so its next matmul starts from cache.
struct Ahead {
    const uint8_t* data;
    int64_t bytes;
};

// Run chunks of p (own lane first, then the others'), then wait until all n are done (prefetching `ahead`).
template <class F>
static inline void phase_run(Phase& p, int tid, F&& work, Ahead ahead = Ahead{nullptr, 0}) {
    for (int s = 0; s < p.team; ++s) {
        WorkLane& lane = p.lanes[(tid + s) % p.team];
        while (lane.next.load(std::memory_order_relaxed) < lane.end) {
            const int64_t i = lane.next.fetch_add(1, std::memory_order_acq_rel);
            if (i >= lane.end) break;
            work(i);
            p.done[tid].value.fetch_add(1, std::memory_order_release);
        }
    }
    int64_t prefetched = 0;
    for (int spins = 0;; ++spins) {
        int64_t finished = 0;
        for (int t = 0; t < p.team; ++t) finished += p.done[t].value.load(std::memory_order_acquire);
        if (finished >= p.n) return;
        if (prefetched < ahead.bytes) {  // a few lines per check: the phase may end any moment
            const int64_t piece = ahead.bytes - prefetched < 512 ? ahead.bytes - prefetched : 512;
            prefetch_span(ahead.data + prefetched, piece);
            prefetched += piece;
            continue;
        }
        if (spins < 4096) _mm_pause();
        else sched_yield();  // the thread running the last chunk was descheduled: let it run
    }
}

constexpr int64_t DECODE_MAX_ROWS = 4;  // the per-row matmul's row tile; wider steps take layer_forward's path

// out[t, j] = silu(g) * u for columns [c0, c1) of row t, as fused.h's swiglu (c0 a multiple of W, so every
// column takes the same vector or scalar path as there).
static inline void swiglu_cols(const float* gate_up, int64_t t, int64_t I, float* out, int64_t c0, int64_t c1) {
    const float* g = gate_up + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    const V one = vset1(1.0f);
    int64_t j = c0;
    for (; j + W <= c1; j += W) {
        const V x = vload(g + j);
        const V e = vexp(vsub(vzero(), x));
        vstore(o + j, vmul(vdiv(x, vadd(one, e)), vload(u + j)));
    }
    for (; j < c1; ++j) o[j] = g[j] / (1.0f + __builtin_expf(-g[j])) * u[j];
}

struct DecodeStep {
    const LayerModel& m;
    int act_quant;
    int64_t T;
    const int64_t* positions;
    const int64_t* slots;
    void* pool;  // KT elements (decode_forward's)
    int64_t layer_stride;
    float* normed;
    float* delta;
    float* qkv;
    float* q;
    float* attn;
    float* gate_up;
    float* act;
    int8_t* xq;      // int8 activations [T, k] of the next matmul
    float* xq_scales;
    uint8_t* scratch;  // per thread: i8_chunk_scratch(max nb) bytes
    int64_t scratch_bytes;

    Q8Rows rows_i8(int64_t k) const {
        const int64_t nb = k / QK;
#if KV_AVX512
        return Q8Rows{xq, xq_scales, xq_scales + T * nb, nullptr, nullptr};
#else
        return Q8Rows{xq, xq_scales, xq_scales + T * nb, xq_scales + 2 * T * nb, xq_scales + 2 * T * nb + T * nb * LANES};
#endif
    }

    void quantize_row(const float* x, int64_t k, int64_t t) const {
        quantize_rows(x + t * k, 1, k, i8_offset(rows_i8(k), t, k, k / QK));
    }

    // y [T, w.rows] = x [T, k] @ w.T, output columns [c0, c1) (x already quantized for int8).
    void matmul_cols(int tid, const float* x, int64_t k, const LayerMatrix& w, float* y, int64_t c0, int64_t c1) const {
        const int qt = static_cast<int>(w.qtype);
        if (act_quant)
            qmatmul_i8_cols(qt, rows_i8(k), T, k, w.data, w.rows, w.row_bytes, y, w.rows, c0, c1,
                            scratch + tid * scratch_bytes);
        else
            qmatmul_cols(qt, x, T, k, w.data, w.rows, w.row_bytes, y, w.rows, c0, c1);
    }

    static int64_t chunks(int64_t n, int64_t size) { return (n + size - 1) / size; }

    // The weight rows of thread tid's lane of a matmul phase over `n` columns of w starting at column `first`
    // (at most 256 KB: what its L2 takes on top of the rest).
    Ahead lane_weights(const LayerMatrix& w, int64_t n, int64_t first, int tid, int team) const {
        const int64_t nc = chunks(n, chunk_cols());
        const int64_t c0 = nc * tid / team * chunk_cols(), c1 = nc * (tid + 1) / team * chunk_cols();
        const int64_t end = c1 < n ? c1 : n;
        if (c0 >= end) return Ahead{nullptr, 0};
        const bool packed = (w.qtype & QT_I8_PACKED) != 0;  // row_bytes: one 16-column group's (c0 % 16 == 0)
        const int64_t bytes = packed ? packed_groups(end - c0) * w.row_bytes : (end - c0) * w.row_bytes;
        const int64_t from = packed ? (first + c0) / PACKED_COLS * w.row_bytes : (first + c0) * w.row_bytes;
        return Ahead{w.data + from, bytes < (int64_t(1) << 18) ? bytes : int64_t(1) << 18};
    }
    int64_t chunk_cols() const { return act_quant ? I8_CHUNK : QMATMUL_CHUNK; }

    // One matmul as a phase over output-column chunks.
    void matmul_phase(Phase& p, int tid, const float* x, int64_t k, const LayerMatrix& w, float* y) const {
        const int64_t size = chunk_cols();
        phase_run(p, tid, [&](int64_t c) {
            const int64_t c0 = c * size, c1 = c0 + size < w.rows ? c0 + size : w.rows;
            matmul_cols(tid, x, k, w, y, c0, c1);
        });
    }

    // A norm per row (x += residual first when given), the normed row quantized for an int8 matmul.
    void norm_phase(Phase& p, int tid, float* x, const float* residual, const float* weight, float* y,
                    bool quantize, Ahead ahead) const {
        const int64_t E = m.hidden;
        phase_run(p, tid, [&](int64_t t) {
            rms_norm(x + t * E, residual ? residual + t * E : nullptr, weight, 1, E, static_cast<float>(m.eps),
                     y + t * E);
            if (quantize) quantize_row(y, E, t);
        }, ahead);
    }
};

// Region "before attention of layer l": norm (residual += delta when given), qkv, RoPE + KV write.
// Phases: 3 of ph.
template <typename KT>
static void decode_pre_attention(const DecodeStep& s, Phase* ph, int tid, int64_t l, float* residual,
                                 const float* delta) {
    const LayerModel& m = s.m;
    const LayerWeightsDesc& w = m.layers[l];
    const int64_t E = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim;
    const int64_t width = (H + 2 * KVH) * D;
    const int team = ph[0].team;
    s.norm_phase(ph[0], tid, residual, delta, w.input_norm, s.normed, s.act_quant != 0,
                 s.lane_weights(w.qkv, w.qkv.rows, 0, tid, team));
    s.matmul_phase(ph[1], tid, s.normed, E, w.qkv, s.qkv);
    KT* kpool = static_cast<KT*>(s.pool) + l * s.layer_stride;
    KT* vpool = kpool + s.layer_stride / 2;
    phase_run(ph[2], tid, [&](int64_t t) {
        rope_kv_write(s.qkv + t * width, 1, H, KVH, D, s.positions + t, m.rope_cos, m.rope_sin, s.q + t * H * D,
                      kpool, vpool, s.slots + t);
    });
}

// Region "after attention of layer l": o proj -> other, other += residual and norm, gate_up with SwiGLU per
// column chunk, down -> delta. Phases: 6 of ph (the two quantizations run with int8 activations only).
static void decode_post_attention(const DecodeStep& s, Phase* ph, int tid, int64_t l, float* residual, float* other) {
    const LayerModel& m = s.m;
    const LayerWeightsDesc& w = m.layers[l];
    const int64_t E = m.hidden, HD = m.heads * m.head_dim, I = m.intermediate, T = s.T;
    const int team = ph[0].team;
    if (s.act_quant) phase_run(ph[0], tid, [&](int64_t t) { s.quantize_row(s.attn, HD, t); });
    s.matmul_phase(ph[1], tid, s.attn, HD, w.o, other);
    s.norm_phase(ph[2], tid, other, residual, w.post_attention_norm, s.normed, s.act_quant != 0,
                 s.lane_weights(w.gate_up, I, 0, tid, team));
    const int64_t size = s.chunk_cols();
    phase_run(ph[3], tid, [&](int64_t c) {
        const int64_t c0 = c * size, c1 = c0 + size < I ? c0 + size : I;
        s.matmul_cols(tid, s.normed, E, w.gate_up, s.gate_up, c0, c1);
        s.matmul_cols(tid, s.normed, E, w.gate_up, s.gate_up, I + c0, I + c1);
        for (int64_t t = 0; t < T; ++t) swiglu_cols(s.gate_up, t, I, s.act, c0, c1);
    });
    if (s.act_quant)
        phase_run(ph[4], tid, [&](int64_t t) { s.quantize_row(s.act, I, t); }, s.lane_weights(w.down, E, 0, tid, team));
    s.matmul_phase(ph[5], tid, s.act, I, w.down, s.delta);
}

static bool decode_matrix_ok(const LayerMatrix& w, int64_t k, int act_quant) {
    if (w.qtype & QT_I8_PACKED) {  // the int8 path's packed layout (qmatmul_i8_packed.h)
        const int base = static_cast<int>(w.qtype & ~QT_I8_PACKED);
        return act_quant && i8_packable(base) && k % QK == 0 &&
               w.row_bytes == k / QK * packed_block_bytes(base);
    }
    if (act_quant && w.qtype == QT_BF16) return false;  // bf16 weights have no int8 kernel
    return float_path_type(static_cast<int>(w.qtype)) && k % QK == 0 &&
           w.row_bytes == k / QK * block_bytes(static_cast<int>(w.qtype)) && w.row_bytes <= (int64_t(1) << 26);
}

template <typename KT>
static int decode_forward(const LayerModel& m, int act_quant, float* hidden, int64_t T, const int64_t* positions,
                          const int64_t* slots, KT* pool, int64_t layer_stride, int64_t bs, const int64_t* tables,
                          int64_t table_stride, const int64_t* ctx_lens, int64_t num_groups,
                          const int64_t* group_offsets, const int64_t* group_rows,
                          const int64_t* group_shared_blocks, const int64_t* row_shared_blocks, float* out) {
    const int64_t E = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim, I = m.intermediate;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    const float scale = static_cast<float>(m.scale);
    if (E % W != 0 || D % W != 0 || H % KVH != 0 || D % 2 != 0) return -2;
    for (int64_t l = 0; l < m.num_layers; ++l) {
        const LayerWeightsDesc& w = m.layers[l];
        if (!decode_matrix_ok(w.qkv, E, act_quant) || !decode_matrix_ok(w.o, H * D, act_quant) ||
            !decode_matrix_ok(w.gate_up, E, act_quant) || !decode_matrix_ok(w.down, I, act_quant) ||
            w.qkv.rows != qkv_width || w.o.rows != E || w.gate_up.rows != 2 * I || w.down.rows != E)
            return -2;
    }
    const int team = kv_threads() > 0 ? kv_threads() : 1;
    const int64_t kmax = I > E ? (I > H * D ? I : H * D) : (E > H * D ? E : H * D);
    const int64_t nbmax = kmax / QK;
    ScratchScope arena;  // scratch.h: the step's buffers, kept between steps
    float* buf = arena.take<float>(T * (3 * E + qkv_width + 2 * H * D + 3 * I) + T * nbmax * (2 + 2 * LANES));
    float* residual = hidden;  // the token embeddings in, scratch afterwards (as layer_forward)
    float* other = buf;
    float* normed = other + T * E;
    DecodeStep s{m, act_quant, T, positions, slots, pool, layer_stride, normed, normed + T * E, nullptr, nullptr,
                 nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0};
    s.qkv = s.delta + T * E;
    s.q = s.qkv + T * qkv_width;
    s.attn = s.q + T * H * D;
    s.gate_up = s.attn + T * H * D;
    s.act = s.gate_up + T * 2 * I;
    s.xq_scales = s.act + T * I;
    int8_t* xq = arena.take<int8_t>(T * kmax);
    s.xq = xq;
    s.scratch_bytes = (i8_chunk_scratch(nbmax) + 63) / 64 * 64;
    s.scratch = s.scratch_bytes ? arena.take<uint8_t>(team * s.scratch_bytes) : nullptr;  // 64-byte aligned

    // Phases of the step, in order: per layer norm, qkv, RoPE (decode_pre_attention), attention, then the six
    // of decode_post_attention; then the final norm. All reset here, before the one region.
    const int64_t L = m.num_layers, per_layer = 10, num_phases = L * per_layer + 1;
    WorkLane* lanes = arena.take<WorkLane>(num_phases * team);
    WorkCount* done = arena.take<WorkCount>(num_phases * team);
    Phase* ph = arena.take<Phase>(num_phases);
    const int64_t cols = s.chunk_cols();
    const bool cascade = num_groups > 0;
    for (int64_t i = 0; i < num_phases; ++i) {
        ph[i] = Phase{lanes + i * team, done + i * team, team, 0};
        const int64_t sizes[per_layer] = {T, DecodeStep::chunks(qkv_width, cols), T, cascade ? 1 : T * KVH,
                                          T, DecodeStep::chunks(E, cols), T, DecodeStep::chunks(I, cols), T,
                                          DecodeStep::chunks(E, cols)};
        phase_reset(ph[i], i == num_phases - 1 ? T : sizes[i % per_layer]);
    }
    // Attention per (row, KV head) as decode_attention.h's paged_attention tasks (da_attend: the same
    // arithmetic per query whatever the task's heads), or for the whole step (cascade: its groups span rows;
    // the kernel's own parallel region runs as a team of one inside this one).
    std::atomic<int> status{0};
    const int64_t G = H / KVH;
    int64_t max_ctx = 1;
    for (int64_t t = 0; t < T; ++t) max_ctx = ctx_lens[t] > max_ctx ? ctx_lens[t] : max_ctx;
    auto attention = [&](DecodeScratch& w, int64_t l, int64_t i) {
        KT* kpool = pool + l * layer_stride;
        KT* vpool = kpool + layer_stride / 2;
        if (cascade) {
            const int rc = cascade_attention(s.q, T, H, KVH, D, kpool, vpool, bs, tables, table_stride, ctx_lens,
                                             num_groups, group_offsets, group_rows, group_shared_blocks,
                                             row_shared_blocks, scale, static_cast<int>(m.attention), s.attn);
            if (rc != 0) status.store(rc, std::memory_order_relaxed);
            return;
        }
        const int64_t t = i / KVH, g0 = i % KVH;
        da_load_queries(w, s.q + (t * H + g0 * G) * D, G, D, scale);
        da_attend(w, G, G, g0, D, KVH, kpool, vpool, bs, tables + t * table_stride, 0, ctx_lens[t]);
        for (int64_t j = 0; j < G; ++j) {
            float* o = s.attn + (t * H + g0 * G + j) * D;
            const V inv = vset1(1.0f / w.sum[j]);
            for (int64_t e = 0; e < D; e += W) vstore(o + e, vmul(vload(w.acc + j * D + e), inv));
        }
    };
#pragma omp parallel num_threads(team)
    {
        const int tid = omp_get_thread_num();
        ScratchScope own;  // this thread's
        DecodeScratch scratch_attn = da_scratch_new(own, G, D, max_ctx);
        float* res = residual;
        float* oth = other;
        for (int64_t l = 0; l < L; ++l) {
            Phase* p = ph + l * per_layer;
            decode_pre_attention<KT>(s, p, tid, l, res, l ? s.delta : nullptr);
            const LayerMatrix& o = m.layers[l].o;
            phase_run(p[3], tid, [&](int64_t i) { attention(scratch_attn, l, i); },
                      s.lane_weights(o, o.rows, 0, tid, team));
            // `oth` becomes the residual after the post-attention norm, as in layer_forward.
            decode_post_attention(s, p + 4, tid, l, res, oth);
            float* swap = res;
            res = oth;
            oth = swap;
        }
        phase_run(ph[num_phases - 1], tid, [&](int64_t t) {
            rms_norm(res + t * E, L ? s.delta + t * E : nullptr, m.final_norm, 1, E, static_cast<float>(m.eps),
                     out + t * E);
        });
    }
    return status.load();
}
