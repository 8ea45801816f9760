"""The benchmarks' own arithmetic and reports (benchmarks/), without running a benchmark.

The figures a GPU session takes once are only as good as this code: the gradient cosine summed one
tensor at a time equals the cosine of the concatenation; the attention-call counter counts SDPA
calls; a run stopped by --time-budget reports the steps it measured and says so; and the
cryptogram probe's ridge classifier scores what it should.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_pass import CountingAttention, gradient_cosine  # noqa: E402
from bench_vs_trl import Side, StepWork, report  # noqa: E402
from probe_cryptogram import ridge_accuracy  # noqa: E402


def test_the_gradient_cosine_tensor_by_tensor_is_the_cosine_of_the_whole():
    a = [torch.tensor([1.0, 0.0]), torch.tensor([[2.0]])]
    b = [torch.tensor([1.0, 1.0]), torch.tensor([[0.0]])]
    assert math.isclose(gradient_cosine(a, b), 1 / math.sqrt(5 * 2))  # <a, b> = 1, |a| = sqrt 5, |b| = sqrt 2
    torch.manual_seed(0)
    a = [torch.randn(3, 4).bfloat16(), torch.randn(5)]
    b = [torch.randn(3, 4).bfloat16(), torch.randn(5)]
    whole = F.cosine_similarity(torch.cat([t.double().flatten() for t in a]),
                                torch.cat([t.double().flatten() for t in b]), dim=0)
    assert math.isclose(gradient_cosine(a, b), float(whole), rel_tol=1e-12)


def test_the_counter_counts_attention_calls_only():
    q = torch.randn(1, 2, 3, 4)
    with CountingAttention() as counting:
        F.scaled_dot_product_attention(q, q, q)
        torch.matmul(q, q.transpose(-1, -2))
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert counting.calls == 2


def test_a_run_stopped_by_the_time_budget_reports_the_steps_it_measured():
    args = argparse.Namespace(prompts=1, group=2, image=448, tokens=4, dtype="float32", checkpointing=True,
                              beta=0.0, model=None, arch_3b=False, size="tiny", micro=2, vlmrl_plain=False,
                              dense_attention=False, vision_loop=False, fused_kernels=False, round_to_nearest=False,
                              decode="auto", vlmrl_only=False, warmup=1, steps=3, device="cpu", peak_tflops=None)
    step = {"step": 2.0, "generate": 1.0, "reward": 0.0, "train": 1.0, "memory": 10.0, "vision_rows": 4,
            "completion_tokens": 4.0, "loss": 0.0}
    sides = [Side("TRL", [dict(step, train=t) for t in (9.0, 4.0, 6.0)]),
             Side("vlmrl", [dict(step, train=t) for t in (3.0, 1.0, 2.0)])]  # warm-up, then 2 of 3 measured
    work = StepWork(text_params=10, vision_params=5, prompt_tokens=3, patches=2, prompts=1, group=2, completion=4,
                    forwards=0)
    text = "\n".join(report(args, sides, work, wall=12.0, speedups="block attention"))
    assert "stopped by --time-budget after 2 of 3 measured steps" in text
    assert "| per step (median of 2 after 1 warm-up) | TRL | vlmrl | vlmrl / TRL |" in text
    assert "| training phase (s) | 5.000 | 1.500 | 0.300 |" in text  # medians of (4, 6) and (1, 2)
    assert "- vlmrl speedups taken: block attention" in text


def test_the_probe_scores_a_separable_set_fully_and_a_constant_feature_at_chance():
    import numpy as np

    train_x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    test_x = np.array([[0.8, 0.0], [0.0, 0.7]])
    assert ridge_accuracy(train_x, ["a", "a", "b", "b"], test_x, ["a", "b"]) == 1.0
    same = np.ones((4, 2))  # every image the same feature: the classifier can only guess one class
    assert ridge_accuracy(same, ["a", "a", "b", "b"], np.ones((2, 2)), ["a", "b"]) == 0.5
