"""The `dataset` task: the same rows in every layout give the same examples; the held-out split and
the train order are pure functions of the seeds; bad rows and unknown columns are one line."""

from __future__ import annotations

import json

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.cli import main
from vlmrl.data.order import draw_row, held_out, permutation
from vlmrl.errors import VlmrlError
from vlmrl.rollout.prompts import chat_messages
from vlmrl.tasks import get_task
from vlmrl.tasks.dataset import choice_letter, verify

COLORS = ["red", "green", "blue", "yellow"]
N = 8


def rows() -> list[dict]:
    """N rows: a question about two charts, its answer, and a column the rewards should see."""
    return [{"question": f"Which bar is tallest in chart {i}?", "answer": COLORS[i % 4], "level": i % 3,
             "charts": [f"img/{i}a.png", f"img/{i}b.png"]} for i in range(N)]


def write_images(folder) -> None:
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(N):
        Image.new("RGB", (16, 12), COLORS[i % 4]).save(folder / "img" / f"{i}a.png")
        Image.new("RGB", (8, 8), COLORS[(i + 1) % 4]).save(folder / "img" / f"{i}b.png")


def write_layout(folder, layout: str):
    """The rows of `rows()` in `layout`; returns the path to give as task.params.path."""
    if layout == "imagefolder":  # Hugging Face's: the images and a metadata.jsonl naming them, in a folder of its own
        folder = folder / "pictures"
    write_images(folder)
    base = rows()
    if layout == "imagefolder":
        (folder / "metadata.jsonl").write_text("".join(json.dumps(
            {"file_names": r["charts"], "question": r["question"], "answer": r["answer"], "level": r["level"]}) + "\n"
            for r in base))
        return folder
    if layout == "trl":
        data = [{"prompt": r["question"], "images": r["charts"], "answer": r["answer"], "level": r["level"]}
                for r in base]
    elif layout == "easyr1":
        data = [{"problem": r["question"], "images": r["charts"], "answer": r["answer"], "level": r["level"]}
                for r in base]
    elif layout == "messages":
        data = [{"messages": [{"role": "user", "content": r["question"]},
                              {"role": "assistant", "content": f"<think> I look. </think> <answer> {r['answer']} </answer>"}],
                 "images": r["charts"], "level": r["level"]} for r in base]
    elif layout == "verl":
        data = [{"prompt": [{"role": "user", "content": r["question"]}], "images": r["charts"],
                 "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "level": r["level"]} for r in base]
    else:  # columns named by the user; csv, parquet with Image features, save_to_disk below
        data = [{"q": r["question"], "a": r["answer"], "charts": r["charts"], "level": r["level"]} for r in base]
    if layout in ("trl", "easyr1", "messages", "verl", "mapped"):
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
        return path
    if layout == "csv":
        for row in data:
            row["charts"] = row["charts"][0]  # csv holds one path per cell
        datasets.Dataset.from_list(data).to_csv(str(folder / "train.csv"))
        return folder / "train.csv"
    with_images = [{**row, "charts": [Image.open(folder / p).convert("RGB") for p in row["charts"]]} for row in data]
    features = datasets.Features({"q": datasets.Value("string"), "a": datasets.Value("string"),
                                  "charts": datasets.Sequence(datasets.Image()), "level": datasets.Value("int64")})
    ds = datasets.Dataset.from_list(with_images, features=features)
    if layout == "parquet":
        ds.to_parquet(str(folder / "train.parquet"))
        return folder / "train.parquet"
    ds.save_to_disk(str(folder / "saved"))
    return folder / "saved"


MAPPED = {"prompt": "q", "answer": "a", "images": "charts"}
LAYOUTS = {"trl": {}, "easyr1": {}, "messages": {}, "verl": {}, "mapped": MAPPED, "csv": MAPPED,
           "parquet": MAPPED, "saved": MAPPED, "imagefolder": {}}


def answer_column(layout: str, answer: str) -> dict:
    """The answer's own column, which reaches the rewards by its name beside the other columns."""
    if layout == "messages":  # the answer is read from the assistant turn, the prompt's column
        return {}
    if layout == "verl":
        return {"reward_model": {"style": "rule", "ground_truth": answer}}
    return {"answer": answer} if layout in ("trl", "easyr1", "imagefolder") else {"a": answer}


def summary(example) -> tuple:
    return (example.prompt, example.answer, [image.getpixel((0, 0)) for image in example.images],
            example.meta["row"], example.meta["columns"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_rows_in_every_layout_give_the_same_examples(tmp_path, layout):
    path = write_layout(tmp_path, layout)
    task = get_task("dataset", path=str(path), columns=LAYOUTS[layout], test_fraction=0.25)
    reference = get_task("dataset", path=str(write_layout(tmp_path / "ref", "trl")), test_fraction=0.25)
    assert task.splits == ("train", "test") and task.size("train") == 6 and task.size("test") == 2
    for split in ("train", "test"):
        for idx in range(task.size(split)):
            got, want = task.example(idx, split), reference.example(idx, split)
            images = 1 if layout == "csv" else 2
            level = want.meta["row"] % 3
            assert summary(got)[:2] == summary(want)[:2] and summary(got)[3:] == (  # a csv's cells are its text
                want.meta["row"], {**answer_column(layout, want.answer), "level": str(level) if layout == "csv" else level})
            assert summary(got)[2] == summary(want)[2][:images]
            assert got.prompt.startswith(rows()[got.meta["row"]]["question"] + "\n")
            assert task.score(got, f"<think> x </think> <answer> {got.answer} </answer>")["total"] == 1.5
    assert task.data_line().endswith("rows: 6 train, 2 test (0.25 of train held out by row, split_seed 0); "
                                     "train shuffled by seed 0, a new order each epoch")


def test_the_mapping_line_names_the_layout(tmp_path):
    line = get_task("dataset", path=str(write_layout(tmp_path, "easyr1"))).data_line()
    assert line.startswith("prompt<-problem, answer<-answer, images<-images (EasyR1 layout)")
    messages = get_task("dataset", path=str(write_layout(tmp_path / "m", "messages")))
    assert messages.data_line().startswith("prompt<-messages, images<-images, reference<-messages, system<-messages")
    example = messages.example(0)
    assert example.reference_completion == f"<think> I look. </think> <answer> {example.answer} </answer>"


def test_images_sit_at_their_markers_and_a_wrong_count_is_a_bad_row(tmp_path, capsys):
    write_images(tmp_path)
    data = [{"prompt": f"Left <image> and right <image>: which is red? {i}", "images": [f"img/{i}a.png", f"img/{i}b.png"],
             "answer": "left"} for i in range(4)]
    data[2]["images"] = data[2]["images"][:1]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
    with pytest.raises(VlmrlError, match=r"row 2 of split 'train' \(.*train.jsonl\): the prompt has 2 <image> "
                                         r"markers but the row has 1 images; fix the data, or set"):
        get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0).splits
    task = get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0, on_bad_row="skip",
                    system="You read charts.")
    assert task.size() == 3 and [row for _, row, _ in task.bad_rows] == [2]
    example = task.example(0)
    system, user = chat_messages(example)
    assert system == {"role": "system", "content": [{"type": "text", "text": "You read charts."}]}
    assert [part["type"] for part in user["content"]] == ["text", "image", "text", "image", "text"]
    assert user["content"][2]["text"] == " and right "


def test_an_unknown_layout_or_column_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a", "label": "b"}) + "\n")
    with pytest.raises(VlmrlError, match=r"cannot tell which column holds the prompt among \['text', 'label'\]; "
                                         r"name it: task.params.columns="):
        get_task("dataset", path=str(tmp_path / "d.jsonl")).splits
    with pytest.raises(VlmrlError, match=r"the column mapping names \['lbl'\] but the data has"):
        get_task("dataset", path=str(tmp_path / "d.jsonl"), columns={"prompt": "text", "answer": "lbl"}).splits
    with pytest.raises(VlmrlError, match=r"columns: unknown key\(s\) \['questoin'\]"):
        get_task("dataset", path=str(tmp_path / "d.jsonl"), columns={"questoin": "text"}).splits


def test_the_held_out_split_is_chosen_by_row_not_by_content(tmp_path):
    """One question over many images (VQA): a hash of question + answer held out all or nothing."""
    write_images(tmp_path)
    data = [{"question": "What colour is the chart?", "image": f"img/{i}a.png", "answer": COLORS[i % 4]}
            for i in range(N)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
    task = get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0.25)
    served = task._data.served
    assert len(served["test"]) == 2 and sorted(served["train"] + served["test"]) == list(range(N))
    other = get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0.25, split_seed=1)
    assert other._data.served["test"] != served["test"]
    assert get_task("dataset", path=str(tmp_path / "train.jsonl"), test_fraction=0.25,
                    seed=5)._data.served["test"] == served["test"]  # the run's seed leaves the test set alone


def test_train_order_is_shuffled_by_the_seed_and_new_each_epoch(tmp_path):
    path = write_layout(tmp_path, "trl")
    task = get_task("dataset", path=str(path), test_fraction=0)
    epochs = [[task.example(e * N + i).meta["row"] for i in range(N)] for e in range(3)]
    assert all(sorted(epoch) == list(range(N)) for epoch in epochs)
    assert epochs[0] != list(range(N)) and epochs[0] != epochs[1] != epochs[2]
    reseeded = get_task("dataset", path=str(path), test_fraction=0, seed=1)
    assert [reseeded.example(i).meta["row"] for i in range(N)] != epochs[0]
    again = get_task("dataset", path=str(path), test_fraction=0)
    assert [again.example(i).meta["row"] for i in range(3 * N)] == sum(epochs, [])  # deterministic
    in_order = get_task("dataset", path=str(path), test_fraction=0, shuffle=False)
    assert [in_order.example(i).meta["row"] for i in range(2 * N)] == list(range(N)) * 2


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 10**6), start=st.integers(0, 500))
def test_draw_row_covers_every_row_once_per_epoch_from_any_cursor(n, seed, start):
    epoch = start // n
    drawn = [draw_row(i, n, str(seed)) for i in range(epoch * n, (epoch + 1) * n)]
    assert sorted(drawn) == list(range(n))
    assert draw_row(start, n, str(seed)) == permutation(n, str(seed), epoch)[start % n]
    held = held_out(n, 0.3, str(seed))
    assert len(held) == (0 if n < 2 else min(n - 1, max(1, round(0.3 * n)))) and held <= set(range(n))


