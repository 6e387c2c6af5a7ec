/*
 * A Llama-style model's decoder layers in one call: for each layer the input norm (with the residual add),
 * the fused q/k/v product, the rotary pass that writes K/V into the paged cache, paged attention, the output
 * product, the post-attention norm (with its residual add), the gate/up product, SiLU times up and the down
 * product. Every step is a kernel the Python layers call one by one (quant_ops.c's products, fused_ops.c,
 * paged_attention.c), reached here through function pointers the caller resolved from those libraries, with
 * the same arguments in the same order: the result is bit for bit the Python path's. What goes is the
 * per-call cost around them (module calls, argument conversion, a tensor allocated per op; docs/PERFORMANCE.md,
 * "Decoder layers in one call").
 *
 * Built at first use by pagedllm.native and called through ctypes from pagedllm.models.lean.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*Product)(const void *x, int64_t m, int64_t k, const void *w, int64_t n, void *y);
typedef void (*Norm)(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps);
typedef void (*ActMul)(const void *gate_up, void *out, int64_t rows, int64_t dim);
typedef void (*AddBias)(void *y, const void *bias, int64_t rows, int64_t dim);
typedef void (*RopeWriteKV)(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin, void *q_out,
                            void *k_cache, void *v_cache, const int64_t *slots, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t block_stride,
                            int64_t position_stride, int64_t head_stride);
typedef void (*Attend)(const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start_loc, void *out,
                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t block_stride, int64_t position_stride, int64_t head_stride,
                       float scale, int64_t window, float softcap);

/* One projection: its parts stacked by output features (a fused q/k/v whose matrices a file quantized
 * differently, as Q4_K_M files do, keeps a part per type), each with its kernel, its blocks (or packed blocks) and
 * its output features; then its bias (or NULL). */
#define MAX_PARTS 3
typedef struct {
    int64_t num_parts;
    Product kernel[MAX_PARTS];
    const void *weight[MAX_PARTS];
    int64_t out_features[MAX_PARTS];
    const void *bias;
} Matrix;

/* One layer, fixed once the model is loaded. */
typedef struct {
    const void *input_norm, *post_attention_norm;
    Matrix qkv, o, gate_up, down;
    int64_t window; /* 0: global attention */
} Layer;

/* The model's shape and the kernels every layer shares. */
typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, element_size;
    float eps, scale, softcap;
    Norm norm;
    ActMul act_mul;
    AddBias add_bias;
    RopeWriteKV rope_write_kv;
    Attend attend;
} Model;

/* One step: the flat batch's `rows` tokens, their rotary tables and slots, the attention metadata, each
 * layer's caches (with the strides every layer's share), and the buffers the layers pass along: `residual`
 * [rows, hidden] is the stream (updated in place), `out` [rows, hidden] receives the last layer's MLP output,
 * still to be added to it (as the Python layers return it). */
typedef struct {
    int64_t rows, num_seqs, table_stride, block_size, block_stride, position_stride, head_stride;
    const void *cos, *sin;
    const int64_t *slots;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    void *const *k_caches;
    void *const *v_caches;
    void *residual, *hidden, *qkv, *q, *attention, *projected, *gate_up, *activated, *out;
    void *part; /* [rows, the widest part of a projection with several] */
} Step;

static int64_t projection_width(const Matrix *p) {
    int64_t width = 0;
    for (int64_t i = 0; i < p->num_parts; i++) width += p->out_features[i];
    return width;
}

/* y [rows, width] = x [rows, in_features] times the projection, plus its bias. A projection of several parts
 * multiplies each into `part` and copies it into its columns of y (torch.cat in the Python layers). */
static void project(const Model *m, const Matrix *p, const void *x, int64_t rows, int64_t in_features, void *y,
                    void *part) {
    const int64_t width = projection_width(p);
    if (p->num_parts == 1) {
        p->kernel[0](x, rows, in_features, p->weight[0], width, y);
    } else {
        for (int64_t i = 0, column = 0; i < p->num_parts; column += p->out_features[i], i++) {
            const int64_t bytes = p->out_features[i] * m->element_size;
            p->kernel[i](x, rows, in_features, p->weight[i], p->out_features[i], part);
            for (int64_t r = 0; r < rows; r++)
                memcpy((char *)y + (r * width + column) * m->element_size, (const char *)part + r * bytes, bytes);
        }
    }
    if (p->bias) m->add_bias(y, p->bias, rows, width);
}

static void attention_block(const Model *m, const Layer *layer, const Step *s, void *k_cache, void *v_cache) {
    const int64_t q_size = m->heads * m->head_dim;
    project(m, &layer->qkv, s->hidden, s->rows, m->hidden, s->qkv, s->part);
    m->rope_write_kv(s->qkv, projection_width(&layer->qkv), s->cos, s->sin, s->q, k_cache, v_cache, s->slots,
                     s->rows, m->heads, m->kv_heads, m->head_dim, s->block_size, s->block_stride,
                     s->position_stride, s->head_stride);
    m->attend(s->q, k_cache, v_cache, s->block_tables, s->table_stride, s->seq_lens, s->query_start_loc,
              s->attention, s->num_seqs, m->heads, m->kv_heads, m->head_dim, s->block_size, s->block_stride,
              s->position_stride, s->head_stride, m->scale, layer->window, m->softcap);
    project(m, &layer->o, s->attention, s->rows, q_size, s->projected, s->part);
}

static void feed_forward(const Model *m, const Layer *layer, const Step *s) {
    project(m, &layer->gate_up, s->hidden, s->rows, m->hidden, s->gate_up, s->part);
    m->act_mul(s->gate_up, s->activated, s->rows, m->intermediate);
    project(m, &layer->down, s->activated, s->rows, m->intermediate, s->out, s->part);
}

/* Every layer over the step; `residual` holds the embeddings on entry. */
void decoder_layers(const Model *m, const Layer *layers, const Step *s) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        const Layer *layer = &layers[l];
        if (l == 0)
            m->norm(s->residual, NULL, layer->input_norm, s->hidden, s->rows, m->hidden, m->eps);
        else
            m->norm(s->out, s->residual, layer->input_norm, s->hidden, s->rows, m->hidden, m->eps);
        attention_block(m, layer, s, s->k_caches[l], s->v_caches[l]);
        m->norm(s->projected, s->residual, layer->post_attention_norm, s->hidden, s->rows, m->hidden, m->eps);
        feed_forward(m, layer, s);
    }
}
