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
// x16: the spans' rows already as bf16 A tiles (gb_rms_norm_rows; x then holds only the decode rows), or null.
static inline int layer_span_matmul(int act_quant, const float* x, int64_t rows, int64_t decodes, int64_t k,
                                    const LayerMatrix& m, const LayerMatrix& m16, float* y,
                                    const uint16_t* x16 = nullptr) {
    if (m16.data == nullptr || decodes >= rows) return layer_qmatmul(act_quant, x, rows, k, m, y);
    const int rc = decodes > 0 ? layer_qmatmul(act_quant, x, decodes, k, m, y) : 0;
    return rc | gemm_bf16_any(x16 ? nullptr : x + decodes * k, x16, rows - decodes, k, m16.data, m.rows,
                              y + decodes * m.rows, m.rows);
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

// gate_up -> SwiGLU -> down (y) of a step's rows, split as layer_span_matmul splits them; with act16 (scratch for
// the spans' rows padded to 32, x I) the spans' SwiGLU goes straight into the down projection's bf16 A tiles
// (gemm_bf16_swiglu_tiles: the same bits as rounding act's float32 rows, which never reach memory).
static inline int layer_span_mlp(int act_quant, const float* x, const uint16_t* x16, int64_t rows, int64_t decodes,
                                 int64_t k, int64_t I, const LayerWeightsDesc& w, float* gate_up, float* act,
                                 uint16_t* act16, float* y) {
    const bool tiles = act16 != nullptr && w.gate_up16.data != nullptr && w.down16.data != nullptr;
    if (!tiles || decodes >= rows || I % 32 != 0) {
        if (x16 != nullptr) return -2;  // the spans' rows exist only as tiles
        return layer_span_gate_up(act_quant, x, rows, decodes, k, I, w.gate_up, w.gate_up16, gate_up, act) |
               layer_span_matmul(act_quant, act, rows, decodes, I, w.down, w.down16, y);
    }
    int rc = 0;
    if (decodes > 0)
        rc = layer_qmatmul(act_quant, x, decodes, k, w.gate_up, gate_up) | swiglu(gate_up, decodes, I, act) |
             layer_qmatmul(act_quant, act, decodes, I, w.down, y);
    const int64_t n = w.down.rows;
    return rc | gemm_bf16_swiglu_tiles(x16 ? nullptr : x + decodes * k, x16, rows - decodes, k, w.gate_up16.data, I,
                                       act16) |
           gemm_bf16_any(nullptr, act16, rows - decodes, I, w.down16.data, n, y + decodes * n, n);
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
    const bool bf16_spans = spans.num_spans > 0 && m.num_layers > 0 && m.layers[0].down16.data != nullptr;
    const int64_t span_rows_pad = (T - Tp + 31) / 32 * 32;
    uint16_t* act16 = bf16_spans ? scope.take<uint16_t>(span_rows_pad * I) : nullptr;  // layer_span_mlp
    // The spans' normed rows as the qkv and gate_up projections' A tiles (gb_rms_norm_rows).
    uint16_t* x16 = bf16_spans && E % 32 == 0 && I % 32 == 0 ? scope.take<uint16_t>(span_rows_pad * E) : nullptr;
    // The spans' attention outputs as the o projection's A tiles (prefill.h's PrefillOut); padding rows zeroed once.
    uint16_t* attn16 = bf16_spans && D % 32 == 0 ? scope.take<uint16_t>(span_rows_pad * H * D) : nullptr;
    if (attn16 != nullptr) a_tile_zero_rows(attn16, H * D / 32, T - Tp, span_rows_pad);
    int rc = 0;
    for (int64_t l = 0; l < m.num_layers && rc == 0; ++l) {
        const LayerWeightsDesc& w = m.layers[l];
        KT* kpool = pool + l * layer_stride;
        KT* vpool = kpool + layer_stride / 2;
        // The spans' normed rows straight into bf16 A tiles where every projection they feed has its bf16 copy.
        uint16_t* n16 = x16 && w.qkv16.data && w.gate_up16.data && w.down16.data ? x16 : nullptr;
        rc |= n16 ? gb_rms_norm_rows(residual, l ? delta : nullptr, w.input_norm, T, E, eps, Tp, normed, n16)
                  : rms_norm(residual, l ? delta : nullptr, w.input_norm, T, E, eps, normed);  // residual += delta
        rc |= layer_span_matmul(act_quant, normed, T, Tp, E, w.qkv, w.qkv16, qkv, n16);
        rc |= rope_kv_write(qkv, T, H, KVH, D, positions, m.rope_cos, m.rope_sin, q, kpool, vpool, slots);
        if (num_groups > 0)
            rc |= cascade_attention(q, Tp, H, KVH, D, kpool, vpool, bs, tables, table_stride, ctx_lens, num_groups,
                                    group_offsets, group_rows, group_shared_blocks, row_shared_blocks, scale,
                                    static_cast<int>(m.attention), attn);
        else if (Tp > 0)
            rc |= paged_attention(q, Tp, H, KVH, D, kpool, vpool, bs, tables, table_stride, ctx_lens, scale, attn);
        uint16_t* o16 = w.o16.data ? attn16 : nullptr;
        if (spans.num_spans > 0)
            rc |= prefill_attention(q, H, KVH, D, kpool, vpool, bs, spans.num_spans, spans.start, spans.len,
                                    spans.ctx, spans.tables, spans.table_stride, scale, static_cast<int>(m.attention),
                                    PrefillOut(attn, o16, Tp));
        rc |= layer_span_matmul(act_quant, attn, T, Tp, H * D, w.o, w.o16, other, o16);
        rc |= n16 ? gb_rms_norm_rows(other, residual, w.post_attention_norm, T, E, eps, Tp, normed, n16)
                  : rms_norm(other, residual, w.post_attention_norm, T, E, eps, normed);  // other = attended + residual
        float* swap = residual;
        residual = other;
        other = swap;
        rc |= layer_span_mlp(act_quant, normed, n16, T, Tp, E, I, w, gate_up, act, act16, delta);
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
