"""geometry: the three public schemas (small files written here), splits, images, and rewards."""

from __future__ import annotations

import io
import json
import math

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.data.images import image_values, load_image
from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example, get_task
from vlmrl.tasks.geometry import answer_from_solution, last_boxed, reasoning_from_solution

COLORS = ["red", "green", "blue", "yellow", "purple"]


def picture(i: int, size: tuple[int, int] = (48, 32)) -> Image.Image:
    return Image.new("RGB", size, COLORS[i % len(COLORS)])


def open_r1_rows(n: int = 20) -> dict[str, list]:
    rows = {"image": [], "problem": [], "solution": [], "original_question": [], "original_answer": []}
    for i in range(n):
        rows["image"].append(picture(i))
        rows["problem"].append(f"In the figure, find the length of side {i}.")
        rows["solution"].append(f"<think> By the rule, the side is {i} + 1. </think>\n<answer> \\boxed{{{i + 1}}} </answer>")
        rows["original_question"].append("q")
        rows["original_answer"].append(str(i + 1))
    rows["image"].append(picture(0))                       # no answer in the solution: original_answer
    rows["problem"].append("What is the area of the square?")
    rows["solution"].append("The area is the side squared.")
    rows["original_question"].append("q")
    rows["original_answer"].append("49")
    rows["image"].append(picture(1))                       # no answer anywhere: a bad row, skipped
    rows["problem"].append("Unanswerable?")
    rows["solution"].append("No idea.")
    rows["original_question"].append("q")
    rows["original_answer"].append("")
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("geometry")
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string"), "original_question": datasets.Value("string"),
                                  "original_answer": datasets.Value("string")})
    datasets.Dataset.from_dict(open_r1_rows(), features=features).to_parquet(str(root / "open_r1.parquet"))

    g3k = root / "geometry3k" / "data"
    g3k.mkdir(parents=True)
    g3k_features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                      "answer": datasets.Value("string"), "choices": datasets.Sequence(datasets.Value("string")),
                                      "ground_truth": datasets.Value("string")})
    for split, n in (("train", 6), ("validation", 3), ("test", 4)):
        rows = {"images": [[picture(i, (300, 200)), picture(i + 1)] for i in range(n)],
                "problem": [f"<image>Find x in {split} figure {i}." for i in range(n)],
                "answer": [str(3 * i + 2) if i % 2 else "\\frac{1}{2}" for i in range(n)],
                "choices": [["1", "2", "3", "4"] for _ in range(n)],
                "ground_truth": ["A" for _ in range(n)]}
        datasets.Dataset.from_dict(rows, features=g3k_features).to_parquet(str(g3k / f"{split}-00000-of-00001.parquet"))

    geoqa = root / "geoqa"
    (geoqa / "images").mkdir(parents=True)
    with open(geoqa / "train.jsonl", "w") as f:
        for i in range(12):
            picture(i).save(geoqa / "images" / f"{i}.png")
            f.write(json.dumps({"image": f"images/{i}.png", "problem": f"As shown in the figure, angle {i} is?",
                                "solution": f"<answer>{100 + i}°</answer>"}) + "\n")
    return root


def test_open_r1_schema_single_file_holds_out_a_test_share(data):
    task = get_task("geometry", source=str(data / "open_r1.parquet"), test_fraction=0.5, on_bad_row="skip")
    assert task.splits == ("train", "test") and [row for _, row, _ in task.bad_rows] == [21]
    served = task._data.served
    assert sorted(served["train"] + served["test"]) == list(range(21))   # row 21 has no answer
    assert not set(served["train"]) & set(served["test"]) and served["train"] and served["test"]
    for split in ("train", "test"):
        for idx in range(len(served[split])):
            example = task.example(idx, split)
            row = example.meta["row"]
            assert example.answer == ("49" if row == 20 else str(row + 1))
            assert example.prompt.startswith(open_r1_rows()["problem"][row])
            assert "<think> </think>" in example.prompt and "<answer> </answer>" in example.prompt
            assert example.image.mode == "RGB" and example.image.size == (48, 32)
            assert example.meta["schema"] == "open_r1"
            if row < 20:
                assert example.reference_completion.startswith(f"<think> By the rule, the side is {row} + 1. </think>")
            assert task.score(example, example.reference_completion) == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
    first = task.example(0, "test")
    assert task.example(len(served["test"]), "test").meta["row"] == first.meta["row"]  # wraps around


def test_without_a_test_share_there_is_no_test_split(data):
    task = get_task("geometry", source=str(data / "open_r1.parquet"), test_fraction=0, on_bad_row="skip")
    assert task.splits == ("train",)
    with pytest.raises(VlmrlError, match="has no split 'test'; valid: train"):
        task.example(0, "test")


