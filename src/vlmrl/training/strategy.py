"""Which way the processes of a run share the work, and a refusal when that is not what was asked.

`accelerate launch` says what the user asked for in environment variables (ACCELERATE_USE_FSDP with
FSDP_VERSION, ACCELERATE_USE_DEEPSPEED with ACCELERATE_DEEPSPEED_ZERO_STAGE), then the Accelerator
decides what runs; accelerate 1.15 quietly runs plain DDP where it will not engage the strategy
(FSDP on CPU processes, DeepSpeed whenever `cpu=True`), and `accelerate launch --num_processes 2`
without `--multi_gpu` starts one process on a machine without GPUs. `settle_strategy` reads both
sides before the model loads: the strategy that will run, or one line saying what was asked and
why it cannot run. FSDP2 is applied by vlmrl itself (sharding.py), on GPUs as on CPU processes,
not by accelerate's plugin: one code path, the one the CPU tests run.
DeepSpeed ZeRO-3 is engaged by accelerate (on a CPU too: `make_accelerator`); what a partitioned
model needs is in zero3.py. ZeRO-1 and ZeRO-2 are refused (vlmrl runs ZeRO-3, FSDP2 or DDP).

The preflight's first line is `Strategy.line()`: `processes: 2, strategy: FSDP2, backend: gloo`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from vlmrl.errors import VlmrlError
from vlmrl.models.support import deepspeed_accelerator_named

STRATEGIES = ("single", "DDP", "FSDP2", "ZeRO-3")


@dataclass(frozen=True)
class Strategy:
    """What runs: how many processes, how they share the model, over which backend."""

    processes: int
    name: str
    """One of STRATEGIES."""
    backend: str
    """The process group's backend (gloo, nccl), "none" on one process."""
    self_sharded: bool = False
    """True where vlmrl applies FSDP2 itself (always for FSDP2: the same units, gathering and
    checkpoints on GPUs as on CPU processes, where accelerate 1.15 would have run DDP)."""
    reshard_after_forward: bool = True
    """FSDP2: each block frees its gathered parameters after its forward (fsdp_reshard_after_forward;
    false keeps them to backward: less communication, more memory)."""
    weights_from_main: bool = False
    """FSDP2 with fsdp_cpu_ram_efficient_loading: the main process alone reads the weights (into CPU
    memory), the others build the model on the meta device, and each process's shards are sent from
    the main one once the model is sharded (sharding.shard)."""

    def line(self) -> str:
        return f"processes: {self.processes}, strategy: {self.name}, backend: {self.backend}"

    @property
    def sharded(self) -> bool:
        """Parameters are split over the processes (FSDP2, ZeRO-3): gather them to generate or save."""
        return self.name in ("FSDP2", "ZeRO-3")

    def loading_place(self, rank: int) -> str:
        """Where process `rank` loads the policy (loading.PLACES): FSDP2 and ZeRO-3 into CPU memory, to
        be moved onto the device a piece at a time as they split it, so the whole model is never on
        one device; with `weights_from_main`, every process but the main one on the meta device."""
        if self.weights_from_main and rank != 0:
            return "meta"
        return "host" if self.sharded else "device"

    @property
    def deepspeed(self) -> bool:
        """A DeepSpeed engine holds the model: it takes the backward and steps its own optimizer."""
        return self.name == "ZeRO-3"


