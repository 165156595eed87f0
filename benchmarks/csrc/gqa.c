/* A hand-written GroupQueryAttention for the CPU: the candidate kernel of a custom op, timed
 * against onnxruntime's own by benchmarks/attention_kernel.py (through ctypes, one thread).
 *
 * It keeps onnxruntime's contract for com.microsoft GroupQueryAttention (rotary inside; KV cache
 * in [batch, kv_heads, buffer, head] buffers that past and present may share) and changes how the
 * work is done: a row's keys and values are loaded once for all the query heads that share them,
 * the dot products of 16 keys are folded together (4 levels of pairwise sums, not 16 horizontal
 * reductions), and each query scores only the keys its mask allows (onnxruntime's kernel runs a
 * GEMM per row and query head over the row's whole length, then masks).
 *
 * Semantics followed exactly (tests/test_benchmarks.py compares outputs and caches with
 * onnxruntime 1.32's on batched rows of different lengths, prompts, prompt pieces, a local window,
 * softcap and partial rotary):
 * - a row's total length is seqlens_k[b] + 1; its new tokens sit at the end, so the past length
 *   is total - S, except in a first prompt (S == total_sequence_length), whose past is 0;
 * - rotary (non-interleaved, the first 2 x cos_cache.shape[1] channels) at position past + s;
 * - scores scaled by `scale` (1/sqrt(head) when 0), then softcap * tanh(x / softcap) when
 *   softcap > 0, then softmax over keys [lo, past + s], the last local_window_size of them when
 *   local_window_size > 0 (onnxruntime 1.32 counts the query's own key in the window).
 */
#include "gqa.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* exp for the softmax, written so the compiler vectorizes it (libm's expf is a scalar call):
 * 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative
 * error about 1e-7, float's own rounding). Inputs are <= 0 here (x - max); below -87 they are
 * clamped there (e^-87 is 2e-38, nothing beside the softmax's largest term, 1). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* Cody-Waite ln2 */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}


typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* lanes of a and b added pairwise into one vector: out[i] = a[2i] + a[2i+1] for i < 8, then b's */
static inline v16 pair_sum(v16 a, v16 b) {
    v16 even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    v16 odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return even + odd;
}

/* The dot products of q with 16 consecutive keys (rows of `head` floats), as one vector: each
 * key's 16 partial sums are folded with its neighbours' in 4 levels of pair_sum instead of 16
 * horizontal reductions. */
static inline v16 dots16(const float *q, const float *k, int head) {
    v16 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = (v16){0};
    for (int d = 0; d < head; d += 16) {
        const v16 qd = load16(q + d);
        for (int j = 0; j < 16; j++) acc[j] += qd * load16(k + j * head + d);
    }
    v16 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) l1[i] = pair_sum(acc[2 * i], acc[2 * i + 1]);
    for (int i = 0; i < 4; i++) l2[i] = pair_sum(l1[2 * i], l1[2 * i + 1]);
    for (int i = 0; i < 2; i++) l3[i] = pair_sum(l2[2 * i], l2[2 * i + 1]);
    v16 l4 = pair_sum(l3[0], l3[1]);
    return l4;
}

static inline void rotate(const float *x, const float *cos_row, const float *sin_row, int half,
                          int head, float *out) {
    for (int i = 0; i < half; i++) {
        out[i] = x[i] * cos_row[i] - x[i + half] * sin_row[i];
        out[i + half] = x[i + half] * cos_row[i] + x[i] * sin_row[i];
    }
    for (int i = 2 * half; i < head; i++) out[i] = x[i];
}

static int64_t past_length(const GqaShape *g, int64_t b) {
    if (g->first_prompt) return 0;
    return (int64_t)g->seqlens_k[b] + 1 - g->seq;
}

static float *cache_row(float *cache, const GqaShape *g, int64_t b, int64_t kvh) {
    return cache + ((b * g->kv_heads + kvh) * g->present_len) * g->head;
}

/* Task (b, kv head): copy the past into present when they are separate buffers, then write the
 * new tokens' keys (rotated) and values at their positions. */
void gqa_write_task(const GqaShape *g, int64_t task) {
    const int64_t b = task / g->kv_heads, kvh = task % g->kv_heads, past = past_length(g, b);
    float *k_out = cache_row(g->present_key, g, b, kvh);
    float *v_out = cache_row(g->present_value, g, b, kvh);
    if (g->past_key != g->present_key && g->past_key != NULL) {
        /* onnxruntime zeroes a separate present, then copies the past it holds */
        const size_t row = (size_t)g->present_len * g->head * sizeof(float);
        memset(k_out, 0, row);
        memset(v_out, 0, row);
        const size_t held = (size_t)past * g->head * sizeof(float);
        const int64_t src = ((b * g->kv_heads + kvh) * g->past_len) * g->head;
        memcpy(k_out, g->past_key + src, held);
        memcpy(v_out, g->past_value + src, held);
    }
    const int64_t kv_width = g->kv_heads * g->head;
    for (int64_t s = 0; s < g->seq; s++) {
        const int64_t pos = past + s;
        const float *k_in = g->key + (b * g->seq + s) * kv_width + kvh * g->head;
        const float *v_in = g->value + (b * g->seq + s) * kv_width + kvh * g->head;
        rotate(k_in, g->cos_cache + pos * g->rotary_half, g->sin_cache + pos * g->rotary_half,
               g->rotary_half, g->head, k_out + pos * g->head);
        memcpy(v_out + pos * g->head, v_in, g->head * sizeof(float));
    }
}

