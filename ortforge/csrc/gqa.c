/* A hand-written GroupQueryAttention for the CPU: ortforge's custom op (ort_op.c), timed against
 * onnxruntime's own by benchmarks/attention_kernel.py (through ctypes, one thread).
 *
 * It keeps onnxruntime's contract for com.microsoft GroupQueryAttention (rotary inside; KV cache
 * in [batch, kv_heads, buffer, head] buffers that past and present may share; a head size that is
 * a multiple of 16) and changes how the work is done. A row's keys and values are loaded once for
 * all the query heads that share them, and each query scores only the keys its mask allows
 * (onnxruntime's kernel runs a GEMM per row and query head over the row's whole length, then
 * masks). A decode step's query folds the dot products of 16 keys together (4 levels of pairwise
 * sums, not 16 horizontal reductions); a prompt's block of queries transposes each 16 keys once
 * and scores them with broadcast multiply-adds, 8 query vectors at a time.
 *
 * Semantics followed exactly (tests/test_custom_ops.py compares outputs and caches with
 * onnxruntime 1.32's on batched rows of different lengths, prompts, prompt pieces, a local window,
 * softcap and partial rotary):
 * - a row's total length is seqlens_k[b] + 1; its new tokens sit at the end, so the past length
 *   is total - S, except in a first prompt (S == total_sequence_length), whose past is 0;
 * - rotary (non-interleaved, the first 2 x cos_cache.shape[1] channels) at position past + s;
 * - scores scaled by `scale` (1/sqrt(head) when 0), then softcap * tanh(x / softcap) when
 *   softcap > 0, then softmax over keys [lo, past + s], the last local_window_size of them when
 *   local_window_size > 0 (onnxruntime 1.32 counts the query's own key in the window);
 * - an int8 cache (k_scale set): each written key (rotated) and value stored as its code per
 *   channel, attention computed over code x scale.
 */
#include "gqa.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* 16 int8 codes as floats. GCC 12 turns __builtin_convertvector from int8 lanes into 16 scalar
 * conversions (3x slower steps than a float cache, measured), so x86 gets its sign-extend and
 * convert instructions by name; other CPUs a loop the compiler vectorizes. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 load16_codes(const int8_t *p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline v16 load16_codes(const int8_t *p) {
    const __m128i codes = _mm_loadu_si128((const __m128i *)p);
    const __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)))};
    v16 v;
    memcpy(&v, halves, sizeof v);
    return v;
}
#else
static inline v16 load16_codes(const int8_t *p) {
    float lanes[16];
#pragma omp simd
    for (int i = 0; i < 16; i++) lanes[i] = (float)p[i];
    return load16(lanes);
}
#endif

/* 16 channels of a KV cache from element `at`, as floats: the cache's floats, or its int8 codes
 * (codes: a constant wherever this is inlined, so each caller compiles to one kind of load). */
static inline __attribute__((always_inline)) v16 load16_cached(const void *cache, int64_t at, int codes) {
    return codes ? load16_codes((const int8_t *)cache + at) : load16((const float *)cache + at);
}

static inline __attribute__((always_inline)) float cached(const void *cache, int64_t at, int codes) {
    return codes ? (float)((const int8_t *)cache)[at] : ((const float *)cache)[at];
}

/* lanes of a and b added pairwise into one vector: out[i] = a[2i] + a[2i+1] for i < 8, then b's */
static inline v16 pair_sum(v16 a, v16 b) {
    v16 even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    v16 odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return even + odd;
}

/* The dot products of q with 16 consecutive keys (rows of `head` channels from element `at` of
 * keys), as one vector: each key's 16 partial sums are folded with its neighbours' in 4 levels of
 * pair_sum instead of 16 horizontal reductions. */
static inline __attribute__((always_inline)) v16 dots16(const float *q, const void *keys, int64_t at, int head,
                                                        int codes) {
    v16 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = (v16){0};
    for (int d = 0; d < head; d += 16) {
        const v16 qd = load16(q + d);
        for (int j = 0; j < 16; j++) acc[j] += qd * load16_cached(keys, at + j * head + d, codes);
    }
    v16 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) l1[i] = pair_sum(acc[2 * i], acc[2 * i + 1]);
    for (int i = 0; i < 4; i++) l2[i] = pair_sum(l1[2 * i], l1[2 * i + 1]);
    for (int i = 0; i < 2; i++) l3[i] = pair_sum(l2[2 * i], l2[2 * i + 1]);
    return pair_sum(l3[0], l3[1]);
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

