// kvserve native CPU kernels: a plain C ABI (loaded with ctypes), every kernel compiled twice -- for
// AVX2/FMA/F16C and for AVX-512 (F/BW/VL/DQ/VNNI) -- and chosen per call by the `isa` argument, which
// Python sets from kv_cpu_features() (run-time __builtin_cpu_supports checks) or an override. The AVX-512
// build may also use AMX tiles (qmatmul_amx.h), only once kv_amx_enable has checked the CPU and the OS.
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "scratch.h"

// Threads per parallel region, set from torch.get_num_threads() when the library is loaded (0: OpenMP's
// default). An explicit count, because OpenMP's own setting is per calling thread and the engine may run
// steps on a thread that never called omp_set_num_threads.
static int g_threads = 0;
static inline int kv_threads() { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

// AVX512-BF16 pair dot products (prefill.h's bf16 attention products) need GCC 10 / clang 9 to compile and the
// CPU to run them (asked once).
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define KV_HAS_BF16 1
#else
#define KV_HAS_BF16 0
#endif
static inline bool kv_cpu_dpbf16() {
    static const bool has = [] {
        __builtin_cpu_init();
        return static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
    }();
    return has;
}
// Whether bf16 attention products may run as those pair products (else float32 FMAs on the same rounded
// values): set by kv_bf16_pairs (kernels/pair_products.py, per CPU when the library loads). AMX tiles, where
// on, run them regardless.
static bool g_bf16_pairs = true;
static inline bool kv_pairs_on() { return g_bf16_pairs && kv_cpu_dpbf16(); }

// Every fp16 bit pattern as a float32, filled once when the library loads (plain bit arithmetic, no F16C:
// loading must not fault on any CPU). The matmuls look block scales up here: a load instead of F16C's
// convert-and-broadcast shuffles (impl.h's half_at). Values equal F16C's for every non-NaN pattern.
struct HalfTable {
    float value[65536];
    HalfTable() {
        for (uint32_t h = 0; h < 65536; ++h) {
            const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
            uint32_t bits;
            if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
                const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
                __builtin_memcpy(&bits, &f, 4);
                bits |= sign;
            } else if (exp == 31) {
                bits = sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u);  // inf; NaN made quiet
            } else {
                bits = sign | ((exp + 112) << 23) | (mant << 13);
            }
            __builtin_memcpy(&value[h], &bits, 4);
        }
    }
};
static const HalfTable g_half_table;

// Whether the int8 path may use AMX tiles (qmatmul_amx.h): set by kv_amx_enable once the CPU has AMX-INT8
// and Linux has granted this process the tile state -- 1: for the weight types where tiles are faster, 2:
// for every packed type (measurements, tests); 0 (the default) never, so a library loaded by anything else
// never executes a tile instruction.
static int g_amx = 0;
static inline int kv_amx_mode() { return g_amx; }
// Whether the exact path's wide GEMM may use AMX-BF16 tiles (qgemm_amx.h): set by kv_amx_exact once the CPU
// has AMX-BF16 and Linux has granted the tile state; off by default, as g_amx.
static bool g_amx_exact = false;
static inline bool kv_amx_exact() { return g_amx_exact; }
// Whether `--prefill-dtype bfloat16`'s GEMM (gemm_bf16.h) may run: set by kv_bf16_gemm once the CPU has
// AMX-BF16 and Linux has granted the tile state; off by default, as g_amx.
static bool g_bf16_gemm = false;
static inline bool kv_bf16_gemm_on() { return g_bf16_gemm; }
static inline const float* kv_half_table() { return g_half_table.value; }
// From how many rows the AVX2 build's exact wide GEMM runs qgemm_wide.h (weights as the vector side) instead of
// qgemm.h's tiles: set by kv_qgemm_wide_rows (benchmarks and tests compare both in one process).
static int64_t g_wide_rows = 48;
static inline int64_t kv_wide_rows() { return g_wide_rows; }
// From how many activation rows the exact wide GEMM (qgemm.h) runs a weight type's matmuls in the layer loop
// instead of the per-row kernel (impl.h), by build (0: AVX2, 1: AVX-512) and GGUF type code; 0: the default,
// 5. Set by kv_qgemm_min_rows (kernels/crossover.py picks it for the CPU at load: the crossover moves with the
// CPU's FMA width).
constexpr int KV_QGEMM_MIN_ROWS_DEFAULT = 5;
static int64_t g_qgemm_min_rows[2][32] = {};
static inline int64_t kv_qgemm_min_rows_for(int wide_isa, int qt) {
    const int64_t rows = qt >= 0 && qt < 32 ? g_qgemm_min_rows[wide_isa ? 1 : 0][qt] : 0;
    return rows > 0 ? rows : KV_QGEMM_MIN_ROWS_DEFAULT;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define KV_AVX512 0
#include "simd.h"
#include "impl.h"
#include "decode_attention.h"
#include "qmatmul_i8.h"
#include "prefill.h"
#include "cascade.h"
#include "fused.h"
#include "qgemm.h"
#include "gemm_bf16.h"
#include "layer.h"
#undef KV_AVX512
}  // namespace isa_avx2
#pragma GCC pop_options

