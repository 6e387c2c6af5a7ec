/*
 * Linear layers on GGUF's block-quantized weights, read as stored: Q4_0, Q4_1 and Q8_0 (blocks of 32
 * values along a row, each with an fp16 scale, and for Q4_1 an fp16 minimum) and the K-quants a Q4_K_M
 * file mixes, Q4_K, Q5_K and Q6_K (super-blocks of 256 values: sub-block scales and minimums in 6 or 8
 * bits under fp16 super-scales). Each type is one `expand_*`: a block to the floats it means, the same
 * numbers as ggml's (and gguf-py's) dequantization.
 *
 * `gemm_*` serves float32 rows up to a few hundred (decode, small prefills): each weight row is read once
 * per call, expanded into floats in L1 and multiplied into every activation row (below PANEL_ROWS by dot
 * products, register tiles of two weight rows by MT activation rows; from it in GEMM-style panels, where
 * AVX2 has them), so a step reads the packed weights once instead of a dequantized copy four to eight
 * times their size. Activations and sums stay in float32: the result is the float32 product with the
 * dequantized weight, up to summation order.
 *
 * `gemm_bf16_*` does the same for bf16 activations on CPUs with AVX512-BF16: each block is expanded once
 * per tile of BF16_TILE rows, rounded to bf16 (as a dequantized bf16 model rounds its weights) and
 * multiplied with vdpbf16ps (32 products an instruction, float32 sums). `has_bf16_gemm` says whether it
 * was built. `gemm_bf16_lut_*` (Q4_0, Q4_1, Q4_K) serves the fewest rows: the 4-bit values go to bf16 through a
 * table, exactly, and each block's sum is scaled after.
 *
 * `gemm_vnni_*` (AVX512-VNNI, bf16 rows: Q4_0, Q4_1, Q4_K, Q6_K) and `gemm_x16_*` (AVX2, float32 rows: those,
 * Q8_0 and Q5_K) read weights repacked at load by `pack_x16`, 16 rows side by side, and multiply them with
 * integer dot products on activations quantized to int16 per block of 32.
 *
 * `dequant_*` writes whole rows as float32 or bf16, for the many-row path (prefill, big batches), where
 * the caller multiplies them with torch's GEMM, and for embedding lookups.
 *
 * Built at first use by pagedllm.native and called through ctypes from pagedllm.models.quantized.
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32 /* the inner loops' width: every block is a whole number of these */

/* float -> bf16, rounding to nearest even, for finite values only (every value here comes from finite
 * scales, which loading checks): without the NaN case it is one vector operation. */
static inline uint16_t finite_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float fp16_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* ---- one block to floats (ggml-quants.c's dequantize_row_*) ---------------------------------------- */

/* 16 nibbles (the low or high halves of 16 bytes) times d plus offset: d * q + offset for elements 0..15
 * (low) and 16..31 (high) of a 4-bit block. */
static inline void expand_nibbles(const uint8_t *restrict qs, float d, float offset, float *restrict out) {
#if defined(__AVX512F__)
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
    const __m512 dv = _mm512_set1_ps(d), ov = _mm512_set1_ps(offset);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(lo, dv, ov));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(hi, dv, ov));
#elif defined(__AVX2__) && defined(__FMA__)
    /* gcc leaves the loops below scalar (about 3 cycles a value): spelled out, 8 values an instruction. */
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(offset);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, ov));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, ov));
    _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, ov));
    _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, ov));
#else
    for (int j = 0; j < 16; j++) out[j] = d * (float)(qs[j] & 0x0F) + offset;
    for (int j = 0; j < 16; j++) out[j + 16] = d * (float)(qs[j] >> 4) + offset;
#endif
}

#if defined(__AVX512F__)
/* 16 unsigned bytes `q` (values 0..63) to d * q + offset. */
static inline void expand_16(__m128i q, float d, float offset, float *restrict out) {
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(d), _mm512_set1_ps(offset)));
}
#endif

static inline void expand_q4_0(const uint8_t *restrict block, float *restrict out) {
    const float d = fp16_to_float(block);
    expand_nibbles(block + 2, d, -8.f * d, out);
}

static inline void expand_q4_1(const uint8_t *restrict block, float *restrict out) {
    expand_nibbles(block + 4, fp16_to_float(block), fp16_to_float(block + 2), out);
}

static inline void expand_q8_0(const uint8_t *restrict block, float *restrict out) {
    const float d = fp16_to_float(block);
    const int8_t *qs = (const int8_t *)(block + 2);
#if defined(__AVX512F__)
    /* gcc's own vectorization of the loop below is slow here (scalar sign extensions); spelled out. */
    const __m512 dv = _mm512_set1_ps(d);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))), dv));
    _mm512_storeu_ps(out + 16,
                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))), dv));
#elif defined(__AVX2__)
    const __m256 dv = _mm256_set1_ps(d);
    for (int j = 0; j < 32; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + j)))), dv));
#else
    for (int j = 0; j < 32; j++) out[j] = d * (float)qs[j];
#endif
}

/* The 6-bit scale and minimum of sub-block j of a Q4_K or Q5_K super-block. */
static inline void scale_min_k4(int j, const uint8_t *q, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63);
        *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: d, dmin (fp16), 12 bytes of scales, 128 bytes of nibbles; each 32 bytes hold two sub-blocks. */
static inline void expand_q4_k(const uint8_t *restrict block, float *restrict out) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    const uint8_t *scales = block + 4, *qs = block + 16;
    for (int c = 0; c < 4; c++, qs += 32, out += 64) {
        float s1, m1, s2, m2;
        scale_min_k4(2 * c, scales, &s1, &m1);
        scale_min_k4(2 * c + 1, scales, &s2, &m2);
        const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
#if defined(__AVX512F__)
        for (int l = 0; l < 32; l += 16) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(qs + l));
            expand_16(_mm_and_si128(q, _mm_set1_epi8(0x0F)), d1, -o1, out + l);
            expand_16(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)), d2, -o2, out + l + 32);
        }
#else
        for (int l = 0; l < 32; l++) out[l] = d1 * (float)(qs[l] & 0x0F) - o1;
        for (int l = 0; l < 32; l++) out[l + 32] = d2 * (float)(qs[l] >> 4) - o2;
#endif
    }
}

/* Q5_K: as Q4_K, with a fifth bit of every value in 32 bytes of high bits before the nibbles. */
static inline void expand_q5_k(const uint8_t *restrict block, float *restrict out) {
    const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
    const uint8_t *scales = block + 4, *qh = block + 16, *qs = block + 48;
    for (int c = 0; c < 4; c++, qs += 32, out += 64) {
        float s1, m1, s2, m2;
        scale_min_k4(2 * c, scales, &s1, &m1);
        scale_min_k4(2 * c + 1, scales, &s2, &m2);
        const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
        const int low = 2 * c, high = 2 * c + 1;
#if defined(__AVX512F__)
        const __m128i nibble = _mm_set1_epi8(0x0F), fifth = _mm_set1_epi8(0x10);
        for (int l = 0; l < 32; l += 16) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(qs + l)), h = _mm_loadu_si128((const __m128i *)(qh + l));
            /* bit `low` (`high`) of each byte moved to bit 4: 16-bit shifts, the other byte's bits masked off */
            const __m128i h1 = _mm_and_si128(_mm_sll_epi16(_mm_srl_epi16(h, _mm_cvtsi32_si128(low)), _mm_cvtsi32_si128(4)), fifth);
            const __m128i h2 = _mm_and_si128(_mm_sll_epi16(_mm_srl_epi16(h, _mm_cvtsi32_si128(high)), _mm_cvtsi32_si128(4)), fifth);
            expand_16(_mm_or_si128(_mm_and_si128(q, nibble), h1), d1, -o1, out + l);
            expand_16(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), nibble), h2), d2, -o2, out + l + 32);
        }
#else
        for (int l = 0; l < 32; l++) out[l] = d1 * (float)((qs[l] & 0x0F) | (((qh[l] >> low) & 1) << 4)) - o1;
        for (int l = 0; l < 32; l++) out[l + 32] = d2 * (float)((qs[l] >> 4) | (((qh[l] >> high) & 1) << 4)) - o2;
#endif
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 sub-block scales, d (fp16) last. */
static inline void expand_q6_k(const uint8_t *restrict block, float *restrict out) {
    const float d = fp16_to_float(block + 208);
    const uint8_t *ql = block, *qh = block + 128;
    const int8_t *sc = (const int8_t *)(block + 192);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, out += 128) {
#if defined(__AVX512F__)
        const __m128i nibble = _mm_set1_epi8(0x0F), pair = _mm_set1_epi8(0x30);
        for (int l = 0, is = 0; l < 32; l += 16, is++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(ql + l));
            const __m128i b = _mm_loadu_si128((const __m128i *)(ql + l + 32));
            const __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
            /* the 2-bit highs at bits 0-1, 2-3, 4-5, 6-7 of each byte, each moved to bits 4-5 */
            const __m128i h0 = _mm_and_si128(_mm_slli_epi16(h, 4), pair), h1 = _mm_and_si128(_mm_slli_epi16(h, 2), pair);
            const __m128i h2 = _mm_and_si128(h, pair), h3 = _mm_and_si128(_mm_srli_epi16(h, 2), pair);
            const float d0 = d * sc[is], d1 = d * sc[is + 2], d2 = d * sc[is + 4], d3 = d * sc[is + 6];
            expand_16(_mm_or_si128(_mm_and_si128(a, nibble), h0), d0, -32.f * d0, out + l);
            expand_16(_mm_or_si128(_mm_and_si128(b, nibble), h1), d1, -32.f * d1, out + l + 32);
            expand_16(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), nibble), h2), d2, -32.f * d2, out + l + 64);
            expand_16(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), nibble), h3), d3, -32.f * d3, out + l + 96);
        }
