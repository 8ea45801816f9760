"""Processors for image+text work on machines without torchvision.

In transformers 5.x many families' processors require a video processor, and every video processor
needs torchvision, which has no CPU build here. vlmrl derives, from the family's own processor
class, one whose constructor takes no video processor. The text and image handling is the family's
own code, untouched; only the video slot is empty (video_processing.py fills it with a twin
without torchvision for the families that take video in vlmrl).

Two things make the derived class round-trip like the family's own:
- its `__init__` has the family's own parameters, by name and default, minus the video processor:
  `ProcessorMixin.to_dict` saves only what `inspect.signature(__init__)` names and `from_pretrained`
  passes only what `__init__.__code__.co_varnames` names, so a `(..., **extra)` constructor would lose
  settings such as InternVL's `image_seq_length` or LLaVA-OneVision's `num_image_tokens`;
- everything is passed by name: families order their parameters differently (Gemma 4: feature
  extractor, image processor, tokenizer, video processor; MiniCPM-V 4.6: image processor, video
  processor, tokenizer), and hand them on to `ProcessorMixin` positionally in that order or by keyword.
  `ProcessorMixin` names positional arguments by the constructor's parameters, which the video slot no
  longer is, so a class between the family's and `ProcessorMixin` names them by the family's order and
  drops the video slot.
A family whose own constructor reads the video processor (MiniCPM-V 4.6 reads its `slice_mode`) still
cannot be built without one. A family whose own `apply_chat_template` is there only to fill in video
settings (SmolVLM's reads its video processor's frame count and rate, and writes a conversation
with a video by the family's default template) renders through `ProcessorMixin`'s, which is what it
calls for images and text, until vlmrl puts its video twin in the slot (video_processing.py): then
through the family's own.

Some processor modules import a torchvision image processor's module for a helper function alone
(Pixtral's imports `image_processing_pixtral` for `get_resize_output_image_size`).
`import_processor_module` lets the module's PIL twin (`image_processing_pil_pixtral`, which has the
same helpers without torchvision) stand in for it, so the processor imports here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys

VIDEO = "video_processor"


@functools.cache
def image_text_processor_class(base: type) -> type:
    """`base` (a `ProcessorMixin` subclass) without its video processor; `base` if it has none.

    The derived class keeps `base`'s name, so a saved `processor_config.json` names the family's
    real processor and loads with `AutoProcessor` wherever torchvision is installed.
    """
    from transformers import ProcessorMixin

    if VIDEO not in inspect.signature(base.__init__).parameters:
        return base
    order = base.get_attributes()  # the family's sub-processors, in its own order, video included

    class WithoutVideo(ProcessorMixin):
        """Names the sub-processors `base` hands on positionally, and drops the video slot."""

        def __init__(self, *args, **named):  # ProcessorMixin's own signature
            named.update(zip(order, args))
            named.pop(VIDEO, None)
            ProcessorMixin.__init__(self, **named)

    body = {"__init__": _init_without_video(base), "__module__": __name__,
            "__doc__": f"{base.__name__} for images and text only."}
    if base.apply_chat_template is not ProcessorMixin.apply_chat_template:
        body["apply_chat_template"] = _template_once_video(base)  # the family's own reads the video slot
    cls = type(base.__name__, (base, WithoutVideo), body)
    cls.__qualname__ = f"image_text[{base.__name__}]"
    return cls


def _template_once_video(base: type):
    """An `apply_chat_template` that is the family's own once a video processor is in the video slot
    (video_processing.py puts its twin there), else `ProcessorMixin`'s."""
    from transformers import ProcessorMixin

    def apply_chat_template(self, conversation, *args, **kwargs):
        owner = base if getattr(self, VIDEO, None) is not None else ProcessorMixin
        return owner.apply_chat_template(self, conversation, *args, **kwargs)

    return apply_chat_template


def _init_without_video(base: type):
    """An `__init__` with `base.__init__`'s parameters (names, defaults, kinds) minus the video
    processor, that calls `base.__init__` with all of them by name and `video_processor=None`."""
    params = [p for p in list(inspect.signature(base.__init__).parameters.values())[1:]
              if p.name != VIDEO and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    heads, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            heads.append("*")
            star = True
        heads.append(f"{p.name}=_defaults[{p.name!r}]" if p.name in defaults else p.name)
    passed = "".join(f", {p.name}={p.name}" for p in params)
    source = (f"def __init__(self, {', '.join(heads)}):\n"
              f"    _base.__init__(self, {VIDEO}=None{passed})\n")
    namespace = {"_base": base, "_defaults": defaults}
    exec(source, namespace)  # a real signature: from_pretrained reads __code__.co_varnames
    return namespace["__init__"]


PIL_TWIN = "image_processing_pil_"
"""The prefix of a family's PIL image-processor module; `image_processing_<family>` is its
torchvision twin."""


def import_processor_module(module: str):
    """Import a processor's module (`transformers.models.pixtral.processing_pixtral`).

    Where the import fails only because torchvision is missing, the family's torchvision image
    processor modules are replaced in `sys.modules` by their PIL twins (the same helper functions,
    without torchvision), and the import is tried once more; any other error propagates.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "torchvision" or not _stand_in_pil_twins(module.rpartition(".")[0]):
            raise
    return importlib.import_module(module)


def _stand_in_pil_twins(package: str) -> bool:
    """Put each `image_processing_pil_X` of `package` in place of its `image_processing_X` where that
    one does not import for want of torchvision; whether any was put in place."""
    placed = False
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not info.name.startswith(PIL_TWIN):
            continue
        twin = f"{package}.image_processing_{info.name[len(PIL_TWIN):]}"
        try:
            importlib.import_module(twin)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] != "torchvision":
                raise
            sys.modules[twin] = importlib.import_module(f"{package}.{info.name}")
            placed = True
    return placed
