/*
 * Paged attention on the CPU for every sequence of a step at once: decode tokens (one query each) and
 * prefill chunks (several queries, causal, maybe after cached tokens), K/V read in place through the
 * block table (this step's K/V are already in the cache). Query token j of a sequence with q_len
 * queries and seq_len positions sits at position seq_len - q_len + j and sees positions 0..that one.
 *
 * The work is split into items. An item walks its context once, 16 positions (a "chunk") at a time,
 * with an online softmax: no scores buffer and no second pass over V. Each chunk of K and V is loaded
 * once for all the item's query rows (its tokens x the query heads of a KV head).
 *  - A decode token is one item with all its KV heads, so it reads each block whole and in order: the
 *    engine stores a block head-major (cache_engine), each KV head's rows one contiguous run.
 *    (When a step makes fewer than two items per thread, its decode tokens are split by KV head.)
 *  - A prefill chunk is cut into tiles of about ITEM_ROWS query rows of one KV head, so a chunk of K/V
 *    is reused from L1 by many rows, like a GEMM micro-kernel, and a long prompt makes many items.
 * Items are sorted by cost and handed out dynamically so that two threads balance mixed lengths.
 *
 * Two implementations of an item share this plan:
 *  - AVX512-BF16 (bf16 caches, head dims that are multiples of 32): vdpbf16ps multiplies bf16 pairs
 *    and accumulates in float32, so Q.K is exact up to float32 accumulation; probabilities are rounded
 *    to bf16 for P.V (as torch's own CPU flash attention does). See the section for the data layouts.
 *  - portable C, for float32 and for machines without AVX512-BF16: the same online softmax on floats.
 *    It also reads int8 caches (pagedllm.attention.kv_quant): each (position, KV head) row is head_dim
 *    int8 values followed by their float32 scale, dequantized into the chunk's float rows (on AVX2, in
 *    registers where they lie: int8_tile_chunk), with float32 or bf16 queries.
 * Both are compiled wherever the compiler can, so the tests run both on an AVX512-BF16 machine.
 *
 * Two per-layer options, as Hugging Face computes them (Mistral and Gemma sliding windows, Gemma 2's
 * logit soft-capping):
 *  - `window` W > 0: the query at position p sees positions p - W < j <= p only. An item's walk starts
 *    at the block holding its earliest row's window start (so O(W) for a decode token, and a block
 *    table entry before that block, which the engine may have freed and set to -1, is never read);
 *    each row masks the positions of its first chunks below its own window start.
 *  - `softcap` c > 0: the scaled logit s becomes c * tanh(s / c) before the mask and the softmax.
 * Each item is compiled three times, the mode a constant: PLAIN (neither option: the code of before they
 * existed, its hot loop free of their branches), WINDOWED (a window, no soft-capping) and CAPPED
 * (soft-capping, with or without a window).
 *
 * Built at first use by pagedllm.native (-O3 -march=native, the safe parts of fast-math) and called
 * through ctypes from pagedllm.attention.cpu.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp2.h"

#define CHUNK 16
/* An item's mode (see the top). */
#define PLAIN 0
#define WINDOWED 1
#define CAPPED 2
#define MAX_HEAD_DIM 256
/* A prefill item holds about this many query rows: enough to amortize loading (and, on the AVX512
 * path, transposing) a chunk of K/V, small enough that a long prompt still makes many items. */
#define ITEM_ROWS 48
#define MAX_ITEM_ROWS 64 /* ITEM_ROWS rounded up to whole tokens, or one token's KV heads' query heads */
/* A step left with fewer than 2 items a thread after splitting its decode items by KV head (a single decode
 * sequence: its 3 KV heads left a thread idle a third of the step on 2 threads) splits its decode items along
 * their context into parts of at least MIN_PART_CHUNKS chunks, about PARTS_PER_THREAD a thread, each walked by any
 * thread; the parts' softmax states are merged afterwards. */
#define PARTS_PER_THREAD 4
#define MIN_PART_CHUNKS 8

/* Query tokens [token_begin, token_end) of sequence `seq` against KV heads [kv_begin, kv_end), over chunks
 * [chunk_begin, chunk_end) of its walk. A part of a split item writes its rows' softmax state (maximum, sum,
 * output not yet divided) to `state` instead of its output. */
typedef struct {
    int32_t seq, token_begin, token_end, kv_begin, kv_end, chunk_begin, chunk_end;
    int64_t cost;
    float *state;
} Item;

/* Everything an item needs to know about the batch, passed around as one pointer. */
typedef struct {
    const void *query, *k_cache, *v_cache;
    void *out;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    int64_t table_stride, num_heads, num_kv_heads, head_dim, block_size;
    /* Cache strides in elements: of a block, a position inside it, a KV head. A row of head_dim (+ 4 bytes of
     * scale in an int8 cache) elements is contiguous; the engine stores each KV head's rows of a block
     * together (head_stride = block_size x position_stride), tests also the token-major order. */
    int64_t block_stride, position_stride, head_stride;
    float scale_log2e; /* softmax in base 2: exp(x * scale) = exp2(x * scale * log2 e) */
    int64_t window;        /* 0: no sliding window */
    float cap_in, cap_out; /* soft-capping (mode CAPPED): logit (base 2) = tanh(dot * cap_in) * cap_out */
} Batch;

/* ---------------------------------------------------------------------------------------------- */
/* Work items                                                                                      */

static int by_cost_descending(const void *a, const void *b) {
    const int64_t x = ((const Item *)a)->cost, y = ((const Item *)b)->cost;
    return (x < y) - (x > y);
}

static inline int64_t q_len_of(const Batch *b, int64_t seq) {
    return b->query_start_loc[seq + 1] - b->query_start_loc[seq];
}

/* The first position a query at `position` sees: its window start, or 0 without a window. */
static inline int64_t window_start(const Batch *b, int64_t position) {
    const int64_t start = position - b->window + 1;
    return b->window > 0 && start > 0 ? start : 0;
}

/* Where the walk of a sequence's query rows from `position` on starts: the window start of the
 * earliest of them, rounded down to its block. Every block-table entry read from there on is live. */
static inline int64_t walk_start(const Batch *b, int64_t position) {
    const int64_t start = window_start(b, position);
    return start - start % b->block_size;
}

/* The chunks an item walks from position `start` (0, or its walk_start). */
static inline int64_t item_chunks(const Batch *b, const Item *it, int64_t start) {
    return (b->seq_lens[it->seq] - q_len_of(b, it->seq) + it->token_end - 1 - start) / CHUNK + 1;
}

static int64_t count_items(const Batch *b, int64_t num_seqs, int64_t tile, int64_t kv_per_decode_item) {
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = q_len_of(b, s);
        count += q_len == 1 ? (b->num_kv_heads + kv_per_decode_item - 1) / kv_per_decode_item
                            : (q_len + tile - 1) / tile * b->num_kv_heads;
    }
    return count;
}

/* Items of every sequence, each over its whole walk. A step of a few decode tokens alone splits them by KV
 * head, so that every thread has work. */
static Item *build_items(const Batch *b, int64_t num_seqs, int64_t *num_items) {
    const int64_t group = b->num_heads / b->num_kv_heads;
    const int64_t tile = group >= ITEM_ROWS ? 1 : ITEM_ROWS / group;
    int64_t kv_per_decode_item = MAX_ITEM_ROWS / group;
    kv_per_decode_item = kv_per_decode_item < b->num_kv_heads ? kv_per_decode_item : b->num_kv_heads;
    int64_t count = count_items(b, num_seqs, tile, kv_per_decode_item);
    if (count < 2 * omp_get_max_threads()) {
        kv_per_decode_item = 1;
        count = count_items(b, num_seqs, tile, kv_per_decode_item);
    }
    Item *items = (Item *)malloc(sizeof(Item) * (count ? count : 1));
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = q_len_of(b, s), kv_step = q_len == 1 ? kv_per_decode_item : 1;
        for (int64_t t = 0; t < q_len; t += tile) {
            const int64_t end = t + tile < q_len ? t + tile : q_len;
            for (int64_t h = 0; h < b->num_kv_heads; h += kv_step) {
                const int64_t kv_end = h + kv_step < b->num_kv_heads ? h + kv_step : b->num_kv_heads;
                Item it = {(int32_t)s, (int32_t)t, (int32_t)end, (int32_t)h, (int32_t)kv_end, 0, 0, 0, NULL};
                it.chunk_end = (int32_t)item_chunks(b, &it, walk_start(b, b->seq_lens[s] - q_len + t));
                it.cost = (end - t) * (kv_end - h) * it.chunk_end;
                items[n++] = it;
            }
        }
    }
    *num_items = n;
    return items;
}

