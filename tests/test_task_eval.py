"""Task A/B on the tiny model: lm-eval's interface over an artifact gives the runtime's own numbers,
record() and the report's comparison score a hand-made example as computed by hand, and the task
gate fails a deliberately damaged variant and passes the reference against itself."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import numpy as np
import pytest

from tasks.core.params import TaskGatesConfig
from tasks.evaluation import task_eval
from tasks.evaluation.task_sets import TaskSet, load
from tasks.reporting import task_ab
from tests.conftest import EVAL_TEXT

pytest.importorskip("lm_eval")


@dataclass
class Request:  # what lm-eval hands a model: its arguments
    args: tuple


@pytest.fixture(scope="module")
def lm(built):
    from tasks.evaluation.lm_eval_model import ArtifactLM

    return ArtifactLM(built["fp32"])


def full_pass_score(lm, context: str, continuation: str) -> float:
    """The continuation's log-likelihood from one pass over the whole text (no cache reuse)."""
    from tasks.evaluation.metrics import log_softmax

    context_ids, continuation_ids = lm.encode_pair(context, continuation)
    ids = context_ids + continuation_ids
    decoder = lm.generator.decoder
    logits, _ = decoder.forward(ids[:-1], decoder.empty_cache())
    rows = log_softmax(logits[len(context_ids) - 1 :].astype(np.float64))
    return float(rows[np.arange(len(continuation_ids)), continuation_ids].sum())


def test_loglikelihood_equals_a_full_pass_with_the_context_prefilled_once(lm):
    context = "This License applies to any program"
    choices = [" or other work", " and", " which contains a notice placed by the copyright holder"]
    found = lm.loglikelihood([Request((context, choice)) for choice in choices])
    for (score, _), choice in zip(found, choices, strict=True):
        assert score == pytest.approx(full_pass_score(lm, context, choice), abs=1e-4)
    assert len({score for score, _ in found}) == 3


def test_loglikelihood_marks_the_greedy_continuation(lm):
    ids = lm.encode("the terms of this License")
    decoder = lm.generator.decoder
    logits, _ = decoder.forward(ids, decoder.empty_cache(), last_only=True)
    ranked = np.argsort(logits[-1])[::-1]
    (best, best_is_greedy), (other, other_is_greedy) = lm.score_pairs(
        [(ids, [int(ranked[0])]), (ids, [int(ranked[1])])]
    )
    assert best_is_greedy and not other_is_greedy and other < best < 0


def test_generate_until_is_what_the_runtime_generates_cut_at_the_stop(lm):
    prompt = "The GNU General Public License is"
    expected = lm.generator.generate(prompt, 12)
    (said,) = lm.generate_until([Request((prompt, {"until": [], "max_gen_toks": 12}))])
    assert said == expected
    stop = expected.strip()[:3]
    (cut,) = lm.generate_until([Request((prompt, {"until": [stop], "max_gen_toks": 12}))])
    assert stop not in cut and expected.startswith(cut)


def test_loglikelihood_rolling_scores_every_token_of_a_text(lm):
    text = "This License applies to any program or other work which contains a notice"
    (total,) = lm.loglikelihood_rolling([Request((text,))])
    ids = lm.encode_plain(text)
    prefix = lm.prefix_ids()
    decoder = lm.generator.decoder
    from tasks.evaluation.metrics import log_softmax

    logits, _ = decoder.forward(prefix + ids[:-1], decoder.empty_cache())
    rows = log_softmax(logits[len(prefix) - 1 :].astype(np.float64))
    assert total == pytest.approx(float(rows[np.arange(len(ids)), ids].sum()), abs=1e-3)


def hand_set(kind: str, rows: list[dict], tmp_path) -> TaskSet:
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    return load(kind, kind, path)


def compared(task: TaskSet, variant: dict, reference: dict) -> dict:
    """The report's comparison of two answer sets, each first recorded as evaluate writes it."""
    return task_ab.compare_set(task_eval.record(task, variant), task_eval.record(task, reference))


def test_compare_qa_by_hand(tmp_path):
    rows = [{"id": str(i), "question": f"Q{i}?", "answers": ["yes"]} for i in range(4)]
    task = hand_set("qa", rows, tmp_path)
    reference = {"0": "Yes.", "1": "yes it is", "2": "Yes", "3": "no"}  # 3 of 4 right
    variant = {"0": "Yes.", "1": "no", "2": "maybe", "3": "no"}  # 1 of 4 right
    assert task_eval.record(task, variant)["right"] == {"0": True, "1": False, "2": False, "3": False}
    found = compared(task, variant, reference)
    assert found["score"]["value"] == 0.25 and found["reference_score"]["value"] == 0.75
    assert found["retention"] == pytest.approx(1 / 3)
    assert found["identical_to_reference"]["value"] == 0.5  # "Yes." and "no" match once normalized
    assert found["difference"]["value"] == pytest.approx(-0.5)
    assert task_ab.gate({"qa": found}, TaskGatesConfig()) == ["qa score retention 0.333 < 0.95"]


