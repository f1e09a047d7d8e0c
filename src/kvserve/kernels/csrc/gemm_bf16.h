// `--prefill-dtype bfloat16`'s GEMM on AMX-BF16 tiles: y = bf16(x) @ W.T for prefill rows, with W a bf16 copy
// of the weights made once at load (kernels/bf16pack.py) and bf16(x) the activations rounded to nearest even.
// Products of two bf16 values are exact in float32 and the tiles sum them in float32, so y is the float32
// matmul of the two rounded operands up to summation order (the torch twin: reference.linear_bf16). This is the
// arithmetic class of a bf16 model (transformers' bf16 GEMMs, oneDNN), not the exact path's: the weights'
// dequantized values and the activations each lose their bits below bf16's 8-bit significand.
//
// Why it exists: the exact path's tiles (qgemm_amx.h) multiply three activation splits by two or three weight
// pieces unpacked per task, and the int8 path runs VNNI dot products with per-block scales (AMX-INT8 needs an
// epilogue per 32-value block, qmatmul_amx.h); one bf16 product per multiply-add on weights already in AMX's
// layout needs neither, and runs near the tiles' rate.
//
// Layout: W is packed as B tiles -- for column tile j (16 weight rows, zero past n) and k block b (32 inputs),
// 1 KiB at (j * k/32 + b) KiB: row t holds each of the 16 weight rows' inputs 2t and 2t + 1. The activations
// are A tiles: 16 rows of 32 bf16, row-major, converted once per call into scratch (rows past `rows` zero).
// Blocking: 2 x 2 (32 activation rows x 32 weight rows) per pass over k: four C tiles, two A and two B loads
// feed four products -- one tile load per product, so where the tiles come from bounds the rate. Above
// GB_PANEL_ROWS rows (with at least two row pairs per thread) each thread takes whole row pairs (their A tiles,
// 2 x k/32 KiB, stay in L1) and passes them over a group of panels whose B tiles (GB_GROUP_BYTES) stay in L2:
// 30 layers' matmuls at 2,048 rows 266 -> 205-220 ms against the panel-major order (2 threads, AMX Xeon). Up to
// it (a chat turn, a short prompt, a prefill chunk) the threads split the panels instead, each thread its panels
// over 256-row chunks: every weight byte then comes from memory once, not once per thread, and the passes over
// a panel pull the next panel's B tiles toward L2 -- benchmarks/short_prefill.py's time to first token.
//
// Defined in both builds; only the AVX-512 build with AMX runs it, and only once kv_bf16_gemm has found the
// tiles usable (-6 otherwise).

#if KV_AVX512 && KV_HAS_AMX
#ifndef GB_GROUP_BYTES
#define GB_GROUP_BYTES (1024 * 1024)  // panels whose B tiles share L2 while row pairs pass (512 KiB-4 MiB measured)
#endif
#ifndef GB_PANEL_ROWS
#define GB_PANEL_ROWS 512  // padded rows up to which the threads split the panels (above: the row pairs)
#endif
#ifndef GB_CHUNK_ROWS
#define GB_CHUNK_ROWS 256  // panel-major order: activation rows per pass over the panels (their bf16 rows stay in L2)
#endif
// x [rows, k] float32 -> bf16 (round to nearest even) as A tiles: 16 rows x 32 inputs, 1 KiB each, for row
// group g and k block b at (g * k/32 + b) KiB; rows past `rows` zero.
static inline void gb_round_rows(const float* x, int64_t rows, int64_t rows_pad, int64_t k, uint16_t* out) {
    const int64_t nb = k / 32;
#pragma omp parallel for num_threads(kv_threads()) schedule(static)
    for (int64_t r = 0; r < rows_pad; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            __m512i v = _mm512_setzero_si512();
            if (r < rows)
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * k + b * 32 + 16), _mm512_loadu_ps(x + r * k + b * 32));
            _mm512_store_si512(a_tile_row(out, nb, r, b), v);
        }
}