@pytest.mark.parametrize("verifier, answer, gold, right", [
    ("choice", "B. 45°", "B", True), ("choice", "(C)", "B", False), ("number", "about 3.50 cm", "3.5", True),
    ("number", "4", "3.5", False), ("exact", "Left  Bar", "left bar", True), ("exact", "left", "left bar", False),
    ("math", "\\frac{1}{2}", "0.5", True), ("auto", "0.5", "1/3", False)])
def test_verifiers(verifier, answer, gold, right):
    assert verify(verifier, answer, gold) is right
    assert choice_letter("B) 45") == "B" and choice_letter("45") is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_two_steps_and_evaluates_from_the_command_line(tmp_path, tiny_model_dir, layout, capfd):
    path = write_layout(tmp_path, layout)
    run = tmp_path / "run"
    columns = [f"task.params.columns.{key}={value}" for key, value in LAYOUTS[layout].items()]
    assert main(["train", "task.name=dataset", f"task.params.path={path}", *columns, "task.params.test_fraction=0.25",
                 f"model.name_or_path={tiny_model_dir}", "model.device=cpu", f"output_dir={run}",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=2",
                 "train.micro_batch_size=4", "train.save_every=0", "eval.every=2", "eval.n=8",
                 "eval.max_new_tokens=4"]) == 0
    out = capfd.readouterr()
    assert "rows: 6 train, 2 test (0.25 of train held out by row" in out.out + out.err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in metrics if "epoch" in row] == [pytest.approx(2 / 6), pytest.approx(4 / 6)]
    evaluation = json.loads((run / "evals" / "step_000002_test.json").read_text())
    assert len(evaluation["examples"]) == 2  # eval.n=8 asks more than the split holds: each row once


