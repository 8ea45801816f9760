"""Any config a user can type either is refused in one line before step 1, or trains.

A property test: hypothesis draws values for several config fields at once (valid ones, edge ones,
invalid ones: negative counts, nan, inf, out-of-range probabilities, unknown names) on top of a
small one-step run of the tiny model. Each draw must end one of two ways: the config (or the checks
before step 1) refuses it with a one-line VlmrlError, or a one-step `train` (or `sft`) run completes
and saves its model. Anything else (a traceback from torch, a loss function or transformers, an
error after step 1) is a bug: the falsifying example names the values.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrl.config import Config, all_keys, load_config
from vlmrl.errors import VlmrlError

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)

NAN, INF = math.nan, math.inf
VALUES: dict[str, list] = {
    "model.name_or_path": ["runs/missing-model"],
    "model.dtype": ["auto", "float32", "bfloat16", "float16"],
    "model.device": ["auto", "cpu", "gpu", "cuda:x"],
    "model.attn_implementation": [None, "eager", "sdpa", "flash_attention_2", "fast"],
    "model.trust_remote_code": [False, True],
    "model.gradient_checkpointing": [False, True, "auto"],
    "model.freeze_vision": [False, True],
    "model.vision_lr_scale": [0.0, 0.5, -1.0, NAN],
    "model.lora.enabled": [False, True],
    "model.lora.r": [-2, 0, 4],
    "model.lora.alpha": [0, 8],
    "model.lora.dropout": [0.0, 0.1, 1.0, -0.1],
    "model.lora.target_modules": [["q_proj"], [], ["no_such_module"]],
    "model.lora.include_vision": [False, True],
    "task.name": ["shapes", "shapez"],
    "task.params": [{}, {"max_count": 0}, {"image_size": 84}],
    "rollout.group_size": [0, 1, 2, 3],
    "rollout.max_new_tokens": [0, 1, 5],
    "rollout.temperature": [0.0, 0.7, -1.0, INF],
    "rollout.top_p": [0.0, 0.5, 1.0, 1.5],
    "rollout.share_prompt_cache": [False, True],
    "rollout.decode": ["auto", "dynamic", "static", "eager"],
    "rollout.prompts_per_step": [0, 1, 2, 4],
    "rollout.max_prompt_length": [0, 10, 4096],
    "rollout.generation_batch_size": [0, 1, 2, 3],
    "rollout.tools": [[], ["zoom"], ["zom"]],
    "rollout.tool_models": [{}, {"detect": "runs/missing-detector"}, {"segment": "runs/x"}, {"detect": 3}],
    "rollout.max_turns": [0, 1, 2],
    "rollout.max_trajectory_tokens": [0, 8, 64],
    "rollout.tool_timeout_s": [0.0, 1.0, NAN],
    "rollout.tool_image_side": [0, 56, 100000],
    "rollout.fsdp_generation": ["whole", "layers", "layer"],
    "rollout.ahead": [0, 1, 2, -1],
    "rollout.generators": [0, 1, 2],
    "algorithm.advantage_scale": ["group", "batch", "none", "std"],
    "algorithm.advantage_shaping": ["none", "cubic", "cubic_rescaled"],
    "algorithm.eps_low": [0.0, 0.2, 1.0, -0.1],
    "algorithm.eps_high": [0.0, 0.28, -1.0],
    "algorithm.dual_clip": [0.0, 0.5, 3.0],
    "algorithm.ratio_level": ["token", "sequence"],
    "algorithm.surrogate": ["clip", "cispo", "gmpo", "sapo", "ppo"],
    "algorithm.sapo_tau_pos": [0.0, 1.0, NAN, 1e300],
    "algorithm.sapo_tau_neg": [-1.0, 1.05, 1e-300],
    "algorithm.reward_aggregation": ["sum", "normalize_then_sum", "gdpo"],
    "algorithm.top_entropy_share": [0.0, 0.2, 1.0, 1.5],
    "algorithm.aggregation": ["token", "sequence", "constant", "mean"],
    "algorithm.beta": [0.0, 0.04, -1.0, NAN],
    "algorithm.kl_estimator": ["k1", "k2", "k3", "k4"],
    "algorithm.ref_refresh_steps": [-1, 0, 1],
    "algorithm.ref_mix": [0.0, 0.5, 1.0, 1.5],
    "algorithm.updates_per_batch": [0, 1, 2],
    "algorithm.dynamic_sampling": [False, True],
    "algorithm.max_sampling_rounds": [0, 1, 2],
    "algorithm.mask_truncated": [False, True],
    "algorithm.overlong_buffer": [-1, 0, 2, 100],
    "algorithm.overlong_penalty": [-1.0, 0.0, 1.0],
    "algorithm.tis_cap": [0.0, 0.5, 1.0, 3.0, 1e300],
    "algorithm.tis_floor": [0.0, 0.5, 1.5],
    "algorithm.tis_mode": ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "sequence"],
    "algorithm.off_policy_mask": [-1.0, 0.0, 0.5],
    "algorithm.teacher": ["", "runs/missing-teacher"],
    "algorithm.distill_weight": [-1.0, 0.0, 1.0, NAN, 1e300],
    "algorithm.distill_reward": ["keep", "drop", "both"],
    "train.steps": [0, 1],
    "train.epochs": [-1.0, 0.0, 1.0, NAN],
    "train.lr": [-1e-3, 0.0, 1e-3, NAN],
    "train.weight_decay": [-0.1, 0.0, 0.01],
    "train.adam_betas": [[0.9, 0.99], [1.0, 0.9], [0.9]],
    "train.warmup_steps": [-1, 0, 2],
    "train.schedule": ["constant", "cosine", "linear"],
    "train.stochastic_rounding": [False, True],
    "train.max_grad_norm": [-1.0, 0.0, 1.0],
    "train.max_bad_steps": [-1, 0, 3],
    "train.micro_batch_size": [0, 1, 4, "auto"],
    "train.pack_groups": [False, True],
    "train.block_attention": [False, True],
    "train.batched_vision_attention": [False, True],
    "train.fused_kernels": [False, True],
    "train.logprob_chunk": [-1, 0, 2],
    "train.save_every": [-1, 0, 1],
    "train.keep_checkpoints": [-1, 0, 1],
    "train.prefetch_batches": [-1, 0, 2],
    "train.background_checkpoints": [False, True],
    "train.background_scoring": [False, True],
    "train.background_logs": [False, True],
    "train.log_rollouts_every": [-1, 0, 1],
    "train.attention_every": [-1, 0, 1],
    "train.trackers": [[], ["tensorboard"], ["tensorbored"]],
    "train.tracker_project": ["", "vlmrl"],
    "sft.batch_size": [0, 1, 2],
    "sft.text_examples": [-1, 0, 1, 2, 3],
    "eval.every": [-1, 0, 1],
    "eval.n": [0, 1, 2],
    "eval.splits": [["test"], [], ["ood"], ["validation"]],
    "eval.max_new_tokens": [-1, 0, 2],
    "eval.batch_size": [0, 1, 2],
    "eval.blind_check": [False, True],
    "seed": [-1, 0, 7, 2 ** 32],
    "rewards": [[], ["accuracy", "format"], ["acuracy"], ["task", {"name": "length", "weight": -1.0}],
                [{"name": "number", "kwargs": {"extract": "boxed"}}], [{"name": "no_such.module:fn"}],
                [{"name": "format", "weight": 1e300}], [{"name": "http://127.0.0.1:9/score", "kwargs": {"timeout_s": "abc"}}],
                [{"name": "http://127.0.0.1:9/score", "kwargs": {"timeout_s": 1e30}}],
                [{"name": "http://127.0.0.1:9/score", "kwargs": {"retries": 2.7}}]],
    "output_dir": [""],
    "resume": [False, True],
    "resume_changes": ["refuse", "allow", "ask"],
}
"""Values to draw for every leaf field of Config (valid, edge and invalid ones)."""


def base(model: str, out: Path) -> dict:
    """A one-step run of the tiny model, small enough to take a few seconds."""
    return {"model.name_or_path": model, "model.device": "cpu", "output_dir": str(out), "train.steps": 1,
            "rollout.prompts_per_step": 2, "rollout.group_size": 2,
            "rollout.generation_batch_size": 2, "rollout.max_new_tokens": 4, "train.micro_batch_size": 4,
            "train.trackers": [], "train.log_rollouts_every": 0, "sft.batch_size": 2, "eval.n": 2,
            "eval.batch_size": 2, "eval.max_new_tokens": 2}


def test_every_field_has_values_to_draw():
    leaves = [key for key in all_keys(Config)
              if "." in key or key in ("seed", "rewards", "output_dir", "resume", "resume_changes")]
    leaves = [key for key in leaves if key not in ("model.lora",)]
    assert sorted(VALUES) == sorted(leaves)


def override(key: str, value) -> str:
    """`key=value` as a user types it (YAML: null, true, .nan, .inf, flow lists and mappings)."""
    if isinstance(value, float) and not math.isfinite(value):
        text = ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    elif value is None or isinstance(value, (bool, list, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return f"{key}={text}"


def one_line_or_one_step(model: str, drawn: dict, mode: str) -> None:
    """The drawn config is refused in one line (by the config, or before step 1), or trains one step
    and saves its model; anything else raises. The run's folder is removed after."""
    from vlmrl.training.sft import sft
    from vlmrl.training.trainer import train

    with tempfile.TemporaryDirectory() as folder:
        try:
            config = load_config(None, [override(k, v) for k, v in (base(model, Path(folder) / "run") | drawn).items()])
        except VlmrlError as error:
            assert "\n" not in str(error), str(error)
            return
        try:
            run = (train if mode == "train" else sft)(config)
        except VlmrlError as error:
            assert "\n" not in str(error), str(error)
            metrics = Path(config.output_dir) / "metrics.jsonl"
            assert not metrics.exists() or not metrics.read_text().strip(), f"refused after a step: {error}"
            return
        assert (run / "final").is_dir()