#else
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            out[l] = d * sc[is] * (float)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
            out[l + 32] = d * sc[is + 2] * (float)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
            out[l + 64] = d * sc[is + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            out[l + 96] = d * sc[is + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
#endif
    }
}

/* ---- kernels, per type: BYTES a block, QB values a block ------------------------------------------- */

/* ---- few float32 rows: weight rows expanded once per call, then multiplied into every activation row ----- */

/* Weight values of a row expanded at a time: two rows' chunks (16 KB) stay in L1. Long chunks keep the
 * horizontal sums at the end of each product few (KC = 512 ran 2-12% slower at 8-32 rows on the AVX2 kind).
 * A multiple of every type's block. */
#define KC 2048
/* Activation rows per tile: 6 rows x 2 weight rows = 12 accumulators, with two weight vectors and one
 * activation vector, within AVX2's 16 registers. */
#define MT 6

/* y[i * n + j] (+)= x[i] . w_j over `len` values (a multiple of 8 * ACC) for activation rows i < mt and weight
 * rows j = 0, 1 (`pair` 0: j = 0 only). Each (i, j) sums in `acc` independent vectors, so that few rows still
 * keep enough FMA chains in flight. `mt` and `acc` are constants at every call site, so each gets its own
 * unrolled copy whose accumulators live in registers. */
static inline __attribute__((always_inline)) void dot_tile(const float *x, int64_t ldx, const float *w0,
                                                          const float *w1, int64_t len, int mt, int acc,
                                                          int first, int pair, float *y, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 sums[MT][2][4];
    for (int i = 0; i < mt; i++)
        for (int a = 0; a < acc; a++) sums[i][0][a] = sums[i][1][a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < len; k += 8 * acc)
        for (int a = 0; a < acc; a++) {
            const __m256 wa = _mm256_loadu_ps(w0 + k + 8 * a), wb = _mm256_loadu_ps(w1 + k + 8 * a);
            for (int i = 0; i < mt; i++) {
                const __m256 xv = _mm256_loadu_ps(x + i * ldx + k + 8 * a);
                sums[i][0][a] = _mm256_fmadd_ps(xv, wa, sums[i][0][a]);
                sums[i][1][a] = _mm256_fmadd_ps(xv, wb, sums[i][1][a]);
            }
        }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j <= pair; j++) {
            __m256 v = sums[i][j][0];
            for (int a = 1; a < acc; a++) v = _mm256_add_ps(v, sums[i][j][a]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_hadd_ps(h, h);
            const float total = _mm_cvtss_f32(_mm_hadd_ps(h, h));
            y[i * n + j] = first ? total : y[i * n + j] + total;
        }
#else
    (void)acc;
    for (int i = 0; i < mt; i++)
        for (int j = 0; j <= pair; j++) {
            const float *w = j ? w1 : w0;
            float total = 0.f;
            _Pragma("omp simd reduction(+ : total)")
            for (int64_t k = 0; k < len; k++) total += x[i * ldx + k] * w[k];
            y[i * n + j] = first ? total : y[i * n + j] + total;
        }
#endif
}

/* Every activation row against weight rows w0 (and w1 where `pair`) over one chunk: tiles of MT rows, then
 * the rest in one tile with more accumulators per product. */
static void dot_rows(const float *x, int64_t m, int64_t k, const float *w0, const float *w1, int64_t len,
                     int first, int pair, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + MT <= m; i += MT) dot_tile(x + i * k, k, w0, w1, len, MT, 1, first, pair, y + i * n, n);
    switch (m - i) {
    case 5: dot_tile(x + i * k, k, w0, w1, len, 5, 1, first, pair, y + i * n, n); break;
    case 4: dot_tile(x + i * k, k, w0, w1, len, 4, 1, first, pair, y + i * n, n); break;
    case 3: dot_tile(x + i * k, k, w0, w1, len, 3, 2, first, pair, y + i * n, n); break;
    case 2: dot_tile(x + i * k, k, w0, w1, len, 2, 2, first, pair, y + i * n, n); break;
    case 1: dot_tile(x + i * k, k, w0, w1, len, 1, 4, first, pair, y + i * n, n); break;
    default: break;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* From PANEL_ROWS activation rows on, GEMM-style: NR weight rows are expanded PK values at a time and
 * transposed into a panel (value k of all NR rows side by side), and each tile of MT activation rows
 * broadcasts its value k against the panel's two vectors: 12 accumulators that each hold 8 outputs, so no
 * horizontal sums, and each expanded value serves every tile. Below PANEL_ROWS the tiles are too few to
 * pay for the transposition. */
#define NR 16
#define PK 256
#define PANEL_ROWS 20

/* dst[k * ldd + j] = src[j * ld + k] for an 8 x 8 square. */
static inline void transpose8(const float *src, int64_t ld, float *dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + j * ld);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        r[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * ldd, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
    }
}

/* y[i * n + j] (+)= sum_k x[i][k] * panel[k][j] for i < mt (a constant at each call site) and the panel's
 * `cols` valid outputs. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t ldx, const float *panel,
                                                            int64_t len, int mt, int first, float *y, int64_t n,
                                                            int64_t cols) {
    __m256 acc[MT][2];
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < len; k++) {
        const __m256 p0 = _mm256_load_ps(panel + k * NR), p1 = _mm256_load_ps(panel + k * NR + 8);
#pragma GCC unroll 8
        for (int i = 0; i < mt; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(xv, p0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, p1, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mt; i++) {
        float out[NR];
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        for (int64_t j = 0; j < cols; j++) y[i * n + j] = first ? out[j] : y[i * n + j] + out[j];
    }
}

/* Every activation row against a panel: tiles of MT rows, then the rest. */
static void panel_rows(const float *x, int64_t m, int64_t k, const float *panel, int64_t len, int first, float *y,
                       int64_t n, int64_t cols) {
    int64_t i = 0;
    for (; i + MT <= m; i += MT) panel_tile(x + i * k, k, panel, len, MT, first, y + i * n, n, cols);
    switch (m - i) {
    case 5: panel_tile(x + i * k, k, panel, len, 5, first, y + i * n, n, cols); break;
    case 4: panel_tile(x + i * k, k, panel, len, 4, first, y + i * n, n, cols); break;
    case 3: panel_tile(x + i * k, k, panel, len, 3, first, y + i * n, n, cols); break;
    case 2: panel_tile(x + i * k, k, panel, len, 2, first, y + i * n, n, cols); break;
    case 1: panel_tile(x + i * k, k, panel, len, 1, first, y + i * n, n, cols); break;
    default: break;
    }
}

#define DEFINE_PANEL_GEMM(TYPE, BYTES, QB)                                                                \
    static void panel_gemm_##TYPE(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,      \
                                  float *y) {                                                             \
        const int64_t blocks = k / (QB), row_bytes = blocks * (BYTES);                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r0 = 0; r0 < n; r0 += NR) {                                                          \
            float rows_buf[NR][PK] __attribute__((aligned(32)));                                          \
            float panel[PK * NR] __attribute__((aligned(32)));                                            \
            const int64_t cols = n - r0 < NR ? n - r0 : NR;                                               \
            if (cols < NR) memset(rows_buf, 0, sizeof rows_buf);                                          \
            for (int64_t k0 = 0; k0 < k; k0 += PK) {                                                      \
                const int64_t len = k - k0 < PK ? k - k0 : PK;                                            \
                for (int64_t j = 0; j < cols; j++)                                                        \
                    for (int64_t b = k0 / (QB); b < (k0 + len) / (QB); b++)                               \
                        expand_##TYPE(w + (r0 + j) * row_bytes + b * (BYTES), rows_buf[j] + b * (QB) - k0); \
                for (int64_t kk = 0; kk < len; kk += 8) {                                                 \
                    transpose8(&rows_buf[0][kk], PK, panel + kk * NR, NR);                                \
                    transpose8(&rows_buf[8][kk], PK, panel + kk * NR + 8, NR);                            \
                }                                                                                         \
                panel_rows(x + k0, m, k, panel, len, k0 == 0, y + r0, n, cols);                           \
            }                                                                                             \
        }                                                                                                 \
    }
#define PANEL_CALL(TYPE)                                                                                  \
    if (m >= PANEL_ROWS) {                                                                                \
        panel_gemm_##TYPE(x, m, k, w, n, y);                                                              \
        return;                                                                                           \
    }
#else
#define DEFINE_PANEL_GEMM(TYPE, BYTES, QB)
#define PANEL_CALL(TYPE)
#endif

/* y[i][r] = sum_k x[i][k] * w[r][k]: each pair of weight rows is expanded into floats once per call, KC values
 * at a time, and multiplied into all m activation rows (so the expansion, the costly part at few rows, no
 * longer repeats per tile of rows). */
