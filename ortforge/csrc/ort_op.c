/* gqa.c as an onnxruntime custom op: ai.ortforge GroupQueryAttention, the same inputs, outputs and
 * attributes as com.microsoft's, so a graph swaps one for the other by the nodes' domain
 * (a variant whose recipe says `attention: ortforge`: tasks/quantization/attention.py moves its nodes).
 * Two ops share the name, as onnxruntime allows when only types differ: one over a float KV cache,
 * one over an int8 cache with per-channel scales (inputs k_scale and v_scale); onnxruntime picks
 * by the cache's type. Inputs the kernel does not implement (position_ids, attention_bias,
 * head_sink) are refused when given, never ignored.
 *
 * onnxruntime's C API headers are not shipped by any package this project can install (the PyPI
 * wheel, npm's onnxruntime-node and Debian 12 carry none), so the few entries used are reached by
 * their place in the OrtApi table, which onnxruntime only ever appends to: each index below was
 * read off the public header and checked against a running onnxruntime. API_VERSION asks for the
 * table as of 1.17, which added KernelContext_ParallelFor, the newest entry used; every later
 * onnxruntime serves it. The op itself is described as of 1.16 (OP_VERSION: the fields up to
 * KernelComputeV2).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gqa.h"

#define API_VERSION 17
#define OP_VERSION 16
#define QUERY_BLOCK 32 /* a prompt's queries a task: each transposed block of keys serves 32 x group */
#define DOMAIN "ai.ortforge"

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtTypeAndShape OrtTypeAndShape;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef void *const *OrtApi; /* the table of function pointers */

typedef struct {
    OrtApi (*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* Places in the OrtApi table (0-based) */
enum {
    CREATE_STATUS = 0,
    CREATE_CUSTOM_OP_DOMAIN = 26,
    CUSTOM_OP_DOMAIN_ADD = 27,
    ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51,
    GET_DIMENSIONS_COUNT = 61,
    GET_DIMENSIONS = 62,
    GET_TENSOR_TYPE_AND_SHAPE = 65,
    KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
    KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_INFO_GET_ATTRIBUTE_STRING = 87,
    KERNEL_CONTEXT_GET_INPUT_COUNT = 88,
    KERNEL_CONTEXT_GET_INPUT = 90,
    KERNEL_CONTEXT_GET_OUTPUT = 91,
    RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
    KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { TYPE_FLOAT = 1, TYPE_INT8 = 3, TYPE_INT32 = 6, TYPE_INT64 = 7 };
enum { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1 };
/* com.microsoft GroupQueryAttention's inputs (onnxruntime 1.32): the nine the kernel always takes,
 * three it does not implement, and the int8 cache's scales */
enum { REQUIRED_INPUTS = 9, POSITION_IDS = 9, HEAD_SINK = 11, K_SCALE = 12, V_SCALE = 13, INPUTS = 14 };

#define CALL(api, index, type) ((type)(api)[index])

typedef OrtStatus *(*CreateStatusFn)(int, const char *);
typedef void (*ReleaseStatusFn)(OrtStatus *);

/* OrtCustomOp as onnxruntime reads it: at version 16, up to KernelComputeV2. */
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *, OrtApi, const OrtKernelInfo *);
    const char *(*GetName)(const OrtCustomOp *);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *);
    int (*GetInputType)(const OrtCustomOp *, size_t);
    size_t (*GetInputTypeCount)(const OrtCustomOp *);
    int (*GetOutputType)(const OrtCustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetOutputCharacteristic)(const OrtCustomOp *, size_t);
    int (*GetInputMemoryType)(const OrtCustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const OrtCustomOp *);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *, OrtApi, const OrtKernelInfo *, void **);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    void *InferOutputShapeFn, *GetStartVersion, *GetEndVersion, *GetMayInplace, *ReleaseMayInplace, *GetAliasMap,
        *ReleaseAliasMap;
};

static OrtApi API; /* set by RegisterCustomOps */

typedef struct {
    OrtApi api;
    int64_t heads, kv_heads, window;
    float scale, softcap;
    int codes; /* the int8-cache op */
} Kernel;

