"""ortforge's own kernels (ortforge/custom_ops.py): the attention kernel computes what
onnxruntime's GroupQueryAttention does, on every path and on any batch (a property), never touches
memory outside its buffers (a fuzz); a variant built on it runs in the runtime as its twin on
onnxruntime's kernel does; what cannot be had is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from ortforge import Decoder, create_session, custom_ops, names
from ortforge.manifest import read_manifest
from tasks import quantize
from tasks.core.errors import StageError
from tasks.evaluation.metrics import full_pass_logits
from tasks.quantization.configs import quantize_config
from tests.conftest import assert_batched_decode_equals_batch_1


@pytest.mark.parametrize(
    ("shape", "lengths", "new", "room", "attributes", "rotary_half"),
    [
        ((9, 3, 64), [1], 1, 16, {}, 0),  # a first token
        ((9, 3, 64), [5, 9, 1, 40], 1, 48, {}, 0),  # a step over rows of different lengths
        ((9, 3, 64), [37], 37, 40, {}, 0),  # a prompt
        ((9, 3, 64), [37], 21, 40, {}, 0),  # a prompt's second piece
        ((4, 1, 256), [40], 40, 64, {"local_window": 8}, 0),  # Gemma's sliding layers
        ((4, 1, 256), [30, 50], 1, 64, {"local_window": 8}, 0),
        ((4, 1, 256), [30, 50], 1, 64, {"softcap": 5.0, "scale": 0.0625}, 0),  # Gemma 2's softcap
        ((8, 2, 64), [20], 20, 32, {}, 16),  # partial rotary: 32 of 64 channels
        ((14, 2, 64), [40], 40, 48, {}, 0),  # a group of 7 query heads (Qwen2.5 0.5B)
        ((14, 2, 64), [40, 9], 1, 48, {}, 0),
    ],
)
def test_hand_written_attention_computes_what_onnxruntimes_does(
    hand_written_kernel, shape, lengths, new, room, attributes, rotary_half
):
    """The kernel attention_kernel.py times keeps onnxruntime's contract: the same output and the
    same cache (new keys rotated and written at each row's own position), on every path."""
    import onnxruntime as ort

    from benchmarks import attention, attention_kernel

    attributes = dict(attributes)  # parametrize's own dict, kept whole for a rerun
    window = attributes.pop("local_window", -1)
    ort_attributes = {"local_window_size": window, "softcap": 0.0, "scale": 0.0} | attributes
    session = ort.InferenceSession(
        attention.attention_model(*shape, None, **ort_attributes), providers=["CPUExecutionProvider"]
    )
    arrays = attention_kernel.inputs(shape, lengths, new, room, np.random.default_rng(1), rotary_half)
    kernel_attributes = {"window": window, "softcap": ort_attributes["softcap"], "scale": ort_attributes["scale"]}
    assert attention_kernel.difference(session, hand_written_kernel, arrays, shape[0], **kernel_attributes) < 1e-5


def attention_sessions(kernel_library, shape, model=None, **attributes):
    """One GroupQueryAttention node as com.microsoft's and as ai.ortforge's (2 threads each);
    model: the two graphs' bytes, when not the float-cache node attention.py writes."""
    import onnxruntime as ort

    from benchmarks import attention

    if model is None:
        model = [attention.attention_model(*shape, None, kernel, **attributes) for kernel in attention.KERNELS]
    stock, ours = model
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(kernel_library))
    cpu = ["CPUExecutionProvider"]
    return ort.InferenceSession(stock, providers=cpu), ort.InferenceSession(ours, options, providers=cpu)


@pytest.mark.parametrize(
    ("shape", "lengths", "new", "room", "window"),
    [
        ((9, 3, 64), [5, 9, 1, 40], 1, 48, -1),  # a step over rows of different lengths
        ((9, 3, 64), [37], 37, 40, -1),  # a prompt
        ((9, 3, 64), [37], 21, 40, -1),  # a prompt's second piece
        ((4, 1, 256), [30, 50], 1, 64, 8),  # Gemma's sliding layers
    ],
)
def test_the_kernel_as_an_onnxruntime_op_computes_what_onnxruntimes_does(
    kernel_library, shape, lengths, new, room, window
):
    """ai.ortforge GroupQueryAttention in a session, on onnxruntime's threads: the same output and
    cache as com.microsoft's, whether past and present share one buffer (as BatchDecoder binds
    them) or onnxruntime allocates the present (a plain run)."""
    from benchmarks import attention_kernel

    sessions = attention_sessions(kernel_library, shape, local_window_size=window, scale=0.0)
    arrays = attention_kernel.inputs(shape, lengths, new, room, np.random.default_rng(2))
    shared = [attention_kernel.onnxruntime_results(session, arrays) for session in sessions]
    separate = [session.run(None, arrays) for session in sessions]
    for theirs, ours in (shared, separate):
        assert [a.shape for a in theirs] == [b.shape for b in ours]
        assert attention_kernel.largest_difference(theirs, ours) < 1e-5


