"""What a training forward keeps for backward, per token: measured on the loaded model.

The preflight's memory estimate (preflight.py) needs the bytes autograd keeps between a micro-
batch's forward and its backward. They depend on the architecture (widths, a gated MLP), the dtype
(bfloat16 models keep their norms and rotary embeddings in float32), the kernels (SDPA's, fused
ones) and what trains (a frozen tower keeps nothing, a LoRA adapter keeps its inputs), so they are
measured rather than modelled: `measure_activation_costs` runs three short forwards of the model
as it will train and records every tensor autograd saves (each storage once, parameters not
counted; torch.autograd.graph.saved_tensors_hooks), and which of them a checkpointable layer
(transformers' GradientCheckpointingLayer: a decoder layer, a vision block) saved:

    text(k)   k text tokens                         per_token       = (text(2k) - text(k)) / k
    image     k tokens, m of them an image's        per_image_token = (image - text(k)) / m

per_token covers the language model, per_image_token the vision tower (and its projection into
the text model) per image token it produces; `in_layers` and `in_blocks` are their shares saved
inside the layers. Both are linear in the tokens for SDPA's fused kernels, which keep one
log-sum-exp per query rather than the L x L scores. At the Qwen2.5-VL-3B architecture's widths a
micro-batch of plain rows keeps what these figures say within 0.5%, packed groups (dense mask)
within 5%; the block kernel (block_attention.py) also keeps each completion's copy of its prompt's
keys and values, which the preflight adds. In bfloat16 the 3B keeps 127 KiB per token per layer,
257 KiB per image token per vision block (benchmarks/bench_memory.py, RESULTS.md).

Gradient checkpointing keeps no activations inside a checkpointed layer, only its input (hidden
size values per token), and recomputes one layer at a time in backward: the probe turns it off
while it measures (and back on), and `ActivationCosts.peak` gives both figures. What backward
allocates beyond the layers, parameter gradients in flight, is not an activation: a trainable
embedding's (`embedding_gradients`) is the largest, three of them at once when it is tied to the
output layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from PIL import Image
from transformers.modeling_layers import GradientCheckpointingLayer

from vlmrl.models.support import hf_model
from vlmrl.rollout.prompts import encode_prompts, image_token_id
from vlmrl.tasks import Example

PROBE_IMAGE = 112
"""Side in pixels of the probe's image (64 patches, 16 image tokens for Qwen-VL)."""


@dataclass(frozen=True)
class ActivationCosts:
    """Bytes a training forward keeps for backward, per token, as measured on one model."""

    per_token: float
    """A text token through the language model, all layers."""
    per_image_token: float
    """An image token's share of the vision tower (0 when the tower keeps nothing)."""
    in_layers: float
    """Of per_token, what the language model's layers keep (all of them): checkpointing drops it."""
    in_blocks: float
    """Of per_image_token, what the vision blocks keep (all of them): checkpointing drops it."""
    layers: int
    """Layers of the language model."""
    layer_input: int
    """Bytes of one layer's input per token (hidden size x dtype): what checkpointing keeps per layer."""
    vision_layers: int
    """Blocks of the vision tower (1 when unknown)."""
    vision_layer_input: int
    """Bytes of one vision block's input per image token, all its patches (0 when unknown)."""

    def peak(self, tokens: int, image_tokens: int, checkpointing: bool = False, readout: int = 0,
             held: int = 0) -> int:
        """Bytes a forward and backward over `tokens` text positions (image tokens included), with
        `image_tokens` from images, hold at their peak: what the forward keeps, then the larger of
        `readout` (what the output layer's chunk allocates as backward starts) and what backward
        holds while it goes through the layers: `held` (gradients waiting in autograd's buffers)
        and the layer it is in.

        That is half a layer (the larger of a text layer and a vision block over the batch): backward
        frees each layer's activations as it adds that layer's gradients. Under checkpointing a layer
        keeps only its input, and backward recomputes one layer at a time and holds it with its
        gradients: one and a half layers."""
        layer = max(self.in_layers / self.layers * tokens, self.in_blocks / self.vision_layers * image_tokens)
        kept = self.per_token * tokens + self.per_image_token * image_tokens
        if not checkpointing:
            return round(kept + max(readout, held + layer / 2))
        inputs = self.layers * self.layer_input * tokens + self.vision_layers * self.vision_layer_input * image_tokens
        outside = kept - self.in_layers * tokens - self.in_blocks * image_tokens
        return round(outside + inputs + max(readout, held + 1.5 * layer))


