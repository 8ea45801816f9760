"""`vlmrl merge ADAPTER OUT`: a LoRA adapter merged into its base model, written as a model folder.

The folder is what `save_pretrained` writes for the base model's class (config.json,
model.safetensors) with the adapter's weights folded in (peft's merge_and_unload), and the processor
and tokenizer files: plain transformers loads it (`AutoModelForImageTextToText.from_pretrained`), and
so does every vlmrl command, with no peft and no base model at hand. The weights keep the base's
dtype unless another is asked for. The merge runs on the CPU: it is one pass over the weights.

The folder is written under a temporary name beside OUT (`.OUT.partial`) and renamed to OUT once
whole: a write that fails (a full disk) removes it, so OUT never holds half a model that loads as one.

Where transformers' `AutoProcessor` cannot load the written processor (the Qwen2-VL families'
processors require a video processor, and each of those needs torchvision, which vlmrl's CPU
install has not), `plain_processor_note` says so and names what loads it (docs/models.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlmrl.disk import cannot_write, output_folder, writing
from vlmrl.errors import VlmrlError
from vlmrl.models.adapter_folder import ADAPTER_CONFIG, describe_folder, is_adapter_folder
from vlmrl.models.loading import DTYPES, load_policy
from vlmrl.models.model_source import find_model_config, first_line


def merge_adapter_folder(adapter: str, out: str, dtype: str = "auto") -> Path:
    """Merge the LoRA adapter folder `adapter` into its base and write the model to `out` (a new or
    empty folder); returns `out`. `dtype`: "auto" (the base's, from its config.json) or a DTYPES name."""
    folder = Path(adapter).expanduser()
    if not folder.is_dir():
        raise VlmrlError(f"LoRA adapter folder {adapter!r} does not exist")
    if (folder / "config.json").is_file():
        raise VlmrlError(f"{adapter!r} is a model folder (config.json), not a LoRA adapter ({ADAPTER_CONFIG}): "
                         "there is nothing to merge; every vlmrl command and transformers load it as it is")
    if not is_adapter_folder(folder):
        raise VlmrlError(describe_folder(folder))
    target = Path(out)
    if target.is_dir() and any(target.iterdir()):
        raise VlmrlError(f"{out!r} is a folder that is not empty; give a new or empty folder for the merged model")
    chosen = base_dtype(find_model_config(adapter)) if dtype == "auto" else dtype
    made = not target.exists()
    output_folder(target, "the merged model")  # a bad OUT in one line, before the model loads
    model, processor = load_policy(adapter, dtype=chosen, device="cpu")
    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an earlier merge that was killed left
    try:
        with writing("the merged model", target):
            try:
                model.save_pretrained(partial)
                processor.save_pretrained(partial)
            except OSError as error:  # any other failed write: one line too
                raise cannot_write("the merged model", target, error) from error
        os.replace(partial, target)  # onto the empty OUT: the whole folder appears at once
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if made and target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        raise
    return target


def plain_processor_note(folder: str | Path) -> str | None:
    """None where transformers' `AutoProcessor.from_pretrained(folder)` loads a processor that takes
    images; else what does load it here, in a line (it may fail, or return the tokenizer alone)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder))
        if getattr(processor, "image_processor", None) is not None:
            return None
        why = f"it returns a {type(processor).__name__}, which takes no image"
    except (OSError, ImportError, ValueError, AttributeError) as error:
        why = first_line(error).split(". ")[0]
    video = ": the family's processor needs torchvision for its video processor" if "video" in why else ""
    return (f"transformers' AutoProcessor cannot load the processor of {str(folder)!r} here ({why}){video}. "
            f"Load it with vlmrl.models.loading.load_processor({str(folder)!r}) and pass it on (TRL: "
            "GRPOTrainer(..., processing_class=processor)): docs/models.md, 'Loading a folder vlmrl wrote'")


def base_dtype(config: dict | None) -> str:
    """The dtype name config.json gives the weights (dtype, or torch_dtype before transformers 5;
    in text_config for some families), float32 when it names none vlmrl loads in."""
    for part in (config or {}, (config or {}).get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if part.get(key) in DTYPES:
                return part[key]
    return "float32"