def int8_cache_graphs(shape, rng, **attributes):
    """One GroupQueryAttention node over an int8 cache as com.microsoft's and as ai.ortforge's, its
    per-channel scales drawn from rng (small enough that some unit-normal keys and values saturate
    a code)."""
    import onnx

    from benchmarks import attention

    graphs = (attention.attention_model(*shape, 8, kernel, **attributes) for kernel in attention.KERNELS)
    stock, ours = map(onnx.load_from_string, graphs)
    for scales, twin in zip(stock.graph.initializer, ours.graph.initializer, strict=True):
        drawn = rng.uniform(0.01, 0.05, size=tuple(scales.dims)).astype(np.float32)
        scales.CopyFrom(onnx.numpy_helper.from_array(drawn, scales.name))
        twin.CopyFrom(scales)
    return stock, ours


def int8_cache_sessions(kernel_library, shape, rng, **attributes):
    stock, ours = int8_cache_graphs(shape, rng, **attributes)
    return attention_sessions(kernel_library, shape, model=(stock.SerializeToString(), ours.SerializeToString()))


@pytest.mark.parametrize(
    ("shape", "lengths", "new", "room", "window"),
    [
        ((9, 3, 64), [1], 1, 16, -1),  # a first token
        ((9, 3, 64), [5, 9, 1, 40], 1, 48, -1),  # a step over rows of different lengths
        ((9, 3, 64), [37], 37, 40, -1),  # a prompt
        ((9, 3, 64), [37], 21, 40, -1),  # a prompt's second piece
        ((4, 1, 256), [40], 40, 64, 8),  # Gemma's sliding layers
        ((4, 1, 256), [30, 50], 1, 64, 8),
        ((14, 2, 64), [40, 9], 1, 48, -1),  # a group of 7 query heads
        ((8, 2, 80), [70], 70, 72, -1),  # a head of 64 + 16 channels, a prompt of three blocks
    ],
)
def test_over_an_int8_cache_the_op_computes_what_onnxruntimes_does(kernel_library, shape, lengths, new, room, window):
    """The int8-cache op (past and present int8, k_scale and v_scale per channel): the same codes
    written, saturated ones too, and the same output within float rounding, on every path."""
    from benchmarks import attention_kernel

    rng = np.random.default_rng(len(lengths) * 31 + new)
    sessions = int8_cache_sessions(kernel_library, shape, rng, local_window_size=window)
    arrays = attention_kernel.inputs(shape, lengths, new, room, rng)
    for kind in ("past_key", "past_value"):
        arrays[kind] = rng.integers(-100, 101, size=arrays[kind].shape, dtype=np.int8)  # 127 and -128: written
    for results in (
        [attention_kernel.onnxruntime_results(s, arrays) for s in sessions],
        [s.run(None, arrays) for s in sessions],
    ):
        (theirs_out, *theirs_cache), (ours_out, *ours_cache) = results
        assert np.abs(theirs_out - ours_out).max() < 1e-4
        for theirs, ours in zip(theirs_cache, ours_cache, strict=True):
            assert ours.dtype == np.int8 and np.array_equal(theirs, ours)
    assert all(127 in cache and -128 in cache for cache in results[1][1:])  # new keys and values saturated