// rms_norm (impl.h) of rows [0, rows) with rows [split, rows) going straight into A tiles (rows - split of them,
// padded to 32 with zeros; as gb_round_rows rounds the float32 rows, the same bits) and rows [0, split) to y as
// float32: the prefill spans' rows of a step whose decode rows come first (layer.h).
static inline int gb_rms_norm_rows(float* x, const float* residual, const float* weight, int64_t rows, int64_t k,
                                   float eps, int64_t split, float* y, uint16_t* tiles) {
    if (k % 32 != 0) return -2;
    const int64_t nb = k / 32;
    a_tile_zero_rows(tiles, nb, rows - split, (rows - split + 31) / 32 * 32);
#pragma omp parallel for schedule(static) num_threads(kv_threads())
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * k;
        const float inv = rms_norm_inverse(xr, residual ? residual + r * k : nullptr, k, eps);
        if (r < split) {
            for (int64_t e = 0; e < k; e += W) vstore(y + r * k + e, rms_norm_at(xr, weight, inv, e));
            continue;
        }
        for (int64_t b = 0; b < nb; ++b)
            _mm512_store_si512(a_tile_row(tiles, nb, r - split, b),
                               (__m512i)_mm512_cvtne2ps_pbh(rms_norm_at(xr, weight, inv, b * 32 + 16),
                                                            rms_norm_at(xr, weight, inv, b * 32)));
    }
    return 0;
}

struct GbPanel {  // the two B tiles' first k block of one panel
    const uint8_t* b0;
    const uint8_t* b1;
};

