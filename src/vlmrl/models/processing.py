"""Processors for image+text work on machines without torchvision.

In transformers 5.x the Qwen2-VL family's processors require a video processor, and every video
processor needs torchvision, which has no CPU build here. vlmrl never feeds video, so it derives,
from the family's own processor class, one whose constructor takes no video processor. The text
and image handling is the family's own code, untouched; only the video slot is gone.
"""

from __future__ import annotations

import functools


@functools.cache
def image_text_processor_class(base: type) -> type:
    """`base` (a `ProcessorMixin` subclass) without its video processor; `base` if it has none.

    The derived class keeps `base`'s name, so a saved `processor_config.json` names the family's
    real processor and loads with `AutoProcessor` wherever torchvision is installed.
    """
    import inspect

    params = inspect.signature(base.__init__).parameters
    if "video_processor" not in params:
        return base

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **extra):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **extra)

    cls = type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                        "__doc__": f"{base.__name__} for images and text only."})
    cls.__qualname__ = f"image_text[{base.__name__}]"
    return cls
