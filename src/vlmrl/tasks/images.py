"""Any PIL image as the RGB image a model sees: the datasets' images (geometry.py) and what a tool
returns (tools.py) go through the same conversion."""

from __future__ import annotations

from PIL import Image

from vlmrl.errors import VlmrlError


class BadImage(VlmrlError):
    """An image value that cannot become the RGB image the model sees; the message says why."""


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB from any PIL mode: transparency laid over white, 16-bit and float greys scaled to 8 bits."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I", "F") or mode.startswith("I;16"):
        low, high = image.getextrema()
        if mode.startswith("I;16"):
            low, high = 0, 65535
        elif mode == "F" and low >= 0 and high <= 1:
            low, high = 0.0, 1.0
        elif low >= 0 and high <= 255:
            low, high = 0, 255
        scale = 255.0 / (high - low) if high > low else 0.0
        return image.convert("F").point(lambda v: v * scale - low * scale).convert("L").convert("RGB")
    try:
        if "A" in mode or "a" in mode or "transparency" in image.info:
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")
    except ValueError as error:
        raise BadImage(f"image mode {mode} cannot be converted to RGB ({error})") from error