def test_geometry3k_schema_folder_maps_test_and_keeps_validation(data):
    task = get_task("geometry", source=str(data / "geometry3k"), max_image_side=150)
    assert task.splits == ("train", "test", "validation")
    assert len(task._data.served["test"]) == 4 and task._data.source_of["test"] == "test"
    example = task.example(1, "test")
    assert example.prompt.startswith("Find x in test figure 1.") and "<image>" not in example.prompt
    assert example.answer == "5" and example.meta["schema"] == "geometry3k"
    assert example.image.size == (150, 100) and example.image.getpixel((5, 5)) == (0, 128, 0)  # first image
    assert task.example(0, "validation").prompt.startswith("Find x in validation figure 0.")
    assert task.example(0, "test").answer == "\\frac{1}{2}"
    for split in task.splits:
        for idx in range(3):
            ex = task.example(idx, split)
            assert task.score(ex, ex.reference_completion)["total"] == 1.5


def test_test_split_parameter_chooses_the_dataset_split(data):
    task = get_task("geometry", source=str(data / "geometry3k"), test_split="validation")
    assert task.example(0, "test").prompt.startswith("Find x in validation figure 0.")
    with pytest.raises(VlmrlError, match="no split 'dev'; it has"):
        get_task("geometry", source=str(data / "geometry3k"), test_split="dev").splits


def test_geoqa_schema_jsonl_with_relative_image_paths(data):
    task = get_task("geometry", source=str(data / "geoqa" / "train.jsonl"), schema="geoqa", test_fraction=0.5)
    served = task._data.served
    assert sorted(served["train"] + served["test"]) == list(range(12)) and served["test"]
    example = task.example(0, "test")
    row = example.meta["row"]
    assert example.answer == f"{100 + row}°" and example.meta["schema"] == "geoqa"
    assert example.image.getpixel((0, 0)) == Image.new("RGB", (1, 1), COLORS[row % 5]).getpixel((0, 0))
    assert example.reference_completion == f"<think> </think> <answer> {100 + row}° </answer>"  # made from the answer alone
    good = task.score(example, f"<think> angles </think> <answer> {100 + row} </answer>")
    assert good == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
    assert get_task("geometry", source=str(data / "geoqa" / "train.jsonl")).example(0).meta["schema"] == "open_r1"


def test_schema_with_missing_columns_is_an_error(data):
    task = get_task("geometry", source=str(data / "open_r1.parquet"), schema="geometry3k")
    with pytest.raises(VlmrlError, match=r"schema 'geometry3k' needs columns \['answer'\]"):
        task.example(0)


def test_missing_image_file_is_an_error(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"image": "gone.png", "problem": "p?", "solution": "<answer>1</answer>"}) + "\n")
    with pytest.raises(VlmrlError, match="gone.png' does not exist"):
        get_task("geometry", source=str(tmp_path / "d.jsonl")).example(0)


def test_relative_image_paths_fall_back_to_the_source_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "pics").mkdir()
    picture(3).save(tmp_path / "pics" / "a.png")
    row = {"image": {"bytes": None, "path": "pics/a.png"}, "problem": "p?", "solution": "<answer>2</answer>"}
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(row) + "\n")
    example = get_task("geometry", source=str(tmp_path), test_fraction=0).example(0)
    assert example.image.getpixel((0, 0)) == (255, 255, 0) and example.answer == "2"


def test_image_forms():
    buffer = io.BytesIO()
    picture(2).save(buffer, format="PNG")
    assert load_image({"bytes": buffer.getvalue(), "path": None}).getpixel((0, 0)) == (0, 0, 255)
    assert [load_image(v).getpixel((0, 0)) for v in image_values([picture(1), picture(2)])] == [
        (0, 128, 0), (0, 0, 255)]  # every image of a row, in order
    assert load_image(picture(0).convert("L")).mode == "RGB"
    assert image_values(None) == [] and image_values([]) == [] and image_values({"bytes": None, "path": None}) == []