// AMX intrinsics need GCC 11 (clang 12); an older compiler builds everything else and reports no tiles.
#pragma GCC push_options
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KV_HAS_AMX 1
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,amx-tile,amx-int8,amx-bf16")
#else
#define KV_HAS_AMX 0
#if KV_HAS_BF16
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif
#endif
namespace isa_avx512 {
#define KV_AVX512 1
#include "simd.h"
#include "impl.h"
#include "decode_attention.h"
#include "qmatmul_i8.h"
#include "prefill.h"
#include "cascade.h"
#include "fused.h"
#include "qgemm.h"
#include "gemm_bf16.h"
#include "layer.h"
#undef KV_AVX512
}  // namespace isa_avx512
#pragma GCC pop_options

enum : int { ISA_AVX2 = 1, ISA_AVX512 = 2 };

static bool cpu_has_amx_int8() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8");
}
static bool cpu_has_amx_bf16() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
}
// Linux (>= 5.16) hands a process the tile state only when asked (ARCH_REQ_XCOMP_PERM); asked once.
static bool amx_permitted() {
    static const bool granted = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return KV_HAS_AMX && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return granted;
}
enum : int { F_AVX2 = 1, F_AVX512 = 2, F_VNNI = 4, F_BF16 = 8, F_AMX = 16, F_AMX_INT8 = 32 };

// The KV pool's element type, for every call that reads or writes the pool (simd.h's KT).
enum : int { KVT_F32 = 0, KVT_BF16 = 1, KVT_FP8 = 2 };

// Runs fn(KT{}) for the pool's element type: fn is a generic lambda that dispatches on the ISA.
template <typename F>
static int with_kv_type(int kvt, F fn) {
    if (kvt == KVT_F32) return fn(float{});
    if (kvt == KVT_BF16) return fn(uint16_t{});
    if (kvt == KVT_FP8) return fn(uint8_t{});
    return -4;
}