static size_t cache_element(const GqaShape *g) { return g->k_scale != NULL ? sizeof(int8_t) : sizeof(float); }

static char *cache_row(void *cache, const GqaShape *g, int64_t b, int64_t kvh) {
    return (char *)cache + (size_t)((b * g->kv_heads + kvh) * g->present_len * g->head) * cache_element(g);
}

/* x / scale per channel as onnxruntime computes it (x times the scale's float reciprocal, which
 * can round a value a hair past a tie: -42.5 by division, -42.500004 so), rounded to the nearest
 * code (ties to even) and saturated to int8. */
static void quantize_codes(const float *x, const float *scale, int64_t head, int8_t *out) {
    for (int64_t d = 0; d < head; d++) {
        const float code = nearbyintf(x[d] * (1.0f / scale[d]));
        out[d] = (int8_t)(code >= 127.0f ? 127.0f : code >= -128.0f ? code : -128.0f); /* NaN: -128 */
    }
}

/* Task (b, kv head): copy the past into present when they are separate buffers, then write the
 * new tokens' keys (rotated) and values at their positions (as codes, for an int8 cache). */
void gqa_write_task(const GqaShape *g, int64_t task) {
    const int64_t b = task / g->kv_heads, kvh = task % g->kv_heads, past = past_length(g, b);
    const size_t element = cache_element(g);
    char *k_out = cache_row(g->present_key, g, b, kvh);
    char *v_out = cache_row(g->present_value, g, b, kvh);
    if (g->past_key != g->present_key && g->past_key != NULL) {
        /* onnxruntime zeroes a separate present, then copies the past it holds */
        const size_t row = (size_t)g->present_len * g->head * element;
        memset(k_out, 0, row);
        memset(v_out, 0, row);
        const size_t held = (size_t)past * g->head * element;
        const size_t src = (size_t)((b * g->kv_heads + kvh) * g->past_len * g->head) * element;
        memcpy(k_out, (const char *)g->past_key + src, held);
        memcpy(v_out, (const char *)g->past_value + src, held);
    }
    const int64_t kv_width = g->kv_heads * g->head;
    for (int64_t s = 0; s < g->seq; s++) {
        const int64_t pos = past + s;
        const float *k_in = g->key + (b * g->seq + s) * kv_width + kvh * g->head;
        const float *v_in = g->value + (b * g->seq + s) * kv_width + kvh * g->head;
        const float *cos_row = g->cos_cache + pos * g->rotary_half, *sin_row = g->sin_cache + pos * g->rotary_half;
        if (g->k_scale == NULL) {
            rotate(k_in, cos_row, sin_row, g->rotary_half, g->head, (float *)k_out + pos * g->head);
            memcpy((float *)v_out + pos * g->head, v_in, g->head * sizeof(float));
            continue;
        }
        float rotated[g->head];
        rotate(k_in, cos_row, sin_row, g->rotary_half, g->head, rotated);
        quantize_codes(rotated, g->k_scale + kvh * g->head, g->head, (int8_t *)k_out + pos * g->head);
        quantize_codes(v_in, g->v_scale + kvh * g->head, g->head, (int8_t *)v_out + pos * g->head);
    }
}

/* The first `count` lanes of v into p: a full vector in one store (memcpy of a size the compiler
 * cannot see became a loop of 8-byte moves, 15% of a prompt's time). */
static inline void store_scores(float *p, v16 v, int64_t count) {
    if (count == 16)
        memcpy(p, &v, sizeof v);
    else
        memcpy(p, &v, (size_t)count * sizeof(float));
}

/* The keys query s of row b attends to: [lo, end). */
static void key_range(const GqaShape *g, int64_t past, int64_t s, int64_t *lo, int64_t *end) {
    *end = past + s + 1;
    *lo = (g->window > 0 && *end > g->window) ? *end - g->window : 0;
}

typedef int32_t v16i __attribute__((vector_size(64)));