/* A decode item split into `parts` parts, whose states lie at `states`, one every state_stride floats. */
typedef struct {
    Item whole;
    int64_t parts;
    float *states;
} Split;

/* The rows' softmax state a part leaves: maximum and sum (base 2), then the output not yet divided. */
static inline int64_t state_stride(const Batch *b) { return MAX_ITEM_ROWS * (b->head_dim + 2); }

/* How many parts split_items makes of `it`: a decode item's chunks in parts of at least MIN_PART_CHUNKS chunks and
 * whole `unit`s (a part starts at a block boundary, where a cursor can start), at most `most`. */
static inline int64_t parts_of(const Item *it, int64_t unit, int64_t most) {
    if (it->token_end - it->token_begin != 1) return 1;
    const int64_t fit = it->chunk_end / (MIN_PART_CHUNKS > unit ? MIN_PART_CHUNKS : unit);
    return fit < 1 ? 1 : fit < most ? fit : most;
}

/* Splits the decode items of a step with few items (see PARTS_PER_THREAD) into parts over their context; returns the
 * items to run (the others as they were) and sets `splits` to the split ones, their parts' states allocated in
 * `*states` (all NULL when nothing was split). */
static Item *split_items(const Batch *b, Item *items, int64_t *num_items, Split **splits, int64_t *num_splits,
                         float **states) {
    const int64_t threads = omp_get_max_threads(), wanted = PARTS_PER_THREAD * threads, n = *num_items;
    *splits = NULL, *num_splits = 0, *states = NULL;
    if (n >= 2 * threads) return items;
    int64_t unit = 1;
    while (unit * CHUNK % b->block_size != 0) unit++;
    const int64_t most = (wanted + n - 1) / n;
    int64_t total = 0, split = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t parts = parts_of(&items[i], unit, most);
        total += parts;
        split += parts > 1;
    }
    if (split == 0) return items;
    Item *out = (Item *)malloc(sizeof(Item) * total);
    *splits = (Split *)malloc(sizeof(Split) * split);
    *states = (float *)malloc(sizeof(float) * (total - (n - split)) * state_stride(b));
    int64_t at = 0, slot = 0;
    for (int64_t i = 0; i < n; i++) {
        const Item it = items[i];
        const int64_t parts = parts_of(&it, unit, most), units = (it.chunk_end + unit - 1) / unit;
        if (parts == 1) {
            out[at++] = it;
            continue;
        }
        (*splits)[(*num_splits)++] = (Split){it, parts, *states + slot * state_stride(b)};
        for (int64_t p = 0; p < parts; p++) {
            Item part = it;
            part.chunk_begin = (int32_t)(units * p / parts * unit);
            const int64_t end = units * (p + 1) / parts * unit;
            part.chunk_end = (int32_t)(end < it.chunk_end ? end : it.chunk_end);
            part.cost = (int64_t)(part.chunk_end - part.chunk_begin) * (it.kv_end - it.kv_begin);
            part.state = *states + (slot++) * state_stride(b);
            out[at++] = part;
        }
    }
    free(items);
    *num_items = at;
    return out;
}

/* Walks an item's context through its block table, CHUNK positions at a time, without a division per
 * position (block sizes need not be powers of two). */
typedef struct {
    const int32_t *table;
    int64_t position, len, block, offset, block_size, block_stride, position_stride;
} Cursor;

/* From position `start`, a multiple of the block size. */
static inline Cursor cursor_start(const Batch *b, const Item *it, int64_t start) {
    return (Cursor){b->block_tables + it->seq * b->table_stride, start, b->seq_lens[it->seq], start / b->block_size,
                    0, b->block_size, b->block_stride, b->position_stride};
}

/* The offsets (in elements) of the next CHUNK positions' rows (KV head 0), or -1 past the end. */
static inline __attribute__((always_inline)) void cursor_next(Cursor *c, int64_t rows[CHUNK]) {
    for (int p = 0; p < CHUNK; p++) {
        rows[p] = c->position < c->len ? c->table[c->block] * c->block_stride + c->offset * c->position_stride : -1;
        c->position++;
        if (++c->offset == c->block_size) {
            c->offset = 0;
            c->block++;
        }
    }
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary. In the
 * engine's head-major caches one KV head's rows of a block are one contiguous run (4 KB for the default
 * model), which the prefetcher streams once it has seen its start: while one KV head of a chunk is
 * computed, ask for the first row of the same KV head's rows in the next two chunks, into L2 (locality 1).
 * Asking for whole runs instead was 4-10% slower on a cold 111 x 290 decode on two threads (AVX2 kind),
 * asking for none 2-4% slower (docs/PERFORMANCE.md, "Decode attention"). An int8
 * cache's runs are a quarter as long (1 KB), too short for the prefetcher to get going: those are asked for
 * whole (cold int8 decode 14% faster on the AVX2 kind). */
static inline void prefetch_first_row(const Batch *b, const int64_t rows[CHUNK], int64_t kv_offset,
                                      int64_t element_size) {
    if (rows[0] < 0) return;
    const char *k = (const char *)b->k_cache + (rows[0] + kv_offset) * element_size;
    const char *v = (const char *)b->v_cache + (rows[0] + kv_offset) * element_size;
    const int64_t bytes = element_size == 1 ? b->block_size * b->position_stride : b->head_dim * element_size;
    for (int64_t offset = 0; offset < bytes; offset += 64) {
        __builtin_prefetch(k + offset, 0, 1);
        __builtin_prefetch(v + offset, 0, 1);
    }
}

/* An item's query rows, KV head by KV head, each KV head's rows token-major (so in position order):
 * row r is KV head kv_begin + r / rows_per_kv, token token_begin + (r % rows_per_kv) / group, and the
 * KV head's (r % group)-th query head. */
static inline int64_t rows_per_kv_head(const Batch *b, const Item *it) {
    return (int64_t)(it->token_end - it->token_begin) * (b->num_heads / b->num_kv_heads);
}

static inline int64_t item_rows(const Batch *b, const Item *it) {
    return rows_per_kv_head(b, it) * (it->kv_end - it->kv_begin);
}

static inline int64_t query_row_offset(const Batch *b, const Item *it, int64_t r) {
    const int64_t group = b->num_heads / b->num_kv_heads, per_kv = rows_per_kv_head(b, it);
    const int64_t token = b->query_start_loc[it->seq] + it->token_begin + r % per_kv / group;
    const int64_t head = (it->kv_begin + r / per_kv) * group + r % group;
    return (token * b->num_heads + head) * b->head_dim;
}

/* The position of query row r: it sees positions 0..this one. */
static inline __attribute__((always_inline)) int64_t query_row_position(const Batch *b, const Item *it, int64_t r) {
    const int64_t group = b->num_heads / b->num_kv_heads;
    return b->seq_lens[it->seq] - q_len_of(b, it->seq) + it->token_begin + r % rows_per_kv_head(b, it) / group;
}

/* Attends one item: its output rows, or a part's state. */
typedef void (*ItemFn)(const Batch *b, const Item *it);

/* Writes a split item's output from its parts' states. */
typedef void (*MergeFn)(const Batch *b, const Split *split);

/* Runs `attend_item` on every item, two threads (or OMP_NUM_THREADS) pulling from the list sorted heaviest
 * first, so that dynamic scheduling finishes with the small ones; where `merge` is given, a step with few items
 * first splits its decode items (split_items) and merges their parts after. */
static void run_items(const Batch *b, int64_t num_seqs, ItemFn attend_item, MergeFn merge) {
    int64_t num_items, num_splits = 0;
    Item *items = build_items(b, num_seqs, &num_items);
    Split *splits = NULL;
    float *states = NULL;
    if (merge != NULL) items = split_items(b, items, &num_items, &splits, &num_splits, &states);
    qsort(items, num_items, sizeof(Item), by_cost_descending);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++) attend_item(b, &items[i]);
#pragma omp parallel for schedule(dynamic, 1) if (num_splits > 1)
    for (int64_t i = 0; i < num_splits; i++) merge(b, &splits[i]);
    free(items);
    free(splits);
    free(states);
}

