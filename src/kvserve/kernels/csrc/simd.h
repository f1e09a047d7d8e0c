// One SIMD vocabulary, compiled once per ISA: kernels.cpp includes this (and the kernel bodies) inside a
// namespace under `#pragma GCC target(...)`, with KV_AVX512 set to 1 or 0. No system headers here.

#if KV_AVX512
typedef __m512 V;
constexpr int W = 16;
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
static inline V vzero() { return _mm512_setzero_ps(); }
static inline V vset1(float x) { return _mm512_set1_ps(x); }
static inline V vbroadcast0(__m128 x) { return _mm512_broadcastss_ps(x); }  // lane 0 everywhere
static inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
static inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(V v) { return _mm512_reduce_max_ps(v); }

// exp(x) for x <= 0 region used by softmax (clamped to [-87, 88]); relative error ~2e-7.
static inline V vexp(V x) {
    x = _mm512_max_ps(_mm512_min_ps(x, vset1(88.0f)), vset1(-87.0f));
    V fx = _mm512_roundscale_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    x = vfma(fx, vset1(-0.693359375f), x);
    x = vfma(fx, vset1(2.12194440e-4f), x);
    V y = vset1(1.9875691500e-4f);
    y = vfma(y, x, vset1(1.3981999507e-3f));
    y = vfma(y, x, vset1(8.3334519073e-3f));
    y = vfma(y, x, vset1(4.1665795894e-2f));
    y = vfma(y, x, vset1(1.6666665459e-1f));
    y = vfma(y, x, vset1(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
    return _mm512_scalef_ps(y, fx);
}

// vexp2's rounding to the nearest integer and its y x 2^n (n integral).
static inline V vround_nearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline V vscale2(V y, V n) { return _mm512_scalef_ps(y, n); }

// 32 quantized weights of one block as float vectors q[0..32/W).
// Q4: the 16 bytes widened once to 32-bit lanes (byte i = weights i and 16 + i), then the low nibbles masked
// and the high ones shifted down (5 vector ops per block instead of 7 for two separate widenings).
static inline void q4_1_block(const uint8_t* qs, V* q) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
static inline void q8_0_block(const int8_t* qs, V* q) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
}
// 32 bf16 weights as floats: a bf16 is the top half of a float32, so widening to 32 bits and shifting left
// by 16 is exact (no rounding, no native bf16 instructions needed).
static inline void bf16_block(const uint8_t* p, V* q) {
    for (int i = 0; i < 2; ++i) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i)));
        q[i] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
}
#else
typedef __m256 V;
constexpr int W = 8;
static inline V vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
static inline V vzero() { return _mm256_setzero_ps(); }
static inline V vset1(float x) { return _mm256_set1_ps(x); }
static inline V vbroadcast0(__m128 x) { return _mm256_broadcastss_ps(x); }
static inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
static inline float vsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vhmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline V vexp(V x) {
    x = _mm256_max_ps(_mm256_min_ps(x, vset1(88.0f)), vset1(-87.0f));
    V fx = _mm256_round_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = vfma(fx, vset1(-0.693359375f), x);
    x = vfma(fx, vset1(2.12194440e-4f), x);
    V y = vset1(1.9875691500e-4f);
    y = vfma(y, x, vset1(1.3981999507e-3f));
    y = vfma(y, x, vset1(8.3334519073e-3f));
    y = vfma(y, x, vset1(4.1665795894e-2f));
    y = vfma(y, x, vset1(1.6666665459e-1f));
    y = vfma(y, x, vset1(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return vmul(y, _mm256_castsi256_ps(e));
}

static inline V vround_nearest(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline V vscale2(V y, V n) {  // 2^n built from its exponent bits (n in [-126, 127])
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return vmul(y, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
static inline V u8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Each half of the 16 bytes widened straight from memory, then both nibbles taken in 32-bit lanes: 10 vector
// ops a block, where nibbles split in bytes first, then shifted apart and widened, took 13.
static inline void q4_1_block(const uint8_t* qs, V* q) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: weights 8h.. (low nibbles) and 16 + 8h.. (high)
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * h)));
        q[h] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
        q[2 + h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
}
static inline void q8_0_block(const int8_t* qs, V* q) {
    for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i))));
}
static inline void bf16_block(const uint8_t* p, V* q) {
    for (int i = 0; i < 4; ++i) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
        q[i] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
}
#endif