extern "C" {

int kv_abi_version() { return 7; }  // 7: fp8 (e4m3fn) KV pools (kvt 2); 6: the layer model's bf16 prefill weights; 5: attention products (attn) on
                                    // prefill / cascade calls and in the layer model; 4: the pool's element type
                                    // (kvt) on every pool call; 3: kv_pack_i8

void kv_set_num_threads(int n) { g_threads = n; }

// The kernels' scratch arenas (scratch.h): unmap those idle for at least min_idle_ms (0: every arena not in
// use now); returns the bytes unmapped. kv_scratch_mapped: the bytes mapped now.
int64_t kv_scratch_release(int64_t min_idle_ms) { return scratch_release(min_idle_ms); }
int64_t kv_scratch_mapped() { return scratch_mapped(); }

// Bit set of what this CPU can run: AVX2 (with FMA and F16C), AVX-512 (F/BW/VL/DQ), VNNI, BF16, AMX-BF16,
// AMX-INT8.
int kv_cpu_features() {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= F_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        f |= F_AVX512;
    if (__builtin_cpu_supports("avx512vnni")) f |= F_VNNI;
    if (__builtin_cpu_supports("avx512bf16")) f |= F_BF16;
    if (cpu_has_amx_bf16()) f |= F_AMX;
    if (cpu_has_amx_int8()) f |= F_AMX_INT8;
    return f;
}

// AMX tiles for the int8 path: mode 1 (where they pay), 2 (every packed type), 0 (off) or -1 (as they are);
// returns the mode now, or -1 when this CPU or kernel cannot run them (no AMX-INT8, or Linux refuses the tile
// state: ARCH_REQ_XCOMP_PERM, Linux >= 5.16).
int kv_amx_enable(int mode) {
    if (mode < 0) return g_amx;
    if (mode == 0) return g_amx = 0;
    if (!KV_HAS_AMX || !cpu_has_amx_int8() || !amx_permitted()) return -1;
    return g_amx = mode > 1 ? 2 : 1;
}

// AMX-BF16 tiles for the exact path's wide GEMM (qgemm_amx.h): 1 on, 0 off, -1 as it is; returns the state
// now, or -1 when this CPU or kernel cannot run them.
int kv_amx_exact(int on) {
    if (on < 0) return g_amx_exact;
    if (on == 0) return g_amx_exact = false;
    if (!KV_HAS_AMX || !cpu_has_amx_bf16() || !amx_permitted()) return -1;
    return g_amx_exact = true;
}

// `--prefill-dtype bfloat16`'s GEMM on AMX-BF16 tiles (gemm_bf16.h): 1 on, 0 off, -1 as it is; returns the state
// now, or -1 when this CPU or kernel cannot run it.
int kv_bf16_gemm(int on) {
    if (on < 0) return g_bf16_gemm;
    if (on == 0) return g_bf16_gemm = false;
    if (!KV_HAS_AMX || !cpu_has_amx_bf16() || !amx_permitted()) return -1;
    return g_bf16_gemm = true;
}

// bf16 attention products as AVX512-BF16 pair dot products: 1 on, 0 off, -1 as it is; returns the state now, or
// -1 when this CPU has no AVX512-BF16.
int kv_bf16_pairs(int on) {
    if (!KV_HAS_BF16 || !kv_cpu_dpbf16()) return -1;
    if (on >= 0) g_bf16_pairs = on != 0;
    return g_bf16_pairs;
}

// The layer loop's crossover from the per-row kernel to the wide GEMM for weight type qt in build isa: rows >= 1
// sets it, anything else leaves it; returns the value it had before (-1: no such build or type code).
int64_t kv_qgemm_min_rows(int isa, int qt, int64_t rows) {
    if (qt < 0 || qt >= 32 || (isa != ISA_AVX2 && isa != ISA_AVX512)) return -1;
    const int wide = isa == ISA_AVX512;
    const int64_t previous = kv_qgemm_min_rows_for(wide, qt);
    if (rows >= 1) g_qgemm_min_rows[wide][qt] = rows;
    return previous;
}

// The AVX2 exact wide GEMM's crossover to qgemm_wide.h: rows >= 1 sets it (a huge value keeps qgemm.h's tiles
// at every row count), anything else leaves it; returns the value it had before.
int64_t kv_qgemm_wide_rows(int64_t rows) {
    const int64_t previous = g_wide_rows;
    if (rows >= 1) g_wide_rows = rows;
    return previous;
}

#define KV_DISPATCH(call)                                  \
    do {                                                   \
        if (isa == ISA_AVX512) return isa_avx512::call;    \
        if (isa == ISA_AVX2) return isa_avx2::call;        \
        return -3;                                         \
    } while (0)

int kv_qmatmul(int isa, int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
               int64_t row_bytes, float* y, int64_t ystride) {
    KV_DISPATCH(qmatmul(qt, x, rows, k, w, n, row_bytes, y, ystride));
}

// As kv_qmatmul, for many rows: each weight panel dequantized once per call (qgemm.h).
int kv_qgemm(int isa, int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
             int64_t row_bytes, float* y, int64_t ystride) {
    KV_DISPATCH(qgemm(qt, x, rows, k, w, n, row_bytes, y, ystride));
}

// y = bf16(x) @ W.T on AMX-BF16 tiles (gemm_bf16.h), W packed by kernels/bf16pack.py (n rows, padded to 32);
// -6 unless kv_bf16_gemm is on.
int kv_gemm_bf16(int isa, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, float* y,
                 int64_t ystride) {
    KV_DISPATCH(gemm_bf16(x, rows, k, w, n, y, ystride));
}

// act = swiglu(bf16(x) @ W.T) for W the packed [2I, k] gate_up rows (I a multiple of 16): gemm_bf16 and fused.h's
// swiglu in one pass (gemm_bf16.h).
int kv_gemm_bf16_swiglu(int isa, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t I, float* act,
                        int64_t astride) {
    KV_DISPATCH(gemm_bf16_swiglu(x, rows, k, w, I, act, astride));
}

// As kv_qmatmul, with the activation rows quantized to int8 blocks first (qmatmul_i8.h). qt may carry
// QT_I8_PACKED: w is then kv_pack_i8's layout and row_bytes one column group's bytes.
int kv_qmatmul_i8(int isa, int qt, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                  int64_t row_bytes, float* y, int64_t ystride) {
    KV_DISPATCH(qmatmul_i8(qt, x, rows, k, w, n, row_bytes, y, ystride));
}

// The int8 path's pre-arranged weight layout (qmatmul_i8_packed.h), built once at model load: out holds
// ceil(n/16) * (k/32) * packed block bytes (288 Q4_0, 320 Q4_1, 576 Q8_0).
int kv_pack_i8(int isa, int qt, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t k, uint8_t* out) {
    KV_DISPATCH(pack_i8(qt, w, n, row_bytes, k, out));
}

// The activation quantization of kv_qmatmul_i8 alone, for tests: q [rows, k] int8, d and s [rows, k/32].
int kv_quantize_i8(int isa, const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
    KV_DISPATCH(quantize_i8(x, rows, k, q, d, s));
}

int kv_dequantize(int isa, int qt, const uint8_t* w, int64_t row_bytes, int64_t k, const int64_t* ids, int64_t nrows,
                  float* out) {
    KV_DISPATCH(dequantize(qt, w, row_bytes, k, ids, nrows, out));
}

int kv_paged_attention(int isa, int kvt, const float* q, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       const void* kpool, const void* vpool, int64_t bs, const int64_t* tables, int64_t table_stride,
                       const int64_t* ctx_lens, float scale, float* out) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        const KT *k = static_cast<const KT*>(kpool), *v = static_cast<const KT*>(vpool);
        KV_DISPATCH(paged_attention(q, T, H, KVH, D, k, v, bs, tables, table_stride, ctx_lens, scale, out));
    });
}

