// The exact path's AMX-BF16 pieces, apart from the GEMM that uses them (qgemm_amx.h): the tile configuration, the
// split of float32 values into three exact bf16 parts, and the 16 x 16 dword transpose into AMX's pair
// layout. Included only inside the AVX-512 namespace, with KV_HAS_AMX (so the guard is safe: the AVX2
// namespace never includes it).
#ifndef KV_AMX_SPLIT_H
#define KV_AMX_SPLIT_H

// Palette 1, every tile 16 rows of 64 bytes (qgemm_amx.h: tmm0, 1, 6, 7 products, tmm2..4 the activations'
// splits, tmm5 a weight piece). Loaded per call by each thread that runs tiles (the configuration is per
// thread).
struct alignas(64) AmxBf16TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// r[i] (16 dwords each) -> r[j][i] = r_in[i][j]: the 16 x 16 dword transpose (16 rows' input pairs into AMX's
// B layout; a 16 x 16 float32 product tile into the output's orientation).
static inline void ga_transpose16(__m512i* r) {
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
// 8 bits at most): hi + mid + lo == v, each exact (as long as lo is a normal number).
static inline void ga_split(__m512 v, __m512* part) {
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    part[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
    const __m512 rest = _mm512_sub_ps(v, part[0]);
    part[1] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
    part[2] = _mm512_sub_ps(rest, part[1]);
}

static inline __m512i ga_bf16_pair(__m512 lo16, __m512 hi16) {  // 2 x 16 floats (bf16 already) -> 32 bf16
    const __m256i a = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo16), 16));
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi16), 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

#endif  // KV_AMX_SPLIT_H
