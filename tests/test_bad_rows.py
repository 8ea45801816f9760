"""Bad data met mid-run (safety/bad_rows.py): a geometry row after the first batch that the processor
refuses, that the task cannot decode, or whose image (or a dataset row's video) makes its prompt longer
than rollout.max_prompt_length, follows on_bad_row: stop with a checkpoint and one line, or replace the
row by the next good one and count it, never train on it cut or past the limit; a stopped run resumes
to what a skipping run does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from vlmrl.cli import main
from vlmrl.report.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def geometry_file(folder: Path, bad_image: str) -> Path:
    """Eight geoqa rows; row 5 (drawn at step 3 with two prompts a step) has a bad image:
    "thin", a 2 x 1000 PNG past the processor's aspect-ratio limit (it decodes: the loader keeps it),
    "text", a file that is no image (found only when it is used: check_images=false), or "big", a
    112 x 112 image: 16 image tokens where the others' 32 x 32 give 4, a prompt of 72 tokens, not 60."""
    (folder / "img").mkdir(parents=True)
    rows = []
    for i in range(8):
        Image.new("RGB", (32, 32), (30 * i, 100, 200)).save(folder / "img" / f"{i}.png")
        rows.append({"image": f"img/{i}.png", "problem": f"Angle {i}?", "solution": f"<answer>{i}</answer>"})
    if bad_image == "thin":
        Image.new("RGB", (2, 1000), "white").save(folder / "img" / "bad.png")
    elif bad_image == "big":
        Image.new("RGB", (112, 112), "white").save(folder / "img" / "bad.png")
    else:
        (folder / "img" / "bad.png").write_text("not a picture")
    rows[5]["image"] = "img/bad.png"
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "train.jsonl"


def train_args(model: str, data: Path, run: Path, *more: str) -> list[str]:
    return ["train", "task.name=geometry", f"task.params.source={data}", "task.params.test_fraction=0",
            f"model.name_or_path={model}", "model.device=cpu", f"output_dir={run}", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=4", "train.micro_batch_size=4",
            "train.save_every=0", "train.lr=1e-3", *more]


LONG = ("the prompt of train example 5 (row 5 of split 'train'), image 112x112 RGB is 72 tokens (16 of them image "
        "tokens) > rollout.max_prompt_length=64: image and video tokens are never cut")
"""What row 5 of the "big" file is told as, past a limit of 64 that the first batch's 60 tokens keep."""


@pytest.mark.parametrize("bad_image, params", [("thin", []), ("text", ["task.params.check_images=false"]),
                                               ("big", ["rollout.max_prompt_length=64"])])
def test_a_bad_row_after_the_first_batch_stops_with_a_checkpoint_or_is_skipped(
        tmp_path, tiny_model_dir, capfd, bad_image, params):
    data = geometry_file(tmp_path / "data", bad_image)
    stopped = tmp_path / "stopped"
    assert main(train_args(tiny_model_dir, data, stopped, *params)) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    what = {"thin": "the processor cannot encode train example 5 (row 5 of split 'train'), image 2x1000 RGB: "
                    "ValueError: absolute aspect ratio",
            "text": "train example 5: row 5 of split 'train': ", "big": LONG}[bad_image]
    assert lines[0].startswith(f"error: bad data at step 3: {what}")
    assert "bad.png" in lines[0] or bad_image != "text"
    assert f"stopped with a checkpoint of step 2 in {stopped / 'checkpoints' / 'step_000002'}" in lines[0]
    assert [row["step"] for row in read_metrics(stopped / "metrics.jsonl")] == [1, 2]

    skipping = tmp_path / "skipping"
    assert main(train_args(tiny_model_dir, data, skipping, *params, "task.params.on_bad_row=skip")) == 0
    err = capfd.readouterr().err
    assert err.count("warning: skipped a bad row (on_bad_row=skip):") == 1 and "Traceback" not in err
    straight = read_metrics(skipping / "metrics.jsonl")
    assert [row.get("bad_rows_skipped", 0) for row in straight] == [0, 0, 1, 0]

    # The stopped run, resumed with on_bad_row=skip, continues exactly as the skipping run went.
    assert main(train_args(tiny_model_dir, data, stopped, *params, "task.params.on_bad_row=skip", "resume=true")) == 0
    resumed = read_metrics(stopped / "metrics.jsonl")

    def strip(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))}
                for row in rows]

    assert strip(resumed) == strip(straight)
    shutil.rmtree(tmp_path / "data")


@pytest.mark.parametrize("bad_image, params", [("thin", []), ("text", ["task.params.check_images=false"]),
                                               ("big", ["rollout.max_prompt_length=64"])])
def test_sft_stops_at_a_bad_row_with_a_checkpoint_or_skips_it(tmp_path, tiny_model_dir, capfd, bad_image, params):
    data = geometry_file(tmp_path / "data", bad_image)
    args = ["sft", "task.name=geometry", f"task.params.source={data}", "task.params.test_fraction=0",
            f"model.name_or_path={tiny_model_dir}", "model.device=cpu", *params,
            "sft.batch_size=2", "train.steps=8", "train.micro_batch_size=1", "train.save_every=0"]
    assert main([*args, f"output_dir={tmp_path / 'a'}"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert "error: bad data at step 3: " + {
        "thin": "the processor cannot encode train example 5 (row 5 of split 'train'), image 2x1000 RGB",
        "text": "train example 5: row 5 of split 'train': ", "big": LONG}[bad_image] in err
    assert (tmp_path / "a" / "checkpoints" / "step_000002").is_dir()
    assert main([*args, f"output_dir={tmp_path / 'b'}", "task.params.on_bad_row=skip"]) == 0
    # eight rows, two a step: row 5 comes again at step 7, in the second epoch
    assert [row.get("bad_rows_skipped", 0) for row in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [
        0, 0, 1, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("bad_image, params", [("thin", []), ("big", ["rollout.max_prompt_length=64"])])
def test_a_bad_held_out_row_past_the_first_eval_batch_stops_before_step_1_or_is_replaced(tmp_path, tiny_model_dir,
                                                                                        capfd, bad_image, params):
    data = tmp_path / "data"
    geometry_file(data, bad_image)
    (data / "test.jsonl").write_text((data / "train.jsonl").read_text())  # row 5 of test is the thin image too
    args = ["train", "task.name=geometry", f"task.params.source={data}", f"model.name_or_path={tiny_model_dir}",
            "model.device=cpu", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.steps=2", "train.micro_batch_size=4", "train.save_every=0", "eval.every=1", "eval.n=6",
            "eval.batch_size=2", "eval.max_new_tokens=2", *params]  # the preflight sees test rows 0 and 1 only
    assert main([*args, f"output_dir={tmp_path / 'a'}"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    what = ("the processor cannot encode test example 5 (row 5 of split 'test'), image 2x1000 RGB: ValueError: "
            "absolute aspect ratio must be smaller than 200, got 500.0" if bad_image == "thin" else
            LONG.replace("train", "test"))
    assert f"error: bad held-out data: {what}; fix the data, or set task.params.on_bad_row=skip" in err
    assert not (tmp_path / "a" / "metrics.jsonl").exists() or not (tmp_path / "a" / "metrics.jsonl").read_text()
    assert main([*args, f"output_dir={tmp_path / 'b'}", "task.params.on_bad_row=skip"]) == 0
    evaluated = json.loads((tmp_path / "b" / "evals" / "step_000001_test.json").read_text())
    assert [record["idx"] for record in evaluated["examples"]] == [0, 1, 2, 3, 4, 6]  # 5 replaced by 6