// Shared-prefix (cascade) decode attention: see cascade.h for the arguments; attn: prefill.h's ATTN_* (ATTN_BF16
// needs a bf16 pool: -5 otherwise).
int kv_cascade_attention(int isa, int kvt, const float* q, int64_t T, int64_t H, int64_t KVH, int64_t D,
                         const void* kpool, const void* vpool, int64_t bs, const int64_t* tables, int64_t table_stride,
                         const int64_t* ctx_lens, int64_t num_groups, const int64_t* group_offsets,
                         const int64_t* group_rows, const int64_t* group_shared_blocks,
                         const int64_t* row_shared_blocks, float scale, int attn, float* out) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        const KT *k = static_cast<const KT*>(kpool), *v = static_cast<const KT*>(vpool);
        KV_DISPATCH(cascade_attention(q, T, H, KVH, D, k, v, bs, tables, table_stride, ctx_lens, num_groups,
                                      group_offsets, group_rows, group_shared_blocks, row_shared_blocks, scale, attn,
                                      out));
    });
}

// Prefill chunks attending causally through the pool, query tiles against shared key rows: see prefill.h (attn:
// as kv_cascade_attention's).
int kv_prefill_attention(int isa, int kvt, const float* q, int64_t H, int64_t KVH, int64_t D, const void* kpool,
                         const void* vpool, int64_t bs, int64_t num_spans, const int64_t* span_start,
                         const int64_t* span_len, const int64_t* span_ctx, const int64_t* tables,
                         int64_t table_stride, float scale, int attn, float* out) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        const KT *k = static_cast<const KT*>(kpool), *v = static_cast<const KT*>(vpool);
        KV_DISPATCH(prefill_attention(q, H, KVH, D, k, v, bs, num_spans, span_start, span_len, span_ctx, tables,
                                      table_stride, scale, attn, out));
    });
}