/* ---------------------------------------------------------------------------------------------- */
/* Portable C: float32, and bf16 where AVX512-BF16 is missing                                       */

/* tanh for soft-capping, from the vectorizable exp2: below |x| = 0.5 its odd Taylor series to x^13 (the
 * first term left out is under 1e-7 of tanh there), above (1 - e) / (1 + e) with e = exp(-2|x|) <= 1/e,
 * so that neither side cancels much; relative error about 2e-7 (tests/test_attention.py checks it). */
#define TANH_SERIES_LIMIT 0.5f
#define TANH_C3 (-1.f / 3.f)
#define TANH_C5 (2.f / 15.f)
#define TANH_C7 (-17.f / 315.f)
#define TANH_C9 (62.f / 2835.f)
#define TANH_C11 (-1382.f / 155925.f)
#define TANH_C13 (21844.f / 6081075.f)

static inline float tanh_f32(float x) {
    const float a = fabsf(x);
    if (a < TANH_SERIES_LIMIT) {
        const float x2 = x * x;
        float p = TANH_C13;
        p = p * x2 + TANH_C11;
        p = p * x2 + TANH_C9;
        p = p * x2 + TANH_C7;
        p = p * x2 + TANH_C5;
        p = p * x2 + TANH_C3;
        return x + x * x2 * p;
    }
    const float e = exp2_nonpositive(-2.f * LOG2E * a);
    return copysignf((1.f - e) / (1.f + e), x);
}

/* For the tests: tanh_f32 over `n` floats. */
void paged_attention_tanh(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = tanh_f32(x[i]);
}

/* The online-softmax update of one row by a chunk's `n` scores `s` (base 2, largest `top`): the row's running
 * maximum `m`, sum `l` and output `o` rescaled to a new maximum, and the chunk's weights written to `w`. */
static inline __attribute__((always_inline)) void row_softmax_update(const float *s, float top, int64_t n,
                                                                     int64_t head_dim, float *restrict m,
                                                                     float *restrict l, float *restrict o,
                                                                     float *restrict w) {
    if (top > *m) {
        const float alpha = exp2_nonpositive(*m - top);
        *l *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] *= alpha;
        *m = top;
    }
    const float shift = *m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < n; p++) {
        w[p] = exp2_nonpositive(s[p] - shift);
        total += w[p];
    }
    *l += total;
}

/* One chunk for one query row: scores of its `n` visible positions (key and value rows `stride` floats
 * apart), soft-capped if `capped`, then the online-softmax update of the row's running maximum `m`, sum
 * `l` and output `o`. */
static inline __attribute__((always_inline)) void portable_row_chunk(const float *restrict q, const float *keys,
                                                                     const float *values, int64_t stride, int64_t n,
                                                                     int64_t head_dim, float scale_log2e, int capped,
                                                                     float cap_in, float cap_out,
                                                                     float *restrict m, float *restrict l,
                                                                     float *restrict o) {
    float s[CHUNK], w[CHUNK], top = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        const float *k = keys + p * stride;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; d++) dot += q[d] * k[d];
        s[p] = capped ? tanh_f32(dot * cap_in) * cap_out : dot * scale_log2e;
        top = s[p] > top ? s[p] : top;
    }
    row_softmax_update(s, top, n, head_dim, m, l, o, w);
    for (int64_t p = 0; p < n; p++) {
        const float *v = values + p * stride;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] += w[p] * v[d];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* [k0.q, k1.q, k2.q, k3.q] for four key rows `stride` floats apart: four independent accumulator chains over
 * the head dim, summed across lanes in one hadd tree. */
static inline __attribute__((always_inline)) __m128 dots4(const float *q, const float *k, int64_t stride,
                                                          int64_t head_dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + stride + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * stride + d), a3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

static inline __attribute__((always_inline)) float dot1(const float *q, const float *k, int64_t head_dim) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}

/* portable_row_chunk without soft-capping, head_dim a multiple of 64, written for AVX2: the portable loops
 * sum each position's dot horizontally on its own and keep the output row in memory across positions (a
 * load and a store of it per position); here four positions' dots share one reduction and P.V keeps 64
 * output dims in eight registers over the whole chunk. The same arithmetic up to summation order. */
static inline __attribute__((always_inline)) void avx2_row_chunk(const float *restrict q, const float *keys,
                                                                 const float *values, int64_t stride, int64_t n,
                                                                 int64_t head_dim, float scale_log2e,
                                                                 float *restrict m, float *restrict l,
                                                                 float *restrict o) {
    float s[CHUNK], w[CHUNK], top = -INFINITY;
    int64_t p = 0;
    for (; p + 4 <= n; p += 4)
        _mm_storeu_ps(s + p, _mm_mul_ps(dots4(q, keys + p * stride, stride, head_dim), _mm_set1_ps(scale_log2e)));
    for (; p < n; p++) s[p] = dot1(q, keys + p * stride, head_dim) * scale_log2e;
    for (p = 0; p < n; p++) top = s[p] > top ? s[p] : top;
    row_softmax_update(s, top, n, head_dim, m, l, o, w);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(o + d0 + 8 * j);
        for (p = 0; p < n; p++) {
            const __m256 wv = _mm256_set1_ps(w[p]);
            const float *v = values + p * stride + d0;
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
    }
}
#endif

/* One chunk for one query row (see portable_row_chunk), on AVX2 where it applies. */
static inline __attribute__((always_inline)) void row_chunk(const float *restrict q, const float *keys,
                                                            const float *values, int64_t stride, int64_t n,
                                                            int64_t head_dim, float scale_log2e, int capped,
                                                            float cap_in, float cap_out, float *restrict m,
                                                            float *restrict l, float *restrict o) {
#if defined(__AVX2__) && defined(__FMA__)
    if (!capped && head_dim % 64 == 0) {
        avx2_row_chunk(q, keys, values, stride, n, head_dim, scale_log2e, m, l, o);
        return;
    }
#endif
    portable_row_chunk(q, keys, values, stride, n, head_dim, scale_log2e, capped, cap_in, cap_out, m, l, o);
}

/* An int8 cache's rows read where they lie, for up to INT8_TILE query rows of one KV head that see the same
 * positions (the query heads of one token), on AVX2 without soft-capping, head dims a multiple of 64. Each key
 * and value row is widened (and scaled) once in registers for all of them, where the general path copies a
 * chunk's rows into float rows first and reads them back once per query row: a decode step's int8 attention
 * is bound by that arithmetic, not by its reads (a quarter of float32's bytes). The values, the products and
 * the order of every sum are avx2_row_chunk's on those float rows, so the result is the same bit for bit: an
 * int8 cache rounds every later layer's K/V, which turns any last-bit difference into a different draw of
 * its noise (docs/PERFORMANCE.md). */
#define INT8_TILE 3
#if defined(__AVX2__) && defined(__FMA__)
/* 8 int8 values at p times their row's scale, as load_int8_row widens them. */
static inline __m256 int8x8(const int8_t *p, __m256 scale) {
    return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}

