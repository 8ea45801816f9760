"""Evaluation: the arithmetic with hand-computed numbers, the blind-image derangement, and the whole
evaluation and `vlmrl eval` on the offline tiny model."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from vlmrl.cli import main
from vlmrl.errors import VlmrlError
from vlmrl.evaluation.evaluate import (
    EvalSettings,
    Evaluation,
    blank_images,
    derangement,
    evaluate,
    format_table,
    held_out_examples,
    length_buckets,
    mean_scores,
    pass_at_k,
    run_eval,
    safe_filename,
    save_evaluation,
    scalar_metrics,
    shuffled_images,
    summarize,
)
from vlmrl.tasks import get_task

# small images and short completions keep the model runs to a few seconds
TASK_PARAMS = {"image_size": 112}


@pytest.fixture(scope="module")
def task():
    return get_task("shapes", **TASK_PARAMS)


# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("samples, correct, k, expected", [
    (4, 0, 4, 0.0),   # none right
    (4, 1, 4, 1.0),   # samples == k: "any of k"
    (4, 2, 1, 0.5),   # pass@1 is the share right
    (5, 2, 2, 0.7),   # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 4, 2, 1.0),   # fewer than k wrong: some draw of k always holds a right one
])
def test_pass_at_k_is_the_unbiased_estimator(samples, correct, k, expected):
    assert pass_at_k(samples, correct, k) == pytest.approx(expected)


@pytest.mark.parametrize("samples, correct, k", [(4, 0, 0), (4, 0, 5), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_rejects_impossible_counts(samples, correct, k):
    with pytest.raises(ValueError):
        pass_at_k(samples, correct, k)


def test_mean_scores_averages_each_component_over_the_rows_that_have_it():
    rows = [{"total": 1.0, "accuracy": 1.0, "format": 0.5}, {"total": 0.0, "accuracy": 0.0}]
    assert mean_scores(rows) == {"total": 0.5, "accuracy": 0.5, "format": 0.5}
    assert list(mean_scores(rows)) == ["total", "accuracy", "format"]


def test_length_buckets_are_quartiles_with_counts_and_accuracy():
    lengths = [8, 1, 2, 7, 3, 4, 5, 6]
    correct = [0, 1, 1, 0, 0, 0, 1, 0]
    assert length_buckets(lengths, correct, 4) == [
        {"min_tokens": 1, "max_tokens": 2, "n": 2, "accuracy": 1.0},
        {"min_tokens": 3, "max_tokens": 4, "n": 2, "accuracy": 0.0},
        {"min_tokens": 5, "max_tokens": 6, "n": 2, "accuracy": 0.5},
        {"min_tokens": 7, "max_tokens": 8, "n": 2, "accuracy": 0.0},
    ]


def test_equal_lengths_share_a_bucket_and_empty_buckets_are_left_out():
    # sorted 5 5 5 5 9 9; edges at ranks 2 and 4 are 5 and 9: [5, 9) and [9, inf)
    assert length_buckets([5, 9, 5, 5, 9, 5], [1, 0, 0, 1, 0, 0], 3) == [
        {"min_tokens": 5, "max_tokens": 5, "n": 4, "accuracy": 0.5},
        {"min_tokens": 9, "max_tokens": 9, "n": 2, "accuracy": 0.0},
    ]
    assert length_buckets([16] * 5, [1, 1, 0, 0, 0], 4) == [
        {"min_tokens": 16, "max_tokens": 16, "n": 5, "accuracy": 0.4}]
    assert length_buckets([3, 1, 2], [1, 0, 0], 1) == [{"min_tokens": 1, "max_tokens": 3, "n": 3, "accuracy": 1 / 3}]
    assert length_buckets([], [], 4) == []


def test_summarize_from_hand_made_numbers():
    scores = [{"format": 1.0, "accuracy": 1.0, "total": 1.0}, {"format": 1.0, "accuracy": 0.0, "total": 0.2},
              {"format": 0.0, "accuracy": 0.0, "total": 0.0}, {"format": 1.0, "accuracy": 1.0, "total": 1.0}]
    results = summarize("shapes", scores, lengths=[10, 20, 30, 40], truncated=[False, False, True, False],
                        samples_correct=[2, 0, 1, 4], k=4, temperature=0.7,
                        blank_correct=[0, 0, 0, 1], shuffled_correct=[1, 0, 0, 0], buckets=2)
    assert results == {
        "task": "shapes", "n": 4, "accuracy": 0.5,
        "rewards": {"format": 0.75, "accuracy": 0.5, "total": pytest.approx(0.55)},
        "completion_tokens": 25.0, "truncated": 0.25,
        "by_length": [{"min_tokens": 10, "max_tokens": 20, "n": 2, "accuracy": 0.5},
                      {"min_tokens": 30, "max_tokens": 40, "n": 2, "accuracy": 0.5}],
        # pass@1 = mean of 2/4, 0/4, 1/4, 4/4; pass@4 = 3 of 4 examples have a right sample
        "pass_at_k": {"k": 4, "temperature": 0.7, "pass@1": pytest.approx(7 / 16), "pass@k": 0.75},
        "blind": {"blank": {"accuracy": 0.25, "drop": 0.25}, "shuffled": {"accuracy": 0.25, "drop": 0.25}},
    }


def test_summarize_without_sampling_or_blind_check():
    results = summarize("t", [{"accuracy": 1.0, "total": 1.0}], lengths=[3], truncated=[True])
    assert results["pass_at_k"] is None and results["blind"] is None
    assert (results["accuracy"], results["truncated"], results["n"]) == (1.0, 1.0, 1)
    only_blank = summarize("t", [{"accuracy": 1.0, "total": 1.0}], [3], [False], blank_correct=[0.0])
    assert only_blank["blind"] == {"blank": {"accuracy": 0.0, "drop": 1.0}, "shuffled": None}


def test_scalar_metrics_and_table_show_the_numbers():
    results = summarize("shapes", [{"accuracy": 1.0, "total": 1.0}, {"accuracy": 0.0, "total": 0.5}],
                        lengths=[12, 30], truncated=[False, True], samples_correct=[1, 0], k=2,
                        blank_correct=[0, 0], shuffled_correct=[1, 0])
    assert scalar_metrics(results) == {
        "eval/accuracy": 0.5, "eval/completion_tokens": 21.0, "eval/truncated": 0.5,
        "eval/reward/accuracy": 0.5, "eval/reward/total": 0.75, "eval/pass@1": 0.25, "eval/pass@k": 0.5,
        "eval/blank/accuracy": 0.0, "eval/blank/drop": 0.5, "eval/shuffled/accuracy": 0.5,
        "eval/shuffled/drop": 0.0}
    table = format_table(results)
    assert table.splitlines()[0] == "shapes: 2 examples"
    assert "  greedy accuracy              50.0%" in table
    assert "  pass@2                       50.0%" in table
    assert "  12                   1      100.0%" in table  # tokens, n, accuracy of the first bucket
    assert "  real                 50.0%\n" in table
    assert "  blank                 0.0%    +50.0 pts" in table
    assert "  shuffled             50.0%     +0.0 pts" in table


def test_settings_out_of_range_are_one_line_errors():
    for settings, message in [(EvalSettings(batch_size=0), "batch size must be >= 1"),
                              (EvalSettings(k=-1), "k must be >= 0"),
                              (EvalSettings(temperature=0.0), "temperature must be in [0.001, 100]"),
                              (EvalSettings(temperature=float("inf")), "temperature must be in [0.001, 100]"),
                              (EvalSettings(temperature=1e-300), "temperature must be in [0.001, 100]"),
                              (EvalSettings(top_p=1.5), "top_p must be in (0, 1]"),
                              (EvalSettings(length_buckets=0), "length buckets must be >= 1")]:
        with pytest.raises(VlmrlError, match=re.escape(message)):
            settings.validate()


def test_safe_filename_keeps_import_paths_usable():
    assert safe_filename("eval_my.tasks:Letters_test.json") == "eval_my.tasks_Letters_test.json"


def test_eval_of_a_split_smaller_than_n_takes_each_row_once(tmp_path, tiny_model_dir, capsys):
    """8 test rows and --n 64: it reported "64 examples", each row 8 times (pass@k over duplicates)."""
    from PIL import Image

    for split, count in (("train", 4), ("test", 8)):
        rows = []
        for i in range(count):
            Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(tmp_path / f"{split}{i}.png")
            rows.append({"question": f"{split} chart {i}?", "answer": str(i), "image": f"{split}{i}.png"})
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["eval", tiny_model_dir, "--task", "dataset", f"path={tmp_path}", "--n", "64", "--k", "2",
                 "--no-blind", "--max-new-tokens", "2", "--device", "cpu", "--out", str(tmp_path / "eval")]) == 0
    out, err = capsys.readouterr()
    assert "dataset: 8 examples" in out
    assert "split 'test' of task 'dataset' holds 8 rows: evaluating those 8, each once (not the 64 asked for)" in err
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert saved["results"]["n"] == 8
    assert sorted(record["prompt"] for record in saved["examples"]) == sorted({r["prompt"] for r in saved["examples"]})


# ---------------------------------------------------------------- blind images


@pytest.mark.parametrize("n", [2, 3, 5, 17])
def test_derangement_moves_every_index_and_is_fixed_by_the_seed(n):
    for seed in range(5):
        order = derangement(n, seed)
        assert sorted(order) == list(range(n))
        assert all(order[i] != i for i in range(n))
        assert derangement(n, seed) == order
    assert derangement(2, 0) == [1, 0]
    assert len({tuple(derangement(17, seed)) for seed in range(5)}) > 1  # the seed matters


def test_derangement_needs_two_items():
    with pytest.raises(ValueError):
        derangement(1, 0)


def test_shuffled_images_give_each_example_another_examples_image(task):
    examples = held_out_examples(task, "test", 6)
    moved, source = shuffled_images(examples, seed=3)
    for i, (original, shown) in enumerate(zip(examples, moved)):
        assert source[i] != i
        assert shown.image is examples[source[i]].image and shown.image is not original.image
        assert (shown.prompt, shown.answer, shown.meta) == (original.prompt, original.answer, original.meta)
    assert shuffled_images(examples, seed=3)[1] == source


def test_blank_images_keep_the_size_and_hold_one_colour(task):
    examples = held_out_examples(task, "test", 2)
    for original, blank in zip(examples, blank_images(examples)):
        assert blank.image.size == original.image.size == (112, 112)
        assert blank.image.getextrema() == ((255, 255), (255, 255), (255, 255))
        assert original.image.getextrema() != blank.image.getextrema()  # the original is untouched
        assert blank.answer == original.answer


def test_held_out_examples_are_fixed_and_checked(task):
    first, again = held_out_examples(task, "ood", 3), held_out_examples(task, "ood", 3)
    assert [e.meta["idx"] for e in first] == [0, 1, 2]
    assert [e.answer for e in first] == [e.answer for e in again]
    with pytest.raises(VlmrlError, match="has no split 'valid'"):
        held_out_examples(task, "valid", 3)
    with pytest.raises(VlmrlError, match=r"must be in \[1, 1,000,000\], got 0"):
        held_out_examples(task, "test", 0)
    with pytest.raises(VlmrlError, match=r"must be in \[1, 1,000,000\], got 100000000000000000000"):
        held_out_examples(task, "test", 10 ** 20)  # a list of them all was made first: a hang


# ---------------------------------------------------------------- on the tiny model


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from vlmrl.models import load_policy

    return load_policy(tiny_model_dir, device="cpu")


def test_evaluate_end_to_end_on_the_tiny_model(tiny_policy, task, tmp_path):
    model, processor = tiny_policy
    examples = held_out_examples(task, "test", 4)
    settings = EvalSettings(batch_size=4, max_new_tokens=6, k=2, blind_check=True, seed=1)
    model.train()
    torch.manual_seed(7)
    rng_before = torch.get_rng_state()
    evaluation = evaluate(model, processor, task, examples, settings, show_progress=False)
    assert model.training  # given back in the mode it had
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's random state is untouched

    results = evaluation.results
    assert list(results) == ["task", "n", "accuracy", "rewards", "completion_tokens", "truncated",
                             "by_length", "pass_at_k", "blind"]
    assert results["task"] == "shapes" and results["n"] == 4
    assert set(results["rewards"]) == set(task.score(examples[0], "")) and "total" in results["rewards"]
    assert 0.0 <= results["accuracy"] <= 1.0 and 0.0 <= results["truncated"] <= 1.0
    assert 1.0 <= results["completion_tokens"] <= 6.0
    assert sum(bucket["n"] for bucket in results["by_length"]) == 4
    assert results["pass_at_k"]["k"] == 2
    assert 0.0 <= results["pass_at_k"]["pass@1"] <= results["pass_at_k"]["pass@k"] <= 1.0
    for kind in ("blank", "shuffled"):
        blind = results["blind"][kind]
        assert blind["drop"] == pytest.approx(results["accuracy"] - blind["accuracy"])

    assert len(evaluation.records) == 4
    for i, record in enumerate(evaluation.records):
        assert (record["idx"], record["split"], record["answer"]) == (i, "test", examples[i].answer)
        assert record["scores"] == task.score(examples[i], record["completion"])
        assert len(record["samples"]) == 2 and 0 <= record["samples_correct"] <= 2
        assert record["shuffled"]["image_from"] != i and "completion" in record["blank"]
    assert evaluation.settings["task_params"]["image_size"] == 112 and evaluation.settings["k"] == 2

    # the same seed gives the same samples, with or without the blind passes
    again = evaluate(model, processor, task, examples, EvalSettings(batch_size=4, max_new_tokens=6, k=2, seed=1),
                     show_progress=False)
    assert [r["samples"] for r in again.records] == [r["samples"] for r in evaluation.records]
    assert again.results["pass_at_k"] == results["pass_at_k"] and again.results["blind"] is None

    path = save_evaluation(evaluation, tmp_path / "out")
    assert path == tmp_path / "out" / "eval.json"
    saved = json.loads(path.read_text())
    assert saved["results"]["pass_at_k"] == results["pass_at_k"]
    assert saved["settings"]["seed"] == 1 and len(saved["examples"]) == 4


def test_evaluate_greedy_only_skips_the_optional_passes(tiny_policy, task):
    model, processor = tiny_policy
    evaluation = evaluate(model, processor, task, held_out_examples(task, "test", 2),
                          EvalSettings(max_new_tokens=4), show_progress=False)
    assert evaluation.results["pass_at_k"] is None and evaluation.results["blind"] is None
    assert set(evaluation.records[0]) == {"idx", "split", "prompt", "answer", "completion",
                                          "completion_tokens", "truncated", "scores"}
    with pytest.raises(VlmrlError, match="empty"):
        evaluate(model, processor, task, [], show_progress=False)


def test_evaluation_decodes_as_asked_with_the_same_answers(tiny_policy, task):
    """EvalSettings.decode, as rollout.decode (a run's evaluations take its setting): each decode
    path gives the same answers, greedy and sampled (tests/test_decoding.py); an unknown one is an error."""
    model, processor = tiny_policy
    examples = held_out_examples(task, "test", 2)

    def answers(decode: str) -> list[str]:
        settings = EvalSettings(max_new_tokens=4, k=2, decode=decode)
        return [r["completion"] for r in evaluate(model, processor, task, examples, settings,
                                                 show_progress=False).records]

    assert answers("static") == answers("dynamic")
    with pytest.raises(VlmrlError, match="decode must be one of auto, dynamic, static, compiled"):
        evaluate(model, processor, task, examples, EvalSettings(decode="fast"), show_progress=False)


def test_run_eval_writes_next_to_the_model_by_default(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    evaluation, path = run_eval(str(model_dir), "shapes", TASK_PARAMS, split="ood", n=2,
                                settings=EvalSettings(max_new_tokens=4), device="cpu")
    assert path == model_dir / "eval_shapes_ood.json"
    saved = json.loads(path.read_text())
    assert saved["settings"]["model"] == str(model_dir) and saved["settings"]["split"] == "ood"
    assert saved["results"] == json.loads(json.dumps(evaluation.results))
    assert isinstance(evaluation, Evaluation)


def test_eval_command_prints_the_table_and_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", tiny_model_dir, "--task", "shapes", "--n", "3", "--k", "2", "--max-new-tokens", "3",
                 "--batch-size", "4", "--out", str(out), "--device", "cpu", "image_size=112"])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("shapes: 3 examples")
    for line in ("greedy accuracy", "pass@2", "accuracy by completion length", "blind-image check",
                 f"wrote {out / 'eval.json'}"):
        assert line in printed
    saved = json.loads((out / "eval.json").read_text())
    assert saved["results"]["n"] == 3 and saved["settings"]["blind_check"] is True
    assert saved["settings"]["task_params"]["image_size"] == 112


@pytest.mark.parametrize("args, message", [
    (["--task", "shapez"], "error: unknown task 'shapez'; did you mean shapes"),
    (["--task", "shapes", "--split", "valid"], "error: task 'shapes' has no split 'valid'; valid: train, test, ood"),
    (["--task", "shapes", "--n", "0"], "error: the number of examples must be in [1, 1,000,000], got 0"),
    (["--task", "shapes", "--k", "-1"], "error: k must be >= 0"),
    (["--task", "shapes", "colour=red"], "error: unknown parameter 'colour' of task 'shapes'"),
    (["--task", "shapes", "--tools", "zoom", "--tool-image-side", "0"],
     "error: --tool-image-side must be in [28, 1024] pixels (the longest side of a zoomed image; a tool returns at "
     "most 1024 x 1024 pixels); got 0"),
    (["--task", "shapes", "--tools", "zoom", "--tool-image-side", "100000"],
     "error: --tool-image-side must be in [28, 1024] pixels"),
    (["--task", "shapes", "--out", "{tmp}/a_file"],
     "error: cannot write the evaluation to {tmp}/a_file: {tmp}/a_file is a file, not a folder; choose another path"),
    (["--task", "shapes", "--out", "{tmp}/a_file/sub"],
     "error: cannot write the evaluation to {tmp}/a_file/sub: {tmp}/a_file is a file, not a folder"),
    (["--task", "shapes", "--out", "/proc/eval"],
     "error: cannot write the evaluation to /proc/eval: /proc is the kernel's virtual filesystem, not a place for "
     "files; choose another path"),
])
def test_eval_command_bad_input_is_one_line_and_exit_2(tiny_model_dir, args, message, capsys, tmp_path):
    (tmp_path / "a_file").write_text("x")
    args, message = [a.format(tmp=tmp_path) for a in args], message.format(tmp=tmp_path)
    assert main(["eval", tiny_model_dir, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_eval_on_a_full_disk_is_one_line_and_keeps_the_earlier_file(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import errno

    out = tmp_path / "eval"
    args = ["eval", tiny_model_dir, "--task", "shapes", "--n", "2", "--k", "0", "--no-blind", "--max-new-tokens", "2",
            "--out", str(out), "--device", "cpu", "image_size=112"]
    assert main(args) == 0
    earlier = (out / "eval.json").read_text()

    def half_then_full(self, text, *rest, **options):
        open(self, "w").write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(out), "write_text", half_then_full)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # after the weight-loading bar
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith(f"error: the disk is full: writing the evaluation to {out / 'eval.json'} failed")
    monkeypatch.undo()
    assert (out / "eval.json").read_text() == earlier and sorted(p.name for p in out.iterdir()) == ["eval.json"]


def test_eval_command_missing_model_folder(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), "--task", "shapes", "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model folder {str(tmp_path / 'nope')!r} does not exist")
    assert len(err.strip().splitlines()) == 1


REWARD_FILE = ("def chars(completions, **kwargs):\n    return [float(len(c[0]['content'])) for c in completions]\n"
               "def odd(completions, **kwargs):\n    return [float(len(c[0]['content']) % 2) for c in completions]\n"
               "def never(completions, **kwargs):\n    return [None for c in completions]\n")


def test_evaluation_scores_with_the_run_s_rewards_and_takes_accuracy_from_the_correctness_reward(
        tiny_policy, task, tmp_path):
    from vlmrl.rewards import builtin

    model, processor = tiny_policy
    (tmp_path / "mine.py").write_text(REWARD_FILE)
    mine = f"{tmp_path}/mine.py"
    examples = held_out_examples(task, "test", 4)

    def run(rewards, **more):
        settings = EvalSettings(batch_size=4, max_new_tokens=6, rewards=rewards, **more)
        return evaluate(model, processor, task, examples, settings, show_progress=False)

    # a function labelled accuracy is the accuracy; a None (never) is left out of an answer's scores
    labelled = run([{"name": f"{mine}:odd", "label": "accuracy"}, {"name": f"{mine}:chars", "weight": 0.5}, "format",
                    {"name": f"{mine}:never", "weight": 0}], k=2, blind_check=True, seed=1)
    texts = [record["completion"] for record in labelled.records]
    odd = [float(len(t) % 2) for t in texts]
    form = builtin.format([[{"role": "assistant", "content": t}] for t in texts])
    assert [record["scores"] for record in labelled.records] == [
        {"accuracy": o, "chars": float(len(t)), "format": f, "total": pytest.approx(o + 0.5 * len(t) + f)}
        for o, t, f in zip(odd, texts, form)]
    results = labelled.results
    assert results["accuracy"] == sum(odd) / 4 and results["rewards"]["chars"] == sum(map(len, texts)) / 4
    assert "never" not in results["rewards"]
    blank = [float(len(r["blank"]["completion"]) % 2) for r in labelled.records]
    assert results["blind"]["blank"]["accuracy"] == sum(blank) / 4
    assert [r["samples_correct"] for r in labelled.records] == [
        sum(len(s) % 2 for s in r["samples"]) for r in labelled.records]
    assert scalar_metrics(results)["eval/reward/chars"] == results["rewards"]["chars"]

    # your own functions alone: the task's own score gives the accuracy (beside them, weight 0)
    own = run([f"{mine}:chars"])
    for record, example in zip(own.records, examples):
        score = task.score(example, record["completion"])
        assert record["scores"]["chars"] == record["scores"]["total"] == float(len(record["completion"]))
        assert record["scores"]["task"] == score["total"] and record["scores"]["accuracy"] == score["accuracy"]
    # a built-in verifier is the accuracy
    number = run(["number"])
    assert all(r["scores"]["accuracy"] == r["scores"]["number"] for r in number.records)
    assert [r["scores"]["number"] for r in number.records] == builtin.number(
        [[{"role": "assistant", "content": r["completion"]}] for r in number.records], [e.answer for e in examples])


def test_eval_command_scores_with_rewards_and_refuses_a_bad_one_before_loading(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "mine.py").write_text(REWARD_FILE)
    args = ["eval", tiny_model_dir, "--task", "shapes", "image_size=112", "--n", "2", "--k", "0", "--no-blind",
            "--max-new-tokens", "3", "--device", "cpu", "--out", str(tmp_path / "eval")]
    assert main(args + ["--reward", f"{tmp_path}/mine.py:odd", "--reward", "{name: format, weight: 0.5}"]) == 0
    saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert set(saved["results"]["rewards"]) >= {"odd", "format", "task", "accuracy", "total"}
    assert [r["scores"]["odd"] for r in saved["examples"]] == [len(r["completion"]) % 2 for r in saved["examples"]]
    assert [r["name"] for r in saved["settings"]["rewards"]] == [f"{tmp_path}/mine.py:odd", "format"]
    capsys.readouterr()
    assert main(args + ["--reward", "acuracy"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: unknown reward 'acuracy'; did you mean accuracy?")


# ---------------------------------------------------------------- the blind checks in time


def test_time_controls_reorder_the_frames_and_keep_the_slots_times():
    from PIL import Image

    from vlmrl.evaluation.evaluate import shuffled_order, time_controls
    from vlmrl.tasks import Example, Video

    frames = [Image.new("RGB", (8, 8), (40 * k, 0, 0)) for k in range(4)]
    example = Example(prompt="?", answer="right", videos=[Video(frames, [0, 0.5, 1.0, 1.5])])
    controls = time_controls([example], seed=3)
    assert list(controls) == ["single_frame", "shuffled_frames", "reversed_frames"]
    single = controls["single_frame"][0].videos[0]
    assert single.frames == (frames[1],) and single.timestamps == (0.5,)  # the middle frame, (4 - 1) // 2
    reversed_ = controls["reversed_frames"][0].videos[0]
    assert reversed_.frames == tuple(frames[::-1]) and reversed_.timestamps == (0, 0.5, 1.0, 1.5)
    order = shuffled_order(4, "3:0:0")  # seed 3, example 0, video 0
    assert controls["shuffled_frames"][0].videos[0].frames == tuple(frames[j] for j in order) and order != [0, 1, 2, 3]
    assert time_controls([example, example], seed=3)["shuffled_frames"][1].videos[0].frames == tuple(
        frames[j] for j in shuffled_order(4, "3:1:0"))
    assert shuffled_order(2, "x") == [1, 0] and shuffled_order(4, "3:0:0") == order
    assert example.videos[0].frames == tuple(frames)  # the example itself untouched
    blank = blank_images([example])[0].videos[0]
    assert blank.timestamps == (0, 0.5, 1.0, 1.5) and all(f.getcolors() == [(64, (255, 255, 255))]
                                                          for f in blank.frames)


def test_the_checks_in_time_reach_the_full_video_the_tools_read():
    """A task may show fewer frames than its full video (the motion task's `view_frames`): each check
    changes the full video that the `frames` tool reads by its own frames, not by the view's."""
    from PIL import Image

    from vlmrl.evaluation.evaluate import shuffled_order, time_controls
    from vlmrl.tasks import Example, Video

    full = [Image.new("RGB", (8, 8), (20 * k, 0, 0)) for k in range(9)]
    times = [k / 2 for k in range(9)]
    example = Example(prompt="?", answer="right", videos=[Video([full[0], full[8]], [0, 4.0])],
                      video_originals=[Video(full, times)])
    controls = time_controls([example], seed=3)
    single = controls["single_frame"][0]
    assert single.videos[0].frames == (full[0],) and single.video_originals[0].frames == (full[4],)
    assert single.video_originals[0].timestamps == (2.0,)
    assert controls["reversed_frames"][0].video_originals[0].frames == tuple(full[::-1])
    shuffled = controls["shuffled_frames"][0].video_originals[0]
    assert shuffled.frames == tuple(full[j] for j in shuffled_order(9, "3:0:0")) and shuffled.timestamps == tuple(times)


def test_summarize_and_the_table_show_the_checks_in_time():
    results = summarize("motion", [{"accuracy": 1.0}, {"accuracy": 1.0}], [5, 5], [False, False],
                        blank_correct=[0, 1], shuffled_correct=[1, 0],
                        time_correct={"single_frame": [1, 0], "shuffled_frames": [0, 1], "reversed_frames": [0, 0]})
    assert list(results["blind"]) == ["blank", "shuffled", "single_frame", "shuffled_frames", "reversed_frames"]
    assert results["blind"]["reversed_frames"] == {"accuracy": 0.0, "drop": 1.0}
    assert scalar_metrics(results)["eval/single_frame/drop"] == 0.5
    assert "  reversed_frames       0.0%   +100.0 pts" in format_table(results)


def read_direction(example) -> str:
    """An oracle that reads the order of the frames: the asked square's centre in the first and the
    last frame; "left" where it cannot tell (one frame, no square, no move)."""
    from vlmrl.tasks.motion import COLOURS

    frames = example.videos[0].frames
    colour = COLOURS[example.meta["colour"]]

    def centre(frame):
        points = [(x, y) for x in range(frame.width) for y in range(frame.height) if frame.getpixel((x, y)) == colour]
        return (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)) if points else None

    first, last = centre(frames[0]), centre(frames[-1])
    if len(frames) < 2 or first is None or last is None or first == last:
        return "left"
    dx, dy = last[0] - first[0], last[1] - first[1]
    return ("right" if dx > 0 else "left") if abs(dx) >= abs(dy) else ("down" if dy > 0 else "up")


def test_the_checks_in_time_catch_a_model_that_reads_the_order(monkeypatch):
    """A model that reads the first and last frames is right on the videos, wrong on every reversed one,
    right on a single frame only where its default guess is; a shuffled order p (another per
    example) shows it frames p[0] and p[3] first and last: right where p[3] > p[0]."""
    from vlmrl.evaluation import evaluate as evaluation_module
    from vlmrl.evaluation.evaluate import shuffled_order
    from vlmrl.rollout.generation import Rollout

    def oracle(model, processor, batch, generation, seed=None):
        texts = [f"<think> x </think> <answer> {read_direction(ex)} </answer>" for ex in batch]
        n = len(texts)
        ones = torch.ones(n, 3, dtype=torch.long)
        return Rollout(list(batch), ones, ones, texts=texts, truncated=torch.zeros(n, dtype=torch.bool))

    monkeypatch.setattr(evaluation_module, "generate_groups", oracle)
    task = get_task("motion", directions="left,right", frames=4, image_size=48)
    examples = held_out_examples(task, "test", 8)
    lefts = sum(ex.answer == "left" for ex in examples) / 8
    model = torch.nn.Linear(1, 1)
    blind = evaluate(model, None, task, examples, EvalSettings(batch_size=4, blind_check=True, seed=2),
                     show_progress=False).results["blind"]
    orders = [shuffled_order(4, f"2:{i}:0") for i in range(8)]
    assert (blind["single_frame"]["accuracy"], blind["blank"]["accuracy"]) == (lefts, lefts)
    assert blind["reversed_frames"] == {"accuracy": 0.0, "drop": 1.0}
    assert blind["shuffled_frames"]["accuracy"] == sum(p[3] > p[0] for p in orders) / 8
    assert 0 < blind["shuffled_frames"]["accuracy"] < 1  # the orders differ by example
