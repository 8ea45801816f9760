"""The model stage: any Hugging Face image-text-to-text model loaded as a policy, and what each
family supports.

    loading.py            load_policy (dtype, device, LoRA, frozen vision, checkpointing) and
                          load_trainable_policy (a run's policy: resumed adapter, kernels chosen)
    merge.py              `vlmrl merge`: a LoRA adapter merged into its base, a plain model folder
    adapter_folder.py     a LoRA adapter folder taken for a model: its base found, moved folders too
    tiny_model.py         the offline tiny builders, one per family (real configs, random weights)
    processing.py         image+text processors that need no torchvision
    model_source.py       a model name or folder checked before anything loads, and refused
                          from its config when vlmrl cannot train it
    folder_check.py       weight files whole and fully loaded, config, processor and tokenizer
                          of one model (a policy, a LoRA adapter, a reference copy)
    fast_paths.py         a fast path that fails on first use falls back to the plain path
    support.py            what each family supports, as data in one table (packing, blocks, ...)
    token_inputs.py       processor outputs along the token axis, and their position ids
    block_attention.py    SDPA over the blocks a packed mask allows
    vision_attention.py   the vision tower's windows in one batched call
    fused_kernels.py      liger-kernel's fused RMSNorm/MLP (CUDA), self-checked before use

May import: torch, transformers, peft, and vlmrl's config, errors, fields and disk. Nothing from the
rollout, training, safety, evaluation or report folders.

    from vlmrl.models import load_policy, build_tiny_model
"""

__all__ = ["build_tiny_model", "load_policy"]


def __getattr__(name: str):
    """The public names, imported when first used: `vlmrl --help` builds its parser from
    tiny_model.py's tables without importing torch (PEP 562)."""
    if name == "load_policy":
        from vlmrl.models.loading import load_policy

        return load_policy
    if name == "build_tiny_model":
        from vlmrl.models.tiny_model import build_tiny_model

        return build_tiny_model
    raise AttributeError(f"module 'vlmrl.models' has no attribute {name!r}")