static inline float int8_row_scale(const int8_t *row, int64_t head_dim) {
    float scale;
    memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

static inline __m128 hsum4(const __m256 a[4]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

static inline __attribute__((always_inline)) void int8_tile_chunk(const float *restrict q, const int nr,
                                                                  const int8_t *keys, const int8_t *values,
                                                                  int64_t stride, int64_t n, int64_t head_dim,
                                                                  float scale_log2e, float *restrict m,
                                                                  float *restrict l, float *restrict o) {
    float s[INT8_TILE][CHUNK], w[INT8_TILE][CHUNK], key_scale[CHUNK], value_scale[CHUNK];
    for (int64_t p = 0; p < n; p++) {
        key_scale[p] = int8_row_scale(keys + p * stride, head_dim);
        value_scale[p] = int8_row_scale(values + p * stride, head_dim);
    }
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {
        __m256 a[INT8_TILE][4];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 k[4];
            for (int j = 0; j < 4; j++) k[j] = int8x8(keys + (p + j) * stride + d, _mm256_set1_ps(key_scale[p + j]));
            for (int r = 0; r < nr; r++) {
                const __m256 qv = _mm256_loadu_ps(q + r * head_dim + d);
                for (int j = 0; j < 4; j++) a[r][j] = _mm256_fmadd_ps(qv, k[j], a[r][j]);
            }
        }
        for (int r = 0; r < nr; r++) _mm_storeu_ps(s[r] + p, _mm_mul_ps(hsum4(a[r]), _mm_set1_ps(scale_log2e)));
    }
    for (; p < n; p++) {
        __m256 a[INT8_TILE];
        for (int r = 0; r < nr; r++) a[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 k = int8x8(keys + p * stride + d, _mm256_set1_ps(key_scale[p]));
            for (int r = 0; r < nr; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * head_dim + d), k, a[r]);
        }
        for (int r = 0; r < nr; r++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[r]), _mm256_extractf128_ps(a[r], 1));
            h = _mm_hadd_ps(h, h);
            s[r][p] = _mm_cvtss_f32(_mm_hadd_ps(h, h)) * scale_log2e;
        }
    }
    for (int r = 0; r < nr; r++) {
        float top = -INFINITY;
        for (p = 0; p < n; p++) top = s[r][p] > top ? s[r][p] : top;
        row_softmax_update(s[r], top, n, head_dim, &m[r], &l[r], o + r * head_dim, w[r]);
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        __m256 acc[INT8_TILE][4];
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_loadu_ps(o + r * head_dim + d0 + 8 * j);
        for (p = 0; p < n; p++) {
            __m256 v[4];
            const __m256 scale = _mm256_set1_ps(value_scale[p]);
            for (int j = 0; j < 4; j++) v[j] = int8x8(values + p * stride + d0 + 8 * j, scale);
            for (int r = 0; r < nr; r++) {
                const __m256 wv = _mm256_set1_ps(w[r][p]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(wv, v[j], acc[r][j]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + r * head_dim + d0 + 8 * j, acc[r][j]);
    }
}

/* `nr` (1..INT8_TILE) rows, each count compiled on its own so that the row loops unroll. */
static void int8_rows_chunk(const float *restrict q, int nr, const int8_t *keys, const int8_t *values, int64_t stride,
                            int64_t n, int64_t head_dim, float scale_log2e, float *restrict m, float *restrict l,
                            float *restrict o) {
    switch (nr) {
    case 3: int8_tile_chunk(q, 3, keys, values, stride, n, head_dim, scale_log2e, m, l, o); break;
    case 2: int8_tile_chunk(q, 2, keys, values, stride, n, head_dim, scale_log2e, m, l, o); break;
    default: int8_tile_chunk(q, 1, keys, values, stride, n, head_dim, scale_log2e, m, l, o);
    }
}
#define INT8_DIRECT 1
#else
#define INT8_DIRECT 0
/* Never called (int8_direct is 0 here): it lets the item code compile on every target. */
static void int8_rows_chunk(const float *restrict q, int nr, const int8_t *keys, const int8_t *values, int64_t stride,
                            int64_t n, int64_t head_dim, float scale_log2e, float *restrict m, float *restrict l,
                            float *restrict o) {
    (void)q, (void)nr, (void)keys, (void)values, (void)stride, (void)n, (void)head_dim, (void)scale_log2e;
    (void)m, (void)l, (void)o;
}
#endif

/* How many positions of the chunk from `chunk_start` a query row at `position` sees (0: none), from the
 * chunk's `*skip`-th on: with a window (mode != PLAIN, the row's first visible position `first`) the chunk's
 * positions below it are skipped. */
static inline __attribute__((always_inline)) int64_t row_span(int64_t position, int64_t first, int64_t chunk_start,
                                                              int mode, int64_t *skip) {
    const int64_t visible = position - chunk_start + 1;
    *skip = 0;
    if (visible <= 0) return 0;
    if (mode != PLAIN) {
        const int64_t below = first - chunk_start;
        if (below >= CHUNK) return 0;
        *skip = below > 0 ? below : 0;
    }
    return (visible < CHUNK ? visible : CHUNK) - *skip;
}

/* One item for a cache element type T. The query rows are widened to float once per item. A chunk of
 * float32 K/V inside one block is read in place; anything else (bf16, or a chunk across blocks) is
 * first copied into float rows. A constant head_dim (64, 128) lets the compiler unroll; `mode` is a
 * constant too (PLAIN, WINDOWED or CAPPED). */
#define DEFINE_PORTABLE_ITEM(NAME, T, TO_FLOAT, FROM_FLOAT, C, LOAD_ROW)                                      \
    static inline __attribute__((always_inline)) void NAME##_at(const Batch *b, const Item *it,               \
                                                                 int64_t head_dim, int mode) {                \
        const C *k_cache = (const C *)b->k_cache, *v_cache = (const C *)b->v_cache;                           \
        const int64_t rows = item_rows(b, it), per_kv = rows_per_kv_head(b, it);                              \
        const int in_place = sizeof(C) == sizeof(float) && b->block_size % CHUNK == 0;                        \
        const int int8_direct = INT8_DIRECT && sizeof(C) == 1 && mode != CAPPED && head_dim % 64 == 0 &&      \
                                b->block_size % CHUNK == 0;                                                   \
        const int64_t group = b->num_heads / b->num_kv_heads;                                                 \
        float q[MAX_ITEM_ROWS * MAX_HEAD_DIM], o[MAX_ITEM_ROWS * MAX_HEAD_DIM], m[MAX_ITEM_ROWS];             \
        float l[MAX_ITEM_ROWS], key_rows[CHUNK * MAX_HEAD_DIM], value_rows[CHUNK * MAX_HEAD_DIM];             \
        int64_t position[MAX_ITEM_ROWS], offsets[CHUNK], next[CHUNK], after_next[CHUNK];                      \
        int64_t first[MAX_ITEM_ROWS]; /* the first position each row sees */                                  \
        for (int64_t r = 0; r < rows; r++) {                                                                  \
            const T *q_row = (const T *)b->query + query_row_offset(b, it, r);                                \
            for (int64_t d = 0; d < head_dim; d++) {                                                          \
                q[r * head_dim + d] = TO_FLOAT(q_row[d]);                                                     \
                o[r * head_dim + d] = 0.f;                                                                    \
            }                                                                                                 \
            m[r] = -INFINITY;                                                                                 \
            l[r] = 0.f;                                                                                       \
            position[r] = query_row_position(b, it, r);                                                       \
            first[r] = mode != PLAIN ? window_start(b, position[r]) : 0;                                      \
        }                                                                                                     \
        const int64_t start = mode != PLAIN ? walk_start(b, query_row_position(b, it, 0)) : 0;                \
        const int capped = mode == CAPPED;                                                                    \
        Cursor cursor = cursor_start(b, it, start + it->chunk_begin * CHUNK);                                 \
        cursor_next(&cursor, next);                                                                           \
        cursor_next(&cursor, after_next);                                                                     \
        for (int64_t chunk = it->chunk_begin; chunk < it->chunk_end; chunk++) {                               \
            const int64_t chunk_start = start + chunk * CHUNK;                                                \
            memcpy(offsets, next, sizeof offsets);                                                            \
            memcpy(next, after_next, sizeof next);                                                            \
            cursor_next(&cursor, after_next);                                                                 \
            for (int64_t kv = 0; kv < it->kv_end - it->kv_begin; kv++) {                                      \
                const int64_t kv_offset = (it->kv_begin + kv) * b->head_stride;                               \
                prefetch_first_row(b, next, kv_offset, sizeof(C));                                            \
                prefetch_first_row(b, after_next, kv_offset, sizeof(C));                                      \
                if (int8_direct) {                                                                            \
                    const int8_t *k8 = (const int8_t *)(k_cache + offsets[0] + kv_offset);                    \
                    const int8_t *v8 = (const int8_t *)(v_cache + offsets[0] + kv_offset);                    \
                    for (int64_t r = kv * per_kv, nr; r < (kv + 1) * per_kv; r += nr) {                       \
                        const int64_t left = group - (r - kv * per_kv) % group; /* this token's rows */       \
                        nr = left < INT8_TILE ? left : INT8_TILE;                                             \
                        int64_t skip;                                                                         \
                        const int64_t n = row_span(position[r], first[r], chunk_start, mode, &skip);          \
                        if (n <= 0) continue;                                                                 \
                        int8_rows_chunk(q + r * head_dim, (int)nr, k8 + skip * b->position_stride,            \
                                        v8 + skip * b->position_stride, b->position_stride, n, head_dim,      \
                                        b->scale_log2e, &m[r], &l[r], o + r * head_dim);                      \
                    }                                                                                         \
                    continue;                                                                                 \
                }                                                                                             \
                const float *keys = key_rows, *values = value_rows;                                           \
                int64_t stride = head_dim;                                                                    \
                if (in_place) {                                                                               \
                    keys = (const float *)(k_cache + offsets[0] + kv_offset);                                 \
                    values = (const float *)(v_cache + offsets[0] + kv_offset);                               \
                    stride = b->position_stride;                                                              \
                } else {                                                                                      \
                    for (int64_t p = 0; p < CHUNK && offsets[p] >= 0; p++) {                                  \
                        LOAD_ROW(k_cache + offsets[p] + kv_offset, key_rows + p * head_dim, head_dim);        \
                        LOAD_ROW(v_cache + offsets[p] + kv_offset, value_rows + p * head_dim, head_dim);      \
                    }                                                                                         \
                }                                                                                             \
                for (int64_t r = kv * per_kv; r < (kv + 1) * per_kv; r++) {                                   \
                    int64_t skip;                                                                             \
                    const int64_t n = row_span(position[r], first[r], chunk_start, mode, &skip);              \
                    if (n <= 0) continue;                                                                     \
                    row_chunk(q + r * head_dim, keys + skip * stride, values + skip * stride, stride, n,      \
                              head_dim, b->scale_log2e, capped, b->cap_in, b->cap_out, &m[r], &l[r],          \
                              o + r * head_dim);                                                              \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int64_t r = 0; r < rows; r++) {                                                                  \
            if (it->state != NULL) {                                                                          \
                float *state = it->state + r * (head_dim + 2);                                                \
                state[0] = m[r];                                                                              \
                state[1] = l[r];                                                                              \
                memcpy(state + 2, o + r * head_dim, sizeof(float) * head_dim);                                \
                continue;                                                                                     \
            }                                                                                                 \
            T *out_row = (T *)b->out + query_row_offset(b, it, r);                                            \
            const float inv = 1.f / l[r];                                                                     \
            for (int64_t d = 0; d < head_dim; d++) out_row[d] = FROM_FLOAT(o[r * head_dim + d] * inv);        \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* Each row's parts' states rescaled to their common maximum and summed (log-sum-exp in base 2). */       \
    static void NAME##_merge(const Batch *b, const Split *split) {                                            \
        const int64_t head_dim = b->head_dim, stride = state_stride(b);                                       \
        for (int64_t r = 0; r < item_rows(b, &split->whole); r++) {                                           \
            float top = -INFINITY, total = 0.f, o[MAX_HEAD_DIM] = {0.f};                                      \
            for (int64_t p = 0; p < split->parts; p++) {                                                      \
                const float m = split->states[p * stride + r * (head_dim + 2)];                               \
                top = m > top ? m : top;                                                                      \
            }                                                                                                 \
            for (int64_t p = 0; p < split->parts; p++) {                                                      \
                const float *state = split->states + p * stride + r * (head_dim + 2);                         \
                const float weight = exp2_nonpositive(state[0] - top);                                        \
                total += weight * state[1];                                                                   \
                for (int64_t d = 0; d < head_dim; d++) o[d] += weight * state[2 + d];                         \
            }                                                                                                 \
            T *out_row = (T *)b->out + query_row_offset(b, &split->whole, r);                                 \
            const float inv = 1.f / total;                                                                    \
            for (int64_t d = 0; d < head_dim; d++) out_row[d] = FROM_FLOAT(o[d] * inv);                       \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void NAME(const Batch *b, const Item *it) {                                                        \
        switch (b->head_dim) {                                                                                \
        case 64: NAME##_at(b, it, 64, PLAIN); break;                                                          \
        case 128: NAME##_at(b, it, 128, PLAIN); break;                                                        \
        default: NAME##_at(b, it, b->head_dim, PLAIN);                                                        \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void NAME##_windowed(const Batch *b, const Item *it) {                                             \
        switch (b->head_dim) {                                                                                \
        case 64: NAME##_at(b, it, 64, WINDOWED); break;                                                       \
        case 128: NAME##_at(b, it, 128, WINDOWED); break;                                                     \
        default: NAME##_at(b, it, b->head_dim, WINDOWED);                                                     \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    static void NAME##_capped(const Batch *b, const Item *it) {                                               \
        switch (b->head_dim) {                                                                                \
        case 64: NAME##_at(b, it, 64, CAPPED); break;                                                         \
        case 128: NAME##_at(b, it, 128, CAPPED); break;                                                       \
        default: NAME##_at(b, it, b->head_dim, CAPPED);                                                       \
        }                                                                                                     \
    }

static inline float f32_identity(float x) { return x; }

/* One cache row of `n` values into floats. */
static inline void load_f32_row(const float *row, float *restrict out, int64_t n) {
    memcpy(out, row, sizeof(float) * n);
}

static inline void load_bf16_row(const uint16_t *row, float *restrict out, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) out[d] = bf16_to_float(row[d]);
}

/* An int8 row: n values, then their float32 scale (unaligned in general: memcpy reads it). */
static inline void load_int8_row(const int8_t *row, float *restrict out, int64_t n) {
    float scale;
    memcpy(&scale, row + n, sizeof scale);
#pragma omp simd
    for (int64_t d = 0; d < n; d++) out[d] = scale * (float)row[d];
}

DEFINE_PORTABLE_ITEM(portable_item_f32, float, f32_identity, f32_identity, float, load_f32_row)
DEFINE_PORTABLE_ITEM(portable_item_bf16, uint16_t, bf16_to_float, float_to_bf16, uint16_t, load_bf16_row)
DEFINE_PORTABLE_ITEM(portable_item_f32_int8kv, float, f32_identity, f32_identity, int8_t, load_int8_row)
DEFINE_PORTABLE_ITEM(portable_item_bf16_int8kv, uint16_t, bf16_to_float, float_to_bf16, int8_t, load_int8_row)

/* ---------------------------------------------------------------------------------------------- */
/* AVX512-BF16                                                                                      */
/*
 * vdpbf16ps multiplies 32 bf16 pairs and adds each pair's two products into one of 16 float32 lanes.
 *  - Q.K, few rows per KV head (decode, up to DIRECT_ROWS): each position's dot is accumulated over
 *    the head dim in its own register straight from the cache, then 16 positions' registers are summed
 *    lane-wise in one transpose-reduce tree (46 instructions instead of 16 horizontal sums).
 *  - Q.K, many rows (prefill tiles): the chunk's keys are transposed once so that lane p of keys[i]
 *    holds dims (2i, 2i+1) of position p; a broadcast query pair then gives 16 positions' partial dots
 *    in one instruction, and the transpose is shared by all the tile's rows.
 *  - P.V: two positions' value rows are interleaved (unpacklo/hi) so that a broadcast pair of bf16
 *    probabilities accumulates both positions into 16 output dims. unpacklo/hi work within 128-bit
 *    lanes, so the output dims come out permuted; `store_row` restores them once per row.
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define FAST 1
#define DIRECT_ROWS 4 /* up to this many rows per KV head, the transpose costs more than it saves */
#define TILE_ROWS 4   /* query rows per register tile: 4 x (head_dim / 16, at most 4) accumulators */

static const uint16_t ZERO_ROW[MAX_HEAD_DIM] __attribute__((aligned(64)));

/* Running state of one query row: maximum and per-lane sums in base 2, and the output (dims permuted). */
typedef struct {
    float m;
    float l[CHUNK];
    float o[MAX_HEAD_DIM];
} RowState;

static inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

static inline __m512i broadcast_pair(const uint16_t *pairs, int64_t index) {
    int32_t bits;
    memcpy(&bits, pairs + 2 * index, sizeof bits);
    return _mm512_set1_epi32(bits);
}

/* Lane p of the result is the sum of the 16 lanes of v[p]. Each round halves the vectors: two inputs'
 * halves are blended into one and the other halves shuffled into another, and the two are added. */
static inline __attribute__((always_inline)) __m512 sum_lanes16(const __m512 v[16]) {
    /* Halves of 512 bits: u[i] lanes 0..7 sum v[i]; lanes 8..15 sum v[i + 8]. */
    __m512 u[8], w[4], z[2];
    for (int i = 0; i < 8; i++) {
        const __m512 kept = _mm512_mask_blend_ps(0xff00, v[i], v[i + 8]);
        u[i] = _mm512_add_ps(kept, _mm512_shuffle_f32x4(v[i], v[i + 8], 0x4e));
    }
    /* Quarters: 128-bit lane L of w[i] sums position i + 4L. */
    const __m512i swap = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    for (int i = 0; i < 4; i++) {
        const __m512 kept = _mm512_mask_blend_ps(0xf0f0, u[i], u[i + 4]);
        w[i] = _mm512_add_ps(kept, _mm512_permutex2var_ps(u[i], swap, u[i + 4]));
    }
    /* Pairs: lanes 0-1 of 128-bit lane L of z[i] sum position i + 4L, lanes 2-3 position i + 2 + 4L. */
    for (int i = 0; i < 2; i++) {
        const __m512 kept = _mm512_mask_blend_ps(0xcccc, w[i], w[i + 2]);
        z[i] = _mm512_add_ps(kept, _mm512_shuffle_ps(w[i], w[i + 2], 0x4e));
    }
    /* Singles: lanes 4L..4L+3 sum positions 4L..4L+3, from z[0] (even ones) and z[1] (odd ones). */
    const __m512 crossed = _mm512_permute_ps(_mm512_mask_blend_ps(0xaaaa, z[1], z[0]), 0xb1);
    return _mm512_add_ps(_mm512_mask_blend_ps(0xaaaa, z[0], z[1]), crossed);
}

/* Scores of one row against the chunk's 16 key rows, read in place. */
static inline __attribute__((always_inline)) __m512 scores_direct(const uint16_t *q, const uint16_t *const *k_rows,
                                                                  int64_t head_dim) {
    __m512i qv[MAX_HEAD_DIM / 32];
    __m512 dots[CHUNK];
    for (int64_t j = 0; j < head_dim / 32; j++) qv[j] = _mm512_loadu_si512(q + 32 * j);
#pragma GCC unroll 16
    for (int p = 0; p < CHUNK; p++) {
        dots[p] = _mm512_setzero_ps();
        for (int64_t j = 0; j < head_dim / 32; j++)
            dots[p] = dpbf16(dots[p], qv[j], _mm512_loadu_si512(k_rows[p] + 32 * j));
    }
    return sum_lanes16(dots);
}

/* Transposes 16 rows of 16 dwords in four rounds of two-input shuffles (the usual 16x16 transpose). */
static inline __attribute__((always_inline)) void transpose16(__m512i a[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    /* u[g + j] holds, in each 128-bit lane L, column 4L + j of rows g..g+3. */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    /* t[h + j] (j < 8): 128-bit lanes (column j, rows h..h+3), (column j + 8, same rows),
     * (column j, rows h+4..h+7), (column j + 8, same rows). */
    for (int h = 0; h < 16; h += 8) {
        for (int j = 0; j < 4; j++) {
            t[h + j] = _mm512_shuffle_i32x4(u[h + j], u[h + 4 + j], 0x88);
            t[h + 4 + j] = _mm512_shuffle_i32x4(u[h + j], u[h + 4 + j], 0xdd);
        }
    }
    for (int j = 0; j < 8; j++) {
        a[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        a[j + 8] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* 32 dims of two positions' value rows as bf16 pairs (even, odd), in the permuted dim order of the
 * section's comment: `lo` holds dims 0-3, 8-11, 16-19, 24-27 and `hi` the others. */
static inline void interleave(const uint16_t *even_row, const uint16_t *odd_row, __m512i *lo, __m512i *hi) {
    const __m512i even = _mm512_loadu_si512(even_row), odd = _mm512_loadu_si512(odd_row);
    *lo = _mm512_unpacklo_epi16(even, odd);
    *hi = _mm512_unpackhi_epi16(even, odd);
}

/* The chunk's keys transposed and its values interleaved once, for the many rows of a prefill tile. */
static inline __attribute__((always_inline)) void pack_chunk(const uint16_t *const *k_rows,
                                                             const uint16_t *const *v_rows, int64_t head_dim,
                                                             __m512i *keys, __m512i *values) {
    for (int64_t j = 0; j < head_dim / 32; j++) {
        __m512i a[CHUNK];
        for (int p = 0; p < CHUNK; p++) a[p] = _mm512_loadu_si512(k_rows[p] + 32 * j);
        transpose16(a);
        for (int i = 0; i < 16; i++) keys[16 * j + i] = a[i];
    }
    for (int k = 0; k < CHUNK / 2; k++)
        for (int64_t j = 0; j < head_dim / 32; j++)
            interleave(v_rows[2 * k] + 32 * j, v_rows[2 * k + 1] + 32 * j, &values[k * (head_dim / 16) + 2 * j],
                       &values[k * (head_dim / 16) + 2 * j + 1]);
}

/* 2^x lane-wise for x <= 0 (see exp2_nonpositive); scalef does the 2^n without integer tricks. */
static inline __m512 exp2_nonpositive_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP2_FLOOR));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* tanh lane-wise, as tanh_f32 computes it. */
static inline __m512 tanh_avx512(__m512 x) {
    const __m512 a = _mm512_abs_ps(x), x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(TANH_C13);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(TANH_C11));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(TANH_C9));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(TANH_C7));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(TANH_C5));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(TANH_C3));
    const __m512 series = _mm512_fmadd_ps(_mm512_mul_ps(x, x2), p, x);
    const __m512 e = exp2_nonpositive_avx512(_mm512_mul_ps(a, _mm512_set1_ps(-2.f * LOG2E)));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    const __m512 large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SERIES_LIMIT), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(small, large, series);
}

/* The online-softmax step of one row: masks the positions it does not see, rescales its sum, rounds
 * the probabilities to bf16 into `weights` and returns the factor its output must be rescaled by.
 * The rounded probabilities are the ones summed, so the weights still add up to exactly 1. */
static inline __attribute__((always_inline)) __m512 softmax_update(__m512 s, __mmask16 valid, RowState *state,
                                                                  uint16_t weights[CHUNK]) {
    const float top = _mm512_reduce_max_ps(s);
    __m512 alpha = _mm512_set1_ps(1.f);
    if (top > state->m) {
        alpha = exp2_nonpositive_avx512(_mm512_set1_ps(state->m - top));
        state->m = top;
    }
    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_nonpositive_avx512(_mm512_sub_ps(s, _mm512_set1_ps(state->m))));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
    _mm256_storeu_si256((__m256i *)weights, rounded);
    const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    _mm512_storeu_ps(state->l, _mm512_fmadd_ps(_mm512_loadu_ps(state->l), alpha, widened));
    return alpha;
}

/* The plain step: row sees the chunk's first `visible` positions. */
static inline __m512 softmax_step(__m512 dots, int64_t visible, float scale_log2e, RowState *state,
                                  uint16_t weights[CHUNK]) {
    const __mmask16 valid = visible >= CHUNK ? 0xffff : visible <= 0 ? 0 : (__mmask16)((1u << visible) - 1u);
    const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, dots, _mm512_set1_ps(scale_log2e));
    return softmax_update(s, valid, state, weights);
}

/* The step of the other modes: the row sees the chunk's positions skip..visible-1, its logits soft-capped
 * if `capped` (a constant). */
static inline __attribute__((always_inline)) __m512 softmax_step_window(__m512 dots, int64_t visible, int64_t skip,
                                                                       const Batch *b, int capped, RowState *state,
                                                                       uint16_t weights[CHUNK]) {
    __mmask16 valid = visible >= CHUNK ? 0xffff : visible <= 0 ? 0 : (__mmask16)((1u << visible) - 1u);
    if (skip > 0) valid &= skip >= CHUNK ? 0 : (__mmask16) ~((1u << skip) - 1u);
    const __m512 logits = capped ? _mm512_mul_ps(tanh_avx512(_mm512_mul_ps(dots, _mm512_set1_ps(b->cap_in))),
                                                    _mm512_set1_ps(b->cap_out))
                                    : _mm512_mul_ps(dots, _mm512_set1_ps(b->scale_log2e));
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, logits);
    return softmax_update(s, valid, state, weights);
}

