"""FSDP2: the policy (and the reference copy) split over the processes, and what a sharded model
needs that a whole one does not.

`shard` applies torch's `fully_shard` to each repeated block the model names in
`_no_split_modules` (decoder layers, vision blocks), then to the root (embeddings, the output
layer, norms, the merger): each process holds 1/world of every parameter, and a unit is gathered
for its forward and backward only. vlmrl does this itself, on GPUs as on CPU processes (where
accelerate 1.15 would run DDP instead): one code path (strategy.py).

Loading (`shard`): the model arrives in CPU memory and each unit moves onto the device as it is
sharded, so the whole model is never on one device; with `weights_from_main` (accelerate's
`fsdp_cpu_ram_efficient_loading`) the processes other than the main one built it on the meta device
and receive their shards from the main one, one tensor at a time.

What changes once the parameters are DTensors:
- generation (`gathered`): a generate call runs hundreds of forwards, and `generate` calls the
  vision tower outside the root's forward; the whole model is gathered once per call (unshard
  every unit, keep it gathered, generate, reshard, restore each unit's resharding), so a call
  makes no collective and ranks may generate different lengths;
- saving (`full_state`): every process takes part in gathering the full state dicts (weights, and
  the optimizer's keyed by parameter name); the main process writes them;
- resume: the optimizer is built on the sharded parameters and its state put back after
  (`load_optimizer_state`).
The output layer stays in the root unit, which FSDP2 keeps gathered from its forward through its
backward: the chunked output layer (output_layer.py) recomputes chunks with it in backward.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from vlmrl.errors import VlmrlError
from vlmrl.models.support import hf_model

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks the model names as not to be split (`_no_split_modules`), in order."""
    names = set(getattr(hf_model(model), "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: torch.nn.Module, world: int, device: torch.device, reshard_after_forward: bool = True,
          weights_from_main: bool = False) -> int:
    """Apply FSDP2 to `model` in place: each block of `shard_units` (freeing its gathered
    parameters after its forward unless `reshard_after_forward` is False), then the root, which stays
    gathered from its forward through its backward (it holds the output layer). A model in CPU
    memory moves onto `device` a unit at a time, each cut to this process's shards as it goes.
    `weights_from_main` (every process passes the same): the main process holds the weights, the
    others built the model on the meta device (loading.PLACES); once sharded, each process
    receives its shards from the main one, one tensor at a time. Returns the number of units (the
    root included); VlmrlError when the model names no blocks to shard."""
    mesh = init_device_mesh(device.type, (world,))
    units = shard_units(model)
    if not units:
        raise VlmrlError(f"FSDP2: {type(hf_model(model)).__name__} names no blocks to shard (_no_split_modules is "
                         "empty), so each process would gather the whole model for every forward: launch with "
                         "configs/accelerate/ddp.yaml instead")
    # torch warns whenever the root returns a view that requires grad (the packed passes' and the
    # preflight's probes do): an in-place op on it would skip the all-gather in backward; vlmrl never
    # modifies a model's output in place (the equivalence tests would see a skipped all-gather)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    main = torch.distributed.get_rank() == 0
    weights = model.state_dict() if weights_from_main and main else {}  # the CPU tensors as read, kept
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if weights_from_main:
        if not main:  # room for this process's shards alone, the same parameter objects (tied ones stay tied)
            swapping = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                model.to_empty(device=device)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(swapping)
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        send_buffers_from_main(model)
    return len(units) + 1


def send_buffers_from_main(model: torch.nn.Module) -> None:
    """Every buffer of `model` (rotary tables: small, kept whole) made the main process's: a process
    that built the model on the meta device has none of their values."""
    for buffer in model.buffers():
        torch.distributed.broadcast(buffer, src=0)


def is_sharded(model: torch.nn.Module | None) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model: torch.nn.Module, whole: bool = True):
    """Within: every parameter of a sharded `model` gathered whole on each process, and kept so
    through any number of forwards (call on all processes; inside, each may run what it likes:
    no collective is made). `whole=False`: the root unit (embeddings, output layer, merger: what
    generate calls outside the root's forward) and the first block of each kind (which the fast
    paths' self-checks call directly), the other blocks still gathered for each forward (every
    process must then run the same forwards). A model that is not sharded is left as it is."""
    if not is_sharded(model):
        yield model
        return
    # FSDP2 settles which unit is the root at the first forward; generate may run a vision block
    # before the root's forward, which would make that block a root of its own: settle it now.
    model._get_fsdp_state()._lazy_init()  # noqa: SLF001 - a no-op once settled
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not whole:
        firsts = {type(unit): unit for unit in reversed(units[1:])}  # the first unit of each class
        units = [model, *firsts.values()]
    resharding = [unit for unit in units if _reshards_after_forward(unit)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
        for unit in resharding:
            unit.set_reshard_after_forward(True, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered unit of a sharded `model`, so that its parameters are its shards again
    (the root stays gathered after a forward without backward: a reference's, a no-grad pass)."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _reshards_after_forward(unit: FSDPModule) -> bool:
    state = unit._get_fsdp_state()  # noqa: SLF001 - torch keeps the flag there alone
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13 (a list)
    if groups is None:  # torch 2.11 on the GPU machine: one group, or None for a unit with no parameters
        groups = [group] if (group := getattr(state, "_fsdp_param_group", None)) is not None else []
    return any(group.post_forward_mesh_info is not None for group in groups)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """The full (unsharded) state dicts of a sharded `model` and of its `optimizer` (keyed by
    parameter name), on the CPU. Every process must call this; each gets them whole."""
    names = distinct_names(model)
    weights = {name: value for name, value in get_model_state_dict(model, options=FULL).items() if name in names}
    moments = get_optimizer_state_dict(model, optimizer, options=FULL) if optimizer is not None else None
    return weights, moments


def distinct_names(model: torch.nn.Module) -> set[str]:
    """The state dict's names, one per tensor: a tied weight (the output layer sharing the input
    embedding) under its first name alone, as `save_pretrained` and safetensors' `load_model` want."""
    names, seen = set(), set()
    for name, value in model.state_dict(keep_vars=True).items():  # the shards: no collective
        if id(value) not in seen:
            seen.add(id(value))
            names.add(name)
    return names


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put a full optimizer state dict saved by `full_state` into the optimizer of the sharded `model`."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


class FullStateOptimizer:
    """The optimizer of a sharded model as a checkpoint restores it: `load_state_dict` takes the
    full state dict `full_state` saved and puts each process's part back."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def load_state_dict(self, state: dict) -> None:
        load_optimizer_state(self.model, self.optimizer, state)
