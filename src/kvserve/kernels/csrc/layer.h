// The whole decoder stack for one step's tokens in one C call (compiled once per ISA, after impl.h and
// fused.h): per layer norm -> qkv matmul -> RoPE + KV write -> paged attention -> o proj -> residual + norm
// -> gate_up matmul -> SwiGLU -> down matmul, then the final norm. The Python loop makes ~15 torch/ctypes
// calls per layer; at 135M parameters their overhead is a large part of a decode step.
//
// Every layer's weights are described once, at model load, by a `LayerModel` that Python lays out (ctypes
// structures, kernels/layer_loop.py); each step passes only its tokens' slots, block tables and context lens.
// Each kernel is the same one the Python loop calls, in the same order: decode rows are bit-identical to it;
// prefill rows attend through prefill.h as the Python loop's native path does (the matmuls may differ: from
// QGEMM_MAX_ROWS rows the Python loop dequantizes for torch's GEMM, this loop always runs qgemm.h). With
// `--prefill-dtype bfloat16` the prefill spans' rows run gemm_bf16.h on the layer's bf16 tiles in both loops.

struct LayerMatrix {       // a quantized [out, in] weight as stored (GGUF blocks)
    const uint8_t* data;
    int64_t qtype;
    int64_t rows;          // output features
    int64_t row_bytes;
};

struct LayerWeightsDesc {
    const float* input_norm;
    const float* post_attention_norm;
    LayerMatrix qkv, o, gate_up, down;
    // `--prefill-dtype bfloat16`: the same projections as bf16 B tiles (gemm_bf16.h; qtype unused), which the
    // prefill spans' rows run on; data null when the mode is off.
    LayerMatrix qkv16, o16, gate_up16, down16;
};

struct LayerModel {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    double eps, scale;
    const float* rope_cos;  // [max_positions, head_dim]
    const float* rope_sin;
    const float* final_norm;
    const LayerWeightsDesc* layers;
    int64_t attention;  // prefill.h's ATTN_*: the products of prefill and shared-prefix attention
};

// Every matmul of the layer loop goes through here. act_quant 0: float32 activations (qmatmul); 1: int8
// activation blocks (qmatmul_i8, `--activation-quant int8`).
// From kv_qgemm_min_rows_for(type) rows the wide GEMM (qgemm.h) beats the per-row kernel (kernels/crossover.py,
// measured by benchmarks/qgemm.py); both run the same arithmetic up to summation order.

static inline int layer_qmatmul(int act_quant, const float* x, int64_t rows, int64_t k, const LayerMatrix& m,
                                float* y) {
    if (act_quant) return qmatmul_i8(static_cast<int>(m.qtype), x, rows, k, m.data, m.rows, m.row_bytes, y, m.rows);
    if (rows >= kv_qgemm_min_rows_for(KV_AVX512, static_cast<int>(m.qtype)))
        return qgemm(static_cast<int>(m.qtype), x, rows, k, m.data, m.rows, m.row_bytes, y, m.rows);
    return qmatmul(static_cast<int>(m.qtype), x, rows, k, m.data, m.rows, m.row_bytes, y, m.rows);
}

// A step's matmul with prefill spans: rows [0, decodes) in the configured arithmetic, the spans' rows after them
// on the bf16 copy (`--prefill-dtype bfloat16`) where there is one.
static inline int layer_span_matmul(int act_quant, const float* x, int64_t rows, int64_t decodes, int64_t k,
                                    const LayerMatrix& m, const LayerMatrix& m16, float* y) {
    if (m16.data == nullptr || decodes >= rows) return layer_qmatmul(act_quant, x, rows, k, m, y);
    const int rc = decodes > 0 ? layer_qmatmul(act_quant, x, decodes, k, m, y) : 0;
    return rc | gemm_bf16(x + decodes * k, rows - decodes, k, m16.data, m.rows, y + decodes * m.rows, m.rows);
}

// gate_up, then SwiGLU into act [rows, I], as layer_span_matmul splits the rows; the spans' rows on the bf16 copy
// take the fused kernel (gemm_bf16_swiglu: the 2I-wide product never reaches gate_up).
static inline int layer_span_gate_up(int act_quant, const float* x, int64_t rows, int64_t decodes, int64_t k,
                                     int64_t I, const LayerMatrix& m, const LayerMatrix& m16, float* gate_up,
                                     float* act) {
    if (m16.data == nullptr || decodes >= rows || I % 16 != 0)
        return layer_span_matmul(act_quant, x, rows, decodes, k, m, m16, gate_up) | swiglu(gate_up, rows, I, act);
    const int rc = decodes > 0 ? layer_qmatmul(act_quant, x, decodes, k, m, gate_up) | swiglu(gate_up, decodes, I, act)
                               : 0;
    return rc | gemm_bf16_swiglu(x + decodes * k, rows - decodes, k, m16.data, I, act + decodes * I, I);
}

#include "decode_step.h"

// hidden [T, hidden]: the token embeddings in, scratch afterwards; out [T, hidden]: the final-normed states.
// pool: the KV pool tensor [L, 2, num_blocks, bs, KVH, D] of KT (float32 or bf16, simd.h); layer_stride =
// 2 * num_blocks * bs * KVH * D elements.
// Row t attends to the first ctx_lens[t] tokens of the table at tables + t * table_stride. num_groups > 0:
// decode rows sharing leading blocks, as cascade.h's arguments -- attention runs as cascade_attention.
// Prefill spans (prefill.h's arguments; num_spans 0: none): with spans, only the first `num_decodes` rows
// attend through tables / ctx_lens (decode attention), and the spans' rows through prefill_attention -- query
// tiles against the pool's keys, as the Python loop's native path runs them (kv/attention.py).
struct LayerSpans {
    int64_t num_decodes, num_spans;
    const int64_t *start, *len, *ctx, *tables;
    int64_t table_stride;
};