/* R query rows (a constant after inlining, so the accumulators stay in registers) against one chunk:
 * `k_rows`/`v_rows` are the chunk's 16 rows of one KV head (ZERO_ROW past the end: 0 x stale NaN would
 * be NaN); `keys`/`values` their transposed/interleaved copies (see pack_chunk), or NULL to work from
 * the rows directly; row r sees the chunk's first `visible[r]` positions, and in the modes but PLAIN (a
 * constant) not its first `skip[r]`, with soft-capping in mode CAPPED. */
static inline __attribute__((always_inline)) void rows_chunk(const uint16_t *const *q, RowState *const *state,
                                                             const int64_t *visible, const int64_t *skip,
                                                             const uint16_t *const *k_rows,
                                                             const uint16_t *const *v_rows, const __m512i *keys,
                                                             const __m512i *values, const Batch *b, int mode,
                                                             int R, int64_t head_dim) {
    __m512 dots[TILE_ROWS], alpha[TILE_ROWS];
    uint16_t weights[TILE_ROWS][CHUNK];
    if (keys == NULL) {
        for (int r = 0; r < R; r++) dots[r] = scores_direct(q[r], k_rows, head_dim);
    } else {
        /* Two accumulators per row hide the instruction's latency. */
        __m512 even[TILE_ROWS], odd[TILE_ROWS];
        for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int64_t i = 0; i < head_dim / 2; i += 2) {
            for (int r = 0; r < R; r++) {
                even[r] = dpbf16(even[r], broadcast_pair(q[r], i), keys[i]);
                odd[r] = dpbf16(odd[r], broadcast_pair(q[r], i + 1), keys[i + 1]);
            }
        }
        for (int r = 0; r < R; r++) dots[r] = _mm512_add_ps(even[r], odd[r]);
    }
    for (int r = 0; r < R; r++)
        alpha[r] = mode != PLAIN ? softmax_step_window(dots[r], visible[r], skip[r], b, mode == CAPPED, state[r],
                                                       weights[r])
                                 : softmax_step(dots[r], visible[r], b->scale_log2e, state[r], weights[r]);
    /* P.V, 64 output dims at a time. */
    for (int64_t c0 = 0; c0 < head_dim / 16; c0 += 4) {
        const int64_t cols = head_dim / 16 - c0 < 4 ? head_dim / 16 - c0 : 4;
        __m512 acc[TILE_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(state[r]->o + 16 * (c0 + c)), alpha[r]);
#pragma GCC unroll 8
        for (int k = 0; k < CHUNK / 2; k++) {
            for (int64_t c = 0; c < cols; c += 2) {
                __m512i lo, hi;
                if (values == NULL) {
                    interleave(v_rows[2 * k] + 16 * (c0 + c), v_rows[2 * k + 1] + 16 * (c0 + c), &lo, &hi);
                } else {
                    lo = values[k * (head_dim / 16) + c0 + c];
                    hi = values[k * (head_dim / 16) + c0 + c + 1];
                }
                for (int r = 0; r < R; r++) {
                    acc[r][c] = dpbf16(acc[r][c], broadcast_pair(weights[r], k), lo);
                    acc[r][c + 1] = dpbf16(acc[r][c + 1], broadcast_pair(weights[r], k), hi);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++) _mm512_storeu_ps(state[r]->o + 16 * (c0 + c), acc[r][c]);
    }
}

/* Rows [begin, end) of one KV head against the chunk at position `chunk_start`, in register tiles of up
 * to TILE_ROWS; row r sees positions first[r]..position[r] (`first` is not read in mode PLAIN). */
static inline __attribute__((always_inline)) void kv_head_chunk(const uint16_t *const *q, RowState *state,
                                                                const int64_t *position, const int64_t *first,
                                                                int64_t begin, int64_t end, int64_t chunk_start,
                                                                const uint16_t *const *k_rows,
                                                                const uint16_t *const *v_rows, const Batch *b,
                                                                int mode, int64_t head_dim) {
    __m512i packed_keys[MAX_HEAD_DIM / 2], packed_values[CHUNK / 2 * MAX_HEAD_DIM / 16];
    const __m512i *keys = NULL, *values = NULL;
    if (end - begin > DIRECT_ROWS) {
        pack_chunk(k_rows, v_rows, head_dim, packed_keys, packed_values);
        keys = packed_keys;
        values = packed_values;
    }
    for (int64_t r0 = begin; r0 < end; r0 += TILE_ROWS) {
        const int64_t n = end - r0 < TILE_ROWS ? end - r0 : TILE_ROWS;
        if (position[r0 + n - 1] < chunk_start) continue; /* the causal mask hides the whole chunk */
        /* Rows are in position order: the tile's first row has the earliest window. */
        if (mode != PLAIN && first[r0] >= chunk_start + CHUNK) continue; /* before every row's window */
        RowState *tile[TILE_ROWS];
        int64_t visible[TILE_ROWS], skip[TILE_ROWS];
        for (int64_t i = 0; i < n; i++) {
            tile[i] = &state[r0 + i];
            visible[i] = position[r0 + i] - chunk_start + 1;
            skip[i] = mode != PLAIN ? first[r0 + i] - chunk_start : 0;
        }
        switch (n) {
        case 4: rows_chunk(q + r0, tile, visible, skip, k_rows, v_rows, keys, values, b, mode, 4, head_dim); break;
        case 3: rows_chunk(q + r0, tile, visible, skip, k_rows, v_rows, keys, values, b, mode, 3, head_dim); break;
        case 2: rows_chunk(q + r0, tile, visible, skip, k_rows, v_rows, keys, values, b, mode, 2, head_dim); break;
        default: rows_chunk(q + r0, tile, visible, skip, k_rows, v_rows, keys, values, b, mode, 1, head_dim);
        }
    }
}

/* Output dims of a 32-dim column in the order P.V left them (see the section's comment): the lanes of
 * (lo, hi) that hold dims 0..15, then those that hold 16..31. */
static inline void store_row(const RowState *state, int64_t head_dim, uint16_t *out) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(state->l)));
    for (int64_t j = 0; j < head_dim / 32; j++) {
        const __m512 lo = _mm512_loadu_ps(state->o + 32 * j), hi = _mm512_loadu_ps(state->o + 32 * j + 16);
        const __m512 low_dims = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv);
        const __m512 high_dims = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv);
        _mm512_storeu_si512(out + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(high_dims, low_dims));
    }
}

