"""Load any Hugging Face image-text-to-text model and its processor as a policy to train.

One path for every model: the offline tiny model, Qwen2.5-VL-3B from the hub, a local fine-tune.
Options a researcher reaches for: dtype, device, attention implementation, LoRA (vision tower left
out by default), a frozen vision tower, gradient checkpointing. Remote code runs only when asked.
The vision tower is found by parameter name, with no per-architecture code.

`load_trainable_policy` is the policy as a run trains it: the run's model settings, the full weights
or LoRA adapter of a checkpoint on resume, and the speedups' module swaps (fused kernels, batched
vision windows) chosen once. The session and `vlmrl check` both load through it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch

from vlmrl.config import Config, LoraConfig, device_rule
from vlmrl.errors import VlmrlError, require
from vlmrl.models.adapter_folder import (
    ADAPTER_FILE, adapter_base, adapter_settings, is_adapter_folder, no_base_config_warning)
from vlmrl.models.folder_check import (
    check_fit, check_image_token, check_loaded_weights, check_processor_family, check_vocabulary, check_weight_file,
    check_weight_files, shape_fit, tensor_shapes, withheld_load_report)
from vlmrl.models.fused_kernels import use_fused_kernels
from vlmrl.models.model_source import (
    check_model_source, find_model_config, first_line, missing_processor_part, processor_class, saved_processor_class)
from vlmrl.models.video_processing import attach_video
from vlmrl.models.processing import image_text_processor_class
from vlmrl.models.support import hf_model, video_unsupported
from vlmrl.models.vision_attention import use_batched_vision_attention

# Module names under which the families keep their vision encoder (Qwen: `visual`; Idefics3,
# LLaVA, Gemma 3: `vision_model` / `vision_tower`).
VISION_MODULE_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder")
_VISION_RE = re.compile(r"(^|\.)(" + "|".join(VISION_MODULE_NAMES) + r")(\.|$)")
PLACES = ("device", "host", "meta")
"""Where `load_policy` puts the model: on the device, in CPU memory, or on the meta device (no weights)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_vision_parameter(name: str) -> bool:
    """True for a parameter of the vision tower (by module name, any family)."""
    return bool(_VISION_RE.search(name))


def resolve_device(device: str, name: str = "device", present: bool = True) -> torch.device:
    """"auto" is CUDA when present, else CPU. A device that is not one (config.DEVICES: "gpu") or, with
    `present`, that this machine does not have (cuda on a torch built without it, cuda:3 of two GPUs,
    mps off a Mac) is one line naming the setting `name` (model.device, --device), before anything loads."""
    require(device_rule(name, device))
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = torch.device(device)
    if not present:
        return target
    if target.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise VlmrlError(f"{name}={device} but {why} (torch {torch.__version__}): use cpu or auto, or install "
                             "a CUDA build of torch on a machine with a GPU")
        count = torch.cuda.device_count()
        if target.index is not None and target.index >= count:
            raise VlmrlError(f"{name}={device} but this machine has {count} GPU(s): cuda:0 .. cuda:{count - 1}")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise VlmrlError(f"{name}=mps but MPS (Apple GPUs) is not available here: use cpu or auto")
    return target


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" is bfloat16 on a GPU and float32 on a CPU (bf16 is several times slower there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise VlmrlError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_processor(name_or_path: str, trust_remote_code: bool = False):
    """The model's processor (image processor + tokenizer + chat template).

    `AutoProcessor` first; where it cannot load (the Qwen2-VL family needs torchvision for its video
    processor), the family's own processor class without the video slot. Refused in one line where
    the processor files are another family's than config.json (folder_check.py).
    """
    from transformers import AutoProcessor, ProcessorMixin
    config = check_model_source(name_or_path, trust_remote_code)
    check_processor_family(name_or_path, config)
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ImportError, ValueError) as auto_error:
        class_name = saved_processor_class(name_or_path)
        base = processor_class(class_name) if class_name else None
        if base is None:
            raise VlmrlError(f"cannot load a processor from {name_or_path!r}: "
                             f"{missing_processor_part(name_or_path) or first_line(auto_error)}")
        try:
            processor = image_text_processor_class(base).from_pretrained(name_or_path)
        except (OSError, ImportError, ValueError) as error:
            raise VlmrlError(f"cannot load a processor from {name_or_path!r}: "
                             f"{missing_processor_part(name_or_path) or first_line(error)}")
    if not isinstance(processor, ProcessorMixin) or getattr(processor, "image_processor", None) is None:
        raise VlmrlError(
            f"{name_or_path!r} has no image processor (no processor_config.json or "
            "preprocessor_config.json): it is not an image-text-to-text model folder")
    if not getattr(processor, "chat_template", None):  # every prompt is written with it (prompts.py)
        raise VlmrlError(f"{name_or_path!r} has no chat template (chat_template.jinja, or chat_template in its "
                         "processor or tokenizer config), which vlmrl writes every prompt with; copy it from the "
                         "model it was made from")
    processor.tokenizer.padding_side = "left"  # generation appends on the right
    if config is not None and video_unsupported(config.get("model_type", "")) is None:
        attach_video(processor, name_or_path)  # the family's video math without torchvision
    return processor