template <typename KT>
static int layer_forward_spans(const void* desc, int act_quant, float* hidden, int64_t T, const int64_t* positions,
                               const int64_t* slots, KT* pool, int64_t layer_stride, int64_t bs,
                               const int64_t* tables, int64_t table_stride, const int64_t* ctx_lens,
                               int64_t num_groups, const int64_t* group_offsets, const int64_t* group_rows,
                               const int64_t* group_shared_blocks, const int64_t* row_shared_blocks,
                               const LayerSpans& spans, float* out) {
    const LayerModel& m = *static_cast<const LayerModel*>(desc);
    const int64_t E = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim, I = m.intermediate;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    const float eps = static_cast<float>(m.eps), scale = static_cast<float>(m.scale);
    if (E % W != 0 || D % W != 0 || H % KVH != 0) return -2;
    if (T <= DECODE_MAX_ROWS && spans.num_spans == 0)  // decode-only steps: one region a step (decode_step.h)
        return decode_forward(m, act_quant, hidden, T, positions, slots, pool, layer_stride, bs, tables, table_stride,
                              ctx_lens, num_groups, group_offsets, group_rows, group_shared_blocks,
                              row_shared_blocks, out);
    ScratchScope scope;  // scratch.h: kept between steps, not freed
    float* buf = scope.take<float>(T * (3 * E + qkv_width + 2 * H * D + 3 * I));
    float* normed = buf;                  // [T, E]
    float* delta = normed + T * E;        // [T, E] the sub-layer output added into the residual
    float* other = delta + T * E;         // [T, E] the residual's second buffer
    float* qkv = other + T * E;           // [T, qkv_width]
    float* q = qkv + T * qkv_width;       // [T, H*D]
    float* attn = q + T * H * D;          // [T, H*D]
    float* gate_up = attn + T * H * D;    // [T, 2I]
    float* act = gate_up + T * 2 * I;     // [T, I]
    float* residual = hidden;
    const int64_t Tp = spans.num_spans > 0 ? spans.num_decodes : T;  // rows before the prefill spans'
    int rc = 0;
    for (int64_t l = 0; l < m.num_layers && rc == 0; ++l) {
        const LayerWeightsDesc& w = m.layers[l];
        KT* kpool = pool + l * layer_stride;
        KT* vpool = kpool + layer_stride / 2;
        rc |= rms_norm(residual, l ? delta : nullptr, w.input_norm, T, E, eps, normed);  // residual += delta
        rc |= layer_span_matmul(act_quant, normed, T, Tp, E, w.qkv, w.qkv16, qkv);
        rc |= rope_kv_write(qkv, T, H, KVH, D, positions, m.rope_cos, m.rope_sin, q, kpool, vpool, slots);
        if (num_groups > 0)
            rc |= cascade_attention(q, Tp, H, KVH, D, kpool, vpool, bs, tables, table_stride, ctx_lens, num_groups,
                                    group_offsets, group_rows, group_shared_blocks, row_shared_blocks, scale,
                                    static_cast<int>(m.attention), attn);
        else if (Tp > 0)
            rc |= paged_attention(q, Tp, H, KVH, D, kpool, vpool, bs, tables, table_stride, ctx_lens, scale, attn);
        if (spans.num_spans > 0)
            rc |= prefill_attention(q, H, KVH, D, kpool, vpool, bs, spans.num_spans, spans.start, spans.len,
                                    spans.ctx, spans.tables, spans.table_stride, scale, static_cast<int>(m.attention),
                                    attn);
        rc |= layer_span_matmul(act_quant, attn, T, Tp, H * D, w.o, w.o16, other);
        rc |= rms_norm(other, residual, w.post_attention_norm, T, E, eps, normed);  // other = attended + residual
        float* swap = residual;
        residual = other;
        other = swap;
        rc |= layer_span_gate_up(act_quant, normed, T, Tp, E, I, w.gate_up, w.gate_up16, gate_up, act);
        rc |= layer_span_matmul(act_quant, act, T, Tp, I, w.down, w.down16, delta);
    }
    if (rc == 0) rc = rms_norm(residual, m.num_layers ? delta : nullptr, m.final_norm, T, E, eps, out);
    return rc;
}

template <typename KT>
static int layer_forward(const void* desc, int act_quant, float* hidden, int64_t T, const int64_t* positions,
                         const int64_t* slots, KT* pool, int64_t layer_stride, int64_t bs, const int64_t* tables,
                         int64_t table_stride, const int64_t* ctx_lens, int64_t num_groups,
                         const int64_t* group_offsets, const int64_t* group_rows,
                         const int64_t* group_shared_blocks, const int64_t* row_shared_blocks, float* out) {
    const LayerSpans none{T, 0, nullptr, nullptr, nullptr, nullptr, 0};
    return layer_forward_spans(desc, act_quant, hidden, T, positions, slots, pool, layer_stride, bs, tables,
                               table_stride, ctx_lens, num_groups, group_offsets, group_rows, group_shared_blocks,
                               row_shared_blocks, none, out);
}