def test_the_op_agrees_with_onnxruntime_on_any_batch_it_is_given(kernel_library):
    """Property: for random head layouts, steps over batches of rows at random lengths and prompts
    or prompt pieces of random size, with or without a local window, over a float or an int8
    cache, the op's output and cache are onnxruntime's (within float rounding)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from benchmarks import attention_kernel

    layouts = st.sampled_from([(4, 1, 16), (6, 2, 32), (9, 3, 64), (8, 8, 16), (14, 2, 64)])

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        layouts,
        st.lists(st.integers(1, 70), min_size=1, max_size=4),
        st.integers(1, 40),
        st.sampled_from([-1, 5, 16]),
        st.booleans(),
    )
    def agrees(shape, held, new, window, int8_cache):
        if new > 1:  # onnxruntime takes a prompt piece one row at a time (so does BatchDecoder)
            held = held[:1]
        lengths = [h + new for h in held]  # each row holds `h` tokens before this run of `new`
        room = max(lengths) + 3
        rng = np.random.default_rng(len(lengths) * 97 + new)
        if int8_cache:
            sessions = int8_cache_sessions(kernel_library, shape, rng, local_window_size=window)
        else:
            sessions = attention_sessions(kernel_library, shape, local_window_size=window, scale=0.0)
        arrays = attention_kernel.inputs(shape, lengths, new, room, rng)
        if int8_cache:
            for kind in ("past_key", "past_value"):
                arrays[kind] = rng.integers(-128, 128, size=arrays[kind].shape, dtype=np.int8)
        theirs, ours = (attention_kernel.onnxruntime_results(session, arrays) for session in sessions)
        assert attention_kernel.largest_difference(theirs, ours) < 1e-4  # int8 caches: the same codes

    agrees()


def test_no_lengths_make_the_op_touch_memory_outside_its_buffers(kernel_library):
    """Fuzz: seqlens_k and total_sequence_length drawn anywhere, sane or not; the op computes or
    refuses in one error, and the process lives (a write outside a buffer would crash it, or
    corrupt the heap for a later example)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from benchmarks import attention_kernel

    shape = (4, 2, 16)
    _, ours = attention_sessions(kernel_library, shape)
    lengths = st.lists(st.integers(-3, 40), min_size=1, max_size=3)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(lengths, st.integers(1, 12), st.integers(-3, 40))
    def survives(seqlens, new, total):
        arrays = attention_kernel.inputs(shape, [new] * len(seqlens), new, 16, np.random.default_rng(0))
        arrays["seqlens_k"] = np.array([[n] for n in seqlens], dtype=np.int32)
        arrays["total_sequence_length"] = np.array(total, dtype=np.int32)
        try:
            ours.run(None, arrays)
        except Exception as error:  # onnxruntime's own checks, or the op's one line
            assert "GroupQueryAttention" in str(error)

    survives()


def test_the_op_refuses_a_row_that_outgrows_its_buffer(kernel_library):
    """A seqlens_k past the KV buffer is an error naming the cause, before any write (the kernel
    would otherwise write outside the buffer)."""
    from benchmarks import attention_kernel

    _, ours = attention_sessions(kernel_library, (9, 3, 64))
    arrays = attention_kernel.inputs((9, 3, 64), [10], 1, 10, np.random.default_rng(3))
    arrays["seqlens_k"][:] = 500
    with pytest.raises(Exception, match="a row outgrows its KV buffer"):
        ours.run(None, arrays)


def test_the_int8_cache_op_rounds_ties_and_saturates_as_onnxruntime_does(kernel_library):
    """Codes written at position 0 (no rotation) from values on a tie by division (2.25 / 0.5 and
    -1.0308809 / 0.02425602 are n.5 exactly) and past int8's range: onnxruntime multiplies by the
    scale's reciprocal and rounds ties to even, and so must the op (hypothesis found the second)."""
    import onnx

    values = np.array([2.25, 2.75, -2.25, 0.25, 100.0, -100.0, -1.0308809, 0.0], dtype=np.float32)
    scales = np.array([0.5] * 6 + [0.02425602, 0.5], dtype=np.float32)
    stock, ours = int8_cache_graphs((1, 1, 16), np.random.default_rng(0))
    for graph in (stock, ours):
        for initializer in graph.graph.initializer:
            tiled = np.tile(scales, 2).reshape(1, 1, 1, 16)
            initializer.CopyFrom(onnx.numpy_helper.from_array(tiled, initializer.name))
    key = np.tile(values, 2).reshape(1, 1, 16)
    arrays = {
        "query": np.zeros((1, 1, 16), np.float32), "key": key, "value": key.copy(),
        "past_key": np.zeros((1, 1, 4, 16), np.int8), "past_value": np.zeros((1, 1, 4, 16), np.int8),
        "seqlens_k": np.array([[0]], np.int32), "total_sequence_length": np.array(1, np.int32),
        "cos_cache": np.ones((4, 8), np.float32), "sin_cache": np.zeros((4, 8), np.float32),
    }  # fmt: skip
    sessions = attention_sessions(kernel_library, None, model=(stock.SerializeToString(), ours.SerializeToString()))
    theirs, ours_written = (session.run(None, arrays)[1][0, 0, 0, :8] for session in sessions)
    assert theirs.tolist() == [4, 6, -4, 0, 127, -128, -43, 0]
    assert np.array_equal(theirs, ours_written)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"k_quant_type": "PER_TENSOR"}, "an int8 cache needs k_quant_type and v_quant_type PER_CHANNEL"),
        ({"kv_cache_bit_width": 4}, "kv_cache_bit_width 8"),
        ({"input": (9, "position_ids")}, "position_ids, attention_bias and head_sink are not implemented"),
    ],
)
def test_what_the_int8_cache_op_does_not_implement_is_refused_not_ignored(kernel_library, change, says):
    import onnx

    from benchmarks import attention_kernel

    rng = np.random.default_rng(4)
    stock, ours = int8_cache_graphs((9, 3, 64), rng)
    node = ours.graph.node[0]
    arrays = attention_kernel.inputs((9, 3, 64), [5], 1, 8, rng)
    for kind in ("past_key", "past_value"):
        arrays[kind] = np.zeros(arrays[kind].shape, dtype=np.int8)
    if "input" in change:
        index, name = change["input"]
        node.input[index] = name
        ours.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, ["B", "S"]))
        arrays[name] = np.array([[4]], dtype=np.int64)
    for attribute in node.attribute:
        if attribute.name in change:
            attribute.CopyFrom(onnx.helper.make_attribute(attribute.name, change[attribute.name]))
    with pytest.raises(Exception, match=says):
        _, session = attention_sessions(
            kernel_library, None, model=(stock.SerializeToString(), ours.SerializeToString())
        )
        session.run(None, arrays)


