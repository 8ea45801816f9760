"""Attention heatmaps: exact grid and head averaging on hand-made tensors, the files the command
writes on the tiny models, the trainer's share-on-image number, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PretrainedConfig

from vlmrl.cli import main
from vlmrl.errors import VlmrlError
from vlmrl.evaluation.attention import completion_image_attention, image_attention_share, resolve_layer, token_grid
from vlmrl.evaluation.attention_maps import attention_maps, colormap, heatmap_frame, image_heatmaps, safe_name
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import image_token_id
from vlmrl.tasks import Example


def hand_attention() -> torch.Tensor:
    """(H=2, S=9, S): image tokens at positions 2..7 (a 2x3 grid), queries at 8 and 7."""
    attention = torch.zeros(2, 9, 9)
    # Query 8, head 0 puts 1/8 .. 6/8 ... on image tokens in grid order; head 1 all on token 5 (row 1, col 0).
    attention[0, 8, 2:8] = torch.tensor([1, 0, 2, 0, 1, 0]) / 8
    attention[0, 8, 8] = 4 / 8
    attention[1, 8, 5] = 1.0
    attention[:, 7, 0] = 1.0  # query 7 looks only at a text token
    return attention


def test_image_heatmaps_average_heads_and_lay_tokens_row_major():
    heat = image_heatmaps(hand_attention(), torch.tensor([8, 7]), torch.arange(2, 8), (2, 3))
    assert heat.shape == (2, 2, 3)
    # Head mean of query 8: head 0 [1,0,2,0,1,0]/8 and head 1 [0,0,0,1,0,0] -> /16 and 8/16 at (1, 0).
    assert torch.equal(heat[0], torch.tensor([[1, 0, 2], [8, 1, 0]]) / 16)
    assert torch.equal(heat[1], torch.zeros(2, 3))
    assert heat[0].sum() == 12 / 16  # share on image: (4/8 + 1) / 2
    with pytest.raises(VlmrlError, match="cannot lay 6 image tokens on a 2x2 grid"):
        image_heatmaps(hand_attention(), torch.tensor([8]), torch.arange(2, 8), (2, 2))


def test_image_attention_share_picks_layers_and_masks_queries():
    first = hand_attention()[None]  # (B=1, H, S, S)
    second = torch.zeros_like(first)
    second[..., 8, 2] = 1.0  # last layer: query 8 entirely on the image
    input_ids = torch.tensor([[0, 1, 9, 9, 9, 9, 9, 9, 3]])  # image token id 9 at 2..7
    queries = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1]])
    assert image_attention_share((first, second), input_ids, 9, queries, layer=0) == 0.75
    assert image_attention_share((first, second), input_ids, 9, queries, layer=-1) == 1.0
    assert image_attention_share((first, second), input_ids, 9, queries) == 0.875  # mean of layers
    both = queries.clone()
    both[0, 7] = 1  # query 7 puts nothing on the image
    assert image_attention_share((first, second), input_ids, 9, both, layer=0) == 0.375
    with pytest.raises(VlmrlError, match="layer 2 is out of range: the model has 2 layers"):
        image_attention_share((first, second), input_ids, 9, queries, layer=2)


def test_layers_grids_and_names():
    assert resolve_layer(-1, 4) == 3 and resolve_layer(-4, 4) == 0 and resolve_layer(2, 4) == 2
    with pytest.raises(VlmrlError, match=r"use 0..3 or -4..-1"):
        resolve_layer(-5, 4)
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2))
    model = SimpleNamespace(config=PretrainedConfig())
    assert token_grid({"image_grid_thw": torch.tensor([[1, 10, 14]])}, processor, model, 35) == (5, 7)
    assert token_grid({}, processor, model, 16) == (4, 4)  # no grid from the processor: a square
    with pytest.raises(VlmrlError, match="layout of the 15 image tokens"):
        token_grid({}, processor, model, 15)
    assert safe_name("<|im_end|>") == "im_end" and safe_name("\n") == "tok" and safe_name(" 3.5") == "3_5"


def test_model_without_image_token_is_a_clear_error():
    model = SimpleNamespace(config=PretrainedConfig())
    processor = SimpleNamespace(tokenizer=SimpleNamespace())
    with pytest.raises(VlmrlError, match="has no image token"):
        image_token_id(processor, model.config)


def test_heatmap_frame_colours_the_right_block():
    assert colormap(np.array([0.0, 1.0])).tolist() == [[0, 0, 4], [252, 255, 164]]  # inferno's ends
    heat = np.zeros((2, 3), dtype=np.float32)
    heat[0, 2] = 0.25  # top right token; normalised to the map's maximum
    frame = heatmap_frame(Image.new("RGB", (112, 112), "white"), heat, "1/1 'x' 25% on image")
    assert frame.size == (320, 352)  # 112 px scaled to 320, plus a 32 px caption band
    # White (grey 255) at weight 0.4, colour at 0.6: hot = 0.4*255 + 0.6*(252, 255, 164).
    assert frame.getpixel((300, 50)) == (253, 255, 200)
    assert frame.getpixel((20, 50)) == frame.getpixel((300, 250)) == (102, 102, 104)


def test_attention_command_writes_a_png_per_token_and_a_gif(tiny_model_dir, circle_image, tmp_path, capsys):
    image = tmp_path / "circles.png"
    circle_image.save(image)
    out = tmp_path / "attn"
    assert main(["attention", tiny_model_dir, "--image", str(image), "--prompt", "How many circles?",
                 "--max-new-tokens", "4", "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    tokens = index["tokens"]
    assert 1 <= len(tokens) <= 4 and index["layer"] == 1 and index["grid"] == [4, 4]  # 112 px / 28
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == [t["file"] for t in tokens]
    assert all(Image.open(p).size == (320, 352) for p in pngs)
    gif = Image.open(out / "attention.gif")
    assert gif.n_frames == len(tokens) and gif.size == (320, 352)
    shares = [t["image_share"] for t in tokens]
    assert all(0.0 <= s <= 1.0 for s in shares)
    assert f"{shares[0]:.1%}" in printed and "mean share on image" in printed

    # The trainer's number on the same completion equals the mean of the per-token shares.
    from vlmrl.models import load_policy

    model, processor = load_policy(tiny_model_dir, device="cpu")  # default (sdpa) attention
    before = model.config._attn_implementation
    ids = torch.tensor([[t["token_id"] for t in tokens]])  # (1, T)
    example = Example(image=circle_image, prompt="How many circles?", answer="")
    completions = Completions([example], ids, torch.ones_like(ids))
    share = completion_image_attention(model, processor, completions, layer=-1)
    assert share == pytest.approx(sum(shares) / len(shares), abs=1e-5)
    assert model.config._attn_implementation == before  # switched to eager and back
    assert 0.0 < completion_image_attention(model, processor, completions) <= 1.0


def test_qwen2_vl_family_works_too(tiny_model_factory, circle_image, tmp_path):
    image = tmp_path / "circles.png"
    circle_image.resize((168, 112)).save(image)
    maps = attention_maps(tiny_model_factory("qwen2_vl"), image, "Count the circles.", layer=0,
                          out_dir=tmp_path / "attn", max_new_tokens=2, device="cpu")
    assert maps.grid == (4, 6) and maps.layer == 0 and 1 <= len(maps.tokens) <= 2
    assert Image.open(tmp_path / "attn" / maps.tokens[0].file).size == (320, 213 + 32)


@pytest.mark.parametrize("args, message", [
    (["--image", "missing.png"], "error: image file 'missing.png' does not exist"),
    (["--layer", "7"], "error: layer 7 is out of range: the model has 2 layers (use 0..1 or -2..-1)"),
    (["--image", "{tmp}/huge.png"], "error: image '{tmp}/huge.png' is too large to decode safely (Image size "
                                    "(400000000 pixels) exceeds limit of 178956970 pixels, could be decompression "
                                    "bomb DOS attack.); downscale it first"),
    (["--image", "{tmp}/big.png"], "error: image '{tmp}/big.png' is 10000x10000 (100 megapixels), more than the 89 "
                                   "megapixels PIL decodes safely; downscale it first"),
    (["--image", "{tmp}/thin.png"], "error: the model's processor cannot take the image (2x1000): ValueError: "
                                    "absolute aspect ratio must be smaller than 200, got 500.0"),
    (["--prompt", "<|image_pad|> how many?"], "error: the prompt contains the model's special token '<|image_pad|>': "
                                              "image tokens would no longer match the image; remove it (the image "
                                              "is placed by --image)"),
    (["--out", "{tmp}/a_file"], "error: cannot write the attention maps to {tmp}/a_file: {tmp}/a_file is a file, "
                                "not a folder; choose another path"),
    (["--out", "/proc/attention"], "error: cannot write the attention maps to /proc/attention: /proc is the kernel's "
                                   "virtual filesystem, not a place for files; choose another path"),
])
def test_bad_input_is_one_line(args, message, tiny_model_dir, circle_image, tmp_path, capsys):
    image = tmp_path / "circles.png"
    circle_image.save(image)
    if "huge.png" in args[1] or "big.png" in args[1]:  # 1-bit, so quick to write; only the header is read
        side = 20000 if "huge" in args[1] else 10000
        Image.new("1", (side, side)).save(tmp_path / ("huge.png" if side == 20000 else "big.png"))
    Image.new("RGB", (2, 1000), "white").save(tmp_path / "thin.png")
    (tmp_path / "a_file").write_text("x")
    args, message = [a.format(tmp=tmp_path) for a in args], message.format(tmp=tmp_path)
    options = {"--image": str(image), "--prompt": "hi", "--device": "cpu", "--out": str(tmp_path / "a"),
               **dict(zip(args[::2], args[1::2]))}
    assert main(["attention", tiny_model_dir, *[x for pair in options.items() for x in pair]]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [message]  # (transformers may print a weight-loading bar before it)


def test_attention_on_a_prompt_of_two_images_draws_a_panel_each(tiny_model_dir, circle_image, tmp_path, capsys):
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    circle_image.save(first)
    Image.new("RGB", (56, 112), (20, 160, 10)).save(second)
    out = tmp_path / "attn2"
    assert main(["attention", tiny_model_dir, "--image", str(first), "--image", str(second), "--prompt",
                 "Which has more circles?", "--max-new-tokens", "3", "--out", str(out), "--device", "cpu"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["grids"] == [[4, 4], [4, 2]]  # 112x112 and 56x112 (width x height) at 28 px a token
    for token in index["tokens"]:
        assert len(token["image_shares"]) == 2
        assert token["image_share"] == pytest.approx(min(sum(token["image_shares"]), 1.0))
        assert Image.open(out / token["file"]).size == (320 + 160, 352)  # two panels side by side
    assert "image grid 4x4, 4x2 tokens" in capsys.readouterr().out


def test_a_full_disk_leaves_no_index(tiny_model_dir, circle_image, tmp_path, capsys, monkeypatch):
    """The frames are written whole or not at all, and index.json (what makes the folder a result)
    last: a disk that fills up half-way leaves no index.json and no half-written file."""
    import errno

    image = tmp_path / "circles.png"
    circle_image.save(image)
    out = tmp_path / "attn"
    real_save, saves = Image.Image.save, []

    def fills_up(self, fp, *args, **kwargs):
        saves.append(fp)
        if len(saves) == 2:
            Path(fp).write_bytes(b"half a PNG")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", fills_up)
    assert main(["attention", tiny_model_dir, "--image", str(image), "--prompt", "hi", "--device", "cpu",
                 "--out", str(out), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("error:")][0].startswith(
        f"error: the disk is full: writing a heatmap to {out}/001_")
    assert not (out / "index.json").exists() and not list(out.glob(".*")) and len(list(out.glob("*.png"))) == 1


def test_attention_on_an_example_of_a_task(tiny_model_dir, tmp_path, capsys):
    from vlmrl.tasks import get_task

    out = tmp_path / "crypto"
    params = ["letters=etaoinshr", "layout=grid", "entries_per_row=3", "instructions=false"]
    assert main(["attention", tiny_model_dir, "--task", "cryptogram", "--example", "2", "--split", "test",
                 "--max-new-tokens", "3", "--out", str(out), "--device", "cpu", *params]) == 0
    index = json.loads((out / "index.json").read_text())
    example = get_task("cryptogram", letters="etaoinshr", layout="grid", entries_per_row=3,
                       instructions=False).example(2, "test")
    assert index["prompt"] == example.prompt and index["grid"] == [3, 3]  # 84 px / 28
    assert len(index["tokens"]) <= 3 and (out / "attention.gif").exists()


@pytest.mark.parametrize("args, message", [
    (["--task", "cryptogram", "--prompt", "hi"], "error: give --task or --image/--prompt, not both"),
    (["--prompt", "hi"], "error: give --image and --prompt, or --task (an example of a task)"),
])
def test_task_and_image_are_one_or_the_other(args, message, tiny_model_dir, tmp_path, capsys):
    assert main(["attention", tiny_model_dir, "--out", str(tmp_path / "a"), *args]) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [message]