int64_t gqa_attend_tasks(const GqaShape *g) {
    return g->batch * g->kv_heads * ((g->seq + g->query_block - 1) / g->query_block);
}

/* Task (b, kv head, block of queries): each key and value is loaded once for all the group's
 * query heads. scratch holds group x (keys + head) floats. */
void gqa_attend_task(const GqaShape *g, int64_t task, float *scratch) {
    const int64_t blocks = (g->seq + g->query_block - 1) / g->query_block;
    const int64_t b = task / (g->kv_heads * blocks);
    const int64_t kvh = (task / blocks) % g->kv_heads;
    const int64_t first = (task % blocks) * g->query_block;
    const int64_t last = first + g->query_block < g->seq ? first + g->query_block : g->seq;
    const int group = (int)(g->heads / g->kv_heads), head = (int)g->head;
    const int64_t past = past_length(g, b);
    const float *keys = cache_row(g->present_key, g, b, kvh);
    const float *values = cache_row(g->present_value, g, b, kvh);
    const float alpha = g->scale == 0.0f ? 1.0f / sqrtf((float)head) : g->scale;
    const int64_t q_width = g->heads * head;
    float *queries = scratch;                    /* group x head, rotated */
    float *scores = scratch + group * head;      /* group x keys */

    for (int64_t s = first; s < last; s++) {
        const int64_t pos = past + s, end = pos + 1;
        const int64_t lo = (g->window > 0 && end > g->window) ? end - g->window : 0;
        const int64_t n = end - lo;
        const float *cos_row = g->cos_cache + pos * g->rotary_half;
        const float *sin_row = g->sin_cache + pos * g->rotary_half;
        for (int h = 0; h < group; h++) {
            const float *q = g->query + (b * g->seq + s) * q_width + (kvh * group + h) * head;
            rotate(q, cos_row, sin_row, (int)g->rotary_half, head, queries + h * head);
        }
        int64_t j = 0;
        if (head % 16 == 0) {
            for (; j + 16 <= n; j += 16) {
                const float *k = keys + (lo + j) * head;
                for (int h = 0; h < group; h++) {
                    v16 sums = dots16(queries + h * head, k, head);
                    memcpy(scores + h * n + j, &sums, sizeof sums);
                    for (int i = 0; i < 16; i++) scores[h * n + j + i] *= alpha;
                }
            }
        }
        for (; j < n; j++) {
            const float *k = keys + (lo + j) * head;
            for (int h = 0; h < group; h++) {
                const float *q = queries + h * head;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head; d++) dot += q[d] * k[d];
                scores[h * n + j] = dot * alpha;
            }
        }
        for (int h = 0; h < group; h++) {
            float *row = scores + h * n;
            if (g->softcap > 0.0f)
                for (int64_t j = 0; j < n; j++) row[j] = g->softcap * tanhf(row[j] / g->softcap);
            float peak = row[0];
            for (int64_t j = 1; j < n; j++) peak = row[j] > peak ? row[j] : peak;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < n; j++) {
                row[j] = exp_nonpositive(row[j] - peak);
                total += row[j];
            }
            const float inverse = 1.0f / total;
            for (int64_t j = 0; j < n; j++) row[j] *= inverse;
        }
        float *out = g->output + (b * g->seq + s) * q_width + kvh * group * head;
        memset(out, 0, (size_t)group * head * sizeof(float));
        for (int64_t j = 0; j < n; j++) {
            const float *v = values + (lo + j) * head;
            for (int h = 0; h < group; h++) {
                const float p = scores[h * n + j];
                float *o = out + h * head;
#pragma omp simd
                for (int d = 0; d < head; d++) o[d] += p * v[d];
            }
        }
    }
}

size_t gqa_scratch_floats(const GqaShape *g) {
    const int64_t group = g->heads / g->kv_heads;
    return (size_t)(group * (g->head + g->present_len));
}

/* The whole op on the calling thread: what the tests call through ctypes. */
int gqa_serial(const GqaShape *g) {
    float *scratch = malloc(gqa_scratch_floats(g) * sizeof(float));
    if (scratch == NULL) return 1;
    for (int64_t t = 0; t < g->batch * g->kv_heads; t++) gqa_write_task(g, t);
    for (int64_t t = 0; t < gqa_attend_tasks(g); t++) gqa_attend_task(g, t, scratch);
    free(scratch);
    return 0;
}
