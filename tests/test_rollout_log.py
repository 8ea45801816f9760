"""The rollout log's image store: one PNG per distinct image, whatever the image's mode."""

from __future__ import annotations

import pytest
from PIL import Image

from vlmrl.report.rollout_log import store_image


@pytest.mark.parametrize("mode, fill, stored", [("F", 300.0, ("RGB", (255, 255, 255))),
                                                ("CMYK", (0, 0, 0, 0), ("RGB", (255, 255, 255))),
                                                ("YCbCr", (76, 85, 255), ("RGB", (254, 0, 0))),
                                                ("L", 7, ("L", 7)), ("RGBA", (1, 2, 3, 4), ("RGBA", (1, 2, 3, 4)))])
def test_an_image_in_any_mode_is_stored_as_a_png(tmp_path, mode, fill, stored):
    """PNG cannot hold F, CMYK or YCbCr: those are stored as RGB; the modes it holds stay as they are."""
    image = Image.new(mode, (3, 2), fill)
    relative = store_image(tmp_path, image)
    with Image.open(tmp_path / relative) as saved:
        assert (saved.format, saved.mode, saved.size, saved.getpixel((2, 1))) == ("PNG", stored[0], (3, 2), stored[1])
    assert store_image(tmp_path, image.copy()) == relative and len(list((tmp_path / "images").iterdir())) == 1


def test_a_video_is_stored_once_as_a_gif_that_a_row_without_an_image_shows(tmp_path):
    from PIL import ImageSequence

    from vlmrl.report.rollout_log import write_rollouts
    from vlmrl.report.rollouts import image_data_uri
    from vlmrl.tasks import Video

    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "lime", "blue")]
    video = Video(frames, [0, 0.25, 0.75])
    row = {"step": 1, "image": None, "images": [], "videos": [video], "prompt": "?", "completion": "x"}
    path = write_rollouts(tmp_path, 1, [row, dict(row)])
    lines = path.read_text().splitlines()
    assert lines[0] == lines[1] and '"videos": ["images/' in lines[0]
    stored = sorted((tmp_path / "rollouts" / "images").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".gif" and f'"image": "images/{stored[0].name}"' in lines[0]
    with Image.open(stored[0]) as gif:
        shown = [(frame.convert("RGB").getpixel((0, 0)), frame.info["duration"]) for frame in ImageSequence.Iterator(gif)]
    assert shown == [((255, 0, 0), 250), ((0, 255, 0), 500), ((0, 0, 255), 500)]
    assert image_data_uri(tmp_path / "rollouts", f"images/{stored[0].name}").startswith("data:image/gif;base64,")
