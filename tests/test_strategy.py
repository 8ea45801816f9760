"""What runs under `accelerate launch`, and the one-line refusal when it is not what was asked."""

from __future__ import annotations

import pytest
import torch

from launching import launcher, run_all_or_kill
from vlmrl.errors import VlmrlError
from vlmrl.training.strategy import Strategy, requested_strategy, settle_strategy

TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1"}


def test_the_preflight_line_says_processes_strategy_and_backend():
    assert Strategy(2, "FSDP2", "gloo").line() == "processes: 2, strategy: FSDP2, backend: gloo"
    assert settle_strategy("NO", 1, None, "cpu", {}).line() == "processes: 1, strategy: single, backend: none"
    assert settle_strategy("MULTI_CPU", 2, "gloo", "cpu", TORCHRUN).line() == "processes: 2, strategy: DDP, backend: gloo"


def test_accelerate_mixed_precision_is_ignored_under_ddp_with_a_warning_naming_model_dtype(capsys, monkeypatch):
    """Issue 51 B18: `mixed_precision: bf16` under DDP was accepted without a word (and autocast only the
    forward accelerate wraps); now the Accelerator never autocasts, and one line says which setting does."""
    from vlmrl.training.strategy import make_accelerator

    ddp = settle_strategy("MULTI_GPU", 2, "nccl", "cuda", TORCHRUN | {"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert ddp.name == "DDP"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("warning: mixed_precision: bf16 in the accelerate config is ignored (vlmrl does "
                                     "not autocast): the weights' dtype is model.dtype; set model.dtype=bfloat16") in err
    settle_strategy("MULTI_GPU", 2, "nccl", "cuda", TORCHRUN | {"RANK": "1", "ACCELERATE_MIXED_PRECISION": "bf16"})
    settle_strategy("MULTI_GPU", 2, "nccl", "cuda", TORCHRUN)
    assert capsys.readouterr().err == ""  # another process, or no mixed precision: nothing
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch sets
    assert make_accelerator("cpu", {"ACCELERATE_MIXED_PRECISION": "bf16"}).mixed_precision == "no"


@pytest.mark.parametrize(("env", "asked"), [
    ({}, None),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "FSDP2"),
    ({"ACCELERATE_USE_FSDP": "true"}, "FSDP1"),  # accelerate's default version
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "ZeRO-3"),
    ({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}, None),
])
def test_what_accelerate_launch_asked_for(env, asked):
    assert requested_strategy(env) == asked


def test_fsdp2_is_applied_by_vlmrl_on_cpu_processes_and_on_gpus():
    fsdp2 = TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    on_cpu = settle_strategy("MULTI_CPU", 2, "gloo", "cpu", fsdp2)
    assert (on_cpu.name, on_cpu.self_sharded, on_cpu.sharded) == ("FSDP2", True, True)
    on_gpus = settle_strategy("FSDP", 8, "nccl", "cuda", fsdp2)  # vlmrl shards there too: one code path
    assert (on_gpus.line(), on_gpus.self_sharded) == ("processes: 8, strategy: FSDP2, backend: nccl", True)