def test_a_datasets_object_from_python_is_read_like_a_file(tmp_path):
    from vlmrl.tasks.dataset import DatasetParams, DatasetTask

    path = write_layout(tmp_path, "trl")
    ds = datasets.Dataset.from_list([json.loads(line) for line in path.read_text().splitlines()])
    ds = ds.map(lambda row: {"images": [str(tmp_path / p) for p in row["images"]]})
    task = DatasetTask(DatasetParams(test_fraction=0.25), data=ds)
    reference = get_task("dataset", path=str(path), test_fraction=0.25)
    assert [summary(task.example(i)) for i in range(6)] == [summary(reference.example(i)) for i in range(6)]


def test_a_resume_on_changed_data_is_one_line_unless_allowed(tmp_path, tiny_model_dir, capfd):
    path = write_layout(tmp_path, "trl")
    run = tmp_path / "run"

    def train(steps: int, *extra: str) -> int:
        return main(["train", "task.name=dataset", f"task.params.path={path}", f"model.name_or_path={tiny_model_dir}",
                     "model.device=cpu", f"output_dir={run}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                     "rollout.max_new_tokens=4", f"train.steps={steps}", "train.micro_batch_size=4",
                     "train.save_every=1", "train.trackers=[]", "train.log_rollouts_every=0", *extra])

    assert train(1) == 0
    size = path.stat().st_size
    prints = json.loads((run / "data.json").read_text())
    assert sorted(prints) == sorted(["train.jsonl"] + [f"img/{i}{s}.png" for i in range(N) for s in "ab"])
    assert prints["train.jsonl"].startswith(f"{size} bytes blake2b:")  # and each image the rows name, by its bytes
    path.write_text(path.read_text().replace("tallest in chart 3", "tallest in chart 9"))  # one row edited
    capfd.readouterr()
    assert train(2, "resume=true") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: resume=true would continue the run on other data: train.jsonl: {size} bytes blake2b:")
    assert err[0].endswith("(since data.json). Resume on the data the run started with, start a new output_dir, "
                           "or set resume_changes=allow to continue on this data anyway")
    assert not (run / "checkpoints" / "step_000002").exists()
    assert train(2, "resume=true", "resume_changes=allow") == 0
    assert "resuming on changed data (resume_changes=allow): train.jsonl: " in capfd.readouterr().err
    assert train(3, "resume=true") == 0  # data.json now holds the data it resumed on: unchanged
    assert (run / "checkpoints" / "step_000003").is_dir()
    easyr1 = write_layout(tmp_path / "geometry", "easyr1")  # geometry's file presets read through the same loader
    assert get_task("geometry", source=str(easyr1)).data_fingerprint() == \
        get_task("dataset", path=str(easyr1)).data_fingerprint() != {}


