"""Supervised warm start: completion-only targets, a model that learns its reference, eval rows."""

from __future__ import annotations

import json

import pytest
import torch

from vlmrl.config import GenerationSettings, load_config
from vlmrl.errors import VlmrlError
from vlmrl.models import load_policy
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.generation import generate_groups, stop_token_ids
from vlmrl.tasks import get_task
from vlmrl.training.logprobs import LogprobScorer
from vlmrl.training.sft import completion_tokens, reference_batch, sft, without_media


def test_targets_are_the_completion_and_its_end_token_only(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir)
    task = get_task("shapes")
    examples = [task.example(i) for i in range(3)]
    stop_ids = stop_token_ids(processor, model)
    ids, mask, trained = completion_tokens(processor, examples, stop_ids)
    assert ids.shape == mask.shape and ids.shape[0] == 3 and (trained == mask).all()
    for row, example in enumerate(examples):
        n = int(mask[row].sum())
        tokens = ids[row, :n].tolist()
        assert tokens[-1] in stop_ids and not any(t in stop_ids for t in tokens[:-1])
        assert processor.tokenizer.decode(tokens[:-1]).strip() == example.reference_completion
        assert (ids[row, n:] == processor.tokenizer.pad_token_id).all()


def test_sft_teaches_the_reference_and_logs_evaluations(tmp_path, tiny_model_dir, letter_task):
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
        f"output_dir={tmp_path / 'run'}", "sft.batch_size=8", "train.micro_batch_size=4", "train.steps=30",
        "train.lr=1e-2", "train.save_every=15", "eval.every=15", "eval.n=4", "rollout.max_new_tokens=10",
        "rollout.decode=static"])
    run = sft(config)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[-1]["loss"] < 0.1 * rows[0]["loss"] and rows[-1]["confident_tokens"] == 1.0
    assert "eval/test/accuracy" in rows[14] and "eval/test/accuracy" not in rows[13]
    assert rows[-1]["eval/test/accuracy"] == 1.0  # greedy decoding now writes the reference
    saved = json.loads((run / "evals" / "step_000015_test.json").read_text())
    assert saved["settings"]["decode"] == "static"  # the run's evaluations decode as its rollouts
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000015", "step_000030"]

    model, processor = load_policy(str(run / "final"))
    task = get_task("letter_task:LetterTask")
    rollout = generate_groups(model, processor, [task.example(99)], GenerationSettings(
        group_size=1, max_new_tokens=10, temperature=0))
    assert rollout.texts == ["a a a a"] and not rollout.truncated.any()


def test_sft_learns_an_answer_that_only_the_image_holds(tmp_path, tiny_model_dir, letter_task):
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:ColorTask",
        f"output_dir={tmp_path / 'run'}", "sft.batch_size=8", "train.micro_batch_size=8", "train.steps=40",
        "train.lr=1e-2", "eval.every=40", "eval.n=16", "rollout.max_new_tokens=4", "train.trackers=[]",
        "eval.blind_check=true"])
    rows = read_metrics(sft(config) / "metrics.jsonl")
    assert rows[-1]["eval/test/accuracy"] == 1.0  # the prompt is the same for both answers
    assert rows[-1]["eval/test/blank/accuracy"] == rows[-1]["eval/test/shuffled/accuracy"] == 0.375  # eval.blind_check