/* exp of 16 lanes for the softmax, in vector code (libm's expf is a scalar call, and a scalar loop
 * GCC reported vectorized ran scalar): 2^n * p(r) with n = x log2(e) rounded (for x <= 0,
 * truncating x log2(e) - 0.5 rounds it), r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite), p the
 * degree-6 Taylor polynomial (relative error about 1e-7, float's own rounding), 2^n built in the
 * exponent's bits. Inputs are <= 0 here (x - max); below -87 they are clamped there (e^-87 is
 * 2e-38, nothing beside the softmax's largest term, 1). */
static inline v16 exp16_nonpositive(v16 x) {
    const v16i low = x < -87.0f;
    x = (v16)(((v16i)x & ~low) | ((v16i)((v16){0} - 87.0f) & low));
    const v16i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v16i);
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    v16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

/* Scaled scores to probabilities, in place: softcap, then softmax. */
static void softmax(float *row, int64_t n, float softcap) {
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; j++) row[j] = softcap * tanhf(row[j] / softcap);
    float peak = row[0];
#pragma omp simd reduction(max : peak)
    for (int64_t j = 1; j < n; j++) peak = row[j] > peak ? row[j] : peak;
    v16 sums = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v16 e = exp16_nonpositive(load16(row + j) - peak);
        memcpy(row + j, &e, sizeof e);
        sums += e;
    }
    float total = 0.0f;
    for (int i = 0; i < 16; i++) total += sums[i];
    if (j < n) { /* the last 1 to 15 scores: one more vector, its spare lanes left out of the sum */
        float tail[16];
        for (int i = 0; i < 16; i++) tail[i] = peak; /* spare lanes: exp(0) */
        memcpy(tail, row + j, (size_t)(n - j) * sizeof(float));
        const v16 e = exp16_nonpositive(load16(tail) - peak);
        for (int64_t i = 0; i < n - j; i++) total += e[i];
        store_scores(row + j, e, n - j);
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t k = 0; k < n; k++) row[k] *= inverse;
}

/* For `heads` heads from h0 and channels [d0, d0 + 64): out[h] (+)= sum over the n keys j of
 * p[h * stride + j] * values[j] (the rows of `head` channels from element `at` of values, floats or
 * int8 codes), added to what out holds when `add`. heads, codes and the 4 vectors of 16 channels
 * are constants where it is inlined, so its up to 16 sums stay in registers as independent chains
 * of multiply-adds, each vector of a value loaded once for the heads. */
static inline __attribute__((always_inline)) void weigh_slice(const void *values, int64_t at, const float *p,
                                                              int64_t stride, int64_t n, int head, int h0, int heads,
                                                              int d0, int add, float *out, int codes) {
    v16 sums[4][4];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < 4; c++) sums[h][c] = add ? load16(out + (h0 + h) * head + d0 + 16 * c) : (v16){0};
    for (int64_t j = 0; j < n; j++) {
        const int64_t v = at + j * head + d0;
        const v16 row[4] = {load16_cached(values, v, codes), load16_cached(values, v + 16, codes),
                            load16_cached(values, v + 32, codes), load16_cached(values, v + 48, codes)};
        for (int h = 0; h < heads; h++) {
            const float weight = p[(h0 + h) * stride + j];
            for (int c = 0; c < 4; c++) sums[h][c] += weight * row[c];
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < 4; c++) memcpy(out + (h0 + h) * head + d0 + 16 * c, &sums[h][c], sizeof(v16));
}

/* out[h] (+)= sum over the n keys j of p[h * stride + j] * values[j] (rows from element `at`), for
 * the group's heads h, 4 heads and 64 channels at a time; a last slice of 16 to 48 channels takes
 * the plain loop. codes: a constant where it is inlined (see load16_cached). */