static const OrtCustomOp FLOAT_CACHE, INT8_CACHE; /* defined at the end */

static OrtStatus *fail(OrtApi api, int code, const char *message) {
    return CALL(api, CREATE_STATUS, CreateStatusFn)(code, message);
}

/* An attribute's value, or fallback when the node does not set it. */
static int64_t int_attribute(OrtApi api, const OrtKernelInfo *info, const char *name, int64_t fallback) {
    int64_t value = fallback;
    OrtStatus *status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_INT64,
                             OrtStatus * (*)(const OrtKernelInfo *, const char *, int64_t *))(info, name, &value);
    if (status != NULL) {
        CALL(api, RELEASE_STATUS, ReleaseStatusFn)(status);
        return fallback;
    }
    return value;
}

static float float_attribute(OrtApi api, const OrtKernelInfo *info, const char *name, float fallback) {
    float value = fallback;
    OrtStatus *status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT,
                             OrtStatus * (*)(const OrtKernelInfo *, const char *, float *))(info, name, &value);
    if (status != NULL) {
        CALL(api, RELEASE_STATUS, ReleaseStatusFn)(status);
        return fallback;
    }
    return value;
}

/* Whether string attribute `name` is `wanted` (an attribute the node does not set is "NONE"). */
static int string_attribute_is(OrtApi api, const OrtKernelInfo *info, const char *name, const char *wanted) {
    typedef OrtStatus *(*GetStringFn)(const OrtKernelInfo *, const char *, char *, size_t *);
    char value[32];
    size_t size = 0;
    OrtStatus *status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_STRING, GetStringFn)(info, name, NULL, &size);
    if (status != NULL) {
        CALL(api, RELEASE_STATUS, ReleaseStatusFn)(status);
        return strcmp(wanted, "NONE") == 0;
    }
    if (size > sizeof value) return 0; /* longer than any value the kernel knows */
    size = sizeof value;
    status = CALL(api, KERNEL_INFO_GET_ATTRIBUTE_STRING, GetStringFn)(info, name, value, &size);
    if (status != NULL) {
        CALL(api, RELEASE_STATUS, ReleaseStatusFn)(status);
        return 0;
    }
    return strcmp(value, wanted) == 0;
}

/* Why the node's cache attributes do not fit the op onnxruntime chose by the cache's type (NULL
 * when they do): an int8 cache is PER_CHANNEL at 8 bits; a float cache quantizes nothing. */
static const char *cache_refused(OrtApi api, const OrtKernelInfo *info, int codes) {
    if (codes) {
        if (!string_attribute_is(api, info, "k_quant_type", "PER_CHANNEL") ||
            !string_attribute_is(api, info, "v_quant_type", "PER_CHANNEL") ||
            int_attribute(api, info, "kv_cache_bit_width", 0) != 8)
            return "ai.ortforge GroupQueryAttention: an int8 cache needs k_quant_type and v_quant_type PER_CHANNEL "
                   "and kv_cache_bit_width 8 (per-tensor scales and 4-bit caches are not implemented)";
        return NULL;
    }
    if (!string_attribute_is(api, info, "k_quant_type", "NONE") || !string_attribute_is(api, info, "v_quant_type", "NONE"))
        return "ai.ortforge GroupQueryAttention: k_quant_type / v_quant_type set over a float cache "
               "(a quantized cache is int8 past_key and past_value)";
    return NULL;
}