def load_policy(
    name_or_path: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    lora: LoraConfig | None = None,
    freeze_vision: bool = False,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    place: str = "device",
):
    """Load an image-text-to-text model and its processor, ready to train. `name_or_path`: a model
    folder, a hub id, or a LoRA adapter folder (its base with the adapter merged: adapter_folder.py).

    Returns (model, processor). With `lora`, the model is a peft model with only the adapter
    trainable; with `freeze_vision`, the vision tower's parameters do not train. `place` (PLACES):
    "device" puts the model on `device`; "host" leaves it in CPU memory, in the dtype chosen for
    `device`, for a caller that moves it onto `device` a piece at a time (sharding), so that it is
    never whole there; "meta" builds it on the meta device without reading any weight (they come
    from another process once sharded: sharding.shard's `weights_from_main`).

    A damaged weights file, a weight missing from the files (which transformers would start from
    random values), one the model has no place for or of another shape, a tokenizer whose image
    token is not config.json's and one larger than the model's embedding are refused in one line
    (folder_check.py).
    """
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}; got {place!r}")
    processor = load_processor(name_or_path, trust_remote_code=trust_remote_code)
    check_image_token(name_or_path, find_model_config(name_or_path), processor)  # the hub asked once
    target = resolve_device(device, present=place == "device")  # elsewhere the device only settles the dtype
    model = load_checked_model(name_or_path, resolve_dtype(dtype, target), attn_implementation, trust_remote_code,
                               on_meta=place == "meta")
    check_vocabulary(name_or_path, model, processor.tokenizer)
    if place == "device":
        model.to(target)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    if freeze_vision:
        set_vision_trainable(model, False)
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora)
    if gradient_checkpointing:
        checkpoint_activations(model)
    return model, processor


def load_checked_model(name_or_path: str, dtype: torch.dtype, attn_implementation: str | None,
                       trust_remote_code: bool, on_meta: bool):
    """The model of `name_or_path` (on the meta device: `on_meta`), after checking its weight files,
    with every weight from them: none missing, unused or of another shape (folder_check.py). For a
    LoRA adapter folder: its base's model with the adapter merged in (on the meta device, the base's:
    the same parameters, their values come later)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForImageTextToText

    if is_adapter_folder(name_or_path):
        base = load_checked_model(adapter_base(name_or_path), dtype, attn_implementation, trust_remote_code, on_meta)
        return base if on_meta else merge_adapter(base, Path(name_or_path).expanduser())
    check_weight_files(name_or_path)
    try:
        with withheld_load_report():
            model, info = AutoModelForImageTextToText.from_pretrained(
                name_or_path,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                ignore_mismatched_sizes=True,  # reported in `info`, refused by check_loaded_weights
                output_loading_info=True,
                **({"device_map": "meta"} if on_meta else {}),
            )
    except SafetensorError as error:  # a hub model's file (a local folder's are checked before)
        raise VlmrlError(f"cannot load model {name_or_path!r}: a weights file is damaged ({first_line(error)})")
    except (OSError, ValueError, ImportError) as error:
        raise VlmrlError(f"cannot load model {name_or_path!r}: {first_line(error)}")
    check_loaded_weights(name_or_path, info)
    return model


def load_trainable_policy(config: Config, device: torch.device, checkpoint: Path | None, place: str = "device"):
    """The policy and processor, for `device`; from `checkpoint` when resuming (full weights or LoRA
    adapter). `place` as load_policy's: in CPU memory ("host") or without weights ("meta"), its
    dtype and the speedups' self-checks are still settled for `device`."""
    settings = config.model
    source = str(checkpoint) if checkpoint is not None and not settings.lora.enabled else settings.name_or_path
    policy, processor = load_policy(
        source, dtype=settings.dtype, device=str(device), attn_implementation=settings.attn_implementation,
        lora=settings.lora, freeze_vision=settings.freeze_vision,
        gradient_checkpointing=settings.gradient_checkpointing is True, trust_remote_code=settings.trust_remote_code,
        place=place)
    if checkpoint is not None and settings.lora.enabled and place != "meta":
        load_adapter_weights(policy, checkpoint)
    # each falls back where it cannot serve on `device` (its reason in the speed line)
    use_fused_kernels(policy, config.train.fused_kernels, device=device)
    use_batched_vision_attention(policy, config.train.batched_vision_attention, device=device)
    return policy, processor


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (non-reentrant); the method was renamed in transformers 5.x."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether gradient checkpointing is on (the property was renamed in transformers 5.x)."""
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Turn gradient checkpointing on in a loaded policy (a LoRA one too: its inputs then need grad)."""
    if is_checkpointing(model):
        return
    enable_checkpointing(model)
    if hasattr(model, "peft_config"):
        model.enable_input_require_grads()


def set_vision_trainable(model: torch.nn.Module, trainable: bool) -> int:
    """Turn training of the vision tower on or off; returns how many parameters it touched."""
    count = 0
    for name, param in model.named_parameters():
        if is_vision_parameter(name):
            param.requires_grad_(trainable)
            count += param.numel()
    if count == 0:
        raise VlmrlError("no vision-tower parameters found in this model "
                         f"(looked for modules named {', '.join(VISION_MODULE_NAMES)})")
    return count


def apply_lora(model: torch.nn.Module, settings: LoraConfig):
    """Wrap `model` with a LoRA adapter; only adapter weights train afterwards."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    exclude = None if settings.include_vision else r".*(" + "|".join(VISION_MODULE_NAMES) + r").*"
    config = PeftLoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), exclude_modules=exclude, bias="none",
    )
    try:
        with warnings.catch_warnings():  # peft's own use of a name transformers 5.24 deprecates: not the user's
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:
        raise VlmrlError(f"LoRA: {first_line(error)} (target_modules={settings.target_modules})")


