/*
 * The decoder layer's element-wise work, fused: RMSNorm (optionally after the residual add; Llama's
 * `w * x` or Gemma's `(1 + w) * x`), SiLU(gate) times up, and rotary embedding (alone, or with the
 * layer's K/V written into the paged cache in the same pass). Unfused, torch makes
 * 4-8 passes over each [tokens, hidden] tensor per op (float copies, pow, mean, mul, cast), which cost
 * about a sixth of a 2048-token prefill step on two cores. Every result is rounded to the tensor's
 * dtype exactly where the torch reference (transformers' Llama, Gemma) rounds, so bf16 outputs match
 * it bit for bit up to the float32 summation order of the norm and a 2e-7 relative error in exp.
 *
 * Built at first use by pagedllm.native and called through ctypes from pagedllm.models.fused.
 */
/* Whole 512-bit vectors where the CPU has them: gcc's -march=native picks 256-bit ones on Intel's AVX512
 * cores, and these loops are arithmetic-bound (SiLU's exp and divide, bf16 rounding), where 512 bits ran
 * 1.2-1.4x faster on the AMX kind (docs/PERFORMANCE.md). Elsewhere it changes nothing. */
#pragma GCC target("prefer-vector-width=512")
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp2.h"

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* exp for x <= 0; 0 below -87, where exp leaves the normal floats (exp2_nonpositive would clamp). */
static inline float exp_nonpositive(float x) { return x < -87.f ? 0.f : exp2_nonpositive(x * LOG2E); }

/* sigmoid through exp of a non-positive argument only, so it never overflows. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    const float sigmoid = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return x * sigmoid;
}

/* An int8 KV cache's row (pagedllm.attention.kv_quant) from `n` floats: q = round(x / s) in -127..127, s =
 * the row's absmax / 127 (its smallest normal where that is 0), then s as float32 in the row's last 4
 * bytes. kv_quant.quantize's arithmetic, so the rows are the Python path's bit for bit; for that its
 * divisions must stay divisions (the build's -freciprocal-math would multiply by a rounded reciprocal). */
#define QMAX 127.f
#define MAX_INT8_ROW 256 /* the widest head the attention kernels take (pagedllm.models.fused checks it) */
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math")
static void quantize_row(const float *x, int8_t *row, int64_t n) {
    float absmax = 0.f;
    for (int64_t i = 0; i < n; i++) absmax = fmaxf(absmax, fabsf(x[i]));
    const float scale = absmax / QMAX, divisor = scale < FLT_MIN ? FLT_MIN : scale;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float q = nearbyintf(x[i] / divisor);
        row[i] = (int8_t)(q > QMAX ? QMAX : q < -QMAX ? -QMAX : q);
    }
    memcpy(row + n, &scale, sizeof scale);
}
#pragma GCC pop_options

/* rope_write_kv for queries of type T and a cache of element type C, whose WRITE_HEAD writes one row's K/V
 * head at its slot (see DEFINE_FUSED). */
#define DEFINE_ROPE_WRITE_KV(NAME, SUFFIX, T, C, WRITE_HEAD)                                               \
    void NAME(const T *qkv, int64_t qkv_stride, const T *cos, const T *sin, T *q_out, C *k_cache, C *v_cache, \
              const int64_t *slots, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,          \
              int64_t block_size, int64_t block_stride, int64_t position_stride, int64_t head_stride) {       \
        _Pragma("omp parallel for schedule(static)")                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                                 \
            const T *row = qkv + r * qkv_stride, *c = cos + r * head_dim, *s = sin + r * head_dim;           \
            for (int64_t h = 0; h < heads; h++)                                                              \
                rope_head_##SUFFIX(row + h * head_dim, c, s, q_out + (r * heads + h) * head_dim, head_dim / 2); \
            if (slots[r] < 0)                                                                                \
                continue;                                                                                    \
            const T *k = row + heads * head_dim, *v = k + kv_heads * head_dim;                               \
            const int64_t slot = slots[r] / block_size * block_stride + slots[r] % block_size * position_stride; \
            for (int64_t h = 0; h < kv_heads; h++)                                                           \
                WRITE_HEAD(k + h * head_dim, v + h * head_dim, c, s, k_cache + slot + h * head_stride,       \
                           v_cache + slot + h * head_stride, head_dim);                                      \
        }                                                                                                    \
    }