def test_compare_choice_and_instruct_by_hand(tmp_path):
    rows = [{"id": str(i), "prompt": "p", "choices": [" a", " b"], "label": i % 2} for i in range(4)]
    choice = compared(
        hand_set("choice", rows, tmp_path), {str(i): 0 for i in range(4)}, {str(i): i % 2 for i in range(4)}
    )
    assert choice["score"]["value"] == 0.5 and choice["reference_score"]["value"] == 1.0
    assert choice["agreement"]["value"] == 0.5
    instruct = hand_set("instruct", [{"id": "x", "instruction": "say"}], tmp_path)
    found = compared(instruct, {"x": "the cat lay on the mat"}, {"x": "the cat sat on the mat"})
    assert found["rouge_l_to_reference"]["value"] == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="no answer for x"):
        task_eval.record(instruct, {})
    with pytest.raises(ValueError, match="no answer for x"):
        task_ab.compare_set({"kind": "instruct", "answers": {}}, task_eval.record(instruct, {"x": "text"}))


def test_sets_are_cut_to_the_limit_in_their_order(tmp_path):
    from tasks.core.params import TasksConfig, TaskSetConfig

    rows = [{"id": f"q{i}", "question": f"Q{i}?", "answers": ["a"]} for i in range(5)]
    hand_set("qa", rows, tmp_path)
    # Constructed unchecked: a set's file must lie under data/tasks, and a test writes in tmp_path.
    spec = TaskSetConfig.model_construct(kind="qa", file=tmp_path / "qa.jsonl")
    cfg = TasksConfig.model_construct(sets={"qa": spec}, limit=2)
    (task,) = task_eval.sets_of(cfg)
    assert [row.id for row in task.rows] == ["q0", "q1"]


def choice_set(tmp_path) -> TaskSet:
    """Forty three-way choices cut from the evaluation text (the tiny model knows nothing else)."""
    words = EVAL_TEXT.read_text(encoding="utf-8").split()
    rows = [
        {
            "id": f"c{i}",
            "prompt": " ".join(words[7 * i : 7 * i + 6]),
            "choices": [" the", " of", " License"],
            "label": i % 3,
        }
        for i in range(40)
    ]
    return hand_set("choice", rows, tmp_path)


def damaged_copy(folder, out, seed: int = 0):
    """The variant with noise as large as its weights added to every matrix: a variant gone wrong."""
    import onnx
    from onnx import numpy_helper

    from tasks.graphs import onnx_io

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("model.onnx*"))
    graph = onnx.load(str(folder / "model.onnx"))
    rng = np.random.default_rng(seed)
    for index, tensor in enumerate(graph.graph.initializer):
        weights = numpy_helper.to_array(tensor)
        if weights.ndim == 2 and weights.dtype == np.float32 and min(weights.shape) > 8:
            noisy = weights + rng.normal(0, weights.std(), weights.shape).astype(np.float32)
            graph.graph.initializer[index].CopyFrom(numpy_helper.from_array(noisy, tensor.name))
    onnx_io.save_runnable(graph, None, out)
    return out


def test_the_task_gate_fails_a_damaged_variant_and_passes_the_reference(built, tmp_path):
    task = choice_set(tmp_path)
    reference = task_eval.answers(built["fp32"], [task])[task.name]
    damaged = task_eval.answers(damaged_copy(built["fp32"], tmp_path / "damaged"), [task])[task.name]
    gates = TaskGatesConfig()
    same = compared(task, reference, reference)
    assert same["agreement"]["value"] == 1.0 and task_ab.gate({task.name: same}, gates) == []
    found = compared(task, damaged, reference)
    assert found["agreement"]["value"] < gates.min_choice_agreement
    assert any("agreement" in failure for failure in task_ab.gate({task.name: found}, gates))


def test_generated_sets_use_a_plain_prompt_without_a_chat_template_and_the_template_with_one(built, tmp_path):
    assert not task_eval.has_chat_template(built["fp32"])
    chatty = tmp_path / "chat"
    shutil.copytree(built["fp32"], chatty)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (chatty / "chat_template.jinja").write_text(template, encoding="utf-8")
    assert task_eval.has_chat_template(chatty)
    from tasks.evaluation.lm_eval_model import ArtifactLM

    rendered = ArtifactLM(chatty).apply_chat_template([{"role": "user", "content": "Hi?"}])
    assert rendered == "<user>Hi?\n<assistant>"
