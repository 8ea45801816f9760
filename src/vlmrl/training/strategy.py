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

The accelerate settings vlmrl reads are checked before the Accelerator reads them (`check_readable`):
`fsdp_version: two` or `fsdp_reshard_after_forward: maybe` is one line naming the key, not
accelerate's ValueError on every process; yes/no settings mean what accelerate takes them to mean
(`TRUTH`: on, y and off too). A setting that would not be applied is refused rather than ignored:
under FSDP2 (vlmrl shards, accelerate's plugin never sees the model) mixed precision, parameter
offload, activation checkpointing, a sharding strategy other than FULL_SHARD and a dynamo backend;
under ZeRO-3 mixed precision, offload, zero3_init_flag and a DeepSpeed config file. Under DDP and
ZeRO-3 accelerate itself compiles the model it prepares when a dynamo backend is set. Under DDP and
on one process, accelerate's mixed precision is ignored (the Accelerator is made with
mixed_precision="no": vlmrl never autocasts, its weights' dtype is model.dtype), with one warning
naming that setting.

The preflight's first line is `Strategy.line()`: `processes: 2, strategy: FSDP2, backend: gloo`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DynamoBackend, InitProcessGroupKwargs

from vlmrl.errors import VlmrlError, warn
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


TRUTH = {"1": True, "true": True, "yes": True, "y": True, "t": True, "on": True,
         "0": False, "false": False, "no": False, "n": False, "f": False, "off": False}
"""A yes/no setting as accelerate reads it (its str_to_bool); any other value is a ValueError raised
inside the Accelerator on every process."""

SETTING_KEYS = {"FSDP_VERSION": "fsdp_version", "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward",
                "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
                "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params", "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing",
                "FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy", "ACCELERATE_DYNAMO_BACKEND": "dynamo_backend",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag"}
"""The accelerate launcher's variable -> the key of the accelerate config file that sets it (errors name the key)."""

FULL_SHARD = ("", "full_shard", "1")
"""fsdp_sharding_strategy values that mean what vlmrl's FSDP2 does (the launcher writes FULL_SHARD when unset)."""


def flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    """The yes/no accelerate setting `name` as accelerate reads it (TRUTH); a value it would stop at
    is one line naming the config key, before the Accelerator reads it."""
    value = env.get(name, "").strip()
    if not value:
        return default
    if value.lower() not in TRUTH:
        raise VlmrlError(f"{SETTING_KEYS[name]}: {value} in the accelerate config is not true or false ({name}): "
                         "set true or false")
    return TRUTH[value.lower()]


def check_readable(env: Mapping[str, str]) -> None:
    """Each accelerate setting vlmrl reads has a value accelerate can read: otherwise accelerate stops
    with a traceback on every process (int("two"), str_to_bool("maybe")); here, one line."""
    if _on(env, "ACCELERATE_USE_FSDP"):
        version = env.get("FSDP_VERSION", "1").strip()
        if version not in ("1", "2"):
            raise VlmrlError(f"fsdp_version: {version} in the accelerate config is not a version of FSDP (FSDP_VERSION): "
                             "vlmrl runs FSDP2, set fsdp_version: 2 (configs/accelerate/fsdp2.yaml)")
        for name in ("FSDP_RESHARD_AFTER_FORWARD", "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_OFFLOAD_PARAMS",
                     "FSDP_ACTIVATION_CHECKPOINTING"):
            if version == "2" or name != "FSDP_RESHARD_AFTER_FORWARD":  # FSDP1 names a strategy there (refused)
                flag(env, name)
    if _on(env, "ACCELERATE_USE_DEEPSPEED"):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2").strip()
        if stage not in ("", "0", "1", "2", "3"):
            raise VlmrlError(f"zero_stage: {stage} in the accelerate config is not a ZeRO stage "
                             "(ACCELERATE_DEEPSPEED_ZERO_STAGE): vlmrl runs ZeRO-3, set zero_stage: 3 "
                             "(configs/accelerate/zero3.yaml)")
        flag(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip()
    if backend.upper() not in {member.value for member in DynamoBackend} | {""}:
        raise VlmrlError(f"dynamo_backend: {backend} in the accelerate config is not a backend accelerate knows "
                         "(ACCELERATE_DYNAMO_BACKEND): set dynamo_backend: no, or inductor")


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
    return Accelerator(cpu=device == "cpu" or not cuda, mixed_precision="no")  # vlmrl's dtype: model.dtype


def warn_ignored_precision(env: Mapping[str, str]) -> None:
    """DDP or one process: accelerate's mixed_precision, which vlmrl does not apply, named in one
    warning (by the main process) with the setting that does it."""
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", "") and env.get("RANK", "0") == "0":
        warn(f"mixed_precision: {precision} in the accelerate config is ignored (vlmrl does not autocast): the "
             "weights' dtype is model.dtype; set model.dtype=bfloat16 (or float16) in vlmrl, and mixed_precision: "
             "'no' there")


def refuse_unrunnable(env: Mapping[str, str]) -> None:
    """Before the Accelerator is built (it raises an ImportError of its own without deepspeed): a
    strategy vlmrl cannot run whatever accelerate does, or a setting accelerate cannot read, one line."""
    check_readable(env)
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
    if flag(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        raise VlmrlError("zero3_init_flag: true is not run by vlmrl: it partitions the weights as transformers "
                         "reads them, before the speedups' self-checks can; vlmrl partitions them itself as they "
                         "move onto the device: set zero3_init_flag: false (configs/accelerate/zero3.yaml)")
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none").strip().lower() not in ("none", ""):
        raise VlmrlError("deepspeed_config_file is not read by vlmrl's ZeRO-3 (it builds the optimizer and the "
                         "schedule itself): put zero_stage: 3 in the accelerate config (configs/accelerate/zero3.yaml)")


def refuse_unapplied_fsdp_settings(env: Mapping[str, str]) -> None:
    """FSDP2 (vlmrl shards, not accelerate's plugin): an accelerate setting it would not apply (mixed
    precision, offload, activation checkpointing, a sharding strategy, a dynamo backend), one line,
    rather than a run that quietly differs from its config."""
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", ""):
        raise VlmrlError(f"mixed_precision: {precision} in the accelerate config is not applied under vlmrl's FSDP2: "
                         "set mixed_precision: 'no' there and model.dtype=bfloat16 (or float32) in vlmrl")
    if flag(env, "FSDP_OFFLOAD_PARAMS"):
        raise VlmrlError("fsdp_offload_params: true is not applied under vlmrl's FSDP2 (the parameters stay on the "
                         "device): set fsdp_offload_params: false, or shard over more GPUs")
    if flag(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise VlmrlError("fsdp_activation_checkpointing: true is not applied under vlmrl's FSDP2 (vlmrl checkpoints "
                         "activations itself): set it to false there and model.gradient_checkpointing=true in vlmrl")
    sharding = env.get("FSDP_SHARDING_STRATEGY", "").strip()
    if sharding.lower() not in FULL_SHARD:
        raise VlmrlError(f"fsdp_sharding_strategy: {sharding} is not applied under vlmrl's FSDP2, which splits every "
                         "parameter, gradient and AdamW moment over the processes (FULL_SHARD): remove it from the "
                         "accelerate config; fsdp_reshard_after_forward: false keeps each block gathered from its "
                         "forward to its backward (SHARD_GRAD_OP's trade), and DDP keeps whole copies "
                         "(configs/accelerate/ddp.yaml)")
    dynamo = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip()
    if dynamo.lower() not in ("", "no"):
        raise VlmrlError(f"dynamo_backend: {dynamo} in the accelerate config is not applied under vlmrl's FSDP2 (vlmrl "
                         "shards the model itself, and accelerate compiles only a model it prepares): set "
                         "dynamo_backend: no; vlmrl compiles its decode step itself (rollout.decode=compiled)")


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
        warn_ignored_precision(env)
        return Strategy(processes, "DDP" if processes > 1 else "single", backend)
    refuse_unrunnable(env)
    if asked == "FSDP2" and engaged in ("FSDP", "MULTI_CPU"):  # GPUs; CPU processes (accelerate runs DDP)
        refuse_unapplied_fsdp_settings(env)
        reshard = flag(env, "FSDP_RESHARD_AFTER_FORWARD", default=True)
        return Strategy(processes, "FSDP2", backend, self_sharded=True, reshard_after_forward=reshard,
                        weights_from_main=processes > 1 and flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING"))
    if asked == "ZeRO-3" and engaged == "DEEPSPEED":
        return Strategy(processes, asked, backend)
    raise VlmrlError(f"{asked} was asked for but accelerate engaged {engaged} on {processes} process(es) "
                     f"on {device}; vlmrl would have run without it. Launch with the matching config file "
                     "(configs/accelerate/), or without the strategy")