// 2^t for t <= 127 (below -126 it gives 2^-126 or so): the softmax of bf16 attention products, whose
// probabilities are rounded to bf16 anyway, as exp(x) = 2^(x log2 e) with the scaling folded into the caller's
// FMA. About 60% of vexp's uops (no Cody-Waite split, no upper clamp, one fewer polynomial term) at the same
// relative error.
static inline V vexp2(V t) {
    t = vmax(t, vset1(-126.0f));
    const V n = vround_nearest(t), f = vsub(t, n);
    V y = vset1(1.3264722656e-3f);  // 2^f on [-1/2, 1/2], relative error <= 1.9e-7 in float32 (fitted)
    y = vfma(y, f, vset1(9.6715129912e-3f));
    y = vfma(y, f, vset1(5.5507335812e-2f));
    y = vfma(y, f, vset1(2.4022242427e-1f));
    y = vfma(y, f, vset1(6.9314700365e-1f));
    y = vfma(y, f, vset1(1.0f));
    return vscale2(y, n);
}

static inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// KV pool elements: float32, or bf16 (`--kv-cache-dtype bfloat16`: the top half of a float32, half the bytes).
// Every kernel that reads or writes the pool is a template over the element type KT. Loads widen bf16
// exactly (a shift); stores round to nearest even, as torch's `.to(torch.bfloat16)` does (NaN -> 0x7FC0, as
// c10::BFloat16), so the torch twin's pool holds the same bits and attention reads the same values.
typedef uint16_t bf16_t;
static inline V kvload(const float* p) { return vload(p); }
static inline void kvstore(float* p, V v) { vstore(p, v); }
static inline float kvscalar(const float* p) { return *p; }
static inline void kvstore1(float* p, float x) { *p = x; }
static inline float kvscalar(const bf16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float x;
    __builtin_memcpy(&x, &bits, 4);
    return x;
}
static inline void kvstore1(bf16_t* p, float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    *p = x != x ? static_cast<bf16_t>(0x7FC0) : static_cast<bf16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#if KV_AVX512
static inline V kvload(const bf16_t* p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
// v rounded to bf16 (nearest even, NaN -> 0x7FC0): 32-bit lanes with the bf16 bits in their low half.
static inline __m512i vbf16_bits(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
static inline void kvstore(bf16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(vbf16_bits(v)));
}
static inline V vround_bf16(V v) { return _mm512_castsi512_ps(_mm512_slli_epi32(vbf16_bits(v), 16)); }
#else
static inline V kvload(const bf16_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
static inline __m256i vbf16_bits(V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
static inline V vround_bf16(V v) { return _mm256_castsi256_ps(_mm256_slli_epi32(vbf16_bits(v), 16)); }
static inline void kvstore(bf16_t* p, V v) {
    const __m256i r = vbf16_bits(v);
    // 32 -> 16 bits (values fit, so unsigned saturation keeps them): packus works per 128-bit lane, then the
    // two lanes' low halves are gathered into the low 128 bits.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// KV pool elements as fp8 e4m3fn (`--kv-cache-dtype fp8`, a quarter of float32's bytes): 1 sign, 4 exponent
// (bias 7) and 3 mantissa bits, no infinities, largest finite 448, subnormals down to 2^-9. Loads are exact:
// the byte's bits placed as a float16's (sign at bit 15, exponent-mantissa at bits 7-13: the value times 2^-8,
// a subnormal e4m3 a subnormal float16), widened by F16C and scaled by 2^8 -- no float32 subnormal is ever an
// operand (placing the bits in a float32 instead made 2^-120-scale subnormals, whose microcode assists ran
// decode attention 3.5x slower than over bf16). 0x7F, the NaN, reads as 480. Stores round to
// nearest even and saturate at +-448, NaN -> 0x7F with its sign -- as torch's `.to(torch.float8_e4m3fn)` does,
// so the torch twin's pool holds the same bits (tests/test_kv_fp8.py compares every store bit for bit).
typedef uint8_t fp8_t;
constexpr float FP8_MAX = 448.0f, FP8_MIN_NORMAL = 0.015625f;  // 2^-6
static inline float kvscalar(const fp8_t* p) {
    const uint32_t b = *p;
    return _cvtsh_ss(static_cast<unsigned short>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))) * 256.0f;
}
static inline void kvstore1(fp8_t* p, float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
    if (x != x) { *p = sign | 0x7Fu; return; }
    float a = __builtin_fabsf(x);
    a = a < FP8_MAX ? a : FP8_MAX;
    if (a < FP8_MIN_NORMAL) {  // subnormal: a multiple of 2^-9, rounded to nearest even (8 -> 0x08, 2^-6)
        *p = sign | static_cast<uint8_t>(__builtin_nearbyintf(a * 512.0f));
        return;
    }
    uint32_t u;
    __builtin_memcpy(&u, &a, 4);
    *p = sign | static_cast<uint8_t>(((u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20) - (120u << 3));
}
#if KV_AVX512
// Sign-extended to 16 bits, shifted left by 7 (the sign's copies land in bits 14-15), bit 14 cleared: the
// float16 bits above.
static inline V kvload(const fp8_t* p) {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
static inline void kvstore(fp8_t* p, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(INT32_MIN)), 24);
    const V a = _mm512_min_ps(_mm512_abs_ps(v), _mm512_set1_ps(FP8_MAX));  // NaN -> 448, masked below
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(ab, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFFF))), 20),
        _mm512_set1_epi32(120 << 3));
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)));  // MXCSR: nearest even
    __m512i r = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(a, _mm512_set1_ps(FP8_MIN_NORMAL), _CMP_LT_OQ), sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_or_si512(r, sign)));
}
#else
static inline V kvload(const fp8_t* p) {
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
static inline void kvstore(fp8_t* p, V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN)), 24);
    const V a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(FP8_MAX));
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(ab, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFFF))), 20),
        _mm256_set1_epi32(120 << 3));
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)));
    const V small = _mm256_cmp_ps(a, _mm256_set1_ps(FP8_MIN_NORMAL), _CMP_LT_OQ);
    __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(small));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_or_si256(r, sign);  // 8 dwords < 256: pack to bytes, low 8 bytes
    const __m256i w = _mm256_packus_epi32(r, r);               // 16-bit, per 128-bit lane
    const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_shuffle_epi32(b, 0x08));  // dwords 0 and 2: r0-r3, r4-r7
}
#endif