#define DEFINE_KERNELS(TYPE, BYTES, QB)                                                                   \
    DEFINE_PANEL_GEMM(TYPE, BYTES, QB)                                                                    \
    void gemm_##TYPE(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {       \
        PANEL_CALL(TYPE)                                                                                  \
        const int64_t blocks = k / (QB), row_bytes = blocks * (BYTES);                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < n; r += 2) {                                                              \
            float w0[KC] __attribute__((aligned(32))), w1[KC] __attribute__((aligned(32)));               \
            const int pair = r + 1 < n;                                                                   \
            for (int64_t k0 = 0; k0 < k; k0 += KC) {                                                      \
                const int64_t len = k - k0 < KC ? k - k0 : KC;                                            \
                for (int64_t b = k0 / (QB); b < (k0 + len) / (QB); b++) {                                 \
                    expand_##TYPE(w + r * row_bytes + b * (BYTES), w0 + b * (QB) - k0);                   \
                    if (pair) expand_##TYPE(w + (r + 1) * row_bytes + b * (BYTES), w1 + b * (QB) - k0);   \
                }                                                                                         \
                dot_rows(x + k0, m, k, w0, pair ? w1 : w0, len, k0 == 0, pair, y + r, n);                 \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    void dequant_##TYPE##_f32(const uint8_t *w, int64_t rows, int64_t k, float *out) {                    \
        const int64_t blocks = k / (QB);                                                                  \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < rows; r++)                                                                \
            for (int64_t b = 0; b < blocks; b++)                                                          \
                expand_##TYPE(w + (r * blocks + b) * (BYTES), out + r * k + b * (QB));                    \
    }                                                                                                     \
                                                                                                          \
    void dequant_##TYPE##_bf16(const uint8_t *w, int64_t rows, int64_t k, uint16_t *out) {                \
        const int64_t blocks = k / (QB);                                                                  \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            float values[QB];                                                                             \
            for (int64_t b = 0; b < blocks; b++) {                                                        \
                expand_##TYPE(w + (r * blocks + b) * (BYTES), values);                                    \
                uint16_t *dst = out + r * k + b * (QB);                                                   \
                _Pragma("omp simd")                                                                       \
                for (int j = 0; j < (QB); j++) dst[j] = finite_to_bf16(values[j]);                        \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    DEFINE_GEMM_BF16(TYPE, BYTES, QB)

#if defined(__AVX512BF16__)
#define BF16_TILE 8

#define DEFINE_GEMM_BF16(TYPE, BYTES, QB)                                                                 \
    static inline void bf16_tile_##TYPE(const uint16_t *x, int64_t k, const uint8_t *row, int64_t blocks, \
                                        float *y, int64_t n, int mt) {                                    \
        __m512 acc[BF16_TILE];                                                                            \
        for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();                                        \
        float values[QB];                                                                                 \
        for (int64_t b = 0; b < blocks; b++) {                                                            \
            expand_##TYPE(row + b * (BYTES), values);                                                     \
            for (int c = 0; c < (QB) / QK; c++) {                                                         \
                const __m512bh wv = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + c * QK + 16),           \
                                                        _mm512_loadu_ps(values + c * QK));                \
                for (int i = 0; i < mt; i++) {                                                            \
                    const __m512i xv = _mm512_loadu_si512((const void *)(x + i * k + b * (QB) + c * QK)); \
                    acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)xv);                                   \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < mt; i++) y[i * n] = _mm512_reduce_add_ps(acc[i]);                             \
    }                                                                                                     \
                                                                                                          \
    void gemm_bf16_##TYPE(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) { \
        const int64_t blocks = k / (QB), row_bytes = blocks * (BYTES);                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < n; r++) {                                                                 \
            const uint8_t *row = w + r * row_bytes;                                                       \
            int64_t i = 0;                                                                                \
            /* Full tiles with a constant row count, so their accumulators stay in registers. */         \
            for (; i + BF16_TILE <= m; i += BF16_TILE)                                                    \
                bf16_tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, BF16_TILE);                 \
            if (i < m) bf16_tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, (int)(m - i));       \
        }                                                                                                 \
    }

/* Q4_0, Q4_1 and Q4_K at few rows: a block's (sub-block's) 4-bit values become bf16 through a table (exact:
 * small integers), are multiplied as they are, and the block's float32 sum is scaled by d after: a third of
 * the instructions of expanding d * q + offset in float32 and rounding it, and no rounding of the weights.
 * A Q4_1 or Q4_K block's minimum multiplies the sum of its 32 activations, summed once per call (`xsums`). */
#define LUT_ROWS 4

static inline __m512i nibble_table(float offset) {
    uint16_t table[32];
    for (int j = 0; j < 32; j++) table[j] = finite_to_bf16((float)(j & 15) + offset);
    return _mm512_loadu_si512((const void *)table);
}

/* 32 4-bit values (the low nibbles of bytes 0..31 of `q`) as bf16 through the table. */
static inline __m512bh nibbles32_bf16(__m256i q, __m512i table) {
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(q, _mm256_set1_epi8(0x0F))), table);
}

/* A Q4_0/Q4_1 block's 32 values: the low nibbles of its 16 bytes, then the high ones. */
static inline __m512bh nibbles_bf16(const uint8_t *qs, __m512i table) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return nibbles32_bf16(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), table);
}

/* The sums of `count` consecutive groups of QK bf16 values. */
static void block_sums(const uint16_t *x, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * QK))), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * QK + 16))), 16));
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

/* Q4_K's sub-blocks are Q4_1's blocks with 6-bit scales under the super-block's d and dmin: the same table. */
static inline void lut_tile_q4_k(const uint16_t *x, int64_t k, const uint8_t *row, int64_t blocks, __m512i table,
                                 const float *xsums, float *y, int64_t n, int mt) {
    __m512 acc[LUT_ROWS];
    float mins[LUT_ROWS] = {0};
    const int64_t groups = k / QK;
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * 144, *scales = block + 4, *qs = block + 16;
        const float d = fp16_to_float(block), dmin = fp16_to_float(block + 2);
        for (int c = 0; c < 4; c++) {
            float s1, m1, s2, m2;
            scale_min_k4(2 * c, scales, &s1, &m1);
            scale_min_k4(2 * c + 1, scales, &s2, &m2);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m512bh low = nibbles32_bf16(q, table), high = nibbles32_bf16(_mm256_srli_epi16(q, 4), table);
            const __m512 d1 = _mm512_set1_ps(d * s1), d2 = _mm512_set1_ps(d * s2);
            const float o1 = dmin * m1, o2 = dmin * m2;
            for (int i = 0; i < mt; i++) {
                const uint16_t *xb = x + i * k + b * 256 + c * 64;
                const __m512i x1 = _mm512_loadu_si512((const void *)xb), x2 = _mm512_loadu_si512((const void *)(xb + 32));
                acc[i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), low, (__m512bh)x1), d1, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), high, (__m512bh)x2), d2, acc[i]);
                const float *sums = xsums + i * groups + b * 8 + 2 * c;
                mins[i] -= o1 * sums[0] + o2 * sums[1];
            }
        }
    }
    for (int i = 0; i < mt; i++) y[i * n] = _mm512_reduce_add_ps(acc[i]) + mins[i];
}

#define DEFINE_LUT_TILE(TYPE, BYTES, QS, HAS_MIN)                                                         \
    static inline void lut_tile_##TYPE(const uint16_t *x, int64_t k, const uint8_t *row, int64_t blocks,  \
                                       __m512i table, const float *xsums, float *y, int64_t n, int mt) {  \
        __m512 acc[LUT_ROWS];                                                                             \
        float mins[LUT_ROWS] = {0};                                                                       \
        for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();                                        \
        for (int64_t b = 0; b < blocks; b++) {                                                            \
            const uint8_t *block = row + b * (BYTES);                                                     \
            const __m512bh wv = nibbles_bf16(block + (QS), table);                                        \
            const __m512 dv = _mm512_set1_ps(fp16_to_float(block));                                      \
            const float least = HAS_MIN ? fp16_to_float(block + 2) : 0.f;                                 \
            for (int i = 0; i < mt; i++) {                                                                \
                const __m512i xv = _mm512_loadu_si512((const void *)(x + i * k + b * QK));                \
                acc[i] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wv, (__m512bh)xv), dv, acc[i]); \
                if (HAS_MIN) mins[i] += least * xsums[i * blocks + b];                                    \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < mt; i++) y[i * n] = _mm512_reduce_add_ps(acc[i]) + mins[i];                   \
    }

DEFINE_LUT_TILE(q4_0, 18, 2, 0)
DEFINE_LUT_TILE(q4_1, 20, 4, 1)

/* Every table kernel: the activations' group sums where the type has minimums, then each weight row
 * against tiles of LUT_ROWS activation rows. */
