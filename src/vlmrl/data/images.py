"""Image values as the RGB images a model sees: the forms datasets hand back (a PIL image, bytes, a
dict of bytes or path, a path relative to the data file, a list of any of these) and the forms JSON
data writes (base64 text under `bytes`, a `data:image/...;base64,` URI: decoded here, never fetched),
decoded once, converted and downscaled. Paths are read inside the data folder (data/paths.py). The
images of a data row (tasks/dataset.py) and what a tool returns (tools/results.py) go through the same
conversion.

Every image becomes RGB: transparency is laid over white (diagrams are often black lines on a
transparent background), 16-bit and float greys are scaled to 8 bits, CMYK, palette and the rest
converted; one with more than max_pixels pixels is downscaled (aspect kept; a JPEG is decoded at a
reduced scale in the first place). A value that cannot become such an image raises `BadImage`
saying why in one short line, naming what the value is (its type and first characters) when it is
none of these forms (`NoImage` when there is no image at all).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import warnings
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from vlmrl.data.paths import Media, media_file, preview, shown
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


IMAGE_KEYS = frozenset({"bytes", "path"})
"""The keys of an image dict (the `datasets` Image feature's)."""
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)


def image_values(value: Any) -> list[Any]:
    """The image values of one row's image cell, in order: a list's items, a single value alone;
    [] for null, "", an empty list or {bytes: None, path: None}."""
    if isinstance(value, (list, tuple)):
        return [item for item in value if not _empty(item)]
    return [] if _empty(value) else [value]


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value) or (
        isinstance(value, dict) and set(value) <= IMAGE_KEYS and not value.get("bytes") and not value.get("path"))


def image_file(value: Any, where: Media = Media()) -> Path | None:
    """The file an image value names (a path, or a dict's path without bytes), resolved inside
    `where` (data/paths.py); None for a value that holds its image (bytes, a data: URI, a PIL image)."""
    if isinstance(value, dict) and set(value) <= IMAGE_KEYS and not value.get("bytes"):
        value = value.get("path")
    if not isinstance(value, str) or not value or value[:5].lower() == "data:" or \
            value.startswith(("http://", "https://")):
        return None
    return media_file(value, where, "image")


def open_image(value: Any, where: Media = Media()) -> Image.Image:
    """A PIL image, not yet decoded, from one image value: a PIL image, bytes, a dict of `bytes` (raw
    or base64 text) or `path`, a path (relative ones looked up in `where`, reads kept inside it), or
    a `data:image/...;base64,` URI (decoded here, never fetched). BadImage in one line naming what
    the value is (its type and first characters) when it is none of these."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray)):
        return _from_bytes(bytes(value), "the image bytes")
    if isinstance(value, dict):
        if set(value) - IMAGE_KEYS:
            raise BadImage(f"the image column holds a dict with keys {sorted(map(str, value))[:6]}; an image dict "
                           "has `bytes` or `path`")
        data = value.get("bytes")
        if data:
            if isinstance(data, (bytes, bytearray)):
                return _from_bytes(bytes(data), "the image bytes")
            if isinstance(data, str):
                return _from_text(data, "the image's `bytes`")
            raise BadImage(f"the image's `bytes` holds {preview(data)}, not bytes or base64 text")
        if value.get("path"):
            return open_image(value["path"], where)
        raise NoImage("no image (neither bytes nor a path)")
    if value is None or value == "" or value == [] or value == ():
        raise NoImage("no image")
    if isinstance(value, str):
        if _DATA_URI.match(value):
            return _from_text(value, "the image's data: URI")
        if value[:5].lower() == "data:":
            raise BadImage(f"the image column holds {preview(value)}: a data: URI of an image is "
                           "data:image/TYPE;base64,DATA")
        return _open_file(value, where)
    raise BadImage(f"the image column holds {preview(value)}, not an image, image bytes, a path or a "
                   "data:image/...;base64, URI")


def _from_text(text: str, what: str) -> Image.Image:
    """An image from base64 text, bare or a `data:image/...;base64,` URI (decoded here, never fetched)."""
    match = _DATA_URI.match(text)
    payload = text[match.end():] if match else text
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadImage(f"{what} is {preview(text)}, not base64 image data (an image value is bytes, base64 "
                       "text under `bytes`, a path or a data:image/...;base64, URI)") from None
    return _from_bytes(data, f"{what} (base64)")


def _from_bytes(data: bytes, what: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as error:
        raise BadImage(f"the image is too large to decode safely ({error})") from error
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise BadImage(f"{what} are not an image PIL can read ({type(error).__name__}: "
                       f"{preview(data)[:80]})") from error


def _open_file(value: str, where: Media) -> Image.Image:
    if value.startswith(("http://", "https://")):
        raise BadImage(f"image {shown(value)} is a URL: download the images and give their paths (no network here)")
    try:
        path = media_file(value, where, "image")
    except VlmrlError as error:
        raise BadImage(str(error)) from None
    try:
        return Image.open(path)
    except Image.DecompressionBombError as error:
        raise BadImage(f"image file {shown(value)} is too large to decode safely ({error})") from error
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise BadImage(f"{shown(value)} is not an image file PIL can read ({type(error).__name__})") from error


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


def load_image(value: Any, where: Media = Media(), max_pixels: int = 0, max_side: int = 0) -> Image.Image:
    """The RGB image the model sees, from one image value: decoded, converted, downscaled to fit
    max_pixels and max_side. BadImage (NoImage when there is none) saying what is wrong."""
    with warnings.catch_warnings():  # big images are downscaled here; too big ones raise below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = open_image(value, where)
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