@st.composite
def drawn_values(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=1, max_size=5, unique=True))
    return {key: draw(st.sampled_from(VALUES[key])) for key in keys}


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=drawn_values(), mode=st.sampled_from(["train", "sft"]))
def test_any_config_is_refused_in_one_line_or_runs_one_step(tiny_model_dir, drawn, mode):
    one_line_or_one_step(tiny_model_dir, drawn, mode)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=drawn_values(), mode=st.sampled_from(["train", "sft"]))
def test_many_configs_are_refused_in_one_line_or_run_one_step(tiny_model_dir, drawn, mode):
    one_line_or_one_step(tiny_model_dir, drawn, mode)


@pytest.mark.parametrize("drawn, message", [
    ({"algorithm.overlong_buffer": 100}, "algorithm.overlong_buffer=100 must be at most rollout.max_new_tokens=4"),
    ({"train.lr": NAN}, "train.lr must be >= 0; got nan"),
    ({"rollout.top_p": 1.5}, r"rollout.top_p must be in \(0, 1\]; got 1.5"),
    ({"rollout.group_size": 1}, "rollout.group_size must be >= 2"),
    ({"rollout.group_size": 0}, "rollout.group_size must be >= 2"),  # the stricter rule, not generation's >= 1
    ({"rollout.temperature": -1.0}, r"rollout.temperature must be in \[0.001, 100\]"),
    ({"rollout.temperature": 1e-300}, r"rollout.temperature must be in \[0.001, 100\] \(sampling divides the "
                                      r"logits by it: smaller overflows float32"),  # once NaN probabilities at step 1
    ({"rollout.temperature": 0.0}, r"rollout.temperature must be in \[0.001, 100\]"),  # GRPO needs samples
    ({"algorithm.beta": NAN, "algorithm.tis_cap": float("inf")}, r"algorithm.beta=nan, tis_cap=inf: must be finite"),
    ({"train.adam_betas": [1.0, 0.9]}, r"train.adam_betas must be two numbers in \[0, 1\)"),
    ({"seed": -1}, r"seed must be in \[0, 2\*\*32\)"),
    ({"model.device": "gpu"}, "model.device must be auto, cpu, mps, cuda or cuda:N; got 'gpu'"),
    # issue 51 B7: floats past what float32 holds where they are used (tracebacks, or NaN/inf trained on)
    ({"algorithm.sapo_tau_pos": 1e300}, r"algorithm.sapo_tau_pos must be in \[0.01, 100\] \(the gate's width"),
    ({"algorithm.sapo_tau_neg": 1e-300}, r"algorithm.sapo_tau_neg must be in \[0.01, 100\] .*; got 1e-300"),
    ({"algorithm.tis_cap": 1e300}, r"algorithm.tis_cap must be in \[0, 10000\] .*; got 1e\+300"),
    ({"algorithm.distill_weight": 1e300}, r"algorithm.distill_weight must be in \[0, 1000\] .*; got 1e\+300"),
    ({"rewards": [{"name": "format", "weight": 1e300}]}, r"reward format: weight must be in \[-1000, 1000\]"),
    ({"train.lr": 1e30}, r"train.lr must be in \[0, 1\]"),
    ({"model.vision_lr_scale": 1e300}, r"model.vision_lr_scale must be in \[0, 1000\]"),
    # issue 51 B10: a reward service's settings, when the config is read (was: at step 1, or after a rollout)
    ({"rewards": [{"name": "http://127.0.0.1:9/score", "kwargs": {"timeout_s": "abc"}}]},
     r"reward service http://127.0.0.1:9/score: kwargs.timeout_s must be a number; got 'abc'"),
    ({"rewards": [{"name": "http://127.0.0.1:9/score", "kwargs": {"timeout_s": 1e30}}]},
     r"kwargs.timeout_s must be in \(0, 3600\] seconds \(the whole call\); got 1e\+30"),
    ({"rewards": [{"name": "http://127.0.0.1:9/score", "kwargs": {"retries": 2.7}}]},
     r"kwargs.retries must be an integer; got 2.7"),
])
def test_values_that_once_failed_mid_run_are_refused_by_the_config(tiny_model_dir, drawn, message, tmp_path):
    values = base(tiny_model_dir, tmp_path / "run") | drawn
    with pytest.raises(VlmrlError, match=message):
        load_config(None, [override(key, value) for key, value in values.items()])


def test_every_float_field_is_declared_with_its_range():
    """Issue 51 B7: every float a run uses is bounded to what it is used as (fields.Range)."""
    import dataclasses
    import typing

    from vlmrl.config import RewardConfig
    from vlmrl.fields import field_range

    def floats(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from floats(hints[f.name], prefix + f.name + ".")
            elif hints[f.name] is float:
                yield prefix + f.name, f

    found = dict(floats(Config)) | {"rewards[].weight": dict(floats(RewardConfig))["weight"]}
    assert len(found) == 23
    assert [key for key, f in found.items() if field_range(f) is None] == []
