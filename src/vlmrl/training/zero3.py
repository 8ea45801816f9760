"""DeepSpeed ZeRO-3: what a model partitioned by DeepSpeed needs that a whole one does not.

accelerate engages DeepSpeed (`configs/accelerate/zero3.yaml`; strategy.py) and `prepare` hands
the policy to a DeepSpeed engine, which splits every parameter, gradient and AdamW moment over the
processes and installs hooks that gather each module's parameters for its forward and backward.
The model is loaded into each process's CPU memory and partitioned from there onto the device one
parameter at a time (`partition`, before `prepare`), so the whole policy is never on one device;
transformers' load-time partitioning, `zero3_init_flag: true`, is refused: every self-check of a
fast path would see empty weights. The pieces vlmrl adds, each the counterpart of one in
sharding.py (FSDP2):
- generation (`gathered`): `generate` runs hundreds of forwards, a different number on each process;
  with the hooks each forward gathers each layer (a collective), and ranks that generate different
  lengths hang. Here every parameter is gathered once for the whole call and DeepSpeed's hooks are
  taken off meanwhile (the pattern of TRL's `unwrap_model_for_generation`), so each process
  generates alone;
- the update (`update`): DeepSpeed keeps the gradients in its partitions and steps its own
  optimizer (torch's AdamW on the fp32 partitions; vlmrl's schedule sets its learning rate). The
  gradient norm is read from the partitions before the step (the numeric guard's), DeepSpeed clips
  to `train.max_grad_norm` (`gradient_clipping`), and a skipped update clears the partitions as
  DeepSpeed's own overflow path does;
- saving and resume (`full_state`, `FullStateOptimizer`): weights and AdamW moments gathered one
  parameter at a time, keyed by parameter name as FSDP2's full state dicts are, and put back into
  the partitions after `prepare`;
- the output layer: the chunked read (output_layer.py) computes log-probs inside the output layer's
  forward hook, whose result DeepSpeed's backward hooks never see; under ZeRO-3 the scorer reads the
  model's logits instead (LogprobScorer `tapped=False`), an ordinary forward and backward;
- the reference copy stays whole on each process (it is copied before `prepare`) and is refreshed
  from the policy's gathered parameters.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from vlmrl.safety.faults import OptimizerUpdate
from vlmrl.training.sharding import distinct_names

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state kept in DeepSpeed's partitions."""


def is_partitioned(model: torch.nn.Module | None) -> bool:
    """True when DeepSpeed ZeRO-3 manages `model`'s parameters."""
    return model is not None and any(hasattr(p, "ds_id") for p in model.parameters())


def _zero_optimizer(model: torch.nn.Module):
    """DeepSpeed's ZeRO-3 optimizer of a partitioned `model` (each parameter points to it)."""
    return next(p for p in model.parameters() if hasattr(p, "ds_id"))._z3_optimizer


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Within: every parameter of a partitioned `model` whole on each process, and DeepSpeed's
    module hooks off, so forwards make no collective and each process may run what it likes (call
    on all processes). A model that is not partitioned is left as it is."""
    if not is_partitioned(model):
        yield model
        return
    import deepspeed

    offload = _zero_optimizer(model).parameter_offload  # holds the hooks
    root_hooks = offload.module._forward_pre_hooks  # noqa: SLF001 - the first resets a step count, with a collective
    start = offload.fwd_pre_hook.id
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        for param in model.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        start_of_forward = root_hooks.pop(start)
        try:
            yield model
        finally:
            root_hooks[start] = start_of_forward
            root_hooks.move_to_end(start, last=False)  # first again, as DeepSpeed registered it
            offload._register_deepspeed_module(offload.module)  # noqa: SLF001 - the hooks back, as DeepSpeed made them


def gradient_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the accumulated gradients, from each process's partitions (a collective)."""
    from deepspeed.utils import safe_get_local_grad

    squares = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.requires_grad and (grad := safe_get_local_grad(param)) is not None:
            squares = squares + grad.double().pow(2).sum().cpu()
    torch.distributed.all_reduce(squares)
    return math.sqrt(float(squares))


class EngineUpdate(OptimizerUpdate):
    """An optimizer update of a DeepSpeed engine, as the numeric guard makes it (faults.py:
    OptimizerUpdate's methods): the norm read from the gradient partitions before the step,
    DeepSpeed's step (which clips to its `gradient_clipping`, set from train.max_grad_norm), or the
    partitions cleared as DeepSpeed's own skipped (overflowed) step clears them."""

    def __init__(self, accelerator, engine, model: torch.nn.Module):
        super().__init__(accelerator, model, engine.optimizer)
        self.engine = engine

    def norm(self, limit: float) -> float:  # noqa: ARG002 - DeepSpeed clips in its step
        return gradient_norm(self.model)

    def make(self, apply: bool) -> None:
        if apply:
            self.engine.step()
            return
        optimizer = _zero_optimizer(self.model)
        optimizer._overflow_clean_up(optimizer.loss_scale)  # noqa: SLF001 - DeepSpeed's own skip