#define DEFINE_GEMM_BF16_LUT(TYPE, BYTES, QB, OFFSET, HAS_MIN)                                            \
    void gemm_bf16_lut_##TYPE(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) { \
        const int64_t blocks = k / (QB), row_bytes = blocks * (BYTES), groups = k / QK;                  \
        const __m512i table = nibble_table(OFFSET);                                                       \
        float xsums[HAS_MIN ? m * groups : 1];                                                            \
        if (HAS_MIN) block_sums(x, m * groups, xsums);                                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < n; r++)                                                                   \
            for (int64_t i = 0; i < m; i += LUT_ROWS) {                                                   \
                const uint8_t *row = w + r * row_bytes;                                                   \
                const float *sums = xsums + (HAS_MIN ? i * groups : 0);                                   \
                /* a constant row count at each call, so that the accumulators stay in registers */      \
                switch (m - i) {                                                                          \
                case 1: lut_tile_##TYPE(x + i * k, k, row, blocks, table, sums, y + i * n + r, n, 1); break; \
                case 2: lut_tile_##TYPE(x + i * k, k, row, blocks, table, sums, y + i * n + r, n, 2); break; \
                case 3: lut_tile_##TYPE(x + i * k, k, row, blocks, table, sums, y + i * n + r, n, 3); break; \
                default: lut_tile_##TYPE(x + i * k, k, row, blocks, table, sums, y + i * n + r, n, LUT_ROWS); \
                }                                                                                         \
            }                                                                                             \
    }

DEFINE_GEMM_BF16_LUT(q4_0, 18, 32, -8.f, 0)
DEFINE_GEMM_BF16_LUT(q4_1, 20, 32, 0.f, 1)
DEFINE_GEMM_BF16_LUT(q4_k, 144, 256, 0.f, 1)

int has_bf16_gemm(void) { return 1; }
#else
#define DEFINE_GEMM_BF16(TYPE, BYTES, QB)
int has_bf16_gemm(void) { return 0; }
#endif

DEFINE_KERNELS(q4_0, 18, 32)
DEFINE_KERNELS(q4_1, 20, 32)
DEFINE_KERNELS(q8_0, 34, 32)
DEFINE_KERNELS(q4_k, 144, 256)
DEFINE_KERNELS(q5_k, 176, 256)
DEFINE_KERNELS(q6_k, 210, 256)

/* ---- Q4_0, Q4_1, Q4_K and Q6_K repacked for integer dot products (AVX512-VNNI) --------------------- */

/* At load, each group of X16 rows is repacked block by block into X16 rows side by side (llama.cpp's
 * "repack" idea). The caller describes a type's block as segments (offset, size) that cover it: the packed
 * block holds segment 0 of each of the X16 rows, row after row, then segment 1 of each, and so on. The same
 * bytes, moved: a packed block of X16 rows is X16 blocks long. The segments (pagedllm.models.quantized
 * says which) put the X16 rows' scales side by side, one vector load for all, and cut the values into
 * runs of 4 bytes: a run of X16 rows is one 64-byte vector whose nibbles (or 6-bit values) hold four
 * values of each row. Split into 16-bit words, a pair of them meets a pair of activations broadcast to
 * every lane in one vpdpwssd, and each lane's int32 sum is one row's.
 *
 * Activations are quantized per block of 32 to int16 with a float32 scale (amax / 32767). llama.cpp
 * quantizes them to int8 here (its Q8_0 and Q8_K), twice the products per instruction; int16 keeps the
 * product as close to float32 as the bf16 path's (int8 was measured at 3.4x the bf16 path's mean KL on the
 * default model, docs/PERFORMANCE.md), and one row is bound by the weights' read either way. Offsets (Q4_0's
 * 8, Q6_K's 32) and minimums (Q4_1's, Q4_K's) are applied once per (sub-)block, by the sums of the
 * quantized activations, so that their error and the values' cancel as in the product with the
 * quantized row. */
#define X16 16

/* Block b of the X16 rows at `rows` (GGUF's layout, `blocks` blocks of `bytes` a row) against its packed
 * form at `packed`: copied into it (`to_packed`) or back out of it. */
static void move_block(uint8_t *rows, int64_t blocks, int64_t bytes, int64_t b, const int32_t *segments,
                       int64_t count, uint8_t *packed, int to_packed) {
    for (int64_t s = 0; s < count; s++) {
        const int32_t offset = segments[2 * s], size = segments[2 * s + 1];
        for (int r = 0; r < X16; r++) {
            uint8_t *row = rows + (r * blocks + b) * bytes + offset, *slot = packed + r * size;
            memcpy(to_packed ? slot : row, to_packed ? row : slot, (size_t)size);
        }
        packed += X16 * size;
    }
}

void pack_x16(uint8_t *w, int64_t n, int64_t blocks, int64_t bytes, const int32_t *segments, int64_t count,
              uint8_t *out) {
    const int64_t group_bytes = X16 * blocks * bytes;
    /* a group at a time through a buffer, so that `out` may be `w` (repacked in place, no second copy) */
    uint8_t *buffer = (uint8_t *)malloc((size_t)group_bytes);
    for (int64_t g = 0; g < n / X16; g++) {
        for (int64_t b = 0; b < blocks; b++)
            move_block(w + g * group_bytes, blocks, bytes, b, segments, count, buffer + b * X16 * bytes, 1);
        memcpy(out + g * group_bytes, buffer, (size_t)group_bytes);
    }
    free(buffer);
}

/* The inverse of pack_x16, for `n` rows (a multiple of X16) starting at a group's first row; `w` is not
 * `packed`. */
void unpack_x16(uint8_t *packed, int64_t n, int64_t blocks, int64_t bytes, const int32_t *segments, int64_t count,
                uint8_t *w) {
    const int64_t group_bytes = X16 * blocks * bytes;
    for (int64_t g = 0; g < n / X16; g++)
        for (int64_t b = 0; b < blocks; b++)
            move_block(w + g * group_bytes, blocks, bytes, b, segments, count, packed + g * group_bytes + b * X16 * bytes, 0);
}

#if (defined(__AVX2__) && defined(__FMA__)) || (defined(__AVX512VNNI__) && defined(__AVX512BF16__))
/* m rows of activations quantized per block of 32: int16 values in the order the kernels pair them (quad
 * t, values 4t..4t+3, as the words (0, 2) and (1, 3)), a float32 scale a block, and sums of the quantized
 * values: per block as they are (`qsum`) and scaled (`xsum`), and per half block (`qhalf`, Q6_K's
 * sub-blocks of 16). Block c of row i is at i * blocks + c. */
typedef struct {
    int16_t *q;
    float *scale, *xsum;
    int32_t *qsum, *qhalf;
    int64_t blocks;
} Activations;

static Activations allocate_activations(int64_t m, int64_t k) {
    const size_t count = (size_t)(m * (k / QK));
    Activations a = {(int16_t *)malloc((size_t)(m * k) * sizeof(int16_t)), (float *)malloc(count * sizeof(float)),
                     (float *)malloc(count * sizeof(float)), (int32_t *)malloc(count * sizeof(int32_t)),
                     (int32_t *)malloc(count * 2 * sizeof(int32_t)), k / QK};
    return a;
}

static void release(Activations *a) {
    free(a->q);
    free(a->scale);
    free(a->xsum);
    free(a->qsum);
    free(a->qhalf);
}

/* The 6-bit scales (`sc`) and minimums (`mn`) of sub-block s of X16 packed Q4_K rows, a byte each, from the
 * packed block's 12 scale bytes `q` (X16 of each byte). */
static inline void q4_k_scale_bytes(const uint8_t *q, int s, __m128i *sc, __m128i *mn) {
    const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(0x0F), top = _mm_set1_epi8((char)0xC0);
#define SCALE_BYTE(j) _mm_loadu_si128((const __m128i *)(q + (j) * X16))
    if (s < 4) {
        *sc = _mm_and_si128(SCALE_BYTE(s), six);
        *mn = _mm_and_si128(SCALE_BYTE(s + 4), six);
    } else {
        /* the low 4 bits from byte s + 4, the top 2 from the top of byte s - 4 (s for the minimum) */
        const __m128i low = SCALE_BYTE(s + 4);
        *sc = _mm_or_si128(_mm_and_si128(low, four), _mm_srli_epi16(_mm_and_si128(SCALE_BYTE(s - 4), top), 2));
        *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(low, 4), four), _mm_srli_epi16(_mm_and_si128(SCALE_BYTE(s), top), 2));
    }
#undef SCALE_BYTE
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define VNNI_ROWS 4
#define VNNI_CHUNK 64

static Activations quantize_activations(const uint16_t *x, int64_t m, int64_t k) {
    const int64_t count = m * (k / QK);
    Activations a = allocate_activations(m, k);
    for (int64_t i = 0; i < count; i++) {
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * QK))), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * QK + 16))), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 32767.f, inverse = amax > 0.f ? 32767.f / amax : 0.f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
        int32_t v[32];
        _mm512_storeu_si512(v, qlo);
        _mm512_storeu_si512(v + 16, qhi);
        int16_t *dst = a.q + i * QK;
        for (int t = 0; t < 8; t++) {
            dst[4 * t] = (int16_t)v[4 * t];
            dst[4 * t + 1] = (int16_t)v[4 * t + 2];
            dst[4 * t + 2] = (int16_t)v[4 * t + 1];
            dst[4 * t + 3] = (int16_t)v[4 * t + 3];
        }
        a.scale[i] = d;
        a.qhalf[2 * i] = _mm512_reduce_add_epi32(qlo);
        a.qhalf[2 * i + 1] = _mm512_reduce_add_epi32(qhi);
        a.qsum[i] = a.qhalf[2 * i] + a.qhalf[2 * i + 1];
        a.xsum[i] = d * (float)a.qsum[i];
    }
    return a;
}

/* The words of a run's 4-bit (or 6-bit) values: lanes' values (0, 2) and (1, 3). */
static inline __m512i even_words(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi16(0x00FF)); }
static inline __m512i odd_words(__m512i v) { return _mm512_srli_epi16(v, 8); }

