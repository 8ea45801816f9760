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