// C tiles 0..3 = (A row groups a, a + nb KiB) x (B column tiles b0, b1) over nb k blocks: tile 0 = rows 0-15 x
// b0, 1 = rows 0-15 x b1, 2 = rows 16-31 x b0, 3 = rows 16-31 x b1. With `share` > 0, `ahead`'s two runs of
// bytes are prefetched into L2, `share` bytes of each per k block, while these compute.
static inline void gb_product(const uint16_t* a, const uint8_t* b0, const uint8_t* b1, int64_t nb,
                              GbPanel ahead = {nullptr, nullptr}, int64_t share = 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t line = 0; line < share; line += 64) {
            __builtin_prefetch(ahead.b0 + b * share + line, 0, 2);
            __builtin_prefetch(ahead.b1 + b * share + line, 0, 2);
        }
        _tile_loadd(4, a + b * 512, 64);
        _tile_loadd(5, a + (nb + b) * 512, 64);
        _tile_loadd(6, b0 + b * 1024, 64);
        _tile_loadd(7, b1 + b * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// One C tile (16 activation rows x 16 weight rows, float32, at acc) into y: the rows and columns that exist.
static inline void gb_store(const float* acc, int64_t live_rows, int64_t live_cols, float* y, int64_t ystride) {
    const __mmask16 keep = static_cast<__mmask16>((1u << live_cols) - 1u);
    for (int64_t r = 0; r < live_rows; ++r) _mm512_mask_storeu_ps(y + r * ystride, keep, _mm512_load_ps(acc + r * 16));
}

// C tile `tile` (literal) to y, directly when all 16 x 16 exist, else through acc.
#define GB_STORE(tile, r0, c0)                                                                            \
    do {                                                                                                  \
        const int64_t lr = rows - (r0) < 16 ? rows - (r0) : 16, lc = n - (c0) < 16 ? n - (c0) : 16;       \
        if (lr == 16 && lc == 16) {                                                                       \
            _tile_stored(tile, y + (r0) * ystride + (c0), ystride * 4);                                   \
        } else if (lr > 0 && lc > 0) {                                                                    \
            _tile_stored(tile, acc, 64);                                                                  \
            gb_store(acc, lr, lc, y + (r0) * ystride + (c0), ystride);                                    \
        }                                                                                                 \
    } while (0)

// The GEMMs' frame over activations already in A tiles (xb: rows padded to 32, zero past `rows`): each thread
// takes whole row pairs across groups of panels (two 16-row B tiles each), or whole panels of every
// GB_CHUNK_ROWS-row chunk; `epilogue(p, r0, acc)` stores C tiles 0..3 of panel p and rows r0..r0 + 31 (acc: 512
// floats of the thread's scratch), after gb_product with the B tiles `panel(p)`.
template <typename Panel, typename Epilogue>
static int gb_run_tiles(const uint16_t* xb, int64_t rows, int64_t k, int64_t panels, Panel panel, Epilogue epilogue) {
    const int64_t nb = k / 32, rows_pad = (rows + 31) / 32 * 32;
    const int64_t pairs = rows_pad / 32;
    // Panels per group: their B tiles (2 x nb KiB each) stay in L2 while each thread's row pairs pass them.
    const int64_t per_group = GB_GROUP_BYTES / (2 * nb * 1024) > 0 ? GB_GROUP_BYTES / (2 * nb * 1024) : 1;
    const bool by_rows = pairs >= 2 * kv_threads() && rows_pad > GB_PANEL_ROWS;
#pragma omp parallel num_threads(kv_threads())
    {
        ScratchScope own;
        float* acc = own.take<float>(512);
        static const AmxBf16TileConfig config;  // simd.h: every tile 16 x 64 bytes
        _tile_loadconfig(&config);
        if (by_rows) {  // each thread whole row pairs (their A tiles stay in L1) across a group of panels
            for (int64_t p0 = 0; p0 < panels; p0 += per_group) {
                const int64_t p1 = p0 + per_group < panels ? p0 + per_group : panels;
#pragma omp for schedule(static)
                for (int64_t rp = 0; rp < pairs; ++rp)
                    for (int64_t p = p0; p < p1; ++p) {
                        const GbPanel b = panel(p);
                        gb_product(xb + 2 * rp * nb * 512, b.b0, b.b1, nb);
                        epilogue(p, 32 * rp, acc);
                    }
            }
        } else {
            for (int64_t chunk = 0; chunk < rows_pad; chunk += GB_CHUNK_ROWS) {
                const int64_t chunk_end = chunk + GB_CHUNK_ROWS < rows_pad ? chunk + GB_CHUNK_ROWS : rows_pad;
                // Each pass over panel p prefetches its share of panel p + 1's B tiles, so the next panel's weights
                // stream from memory while this one's compute (all of it in the first pass: 1.05-1.07x slower
                // prompts, short_prefill.py). Shares round up to lines: the last may reach past the panel's tiles,
                // which a prefetch may (it never faults).
                const int64_t share = (1024 * 32 / (chunk_end - chunk) + 63) / 64 * 64;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; ++p) {
                    const GbPanel b = panel(p), next = panel(p + 1 < panels ? p + 1 : p);
                    for (int64_t r0 = chunk; r0 < chunk_end; r0 += 32) {
                        const int64_t at = (r0 - chunk) / 32 * nb * share;
                        gb_product(xb + (r0 / 16) * nb * 512, b.b0, b.b1, nb, {next.b0 + at, next.b1 + at}, share);
                        epilogue(p, r0, acc);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

// gb_run_tiles over float32 rows x, rounded into A tiles first (gb_round_rows).
template <typename Panel, typename Epilogue>
static int gb_run(const float* x, int64_t rows, int64_t k, int64_t panels, Panel panel, Epilogue epilogue) {
    const int64_t rows_pad = (rows + 31) / 32 * 32;
    ScratchScope scope;  // scratch.h
    uint16_t* xb = scope.take<uint16_t>(rows_pad * k);
    gb_round_rows(x, rows, rows_pad, k, xb);
    return gb_run_tiles(xb, rows, k, panels, panel, epilogue);
}

// y = bf16(x) @ W.T, the activations as float32 rows x (rounded here) or, xb non-null, as A tiles already rounded
// (gb_rms_norm_rows, gemm_bf16_swiglu_tiles, prefill.h's PrefillOut leave them so).
static int gemm_bf16_any(const float* x, const uint16_t* xb, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                         float* y, int64_t ystride) {
    if (!kv_bf16_gemm_on()) return -6;
    if (rows <= 0) return 0;
    if (k % 32 != 0 || n <= 0 || ystride < n) return -2;
    const int64_t nb = k / 32;
    const auto panel = [&](int64_t p) {  // packed n is a multiple of 32: both tiles exist
        return GbPanel{w + (2 * p) * nb * 1024, w + (2 * p + 1) * nb * 1024};
    };
    const auto epilogue = [&](int64_t p, int64_t r0, float* acc) {
        const int64_t c0 = 32 * p;
        GB_STORE(0, r0, c0);
        GB_STORE(1, r0, c0 + 16);
        GB_STORE(2, r0 + 16, c0);
        GB_STORE(3, r0 + 16, c0 + 16);
    };
    if (xb != nullptr) return gb_run_tiles(xb, rows, k, (n + 31) / 32, panel, epilogue);
    return gb_run(x, rows, k, (n + 31) / 32, panel, epilogue);
}

static int gemm_bf16(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, float* y,
                     int64_t ystride) {
    return gemm_bf16_any(x, nullptr, rows, k, w, n, y, ystride);
}

// The gate_up projection fused with SwiGLU: act[r, j] = silu(g) * u for g, u = bf16(x) @ W.T's columns j and
// I + j (W: the packed [2I, k] gate_up rows, I a multiple of 16, so gate tile t and up tile I/16 + t pair up
// as one panel). The epilogue is fused.h's swiglu on the same floats (the result equals gemm_bf16 then swiglu),
// and the 2I-wide product never reaches memory. `sink(r, t, v)` takes the 16 values v of row r, gate tile t, for
// each live row: act's float32 row (gemm_bf16_swiglu) or, rounded, the down projection's A tiles
// (gemm_bf16_swiglu_tiles).
template <typename Sink>
static int gb_swiglu_run(const float* x, const uint16_t* xb, int64_t rows, int64_t k, const uint8_t* w, int64_t I,
                         Sink sink) {
    const int64_t nb = k / 32, tiles = I / 16;
    const auto panel = [&](int64_t t) { return GbPanel{w + t * nb * 1024, w + (tiles + t) * nb * 1024}; };
    const auto epilogue = [&](int64_t t, int64_t r0, float* acc) {
        const V one = vset1(1.0f);
        for (int half = 0; half < 2; ++half) {
            const int64_t first = r0 + 16 * half;
            if (first >= rows) break;
            if (half == 0) {
                _tile_stored(0, acc, 64);
                _tile_stored(1, acc + 256, 64);
            } else {
                _tile_stored(2, acc, 64);
                _tile_stored(3, acc + 256, 64);
            }
            const int64_t live = rows - first < 16 ? rows - first : 16;
            for (int64_t r = 0; r < live; ++r) {  // gate in acc, up in acc + 256
                const V g = vload(acc + r * 16), e = vexp(vsub(vzero(), g));
                sink(first + r, t, vmul(vdiv(g, vadd(one, e)), vload(acc + 256 + r * 16)));
            }
        }
    };
    if (xb != nullptr) return gb_run_tiles(xb, rows, k, tiles, panel, epilogue);
    return gb_run(x, rows, k, tiles, panel, epilogue);
}

static int gemm_bf16_swiglu(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t I, float* act,
                            int64_t astride) {
    if (!kv_bf16_gemm_on()) return -6;
    if (rows <= 0) return 0;
    if (k % 32 != 0 || I <= 0 || I % 16 != 0 || astride < I) return -2;
    return gb_swiglu_run(x, nullptr, rows, k, w, I,
                         [&](int64_t r, int64_t t, V v) { vstore(act + r * astride + 16 * t, v); });
}

// gemm_bf16_swiglu with act as the down projection's A tiles (x as float32 rows or, xb, A tiles already; I a
// multiple of 32; rows padded to 32, the padding zeroed here): each value rounded to bf16 as gb_round_rows
// rounds (nearest even) -- gemm_bf16_swiglu then gb_round_rows, the same bits, without act's float32 rows.
// Tile t's 16 columns are half t % 2 of the A tiles' k block t / 2.
static int gemm_bf16_swiglu_tiles(const float* x, const uint16_t* xb, int64_t rows, int64_t k, const uint8_t* w,
                                  int64_t I, uint16_t* act_tiles) {
    if (!kv_bf16_gemm_on()) return -6;
    if (rows <= 0) return 0;
    if (k % 32 != 0 || I <= 0 || I % 32 != 0) return -2;
    const int64_t nbI = I / 32;
    a_tile_zero_rows(act_tiles, nbI, rows, (rows + 31) / 32 * 32);
    return gb_swiglu_run(x, xb, rows, k, w, I, [&](int64_t r, int64_t t, V v) {
        const __m256bh b = _mm512_cvtneps_pbh(v);
        __m256i bits;
        __builtin_memcpy(&bits, &b, sizeof bits);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a_tile_row(act_tiles, nbI, r, t / 2) + (t % 2) * 16), bits);
    });
}
#undef GB_STORE
#else
static inline int gemm_bf16(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t) {
    return -6;  // no AMX in this build
}
static inline int gemm_bf16_any(const float*, const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, float*,
                                int64_t) {
    return -6;
}
static inline int gemm_bf16_swiglu_tiles(const float*, const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t,
                                         uint16_t*) {
    return -6;
}
static inline int gb_rms_norm_rows(float*, const float*, const float*, int64_t, int64_t, float, int64_t, float*,
                                   uint16_t*) {
    return -6;
}
static inline int gemm_bf16_swiglu(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t) {
    return -6;
}
#endif
