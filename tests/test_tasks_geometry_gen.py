"""Generated geometry (geometry_gen.py, geometry source=procedural, `vlmrl data geometry`): answers
written as math-verify reads them, deterministic and disjoint splits, every kind, the reference
solution scoring full marks, multiple choice, and files that read back as Geometry3K."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

from vlmrl.cli import main
from vlmrl.tasks import get_task
from vlmrl.tasks.geometry_gen import KINDS, latex_number, latex_sqrt, make_problem
from vlmrl.rewards.verify import math_equal


def test_numbers_are_written_as_latex():
    assert [latex_number(Fraction(n)) for n in (7, Fraction(35, 2), Fraction(-3, 4))] == ["7", "\\frac{35}{2}",
                                                                                         "-\\frac{3}{4}"]
    assert [latex_number(Fraction(n), "\\pi") for n in (1, 5, Fraction(10, 3), Fraction(1, 2))] == [
        "\\pi", "5\\pi", "\\frac{10\\pi}{3}", "\\frac{\\pi}{2}"]
    assert [latex_sqrt(n) for n in (25, 20, 41, 72)] == ["5", "2\\sqrt{5}", "\\sqrt{41}", "6\\sqrt{2}"]


@pytest.mark.parametrize("gold, equal, other", [
    ("\\frac{35}{2}", "17.5", "35"), ("2\\sqrt{5}", "\\sqrt{20}", "2\\sqrt{6}"),
    ("\\frac{10\\pi}{3}", "\\frac{10}{3}\\pi", "\\frac{10}{3}"), ("B", "(B)", "C")])
def test_math_verify_judges_the_answer_forms(gold, equal, other):
    assert math_equal(equal, gold) and not math_equal(other, gold)


def test_every_kind_is_drawn_with_an_answer_and_a_diagram():
    problems = [make_problem(random.Random(i), image_size=96, choice_share=0.3) for i in range(400)]
    assert {p.kind for p in problems} == set(KINDS)
    for p in problems:
        assert p.problem.startswith("<image>") and p.answer and p.image.size == (96, 96)
        assert p.image.convert("L").getextrema()[0] < 128  # something is drawn on the white
        if "Choices:" in p.problem:
            assert p.answer in "ABCD" and f"That is choice {p.answer}." in p.solution
    assert 0.2 < sum("Choices:" in p.problem for p in problems) / 400 < 0.4


def test_the_procedural_source_is_deterministic_with_disjoint_splits():
    task = get_task("geometry", source="procedural", seed=3, image_size=96)
    again = get_task("geometry", source="procedural", seed=3, image_size=96)
    assert task.splits == ("train", "test")
    first, repeat = task.example(17, "train"), again.example(17, "train")
    assert (first.prompt, first.answer, first.image.tobytes()) == (repeat.prompt, repeat.answer,
                                                                   repeat.image.tobytes())
    train = {task.generated_problem(i, "train").key for i in range(300)}
    test = {task.generated_problem(i, "test").key for i in range(100)}
    assert not train & test and len(test) > 50  # disjoint by content; not one problem over and over


def test_the_split_is_by_the_givens_so_both_splits_ask_for_the_same_answers():
    """The question text of a kind is one sentence ("Find x."): the givens, only in the diagram and
    the solution, decide the split, not the answer alone."""
    task = get_task("geometry", source="procedural", kinds=["triangle"], choice_share=0.0, image_size=96)
    train = {task.generated_problem(i, "train").answer for i in range(100)}
    test = {task.generated_problem(i, "test").answer for i in range(40)}
    assert len(train & test) > 10


def test_the_reference_solution_earns_full_marks_and_a_wrong_answer_none():
    task = get_task("geometry", source="procedural", seed=0, image_size=96)
    for idx in range(60):
        example = task.example(idx, "train")
        assert task.score(example, example.reference_completion) == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
        assert task.score(example, "<think> guess </think> <answer> 99999 </answer>")["accuracy"] == 0.0
        assert "<image>" not in example.prompt and example.meta["kind"] in KINDS


def test_the_generator_parameters_are_checked():
    from vlmrl.errors import VlmrlError

    with pytest.raises(VlmrlError, match="kinds must be some of"):
        get_task("geometry", source="procedural", kinds=["hexagon"])
    only = get_task("geometry", source="procedural", kinds=["arc"], choice_share=0.0, image_size=96)
    assert {only.example(i).meta["kind"] for i in range(10)} == {"arc"}
    assert all("\\pi" in only.example(i).answer for i in range(10))


def test_data_geometry_writes_files_that_read_back_as_geometry3k(tmp_path, capsys):
    out = tmp_path / "geo"
    assert main(["data", "geometry", str(out), "--n", "12", "--test", "4", "--seed", "5", "image_size=96"]) == 0
    assert f"task.params.source={out}" in capsys.readouterr().out
    assert main(["data", "geometry", str(tmp_path / "other"), "seed=3"]) == 2  # one line, no traceback
    assert "give the seed with --seed" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and set(rows[0]) == {"images", "problem", "answer", "solution", "kind"}
    generated = get_task("geometry", source="procedural", seed=5, image_size=96)
    from_files = get_task("geometry", source=str(out), schema="geometry3k")
    assert from_files.splits == ("train", "test")
    for idx in range(4):
        a, b = generated.example(idx, "test"), from_files.example(idx, "test")
        assert (a.prompt, a.answer) == (b.prompt, b.answer)
        assert a.image.tobytes() == b.image.tobytes()  # PNG is lossless