static inline __attribute__((always_inline)) void weigh_values(const void *values, int64_t at, const float *p,
                                                               int64_t stride, int64_t n, int group, int head,
                                                               int add, float *out, int codes) {
    for (int d0 = 0; d0 < head; d0 += 64) {
        if (head - d0 < 64) {
            for (int h = 0; h < group; h++) {
                float *o = out + h * head + d0;
                if (!add) memset(o, 0, (size_t)(head - d0) * sizeof(float));
                for (int64_t j = 0; j < n; j++) {
                    const float weight = p[h * stride + j];
#pragma omp simd
                    for (int d = 0; d < head - d0; d++) o[d] += weight * cached(values, at + j * head + d0 + d, codes);
                }
            }
            continue;
        }
        for (int h0 = 0; h0 < group; h0 += 4) {
            switch (group - h0) {
            case 1: weigh_slice(values, at, p, stride, n, head, h0, 1, d0, add, out, codes); break;
            case 2: weigh_slice(values, at, p, stride, n, head, h0, 2, d0, add, out, codes); break;
            case 3: weigh_slice(values, at, p, stride, n, head, h0, 3, d0, add, out, codes); break;
            default: weigh_slice(values, at, p, stride, n, head, h0, 4, d0, add, out, codes); break;
            }
        }
    }
}

enum { VALUE_TILE = 64 }; /* keys whose values a prompt's block weighs together (16 KB at a head of 64) */

typedef struct {
    const GqaShape *g;
    int64_t b, kvh, past;
    int group, head;
    float alpha;
    const void *keys, *values; /* the row's cache from position `base`: floats, or int8 codes (codes) */
    int64_t base;
    int codes;
    const float *k_scale, *v_scale; /* this kv head's channel scales, when codes */
} Task;

static void rotate_query(const Task *t, int64_t s, float *rotated) {
    const GqaShape *g = t->g;
    const int64_t pos = t->past + s;
    for (int h = 0; h < t->group; h++) {
        const float *q = g->query + (t->b * g->seq + s) * g->heads * t->head + (t->kvh * t->group + h) * t->head;
        rotate(q, g->cos_cache + pos * g->rotary_half, g->sin_cache + pos * g->rotary_half, (int)g->rotary_half,
               t->head, rotated + h * t->head);
    }
}

static float *output_of(const Task *t, int64_t s) {
    const GqaShape *g = t->g;
    return g->output + (t->b * g->seq + s) * g->heads * t->head + t->kvh * t->group * t->head;
}

/* One query (a decode step's): its group's heads score each key with dots16, 16 keys at a time
 * while 16 keys fit in the buffer (past the row's end they are read, their scores never used),
 * plain dot products for the rest. Over int8 codes, q . (code x k_scale) = (q x k_scale) . code
 * and the values' sum takes v_scale once at the end, so the loops read the codes as they are (a
 * quarter of a float cache's bytes). scratch: group x (head + keys) floats. */
static inline __attribute__((always_inline)) void attend_one_over(const Task *t, int64_t s, float *scratch,
                                                                  int codes) {
    const int group = t->group, head = t->head;
    int64_t lo, end;
    key_range(t->g, t->past, s, &lo, &end);
    const int64_t n = end - lo;
    float *queries = scratch, *scores = scratch + group * head;
    rotate_query(t, s, queries);
    if (codes)
        for (int i = 0; i < group * head; i++) queries[i] *= t->k_scale[i % head];
    int64_t j = 0;
    for (; j < n && lo + j + 16 <= t->g->present_len; j += 16) {
        const int64_t at = (lo + j - t->base) * head;
        const int64_t used = n - j < 16 ? n - j : 16;
        for (int h = 0; h < group; h++) {
            store_scores(scores + h * n + j, dots16(queries + h * head, t->keys, at, head, codes) * t->alpha, used);
        }
    }
    for (; j < n; j++) {
        const int64_t at = (lo + j - t->base) * head;
        for (int h = 0; h < group; h++) {
            const float *q = queries + h * head;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head; d++) dot += q[d] * cached(t->keys, at + d, codes);
            scores[h * n + j] = dot * t->alpha;
        }
    }
    for (int h = 0; h < group; h++) softmax(scores + h * n, n, t->g->softcap);
    float *out = output_of(t, s);
    weigh_values(t->values, (lo - t->base) * head, scores, n, n, group, head, 0, out, codes);
    if (codes)
        for (int i = 0; i < group * head; i++) out[i] *= t->v_scale[i % head];
}

static void attend_one(const Task *t, int64_t s, float *scratch) {
    if (t->codes)
        attend_one_over(t, s, scratch, 1);
    else
        attend_one_over(t, s, scratch, 0);
}