def test_a_variant_on_our_kernel_imports_its_domain_and_moves_every_attention_node(on_our_kernel, built):
    import onnx

    assert read_manifest(on_our_kernel)["params"]["attention"] == "ortforge"
    # its twin's manifest does not mention the key: variants from before it keep their bytes
    assert "attention" not in read_manifest(built["fp32"])["params"]
    graph = onnx.load(str(on_our_kernel / names.MODEL_FILE), load_external_data=False)
    attention_domains = {n.domain for n in graph.graph.node if n.op_type == "GroupQueryAttention"}
    assert attention_domains == {custom_ops.DOMAIN}
    assert custom_ops.opset_domains(on_our_kernel / names.MODEL_FILE) == {o.domain for o in graph.opset_import}
    assert custom_ops.DOMAIN not in custom_ops.opset_domains(built["fp32"] / names.MODEL_FILE)


def test_the_domains_are_read_past_a_graph_that_holds_its_weights(tmp_path):
    """The opset imports follow the graph in the file; a graph with its weights inside is skipped
    unread, and a file that is no model names no domain (onnxruntime then says why)."""
    import onnx

    weights = onnx.numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
    node = onnx.helper.make_node("MatMul", ["x", "w"], ["y"])
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 256])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 256])
    graph = onnx.helper.make_graph([node], "g", [x], [y], [weights])
    imports = [onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid(custom_ops.DOMAIN, 1)]
    onnx.save(onnx.helper.make_model(graph, opset_imports=imports), tmp_path / "model.onnx")
    assert custom_ops.opset_domains(tmp_path / "model.onnx") == {"", custom_ops.DOMAIN}
    for junk in (b"", b"\xff\xff\xff", b"not a model at all"):
        (tmp_path / "junk.onnx").write_bytes(junk)
        assert custom_ops.opset_domains(tmp_path / "junk.onnx") == set()


def test_a_variant_on_our_kernel_computes_what_its_twin_does(on_our_kernel, built):
    """The runtime registers the kernel by itself; a prompt's logits and then cached steps' are the
    twin's within float rounding."""
    ids = [5, 17, 99, 250, 3, 7, 11, 200, 42, 8, 9, 120]
    theirs = full_pass_logits(Decoder(create_session(built["fp32"])), ids)
    ours = full_pass_logits(Decoder(create_session(on_our_kernel)), ids)
    assert np.abs(theirs - ours).max() < 1e-4
    decoders = [Decoder(create_session(folder)) for folder in (built["fp32"], on_our_kernel)]
    steps = []
    for decoder in decoders:
        logits, cache = decoder.forward(np.array([ids[:6]]), decoder.empty_cache())
        for token in ids[6:]:
            logits, cache = decoder.forward(np.array([[token]]), cache, last_only=True)
        steps.append(logits)
    assert np.abs(steps[0] - steps[1]).max() < 1e-4