def test_where_each_process_loads_the_policy():
    """Split strategies load into CPU memory (moved onto the device a piece at a time as they split);
    with fsdp_cpu_ram_efficient_loading, all but the main process build the model without weights."""
    fsdp2 = TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    each = settle_strategy("FSDP", 2, "nccl", "cuda", fsdp2)
    from_main = settle_strategy("FSDP", 2, "nccl", "cuda", fsdp2 | {"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    assert [each.loading_place(rank) for rank in (0, 1)] == ["host", "host"] and not each.weights_from_main
    assert [from_main.loading_place(rank) for rank in (0, 1)] == ["host", "meta"] and from_main.weights_from_main
    alone = settle_strategy("FSDP", 1, "nccl", "cuda", fsdp2 | {"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    assert alone.loading_place(0) == "host" and not alone.weights_from_main
    assert settle_strategy("MULTI_GPU", 2, "nccl", "cuda", TORCHRUN).loading_place(1) == "device"  # DDP
    assert settle_strategy("NO", 1, None, "cuda", {}).loading_place(0) == "device"


@pytest.mark.parametrize(("engaged", "env", "message"), [
    ("MULTI_CPU", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     r"^(ZeRO-3 was asked for but accelerate engaged MULTI_CPU on 2 process\(es\) on cpu; vlmrl would have run "
     r"without it|DeepSpeed ZeRO-3 was asked for but deepspeed is not installed)"),
    ("DEEPSPEED", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
     r"^DeepSpeed ZeRO-2 was asked for \(ACCELERATE_DEEPSPEED_ZERO_STAGE\); vlmrl runs ZeRO-3"),
    ("MULTI_CPU", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, r"^FSDP version 1 was asked for"),
    ("MULTI_CPU", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
     r"^DeepSpeed ZeRO-1 was asked for"),
    ("NO", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, r"^FSDP2 was asked for but accelerate engaged NO"),
])
def test_a_strategy_asked_for_and_not_engaged_is_refused(engaged, env, message):
    with pytest.raises(VlmrlError, match=message):
        settle_strategy(engaged, 2 if engaged != "NO" else 1, "gloo", "cpu", TORCHRUN | env)


def test_several_processes_asked_and_one_started_is_refused():
    """`accelerate launch --num_processes 2` without --multi_gpu on a machine without GPUs: its
    single-process launcher sets MASTER_ADDR, and no WORLD_SIZE."""
    one = {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(VlmrlError, match="asked for several processes but started one: on a machine without GPUs "
                                         "add --multi_gpu"):
        settle_strategy("NO", 1, None, "cpu", one)
    assert settle_strategy("NO", 1, None, "cpu", {"ACCELERATE_MIXED_PRECISION": "no"}).name == "single"


def test_zero3_is_engaged_by_accelerate_and_run_by_a_deepspeed_engine():
    zero3 = TORCHRUN | {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    strategy = settle_strategy("DEEPSPEED", 2, "gloo", "cpu", zero3)
    assert (strategy.line(), strategy.sharded, strategy.deepspeed, strategy.self_sharded) == (
        "processes: 2, strategy: ZeRO-3, backend: gloo", True, True, False)


@pytest.mark.parametrize(("setting", "message"), [
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, r"^mixed_precision: bf16 in the accelerate config is not applied under vlmrl's ZeRO-3"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, r"^offload_optimizer_device: cpu is not run by vlmrl's ZeRO-3"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, r"^offload_param_device: nvme is not run"),
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}, r"^zero3_init_flag: true is not run by vlmrl"),
    ({"ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}, r"^deepspeed_config_file is not read by vlmrl's ZeRO-3"),
])
def test_a_zero3_setting_vlmrl_would_not_honour_is_refused(setting, message):
    pytest.importorskip("deepspeed")
    zero3 = TORCHRUN | {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}
    with pytest.raises(VlmrlError, match=message):
        settle_strategy("DEEPSPEED", 2, "gloo", "cpu", zero3 | setting)


def test_zero3_without_deepspeed_installed_is_refused(monkeypatch):
    import vlmrl.training.strategy as strategy

    monkeypatch.setattr(strategy.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(VlmrlError, match=r"^DeepSpeed ZeRO-3 was asked for but deepspeed is not installed: "
                                         r"pip install 'vlmrl\[deepspeed\]'"):
        settle_strategy("DEEPSPEED", 2, "gloo", "cpu",
                        TORCHRUN | {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})


def test_the_refusal_comes_before_the_model_loads_in_one_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The CLI with DeepSpeed ZeRO-2 asked for: exit 2, one line (loading the weights would have
    drawn a progress bar on stderr). In this process (the refusal comes before the Accelerator is built;
    a process of its own cost 8 s more)."""
    from vlmrl.cli import main

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    capsys.readouterr()
    returncode = main(["train", "configs/shapes_grpo_tiny.yaml", "model.device=cpu",
                       f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("error: DeepSpeed ZeRO-2 was asked for (ACCELERATE_DEEPSPEED_ZERO_STAGE); vlmrl runs "
                               "ZeRO-3"), lines


@pytest.mark.parametrize(("setting", "message"), [
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, r"^mixed_precision: bf16 in the accelerate config is not applied under vlmrl's FSDP2"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, r"^fsdp_offload_params: true is not applied"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, r"^fsdp_activation_checkpointing: true is not applied .* "
                                                r"model.gradient_checkpointing=true"),
])
def test_an_fsdp_setting_vlmrl_would_not_apply_on_cpu_processes_is_refused(setting, message):
    fsdp2 = TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    with pytest.raises(VlmrlError, match=message):
        settle_strategy("MULTI_CPU", 2, "gloo", "cpu", fsdp2 | setting)
    kept = settle_strategy("MULTI_CPU", 2, "gloo", "cpu", fsdp2 | {"FSDP_RESHARD_AFTER_FORWARD": "false"})
    assert kept.reshard_after_forward is False


def test_a_model_without_blocks_to_shard_is_refused(tmp_path):
    from vlmrl.training.sharding import shard

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(VlmrlError, match=r"^FSDP2: Linear names no blocks to shard"):
            shard(torch.nn.Linear(2, 2), 1, torch.device("cpu"))
    finally:
        torch.distributed.destroy_process_group()


def test_accelerate_launch_num_processes_2_without_multi_gpu_is_refused_on_a_cpu(tmp_path, tiny_model_dir):
    """The command that used to start one process silently: now it stops in one line, before loading."""
    if torch.cuda.is_available():
        pytest.skip("with GPUs accelerate starts the processes asked for")
    returncode, _, stderr = run_all_or_kill(
        launcher("--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no")
        + ["train", "configs/shapes_grpo_tiny.yaml", "model.device=cpu", f"model.name_or_path={tiny_model_dir}",
           f"output_dir={tmp_path / 'run'}"], timeout=120)
    assert returncode == 1 and "returned non-zero exit status 2" in stderr, stderr  # the launcher wraps vlmrl's 2
    assert "error: accelerate launch was asked for several processes but started one: on a machine without GPUs " \
           "add --multi_gpu" in stderr
    assert "Loading weights" not in stderr


@pytest.mark.parametrize(("setting", "message"), [
    ({"FSDP_VERSION": "two"}, r"^fsdp_version: two in the accelerate config is not a version of FSDP \(FSDP_VERSION\): "
                              r"vlmrl runs FSDP2, set fsdp_version: 2"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "maybe"}, r"^fsdp_reshard_after_forward: maybe in the accelerate config is not true "
                                              r"or false \(FSDP_RESHARD_AFTER_FORWARD\): set true or false$"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "sometimes"}, r"^fsdp_cpu_ram_efficient_loading: sometimes in the accelerate"),
    ({"FSDP_OFFLOAD_PARAMS": "2"}, r"^fsdp_offload_params: 2 in the accelerate config is not true or false"),
    ({"ACCELERATE_DYNAMO_BACKEND": "turbo"}, r"^dynamo_backend: turbo in the accelerate config is not a backend "
                                            r"accelerate knows"),
])
def test_an_fsdp_setting_accelerate_cannot_read_is_one_line_before_the_accelerator(setting, message):
    """accelerate's int("two") and str_to_bool("maybe") were a ValueError traceback on every process."""
    from vlmrl.training.strategy import refuse_unrunnable

    with pytest.raises(VlmrlError, match=message):
        refuse_unrunnable(TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} | setting)


@pytest.mark.parametrize(("setting", "message"), [
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"}, r"^zero_stage: three in the accelerate config is not a ZeRO stage"),
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "perhaps"}, r"^zero3_init_flag: perhaps in the accelerate config is not true "
                                                    r"or false"),
])
def test_a_deepspeed_setting_accelerate_cannot_read_is_one_line(setting, message):
    from vlmrl.training.strategy import refuse_unrunnable

    with pytest.raises(VlmrlError, match=message):
        refuse_unrunnable(TORCHRUN | {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
                          | setting)


@pytest.mark.parametrize(("value", "reshard"), [("off", False), ("n", False), ("f", False), ("0", False),
                                                ("on", True), ("Yes", True), ("t", True)])
def test_a_yes_or_no_setting_means_what_accelerate_takes_it_to_mean(value, reshard):
    """vlmrl read "off" and "n" as true (only false, 0 and no were false), accelerate as false."""
    fsdp2 = TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": value}
    assert settle_strategy("MULTI_CPU", 2, "gloo", "cpu", fsdp2).reshard_after_forward is reshard


@pytest.mark.parametrize(("setting", "message"), [
    ({"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, r"^fsdp_sharding_strategy: SHARD_GRAD_OP is not applied under vlmrl's "
                                                  r"FSDP2, .* fsdp_reshard_after_forward: false"),
    ({"FSDP_SHARDING_STRATEGY": "NO_SHARD"}, r"^fsdp_sharding_strategy: NO_SHARD is not applied .*configs/accelerate/ddp"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, r"^dynamo_backend: INDUCTOR in the accelerate config is not applied "
                                                r"under vlmrl's FSDP2 .* set dynamo_backend: no"),
])
def test_a_sharding_strategy_or_dynamo_backend_fsdp2_would_ignore_is_refused(setting, message):
    """Both were accepted in silence: vlmrl shards FULL_SHARD-style itself, and accelerate compiles only
    a model it prepares (under DDP and ZeRO-3 it does)."""
    fsdp2 = TORCHRUN | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    with pytest.raises(VlmrlError, match=message):
        settle_strategy("MULTI_CPU", 2, "gloo", "cpu", fsdp2 | setting)
    launched = fsdp2 | {"FSDP_SHARDING_STRATEGY": "FULL_SHARD", "ACCELERATE_DYNAMO_BACKEND": "NO"}  # the launcher's defaults
    assert settle_strategy("MULTI_CPU", 2, "gloo", "cpu", launched).name == "FSDP2"
    assert settle_strategy("MULTI_CPU", 2, "gloo", "cpu", TORCHRUN | {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}).name == "DDP"