/* Why the kernel cannot compute the node as its attributes describe it (NULL when it can). */
static const char *attributes_refused(OrtApi api, const OrtKernelInfo *info, const Kernel *kernel) {
    if (kernel->heads <= 0 || kernel->kv_heads <= 0 || kernel->heads % kernel->kv_heads != 0)
        return "ai.ortforge GroupQueryAttention: num_heads must be a positive multiple of kv_num_heads";
    if (int_attribute(api, info, "do_rotary", 0) != 1)
        return "ai.ortforge GroupQueryAttention: only do_rotary=1 (rotary inside) is implemented";
    if (int_attribute(api, info, "rotary_interleaved", 0) != 0)
        return "ai.ortforge GroupQueryAttention: interleaved rotary is not implemented";
    if (int_attribute(api, info, "smooth_softmax", 0) != 0)
        return "ai.ortforge GroupQueryAttention: smooth_softmax is not implemented";
    return cache_refused(api, info, kernel->codes);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApi given, const OrtKernelInfo *info, void **out) {
    (void)given; /* onnxruntime hands over the table as of OP_VERSION; API is as of API_VERSION */
    OrtApi api = API;
    Kernel *kernel = calloc(1, sizeof *kernel);
    if (kernel == NULL) return fail(api, ORT_FAIL, "ai.ortforge GroupQueryAttention: out of memory");
    kernel->api = api;
    kernel->heads = int_attribute(api, info, "num_heads", 0);
    kernel->kv_heads = int_attribute(api, info, "kv_num_heads", 0);
    kernel->window = int_attribute(api, info, "local_window_size", -1);
    kernel->scale = float_attribute(api, info, "scale", 0.0f);
    kernel->softcap = float_attribute(api, info, "softcap", 0.0f);
    kernel->codes = op == &INT8_CACHE;
    const char *refused = attributes_refused(api, info, kernel);
    if (refused != NULL) {
        free(kernel);
        return fail(api, ORT_INVALID_ARGUMENT, refused);
    }
    *out = kernel;
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }

/* A tensor's data and dimensions (up to 4). */
typedef struct {
    void *data;
    int64_t dims[4];
    size_t rank;
} Tensor;

static OrtStatus *describe(OrtApi api, const OrtValue *value, Tensor *tensor) {
    OrtTypeAndShape *info = NULL;
    OrtStatus *status =
        CALL(api, GET_TENSOR_TYPE_AND_SHAPE, OrtStatus * (*)(const OrtValue *, OrtTypeAndShape **))(value, &info);
    if (status != NULL) return status;
    status = CALL(api, GET_DIMENSIONS_COUNT, OrtStatus * (*)(const OrtTypeAndShape *, size_t *))(info, &tensor->rank);
    if (status == NULL && tensor->rank > 4)
        status = fail(api, ORT_INVALID_ARGUMENT, "ai.ortforge GroupQueryAttention: an input has more than 4 dims");
    if (status == NULL)
        status = CALL(api, GET_DIMENSIONS, OrtStatus * (*)(const OrtTypeAndShape *, int64_t *, size_t))(
            info, tensor->dims, tensor->rank);
    CALL(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(OrtTypeAndShape *))(info);
    if (status != NULL) return status;
    return CALL(api, GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(OrtValue *, void **))((OrtValue *)value, &tensor->data);
}

/* Input `index` into tensor; *given is 0 when the node leaves it out (an optional input). */
static OrtStatus *optional_input(OrtApi api, OrtKernelContext *context, size_t index, Tensor *tensor, int *given) {
    size_t count = 0;
    *given = 0;
    OrtStatus *status = CALL(api, KERNEL_CONTEXT_GET_INPUT_COUNT,
                             OrtStatus * (*)(const OrtKernelContext *, size_t *))(context, &count);
    if (status != NULL || index >= count) return status;
    const OrtValue *value = NULL;
    status = CALL(api, KERNEL_CONTEXT_GET_INPUT,
                  OrtStatus * (*)(const OrtKernelContext *, size_t, const OrtValue **))(context, index, &value);
    if (status != NULL || value == NULL) return status;
    *given = 1;
    return describe(api, value, tensor);
}

static OrtStatus *input(OrtApi api, OrtKernelContext *context, size_t index, Tensor *tensor) {
    int given = 0;
    OrtStatus *status = optional_input(api, context, index, tensor, &given);
    if (status == NULL && !given)
        return fail(api, ORT_INVALID_ARGUMENT, "ai.ortforge GroupQueryAttention: an input is missing");
    return status;
}

/* The int8 cache's scales, when the op is the int8-cache one: k_scale and v_scale, each
 * [1, kv_heads, 1, head] (one per channel); neither may be given over a float cache. */