/* One item in a constant `mode`: PLAIN, WINDOWED or CAPPED (see the top). */
static inline __attribute__((always_inline)) void fast_item_at(const Batch *b, const Item *it, int64_t head_dim,
                                                               int mode) {
    const uint16_t *k_cache = (const uint16_t *)b->k_cache, *v_cache = (const uint16_t *)b->v_cache;
    const int64_t rows = item_rows(b, it), per_kv = rows_per_kv_head(b, it);
    RowState state[MAX_ITEM_ROWS];
    const uint16_t *q[MAX_ITEM_ROWS];
    int64_t position[MAX_ITEM_ROWS], first[MAX_ITEM_ROWS], offsets[CHUNK], next[CHUNK], after_next[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        q[r] = (const uint16_t *)b->query + query_row_offset(b, it, r);
        position[r] = query_row_position(b, it, r);
        first[r] = mode != PLAIN ? window_start(b, position[r]) : 0;
        state[r].m = -INFINITY;
        memset(state[r].l, 0, sizeof state[r].l);
        memset(state[r].o, 0, sizeof(float) * head_dim);
    }
    const int64_t start = mode != PLAIN ? walk_start(b, query_row_position(b, it, 0)) : 0;
    const int64_t num_chunks = item_chunks(b, it, start);
    Cursor cursor = cursor_start(b, it, start);
    cursor_next(&cursor, next);
    cursor_next(&cursor, after_next);
    for (int64_t chunk = 0; chunk < num_chunks; chunk++) {
        memcpy(offsets, next, sizeof offsets);
        memcpy(next, after_next, sizeof next);
        cursor_next(&cursor, after_next);
        for (int64_t kv = 0; kv < it->kv_end - it->kv_begin; kv++) {
            const int64_t kv_offset = (it->kv_begin + kv) * b->head_stride;
            prefetch_first_row(b, next, kv_offset, sizeof(uint16_t));
            prefetch_first_row(b, after_next, kv_offset, sizeof(uint16_t));
            const uint16_t *k_rows[CHUNK], *v_rows[CHUNK];
            for (int p = 0; p < CHUNK; p++) {
                k_rows[p] = offsets[p] >= 0 ? k_cache + offsets[p] + kv_offset : ZERO_ROW;
                v_rows[p] = offsets[p] >= 0 ? v_cache + offsets[p] + kv_offset : ZERO_ROW;
            }
            kv_head_chunk(q, state, position, first, kv * per_kv, (kv + 1) * per_kv, start + chunk * CHUNK, k_rows,
                          v_rows, b, mode, head_dim);
        }
    }
    for (int64_t r = 0; r < rows; r++) store_row(&state[r], head_dim, (uint16_t *)b->out + query_row_offset(b, it, r));
}

