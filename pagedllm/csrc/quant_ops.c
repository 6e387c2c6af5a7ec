/*
 * Linear layers on GGUF's block-quantized weights, read as stored: Q4_0, Q4_1 and Q8_0 (blocks of 32
 * values along a row, each with an fp16 scale, and for Q4_1 an fp16 minimum).
 *
 * `gemm_*` serves few rows (decode): each weight block is read once per call, expanded to 32 floats in
 * registers and multiplied into up to TILE activation rows at once, so a decode step reads the packed
 * weights once instead of a dequantized copy four to eight times their size. Activations and sums stay in
 * float32: the result is the float32 product with the dequantized weight, up to summation order.
 *
 * `dequant_*` writes whole rows as float32 or bf16, for the many-row path (prefill, big batches), where
 * the caller multiplies them with torch's GEMM, and for embedding lookups.
 *
 * Built at first use by pagedllm.native and called through ctypes from pagedllm.models.quantized.
 */
#include <stdint.h>
#include <string.h>


#define QK 32
#define TILE 4

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

/* Block `b` of a row expanded to 32 floats: the values the GGUF block means. */
static inline void expand_q4_0(const uint8_t *block, float *out) {
    const float d = fp16_to_float(block);
    const uint8_t *qs = block + 2;
    /* Two loops, one per nibble, so each is one 16-lane vector operation. */
    for (int j = 0; j < QK / 2; j++) out[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
    for (int j = 0; j < QK / 2; j++) out[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
}

static inline void expand_q4_1(const uint8_t *block, float *out) {
    const float d = fp16_to_float(block), m = fp16_to_float(block + 2);
    const uint8_t *qs = block + 4;
    for (int j = 0; j < QK / 2; j++) out[j] = d * (float)(qs[j] & 0x0F) + m;
    for (int j = 0; j < QK / 2; j++) out[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
}

static inline void expand_q8_0(const uint8_t *block, float *out) {
    const float d = fp16_to_float(block);
    const int8_t *qs = (const int8_t *)(block + 2);
    for (int j = 0; j < QK; j++) out[j] = d * (float)qs[j];
}

/* y[i][r] = sum_k x[i][k] * w[r][k] for rows r of one weight row range, activation rows i0 .. i0 + mt;
 * `mt` is a constant at every call site, so each tile size gets its own unrolled copy. */
#define DEFINE_GEMM(TYPE, BYTES)                                                                          \
    static inline void tile_##TYPE(const float *x, int64_t k, const uint8_t *row, int64_t blocks,         \
                                   float *y, int64_t n, int mt) {                                          \
        float acc[TILE][QK];                                                                              \
        memset(acc, 0, sizeof acc);                                                                       \
        float w[QK];                                                                                      \
        for (int64_t b = 0; b < blocks; b++) {                                                            \
            expand_##TYPE(row + b * (BYTES), w);                                                          \
            for (int i = 0; i < mt; i++) {                                                                \
                const float *xb = x + i * k + b * QK;                                                     \
                _Pragma("omp simd")                                                                       \
                for (int j = 0; j < QK; j++) acc[i][j] += w[j] * xb[j];                                   \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < mt; i++) {                                                                    \
            float sum = 0.f;                                                                              \
            _Pragma("omp simd reduction(+ : sum)")                                                        \
            for (int j = 0; j < QK; j++) sum += acc[i][j];                                                \
            y[i * n] = sum;                                                                               \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    void gemm_##TYPE(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {       \
        const int64_t blocks = k / QK, row_bytes = blocks * (BYTES);                                      \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < n; r++) {                                                                 \
            const uint8_t *row = w + r * row_bytes;                                                       \
            int64_t i = 0;                                                                                \
            for (; i + TILE <= m; i += TILE) tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, TILE); \
            switch (m - i) {                                                                              \
            case 3: tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, 3); break;                   \
            case 2: tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, 2); break;                   \
            case 1: tile_##TYPE(x + i * k, k, row, blocks, y + i * n + r, n, 1); break;                   \
            default: break;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    void dequant_##TYPE##_f32(const uint8_t *w, int64_t rows, int64_t k, float *out) {                    \
        const int64_t blocks = k / QK;                                                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < rows; r++)                                                                \
            for (int64_t b = 0; b < blocks; b++)                                                          \
                expand_##TYPE(w + (r * blocks + b) * (BYTES), out + r * k + b * QK);                      \
    }                                                                                                     \
                                                                                                          \
    void dequant_##TYPE##_bf16(const uint8_t *w, int64_t rows, int64_t k, uint16_t *out) {                \
        const int64_t blocks = k / QK;                                                                    \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            float values[QK];                                                                             \
            for (int64_t b = 0; b < blocks; b++) {                                                        \
                expand_##TYPE(w + (r * blocks + b) * (BYTES), values);                                    \
                uint16_t *dst = out + r * k + b * QK;                                                     \
                _Pragma("omp simd")                                                                       \
                for (int j = 0; j < QK; j++) dst[j] = finite_to_bf16(values[j]);                           \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_GEMM(q4_0, 18)
DEFINE_GEMM(q4_1, 20)
DEFINE_GEMM(q8_0, 34)