def test_an_imagefolder_with_train_and_test_folders_and_a_csv(tmp_path):
    for split, first in (("train", 0), ("test", 6)):
        folder = tmp_path / "pictures" / split
        folder.mkdir(parents=True)
        for i in range(first, first + (6 if split == "train" else 2)):
            Image.new("RGB", (16, 12), COLORS[i % 4]).save(folder / f"{i}.png")
        datasets.Dataset.from_list([{"file_name": f"{i}.png", "question": f"Which colour is picture {i}?",
                                     "answer": COLORS[i % 4], "source": "mine"}
                                    for i in range(first, first + (6 if split == "train" else 2))]
                                   ).to_csv(str(folder / "metadata.csv"), index=False)
    task = get_task("dataset", path=str(tmp_path / "pictures"))
    assert task.data_line().startswith("prompt<-question, answer<-answer, images<-image (question/answer layout); "
                                       "rows: 6 train, 2 test; train shuffled")
    tests = sorted((task.example(i, "test") for i in range(2)), key=lambda e: e.answer)
    assert [(e.prompt.split("\n")[0], e.answer, e.images[0].getpixel((0, 0)), e.meta["columns"]) for e in tests] == [
        ("Which colour is picture 6?", "blue", (0, 0, 255), {"answer": "blue", "source": "mine"}),
        ("Which colour is picture 7?", "yellow", (255, 255, 0), {"answer": "yellow", "source": "mine"})]
    prints = task.data_fingerprint()
    assert sorted(prints) == ["test/6.png", "test/7.png", "test/metadata.csv"] + \
        [f"train/{i}.png" for i in range(6)] + ["train/metadata.csv"]
    Image.new("RGB", (16, 12), "white").save(tmp_path / "pictures" / "test" / "7.png")  # an image edited
    from vlmrl.data.fingerprint import differences
    from vlmrl.data.sources import open_source

    changed = differences(prints, get_task("dataset", path=str(tmp_path / "pictures")).data_fingerprint())
    assert [c.split(":")[0] for c in changed] == ["test/7.png"]
    assert open_source(str(tmp_path / "pictures")).splits["train"].features["image"] == datasets.Image()


