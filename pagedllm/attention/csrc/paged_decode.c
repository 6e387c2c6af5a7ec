/*
 * Paged attention for decode tokens on the CPU: one query token per sequence, K/V read in place
 * through the block table (no gather copy, no padding). One task per sequence: each key and value
 * token (all KV heads, contiguous in the block) is loaded once for all query heads. Scores and the softmax are
 * float32; the output is rounded back to the cache's dtype.
 *
 * Built at first use by pagedllm.attention.native with the system C compiler
 * (see FLAGS there) and called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* keep NaN a NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* exp for x <= 0 (scores minus their max), written so the compiler vectorizes it (glibc's expf is
 * not vectorized here): 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial for 2^f, f in [-0.5, 0.5];
 * relative error about 2e-7. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_roundf(t);
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary:
 * ask for the row a few positions ahead, whichever block it lives in. */
#define PREFETCH_AHEAD 4

static inline void prefetch_row(const void *row, int64_t num_bytes) {
    for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch((const char *)row + offset, 0, 1);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define MAX_HEAD_DIM 256
#define MAX_HEADS 128
#define MAX_TOKEN_WIDTH 4096 /* num_kv_heads * head_dim */

/* Scores of every head against one position: the key token (all KV heads, contiguous) is widened
 * to float once, then each head takes the dot product with its own KV head's slice. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, HD)                                                          \
    void NAME(const T *query, const T *k_cache, const T *v_cache, const int32_t *block_tables,         \
              int64_t table_stride, const int32_t *seq_lens, const int64_t *token_index, T *out,       \
              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_arg,         \
              int64_t block_size, float scale) {                                                       \
        const int64_t head_dim = HD ? HD : head_dim_arg; /* a constant lets the compiler unroll */   \
        const int64_t group = num_heads / num_kv_heads;                                                \
        const int64_t width = num_kv_heads * head_dim;                                                 \
        _Pragma("omp parallel")                                                                        \
        {                                                                                              \
            int64_t capacity = 0;                                                                      \
            float *scores = NULL;                                                                      \
            float q[MAX_HEADS * MAX_HEAD_DIM], acc[MAX_HEADS * MAX_HEAD_DIM], row[MAX_TOKEN_WIDTH];    \
            _Pragma("omp for schedule(dynamic, 1)")                                                    \
            for (int64_t seq = 0; seq < num_seqs; seq++) {                                             \
                const int64_t len = seq_lens[seq];                                                     \
                const int32_t *table = block_tables + seq * table_stride;                              \
                if (len * num_heads > capacity) {                                                      \
                    capacity = len * num_heads * 2;                                                    \
                    free(scores);                                                                      \
                    scores = (float *)malloc(sizeof(float) * capacity);                                \
                }                                                                                      \
                const T *q_row = query + token_index[seq] * num_heads * head_dim;                      \
                for (int64_t i = 0; i < num_heads * head_dim; i++) {                                   \
                    q[i] = LOAD(q_row[i]) * scale;                                                     \
                    acc[i] = 0.f;                                                                      \
                }                                                                                      \
                for (int64_t pos = 0; pos < len; pos++) {                                              \
                    const T *key = k_cache + ((int64_t)table[pos / block_size] * block_size +          \
                                              pos % block_size) * width;                               \
                    if (pos + PREFETCH_AHEAD < len) {                                                  \
                        const int64_t ahead = pos + PREFETCH_AHEAD;                                    \
                        prefetch_row(k_cache + ((int64_t)table[ahead / block_size] * block_size +      \
                                                ahead % block_size) * width, width * (int64_t)sizeof(T)); \
                    }                                                                                  \
                    _Pragma("omp simd")                                                                \
                    for (int64_t i = 0; i < width; i++) row[i] = LOAD(key[i]);                         \
                    for (int64_t h = 0; h < num_heads; h++) {                                          \
                        const float *kh = row + (h / group) * head_dim, *qh = q + h * head_dim;        \
                        float dot = 0.f;                                                               \
                        _Pragma("omp simd reduction(+ : dot)")                                         \
                        for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];                   \
                        scores[h * len + pos] = dot;                                                   \
                    }                                                                                  \
                }                                                                                      \
                for (int64_t h = 0; h < num_heads; h++) {                                              \
                    float *s = scores + h * len;                                                       \
                    float top = s[0], total = 0.f;                                                     \
                    _Pragma("omp simd reduction(max : top)")                                          \
                    for (int64_t pos = 1; pos < len; pos++) top = s[pos] > top ? s[pos] : top;         \
                    _Pragma("omp simd reduction(+ : total)")                                           \
                    for (int64_t pos = 0; pos < len; pos++) {                                          \
                        s[pos] = exp_nonpositive(s[pos] - top);                                                   \
                        total += s[pos];                                                               \
                    }                                                                                  \
                    const float inv = 1.f / total;                                                     \
                    _Pragma("omp simd")                                                                \
                    for (int64_t pos = 0; pos < len; pos++) s[pos] *= inv;                             \
                }                                                                                      \
                for (int64_t pos = 0; pos < len; pos++) {                                              \
                    const T *value = v_cache + ((int64_t)table[pos / block_size] * block_size +        \
                                                pos % block_size) * width;                             \
                    if (pos + PREFETCH_AHEAD < len) {                                                  \
                        const int64_t ahead = pos + PREFETCH_AHEAD;                                    \
                        prefetch_row(v_cache + ((int64_t)table[ahead / block_size] * block_size +      \
                                                ahead % block_size) * width, width * (int64_t)sizeof(T)); \
                    }                                                                                  \
                    _Pragma("omp simd")                                                                \
                    for (int64_t i = 0; i < width; i++) row[i] = LOAD(value[i]);                       \
                    for (int64_t h = 0; h < num_heads; h++) {                                          \
                        const float weight = scores[h * len + pos];                                    \
                        const float *vh = row + (h / group) * head_dim;                                \
                        float *ah = acc + h * head_dim;                                                \
                        _Pragma("omp simd")                                                            \
                        for (int64_t d = 0; d < head_dim; d++) ah[d] += weight * vh[d];                \
                    }                                                                                  \
                }                                                                                      \
                T *out_row = out + token_index[seq] * num_heads * head_dim;                            \
                for (int64_t i = 0; i < num_heads * head_dim; i++) out_row[i] = STORE(acc[i]);         \
            }                                                                                          \
            free(scores);                                                                              \
        }                                                                                              \
    }

/* Head dims 64 and 128 (most Llama models) get unrolled kernels; 0 means any head dim. */
DEFINE_DECODE(paged_decode_bf16_d64, uint16_t, bf16_to_float, float_to_bf16, 64)
DEFINE_DECODE(paged_decode_bf16_d128, uint16_t, bf16_to_float, float_to_bf16, 128)
DEFINE_DECODE(paged_decode_bf16_any, uint16_t, bf16_to_float, float_to_bf16, 0)
DEFINE_DECODE(paged_decode_f32_d64, float, f32_load, f32_store, 64)
DEFINE_DECODE(paged_decode_f32_d128, float, f32_load, f32_store, 128)
DEFINE_DECODE(paged_decode_f32_any, float, f32_load, f32_store, 0)