// The AMX A-tile layout of activations (gemm_bf16.h): 16 rows x 32 bf16 inputs a KiB, row group r / 16 and k
// block b at (r / 16 * nb + b) KiB; row r's 32 inputs of block b start here. Writers: gb_round_rows, the norms
// and SwiGLU of gemm_bf16.h, prefill attention's outputs (prefill.h). Both builds: only the zeroing runs in
// the AVX2 one (the layer loop pads whatever it allocates).
static inline uint16_t* a_tile_row(uint16_t* tiles, int64_t nb, int64_t r, int64_t b) {
    return tiles + ((r / 16) * nb + b) * 512 + (r % 16) * 32;
}
// Rows [r0, r1) of every one of the nb blocks zeroed: the padding past the live rows, which the tiles read.
static inline void a_tile_zero_rows(uint16_t* tiles, int64_t nb, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) __builtin_memset(a_tile_row(tiles, nb, r, b), 0, 64);
}

#if KV_AVX512
// r[i] (16 dwords each) -> r[j][i] = r_in[i][j]: the 16 x 16 dword transpose (16 rows' input pairs into AMX's
// B layout; a 16 x 16 float32 product tile into the output's orientation; bf16 pairs between key-major and
// query-major in prefill_amx.h).
static inline void transpose16_dwords(__m512i* r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; ++i) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i u0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88), u1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
        const __m512i v0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88), v1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(u0, v0, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(u1, v1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
    }
}

// The three bf16 splits of 16 floats: hi (top 8 significant bits), mid (the next 8 of the rest), lo (the rest,
// 8 bits at most): hi + mid + lo == v, each exact (as long as lo is a normal number). The AMX tiles' exact
// products (qgemm_amx.h's activations, prefill_amx.h's queries and probabilities).
static inline void split_bf16x3(__m512 v, __m512* part) {
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    part[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
    const __m512 rest = _mm512_sub_ps(v, part[0]);
    part[1] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
    part[2] = _mm512_sub_ps(rest, part[1]);
}

#if KV_HAS_AMX
// Palette 1, every tile 16 rows of 64 bytes (qgemm_amx.h, prefill_amx.h). Loaded by each thread before its
// tiles run (the configuration is per thread; both users load this same one).
struct alignas(64) AmxBf16TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
#endif
#endif
