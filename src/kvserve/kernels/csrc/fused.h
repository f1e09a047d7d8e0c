// Fused per-layer glue, compiled once per ISA like impl.h (included after it, inside the ISA namespace).
// Each replaces several small torch ops per layer: RoPE on q and k plus the KV write into the pool slots
// (split, views, two rotate-half cats, two index_copy_), and SwiGLU (chunk, silu, mul).
// Built with -ffp-contract=off, so RoPE rounds x*cos and y*sin separately, exactly as the torch twin.

#if KV_AVX512
static inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
#else
static inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
#endif

// From how many rows RoPE + the KV write and SwiGLU split their rows across the threads (fewer: one thread, no
// parallel region to enter).
constexpr int64_t FUSED_PARALLEL_ROWS = 32;

// One head's rotate-half RoPE: out[i] = x[i]*cos[i] - x[i+h]*sin[i]; out[i+h] = x[i+h]*cos[i+h] + x[i]*sin[i+h],
// stored as OT (a query: float; a key: the pool's element type, rounded by kvstore).
template <typename OT>
static inline void rope_head(const float* x, const float* cos, const float* sin, int64_t D, OT* out) {
    const int64_t half = D / 2;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
        const V lo = vload(x + i), hi = vload(x + half + i);
        kvstore(out + i, vsub(vmul(lo, vload(cos + i)), vmul(hi, vload(sin + i))));
        kvstore(out + half + i, vadd(vmul(hi, vload(cos + half + i)), vmul(lo, vload(sin + half + i))));
    }
    for (; i < half; ++i) {
        const float lo = x[i], hi = x[half + i];
        kvstore1(out + i, lo * cos[i] - hi * sin[i]);
        kvstore1(out + half + i, hi * cos[half + i] + lo * sin[half + i]);
    }
}

// n floats into the pool as KT (float: a copy; bf16 / fp8: rounded to nearest even, simd.h's kvstore).
static inline void kv_copy(const float* src, int64_t n, float* dst) { __builtin_memcpy(dst, src, n * sizeof(float)); }
template <typename KT>
static inline void kv_copy(const float* src, int64_t n, KT* dst) {
    int64_t i = 0;
    for (; i + W <= n; i += W) kvstore(dst + i, vload(src + i));
    for (; i < n; ++i) kvstore1(dst + i, src[i]);
}

// qkv rows [T, (H + 2*KVH) * D] (q heads, then k heads, then v heads, as the fused projection writes them):
// rotated queries go to q_out [T, H*D]; rotated keys and the values go to pool slot slots[t] of kpool / vpool
// (each slot KVH*D elements of KT). cos/sin tables are [max_pos, D]; positions[t] picks the row.
template <typename KT>
static int rope_kv_write(const float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D, const int64_t* positions,
                         const float* cos_table, const float* sin_table, float* q_out, KT* kpool, KT* vpool,
                         const int64_t* slots) {
    if (D % 2 != 0) return -2;
    const int64_t width = (H + 2 * KVH) * D;
    // Rows are independent (each its own slot): a prefill's thousands of rows split across the threads.
#pragma omp parallel for schedule(static) if (T > FUSED_PARALLEL_ROWS) num_threads(kv_threads())
    for (int64_t t = 0; t < T; ++t) {
        const float* row = qkv + t * width;
        const float* cos = cos_table + positions[t] * D;
        const float* sin = sin_table + positions[t] * D;
        for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, cos, sin, D, q_out + (t * H + h) * D);
        KT* kdst = kpool + slots[t] * KVH * D;
        KT* vdst = vpool + slots[t] * KVH * D;
        for (int64_t h = 0; h < KVH; ++h) rope_head(row + (H + h) * D, cos, sin, D, kdst + h * D);
        kv_copy(row + (H + KVH) * D, KVH * D, vdst);
    }
    return 0;
}

// out[t, j] = silu(gate_up[t, j]) * gate_up[t, I + j] with silu(x) = x / (1 + exp(-x)).
static int swiglu(const float* gate_up, int64_t T, int64_t I, float* out) {
    const V one = vset1(1.0f);
#pragma omp parallel for schedule(static) if (T > FUSED_PARALLEL_ROWS) num_threads(kv_threads())
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gate_up + t * 2 * I;
        const float* u = g + I;
        float* o = out + t * I;
        int64_t j = 0;
        for (; j + W <= I; j += W) {
            const V x = vload(g + j);
            const V e = vexp(vsub(vzero(), x));
            vstore(o + j, vmul(vdiv(x, vadd(one, e)), vload(u + j)));
        }
        for (; j < I; ++j) o[j] = g[j] / (1.0f + __builtin_expf(-g[j])) * u[j];
    }
    return 0;
}
