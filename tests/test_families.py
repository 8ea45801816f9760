"""The family matrix: every family `vlmrl tiny-model --arch` builds trains end to end on the CPU.

Per family, on its tiny build: the image reaches the output (shifted pixels change the logits),
the folder loads with plain transformers and with vlmrl to the same logits, and SFT, GRPO,
evaluation, saving and an exact resume run through vlmrl's own entry points. What each fast path
gives against the plain one is checked in test_speedups.py and test_decoding.py, for the families
whose row of `support.FAMILIES` lists it as exact; here, that a family with a fast path off says so
in the preflight, in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.config import load_config
from vlmrl.evaluation.evaluate import run_eval
from vlmrl.models import load_policy, support
from vlmrl.models.tiny_model import ARCHES
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.prompts import encode_prompts
from vlmrl.safety.preflight import preflight
from vlmrl.tasks import Example
from vlmrl.training.sft import sft
from vlmrl.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)
PROMPTS = [Example(Image.new("RGB", (56, 84), (200, 10, 10)), "Count.", "1"),
           Example(Image.new("RGB", (112, 112), (20, 100, 10)), "How many circles are in the image?", "2")]


def pixels_shifted(inputs: dict) -> dict:
    """The same inputs with every floating-point pixel input moved by 0.3."""
    return {k: v + 0.3 if k.startswith("pixel") and v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.parametrize("arch", ARCHES)
def test_the_image_reaches_the_output(arch, tiny_model_factory):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    inputs = encode_prompts(processor, PROMPTS, torch.device("cpu"))
    with torch.no_grad():
        plain, shifted = model(**inputs).logits, model(**pixels_shifted(inputs)).logits  # (B, P, V)
    assert (plain - shifted).abs().max() > 1e-3  # no projector or gate left at zero


@pytest.mark.parametrize("arch", ARCHES)
def test_the_folder_loads_with_transformers_and_with_vlmrl_to_the_same_logits(arch, tiny_model_factory):
    from transformers import AutoModelForImageTextToText

    folder = tiny_model_factory(arch)
    model, processor = load_policy(folder, device="cpu")
    plain = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    inputs = encode_prompts(processor, PROMPTS, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain(**inputs).logits)


def run_config(tmp_path, model_dir, name, *overrides):
    base = [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={tmp_path / name}", "rollout.prompts_per_step=2", "rollout.group_size=3",
            "rollout.max_new_tokens=6", "rollout.generation_batch_size=2", "train.micro_batch_size=6",
            "train.lr=1e-3", "sft.batch_size=2", "eval.every=0"]
    return load_config(None, base + list(overrides))


@pytest.mark.parametrize("arch", ARCHES)
def test_sft_then_grpo_then_an_exact_resume(arch, tiny_model_factory, tmp_path, letter_task):
    warm = sft(run_config(tmp_path, tiny_model_factory(arch), "sft", "train.steps=2")) / "final"
    common = ["train.steps=2", "train.save_every=1", "algorithm.beta=0.05"]
    straight = train(run_config(tmp_path, warm, "a", *common))
    interrupted = Path(shutil.copytree(straight, tmp_path / "b"))  # the same run (as launching.py's resume tests)
    shutil.rmtree(interrupted / "checkpoints" / "step_000002")  # as if stopped after step 1
    shutil.rmtree(interrupted / "final")
    resumed = train(run_config(tmp_path, warm, "b", *common, "resume=true"))

    def strip(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))}
                for row in rows]

    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(straight / "metrics.jsonl"))
    evaluation, _ = run_eval(str(resumed / "final"), "letter_task:LetterTask", {}, n=2, device="cpu",
                             out_dir=str(tmp_path / "eval"))
    assert len(evaluation.records) == 2 and 0.0 <= evaluation.results["accuracy"] <= 1.0


@pytest.mark.parametrize("arch", [a for a in ARCHES if any(support.FAMILIES[a].paths().values())])
def test_a_fast_path_a_family_has_off_is_named_in_the_preflight(arch, tiny_model_factory, tmp_path, letter_task):
    from vlmrl.tasks import get_task

    config = run_config(tmp_path, tiny_model_factory(arch), "run", "train.steps=1")
    model, processor = load_policy(config.model.name_or_path, device="cpu")
    lines = "\n".join(preflight(config, model, processor, get_task(config.task.name), "train").lines())
    for path, reason in support.FAMILIES[arch].paths().items():
        if reason is not None and path != "static and compiled decoding":  # decoding says it in its own line
            assert reason in lines, (path, lines)


@pytest.mark.parametrize("arch", [a for a in ARCHES if support.FAMILIES[a].tool_rollouts is not None])
def test_tools_on_a_family_without_tool_rollouts_stop_in_the_preflight(arch, tiny_model_factory, tmp_path,
                                                                        letter_task):
    from vlmrl.errors import VlmrlError
    from vlmrl.tasks import get_task

    config = run_config(tmp_path, tiny_model_factory(arch), "run", "train.steps=1", "rollout.tools=[zoom]")
    model, processor = load_policy(config.model.name_or_path, device="cpu")
    with pytest.raises(VlmrlError, match="rollout.tools: tool rollouts are off for this model .*"
                                         + support.FAMILIES[arch].tool_rollouts[:20]):
        preflight(config, model, processor, get_task(config.task.name), "train")


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl"])
def test_the_preflight_counts_the_image_tokens_the_model_sees(arch, tiny_model_factory, tmp_path, letter_task):
    """Gemma 3's processor names its begin-of-image token as `image_token_id`; the soft tokens the
    vision tower fills are the config's: the preflight counts those (16 per image here)."""
    from vlmrl.tasks import get_task

    config = run_config(tmp_path, tiny_model_factory(arch), "run", "train.steps=1")
    model, processor = load_policy(config.model.name_or_path, device="cpu")
    report = preflight(config, model, processor, get_task(config.task.name), "train")
    example = get_task(config.task.name).example(0)
    ids = encode_prompts(processor, [example], torch.device("cpu"))["input_ids"][0]
    expected = int((ids == model.config.get_text_config().image_token_id if arch == "qwen2_5_vl"
                    else ids == model.config.image_token_index).sum())
    assert expected >= 4 and max(check.image_tokens for check in report.splits) == expected
