"""The data layer's rules on what a row may hold: a CSV cell is the text the file holds, image values
are decoded or named in one short line, reads stay in the data folder, a loader's hidden cause is
shown, non-text cells and answer-showing mappings are refused, chat turns are checked, and the
fingerprint covers the images the rows name (issue 51, B4 B8 B11 B12 B14 B17)."""

from __future__ import annotations

import base64
import io
import json
import os

import datasets
import pytest
from PIL import Image

from vlmrl.data.fingerprint import differences
from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task


def png(color: str = "red", size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def jsonl(path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(path, **params):
    task = get_task("dataset", path=str(path), test_fraction=0, shuffle=False, **params)
    task.splits  # noqa: B018 - loads and checks every row
    return task


def bad(task) -> dict[int, str]:
    return {row: message for _, row, message in task.bad_rows}


def test_a_csv_gold_answer_is_the_text_the_file_holds(tmp_path):
    """`007` stayed 7 and `12` became 12.0 once the column held a blank or 1e3 (type inference)."""
    (tmp_path / "train.csv").write_text("question,answer,level\nq1,007,1\nq2,12,2\nq3,,3\nq4,1e3,NA\nq5,NA,x\n")
    task = load(tmp_path / "train.csv", on_bad_row="skip", verifier="exact")
    examples = [task.example(i) for i in range(task.size())]
    assert [e.answer for e in examples] == ["007", "12", "1e3", "NA"]
    assert "007" in examples[0].reference_completion  # the SFT target holds the answer as written
    assert task.score(examples[0], "<think> x </think> <answer> 7 </answer>")["accuracy"] == 0.0
    assert task.score(examples[0], "<think> x </think> <answer> 007 </answer>")["accuracy"] == 1.0
    assert [e.meta["columns"]["level"] for e in examples] == ["1", "2", "NA", "x"]
    assert bad(task) == {2: f"row 2 of split 'train' ({tmp_path / 'train.csv'}): column 'answer' is empty"}
    folder = tmp_path / "pictures"  # an imagefolder's metadata.csv the same
    folder.mkdir()
    (folder / "a.png").write_bytes(png())
    (folder / "b.png").write_bytes(png("blue"))
    (folder / "metadata.csv").write_text("file_name,question,answer\na.png,q1,007\nb.png,q2,12\n")
    task = load(folder)
    assert [task.example(i).answer for i in range(2)] == ["007", "12"]


def test_image_values_are_decoded_or_named_in_one_short_line(tmp_path):
    """base64 text under `bytes` and a data: URI are decoded here (never fetched); a list, a dict of
    other keys, text that is no base64 and an 8000-character name are one short line naming the row
    and what the value is (the data: URI used to be probed as a file name: OSError, 826 characters)."""
    text = base64.b64encode(png("blue")).decode()
    rows = [{"question": "q0", "answer": "a", "image": {"bytes": text, "path": None}},
            {"question": "q1", "answer": "a", "image": f"data:image/png;base64,{text}"},
            {"question": "q2", "answer": "a", "image": [["x.png"]]},
            {"question": "q3", "answer": "a", "image": {"bytes": "not base64 at all!" * 50, "path": None}},
            {"question": "q4", "answer": "a", "image": "A" * 8000},
            {"question": "q5", "answer": "a", "image": {"url": "x.png"}},
            {"question": "q6", "answer": "a", "image": {"bytes": base64.b64encode(b"no picture").decode()}},
            {"question": "q7", "answer": "a", "image": "data:image/svg+xml,<svg></svg>"}]
    task = load(jsonl(tmp_path / "train.jsonl", rows), on_bad_row="skip")
    assert [task.example(i).images[0].getpixel((0, 0)) for i in range(2)] == [(0, 0, 255), (0, 0, 255)]
    messages = bad(task)
    assert sorted(messages) == [2, 3, 4, 5, 6, 7]
    assert all(len(m.split("): ", 1)[1]) < 250 and "\n" not in m and m.startswith(f"row {row} of split 'train'")
               for row, m in messages.items())
    assert "the image column holds list \"['x.png']\", not an image" in messages[2]
    assert "the image's `bytes` is str 'not base64 at all!not base64 at all!not ...' (900 characters), " \
           "not base64 image data" in messages[3]
    assert "image path 'AAAA" in messages[4] and "is no file name this system can open (OSError)" in messages[4]
    assert "a dict with keys ['url']" in messages[5]
    assert "the image's `bytes` (base64) are not an image PIL can read" in messages[6]
    assert messages[7].endswith("the image column holds str 'data:image/svg+xml,<svg></svg>': a data: URI of an "
                                "image is data:image/TYPE;base64,DATA")


def test_reads_stay_in_the_data_folder_unless_media_root_allows_more(tmp_path):
    """An absolute path, `..` and a symlink out of the data folder were read without a word (and ended
    in rollout logs and the report); now a bad row naming the path, unless media_root takes them in."""
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png("green"))
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    (data / "img" / "ok.png").write_bytes(png())
    os.symlink(outside / "secret.png", data / "img" / "link.png")
    rows = [{"question": "q0", "answer": "a", "image": "img/ok.png"},
            {"question": "q1", "answer": "a", "image": str(outside / "secret.png")},
            {"question": "q2", "answer": "a", "image": "../private/secret.png"},
            {"question": "q3", "answer": "a", "image": "img/link.png"},
            {"question": "q4", "answer": "a", "image": "../private/nothing.png"}]
    path = jsonl(data / "train.jsonl", rows)
    with pytest.raises(VlmrlError, match=rf"^bad dataset data: row 1 of split 'train' \({path}\): image file "
                                         rf"'{outside / 'secret.png'}' is outside the data folder {data}: paths in a "
                                         r"data file are read from its folder; set task.params.media_root=FOLDER "
                                         r"to allow reading there \(and 3 more bad rows\)"):
        load(path)
    task = load(path, on_bad_row="skip")
    assert sorted(bad(task)) == [1, 2, 3, 4] and all("is outside the data folder" in m for m in bad(task).values())
    assert "'../private/nothing.png' is outside" in bad(task)[4]  # said whether the file exists or not
    allowed = load(path, media_root=str(tmp_path), on_bad_row="skip")
    assert list(bad(allowed)) == [4] and bad(allowed)[4].endswith("image file '../private/nothing.png' does not exist "
                                                                  f"(looked in {data})")
    assert [allowed.example(i).images[0].getpixel((0, 0)) for i in range(4)] == [(255, 0, 0)] + [(0, 128, 0)] * 3
    with pytest.raises(VlmrlError, match=r"media_root '.*nowhere' is not a folder"):
        get_task("dataset", path=str(path), media_root=str(tmp_path / "nowhere"))


def test_a_load_error_says_its_cause_not_the_wrapper(tmp_path):
    """"An error occurred while generating the dataset" hid a lone surrogate and an imagefolder
    file_name that escapes its folder or is a URL."""
    (tmp_path / "s.jsonl").write_text('{"question": "q \\ud800", "answer": "1"}\n')
    with pytest.raises(VlmrlError) as error:
        load(tmp_path / "s.jsonl")
    message = str(error.value)
    assert message.startswith(f"cannot load data source '{tmp_path / 's.jsonl'}': ArrowInvalid: JSON parse error: "
                              "The surrogate pair in string is invalid") and "generating the dataset" not in message
    for name, cause in (("../x.png", "parent-directory"), ("file:///etc/passwd", "URL schemes")):
        folder = tmp_path / f"pictures{len(name)}"
        folder.mkdir()
        (folder / "a.png").write_bytes(png())
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": name, "question": "q", "answer": "1"}) + "\n")
        with pytest.raises(VlmrlError, match=rf"cannot load data source .*: ValueError: Invalid metadata file_name "
                                             rf"'{name}'.*{cause}"):
            load(folder)


def test_a_mixed_type_image_column_blames_the_bad_row_only(tmp_path):
    """A column of paths, dicts, lists and a number is JSON-encoded by `datasets`: every row was read
    as the text '"a.png"' and the good row 0 blamed."""
    (tmp_path / "a.png").write_bytes(png())
    rows = [{"question": "q0", "answer": "1", "image": "a.png"},
            {"question": "q1", "answer": "1", "image": {"bytes": None, "path": "a.png"}},
            {"question": "q2", "answer": "1", "image": ["a.png", "a.png"]},
            {"question": "q3", "answer": "1", "image": 5}]
    task = load(jsonl(tmp_path / "train.jsonl", rows), on_bad_row="skip")
    assert list(bad(task)) == [3] and "the image column holds int '5', not an image" in bad(task)[3]
    assert [len(task.example(i).images) for i in range(3)] == [1, 1, 2]


def test_non_text_cells_and_mappings_that_show_the_answer_are_refused(tmp_path):
    rows = [{"question": "q0", "answer": 7, "hint": ""}, {"question": "q1", "answer": {"x": 1}, "hint": ""},
            {"question": "q2", "answer": True, "hint": ""}, {"question": {"text": "q3"}, "answer": "1", "hint": ""},
            {"question": "q4", "answer": 2.5, "hint": ""}]
    path = jsonl(tmp_path / "train.jsonl", rows)
    task = load(path, on_bad_row="skip")
    assert [task.example(i).answer for i in range(task.size())] == ["7", "2.5"]  # numbers are their text
    assert {row: m.split(": ", 1)[1] for row, m in bad(task).items()} == {
        1: "column 'answer' holds dict \"{'x': 1}\", not text or a number",
        2: "column 'answer' holds bool 'True', not text or a number",
        3: "column 'question' holds dict \"{'text': 'q3'}\", not text or a number"}
    with pytest.raises(VlmrlError, match=r"^template must hold \{prompt\} \(where the row's question goes\), got "
                                         r"'Answer in one word.': without it every example would ask the same thing$"):
        get_task("dataset", path=str(path), template="Answer in one word.")
    with pytest.raises(VlmrlError, match=r"^columns: prompt<-answer would show the model the gold answer "
                                         r"\(answer<-answer\); map prompt to the question's column"):
        load(path, columns={"prompt": "answer"})
    with pytest.raises(VlmrlError, match=r"^columns: system<-answer would show the model the gold answer"):
        load(path, columns={"system": "answer"})
    verl = jsonl(tmp_path / "verl.jsonl", [{"prompt": [{"role": "user", "content": "q"}], "extra": "x",
                                            "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(VlmrlError, match=r"^columns: prompt<-reward_model would show the model the gold answer "
                                         r"\(answer<-reward_model.ground_truth\)"):
        load(verl, columns={"prompt": "reward_model"})


def test_chat_turns_are_checked_and_a_developer_turn_is_the_system_turn(tmp_path):
    """A non-dict turn was dropped silently and a `developer` turn called an assistant turn."""
    rows = [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q0"},
                          {"role": "assistant", "content": "<answer> 1 </answer>"}]},
            {"messages": ["hello", {"role": "user", "content": "q1"}, {"role": "assistant", "content": "1"}]},
            {"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q2"},
                          {"role": "assistant", "content": "1"}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, "q3"]},
                          {"role": "assistant", "content": "1"}]}]
    task = load(jsonl(tmp_path / "train.jsonl", rows), on_bad_row="skip")
    example = task.example(0)
    assert (example.system, example.prompt.split("\n")[0], example.answer) == ("Be brief.", "q0", "1")
    assert {row: m.split(": ", 1)[1] for row, m in bad(task).items()} == {
        1: "turn 0 of column 'messages' is str 'hello', not a {role, content} dict",
        2: "turn 0 of column 'messages' has role str 'tool'; a prompt's turns are system (or developer), user and "
           "a last assistant turn",
        3: "column 'messages' holds a content part of type 'image_url'; parts are text, image or video (the images "
           "themselves in the image column)"}