/* sums[i] += the run's values `v` times activation quad t of block `c` of row `i`. */
static inline void dot_quad(__m512i v, const Activations *a, int64_t row, int64_t c, int t, int mt, __m512i *sums) {
    const __m512i even = even_words(v), odd = odd_words(v);
    for (int i = 0; i < mt; i++) {
        const int32_t *pairs = (const int32_t *)(a->q + ((row + i) * a->blocks + c) * QK);
        sums[i] = _mm512_dpwssd_epi32(sums[i], even, _mm512_set1_epi32(pairs[2 * t]));
        sums[i] = _mm512_dpwssd_epi32(sums[i], odd, _mm512_set1_epi32(pairs[2 * t + 1]));
    }
}

/* Q4_0 (`has_min` 0) and Q4_1 blocks: X16 scales (and minimums) as fp16, then four runs of nibbles. */
static inline void q4_block(const uint8_t *blk, int has_min, const Activations *a, int64_t row, int64_t c, int mt, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t *runs = blk + X16 * (has_min ? 4 : 2);
    __m512i sums[VNNI_ROWS];
    /* Q4_0's values are q - 8: the offset times the activations' sum starts the integer sum */
    for (int i = 0; i < mt; i++) sums[i] = _mm512_set1_epi32(has_min ? 0 : -8 * a->qsum[(row + i) * a->blocks + c]);
    for (int t = 0; t < 4; t++) {
        const __m512i run = _mm512_loadu_si512((const void *)(runs + 64 * t));
        dot_quad(_mm512_and_si512(run, nibble), a, row, c, t, mt, sums);
        dot_quad(_mm512_and_si512(_mm512_srli_epi16(run, 4), nibble), a, row, c, t + 4, mt, sums);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int i = 0; i < mt; i++) {
        const int64_t at = (row + i) * a->blocks + c;
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(d, _mm512_set1_ps(a->scale[at])), acc[i]);
        if (has_min) {
            const __m512 least = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * X16)));
            acc[i] = _mm512_fmadd_ps(least, _mm512_set1_ps(a->xsum[at]), acc[i]);
        }
    }
}

static inline void q4_0_block(const uint8_t *blk, const Activations *a, int64_t row, int64_t b, int mt, __m512 *acc) {
    q4_block(blk, 0, a, row, b, mt, acc);
}

static inline void q4_1_block(const uint8_t *blk, const Activations *a, int64_t row, int64_t b, int mt, __m512 *acc) {
    q4_block(blk, 1, a, row, b, mt, acc);
}

/* 16 bytes, one per row, to floats. */
static inline __m512 bytes_to_floats(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

/* Q4_K super-blocks: d and dmin (fp16, X16 each), the 12 bytes of 6-bit scales and minimums (X16 of each
 * byte), then 32 runs of nibbles: run 8c + j holds bytes 32c + 4j.. of each row, whose low nibbles are
 * values 4j.. of sub-block 2c and high nibbles the same of sub-block 2c + 1. */
static inline void q4_k_block(const uint8_t *blk, const Activations *a, int64_t row, int64_t b, int mt, __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * X16)));
    const uint8_t *q = blk + 4 * X16, *runs = blk + 16 * X16;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m512 scales[2], mins[2];
        for (int h = 0; h < 2; h++) {
            __m128i sc, mn;
            q4_k_scale_bytes(q, 2 * c + h, &sc, &mn);
            scales[h] = _mm512_mul_ps(d, bytes_to_floats(sc));
            mins[h] = _mm512_mul_ps(dmin, bytes_to_floats(mn));
        }
        __m512i low[VNNI_ROWS], high[VNNI_ROWS];
        for (int i = 0; i < mt; i++) low[i] = high[i] = _mm512_setzero_si512();
        const int64_t first = 8 * b + 2 * c; /* the activations' block of sub-block 2c */
        for (int j = 0; j < 8; j++) {
            const __m512i run = _mm512_loadu_si512((const void *)(runs + 64 * (8 * c + j)));
            dot_quad(_mm512_and_si512(run, nibble), a, row, first, j, mt, low);
            dot_quad(_mm512_and_si512(_mm512_srli_epi16(run, 4), nibble), a, row, first + 1, j, mt, high);
        }
        for (int i = 0; i < mt; i++) {
            const int64_t at = (row + i) * a->blocks + first;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[i]), _mm512_mul_ps(scales[0], _mm512_set1_ps(a->scale[at])), acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high[i]), _mm512_mul_ps(scales[1], _mm512_set1_ps(a->scale[at + 1])), acc[i]);
            acc[i] = _mm512_fnmadd_ps(mins[0], _mm512_set1_ps(a->xsum[at]), acc[i]);
            acc[i] = _mm512_fnmadd_ps(mins[1], _mm512_set1_ps(a->xsum[at + 1]), acc[i]);
        }
    }
}

/* Q6_K super-blocks: d (fp16, X16), the 16 int8 sub-block scales (X16 of each), then for each half h and
 * quad j three runs: low-nibble bytes 64h + 4j.. (A) and 64h + 32 + 4j.. (B), high-bit bytes 32h + 4j.. (H).
 * Of each row, A's low nibbles with H's bits 0-1 are values 128h + 4j.., B's low with bits 2-3 values
 * 128h + 32 + 4j.., A's high with bits 4-5 values 128h + 64 + 4j.., B's high with bits 6-7 128h + 96 + 4j.. */
static inline void q6_k_block(const uint8_t *blk, const Activations *a, int64_t row, int64_t b, int mt, __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const int8_t *sc = (const int8_t *)(blk + 2 * X16);
    const uint8_t *runs = blk + 18 * X16;
    const __m512i nibble = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 2; half++) { /* quads 4 half .. 4 half + 3: sub-blocks 8h + 2 type + half */
            __m512i sums[4][VNNI_ROWS];
            for (int type = 0; type < 4; type++)
                for (int i = 0; i < mt; i++) {
                    /* values q - 32: the offset times the activations' sum over the sub-block starts its sum */
                    const int64_t at = (row + i) * a->blocks + 8 * b + 4 * h + type;
                    sums[type][i] = _mm512_set1_epi32(-32 * a->qhalf[2 * at + half]);
                }
            for (int j = 4 * half; j < 4 * half + 4; j++) {
                const uint8_t *run = runs + 192 * (8 * h + j);
                const __m512i A = _mm512_loadu_si512((const void *)run), B = _mm512_loadu_si512((const void *)(run + 64));
                const __m512i H = _mm512_loadu_si512((const void *)(run + 128));
                const __m512i values[4] = {
                    _mm512_or_si512(_mm512_and_si512(A, nibble), _mm512_and_si512(_mm512_slli_epi16(H, 4), pair)),
                    _mm512_or_si512(_mm512_and_si512(B, nibble), _mm512_and_si512(_mm512_slli_epi16(H, 2), pair)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), nibble), _mm512_and_si512(H, pair)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), nibble), _mm512_and_si512(_mm512_srli_epi16(H, 2), pair)),
                };
                for (int type = 0; type < 4; type++) dot_quad(values[type], a, row, 8 * b + 4 * h + type, j, mt, sums[type]);
            }
            for (int type = 0; type < 4; type++) {
                const int sub = 8 * h + 2 * type + half;
                const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + sub * X16)))));
                for (int i = 0; i < mt; i++) {
                    const int64_t at = (row + i) * a->blocks + 8 * b + 4 * h + type;
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[type][i]), _mm512_mul_ps(scale, _mm512_set1_ps(a->scale[at])), acc[i]);
                }
            }
        }
}

/* y = x @ W.T for bf16 x `[m, k]` and W packed by pack_x16 (blocks of QB values, BYTES a row's block), y
 * in bf16. Each thread takes a share of the groups and goes through the activation rows a chunk at a time,
 * so a chunk of quantized rows stays in its L2 while its groups pass (a group's blocks are 18-74 KB). */
#define DEFINE_GEMM_VNNI(TYPE, BYTES, QB)                                                                  \
    static inline void TYPE##_group(const uint8_t *group, int64_t blocks, const Activations *a, int64_t row, \
                                    int mt, uint16_t *y, int64_t n) {                                      \
        __m512 acc[VNNI_ROWS];                                                                              \
        for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();                                          \
        for (int64_t b = 0; b < blocks; b++) TYPE##_block(group + b * X16 * (BYTES), a, row, b, mt, acc);   \
        for (int i = 0; i < mt; i++) _mm256_storeu_si256((__m256i *)(y + i * n), (__m256i)_mm512_cvtneps_pbh(acc[i])); \
    }                                                                                                       \
                                                                                                            \
    void gemm_vnni_##TYPE(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *y) { \
        const int64_t blocks = k / (QB), group_bytes = blocks * X16 * (BYTES);                             \
        Activations a = quantize_activations(x, m, k);                                                      \
        _Pragma("omp parallel")                                                                             \
        {                                                                                                   \
            const int64_t groups = n / X16, threads = omp_get_num_threads(), id = omp_get_thread_num();     \
            const int64_t first = groups * id / threads, last = groups * (id + 1) / threads;                \
            for (int64_t chunk = 0; chunk < m; chunk += VNNI_CHUNK)                                         \
                for (int64_t g = first; g < last; g++)                                                      \
                    for (int64_t i = chunk; i < m && i < chunk + VNNI_CHUNK; i += VNNI_ROWS) {              \
                        const uint8_t *group = w + g * group_bytes;                                         \
                        uint16_t *out = y + i * n + g * X16;                                                \
                        /* a constant row count at each call, so that the accumulators stay in registers */ \
                        switch (m - i) {                                                                    \
                        case 1: TYPE##_group(group, blocks, &a, i, 1, out, n); break;                       \
                        case 2: TYPE##_group(group, blocks, &a, i, 2, out, n); break;                       \
                        case 3: TYPE##_group(group, blocks, &a, i, 3, out, n); break;                       \
                        default: TYPE##_group(group, blocks, &a, i, VNNI_ROWS, out, n);                     \
                        }                                                                                   \
                    }                                                                                       \
        }                                                                                                   \
        release(&a);                                                                                        \
    }