@pytest.fixture(scope="module")
def int8_cache_twins(built, params, kernel_library, tmp_path_factory) -> dict[str, object]:
    """The tiny model's fp32 weights over an int8 cache, on onnxruntime's kernel and on ours."""
    root = tmp_path_factory.mktemp("int8_cache")
    out = {}
    for name, attention in (("onnxruntime", "onnxruntime"), ("ortforge", "ortforge")):
        out[name] = root / name
        recipe = quantize_config(method="fp32", kv_cache="int8", attention=attention)
        record = {"model": "tiny", "variant": f"fp32_kv8_{name}", "tool_versions": {}}
        quantize.run(recipe, built["optimized"], built["hf"], out[name], record, params.calibration)
    return out


def test_a_variant_on_our_kernel_over_an_int8_cache_computes_what_its_twin_does(int8_cache_twins):
    """kv_cache: int8 with attention: ortforge keeps the cache's scales on our nodes; a prompt and
    then cached steps give the logits of the same recipe on onnxruntime's kernel (the same codes
    stored), and so does the float-cache twin validate measures the cache's error against."""
    import onnx

    from tasks.quantization import kv_cache

    graph = onnx.load(str(int8_cache_twins["ortforge"] / names.MODEL_FILE), load_external_data=False)
    nodes = kv_cache.attention_nodes(graph)
    assert nodes and all(n.domain == custom_ops.DOMAIN and n.input[kv_cache.V_SCALE_INPUT] for n in nodes)
    assert kv_cache.stored_bits(graph) == 8
    ids = [5, 17, 99, 250, 3, 7, 11, 200, 42, 8, 9, 120]
    steps = []
    for folder in (int8_cache_twins["onnxruntime"], int8_cache_twins["ortforge"]):
        decoder = Decoder(create_session(folder))
        logits, cache = decoder.forward(np.array([ids[:6]]), decoder.empty_cache())
        for token in ids[6:]:
            logits, cache = decoder.forward(np.array([[token]]), cache, last_only=True)
        steps.append(logits)
    assert np.abs(steps[0] - steps[1]).max() < 1e-4
    twin = kv_cache.float_cache(graph)
    assert kv_cache.stored_bits(twin) == 32 and {n.domain for n in kv_cache.attention_nodes(twin)} == {
        custom_ops.DOMAIN
    }


def test_batched_decode_on_our_kernel_over_an_int8_cache_equals_batch_1(int8_cache_twins):
    assert_batched_decode_equals_batch_1(int8_cache_twins["ortforge"])


def test_no_compiler_is_said_in_one_line_naming_cc(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(custom_ops.KernelUnavailable, match="'no-such-compiler' is not on PATH.*set CC"):
        custom_ops.library()


def test_a_failed_build_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(custom_ops, "SOURCES", (broken,))
    monkeypatch.setenv(custom_ops.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(custom_ops.KernelUnavailable, match="could not build"):
        custom_ops.library()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_the_build_refuses_what_the_kernel_cannot_run_before_work(built, built_optimum, kernel_library, tmp_path):
    import onnx

    from tasks.quantization import attention

    with pytest.raises(StageError, match="has none: set attention: onnxruntime"):
        quantize.run(
            quantize_config(method="fp32", attention="ortforge"),
            built_optimum["optimized"],
            built["hf"],
            tmp_path / "optimum",
            {},
        )
    assert not (tmp_path / "optimum").exists()
    node = onnx.helper.make_node("GroupQueryAttention", ["q"] * 9, ["o"], domain="com.microsoft", do_rotary=0)
    assert "do_rotary is 0" in attention.unsupported(node, 64)
    node = onnx.helper.make_node("GroupQueryAttention", ["q"] * 9, ["o"], domain="com.microsoft", do_rotary=1)
    assert attention.unsupported(node, 64) is None and "not a multiple of 16" in attention.unsupported(node, 40)
    node.input.extend(["", "", "", "k_scale", "v_scale"])  # an int8 cache's scales: taken
    assert attention.unsupported(node, 64) is None
    node.input[9] = "position_ids"
    assert "inputs beyond the nine the kernel takes and an int8 cache's scales (position_ids)" in attention.unsupported(
        node, 64
    )


def test_the_kernel_reads_a_float_or_int8_cache_only():
    assert quantize_config(method="int8_per_token", attention="ortforge", kv_cache="int8").kv_bits == 8
    with pytest.raises(ValueError, match="reads a float or int8 KV cache and kv_cache is int4: set kv_cache: int8"):
        quantize_config(method="int8_per_token", attention="ortforge", kv_cache="int4")
