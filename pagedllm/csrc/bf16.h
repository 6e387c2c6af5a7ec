/* bfloat16 <-> float for the C sources built by pagedllm.native (which puts this folder on the
 * include path and hashes it into every library's cache key). */
#ifndef PAGEDLLM_BF16_H
#define PAGEDLLM_BF16_H

#include <stdint.h>
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
    bits += 0x7fffu + ((bits >> 16) & 1u);                                            /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

#endif
