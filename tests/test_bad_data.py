"""geometry on bad data: each kind of bad row stops the run at load naming the row and file, or is
skipped and counted with on_bad_row=skip; odd image modes become the RGB a person would see."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task
from vlmrl.data.images import load_image, to_rgb


def write_rows(folder: Path, rows: list[dict], name: str = "train.jsonl") -> Path:
    """A jsonl data file of geoqa rows; images are paths relative to it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def good_rows(folder: Path, n: int = 4) -> list[dict]:
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (20, 10), (10 * i, 100, 200)).save(folder / "img" / f"{i}.png")
        rows.append({"image": f"img/{i}.png", "problem": f"Angle {i}?", "solution": f"<answer>{i}</answer>"})
    return rows


def load(path: Path, **params):
    """The task with its dataset loaded (where bad rows are found)."""
    task = get_task("geometry", source=str(path), test_fraction=0, **params)
    task.splits  # noqa: B018 - loads and checks the data
    return task


def check_bad_row(tmp_path: Path, bad: dict, message: str, capsys) -> None:
    """Row 2 of five is `bad`: an error naming row 2, the file and `message`; skipped when asked."""
    rows = good_rows(tmp_path)
    path = write_rows(tmp_path, rows[:2] + [bad] + rows[2:])
    with pytest.raises(VlmrlError, match=message) as error:
        load(path)
    assert f"row 2 of split 'train' ({path})" in str(error.value) and "on_bad_row=skip" in str(error.value)
    task = load(path, on_bad_row="skip")
    assert [(split, row) for split, row, _ in task.bad_rows] == [("train", 2)]
    assert "skipped 1 bad rows of 5" in capsys.readouterr().err
    assert [task.example(i).meta["row"] for i in range(4)] == [0, 1, 3, 4]


def test_unreadable_image_file(tmp_path, capsys):
    (tmp_path / "notes.png").write_text("this is text, not a picture")
    check_bad_row(tmp_path, {"image": "notes.png", "problem": "p?", "solution": "<answer>1</answer>"},
                  r"notes.png' is not an image file PIL can read", capsys)


def test_truncated_image_file(tmp_path, capsys):
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).save(buffer, format="PNG")
    (tmp_path / "cut.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    check_bad_row(tmp_path, {"image": "cut.png", "problem": "p?", "solution": "<answer>1</answer>"},
                  r"cut.png' cannot be decoded, truncated or corrupt", capsys)


def test_missing_image_file(tmp_path, capsys):
    check_bad_row(tmp_path, {"image": "gone.png", "problem": "p?", "solution": "<answer>1</answer>"},
                  r"gone.png' does not exist", capsys)


def test_row_missing_a_field(tmp_path, capsys):
    check_bad_row(tmp_path, {"image": "img/0.png", "problem": None, "solution": "<answer>1</answer>"},
                  r"column 'problem' is empty", capsys)


def test_row_without_an_answer(tmp_path, capsys):
    check_bad_row(tmp_path, {"image": "img/0.png", "problem": "p?", "solution": "I do not know."},
                  r"its solution has no <answer> or \\boxed\{\} answer", capsys)


def test_row_without_an_image(tmp_path, capsys):
    check_bad_row(tmp_path, {"image": None, "problem": "p?", "solution": "<answer>1</answer>"},
                  r": no image", capsys)


def test_non_image_in_the_image_column(tmp_path):
    rows = [{"image": 42 + i, "problem": "p?", "solution": "<answer>1</answer>"} for i in range(3)]
    path = write_rows(tmp_path, rows)
    with pytest.raises(VlmrlError, match=r"row 0 of split 'train' .*the image column holds int '42', not an image"
                                         r".*\(and 2 more bad rows\)"):
        load(path)
    with pytest.raises(VlmrlError, match="has no usable rows in split 'train'"):
        load(path, on_bad_row="skip")


def test_image_bytes_that_are_not_an_image(tmp_path):
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    good = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(good, format="PNG")
    rows = {"image": [{"bytes": good.getvalue(), "path": None}, {"bytes": b"GIF89a garbage", "path": None}],
            "problem": ["a?", "b?"], "answer": ["1", "2"]}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(VlmrlError, match=r"row 1 of split 'train' .*image bytes are not an image PIL can read"):
        load(tmp_path / "d.parquet")


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(VlmrlError, match=r"data file '.*empty.jsonl' is empty"):
        load(tmp_path / "empty.jsonl")
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    datasets.Dataset.from_dict({"image": [], "problem": [], "answer": []}, features=features).to_parquet(
        str(tmp_path / "none.parquet"))
    with pytest.raises(VlmrlError, match=r"none.parquet' is empty: it holds no rows"):
        load(tmp_path / "none.parquet")
    (tmp_path / "list.json").write_text("[]\n")
    with pytest.raises(VlmrlError, match=r"list.json' is empty"):
        load(tmp_path / "list.json")