DEFINE_GEMM_VNNI(q4_0, 18, 32)
DEFINE_GEMM_VNNI(q4_1, 20, 32)
DEFINE_GEMM_VNNI(q4_k, 144, 256)
DEFINE_GEMM_VNNI(q6_k, 210, 256)

int has_vnni_gemm(void) { return 1; }
#else
int has_vnni_gemm(void) { return 0; }
#endif


/* ---- Q4_0, Q4_1, Q8_0 and the K-quants repacked by pack_x16, on float32 rows quantized to int16 (AVX2) -- */

/* The VNNI kernels' layout and activations, for AVX2's vpmaddwd: a run of the X16 rows (4 bytes each) is
 * two 32-byte vectors of 8 rows; split into 16-bit words, each holds a pair of values of each of its rows,
 * and against a pair of activations broadcast to every lane one vpmaddwd gives each row's two products
 * summed in int32 (AVX2 has no accumulating form: a vpaddd follows). Twice the products of an FMA an
 * instruction, and the weights need no expansion to floats: a product's integer sums are scaled once a
 * block. Q8_0 runs hold signed bytes, sign-extended to words. */
#if defined(__AVX2__) && defined(__FMA__)
#define X16_TILE 3   /* activation rows per tile: 6 int32 sums and 6 float32 accumulators */
#define X16_CHUNK 64 /* activation rows a thread takes through its groups at a time, staying in its L2 */
/* From this many activation rows, a group's runs are first expanded to words, X16_KB blocks at a time, into a
 * panel that every tile of rows reads: in the tiles themselves each expansion served X16_TILE rows only. */
#define X16_PANEL_ROWS 4
#define X16_KB 8

/* Float32 rows quantized per block of 32 as quantize_activations does bf16 ones (amax / 32767, the values
 * in quads ordered (0, 2, 1, 3)). */
static Activations quantize_activations_f32(const float *x, int64_t m, int64_t k) {
    Activations a = allocate_activations(m, k);
    /* from a chunk of rows on, on every thread: a prefill's thousands of rows take a few percent of a product */
    _Pragma("omp parallel for schedule(static) if (m >= X16_CHUNK)")
    for (int64_t i = 0; i < m * a.blocks; i++) {
        const float *src = x + i * QK;
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(src + 8 * t);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const __m256 inverse = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
        __m256i q[4];
        int32_t half[2];
        for (int t = 0; t < 4; t++) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inverse));
        for (int s = 0; s < 2; s++) {
            const __m256i both = _mm256_add_epi32(q[2 * s], q[2 * s + 1]);
            __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            sum = _mm_hadd_epi32(sum, sum);
            half[s] = _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
            /* a 128-bit lane is one quad; packs interleaves the lanes of its two operands, the permute undoes it */
            const __m256i first = _mm256_shuffle_epi32(q[2 * s], _MM_SHUFFLE(3, 1, 2, 0));
            const __m256i second = _mm256_shuffle_epi32(q[2 * s + 1], _MM_SHUFFLE(3, 1, 2, 0));
            _mm256_storeu_si256((__m256i *)(a.q + i * QK + 16 * s),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xD8));
        }
        a.scale[i] = top / 32767.f;
        a.qhalf[2 * i] = half[0];
        a.qhalf[2 * i + 1] = half[1];
        a.qsum[i] = half[0] + half[1];
        a.xsum[i] = a.scale[i] * (float)a.qsum[i];
    }
    return a;
}

/* sums[i][h] += the words of half h's rows (`even`, `odd`: values (0, 2) and (1, 3) of quad `quad`) times
 * activation row i's quad. */
static inline __attribute__((always_inline)) void x16_quad(__m256i even0, __m256i odd0, __m256i even1, __m256i odd1,
                                                          const int32_t *const *pairs, int quad, int mt,
                                                          __m256i sums[][2]) {
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) {
        const __m256i e = _mm256_set1_epi32(pairs[i][2 * quad]), o = _mm256_set1_epi32(pairs[i][2 * quad + 1]);
        sums[i][0] = _mm256_add_epi32(sums[i][0], _mm256_add_epi32(_mm256_madd_epi16(even0, e), _mm256_madd_epi16(odd0, o)));
        sums[i][1] = _mm256_add_epi32(sums[i][1], _mm256_add_epi32(_mm256_madd_epi16(even1, e), _mm256_madd_epi16(odd1, o)));
    }
}

static inline __m256i low_bytes(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi16(0x00FF)); }
static inline __m256i high_bytes(__m256i v) { return _mm256_srli_epi16(v, 8); }
static inline __m256i low_bytes_signed(__m256i v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); }
static inline __m256i high_bytes_signed(__m256i v) { return _mm256_srai_epi16(v, 8); }

/* acc[i][h] += activation row i's block c: its rows' minimums `least[h]` (when `has_min`) times the activations'
 * sum, then its integer sums scaled by the rows' scales `d[h]` and the activations' scale. One epilogue for the
 * blocks read from their runs and from a panel. */
static inline __attribute__((always_inline)) void x16_epilogue(__m256i sums[][2], const __m256 d[2], const __m256 least[2],
                                                              int has_min, const Activations *a, int64_t row, int64_t c,
                                                              int mt, __m256 acc[][2]) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            const int64_t at = (row + i) * a->blocks + c;
            if (has_min) acc[i][h] = _mm256_fmadd_ps(least[h], _mm256_set1_ps(a->xsum[at]), acc[i][h]);
            acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][h]), _mm256_mul_ps(d[h], _mm256_set1_ps(a->scale[at])), acc[i][h]);
        }
    }
}

/* x16_epilogue with the block's fp16 scales `blk` (X16) and minimums `least` (X16, or none). */
static inline __attribute__((always_inline)) void x16_scale(__m256i sums[][2], const uint8_t *blk, const uint8_t *least,
                                                           const Activations *a, int64_t row, int64_t c, int mt,
                                                           __m256 acc[][2]) {
    __m256 d[2], mins[2];
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        mins[h] = least == NULL ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(least + 16 * h)));
    }
    x16_epilogue(sums, d, mins, least != NULL, a, row, c, mt, acc);
}

/* Q4_0 (`has_min` 0) and Q4_1 blocks: X16 scales (and minimums), then four runs of nibbles: the low ones
 * are quad t, the high ones quad t + 4. */
static inline __attribute__((always_inline)) void x16_q4(const uint8_t *blk, int has_min, const Activations *a, int64_t row,
                                                        int64_t c, int mt, __m256 acc[][2]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const uint8_t *runs = blk + X16 * (has_min ? 4 : 2);
    __m256i sums[X16_TILE][2];
    const int32_t *pairs[X16_TILE];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) {
        const int64_t at = (row + i) * a->blocks + c;
        pairs[i] = (const int32_t *)(a->q + at * QK);
        /* Q4_0's values are q - 8: the offset times the activations' sum starts the integer sum */
        sums[i][0] = sums[i][1] = _mm256_set1_epi32(has_min ? 0 : -8 * a->qsum[at]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t + 32));
        const __m256i lo0 = _mm256_and_si256(r0, nibble), lo1 = _mm256_and_si256(r1, nibble);
        x16_quad(low_bytes(lo0), high_bytes(lo0), low_bytes(lo1), high_bytes(lo1), pairs, t, mt, sums);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), nibble);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), nibble);
        x16_quad(low_bytes(hi0), high_bytes(hi0), low_bytes(hi1), high_bytes(hi1), pairs, t + 4, mt, sums);
    }
    x16_scale(sums, blk, has_min ? blk + 2 * X16 : NULL, a, row, c, mt, acc);
}

static inline __attribute__((always_inline)) void x16_q4_0(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t c, int mt, __m256 acc[][2]) {
    x16_q4(blk, 0, a, row, c, mt, acc);
}

static inline __attribute__((always_inline)) void x16_q4_1(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t c, int mt, __m256 acc[][2]) {
    x16_q4(blk, 1, a, row, c, mt, acc);
}

/* Q8_0 blocks: X16 scales, then eight runs of signed bytes, run t quad t. */
static inline __attribute__((always_inline)) void x16_q8_0(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t c, int mt, __m256 acc[][2]) {
    const uint8_t *runs = blk + 2 * X16;
    __m256i sums[X16_TILE][2];
    const int32_t *pairs[X16_TILE];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) {
        pairs[i] = (const int32_t *)(a->q + ((row + i) * a->blocks + c) * QK);
        sums[i][0] = sums[i][1] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t + 32));
        x16_quad(low_bytes_signed(r0), high_bytes_signed(r0), low_bytes_signed(r1), high_bytes_signed(r1), pairs, t,
                 mt, sums);
    }
    x16_scale(sums, blk, NULL, a, row, c, mt, acc);
}

