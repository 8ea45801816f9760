"""The policy update's parts on hand-made batches: the config's knobs reach grpo.policy_loss, the
loss mask, the micro-batches and their shares of the loss weight."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vlmrl import grpo
from vlmrl.config import load_config
from vlmrl.rollout.generation import Rollout
from vlmrl.training.experience import Experience
from vlmrl.training.policy_update import LOSS_STATISTICS, accumulate_gradients, loss_batch, loss_settings


class OneProcess:
    """What loss_batch asks of accelerate, for one process on the CPU."""

    device = torch.device("cpu")
    num_processes = 1

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor


def experience(mask: list[list[int]], truncated: list[bool]) -> Experience:
    rows = len(mask)
    rollout = Rollout(rows=[object()] * rows, completion_ids=torch.zeros(rows, len(mask[0]), dtype=torch.long),
                      completion_mask=torch.tensor(mask), texts=[""] * rows, truncated=torch.tensor(truncated))
    return Experience(rollout, rewards={}, reward=torch.zeros(rows), advantages=torch.arange(rows).float(),
                      groups_drawn=1, groups_with_signal=1)


def session(*overrides: str) -> SimpleNamespace:
    return SimpleNamespace(config=load_config(None, ["train.micro_batch_size=2", *overrides]), accelerator=OneProcess())


def test_every_knob_of_the_loss_comes_from_the_config():
    config = load_config(None, ["algorithm.eps_low=0.1", "algorithm.eps_high=0.28", "algorithm.ratio_level=sequence",
                                "algorithm.aggregation=constant", "rollout.max_new_tokens=12", "algorithm.beta=0.5",
                                "algorithm.kl_estimator=k2", "algorithm.dual_clip=3", "algorithm.tis_cap=2"])
    assert loss_settings(config) == grpo.LossSettings(eps_low=0.1, eps_high=0.28, ratio_level="sequence",
                                                      aggregation="constant", max_len=12, beta=0.5, kl_kind="k2",
                                                      dual_clip=3.0, tis_cap=2.0)
    assert loss_settings(load_config(None, [])).dual_clip is None  # 0 = off
    assert loss_settings(load_config(None, ["algorithm.tis_cap=0"])).tis_cap is None  # 0 = off
    assert loss_settings(load_config(None, [])).tis_cap == 3.0  # on by default
    with pytest.raises(Exception, match=r"algorithm.tis_cap must be 0 \(off\) or >= 1; got 0.5"):
        load_config(None, ["algorithm.tis_cap=0.5"])


def test_dual_clip_must_be_off_or_above_one():
    with pytest.raises(Exception, match=r"algorithm.dual_clip must be 0 \(off\) or > 1; got 0.5"):
        load_config(None, ["algorithm.dual_clip=0.5"])


def test_token_aggregation_weighs_micro_batches_by_their_tokens():
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]  # 3, 1, 4, 2, 4 tokens
    batch = loss_batch(session("algorithm.aggregation=token"), experience(mask, [False] * 5))
    assert batch.micro == [[0, 1], [2, 3], [4]]
    assert [float(s) for s in batch.shares] == pytest.approx([4 / 14, 6 / 14, 4 / 14])
    assert torch.equal(batch.mask, torch.tensor(mask))
    inputs = batch.loss_inputs([2, 3], logp=torch.full((2, 4), -1.0))
    assert torch.equal(inputs.old_logp, torch.full((2, 4), -1.0)) and inputs.ref_logp is None  # on-policy
    assert torch.equal(inputs.advantages, torch.tensor([2.0, 3.0]))


def test_sequence_aggregation_weighs_rows_and_overlong_filtering_drops_truncated_rows():
    mask = [[1, 1], [1, 1], [1, 0]]
    batch = loss_batch(session("algorithm.mask_truncated=true"), experience(mask, [False, True, False]))
    assert [float(s) for s in batch.shares] == pytest.approx([2 / 3, 1 / 3])  # rows, truncated ones included
    assert torch.equal(batch.mask, torch.tensor([[1, 1], [0, 0], [1, 0]]))
    assert torch.equal(batch.completions.completion_mask, torch.tensor(mask))  # still scored, no loss


class Recorder(OneProcess):
    """OneProcess that also runs backward and never skips a gradient sync."""

    def no_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


def test_accumulated_statistics_are_share_weighted_sums_read_once(monkeypatch):
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]  # 3, 1, 4 tokens: micro-batches of 4 and 4 tokens
    run = session("algorithm.aggregation=token", "algorithm.tis_cap=0")
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(model.weight, 0.5)

    def scorer(policy, part, with_entropy):
        n, length = part.completion_mask.shape
        logp = policy.weight.reshape(()) * -torch.arange(1.0, 1.0 + n * length).reshape(n, length) / 10  # (n, T)
        return logp, 2.0 * part.completion_mask  # (n, T) entropy 2 on every valid token, 0 on padding

    run.model, run.accelerator = model, Recorder()
    run.backward = lambda loss, last: run.accelerator.backward(loss)  # TrainingSession.backward without DeepSpeed
    batch = loss_batch(run, experience(mask, [False] * 3))
    batch.reference = torch.full((3, 4), -0.3)  # (N, T) the KL term counts too
    expected = {name: 0.0 for name in LOSS_STATISTICS}
    for rows, share in zip(batch.micro, batch.shares):
        logp, _ = scorer(model, batch.completions.select(rows), True)
        out = grpo.policy_loss(logp, batch.loss_inputs(rows, logp), loss_settings(run.config))
        for name in LOSS_STATISTICS:
            expected[name] += float(getattr(out, name).detach()) * float(share)
    reads = []
    for method in ("__float__", "item", "tolist"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _m=method: reads.append(_m) or _f(self, *a))
    sums = accumulate_gradients(run, scorer, batch)
    monkeypatch.undo()
    assert reads == ["tolist"]  # one device-to-host copy for all statistics of all micro-batches
    assert sums == pytest.approx(expected | {"entropy": 2.0})  # the entropy's mean: 2 per valid token
    assert model.weight.grad is not None and float(model.weight.grad.abs()) > 0
