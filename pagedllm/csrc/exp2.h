/* A vectorizable exp2 for the C sources built by pagedllm.native: glibc's exp2f/expf are not
 * vectorized without -ffast-math, which the build must not use (it sets flush-to-zero process-wide). */
#ifndef PAGEDLLM_EXP2_H
#define PAGEDLLM_EXP2_H

#include <stdint.h>
#include <string.h>

#define LOG2E 1.44269504088896341f
/* exp2 of anything below this is 0 for our purposes; clamping there keeps 2^n a normal float and
 * -inf (masked scores, the first chunk's "previous maximum") away from inf - inf. */
#define EXP2_FLOOR -126.f

/* 2^x for x <= 0, written so that the compiler vectorizes it (glibc's exp2f is not vectorized here):
 * 2^n * 2^f with a degree-6 polynomial for 2^f, f in [-0.5, 0.5]; relative error about 2e-7. */
static inline float exp2_nonpositive(float x) {
    x = x < EXP2_FLOOR ? EXP2_FLOOR : x;
    const float n = __builtin_roundf(x);
    const float f = x - n;
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

#endif