#define DEFINE_FUSED(SUFFIX, T, LOAD, STORE)                                                             \
    /* out = weight * round(x * rsqrt(mean(x^2) + eps)); with `residual`, x = round(x + residual) is  \
     * computed first and written back to `residual` (the stream the next layer adds to). With        \
     * `offset` (Gemma): out = round(x * rsqrt(mean(x^2) + eps) * (1 + weight)), all in float32. */  \
    static inline void rms_norm_any_##SUFFIX(const T *x, T *residual, const T *weight, T *out,        \
                                             int64_t rows, int64_t dim, float eps, int offset) {      \
        _Pragma("omp parallel for schedule(static)")                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *src = x + r * dim;                                                               \
            T *dst = out + r * dim;                                                                   \
            T *res = residual ? residual + r * dim : NULL;                                            \
            float sum = 0.f;                                                                          \
            if (res) {                                                                                \
                _Pragma("omp simd reduction(+ : sum)")                                                \
                for (int64_t i = 0; i < dim; i++) {                                                   \
                    const float v = LOAD(STORE(LOAD(src[i]) + LOAD(res[i])));                         \
                    res[i] = STORE(v);                                                                \
                    sum += v * v;                                                                     \
                }                                                                                     \
                src = res;                                                                            \
            } else {                                                                                  \
                _Pragma("omp simd reduction(+ : sum)")                                                \
                for (int64_t i = 0; i < dim; i++) sum += LOAD(src[i]) * LOAD(src[i]);                 \
            }                                                                                         \
            const float inv = 1.f / sqrtf(sum / (float)dim + eps);                                    \
            if (offset) {                                                                             \
                _Pragma("omp simd")                                                                   \
                for (int64_t i = 0; i < dim; i++)                                                     \
                    dst[i] = STORE((LOAD(src[i]) * inv) * (1.f + LOAD(weight[i])));                   \
            } else {                                                                                  \
                _Pragma("omp simd")                                                                   \
                for (int64_t i = 0; i < dim; i++)                                                     \
                    dst[i] = STORE(LOAD(weight[i]) * LOAD(STORE(LOAD(src[i]) * inv)));                \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    void rms_norm_##SUFFIX(const T *x, T *residual, const T *weight, T *out, int64_t rows,          \
                           int64_t dim, float eps) {                                                  \
        rms_norm_any_##SUFFIX(x, residual, weight, out, rows, dim, eps, 0);                           \
    }                                                                                                 \
    void rms_norm_offset_##SUFFIX(const T *x, T *residual, const T *weight, T *out, int64_t rows,   \
                                  int64_t dim, float eps) {                                           \
        rms_norm_any_##SUFFIX(x, residual, weight, out, rows, dim, eps, 1);                           \
    }                                                                                                 \
                                                                                                      \
    /* y [rows, dim] = round(y + bias), in place (a projection's bias, as torch adds it). */          \
    void add_bias_##SUFFIX(T *y, const T *bias, int64_t rows, int64_t dim) {                          \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            T *row = y + r * dim;                                                                     \
            _Pragma("omp simd")                                                                       \
            for (int64_t i = 0; i < dim; i++) row[i] = STORE(LOAD(row[i]) + LOAD(bias[i]));           \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    /* gate_up [rows, 2 * dim] -> out [rows, dim] = round(round(silu(gate)) * up). */                 \
    void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t dim) {                     \
        _Pragma("omp parallel for schedule(static)")                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *gate = gate_up + r * 2 * dim, *up = gate + dim;                                  \
            T *dst = out + r * dim;                                                                   \
            _Pragma("omp simd")                                                                       \
            for (int64_t i = 0; i < dim; i++) dst[i] = STORE(LOAD(STORE(silu(LOAD(gate[i])))) * LOAD(up[i])); \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    /* One head: y = round(round(x * cos) + round(rotate_half(x) * sin)), cos/sin [head_dim]. */     \
    static inline void rope_head_##SUFFIX(const T *x, const T *c, const T *s, T *y, int64_t half) {   \
        _Pragma("omp simd")                                                                           \
        for (int64_t i = 0; i < half; i++) {                                                          \
            const float lo = LOAD(x[i]), hi = LOAD(x[i + half]);                                      \
            y[i] = STORE(LOAD(STORE(lo * LOAD(c[i]))) + LOAD(STORE(-hi * LOAD(s[i]))));                \
            y[i + half] = STORE(LOAD(STORE(hi * LOAD(c[i + half]))) + LOAD(STORE(lo * LOAD(s[i + half])))); \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    /* Rotary embedding of `heads` heads of `head_dim` starting at column `col` of each row of `src`  \
     * (row stride `src_stride`), into the contiguous `out` [rows, heads, head_dim]; cos/sin are     \
     * [rows, head_dim]. */                                                                           \
    void rope_##SUFFIX(const T *src, int64_t src_stride, int64_t col, const T *cos, const T *sin,     \
                       T *out, int64_t rows, int64_t heads, int64_t head_dim) {                       \
        _Pragma("omp parallel for schedule(static)")                                                  \
        for (int64_t r = 0; r < rows; r++)                                                            \
            for (int64_t h = 0; h < heads; h++)                                                       \
                rope_head_##SUFFIX(src + r * src_stride + col + h * head_dim, cos + r * head_dim,     \
                                   sin + r * head_dim, out + (r * heads + h) * head_dim, head_dim / 2); \
    }                                                                                                 \
                                                                                                      \
    /* One row's K/V head at its slot: the key rotated into the K cache, the value copied. */         \
    static inline void write_head_##SUFFIX(const T *k, const T *v, const T *c, const T *s, T *k_dst,  \
                                           T *v_dst, int64_t head_dim) {                              \
        rope_head_##SUFFIX(k, c, s, k_dst, head_dim / 2);                                             \
        memcpy(v_dst, v, sizeof(T) * head_dim);                                                       \
    }                                                                                                 \
                                                                                                      \
    /* The same into an int8 cache's rows (values and scale): the key rotated and rounded to T, then  \
     * quantized as kv_quant.quantize quantizes it; the value quantized as it is. */                  \
    static inline void write_head_int8_##SUFFIX(const T *k, const T *v, const T *c, const T *s,       \
                                                int8_t *k_dst, int8_t *v_dst, int64_t head_dim) {     \
        T rotated[MAX_INT8_ROW];                                                                      \
        float wide[MAX_INT8_ROW];                                                                     \
        rope_head_##SUFFIX(k, c, s, rotated, head_dim / 2);                                           \
        for (int64_t i = 0; i < head_dim; i++) wide[i] = LOAD(rotated[i]);                            \
        quantize_row(wide, k_dst, head_dim);                                                          \
        for (int64_t i = 0; i < head_dim; i++) wide[i] = LOAD(v[i]);                                  \
        quantize_row(wide, v_dst, head_dim);                                                          \
    }                                                                                                 \
                                                                                                      \
    /* An attention layer's whole rotary pass and K/V write from its fused projection `qkv` [rows,    \
     * (heads + 2 kv_heads) head_dim] (row stride `qkv_stride`): the query heads rotated into `q_out`  \
     * [rows, heads, head_dim], the key heads rotated straight into the K cache at each row's slot and \
     * the value heads copied into the V cache there (caches [blocks, block_size, kv_heads, head_dim] \
     * with strides `block_stride`, `position_stride`, `head_stride` in elements, K and V alike, rows  \
     * contiguous); a negative slot is padding and is not written. One pass instead of rope, rope and  \
     * two scatters. rope_write_kv_int8 writes an int8 cache so (strides in bytes). */                \
    DEFINE_ROPE_WRITE_KV(rope_write_kv_##SUFFIX, SUFFIX, T, T, write_head_##SUFFIX)                  \
    DEFINE_ROPE_WRITE_KV(rope_write_kv_int8_##SUFFIX, SUFFIX, T, int8_t, write_head_int8_##SUFFIX)

DEFINE_FUSED(bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_FUSED(f32, float, f32_load, f32_store)
