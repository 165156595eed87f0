/* The shapes and buffers of one GroupQueryAttention call (see gqa.c). */
#ifndef ORTFORGE_GQA_H
#define ORTFORGE_GQA_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int64_t batch, seq, heads, kv_heads, head;
    int64_t past_len;     /* past buffer's length (dim 2) */
    int64_t present_len;  /* present buffer's length (dim 2) */
    int64_t rotary_half;  /* cos_cache.shape[1] */
    int64_t window;       /* local_window_size; <= 0: none */
    int64_t query_block;  /* queries per task */
    int32_t first_prompt; /* seq == total_sequence_length */
    float scale, softcap;
    const int32_t *seqlens_k;
    const float *query, *key, *value;
    const void *past_key, *past_value; /* floats, or int8 codes when k_scale is set */
    const float *cos_cache, *sin_cache;
    float *output;
    void *present_key, *present_value;
    /* An int8 cache (onnxruntime's k_quant_type = v_quant_type = PER_CHANNEL, kv_cache_bit_width 8):
     * [kv_heads, head] scales, a channel's code its value x (1 / scale) rounded to the nearest (ties
     * to even) and saturated to [-128, 127]. NULL: the cache holds floats. */
    const float *k_scale, *v_scale;
} GqaShape;

void gqa_write_task(const GqaShape *g, int64_t task);
int64_t gqa_attend_tasks(const GqaShape *g);
void gqa_attend_task(const GqaShape *g, int64_t task, float *scratch);
size_t gqa_scratch_floats(const GqaShape *g);
int gqa_serial(const GqaShape *g);

#endif