def load_adapter_weights(model: torch.nn.Module, folder: Path) -> None:
    """Put a saved LoRA adapter's weights into a peft model, after checking that the file is whole and
    holds exactly the adapter's tensors, in their shapes (folder_check.py): one line otherwise."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = folder / ADAPTER_FILE
    if not path.exists():
        raise VlmrlError(f"checkpoint {folder} has no {ADAPTER_FILE}")
    check_weight_file(path, "LoRA adapter file")
    with no_base_config_warning():
        expected = {name: tuple(value.shape) for name, value in get_peft_model_state_dict(model).items()}
    check_fit(f"LoRA adapter in {folder}", ADAPTER_FILE, *shape_fit(expected, tensor_shapes(path)),
              "the run's LoRA settings")
    set_peft_model_state_dict(model, load_file(path))


def merge_adapter(model: torch.nn.Module, folder: Path):
    """`model` with the LoRA adapter saved in `folder` merged into its weights (peft's
    merge_and_unload), the adapter file checked as `load_adapter_weights` checks it. Every parameter of the
    merged model trains, as a model folder's does (peft leaves the base's frozen). The merged model's
    name_or_path is the adapter folder: an adapter trained on top of it names that folder as its base."""
    from peft import PeftConfig, get_peft_model

    settings = adapter_settings(folder)
    if settings.get("peft_type") != "LORA":
        raise VlmrlError(f"{str(folder)!r} holds a {settings.get('peft_type')} adapter; vlmrl loads LoRA adapters")
    try:
        peft_config = PeftConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as error:
        raise VlmrlError(f"cannot read the LoRA adapter settings in {folder}: {first_line(error)}") from None
    peft_config.base_model_name_or_path = None  # the base is loaded already: no rename warning
    peft_config.inference_mode = False
    with warnings.catch_warnings():  # peft's own use of a name transformers 5.24 deprecates: not the user's
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        adapted = get_peft_model(model, peft_config)
    load_adapter_weights(adapted, folder)
    merged = adapted.merge_and_unload()
    for parameter in merged.parameters():  # peft froze the base under its adapter: the merged model is whole again
        parameter.requires_grad_(True)
    merged.name_or_path = merged.config.name_or_path = str(folder.resolve())
    return merged


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


@contextlib.contextmanager
def counting_vision_rows(model: torch.nn.Module):
    """Within: the yielded list holds, per call of the vision tower, the rows it was given (patches
    for Qwen-VL, images for Idefics3). For tests and benchmarks."""
    tower = next(m for name, m in hf_model(model).named_modules() if name.split(".")[-1] in VISION_MODULE_NAMES)
    calls: list[int] = []

    def hook(module, args, kwargs):
        first = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        calls.append(int(first.shape[0]))

    handle = tower.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