def test_solution_parsing():
    assert last_boxed("a \\boxed{\\frac{1}{2}} then \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert answer_from_solution("<think>t</think><answer> 3 </answer>") == "3"
    assert answer_from_solution("<answer>1</answer> ... <answer>The answer is \\boxed{2}</answer>") == "2"
    assert answer_from_solution("so \\boxed{7}.") == "7"
    assert answer_from_solution("nothing here") == ""
    assert reasoning_from_solution("<think> a <answer>b</answer> </think> <answer>c</answer>") == "a b"
    assert reasoning_from_solution("First this. <answer>c</answer>") == "First this."


# --- the reward each case deserves -------------------------------------------------------------

TASK = get_task("geometry", source="some/hub-id")  # scoring needs no data
HALF = Example(image=picture(0), prompt="", answer="\\frac{1}{2}", meta={})
CHOICE = Example(image=picture(0), prompt="", answer="B", meta={})


@pytest.mark.parametrize("example, text, accuracy, fmt", [
    (HALF, "<think> half </think> <answer> 0.5 </answer>", 1.0, 1.0),
    (HALF, "<think> half </think> <answer> $\\dfrac{1}{2}$ </answer>", 1.0, 1.0),
    (HALF, "<answer> 1/2 </answer>", 1.0, 0.0),                                   # no think block
    (HALF, "<think> x </think> <answer> 0.5 1 2 3 </answer>", 0.0, 1.0),          # stuffed numbers
    (HALF, "<think> x </think> <answer> 0.5, or maybe 2 </answer>", 0.0, 1.0),    # buried among others
    (HALF, "<think> x </think> <answer> </answer>", 0.0, 0.0),                    # empty answer
    (HALF, "<think> x </think> <answer> 0.5 </answer> <answer> 0.5 </answer>", 0.0, 0.0),
    (HALF, "<think> x </think> <answer> <answer> 0.5 </answer> </answer>", 0.0, 0.0),
    (HALF, "the answer is 0.5", 0.0, 0.0),                                        # outside the tags
    (HALF, "<think> 0.5 </think>", 0.0, 0.0),
    (CHOICE, "<think> x </think> <answer> (B) </answer>", 1.0, 1.0),
    (CHOICE, "<think> x </think> <answer> B. </answer>", 1.0, 1.0),
    (CHOICE, "<think> x </think> <answer> A </answer>", 0.0, 1.0),
    (CHOICE, "<think> x </think> <answer> A B C D </answer>", 0.0, 1.0),
])
def test_geometry_rewards(example, text, accuracy, fmt):
    assert TASK.score(example, text) == {"accuracy": accuracy, "format": fmt, "total": accuracy + 0.5 * fmt}


FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "0.5", "\\frac{1}{2}", "B", "(B)", " ", "$",
             "\\boxed{", "}", "1e400", "9" * 30, "\n"]
texts = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(FRAGMENTS)), max_size=10).map("".join)


@settings(max_examples=100, deadline=None)
@given(text=texts, example=st.sampled_from([HALF, CHOICE]))
def test_score_is_total_and_in_range(text, example):
    scores = TASK.score(example, text)
    assert set(scores) == {"accuracy", "format", "total"}
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["accuracy"] in (0.0, 1.0) and scores["format"] in (0.0, 1.0) and 0.0 <= scores["total"] <= 1.5


@pytest.mark.parametrize("source", ["no-such-dataset", "data/no-such-folder"])
def test_a_source_that_is_neither_here_nor_on_the_hub_is_said_in_vlmrls_words(source, monkeypatch):
    """The datasets library's "ConnectionError: Couldn't reach 'x' on the Hub (OfflineModeIsEnabled)"
    stood where vlmrl's own sentence belongs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", lambda name: (_ for _ in ()).throw(
        ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")))
    with pytest.raises(VlmrlError) as error:
        get_task("geometry", source=source).example(0)
    assert str(error.value) == (f"data source {source!r} is not a local file or folder, and the hub is off "
                                "(HF_HUB_OFFLINE) and its cache does not hold such a dataset: give a "
                                ".json/.jsonl/.csv/.parquet file, a folder of them, or a hub dataset id")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(datasets, "load_dataset", lambda name: (_ for _ in ()).throw(
        datasets.exceptions.DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")))
    with pytest.raises(VlmrlError, match=rf"^data source '{source}' is not a local file or folder, nor a dataset "
                                         r"on the hub: give"):
        get_task("geometry", source=source).example(0)


def test_geometry_s_file_parameters_are_the_dataset_task_s_and_all_reach_its_loader(data):
    """One definition (tasks/dataset.py FileParams): geometry keeps file order by default, and every
    file parameter it is given is the one its loader (the dataset task) reads."""
    import dataclasses

    from vlmrl.tasks.dataset import DatasetParams, FileParams
    from vlmrl.tasks.geometry import GeometryParams

    shared = [f.name for f in dataclasses.fields(FileParams) if f.name != "seed"]
    assert shared == ["train_split", "test_split", "test_fraction", "split_seed", "shuffle", "max_image_side",
                      "max_pixels", "on_bad_row", "check_images", "format_weight", "media_root"]
    assert issubclass(GeometryParams, FileParams) and issubclass(DatasetParams, FileParams)
    assert GeometryParams.__dict__["__dataclass_fields__"]["shuffle"].default is False
    assert DatasetParams().shuffle is True and GeometryParams(source="procedural").shuffle is False
    given = {"train_split": "train", "test_split": "test", "test_fraction": 0.3, "split_seed": 4, "shuffle": True,
             "max_image_side": 40, "max_pixels": 5000, "on_bad_row": "skip", "check_images": False,
             "format_weight": 0.25, "media_root": str(data)}
    task = get_task("geometry", source=str(data / "geometry3k"), **given)
    loader = task.files.params
    assert {name: getattr(loader, name) for name in shared} == given
    assert (loader.path, loader.markers, loader.verifier) == (str(data / "geometry3k"), "drop", "math")
    get_task("geometry", source="procedural", test_fraction=2.0)  # file parameters are not read for generated problems
    with pytest.raises(VlmrlError, match=r"^test_fraction must be in \[0, 1\), got 2.0$"):
        get_task("geometry", source=str(data / "geometry3k"), test_fraction=2.0)