/* The keys any query of [first, last) attends to: [lo, end). */
static void block_keys(const Task *t, int64_t first, int64_t last, int64_t *lo, int64_t *end) {
    int64_t unused;
    key_range(t->g, t->past, first, lo, &unused);
    key_range(t->g, t->past, last - 1, &unused, end);
}

/* A block of a prompt's queries [first, last): each 16 keys are transposed once into [head][16]
 * and every query vector of the block (queries x group heads) scores them with head broadcast
 * multiply-adds and no reductions, as a GEMM's micro-kernel would. The block's queries share all
 * but their last few keys, so all are scored against the block's whole key range; softmax reads
 * only the keys each query's mask allows. scratch: see block_scratch_floats. */
static void attend_block(const Task *t, int64_t first, int64_t last, float *scratch) {
    const int group = t->group, head = t->head;
    const int64_t rows = (last - first) * group, padded = (rows + 7) / 8 * 8;
    int64_t block_lo, block_end;
    block_keys(t, first, last, &block_lo, &block_end);
    const int64_t width = block_end - block_lo;
    float *queries = scratch;                    /* padded x head, rows past `rows` zero */
    float *scores = queries + padded * head;     /* padded x width */
    float *transposed = scores + padded * width; /* head x 16 */
    for (int64_t s = first; s < last; s++) rotate_query(t, s, queries + (s - first) * group * head);
    memset(queries + rows * head, 0, (size_t)(padded - rows) * head * sizeof(float));
    for (int64_t j0 = block_lo; j0 < block_end; j0 += 16) {
        const int64_t count = block_end - j0 < 16 ? block_end - j0 : 16;
        for (int d = 0; d < head; d++)
            for (int j = 0; j < 16; j++)
                transposed[d * 16 + j] = j < count ? ((const float *)t->keys)[(j0 + j - t->base) * head + d] : 0.0f;
        /* 8 query vectors at a time: 8 independent chains of multiply-adds share each load */
        for (int64_t r0 = 0; r0 < padded; r0 += 8) {
            v16 sums[8];
            for (int r = 0; r < 8; r++) sums[r] = (v16){0};
            for (int d = 0; d < head; d++) {
                const v16 k = load16(transposed + d * 16);
                for (int r = 0; r < 8; r++) sums[r] += queries[(r0 + r) * head + d] * k;
            }
            for (int r = 0; r < 8; r++)
                store_scores(scores + (r0 + r) * width + (j0 - block_lo), sums[r] * t->alpha, count);
        }
    }
    for (int64_t s = first; s < last; s++) {
        int64_t lo, end;
        key_range(t->g, t->past, s, &lo, &end);
        float *p = scores + (s - first) * group * width + (lo - block_lo);
        for (int h = 0; h < group; h++) softmax(p + h * width, end - lo, t->g->softcap);
    }
    /* Values a tile of keys at a time, each tile weighed into every query of the block while it
     * sits in the L1 cache: a query by itself would stream all the row's values from further out. */
    for (int64_t t0 = block_lo; t0 < block_end; t0 += VALUE_TILE) {
        const int64_t t1 = t0 + VALUE_TILE < block_end ? t0 + VALUE_TILE : block_end;
        for (int64_t s = first; s < last; s++) {
            int64_t lo, end;
            key_range(t->g, t->past, s, &lo, &end);
            const int64_t a = t0 > lo ? t0 : lo, b = t1 < end ? t1 : end;
            if (a >= b) continue; /* the tile holding lo starts each query's sums: a == lo there */
            const float *p = scores + (s - first) * group * width + (a - block_lo);
            weigh_values(t->values, (a - t->base) * head, p, width, b - a, group, head, a != lo, output_of(t, s), 0);
        }
    }
}

/* A prompt block over an int8 cache: the keys and values it reads, as floats (code x scale, as
 * onnxruntime dequantizes them) in `into` (2 x keys x head floats), and t made to read those. A
 * block reads each key for 32 queries, so converting them once costs little beside its work. */
