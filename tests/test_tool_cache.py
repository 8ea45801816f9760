"""The tools' answer cache (tools/cache.py): find_objects and measure answer a repeated call from it, the same
text and image as without it, each caller its own copy; and the hit rate logged per step by the tool rollout
and the trainer (`tools/<name>/calls`, `tools/<name>/cache_hit_rate`) and recorded by evaluation."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw

from vlmrl.tools import ToolContext
from vlmrl.tools.cache import CV_CACHE_SIZE, AnswerCache, argument_key, counts_of, image_key
from vlmrl.tools.cv_tools import _find_objects, _measure, find_objects, measure

FIND = '<tool_call>\n{"name": "find_objects", "arguments": {"colour": "blue"}}\n</tool_call>'


@pytest.fixture
def fresh_caches(monkeypatch):
    """find_objects and measure with empty caches of their own (the module's persist across tests)."""
    monkeypatch.setattr(find_objects, "answer_cache", AnswerCache(CV_CACHE_SIZE))
    monkeypatch.setattr(measure, "answer_cache", AnswerCache(CV_CACHE_SIZE))


def scene() -> Image.Image:
    """112 px white: two blue discs touching, one apart, a red square."""
    image = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(image)
    for box in ((10, 10, 30, 30), (30, 10, 50, 30), (70, 70, 95, 95)):
        draw.ellipse(box, fill=(40, 70, 220))
    draw.rectangle((60, 10, 80, 30), fill=(220, 40, 40))
    return image


def test_cv_tools_cache_is_invisible_bounded_and_counted(fresh_caches):
    original = scene()
    context = ToolContext([original], max_side=56)
    plain_text, plain_image = _find_objects(original, "blue", None, None, 0, 56)  # without the cache
    first = find_objects(context, colour="blue")
    ImageDraw.Draw(first[1]).rectangle((0, 0, 55, 55), fill=(0, 0, 0))  # the caller draws on its copy
    second = find_objects(ToolContext([original.copy()], max_side=56), colour="blue")  # same pixels, other object
    third = find_objects(context, colour="blue")
    assert first[0] == second[0] == third[0] == plain_text
    assert second[1].tobytes() == third[1].tobytes() == plain_image.tobytes() and second[1] is not third[1]
    cache = find_objects.answer_cache
    assert (cache.calls, cache.computed, cache.cache_hits) == (3, 1, 2) and counts_of(find_objects) == (3, 1)

    edited = original.copy()
    edited.putpixel((100, 5), (40, 70, 220))  # a speck: another image, another answer
    find_objects(ToolContext([edited], max_side=56), colour="blue")
    find_objects(ToolContext([original], max_side=112), colour="blue")  # another overlay side
    find_objects(context, colour="red")
    assert cache.computed == 4

    assert measure(context, ids=[1, 2], colour="blue") == _measure(original, [1, 2], None, "blue", None, None, 0)
    measure(context, ids=[1, 2], colour="blue")
    for bad in ([True, 2], [1.0, 2], [1, 9]):  # equal to [1, 2] in Python, or no such id: refused every time
        for _ in range(2):
            with pytest.raises(ValueError):
                measure(context, ids=bad, colour="blue")
    measure(context, boxes=[0, 0, 10, 10])  # boxes alone: computed every time, not kept
    measure(context, boxes=[0, 0, 10, 10])
    assert counts_of(measure) == (10, 9) and len(measure.answer_cache.entries) == 1

    small = AnswerCache(2)
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" comes
        small.answer((key,), lambda: key.upper())
    assert list(small.entries) == [("a",), ("c",)] and (small.calls, small.computed) == (4, 3)
    assert argument_key([1, 2]) != argument_key([True, 2]) != argument_key([1.0, 2])
    assert argument_key([float("nan")]) is None and image_key(original) == image_key(original.copy())


def test_rollout_trainer_and_evaluation_log_the_hit_rate(tmp_path, tiny_model_dir, letter_task, monkeypatch,
                                                         fresh_caches):
    """One GRPO step of 2 prompts x G=4 whose every trajectory first asks find_objects the same thing: 8 calls,
    2 computed (one per image); an evaluation whose answer asks it twice: 2 calls, 1 computed."""
    from letter_task import LetterTask

    from vlmrl.config import load_config
    from vlmrl.evaluation.evaluate import EvalSettings, evaluate, format_table, scalar_metrics
    from vlmrl.models import load_policy
    from vlmrl.report.tracking import read_metrics
    from vlmrl.rollout import tool_rollout
    from vlmrl.rollout.generation import stop_token_ids
    from vlmrl.rollout.trajectories import Segment
    from vlmrl.training.trainer import train

    def sample_turn(model, processor, rows, segments, settings):  # find_objects, then an answer
        stop = stop_token_ids(processor, model)[0]
        text = FIND if not any(segments) else "a a"
        return [Segment(processor.tokenizer(text, add_special_tokens=False).input_ids + ([stop] if text == "a a" else []),
                        model=True) for _ in rows]

    with monkeypatch.context() as patch:
        patch.setattr(tool_rollout, "sample_turn", sample_turn)
        config = load_config(None, [
            f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=4",
            "rollout.max_new_tokens=40", "rollout.generation_batch_size=2", "rollout.tools=[zoom,find_objects,measure]",
            "rollout.tool_image_side=56", "train.micro_batch_size=8", "train.steps=1", "train.trackers=[]"])
        (row,) = read_metrics(train(config) / "metrics.jsonl")
    assert row["tools/find_objects/calls"] == 8 and row["tools/find_objects/cache_hit_rate"] == pytest.approx(0.75)
    assert row["tools/measure/calls"] == 0 and "tools/measure/cache_hit_rate" not in row
    assert not any(name.startswith("tools/zoom/") for name in row)

    from test_tool_rollout import scripted

    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[FIND, FIND, "a"]])
    evaluation = evaluate(model, processor, LetterTask(), [LetterTask().example(9, split="test")],
                          EvalSettings(batch_size=1, max_new_tokens=40, tools=["find_objects"], max_turns=3),
                          show_progress=False)
    assert evaluation.results["tool_cache"] == {"find_objects/calls": 2.0, "find_objects/cache_hit_rate": 0.5}
    assert scalar_metrics(evaluation.results)["eval/tools/find_objects/cache_hit_rate"] == 0.5
    assert "find_objects/cache_hit_rate" in format_table(evaluation.results)