static OrtStatus *cache_scales(const Kernel *kernel, OrtKernelContext *context, int64_t head, GqaShape *g) {
    OrtApi api = kernel->api;
    Tensor scales[2];
    for (int i = 0; i < 2; i++) {
        int given = 0;
        OrtStatus *status = optional_input(api, context, K_SCALE + i, &scales[i], &given);
        if (status != NULL) return status;
        if (given != kernel->codes)
            return fail(api, ORT_INVALID_ARGUMENT,
                        kernel->codes ? "ai.ortforge GroupQueryAttention: an int8 cache needs k_scale and v_scale"
                                      : "ai.ortforge GroupQueryAttention: k_scale / v_scale given over a float cache");
        if (given && (scales[i].rank != 4 || scales[i].dims[0] != 1 || scales[i].dims[1] != kernel->kv_heads ||
                      scales[i].dims[2] != 1 || scales[i].dims[3] != head))
            return fail(api, ORT_INVALID_ARGUMENT,
                        "ai.ortforge GroupQueryAttention: k_scale and v_scale must be [1, kv_num_heads, 1, head] "
                        "(per channel)");
    }
    if (kernel->codes) {
        g->k_scale = scales[0].data;
        g->v_scale = scales[1].data;
    }
    return NULL;
}

/* None of the inputs the kernel does not implement is given (leaving them out is onnxruntime's
 * default: positions from seqlens_k, no bias, no sink). */
static OrtStatus *no_unimplemented_inputs(OrtApi api, OrtKernelContext *context) {
    for (size_t i = POSITION_IDS; i <= HEAD_SINK; i++) {
        Tensor unused;
        int given = 0;
        OrtStatus *status = optional_input(api, context, i, &unused, &given);
        if (status != NULL) return status;
        if (given)
            return fail(api, ORT_INVALID_ARGUMENT,
                        "ai.ortforge GroupQueryAttention: position_ids, attention_bias and head_sink are not "
                        "implemented: leave them out, or use com.microsoft's kernel");
    }
    return NULL;
}