def test_sft_logs_its_cpu_seconds_and_the_epoch_of_a_dataset_and_none_for_a_generator(tmp_path, tiny_model_dir, letter_task):
    from PIL import Image

    rows = []
    for i in range(5):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
        rows.append({"question": f"chart {i}?", "answer": str(i), "image": f"{i}.png"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "sft.batch_size=2", "train.steps=3",
              "eval.every=0"]
    run = sft(load_config(None, [*common, "task.name=dataset", f"task.params.path={tmp_path / 'train.jsonl'}",
                                 "task.params.test_fraction=0", f"output_dir={tmp_path / 'data-run'}"]))
    data_rows = read_metrics(run / "metrics.jsonl")
    assert [row["epoch"] for row in data_rows] == [0.4, 0.8, 1.2]  # 5 rows, 2 a step
    assert all(0 < row["time/cpu"] and 0 < row["seconds"] for row in data_rows)  # CPU seconds beside the wall clock, as GRPO's
    run = sft(load_config(None, [*common, "task.name=letter_task:LetterTask", f"output_dir={tmp_path / 'gen-run'}"]))
    assert all("epoch" not in row for row in read_metrics(run / "metrics.jsonl"))


def test_text_examples_leave_out_of_the_loss_only_what_the_image_tells(tiny_model_dir):
    """sft.text_examples: of a cryptogram learnt without its image, every plain letter of the
    decoder's entries and of the walk is left out of the loss, and every other token is learnt."""
    model, processor = load_policy(tiny_model_dir)
    task = get_task("cryptogram", layout="grid", entries="all", reference="table", pair_breaks=True)
    examples = [task.example(i) for i in range(2)]
    spans = [task.image_only_spans(example) for example in examples]
    ids, mask, trained = completion_tokens(processor, examples, stop_token_ids(processor, model), spans)
    for row, (example, places) in enumerate(zip(examples, spans)):
        text = example.reference_completion
        left_out = ids[row][(mask[row] == 1) & (trained[row] == 0)].tolist()
        assert "".join(processor.tokenizer.decode([t]).strip() for t in left_out) == "".join(text[a:b] for a, b in places)
        assert len(places) == len(example.meta["cells"]) + len(example.meta["coded"].replace(" ", "").replace("_", ""))
    assert (trained <= mask).all() and trained[:, 0].all()  # the opening <think> is learnt


def test_a_text_copy_scores_in_a_batch_with_images_as_alone(tiny_model_dir):
    """Rows without an image beside rows with one (one processor call): each row's log-probs are
    those of the row alone."""
    model, processor = load_policy(tiny_model_dir)
    task = get_task("cryptogram", layout="grid", entries="all", reference="table")
    example = task.example(0)
    stop_ids = stop_token_ids(processor, model)
    scorer = LogprobScorer(processor, 1.0, False, 0, False)
    mixed = reference_batch(processor, [example, without_media(example)], None, stop_ids)
    together, _ = scorer(model, mixed)  # (2, T)
    for row in range(2):
        alone, _ = scorer(model, reference_batch(processor, [mixed.rows[row]], None, stop_ids))  # (1, T_row)
        assert torch.allclose(together[row, :alone.shape[1]], alone[0], atol=1e-5)
    assert not torch.allclose(together[0], together[1])  # the image is seen by one row only


def test_sft_with_text_copies_still_learns_what_only_the_image_holds(tmp_path, tiny_model_dir, letter_task):
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:ColorTask",
        f"output_dir={tmp_path / 'run'}", "sft.batch_size=8", "sft.text_examples=8", "train.micro_batch_size=16",
        "train.steps=40", "train.lr=1e-2", "eval.every=40", "eval.n=16", "rollout.max_new_tokens=4",
        "train.trackers=[]", "eval.blind_check=true"])
    rows = read_metrics(sft(config) / "metrics.jsonl")
    assert rows[-1]["eval/test/accuracy"] == 1.0
    assert rows[-1]["eval/test/blank/accuracy"] == rows[-1]["eval/test/shuffled/accuracy"] == 0.375


def test_text_examples_and_tools_are_refused_with_the_key_to_change():
    with pytest.raises(VlmrlError, match="sft.text_examples=0"):
        load_config(None, ["sft.batch_size=4", "sft.text_examples=2", "rollout.tools=[zoom]"])
    with pytest.raises(VlmrlError, match="0..sft.batch_size"):
        load_config(None, ["sft.batch_size=4", "sft.text_examples=5"])