int kv_rms_norm(int isa, float* x, const float* residual, const float* weight, int64_t rows, int64_t n, float eps,
                float* y) {
    KV_DISPATCH(rms_norm(x, residual, weight, rows, n, eps, y));
}

int kv_rope_kv_write(int isa, int kvt, const float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D,
                     const int64_t* positions, const float* cos_table, const float* sin_table, float* q_out,
                     void* kpool, void* vpool, const int64_t* slots) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        KT *k = static_cast<KT*>(kpool), *v = static_cast<KT*>(vpool);
        KV_DISPATCH(rope_kv_write(qkv, T, H, KVH, D, positions, cos_table, sin_table, q_out, k, v, slots));
    });
}

int kv_swiglu(int isa, const float* gate_up, int64_t T, int64_t I, float* out) {
    KV_DISPATCH(swiglu(gate_up, T, I, out));
}

int kv_layer_forward(int isa, int kvt, const void* model, int act_quant, float* hidden, int64_t T,
                     const int64_t* positions, const int64_t* slots, void* pool, int64_t layer_stride, int64_t bs,
                     const int64_t* tables, int64_t table_stride, const int64_t* ctx_lens, int64_t num_groups,
                     const int64_t* group_offsets, const int64_t* group_rows, const int64_t* group_shared_blocks,
                     const int64_t* row_shared_blocks, float* out) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        KT* p = static_cast<KT*>(pool);
        KV_DISPATCH(layer_forward(model, act_quant, hidden, T, positions, slots, p, layer_stride, bs, tables,
                                  table_stride, ctx_lens, num_groups, group_offsets, group_rows, group_shared_blocks,
                                  row_shared_blocks, out));
    });
}

// As kv_layer_forward, with prefill spans (layer.h's LayerSpans): rows [0, num_decodes) attend through
// tables / ctx_lens (cascade groups among them as kv_layer_forward's), the spans' rows through
// prefill_attention (prefill.h's arguments).
int kv_layer_forward_spans(int isa, int kvt, const void* model, int act_quant, float* hidden, int64_t T,
                           const int64_t* positions, const int64_t* slots, void* pool, int64_t layer_stride,
                           int64_t bs, const int64_t* tables, int64_t table_stride, const int64_t* ctx_lens,
                           int64_t num_groups, const int64_t* group_offsets, const int64_t* group_rows,
                           const int64_t* group_shared_blocks, const int64_t* row_shared_blocks,
                           int64_t num_decodes, int64_t num_spans, const int64_t* span_start, const int64_t* span_len,
                           const int64_t* span_ctx, const int64_t* span_tables, int64_t span_table_stride,
                           float* out) {
    return with_kv_type(kvt, [&](auto tag) {
        using KT = decltype(tag);
        KT* p = static_cast<KT*>(pool);
        if (isa == ISA_AVX512) {
            const isa_avx512::LayerSpans spans{num_decodes, num_spans, span_start, span_len, span_ctx, span_tables,
                                               span_table_stride};
            return isa_avx512::layer_forward_spans(model, act_quant, hidden, T, positions, slots, p, layer_stride,
                                                   bs, tables, table_stride, ctx_lens, num_groups, group_offsets,
                                                   group_rows, group_shared_blocks, row_shared_blocks, spans, out);
        }
        if (isa == ISA_AVX2) {
            const isa_avx2::LayerSpans spans{num_decodes, num_spans, span_start, span_len, span_ctx, span_tables,
                                             span_table_stride};
            return isa_avx2::layer_forward_spans(model, act_quant, hidden, T, positions, slots, p, layer_stride, bs,
                                                 tables, table_stride, ctx_lens, num_groups, group_offsets,
                                                 group_rows, group_shared_blocks, row_shared_blocks, spans, out);
        }
        return -3;
    });
}

}  // extern "C"
