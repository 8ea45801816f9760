"""Image values as the RGB images a model sees: the forms datasets hand back (a PIL image, a dict of
bytes or path, a path relative to the data file, a list of any of these), decoded once, converted and
downscaled. The images of a data row (tasks/dataset.py) and what a tool returns (tasks/tools.py) go
through the same conversion.

Every image becomes RGB: transparency is laid over white (diagrams are often black lines on a
transparent background), 16-bit and float greys are scaled to 8 bits, CMYK, palette and the rest
converted; one with more than max_pixels pixels is downscaled (aspect kept; a JPEG is decoded at a
reduced scale in the first place). A value that cannot become such an image raises `BadImage`
saying why (`NoImage` when there is no image at all).
"""

from __future__ import annotations

import io
import math
import warnings
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

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


class NoImage(BadImage):
    """No image at all: null, empty, an empty list, a dict with neither bytes nor path."""


def image_values(value: Any) -> list[Any]:
    """The image values of one row's image cell, in order: a list's items, a single value alone;
    [] for null, "", an empty list or {bytes: None, path: None}."""
    if isinstance(value, (list, tuple)):
        return [item for item in value if not _empty(item)]
    return [] if _empty(value) else [value]


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value) or (
        isinstance(value, dict) and not value.get("bytes") and not value.get("path"))


def open_image(value: Any, folders: tuple[Path, ...] = ()) -> Image.Image:
    """A PIL image, not yet decoded, from one image value; a relative path is looked up in `folders`
    in order (the data file's folder first)."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            try:
                return Image.open(io.BytesIO(value["bytes"]))
            except Image.DecompressionBombError as error:
                raise BadImage(f"the image is too large to decode safely ({error})") from error
            except (UnidentifiedImageError, OSError, ValueError) as error:
                raise BadImage(f"the image bytes are not an image PIL can read ({error})") from error
        if value.get("path"):
            return open_image(value["path"], folders)
        raise NoImage("no image (neither bytes nor a path)")
    if value is None or value == "" or value == [] or value == ():
        raise NoImage("no image")
    if isinstance(value, str):
        return _open_file(value, folders)
    raise BadImage(f"the image column holds {type(value).__name__} {str(value)[:40]!r}, not an image, "
                   "image bytes or a path")


def _open_file(value: str, folders: tuple[Path, ...]) -> Image.Image:
    if value.startswith(("http://", "https://")):
        raise BadImage(f"image {value!r} is a URL: download the images and give their paths (no network here)")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = next((f / path for f in folders if (f / path).exists()), folders[0] / path if folders else path)
    if not path.is_file():
        raise BadImage(f"image file {str(path)!r} does not exist")
    try:
        return Image.open(path)
    except Image.DecompressionBombError as error:
        raise BadImage(f"image file {str(path)!r} is too large to decode safely ({error})") from error
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise BadImage(f"{str(path)!r} is not an image file PIL can read ({type(error).__name__})") from error


def fit_size(size: tuple[int, int], max_pixels: int = 0, max_side: int = 0) -> tuple[int, int]:
    """`size` scaled down (aspect kept) to at most max_pixels pixels and max_side per side (0: no limit)."""
    width, height = size
    scale = 1.0
    if max_side and max(width, height) > max_side:
        scale = max_side / max(width, height)
    if max_pixels and width * height * scale * scale > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
    if scale >= 1.0:
        return size
    return max(1, int(width * scale + 1e-6)), max(1, int(height * scale + 1e-6))


def load_image(value: Any, folders: tuple[Path, ...] = (), max_pixels: int = 0, max_side: int = 0) -> Image.Image:
    """The RGB image the model sees, from one image value: decoded, converted, downscaled to fit
    max_pixels and max_side. BadImage (NoImage when there is none) saying what is wrong."""
    with warnings.catch_warnings():  # big images are downscaled here; too big ones raise below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = open_image(value, folders)
        name = getattr(image, "filename", "") or ""
        what = f"image file {name!r}" if name else "the image"
        try:
            target = fit_size(image.size, max_pixels, max_side)
            if target != image.size and image.format == "JPEG":
                image.draft(None, target)  # decode at 1/2, 1/4 or 1/8 scale, no smaller than target
            image.load()
        except Image.DecompressionBombError as error:
            raise BadImage(f"{what} is too large to decode safely ({error})") from error
        except (OSError, SyntaxError, ValueError, EOFError) as error:
            raise BadImage(f"{what} cannot be decoded, truncated or corrupt "
                           f"({type(error).__name__}: {error})") from error
    image = to_rgb(image)
    target = fit_size(image.size, max_pixels, max_side)
    return image.resize(target) if target != image.size else image