def _on(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("1", "true", "yes")


def requested_strategy(env: Mapping[str, str]) -> str | None:
    """The strategy `accelerate launch` (its flags or config file) asked for, as named in STRATEGIES
    ("FSDP1" and "ZeRO-1" too), or None when it asked for none (DDP or one process)."""
    if _on(env, "ACCELERATE_USE_DEEPSPEED"):
        return f"ZeRO-{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2').strip() or '2'}"
    if _on(env, "ACCELERATE_USE_FSDP"):
        return f"FSDP{env.get('FSDP_VERSION', '1').strip() or '1'}"
    return None


def several_asked_one_started(env: Mapping[str, str], processes: int) -> bool:
    """accelerate's single-process launcher sets MASTER_ADDR only when --num_processes > 1; a process
    started by it with no WORLD_SIZE is the one process `accelerate launch --num_processes N` starts
    on a machine without GPUs when --multi_gpu is missing."""
    launched = "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env
    return launched and "WORLD_SIZE" not in env and processes == 1


def make_accelerator(device: str, env: Mapping[str, str]) -> Accelerator:
    """The run's Accelerator: on the CPU (`cpu=True`) on a machine without CUDA or with
    model.device=cpu, except where DeepSpeed was asked for. accelerate 1.15 skips DeepSpeed under
    `cpu=True`, and without CUDA finds no backend for it (it would count one process): there it
    gets gloo by name, and DeepSpeed picks its CPU accelerator by itself (without compiling its
    shared-memory all-reduce, which serves inference only and takes a C++ compiler and a minute)."""
    cuda = torch.cuda.is_available()
    if requested_strategy(env) == "ZeRO-3":
        if cuda:
            return Accelerator(cpu=False)
        deepspeed_accelerator_named()
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        return Accelerator(cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    return Accelerator(cpu=device == "cpu" or not cuda)


def refuse_unrunnable(env: Mapping[str, str]) -> None:
    """Before the Accelerator is built (it raises an ImportError of its own without deepspeed): a
    strategy vlmrl cannot run whatever accelerate does, one line."""
    asked = requested_strategy(env)
    if asked == "FSDP1":
        raise VlmrlError("FSDP version 1 was asked for (FSDP_VERSION=1); vlmrl runs FSDP2: set fsdp_version: 2 "
                         "in the accelerate config (configs/accelerate/fsdp2.yaml) or pass --fsdp_version 2")
    if asked in ("ZeRO-1", "ZeRO-2"):
        raise VlmrlError(f"DeepSpeed {asked} was asked for (ACCELERATE_DEEPSPEED_ZERO_STAGE); vlmrl runs ZeRO-3: set "
                         "zero_stage: 3 in the accelerate config (configs/accelerate/zero3.yaml), or shard with FSDP2 "
                         "(configs/accelerate/fsdp2.yaml); plain data parallelism is configs/accelerate/ddp.yaml")
    if asked == "ZeRO-3" and importlib.util.find_spec("deepspeed") is None:
        raise VlmrlError("DeepSpeed ZeRO-3 was asked for but deepspeed is not installed: pip install 'vlmrl[deepspeed]', "
                         "or shard with FSDP2 (configs/accelerate/fsdp2.yaml)")
    if asked == "ZeRO-3":
        refuse_unapplied_zero3_settings(env)


def refuse_unapplied_zero3_settings(env: Mapping[str, str]) -> None:
    """ZeRO-3: a DeepSpeed setting vlmrl would not honour, one line."""
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", ""):
        raise VlmrlError(f"mixed_precision: {precision} in the accelerate config is not applied under vlmrl's ZeRO-3: "
                         "set mixed_precision: 'no' there and model.dtype=bfloat16 (or float32) in vlmrl")
    for name in ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"):
        if env.get(name, "none").strip().lower() not in ("none", ""):
            setting = name.removeprefix("ACCELERATE_DEEPSPEED_").lower()
            raise VlmrlError(f"{setting}: {env[name]} is not run by vlmrl's ZeRO-3 (its gradient norm and checkpoints "
                             f"read the partitions on the device): set {setting}: none, or shard over more GPUs")
    if _on(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        raise VlmrlError("zero3_init_flag: true is not run by vlmrl: it partitions the weights as transformers "
                         "reads them, before the speedups' self-checks can; vlmrl partitions them itself as they "
                         "move onto the device: set zero3_init_flag: false (configs/accelerate/zero3.yaml)")
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none").strip().lower() not in ("none", ""):
        raise VlmrlError("deepspeed_config_file is not read by vlmrl's ZeRO-3 (it builds the optimizer and the "
                         "schedule itself): put zero_stage: 3 in the accelerate config (configs/accelerate/zero3.yaml)")


def refuse_unapplied_fsdp_settings(env: Mapping[str, str]) -> None:
    """FSDP2 (vlmrl shards, not accelerate's plugin): an accelerate setting it would not apply, one
    line, rather than a run that quietly differs from its config."""
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", ""):
        raise VlmrlError(f"mixed_precision: {precision} in the accelerate config is not applied under vlmrl's FSDP2: "
                         "set mixed_precision: 'no' there and model.dtype=bfloat16 (or float32) in vlmrl")
    if _on(env, "FSDP_OFFLOAD_PARAMS"):
        raise VlmrlError("fsdp_offload_params: true is not applied under vlmrl's FSDP2 (the parameters stay on the "
                         "device): set fsdp_offload_params: false, or shard over more GPUs")
    if _on(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise VlmrlError("fsdp_activation_checkpointing: true is not applied under vlmrl's FSDP2 (vlmrl checkpoints "
                         "activations itself): set it to false there and model.gradient_checkpointing=true in vlmrl")


def settle_strategy(engaged: str, processes: int, backend: str | None, device: str,
                    env: Mapping[str, str]) -> Strategy:
    """The strategy of this run from what accelerate engaged (`engaged`: its DistributedType's
    name, e.g. "MULTI_CPU", "FSDP", "DEEPSPEED") and what was asked (`env`); VlmrlError, one line,
    when what was asked cannot run. FSDP2 asked for on CPU processes (MULTI_CPU) runs: vlmrl shards."""
    asked = requested_strategy(env)
    backend = backend or "none"
    if several_asked_one_started(env, processes):
        raise VlmrlError("accelerate launch was asked for several processes but started one: on a machine "
                         "without GPUs add --multi_gpu, or launch with a config file "
                         "(accelerate launch --config_file configs/accelerate/ddp.yaml -m vlmrl ...)")
    if asked is None:
        return Strategy(processes, "DDP" if processes > 1 else "single", backend)
    refuse_unrunnable(env)
    if asked == "FSDP2" and engaged in ("FSDP", "MULTI_CPU"):  # GPUs; CPU processes (accelerate runs DDP)
        refuse_unapplied_fsdp_settings(env)
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower() not in ("false", "0", "no")
        return Strategy(processes, "FSDP2", backend, self_sharded=True, reshard_after_forward=reshard,
                        weights_from_main=processes > 1 and _on(env, "FSDP_CPU_RAM_EFFICIENT_LOADING"))
    if asked == "ZeRO-3" and engaged == "DEEPSPEED":
        return Strategy(processes, asked, backend)
    raise VlmrlError(f"{asked} was asked for but accelerate engaged {engaged} on {processes} process(es) "
                     f"on {device}; vlmrl would have run without it. Launch with the matching config file "
                     "(configs/accelerate/), or without the strategy")