def full_state(model: torch.nn.Module, with_optimizer: bool) -> tuple[dict, dict | None]:
    """The full state dicts of a partitioned `model` and, `with_optimizer`, of its AdamW (keyed by
    parameter name, in FSDP2's full layout), on the CPU, one parameter gathered at a time. Every
    process must call this; each gets them whole."""
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    names = distinct_names(model)
    optimizer = _zero_optimizer(model)
    group_states = _group_states(optimizer) if with_optimizer else {}
    weights, state = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in names:
            continue
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None, enabled=hasattr(tensor, "ds_id")):
            weights[name] = tensor.detach().cpu().clone()
        if with_optimizer and isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
            step = torch.as_tensor(group_states[id(tensor)].get("step", 0), dtype=torch.float32).clone()
            state[name] = {"step": step} | {key: safe_get_full_optimizer_state(tensor, key).cpu() for key in MOMENTS}
    if not with_optimizer:
        return weights, None
    groups = []
    for group, params in zip(optimizer.optimizer.param_groups, optimizer.fp16_groups):
        ids = {id(p) for p in params}
        groups.append({k: v for k, v in group.items() if k != "params"}
                      | {"params": [n for n, p in model.named_parameters() if id(p) in ids]})
    return weights, {"state": state, "param_groups": groups}


def _group_states(optimizer) -> dict[int, dict]:
    """AdamW's state of the fp32 partition group holding each parameter, by the parameter's id
    (DeepSpeed steps one flat group at a time), from DeepSpeed's ZeRO-3 `optimizer`."""
    return {id(param): optimizer.optimizer.state[flat]
            for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_partitioned_groups_flat, strict=True)
            for param in params}


class FullStateOptimizer:
    """The optimizer of a partitioned model as a checkpoint restores it: `load_state_dict` takes the
    full state dict `full_state` saved (or FSDP2's) and puts each process's part back."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def load_state_dict(self, state: dict) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        saved = state["state"]
        optimizer = _zero_optimizer(self.model)
        for group, saved_group in zip(optimizer.optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})  # the learning rate it was at
        for flat in optimizer.fp32_partitioned_groups_flat:  # AdamW makes its state at its first step
            if not optimizer.optimizer.state[flat]:
                optimizer.optimizer.state[flat] = {"step": torch.tensor(0.0)} | {
                    key: torch.zeros_like(flat, memory_format=torch.preserve_format) for key in MOMENTS}
        group_states = _group_states(optimizer)
        for name, param in self.model.named_parameters():
            if name not in saved:
                continue
            for key in MOMENTS:
                safe_set_full_optimizer_state(param, saved[name][key], key)
            group_states[id(param)]["step"] = torch.as_tensor(saved[name]["step"], dtype=torch.float32).clone()


def partition(model: torch.nn.Module, accelerator) -> None:
    """Split `model`, loaded into CPU memory, over the processes: one parameter at a time moved to
    the device and cut to this process's partition (DeepSpeed's `zero.Init` on a built module), so the
    whole model is never on one device; `prepare` then leaves it where it is (a model not yet
    partitioned it would move whole onto the device first). The buffers (rotary tables) are small and
    move whole, in place, as FSDP2 moves them (an attribute that aliases one moves with it)."""
    import deepspeed

    device = accelerator.device
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.data = buffer.data.to(device)
    deepspeed.zero.Init(module=model, config_dict_or_path=accelerator.state.deepspeed_plugin.deepspeed_config,
                        dtype=next(model.parameters()).dtype)


def configure(accelerator, max_grad_norm: float) -> None:
    """Before the model loads: transformers loads it whole (accelerate registers its DeepSpeed
    config with transformers, which would partition at load), and the DeepSpeed config gets what
    vlmrl runs with: one backward per micro-batch with its own weights (DeepSpeed's batch sizes are
    bookkeeping only), torch's AdamW, and clipping to `train.max_grad_norm` (0: none)."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    warnings.filterwarnings("ignore", category=FutureWarning,  # DeepSpeed's collectives, at every gather
                            message=r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    settings = accelerator.state.deepspeed_plugin.deepspeed_config
    settings |= {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_allow_untested_optimizer": True, "gradient_clipping": max_grad_norm}
    settings.pop("train_batch_size", None)