def test_the_fingerprint_covers_the_images_the_rows_name(tmp_path):
    """An image replaced under its name resumed unnoticed: the fingerprint held the data file alone."""
    (tmp_path / "img").mkdir()
    for i in range(3):
        (tmp_path / "img" / f"{i}.png").write_bytes(png())
    rows = [{"question": f"q{i}", "answer": "red", "image": f"img/{i}.png"} for i in range(3)]
    path = jsonl(tmp_path / "train.jsonl", rows)
    before = load(path).data_fingerprint()
    assert sorted(before) == ["img/0.png", "img/1.png", "img/2.png", "train.jsonl"]
    (tmp_path / "img" / "1.png").write_bytes(png("white"))
    changed = differences(before, load(path).data_fingerprint())
    assert [c.split(":")[0] for c in changed] == ["img/1.png"]
    ds = datasets.Dataset.from_list([{**row, "image": str(tmp_path / row["image"])} for row in rows])
    from vlmrl.tasks.dataset import DatasetParams, DatasetTask

    prints = DatasetTask(DatasetParams(), data=ds).data_fingerprint()  # a Python object: its split and the files
    assert len(prints) == 4 and list(prints)[0] == "split train"


def test_a_config_reads_its_code_from_its_folder_and_its_data_from_the_working_folder(tmp_path, monkeypatch):
    """A task file named in a config was read from the working folder while a reward file beside it was
    read from the config's folder (issue 51, A8): both are the config's code now; data stays the
    working folder's."""
    from vlmrl.config import load_config

    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "mytask.py").write_text("from vlmrl.tasks.dataset import DatasetTask\n"
                                      "class Mine(DatasetTask):\n    name = 'mine'\n")
    (folder / "config.yaml").write_text("task:\n  name: mytask.py:Mine\n  params: {path: data/train.jsonl}\n"
                                        "rewards: [reward.py:accuracy]\n")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    config = load_config(folder / "config.yaml")
    assert config.task.name == f"{folder / 'mytask.py'}:Mine"
    assert config.rewards[0].name == f"{folder / 'reward.py'}:accuracy"
    assert config.task.params["path"] == "data/train.jsonl"  # read from the working folder, as given
    assert load_config(None, ["task.name=mytask.py:Mine"]).task.name == "mytask.py:Mine"  # the command line's


def test_csv_splits_are_read_each_with_its_own_header(tmp_path):
    (tmp_path / "train.csv").write_text("question,answer,level\nq1,007,1\nq2,08,2\n")
    (tmp_path / "test.csv").write_text("question,answer\nq3,09\n")
    task = get_task("dataset", path=str(tmp_path), shuffle=False)
    assert [task.example(i).answer for i in range(2)] + [task.example(0, "test").answer] == ["007", "08", "09"]
