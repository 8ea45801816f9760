"""A fast path that fails on its first use falls back (fast_paths.py): the run goes on on the plain
path with one warning and a `fallback/<path>` metric, and equals a run with that fast path off; an
error after a first use that worked propagates."""

from __future__ import annotations

import signal

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.models import fast_paths, support
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout import generation
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")
WARNING = "failed on its first use"


@pytest.fixture
def fresh_warnings(monkeypatch):
    """warn_once forgets what other tests said; every warning is recorded."""
    monkeypatch.setattr(support, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def failing(real, calls: set[int], model_at: int = 0, when=lambda *args: True):
    """`real`, but its n-th call with a model (argument `model_at`), for n in `calls` (1-based,
    counting only calls where `when`), raises as a failed graph capture would: each model (the
    policy, the reference copy) fails on its own uses, as a compile error of its family would."""
    counts: dict[int, int] = {}

    def wrapped(*args, **kwargs):
        if when(*args):
            key = id(args[model_at])
            counts[key] = counts.get(key, 0) + 1
            if counts[key] in calls:
                raise RuntimeError(f"injected: CUDA graph capture failed (call {counts[key]})")
        return real(*args, **kwargs)

    return wrapped


def test_first_use_falls_back_once_and_later_errors_propagate(fresh_warnings):
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(0)
    expected = torch.rand(3)  # what the plain path draws from the fast path's starting state

    def broken():
        torch.rand(5)  # consumes random numbers before it fails
        raise RuntimeError("Dynamo failed to run FX node\nlong trace")

    torch.manual_seed(0)
    assert torch.equal(fast_paths.first_use(model, "static_decode", broken, lambda: torch.rand(3)), expected)
    assert fast_paths.first_use(model, "static_decode", lambda: 1 / 0, lambda: "plain") == "plain"  # never again
    assert fast_paths.fallbacks(model) == ["static_decode"] and fast_paths.fell_back(model, "static_decode")
    assert [str(w.message) for w in fresh_warnings] == [
        "vlmrl: static_decode failed on its first use (RuntimeError: Dynamo failed to run FX node); this run "
        "takes the plain path (fallback/static_decode in metrics.jsonl)"]
    assert fast_paths.first_use(model, "packed_logprobs", lambda: "fast", lambda: "plain") == "fast"
    with pytest.raises(ZeroDivisionError):  # it ran once: a later error is a real one
        fast_paths.first_use(model, "packed_logprobs", lambda: 1 / 0, lambda: "plain")
    other = torch.nn.Linear(2, 2)  # per model: another model's first use is its own
    assert fast_paths.first_use(other, "packed_logprobs", lambda: 1 / 0, lambda: "plain") == "plain"
    assert fast_paths.fallbacks(model) == ["static_decode"] and fast_paths.fallbacks(other) == ["packed_logprobs"]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), VlmrlError("fix the config")])
def test_out_of_memory_and_user_errors_never_fall_back(error):
    model = torch.nn.Linear(2, 2)

    def fast():
        raise error

    with pytest.raises(type(error)):
        fast_paths.first_use(model, "shared_prefill", fast, lambda: "plain")
    assert fast_paths.fallbacks(model) == []


def _config(tmp_path, model_dir, *overrides):
    base = [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=8", "rollout.generation_batch_size=2", "train.micro_batch_size=8",
            "train.lr=1e-3", "train.log_rollouts_every=1", "train.steps=2", "algorithm.beta=0.05"]
    return load_config(None, base + list(overrides))


def _inject(monkeypatch, path: str, calls: set[int]) -> None:
    """Make fast path `path` raise on its `calls`-th uses."""
    if path == "static_decode":  # the static cache (compiled: the same route) fails inside generate
        monkeypatch.setattr(generation, "decode_kwargs", failing(generation.decode_kwargs, calls,
                                                                 when=lambda model, inputs, decode, new: decode != "dynamic"))
    elif path == "shared_prefill":
        monkeypatch.setattr(generation, "prefill_once", failing(generation.prefill_once, calls))
    else:
        monkeypatch.setattr(LogprobScorer, "_packed", failing(LogprobScorer._packed, calls, model_at=1))


FAST_ON_OFF = {  # the fast path on (where it is off by default on a CPU), and off
    "static_decode": ("rollout.decode=static", "rollout.decode=dynamic"),
    "shared_prefill": ("rollout.share_prompt_cache=true", "rollout.share_prompt_cache=false"),
    "packed_logprobs": ("train.pack_groups=true", "train.pack_groups=false"),
}


def _run(run: Path) -> tuple[list[dict], list[str], dict]:
    """What a run logged (timings and fallbacks left out), its rollouts and its final weights."""
    rows = [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/", "fallback/"))}
            for row in read_metrics(run / "metrics.jsonl")]
    rollouts = [path.read_text() for path in sorted((run / "rollouts").glob("*.jsonl"))]
    return rows, rollouts, load_file(run / "final" / "model.safetensors")


@pytest.mark.parametrize("path", list(FAST_ON_OFF))
def test_a_fast_path_that_fails_on_first_use_falls_back_and_the_run_equals_one_without_it(
        path, tmp_path, tiny_model_dir, letter_task, monkeypatch, fresh_warnings):
    on, off = FAST_ON_OFF[path]
    plain = train(_config(tmp_path / "plain", tiny_model_dir, off))
    _inject(monkeypatch, path, calls={1})
    fell = train(_config(tmp_path / "fell", tiny_model_dir, on))
    said = [str(w.message) for w in fresh_warnings if WARNING in str(w.message)]
    assert said == [f"vlmrl: {path} failed on its first use (RuntimeError: injected: CUDA graph capture failed "
                    f"(call 1)); this run takes the plain path (fallback/{path} in metrics.jsonl)"]
    assert [row.get(f"fallback/{path}") for row in read_metrics(fell / "metrics.jsonl")] == [1, 1]
    assert not any(k.startswith("fallback/") for row in read_metrics(plain / "metrics.jsonl") for k in row)
    (rows_a, rollouts_a, weights_a), (rows_b, rollouts_b, weights_b) = _run(plain), _run(fell)
    assert rows_a == rows_b and rollouts_a == rollouts_b  # the same completions, rewards, log-probs, losses
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.parametrize("path", list(FAST_ON_OFF))
def test_an_error_after_a_first_use_that_worked_ends_the_run(path, tmp_path, tiny_model_dir, letter_task,
                                                             monkeypatch, fresh_warnings):
    _inject(monkeypatch, path, calls={2})
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match=r"injected: CUDA graph capture failed \(call 2\)"):
        train(_config(tmp_path, tiny_model_dir, FAST_ON_OFF[path][0]))
    assert not any(WARNING in str(w.message) for w in fresh_warnings)
    assert signal.getsignal(signal.SIGINT) is handler  # the run's stop handler went with it: Ctrl-C is the caller's again