def test_on_bad_row_must_be_error_or_skip(tmp_path):
    with pytest.raises(VlmrlError, match="on_bad_row must be error or skip"):
        get_task("geometry", source="org/data", on_bad_row="ignore")


def test_without_check_images_a_bad_image_stops_at_first_use(tmp_path):
    (tmp_path / "notes.png").write_text("text")
    rows = good_rows(tmp_path, 1) + [{"image": "notes.png", "problem": "p?", "solution": "<answer>1</answer>"}]
    task = load(write_rows(tmp_path, rows), check_images=False)
    assert task.example(0).image.size == (20, 10)
    with pytest.raises(VlmrlError, match=r"row 1 of split 'train': .*notes.png' is not an image file"):
        task.example(1)


def test_huge_image_is_downscaled_within_max_pixels(tmp_path):
    rows = good_rows(tmp_path, 1)
    Image.new("RGB", (4000, 3000), "blue").save(tmp_path / "img" / "big.png")
    Image.new("RGB", (4000, 3000), "blue").save(tmp_path / "img" / "big.jpg", quality=90)
    rows += [{"image": f"img/big.{ext}", "problem": "p?", "solution": "<answer>1</answer>"} for ext in ("png", "jpg")]
    task = load(write_rows(tmp_path, rows), max_pixels=1_000_000)
    for i in (1, 2):
        image = task.example(i).image
        assert image.size == (1154, 866) and image.width * image.height <= 1_000_000
        r, g, b = image.getpixel((500, 400))
        assert b > 240 and r < 15 and g < 15
    assert task.example(0).image.size == (20, 10)  # small ones are left alone
    assert load(write_rows(tmp_path, rows), max_pixels=0).example(1).image.size == (4000, 3000)


def test_decompression_bomb_is_a_bad_row(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL refuses images over twice this
    Image.new("L", (100, 100)).save(tmp_path / "bomb.png")
    with pytest.raises(VlmrlError, match=r"bomb.png' is too large to decode safely"):
        load_image(str(tmp_path / "bomb.png"))


def transparent(mode: str) -> Image.Image:
    """A 4x4 image: left half a black opaque stroke, right half fully transparent."""
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    for y in range(4):
        for x in range(2):
            image.putpixel((x, y), (0, 0, 0, 255))
    return image.convert(mode) if mode != "RGBA" else image


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA"])
def test_transparency_is_laid_over_white(mode):
    rgb = to_rgb(transparent(mode))
    assert rgb.mode == "RGB" and rgb.getpixel((0, 0)) == (0, 0, 0) and rgb.getpixel((3, 3)) == (255, 255, 255)


def test_palette_with_a_transparent_colour():
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0
    assert [to_rgb(image).getpixel((x, 0)) for x in range(2)] == [(255, 255, 255), (255, 0, 0)]


def test_odd_modes_from_files(tmp_path):
    import numpy as np

    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")  # red in print colours
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(tmp_path / "deep.png")  # 16-bit grey
    Image.new("L", (8, 8), 77).save(tmp_path / "grey.png")
    Image.new("1", (8, 8), 1).save(tmp_path / "bits.png")
    assert Image.open(tmp_path / "cmyk.jpg").mode == "CMYK" and Image.open(tmp_path / "deep.png").mode == "I;16"
    red = load_image(str(tmp_path / "cmyk.jpg")).getpixel((4, 4))
    assert red[0] > 230 and red[1] < 30 and red[2] < 30
    assert load_image(str(tmp_path / "deep.png")).getpixel((4, 4)) == (127, 127, 127)  # scaled, not clipped to 255
    assert load_image(str(tmp_path / "grey.png")).getpixel((0, 0)) == (77, 77, 77)
    assert load_image(str(tmp_path / "bits.png")).getpixel((0, 0)) == (255, 255, 255)
    floats = Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32))
    assert to_rgb(floats).getpixel((0, 0)) == (127, 127, 127)  # floats in [0, 1] scaled to 8 bits


def test_odd_modes_reach_the_example_as_rgb(tmp_path):
    rows = []
    for i, mode in enumerate(["RGBA", "LA", "L", "P", "CMYK"]):
        name = f"{i}.{'jpg' if mode == 'CMYK' else 'png'}"
        Image.new(mode, (6, 6)).save(tmp_path / name)
        rows.append({"image": name, "problem": f"{mode}?", "solution": "<answer>1</answer>"})
    task = load(write_rows(tmp_path, rows))
    assert {task.example(i).image.mode for i in range(5)} == {"RGB"}
