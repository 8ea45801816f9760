"""SFT's batches made ahead on a worker thread (training/sft_batches.py) equal the batches made in place."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.completions import Completions
from vlmrl.tasks import get_task
from vlmrl.training.sft import sft
from vlmrl.training.sft_batches import SftBatches


def run(tmp_path, tiny_model_dir, name: str, prefetch: int):
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LookTask",
        f"output_dir={tmp_path / name}", "rollout.tools=[zoom]", "sft.batch_size=4", "train.micro_batch_size=2",
        "train.steps=3", "train.lr=1e-2", "train.trackers=[]", f"train.prefetch_batches={prefetch}"])
    folder = sft(config)
    return read_metrics(folder / "metrics.jsonl"), load_file(str(folder / "final" / "model.safetensors"))


def test_sft_with_its_batches_made_ahead_equals_sft_making_each_in_place(tmp_path, tiny_model_dir, letter_task):
    """Reference trajectories with a tool call (zoom), 3 steps: the same losses and the same weights, bit for bit."""
    (plain, plain_weights), (ahead, ahead_weights) = (run(tmp_path, tiny_model_dir, "plain", 0),
                                                      run(tmp_path, tiny_model_dir, "ahead", 2))
    assert [r["loss"] for r in ahead] == [r["loss"] for r in plain]
    assert all(torch.equal(ahead_weights[name], plain_weights[name]) for name in plain_weights)
    assert all(r["time/data_ahead"] > 0 for r in ahead) and all(r["time/data_ahead"] == 0 for r in plain)
    assert all(r["time/data"] > 0 for r in plain)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_a_batch_that_fails_raises_at_its_own_step_and_the_worker_stops(depth):
    made = []

    def make(examples, processor):
        if made:
            raise ValueError("the second batch is broken")
        made.append([example.meta["idx"] for example in examples])
        return Completions(examples, torch.zeros(len(examples), 1), torch.ones(len(examples), 1))

    batches = SftBatches(get_task("shapes"), processor=None, limit=None, indices=lambda step: [2 * step, 2 * step + 1],
                         make=make, start=1, steps=6, depth=depth)
    first, _ = batches.take(1)
    assert (first.wanted, first.used, first.stop, made) == ([2, 3], [2, 3], None, [[2, 3]])
    with pytest.raises(ValueError, match="the second batch is broken"):
        batches.take(2)
    batches.close()
    assert batches.thread is None or not batches.thread.is_alive()
    assert made == [[2, 3]]  # nothing made after the step that failed
