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


def attention_sessions(kernel_library, shape, **attributes):
    """One GroupQueryAttention node as com.microsoft's and as ai.ortforge's (2 threads each)."""
    import onnx
    import onnxruntime as ort

    from benchmarks import attention

    stock = attention.attention_model(*shape, None, **attributes)
    ours = onnx.load_from_string(stock)
    ours.graph.node[0].domain = custom_ops.DOMAIN
    ours.opset_import.append(onnx.helper.make_opsetid(custom_ops.DOMAIN, 1))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(kernel_library))
    cpu = ["CPUExecutionProvider"]
    return ort.InferenceSession(stock, providers=cpu), ort.InferenceSession(
        ours.SerializeToString(), options, providers=cpu
    )


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


def test_the_op_agrees_with_onnxruntime_on_any_batch_it_is_given(kernel_library):
    """Property: for random head layouts, steps over batches of rows at random lengths and prompts
    or prompt pieces of random size, with or without a local window, the op's output and cache
    are onnxruntime's (within float rounding)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from benchmarks import attention_kernel

    layouts = st.sampled_from([(4, 1, 16), (6, 2, 32), (9, 3, 64), (8, 8, 16), (14, 2, 64)])

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        layouts, st.lists(st.integers(1, 70), min_size=1, max_size=4), st.integers(1, 40), st.sampled_from([-1, 5, 16])
    )
    def agrees(shape, held, new, window):
        if new > 1:  # onnxruntime takes a prompt piece one row at a time (so does BatchDecoder)
            held = held[:1]
        lengths = [h + new for h in held]  # each row holds `h` tokens before this run of `new`
        room = max(lengths) + 3
        sessions = attention_sessions(kernel_library, shape, local_window_size=window, scale=0.0)
        arrays = attention_kernel.inputs(shape, lengths, new, room, np.random.default_rng(len(lengths) * 97 + new))
        theirs, ours = (attention_kernel.onnxruntime_results(session, arrays) for session in sessions)
        assert attention_kernel.largest_difference(theirs, ours) < 1e-4

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
    node.input.append("position_ids")
    assert "inputs beyond the nine" in attention.unsupported(node, 64)


def test_the_kernel_reads_a_float_cache_only():
    with pytest.raises(ValueError, match="attention: ortforge reads a float KV cache"):
        quantize_config(method="int8_per_token", attention="ortforge", kv_cache="int8")
