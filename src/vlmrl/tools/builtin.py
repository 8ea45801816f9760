"""The built-in tools by name: the one table a new built-in tool is added to.

The built-in tools are trusted, total and quick (their cost is bounded by the image and
`max_side`), so they run in the trainer's process on the example's images as they are (they only
read them); running.py tells them apart by this table.
"""

from __future__ import annotations

from typing import Any, Callable

from vlmrl.tools.cv_tools import find_objects, measure
from vlmrl.tools.image_tools import zoom, zoom_window
from vlmrl.tools.video_tools import frames


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"zoom": zoom, "crop": zoom, "zoom_window": zoom_window,
                                                "frames": frames, "find_objects": find_objects, "measure": measure}
"""Tools known by name alone; `crop` is another name for `zoom`; find_objects and measure: cv_tools.py."""