def embedding_gradients(model: torch.nn.Module) -> tuple[int, int]:
    """(held, last): bytes of embedding gradients that backward holds from its start, and that it
    allocates at its end. A trainable input embedding gets a dense (vocabulary x hidden) gradient
    as backward ends; tied to the output layer (Qwen2.5-VL-3B), the output layer's gradient waits in
    autograd's buffer from the start of backward until then, and the two are summed into a third
    (measured on the CPU: 3 x 1187 MiB above the start for the 3B's fp32 embedding)."""
    inner = hf_model(model)
    weight = inner.get_input_embeddings().weight
    if not weight.requires_grad:
        return 0, 0
    size = weight.numel() * weight.element_size()
    output = inner.get_output_embeddings()
    return (size, 3 * size) if output is not None and output.weight is weight else (0, size)


def saved_bytes(forward, model: torch.nn.Module) -> int:
    """Bytes of the tensors autograd saves for backward while `forward()` runs, each storage once,
    the model's parameters not counted."""
    return sum(saved_bytes_by_place(forward, model))


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter sharded by FSDP2 (a DTensor has no storage of its own)."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def saved_bytes_by_place(forward, model: torch.nn.Module) -> tuple[int, int]:
    """`saved_bytes` in two parts: (saved inside a checkpointable layer, saved elsewhere). A storage
    saved in both places counts where it was saved first."""
    parameters = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, bool]] = {}  # data pointer -> (bytes, saved inside a layer)
    depth = [0]  # checkpointable layers the forward is inside

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters:
            size, inside = storages.get(pointer, (0, depth[0] > 0))
            storages[pointer] = (max(size, storage.nbytes()), inside)
        return tensor

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    handles = [handle for module in model.modules() if isinstance(module, GradientCheckpointingLayer)
               for handle in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), torch.enable_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    inside = sum(size for size, in_layer in storages.values() if in_layer)
    return inside, sum(size for size, _ in storages.values()) - inside


def measure_activation_costs(model: torch.nn.Module, processor) -> ActivationCosts:
    """`ActivationCosts` of `model` as it will train (its dtype, kernels, adapter, frozen parts),
    from three short forwards; the random state and gradient checkpointing are left as they were."""
    device = next(model.parameters()).device
    inputs = encode_prompts(processor, [Example(Image.new("RGB", (PROBE_IMAGE, PROBE_IMAGE), (200, 60, 20)),
                                                "What is shown?", "")], device)  # (1, k)
    length = inputs["input_ids"].shape[1]  # k
    image_tokens = int((inputs["input_ids"] == image_token_id(processor, hf_model(model).config)).sum())  # m
    plain = processor.tokenizer.encode("a", add_special_tokens=False)[0]

    def text(n: int) -> tuple[int, int]:
        ids = torch.full((1, n), plain, device=device)  # (1, n)
        return saved_bytes_by_place(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                  use_cache=False), model)

    with _checkpointing_paused(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        short, long = text(length), text(2 * length)  # (inside layers, elsewhere) each
        image = saved_bytes_by_place(lambda: model(**inputs, use_cache=False), model)
    per_image = max(sum(image) - sum(short), 0) / max(image_tokens, 1)
    return ActivationCosts(per_token=(sum(long) - sum(short)) / length, per_image_token=per_image,
                           in_layers=(long[0] - short[0]) / length,
                           in_blocks=min(max(image[0] - short[0], 0) / max(image_tokens, 1), per_image),
                           **_layer_sizes(model))


def _layer_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Layer counts and per-token input bytes of the language model and the vision tower."""
    config = hf_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = next(model.parameters()).element_size()
    vision = getattr(config, "vision_config", None)
    depth, width, merge = 1, 0, 1
    if vision is not None:
        depth = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", None) or 1
        width = getattr(vision, "embed_dim", None) or getattr(vision, "hidden_size", 0)  # Qwen2-VL: embed_dim
        merge = getattr(vision, "spatial_merge_size", None) or getattr(config, "scale_factor", None) or 1  # Idefics3
    return {"layers": text.num_hidden_layers, "layer_input": text.hidden_size * size, "vision_layers": depth,
            "vision_layer_input": merge * merge * width * size}


@contextlib.contextmanager
def _checkpointing_paused(model: torch.nn.Module):
    """Within: no module recomputes (transformers' `gradient_checkpointing` flags off); restored after."""
    flags = {module: module.gradient_checkpointing for module in model.modules()
             if isinstance(getattr(module, "gradient_checkpointing", None), bool)}
    try:
        for module in flags:
            module.gradient_checkpointing = False
        yield
    finally:
        for module, flag in flags.items():
            module.gradient_checkpointing = flag
