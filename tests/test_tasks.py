"""What every task promises: registry and parameters, determinism, disjoint splits, reference
completions that score the maximum, no torch, and the `tasks list|show` helpers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example, Task, get_task, list_tasks
from vlmrl.tasks.base import in_split
from vlmrl.tasks.inspect import format_task_list, show_task

PROCEDURAL = ["cryptogram", "shapes", "grounding", "zoom", "census"]
MAX_TOTAL = {("cryptogram", "chapter"): 3.0, ("shapes", "chapter"): 1.7, ("shapes", "strict"): 2.0,
             ("grounding", "chapter"): 1.5, ("zoom", "chapter"): 1.5}


def image_bytes(example: Example) -> bytes:
    return example.image.tobytes()


def key(example: Example) -> tuple[str, str, bytes]:
    return example.prompt, example.answer, image_bytes(example)


def test_registry_lists_the_built_in_tasks():
    assert list_tasks() == ["census", "cryptogram", "dataset", "geometry", "grounding", "motion", "shapes", "zoom"]
    assert all(isinstance(get_task(name), Task) for name in PROCEDURAL)


def test_unknown_task_and_parameter_name_the_closest_valid_ones():
    with pytest.raises(VlmrlError, match="unknown task 'shape'; did you mean shapes"):
        get_task("shape")
    with pytest.raises(VlmrlError, match="unknown parameter 'max_word' of task 'cryptogram'; did you mean max_words"):
        get_task("cryptogram", max_word=2)


def test_a_task_of_your_own_loads_by_import_path(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    task = get_task("letter_task:LetterTask", seed=3)
    assert task.params.seed == 3 and task.score(task.example(0), "a a")["total"] == 1.0
    with pytest.raises(VlmrlError, match="cannot import the module"):
        get_task("no_such_module_xyz:Task")
    with pytest.raises(VlmrlError, match="must name a subclass of vlmrl.tasks.Task"):
        get_task("os.path:join")


def test_parameters_from_the_command_line_are_coerced():
    task = get_task("cryptogram", seed="3", max_words="2", min_words=1)
    assert (task.params.seed, task.params.max_words, task.params.min_words) == (3, 2, 1)
    assert get_task("shapes", targets="circle, square").params.targets == ("circle", "square")
    assert get_task("shapes", targets="[circle, square]").params.targets == ("circle", "square")
    assert get_task("shapes", targets=["triangle"]).params.targets == ("triangle",)
    assert get_task("grounding", format_weight="0.25").params.format_weight == 0.25
    assert get_task("grounding", min_size="1.5e-1").params.min_size == 0.15
    assert get_task("shapes", distractors="no").params.distractors is False
    assert get_task("shapes", rubric="strict").params.rubric == "strict"
    with pytest.raises(VlmrlError, match=r"^parameter max_words of task 'cryptogram' must be an integer; got 'two'$"):
        get_task("cryptogram", max_words="two")
    with pytest.raises(VlmrlError, match=r"^parameter format_weight of task 'grounding' must be a number; got 'heavy'"):
        get_task("grounding", format_weight="heavy")


@pytest.mark.parametrize("name, params, message", [
    ("cryptogram", {"min_words": 1.0}, "parameter min_words of task 'cryptogram' must be an integer; got 1.0"),
    ("cryptogram", {"max_words": "3.0"}, "parameter max_words of task 'cryptogram' must be an integer; got '3.0'"),
    ("cryptogram", {"seed": True}, "parameter seed of task 'cryptogram' must be an integer; got true"),
    ("shapes", {"distractors": 1}, "parameter distractors of task 'shapes' must be true or false; got 1"),
    ("shapes", {"distractors": "1"}, "parameter distractors of task 'shapes' must be true or false; got '1'"),
    ("shapes", {"rubric": True}, "parameter rubric of task 'shapes' must be text; got true"),
    ("shapes", {"targets": 3}, "parameter targets of task 'shapes' must be a list of texts (or comma-separated text); got 3"),
    ("shapes", {"targets": ["circle", None]}, "parameter targets[1] of task 'shapes' must be text; got null"),
])
def test_parameters_follow_the_one_rule_of_the_config(name, params, message):
    # A number is an int only when it is an integer, a flag only a bool (or YAML text for one).
    with pytest.raises(VlmrlError) as error:
        get_task(name, **params)
    assert str(error.value) == message


@pytest.mark.parametrize("name, params, message", [
    ("cryptogram", {"min_words": 3, "max_words": 2}, "min_words <= max_words"),
    ("cryptogram", {"image_size": 50}, "image_size must be in 112..2048"),
    ("cryptogram", {"vocab_size": 5000}, "vocab_size must be in 10..2000"),
    ("shapes", {"rubric": "loose"}, "rubric must be 'chapter' or 'strict'"),
    ("shapes", {"ood_min": 5}, "max_count < ood_min"),
    ("shapes", {"targets": "hexagon"}, "targets must be distinct names"),
    ("shapes", {"max_count": 9, "ood_min": 10, "ood_max": 12}, "do not fit"),
    ("grounding", {"max_distractors": 6}, "max_distractors < ood_min_distractors"),
    ("grounding", {"max_size": 0.45}, "do not fit"),
    ("geometry", {}, "geometry needs source="),
    ("geometry", {"source": "/nonexistent/data.jsonl"}, "does not exist"),
    ("geometry", {"source": "x/y", "schema": "mmmu"}, "schema must be one of"),
])
def test_bad_parameters_are_one_line_errors(name, params, message):
    with pytest.raises(VlmrlError, match=message):
        get_task(name, **params)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_unknown_split_and_bad_index_are_errors(name):
    task = get_task(name)
    assert task.splits == ("train", "test", "ood")
    with pytest.raises(VlmrlError, match="has no split 'dev'; valid: train, test, ood"):
        task.example(0, split="dev")
    with pytest.raises(VlmrlError, match="index must be an integer >= 0"):
        task.example(-1)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_examples_are_deterministic_and_depend_on_the_seed(name):
    a, b, other = get_task(name, seed=5), get_task(name, seed=5), get_task(name, seed=6)
    for split in a.splits:
        for idx in (0, 1, 123456):
            x, y = a.example(idx, split), b.example(idx, split)
            assert key(x) == key(y) and x.reference_completion == y.reference_completion and x.meta == y.meta
    assert [key(a.example(i)) for i in range(5)] != [key(other.example(i)) for i in range(5)]
    assert key(a.example(0, "train")) != key(a.example(0, "test"))


@pytest.mark.parametrize("name", PROCEDURAL)
def test_train_and_test_never_share_an_example(name):
    task = get_task(name, seed=0)
    train = {key(task.example(i, "train")) for i in range(300)}
    test = {key(task.example(i, "test")) for i in range(300)}
    assert len(train) == 300 and len(test) == 300
    assert not train & test


def _content_key(name: str, example: Example) -> str:
    """The content each generator hashes to choose the split (see base.in_split)."""
    meta = example.meta
    if name == "cryptogram":
        return f"{meta['message']}|{meta['cipher']}"
    if name == "shapes":
        return meta["target"] + "|" + ";".join(",".join(map(str, s)) for s in meta["shapes"])
    if name == "zoom":  # the code, its colour and the 4 x 4 cell of the tag's centre
        x1, y1, x2, y2 = meta["box"]
        side = meta["original_size"][0]
        return f"{meta['code']}|{meta['color']}|{(x1 + x2) * 2 // side},{(y1 + y2) * 2 // side}"
    if name == "census":  # the question, the colours asked and every group's colour and corners
        groups = ";".join(f"{colour}{[tuple(xy) for xy in corners]}" for colour, corners in meta["groups"])
        return f"{meta['question']}|{','.join(meta['asked'])}|{groups}"
    return ";".join(",".join(map(str, s)) for s in meta["shapes"])


@pytest.mark.parametrize("name", PROCEDURAL)
def test_split_membership_is_by_construction(name):
    task = get_task(name, seed=1)
    for idx in range(40):
        assert in_split(_content_key(name, task.example(idx, "test")), "test")
        assert not in_split(_content_key(name, task.example(idx, "train")), "test")


@pytest.mark.parametrize("name, rubric", [("cryptogram", "chapter"), ("shapes", "chapter"), ("shapes", "strict"),
                                          ("grounding", "chapter"), ("zoom", "chapter")])
def test_reference_completion_scores_the_maximum(name, rubric):
    task = get_task(name, rubric=rubric) if name == "shapes" else get_task(name)
    for split in task.splits:
        for idx in range(50):
            example = task.example(idx, split)
            scores = task.score(example, example.reference_completion)
            assert scores["accuracy"] == 1.0
            assert scores["total"] == pytest.approx(MAX_TOTAL[(name, rubric)])


@pytest.mark.parametrize("name", PROCEDURAL)
def test_examples_have_rgb_images_and_prompts_that_state_the_format(name):
    example = get_task(name).example(3)
    assert example.image.mode == "RGB"
    assert list(example.image.size) == example.meta["image_size"]
    assert "<answer>" in example.prompt and "</answer>" in example.prompt
    assert example.meta["idx"] == 3 and example.meta["split"] == "train"


def test_importing_the_tasks_does_not_import_torch():
    code = ("import sys, vlmrl.tasks, vlmrl.rewards.verify, vlmrl.tasks.inspect\n"
            "from vlmrl.tasks import get_task\n"
            "for name in ('cryptogram', 'shapes', 'grounding', 'zoom', 'census'):\n"
            "    t = get_task(name); e = t.example(0); t.score(e, e.reference_completion)\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_format_task_list_names_tasks_and_parameters():
    text = format_task_list()
    for name in list_tasks():
        assert f"{name}: " in text
    assert "max_words: int = 3  # Most words" in text
    assert "rubric: str = 'chapter'" in text
    assert "targets: tuple[str, ...] = ('circle', 'square', 'triangle')" in text


def test_show_task_prints_examples_and_writes_images(tmp_path):
    text = show_task("shapes", {"rubric": "strict", "seed": "2"}, split="ood", n=2, out_dir=str(tmp_path / "imgs"))
    files = sorted(p.name for p in (tmp_path / "imgs").iterdir())
    assert files == ["shapes_ood_0.png", "shapes_ood_1.png"]
    assert text.count("=== example") == 2
    assert "reference score: format=1.000, accuracy=1.000, total=2.000" in text
    assert f"image: 168x168 -> {tmp_path / 'imgs' / 'shapes_ood_0.png'}" in text
    example = get_task("shapes", rubric="strict", seed=2).example(0, "ood")
    assert example.prompt.splitlines()[0] in text and f"answer: {example.answer}" in text
    from PIL import Image
    saved = Image.open(tmp_path / "imgs" / "shapes_ood_0.png")
    assert saved.convert("RGB").tobytes() == example.image.tobytes()
    assert "=== example" not in show_task("cryptogram", {}, split="test", n=0, out_dir=None)
    with pytest.raises(VlmrlError, match="no split 'validation'"):
        show_task("cryptogram", {}, split="validation", n=1, out_dir=None)


def test_show_task_names_the_images_of_a_task_given_by_import_path_without_a_colon(tmp_path, letter_task):
    text = show_task("letter_task:LetterTask", {}, split="test", n=1, out_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["letter_task_LetterTask_test_0.png"]
    assert str(tmp_path / "letter_task_LetterTask_test_0.png") in text



def test_examples_are_the_same_in_another_process_with_another_hash_seed():
    code = ("import hashlib\nfrom vlmrl.tasks import get_task\n"
            "for name in ('cryptogram', 'shapes', 'grounding', 'zoom', 'census'):\n"
            "    e = get_task(name, seed=9).example(77, 'test')\n"
            "    print(hashlib.sha256(e.prompt.encode() + e.answer.encode() + e.image.tobytes()).hexdigest())")
    here = []
    for name in PROCEDURAL:
        e = get_task(name, seed=9).example(77, "test")
        here.append(hashlib.sha256(e.prompt.encode() + e.answer.encode() + e.image.tobytes()).hexdigest())
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        assert result.stdout.split() == here
