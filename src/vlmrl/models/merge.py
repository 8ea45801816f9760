"""`vlmrl merge ADAPTER OUT`: a LoRA adapter merged into its base model, written as a model folder.

The folder is what `save_pretrained` writes for the base model's class (config.json,
model.safetensors) with the adapter's weights folded in (peft's merge_and_unload), and the processor
and tokenizer files: plain transformers loads it (`AutoModelForImageTextToText.from_pretrained`), and
so does every vlmrl command, with no peft and no base model at hand. The weights keep the base's
dtype unless another is asked for. The merge runs on the CPU: it is one pass over the weights.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.disk import output_folder, writing
from vlmrl.errors import VlmrlError
from vlmrl.models.adapter_folder import ADAPTER_CONFIG, describe_folder, is_adapter_folder
from vlmrl.models.loading import DTYPES, load_policy
from vlmrl.models.model_source import find_model_config


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
    output_folder(target, "the merged model")  # a bad OUT in one line, before the model loads
    model, processor = load_policy(adapter, dtype=chosen, device="cpu")
    with writing("the merged model", target):
        model.save_pretrained(target)
        processor.save_pretrained(target)
    return target


def base_dtype(config: dict | None) -> str:
    """The dtype name config.json gives the weights (dtype, or torch_dtype before transformers 5;
    in text_config for some families), float32 when it names none vlmrl loads in."""
    for part in (config or {}, (config or {}).get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if part.get(key) in DTYPES:
                return part[key]
    return "float32"