def test_the_fingerprint_of_a_saved_folder_and_of_a_python_dataset(tmp_path):
    from vlmrl.data.fingerprint import differences
    from vlmrl.tasks.dataset import DatasetParams, DatasetTask

    saved = get_task("dataset", path=str(write_layout(tmp_path, "saved")), columns=MAPPED).data_fingerprint()
    assert {"data-00000-of-00001.arrow", "state.json", "dataset_info.json"} <= set(saved)
    rows = [json.loads(line) for line in write_layout(tmp_path / "trl", "trl").read_text().splitlines()]

    def prints(data: list[dict]) -> dict:
        return DatasetTask(DatasetParams(check_images=False), data=datasets.Dataset.from_list(data)).data_fingerprint()

    first = prints(rows)
    assert list(first) == ["split train"] and first["split train"].startswith("8 rows, datasets fingerprint ")
    assert prints(rows) == first  # the same rows: the same fingerprint (it is made from the table)
    edited = [dict(row, answer="purple") if i == 5 else row for i, row in enumerate(rows)]
    assert differences(first, prints(edited)) == [f"split train: {first['split train']} -> "
                                                   f"{prints(edited)['split train']}"]
    assert differences({"a": "1"}, {"b": "1"}) == ["a removed", "b added"]


@pytest.mark.parametrize("template, answer_format, target, reward_kwargs", [
    ("{prompt}", "auto", "<think> </think> <answer> {} </answer>", {}),
    ("{prompt}\nPut the final answer in \\boxed{{}}.", "auto", "\\boxed{{{}}}", {"extract": "boxed"}),
    ("{prompt}\nAnswer with one word.", "whole", "{}", {"extract": "whole"}),
])
def test_the_target_made_from_an_answer_is_the_answer_in_the_runs_format(tmp_path, template, answer_format, target,
                                                                           reward_kwargs):
    from vlmrl.rewards.checks import check_rewards
    from vlmrl.rewards.reward import resolve

    task = get_task("dataset", path=str(write_layout(tmp_path, "trl")), template=template, answer_format=answer_format)
    examples = [task.example(i) for i in range(4)]
    for example in examples:  # nothing made up around the answer (it was a 31-token fixed sentence)
        assert example.reference_completion == target.format(example.answer) and example.meta["made_reference"]
        assert task.score(example, example.reference_completion) == {"accuracy": 1.0, "format": 1.0, "total": 1.5}
    rewards = [resolve("task", task=task), resolve("accuracy", kwargs=reward_kwargs), resolve("exact", kwargs=reward_kwargs)]
    check_rewards(rewards, task, examples)  # the run's rewards give the made target full marks
    if reward_kwargs:  # a reward that reads <answer> tags would pay the target 0: refused before step 1, in one line
        with pytest.raises(VlmrlError, match=r"^reward 'accuracy' gives 0, not 1, to the SFT target made from the "
                                             r"answer of train example 0 .*task.params.answer_format[^\n]*$"):
            check_rewards([resolve("accuracy")], task, examples)
        check_rewards([*rewards, resolve("accuracy", weight=0.0)], task, examples)  # logged only: not held to it


def test_a_made_target_keeps_the_reasoning_of_a_solution_and_a_given_target_is_not_made(tmp_path):
    write_images(tmp_path)
    data = [{"prompt": r["question"], "images": r["charts"],
             "solution": f"<think> It is {r['answer']}. </think> <answer> {r['answer']} </answer>"} for r in rows()]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
    example = get_task("dataset", path=str(tmp_path / "train.jsonl")).example(0)
    assert example.reference_completion == f"<think> It is {example.answer}. </think> <answer> {example.answer} </answer>"
    boxed = get_task("dataset", path=str(tmp_path / "train.jsonl"), answer_format="boxed").example(0)
    assert boxed.reference_completion == f"It is {boxed.answer}. \\boxed{{{boxed.answer}}}"
    given = get_task("dataset", path=str(tmp_path / "train.jsonl"), columns={"reference": "solution"}).example(0)
    assert not given.meta["made_reference"] and given.reference_completion == data[given.meta["row"]]["solution"]
    with pytest.raises(VlmrlError, match=r"^answer_format must be one of auto, answer_tag, boxed, whole, got 'tags'$"):
        get_task("dataset", path=str(tmp_path / "train.jsonl"), answer_format="tags")
