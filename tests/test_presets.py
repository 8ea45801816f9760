"""The real-size presets (issue 32, "real sizes"): each resolves and passes its checks with `vlmrl
config` (no weights loaded), names its model by hub id, and says at its top what the preflight's
memory estimate for it was (benchmarks/estimate_real.py, RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmrl.cli import main
from vlmrl.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = {
    "shapes_grpo_qwen3vl_4b_lora.yaml": ("Qwen/Qwen3-VL-4B-Instruct", True),
    "shapes_grpo_qwen3vl_4b_full.yaml": ("Qwen/Qwen3-VL-4B-Instruct", False),
    "shapes_grpo_qwen3vl_8b_lora.yaml": ("Qwen/Qwen3-VL-8B-Instruct", True),
    "shapes_grpo_qwen3vl_8b_full.yaml": ("Qwen/Qwen3-VL-8B-Instruct", False),
    "shapes_grpo_gemma3_4b.yaml": ("google/gemma-3-4b-it", False),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_real_size_preset_passes_vlmrl_config(name, capsys):
    path = CONFIGS / name
    assert main(["config", str(path)]) in (0, None)
    assert f"name_or_path: {PRESETS[name][0]}" in capsys.readouterr().out
    config = load_config(str(path))
    assert config.model.lora.enabled is PRESETS[name][1]
    assert config.model.dtype == "bfloat16"
    assert config.rollout.prompts_per_step % config.rollout.generation_batch_size == 0
    header = path.read_text().split("\nmodel:")[0]
    assert "estimate" in header and "GiB" in header and "estimate_real.py" in header