static void dequantize_block(Task *t, int64_t first, int64_t last, float *into) {
    const int head = t->head;
    int64_t lo, end;
    block_keys(t, first, last, &lo, &end);
    float *keys = into, *values = into + (end - lo) * head;
    const int8_t *key_codes = (const int8_t *)t->keys + lo * head, *value_codes = (const int8_t *)t->values + lo * head;
    for (int64_t i = 0; i < (end - lo) * head; i++) {
        keys[i] = (float)key_codes[i] * t->k_scale[i % head];
        values[i] = (float)value_codes[i] * t->v_scale[i % head];
    }
    t->keys = keys;
    t->values = values;
    t->base = lo;
    t->codes = 0;
}

/* Prompts (several queries a task) take attend_block. */
static int blocked(const GqaShape *g) { return g->query_block > 1 && g->seq > 1; }

/* The most keys any query of the call attends to: the longest row's length, or the window. Scratch
 * follows it, not the buffer's length (a model's whole context, for a row that holds a few). */
static int64_t most_keys(const GqaShape *g) {
    int64_t most = 1;
    for (int64_t b = 0; b < g->batch; b++) {
        const int64_t end = past_length(g, b) + g->seq;
        most = end > most ? end : most;
    }
    return g->window > 0 && g->window < most ? g->window : most;
}

/* attend_block's scratch; dequantize_block's follows it. */
static size_t block_scratch_floats(const GqaShape *g) {
    const int64_t group = g->heads / g->kv_heads, padded = (g->query_block * group + 7) / 8 * 8;
    const int64_t width = g->query_block + most_keys(g);
    return (size_t)(padded * (g->head + width) + g->head * 16);
}

static size_t dequantized_floats(const GqaShape *g) {
    return g->k_scale != NULL ? (size_t)(2 * (g->query_block + most_keys(g)) * g->head) : 0;
}

int64_t gqa_attend_tasks(const GqaShape *g) {
    return g->batch * g->kv_heads * ((g->seq + g->query_block - 1) / g->query_block);
}

size_t gqa_scratch_floats(const GqaShape *g) {
    const int64_t group = g->heads / g->kv_heads;
    const size_t one = (size_t)(group * (g->head + most_keys(g)));
    return blocked(g) ? block_scratch_floats(g) + dequantized_floats(g) : one;
}

/* Task (b, kv head, block of queries): each key and value is loaded once for all the group's
 * query heads. scratch: gqa_scratch_floats(g) floats. */
void gqa_attend_task(const GqaShape *g, int64_t task, float *scratch) {
    const int64_t blocks = (g->seq + g->query_block - 1) / g->query_block;
    Task t = {.g = g, .b = task / (g->kv_heads * blocks), .kvh = (task / blocks) % g->kv_heads};
    t.past = past_length(g, t.b);
    t.group = (int)(g->heads / g->kv_heads);
    t.head = (int)g->head;
    t.alpha = g->scale == 0.0f ? 1.0f / sqrtf((float)g->head) : g->scale;
    t.keys = cache_row(g->present_key, g, t.b, t.kvh);
    t.values = cache_row(g->present_value, g, t.b, t.kvh);
    t.codes = g->k_scale != NULL;
    if (t.codes) {
        t.k_scale = g->k_scale + t.kvh * g->head;
        t.v_scale = g->v_scale + t.kvh * g->head;
    }
    const int64_t first = (task % blocks) * g->query_block;
    const int64_t last = first + g->query_block < g->seq ? first + g->query_block : g->seq;
    if (blocked(g)) {
        if (t.codes) dequantize_block(&t, first, last, scratch + block_scratch_floats(g));
        attend_block(&t, first, last, scratch);
        return;
    }
    for (int64_t s = first; s < last; s++) attend_one(&t, s, scratch);
}

/* The whole op on the calling thread: what the tests call through ctypes. 0: done; 1: no memory;
 * 2: a head size that is no multiple of 16 (onnxruntime's kernel refuses those too). */
int gqa_serial(const GqaShape *g) {
    if (g->head % 16 != 0) return 2;
    float *scratch = malloc(gqa_scratch_floats(g) * sizeof(float));
    if (scratch == NULL) return 1;
    for (int64_t t = 0; t < g->batch * g->kv_heads; t++) gqa_write_task(g, t);
    for (int64_t t = 0; t < gqa_attend_tasks(g); t++) gqa_attend_task(g, t, scratch);
    free(scratch);
    return 0;
}