static void fast_item(const Batch *b, const Item *it) {
    switch (b->head_dim) {
    case 64: fast_item_at(b, it, 64, PLAIN); break;
    case 128: fast_item_at(b, it, 128, PLAIN); break;
    default: fast_item_at(b, it, b->head_dim, PLAIN); /* any multiple of 32 up to MAX_HEAD_DIM */
    }
}

static void fast_item_windowed(const Batch *b, const Item *it) {
    switch (b->head_dim) {
    case 64: fast_item_at(b, it, 64, WINDOWED); break;
    case 128: fast_item_at(b, it, 128, WINDOWED); break;
    default: fast_item_at(b, it, b->head_dim, WINDOWED);
    }
}

static void fast_item_capped(const Batch *b, const Item *it) {
    switch (b->head_dim) {
    case 64: fast_item_at(b, it, 64, CAPPED); break;
    case 128: fast_item_at(b, it, 128, CAPPED); break;
    default: fast_item_at(b, it, b->head_dim, CAPPED);
    }
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Entry points                                                                                     */

/* Each token's K and V rows stored at its slot (a negative slot is padding, not written): `key`/`value`
 * [tokens, num_kv_heads, row_bytes] contiguous, the caches with the strides (in bytes) the kernels read them
 * by. Any element type: a row is copied whole (an int8 row with its scale). torch can index_copy_ rows only
 * where the slots are one dimension of a view, which head-major blocks are not, and its indexed put was
 * 1.5-3x slower than this loop (1 to 2048 tokens, AVX2 kind). */
void paged_attention_write_kv(const char *key, const char *value, char *k_cache, char *v_cache,
                              const int64_t *slots, int64_t tokens, int64_t num_kv_heads, int64_t row_bytes,
                              int64_t block_size, int64_t block_stride, int64_t position_stride,
                              int64_t head_stride) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * position_stride;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t from = (t * num_kv_heads + h) * row_bytes;
            memcpy(k_cache + at + h * head_stride, key + from, row_bytes);
            memcpy(v_cache + at + h * head_stride, value + from, row_bytes);
        }
    }
}