/* 16 bytes, one per row, to the floats of half h of the rows (8 h .. 8 h + 7). */
static inline __m256 half_bytes_to_floats(__m128i v, int h, int is_signed) {
    const __m128i half = h ? _mm_srli_si128(v, 8) : v;
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(half) : _mm256_cvtepu8_epi32(half));
}

/* Sub-block s's scales (d times its 6-bit scale) and minimums (-dmin times its 6-bit minimum) of a packed Q4_K
 * or Q5_K block, for each half of the rows. */
static inline void q4_k_sub_scales(const uint8_t *blk, int s, __m256 d[2], __m256 least[2]) {
    __m128i sc, mn;
    q4_k_scale_bytes(blk + 4 * X16, s, &sc, &mn);
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h))), half_bytes_to_floats(sc, h, 0));
        least[h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * X16 + 16 * h))),
                                 _mm256_sub_ps(_mm256_setzero_ps(), half_bytes_to_floats(mn, h, 0)));
    }
}

/* Sub-block s's scales of a packed Q6_K block (d times its int8 scale), for each half of the rows. */
static inline void q6_k_sub_scales(const uint8_t *blk, int s, __m256 d[2]) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 2 * X16 + s * X16));
    for (int h = 0; h < 2; h++)
        d[h] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h))), half_bytes_to_floats(sc, h, 1));
}

/* The values of sub-block s in quad j of a packed Q4_K block, or Q5_K (`five`), as the bytes of rows 0..7 (`v[0]`)
 * and 8..15 (`v[1]`): the low nibbles of run 8 (s / 2) + j for even s, the high ones for odd s; Q5_K's fifth bits
 * are bit s of its high-bit run j. */
static inline void k_run(const uint8_t *blk, int five, int s, int j, __m256i v[2]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const uint8_t *run = blk + (five ? 48 : 16) * X16 + 64 * (8 * (s / 2) + j);
    for (int h = 0; h < 2; h++) {
        const __m256i r = _mm256_loadu_si256((const __m256i *)(run + 32 * h));
        v[h] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(r, 4) : r, nibble);
        if (five) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(blk + 16 * X16 + 64 * j + 32 * h));
            v[h] = _mm256_or_si256(v[h], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, s), one), 4));
        }
    }
}

/* The 6-bit values (0..63) of `type` in half `h`, quad j of a packed Q6_K block, as the bytes of rows 0..7 and
 * 8..15 (see q6_k_block). */
static inline void q6_k_run(const uint8_t *blk, int h, int type, int j, __m256i v[2]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    const uint8_t *run = blk + 18 * X16 + 192 * (8 * h + j);
    for (int r = 0; r < 2; r++) {
        const __m256i low = _mm256_loadu_si256((const __m256i *)(run + 64 * (type % 2) + 32 * r));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(run + 128 + 32 * r));
        const __m256i bits = type == 0 ? _mm256_slli_epi16(high, 4) : type == 1 ? _mm256_slli_epi16(high, 2)
                             : type == 2 ? high : _mm256_srli_epi16(high, 2);
        v[r] = _mm256_or_si256(_mm256_and_si256(type < 2 ? low : _mm256_srli_epi16(low, 4), nibble),
                               _mm256_and_si256(bits, pair));
    }
}

/* Q4_K and Q5_K (`five`) super-blocks (b: the super-block; its sub-block s is the activations' block 8 b + s):
 * each sub-block a Q4_1 block (of 5-bit values in Q5_K) with the scale d times its 6-bit scale and the minimum
 * -dmin times its 6-bit minimum. */
static inline __attribute__((always_inline)) void x16_k(const uint8_t *blk, int five, const Activations *a,
                                                       int64_t row, int64_t b, int mt, __m256 acc[][2]) {
    for (int s = 0; s < 8; s++) {
        __m256i sums[X16_TILE][2];
        const int32_t *pairs[X16_TILE];
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            pairs[i] = (const int32_t *)(a->q + ((row + i) * a->blocks + 8 * b + s) * QK);
            sums[i][0] = sums[i][1] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 8; j++) {
            __m256i v[2];
            k_run(blk, five, s, j, v);
            x16_quad(low_bytes(v[0]), high_bytes(v[0]), low_bytes(v[1]), high_bytes(v[1]), pairs, j, mt, sums);
        }
        __m256 d[2], least[2];
        q4_k_sub_scales(blk, s, d, least);
        x16_epilogue(sums, d, least, 1, a, row, 8 * b + s, mt, acc);
    }
}

static inline __attribute__((always_inline)) void x16_q4_k(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t b, int mt, __m256 acc[][2]) {
    x16_k(blk, 0, a, row, b, mt, acc);
}

static inline __attribute__((always_inline)) void x16_q5_k(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t b, int mt, __m256 acc[][2]) {
    x16_k(blk, 1, a, row, b, mt, acc);
}

/* Q6_K super-blocks: `type` t of half h is the activations' block 8 b + 4 h + t, whose first and second 16 values
 * are two sub-blocks with their own scales; values are q - 32, the offset applied through the activations' sums
 * over each half block (`qhalf`). */
static inline __attribute__((always_inline)) void x16_q6_k(const uint8_t *blk, const Activations *a, int64_t row,
                                                          int64_t b, int mt, __m256 acc[][2]) {
    const __m256 none[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2; h++)
        for (int type = 0; type < 4; type++)
            for (int half = 0; half < 2; half++) {
                const int64_t c = 8 * b + 4 * h + type;
                __m256i sums[X16_TILE][2];
                const int32_t *pairs[X16_TILE];
#pragma GCC unroll 4
                for (int i = 0; i < mt; i++) {
                    const int64_t at = (row + i) * a->blocks + c;
                    pairs[i] = (const int32_t *)(a->q + at * QK);
                    sums[i][0] = sums[i][1] = _mm256_set1_epi32(-32 * a->qhalf[2 * at + half]);
                }
                for (int j = 4 * half; j < 4 * half + 4; j++) {
                    __m256i v[2];
                    q6_k_run(blk, h, type, j, v);
                    x16_quad(low_bytes(v[0]), high_bytes(v[0]), low_bytes(v[1]), high_bytes(v[1]), pairs, j, mt, sums);
                }
                __m256 d[2];
                q6_k_sub_scales(blk, 8 * h + 2 * type + half, d);
                x16_epilogue(sums, d, none, 0, a, row, c, mt, acc);
            }
}

/* A packed block expanded for the panel: pair p of its values is panel[2p + h] for half h (the activations'
 * pair p: quad p / 2, words (0, 2) or (1, 3)), with its rows' scales and minimums (Q4_1, Q4_K; others none) as
 * floats. Q4_0's values are q - 8 as words, Q6_K's q - 32. A K-quant super-block expands to 8 of them, one a
 * block of 32 activations; Q6_K's hold two sub-blocks of 16, with their own scales. */
typedef struct {
    __m256i words[QK];
    float d[X16] __attribute__((aligned(32)));
    float least[X16] __attribute__((aligned(32)));
    float d2[X16] __attribute__((aligned(32))); /* Q6_K: the second 16 values' scales (d: the first 16's) */
} PanelBlock;

static inline void panel_quad(PanelBlock *out, int quad, __m256i v0, __m256i v1, int is_signed) {
    out->words[4 * quad] = is_signed ? low_bytes_signed(v0) : low_bytes(v0);
    out->words[4 * quad + 1] = is_signed ? low_bytes_signed(v1) : low_bytes(v1);
    out->words[4 * quad + 2] = is_signed ? high_bytes_signed(v0) : high_bytes(v0);
    out->words[4 * quad + 3] = is_signed ? high_bytes_signed(v1) : high_bytes(v1);
}

static inline void panel_scales(PanelBlock *out, const uint8_t *blk, const uint8_t *least) {
    for (int h = 0; h < 2; h++) {
        _mm256_store_ps(out->d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h))));
        _mm256_store_ps(out->least + 8 * h,
                        least == NULL ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(least + 16 * h))));
    }
}

static inline void panel_q4(const uint8_t *blk, int has_min, PanelBlock *out) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const uint8_t *runs = blk + X16 * (has_min ? 4 : 2);
    for (int t = 0; t < 4; t++) {
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t));
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)(runs + 64 * t + 32));
        __m256i lo0 = _mm256_and_si256(r0, nibble), lo1 = _mm256_and_si256(r1, nibble);
        __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), nibble);
        __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), nibble);
        if (!has_min) {
            lo0 = _mm256_sub_epi8(lo0, eight);
            lo1 = _mm256_sub_epi8(lo1, eight);
            hi0 = _mm256_sub_epi8(hi0, eight);
            hi1 = _mm256_sub_epi8(hi1, eight);
        }
        panel_quad(out, t, lo0, lo1, !has_min);
        panel_quad(out, t + 4, hi0, hi1, !has_min);
    }
    panel_scales(out, blk, has_min ? blk + 2 * X16 : NULL);
}

static inline void panel_q4_0(const uint8_t *blk, PanelBlock *out) { panel_q4(blk, 0, out); }
static inline void panel_q4_1(const uint8_t *blk, PanelBlock *out) { panel_q4(blk, 1, out); }