static OrtStatus *output(OrtApi api, OrtKernelContext *context, size_t index, const int64_t *dims, void **data) {
    OrtValue *value = NULL;
    OrtStatus *status =
        CALL(api, KERNEL_CONTEXT_GET_OUTPUT,
             OrtStatus * (*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(context, index, dims,
                                                                                                  index == 0 ? 3 : 4,
                                                                                                  &value);
    if (status != NULL) return status;
    return CALL(api, GET_TENSOR_MUTABLE_DATA, OrtStatus * (*)(OrtValue *, void **))(value, data);
}

typedef struct {
    const GqaShape *shape;
    volatile int out_of_memory;
} Work;

static void write_one(void *work, size_t task) { gqa_write_task(((Work *)work)->shape, (int64_t)task); }

static void attend_one_task(void *work, size_t task) {
    Work *w = work;
    float *scratch = malloc(gqa_scratch_floats(w->shape) * sizeof(float));
    if (scratch == NULL) {
        w->out_of_memory = 1;
        return;
    }
    gqa_attend_task(w->shape, (int64_t)task, scratch);
    free(scratch);
}

typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

/* Every row's past, new tokens and positions fit its buffers and the rotary tables: checked before
 * any write, so no input can make the kernel touch memory outside them. */
static const char *check_rows(const GqaShape *g, int64_t cos_rows) {
    for (int64_t b = 0; b < g->batch; b++) {
        const int64_t total = (int64_t)g->seqlens_k[b] + 1;
        const int64_t past = g->first_prompt ? 0 : total - g->seq;
        if (total < 1 || past < 0) return "ai.ortforge GroupQueryAttention: seqlens_k holds fewer tokens than the run";
        if (past + g->seq > g->present_len) return "ai.ortforge GroupQueryAttention: a row outgrows its KV buffer";
        if (past + g->seq > cos_rows) return "ai.ortforge GroupQueryAttention: a position outgrows the rotary tables";
        if (!g->first_prompt && past > g->past_len) return "ai.ortforge GroupQueryAttention: a row's past outgrows past_key";
    }
    return NULL;
}

static OrtStatus *compute(void *opaque, OrtKernelContext *context) {
    const Kernel *kernel = opaque;
    OrtApi api = kernel->api;
    Tensor t[REQUIRED_INPUTS];
    OrtStatus *status = no_unimplemented_inputs(api, context);
    for (size_t i = 0; i < REQUIRED_INPUTS && status == NULL; i++) status = input(api, context, i, &t[i]);
    if (status != NULL) return status;
    const Tensor *query = &t[0], *key = &t[1], *value = &t[2], *past_key = &t[3], *past_value = &t[4];
    const Tensor *seqlens = &t[5], *total = &t[6], *cos_cache = &t[7], *sin_cache = &t[8];
    if (query->rank != 3 || key->rank != 3 || value->rank != 3 || past_key->rank != 4 || past_value->rank != 4 ||
        cos_cache->rank != 2 || sin_cache->rank != 2)
        return fail(api, ORT_INVALID_ARGUMENT, "ai.ortforge GroupQueryAttention: inputs of unexpected rank");
    const int64_t batch = query->dims[0], seq = query->dims[1], head = past_key->dims[3];
    GqaShape g = {
        .batch = batch, .seq = seq, .heads = kernel->heads, .kv_heads = kernel->kv_heads, .head = head,
        .past_len = past_key->dims[2], .rotary_half = cos_cache->dims[1], .window = kernel->window,
        .query_block = QUERY_BLOCK, .scale = kernel->scale, .softcap = kernel->softcap,
        .seqlens_k = seqlens->data, .query = query->data, .key = key->data, .value = value->data,
        .past_key = past_key->data, .past_value = past_value->data,
        .cos_cache = cos_cache->data, .sin_cache = sin_cache->data,
    };
    int64_t total_count = 1;
    for (size_t i = 0; i < total->rank; i++) total_count *= total->dims[i];
    if (total_count != 1)
        return fail(api, ORT_INVALID_ARGUMENT, "ai.ortforge GroupQueryAttention: total_sequence_length must hold one value");
    const int64_t total_length = *(const int32_t *)total->data;
    g.present_len = g.past_len > total_length ? g.past_len : total_length;
    g.first_prompt = seq == total_length;
    int64_t seqlen_count = 1;
    for (size_t i = 0; i < seqlens->rank; i++) seqlen_count *= seqlens->dims[i];
    if (head % 16 != 0 || query->dims[2] != kernel->heads * head || key->dims[2] != kernel->kv_heads * head ||
        value->dims[2] != key->dims[2] || key->dims[0] != batch || key->dims[1] != seq ||
        past_key->dims[0] != batch || past_key->dims[1] != kernel->kv_heads ||
        memcmp(past_key->dims, past_value->dims, sizeof past_key->dims) != 0 || seqlen_count != batch ||
        2 * g.rotary_half > head || cos_cache->dims[0] != sin_cache->dims[0] ||
        cos_cache->dims[1] != sin_cache->dims[1])
        return fail(api, ORT_INVALID_ARGUMENT, "ai.ortforge GroupQueryAttention: input shapes do not agree");
    const char *refused = check_rows(&g, cos_cache->dims[0]);
    if (refused != NULL) return fail(api, ORT_INVALID_ARGUMENT, refused);
    if ((status = cache_scales(kernel, context, head, &g)) != NULL) return status;
    const int64_t out_dims[3] = {batch, seq, kernel->heads * head};
    const int64_t cache_dims[4] = {batch, kernel->kv_heads, g.present_len, head};
    if ((status = output(api, context, 0, out_dims, (void **)&g.output)) != NULL) return status;
    if ((status = output(api, context, 1, cache_dims, &g.present_key)) != NULL) return status;
    if ((status = output(api, context, 2, cache_dims, &g.present_value)) != NULL) return status;
    Work work = {.shape = &g};
    ParallelForFn parallel_for = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn);
    if ((status = parallel_for(context, write_one, (size_t)(batch * kernel->kv_heads), 0, &work)) != NULL)
        return status;
    if ((status = parallel_for(context, attend_one_task, (size_t)gqa_attend_tasks(&g), 0, &work)) != NULL)
        return status;
    return work.out_of_memory ? fail(api, ORT_FAIL, "ai.ortforge GroupQueryAttention: out of memory") : NULL;
}

static const char *op_name(const OrtCustomOp *op) {
    (void)op;
    return "GroupQueryAttention";
}

/* The KV cache's element type: what onnxruntime tells the two ops apart by. */
static int cache_type(const OrtCustomOp *op) { return op == &INT8_CACHE ? TYPE_INT8 : TYPE_FLOAT; }

static int input_type(const OrtCustomOp *op, size_t index) {
    switch (index) {
    case 3: case 4: return cache_type(op); /* past_key, past_value */
    case 5: case 6: return TYPE_INT32;     /* seqlens_k, total_sequence_length */
    case POSITION_IDS: return TYPE_INT64;
    default: return TYPE_FLOAT;
    }
}

static size_t input_count(const OrtCustomOp *op) {
    (void)op;
    return INPUTS;
}

static int output_type(const OrtCustomOp *op, size_t index) {
    return index == 0 ? TYPE_FLOAT : cache_type(op); /* output, present_key, present_value */
}

static size_t output_count(const OrtCustomOp *op) {
    (void)op;
    return 3;
}

static int input_characteristic(const OrtCustomOp *op, size_t index) {
    (void)op;
    return index < REQUIRED_INPUTS ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

static int required(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return INPUT_OUTPUT_REQUIRED;
}

static int default_memory(const OrtCustomOp *op, size_t index) {
    (void)op, (void)index;
    return 0; /* OrtMemTypeDefault */
}

static const char *on_cpu(const OrtCustomOp *op) {
    (void)op;
    return NULL; /* the CPU execution provider */
}

static int no_variadic(const OrtCustomOp *op) {
    (void)op;
    return 1; /* read for every op from version 14, used only by variadic ones */
}

/* Every callback up to OP_VERSION is set: onnxruntime calls them without looking. The two ops
 * differ only in their cache's type (cache_type). */
#define GROUP_QUERY_ATTENTION                                                                                           \
    {                                                                                                                  \
        .version = OP_VERSION, .GetName = op_name, .GetExecutionProviderType = on_cpu, .GetInputType = input_type,    \
        .GetInputTypeCount = input_count, .GetOutputType = output_type, .GetOutputTypeCount = output_count,          \
        .KernelDestroy = destroy_kernel, .GetInputCharacteristic = input_characteristic,                             \
        .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory,                                   \
        .GetVariadicInputMinArity = no_variadic, .GetVariadicInputHomogeneity = no_variadic,                         \
        .GetVariadicOutputMinArity = no_variadic, .GetVariadicOutputHomogeneity = no_variadic,                       \
        .CreateKernelV2 = create_kernel, .KernelComputeV2 = compute,                                                 \
    }
static const OrtCustomOp FLOAT_CACHE = GROUP_QUERY_ATTENTION;
static const OrtCustomOp INT8_CACHE = GROUP_QUERY_ATTENTION;

/* What SessionOptions.register_custom_ops_library calls. The domain lives as long as the process:
 * onnxruntime keeps using it for every session made with these options. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    OrtApi api = base->GetApi(API_VERSION);
    if (api == NULL) return NULL; /* an onnxruntime before 1.17: the op stays unknown, and the session says so */
    API = api;
    OrtCustomOpDomain *domain = NULL;
    OrtStatus *status =
        CALL(api, CREATE_CUSTOM_OP_DOMAIN, OrtStatus * (*)(const char *, OrtCustomOpDomain **))(DOMAIN, &domain);
    if (status != NULL) return status;
    const OrtCustomOp *ops[] = {&FLOAT_CACHE, &INT8_CACHE};
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++) {
        status = CALL(api, CUSTOM_OP_DOMAIN_ADD, OrtStatus * (*)(OrtCustomOpDomain *, const OrtCustomOp *))(domain, ops[i]);
        if (status != NULL) return status;
    }
    return CALL(api, ADD_CUSTOM_OP_DOMAIN, OrtStatus * (*)(OrtSessionOptions *, OrtCustomOpDomain *))(options, domain);
}