/* `query`/`out` [tokens, num_heads, head_dim] contiguous; caches [blocks, block_size, num_kv_heads, row] with
 * strides (in elements) `block_stride`, `position_stride`, `head_stride` and contiguous rows (head_dim values,
 * then in an int8 cache their 4-byte scale), K and V alike; `block_tables` int32 rows of `table_stride`; `seq_lens` int32 [num_seqs];
 * `query_start_loc` int32 [num_seqs + 1]. Sequences with no query tokens are skipped. `window` > 0 is a
 * sliding window of that many positions, `softcap` > 0 caps the scaled logits (0: neither). */
#define DEFINE_ENTRY(NAME, ITEM_FN, MERGE_FN)                                                                    \
    void NAME(const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,         \
              int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc, void *out,         \
              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,  \
              int64_t block_stride, int64_t position_stride, int64_t head_stride, float scale, int64_t window,  \
              float softcap) {                                                                                  \
        const int capped = softcap > 0.f;                                                                       \
        const Batch b = {query,                                                                                 \
                         k_cache,                                                                               \
                         v_cache,                                                                               \
                         out,                                                                                   \
                         block_tables,                                                                          \
                         seq_lens,                                                                              \
                         query_start_loc,                                                                       \
                         table_stride,                                                                          \
                         num_heads,                                                                             \
                         num_kv_heads,                                                                          \
                         head_dim,                                                                              \
                         block_size,                                                                            \
                         block_stride,                                                                          \
                         position_stride,                                                                       \
                         head_stride,                                                                           \
                         scale * LOG2E,                                                                         \
                         window > 0 ? window : 0,                                                               \
                         capped ? scale / softcap : 0.f,                                                        \
                         capped ? softcap * LOG2E : 0.f};                                                       \
        run_items(&b, num_seqs, capped ? ITEM_FN##_capped : window > 0 ? ITEM_FN##_windowed : ITEM_FN,          \
                  window > 0 ? NULL : MERGE_FN);                                                                \
    }

DEFINE_ENTRY(paged_attention_f32_portable, portable_item_f32, portable_item_f32_merge)
DEFINE_ENTRY(paged_attention_bf16_portable, portable_item_bf16, portable_item_bf16_merge)
DEFINE_ENTRY(paged_attention_f32_int8kv_portable, portable_item_f32_int8kv, portable_item_f32_int8kv_merge)
DEFINE_ENTRY(paged_attention_bf16_int8kv_portable, portable_item_bf16_int8kv, portable_item_bf16_int8kv_merge)
#ifdef FAST
/* its items are never split (its item function keeps no partial state) */
DEFINE_ENTRY(paged_attention_bf16_avx512, fast_item, NULL)
#endif