static inline void panel_q8_0(const uint8_t *blk, PanelBlock *out) {
    for (int t = 0; t < 8; t++)
        panel_quad(out, t, _mm256_loadu_si256((const __m256i *)(blk + 2 * X16 + 64 * t)),
                   _mm256_loadu_si256((const __m256i *)(blk + 2 * X16 + 64 * t + 32)), 1);
    panel_scales(out, blk, NULL);
}

static inline void panel_k(const uint8_t *blk, int five, PanelBlock *out) {
    for (int s = 0; s < 8; s++) {
        for (int j = 0; j < 8; j++) {
            __m256i v[2];
            k_run(blk, five, s, j, v);
            panel_quad(out + s, j, v[0], v[1], 0);
        }
        __m256 d[2], least[2];
        q4_k_sub_scales(blk, s, d, least);
        for (int h = 0; h < 2; h++) {
            _mm256_store_ps(out[s].d + 8 * h, d[h]);
            _mm256_store_ps(out[s].least + 8 * h, least[h]);
        }
    }
}

static inline void panel_q4_k(const uint8_t *blk, PanelBlock *out) { panel_k(blk, 0, out); }
static inline void panel_q5_k(const uint8_t *blk, PanelBlock *out) { panel_k(blk, 1, out); }

static inline void panel_q6_k(const uint8_t *blk, PanelBlock *out) {
    const __m256i offset = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++)
        for (int type = 0; type < 4; type++) {
            PanelBlock *o = out + 4 * h + type;
            for (int j = 0; j < 8; j++) {
                __m256i v[2];
                q6_k_run(blk, h, type, j, v);
                panel_quad(o, j, _mm256_sub_epi8(v[0], offset), _mm256_sub_epi8(v[1], offset), 1);
            }
            __m256 d[2], d2[2];
            q6_k_sub_scales(blk, 8 * h + 2 * type, d);
            q6_k_sub_scales(blk, 8 * h + 2 * type + 1, d2);
            for (int r = 0; r < 2; r++) {
                _mm256_store_ps(o->d + 8 * r, d[r]);
                _mm256_store_ps(o->d2 + 8 * r, d2[r]);
                _mm256_store_ps(o->least + 8 * r, _mm256_setzero_ps());
            }
        }
}

/* sums[i][h] = the panel block's pairs p_begin .. p_end - 1 against activation row i's. */
static inline __attribute__((always_inline)) void panel_sums(const PanelBlock *blk, const int32_t *const *pairs,
                                                            int p_begin, int p_end, int mt, __m256i sums[][2]) {
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int p = p_begin; p < p_end; p++) {
        const __m256i w0 = _mm256_load_si256(blk->words + 2 * p), w1 = _mm256_load_si256(blk->words + 2 * p + 1);
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) {
            const __m256i xv = _mm256_set1_epi32(pairs[i][p]);
            sums[i][0] = _mm256_add_epi32(sums[i][0], _mm256_madd_epi16(w0, xv));
            sums[i][1] = _mm256_add_epi32(sums[i][1], _mm256_madd_epi16(w1, xv));
        }
    }
}

/* y[i * n + j] (+)= activation rows row.. row + mt - 1 against the panel's `count` blocks from block c; `split`
 * (Q6_K) scales each block's two halves on their own (d, then d2). */
static inline __attribute__((always_inline)) void panel_x16_tile(const PanelBlock *panel, int64_t count,
                                                                const Activations *a, int64_t row, int64_t c,
                                                                int mt, int first, float *y, int64_t n, int split) {
    __m256 acc[X16_TILE][2];
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < count; b++) {
        const PanelBlock *blk = panel + b;
        __m256i sums[X16_TILE][2];
        const int32_t *pairs[X16_TILE];
#pragma GCC unroll 4
        for (int i = 0; i < mt; i++) pairs[i] = (const int32_t *)(a->q + ((row + i) * a->blocks + c + b) * QK);
        const __m256 d[2] = {_mm256_load_ps(blk->d), _mm256_load_ps(blk->d + 8)};
        const __m256 least[2] = {_mm256_load_ps(blk->least), _mm256_load_ps(blk->least + 8)};
        if (split) {
            const __m256 d2[2] = {_mm256_load_ps(blk->d2), _mm256_load_ps(blk->d2 + 8)};
            panel_sums(blk, pairs, 0, QK / 4, mt, sums);
            x16_epilogue(sums, d, least, 0, a, row, c + b, mt, acc);
            panel_sums(blk, pairs, QK / 4, QK / 2, mt, sums);
            x16_epilogue(sums, d2, least, 0, a, row, c + b, mt, acc);
        } else {
            panel_sums(blk, pairs, 0, QK / 2, mt, sums);
            x16_epilogue(sums, d, least, 1, a, row, c + b, mt, acc);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mt; i++)
        for (int h = 0; h < 2; h++) {
            float *out = y + i * n + 8 * h;
            _mm256_storeu_ps(out, first ? acc[i][h] : _mm256_add_ps(_mm256_loadu_ps(out), acc[i][h]));
        }
}

/* y = x @ W.T for float32 x `[m, k]` and W packed by pack_x16 (n a multiple of X16; blocks of QB values, BYTES a
 * row's block), as gemm_vnni_* does it: each thread takes a share of the groups and goes through the activation
 * rows a chunk at a time; from X16_PANEL_ROWS rows on through panels, filled X16_KB blocks of 32 at a time (a
 * K-quant super-block fills 8). */
#define DEFINE_GEMM_X16(TYPE, BYTES, QB, SPLIT)                                                             \
    static void x16_##TYPE##_group(const uint8_t *group, int64_t blocks, const Activations *a, int64_t row,   \
                                   int mt, float *y, int64_t n) {                                            \
        __m256 acc[X16_TILE][2];                                                                             \
        for (int i = 0; i < X16_TILE; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                      \
        for (int64_t b = 0; b < blocks; b++) {                                                               \
            /* a constant row count at each call, so that the sums stay in registers */                     \
            const uint8_t *blk = group + b * X16 * (BYTES);                                                  \
            switch (mt) {                                                                                    \
            case 1: x16_##TYPE(blk, a, row, b, 1, acc); break;                                               \
            case 2: x16_##TYPE(blk, a, row, b, 2, acc); break;                                               \
            default: x16_##TYPE(blk, a, row, b, X16_TILE, acc);                                              \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < mt; i++) {                                                                       \
            _mm256_storeu_ps(y + i * n, acc[i][0]);                                                          \
            _mm256_storeu_ps(y + i * n + 8, acc[i][1]);                                                      \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    void gemm_x16_##TYPE(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {     \
        const int64_t blocks = k / (QB), group_bytes = blocks * X16 * (BYTES), per = (QB) / QK;              \
        const int64_t fill = X16_KB / per; /* blocks a panel holds */                                        \
        Activations a = quantize_activations_f32(x, m, k);                                                   \
        _Pragma("omp parallel")                                                                              \
        {                                                                                                    \
            const int64_t groups = n / X16, threads = omp_get_num_threads(), id = omp_get_thread_num();      \
            const int64_t first = groups * id / threads, last = groups * (id + 1) / threads;                 \
            PanelBlock panel[X16_KB];                                                                        \
            for (int64_t chunk = 0; chunk < m; chunk += X16_CHUNK) {                                         \
                const int64_t end = m < chunk + X16_CHUNK ? m : chunk + X16_CHUNK;                           \
                for (int64_t g = first; g < last; g++) {                                                     \
                    const uint8_t *group = w + g * group_bytes;                                              \
                    if (m < X16_PANEL_ROWS) {                                                                \
                        for (int64_t i = chunk; i < end; i += X16_TILE)                                      \
                            x16_##TYPE##_group(group, blocks, &a, i, end - i < X16_TILE ? (int)(end - i) : X16_TILE, \
                                               y + i * n + g * X16, n);                                      \
                        continue;                                                                            \
                    }                                                                                        \
                    for (int64_t c = 0; c < blocks; c += fill) {                                             \
                        const int64_t count = (blocks - c < fill ? blocks - c : fill) * per, at = c * per;    \
                        for (int64_t b = 0; b < count / per; b++)                                            \
                            panel_##TYPE(group + (c + b) * X16 * (BYTES), &panel[b * per]);                  \
                        float *out = y + g * X16;                                                            \
                        int64_t i = chunk;                                                                   \
                        for (; i + X16_TILE <= end; i += X16_TILE)                                           \
                            panel_x16_tile(panel, count, &a, i, at, X16_TILE, c == 0, out + i * n, n, SPLIT); \
                        switch (end - i) {                                                                   \
                        case 2: panel_x16_tile(panel, count, &a, i, at, 2, c == 0, out + i * n, n, SPLIT); break; \
                        case 1: panel_x16_tile(panel, count, &a, i, at, 1, c == 0, out + i * n, n, SPLIT); break; \
                        default: break;                                                                      \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        release(&a);                                                                                         \
    }

DEFINE_GEMM_X16(q4_0, 18, 32, 0)
DEFINE_GEMM_X16(q4_1, 20, 32, 0)
DEFINE_GEMM_X16(q8_0, 34, 32, 0)
DEFINE_GEMM_X16(q4_k, 144, 256, 0)
DEFINE_GEMM_X16(q5_k, 176, 256, 0)
DEFINE_GEMM_X16(q6_k, 210, 256, 1)

int has_x16_gemm(void) { return 1; }
#else
int has_x16_gemm(void) { return 0; }
#endif
