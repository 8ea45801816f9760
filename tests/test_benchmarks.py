"""The benchmarks' own arithmetic and reports (benchmarks/), without running a benchmark.

The figures a GPU session takes once are only as good as this code: the gradient cosine summed one
tensor at a time equals the cosine of the concatenation; the attention-call counter counts SDPA
calls; a run stopped by --time-budget reports the steps it measured and says so; the --video table
divides each vlmrl side by TRL's and counts each side's own work; the
cryptogram probe's ridge classifier scores what it should; the reading probe scores each walk
letter at the position that predicts it, and counts a guess read from another filled cell; the
text-alone copy probe labels each copied letter's token with its kind; and a model moved onto the
letter tokenizer keeps its weights and each shared token's row.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_pass import CountingAttention, gradient_cosine  # noqa: E402
from bench_vs_trl import Side, StepWork, report  # noqa: E402
from probe_cryptogram import ridge_accuracy  # noqa: E402
from probe_cryptogram_reading import other_cell_share, walk_coded_letters, walk_reading  # noqa: E402
from probe_walk_copies import encode  # noqa: E402


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


def test_the_video_table_divides_each_vlmrl_side_by_trl_and_counts_each_sides_own_work():
    """bench_vs_trl.py --video: TRL on frames as images (each prompt G times), vlmrl on the video and on
    the frames (each prompt once per group), each side's FLOPs from its own prompt tokens and patches."""
    args = argparse.Namespace(prompts=1, group=2, image=112, tokens=4, dtype="float32", checkpointing=True,
                              beta=0.0, model=None, arch_3b=False, size="tiny", micro=2, vlmrl_plain=False,
                              dense_attention=False, vision_loop=False, fused_kernels=False, round_to_nearest=False,
                              decode="auto", vlmrl_only=False, warmup=1, steps=2, device="cpu", peak_tflops=None,
                              video=True, frames=4)
    step = {"step": 2.0, "generate": 1.0, "reward": 0.0, "train": 1.0, "memory": 10.0, "vision_rows": 4,
            "completion_tokens": 4.0, "loss": 0.0}
    sides = [Side("TRL (frames)", [dict(step, cpu=c) for c in (9.0, 4.0, 6.0)]),
             Side("vlmrl (video)", [dict(step, cpu=c) for c in (3.0, 1.0, 1.0)]),
             Side("vlmrl (frames)", [dict(step, cpu=c) for c in (3.0, 2.0, 1.0)])]
    frames = StepWork(text_params=10, vision_params=5, prompt_tokens=3, patches=2, prompts=1, group=2, completion=4,
                      forwards=0)
    video = dataclasses.replace(frames, prompt_tokens=2, patches=1)
    text = "\n".join(report(args, sides, {"TRL (frames)": frames, "vlmrl (frames)": frames, "vlmrl (video)": video},
                            wall=12.0, speedups="block attention"))
    assert "the motion task's videos of 4 frames of 112x112 (TRL: the frames as images)" in text
    assert ("| per step (median of 2 after 1 warm-up) | TRL (frames) | vlmrl (video) | vlmrl (frames) | "
            "vlmrl (video) / TRL (frames) | vlmrl (frames) / TRL (frames) |") in text
    assert "| step CPU (s) | 5.000 | 1.000 | 1.500 | 0.200 | 0.300 |" in text
    # 6 x (10 x tokens + 5 x patches): TRL 2 x 3 + 2 x 4 tokens, 2 x 2 patches; vlmrl 3 + 8 and 2; video 2 + 8 and 1
    assert "| training model FLOPs (TFLOP) | 9.6e-10 | 6.3e-10 | 7.2e-10 | 0.656 | 0.750 |" in text


def test_the_probe_scores_a_separable_set_fully_and_a_constant_feature_at_chance():
    import numpy as np

    train_x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    test_x = np.array([[0.8, 0.0], [0.0, 0.7]])
    assert ridge_accuracy(train_x, ["a", "a", "b", "b"], test_x, ["a", "b"]) == 1.0
    same = np.ones((4, 2))  # every image the same feature: the classifier can only guess one class
    assert ridge_accuracy(same, ["a", "a", "b", "b"], np.ones((2, 2)), ["a", "b"]) == 0.5


def test_the_reading_probe_scores_each_walk_letter_where_it_is_predicted(tiny_model_dir):
    from types import SimpleNamespace

    from vlmrl.models import load_policy
    from vlmrl.tasks import get_task
    from vlmrl.tasks.cryptogram import table_letter_cells, walk_letter_cells

    _, processor = load_policy(tiny_model_dir, device="cpu")
    task = get_task("cryptogram", letters="abcdefgh", layout="grid", reference="pairs", instructions=False,
                    vocabulary="strings", min_word_length=1, max_word_length=2, max_words=2)
    examples = [task.example(i, "test") for i in range(3)]
    letters = sum(len(e.meta["message"].replace(" ", "")) for e in examples)

    def oracle(shift: int):
        """Logits that put each position's next token (shift=1) or its own (shift=0) first."""
        def forward(**inputs):
            ids = torch.roll(inputs["input_ids"], -shift, dims=1)  # (B, S)
            return SimpleNamespace(logits=F.one_hot(ids, len(processor.tokenizer)).float())  # (B, S, V)
        return forward

    images, guesses = [e.image for e in examples], []
    assert walk_reading(oracle(1), processor, examples, images, batch_size=2, guesses=guesses) == {
        "letters": (letters, letters, 3)}
    assert guesses == [letter for e in examples for letter in e.meta["message"].replace(" ", "")]
    right, total, whole = walk_reading(oracle(0), processor, examples, images, batch_size=2)["letters"]
    assert total == letters and whole == 0 and right < letters

    # reference=table: the table's entries, the walk after it and its coded letters, each its own count
    table = get_task("cryptogram", letters="abcdefgh", layout="grid", reference="table", instructions=False,
                     vocabulary="strings", min_word_length=1, max_word_length=2, max_words=2)
    examples = [table.example(i, "test") for i in range(3)]
    spans = {"letters": table.answer_regions, "table": table_letter_cells, "walk": walk_letter_cells,
             "walk_coded": walk_coded_letters}
    counts = walk_reading(oracle(1), processor, examples, images, batch_size=2, guesses=(guesses := []), spans=spans)
    assert counts == {"letters": (letters, letters, 3), "table": (24, 24, 3), "walk": (letters, letters, 3),
                      "walk_coded": (letters, letters, 3)}
    assert guesses == [letter for e in examples for letter in e.meta["message"].replace(" ", "")]
    assert [e.reference_completion[a:b] for e in examples for a, b, _ in walk_coded_letters(e)] == [
        letter for e in examples for letter in e.meta["coded"].split() if letter != "_"]
    assert all(right < total for right, total, _ in
               walk_reading(oracle(0), processor, examples, images, batch_size=2, spans=spans).values())


def test_the_reading_probe_counts_a_guess_from_another_filled_cell():
    from vlmrl.tasks import get_task

    task = get_task("cryptogram", layout="grid", reference="pairs", instructions=False, vocabulary="strings",
                    min_word_length=1, max_word_length=1, max_words=1, entries="some", extra_entries=3)
    example = task.example(0, "test")
    decode = {coded: plain for plain, coded in zip(example.meta["letters"], example.meta["cipher"])}
    coded = example.meta["coded"]
    other = next(c for c in example.meta["filled"] if c != coded)
    bare = next(c for c in decode if c not in example.meta["filled"])
    guesses = [decode[coded], decode[other], decode[bare], "<"]  # right, another filled cell, an empty one, no letter
    assert other_cell_share([example] * 4, guesses, "some") == 0.25
    assert other_cell_share([example] * 4, guesses, "all") == 0.5  # every cell filled: the empty one counts too
    assert other_cell_share([example] * 4, guesses, "message") == 0.0  # only the message's own cell filled


def test_a_model_moved_to_the_letter_tokenizer_keeps_its_weights_and_each_shared_tokens_row(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from retokenize_model import retokenize, vocabulary
    from vlmrl.models.tiny_model import build_tiny_model

    target = build_tiny_model(tmp_path / "letters", size="tiny", tokenizer="letters")
    taken, total = retokenize(Path(tiny_model_dir), target, tmp_path / "moved")
    old, new = vocabulary(Path(tiny_model_dir)), vocabulary(target)
    assert total == len(new) and taken == len(new.keys() & old.keys()) and 0 < taken < total
    trained, fresh = load_file(Path(tiny_model_dir) / "model.safetensors"), load_file(target / "model.safetensors")
    moved = load_file(tmp_path / "moved" / "model.safetensors")
    embedding = "model.embed_tokens.weight"
    assert embedding in moved and moved[embedding].shape == fresh[embedding].shape
    for name, tensor in moved.items():
        if name != embedding:
            assert torch.equal(tensor, trained[name]), name
    shared = next(text for text in new if text in old and new[text] != old[text])  # a shared token, moved
    assert torch.equal(moved[embedding][new[shared]], trained[embedding][old[shared]])
    only_new = next(text for text in new if text not in old)
    assert torch.equal(moved[embedding][new[only_new]], fresh[embedding][new[only_new]])  # a new one: its start
    assert (tmp_path / "moved" / "tokenizer.json").read_text() == (target / "tokenizer.json").read_text()


def test_the_copy_probe_labels_each_copied_letter_s_token_and_leaves_the_decoder_s_entries_untrained(tiny_model_dir):
    """probe_walk_copies.encode: the prompt, then the reference; each kind's tokens are its letters
    in order (the walk's plain and coded letters, <chars>, the answer) and the table's entries,
    which only the image tells, are "unknown" (not trained)."""
    from vlmrl.models import load_policy
    from vlmrl.tasks import get_task

    _, processor = load_policy(tiny_model_dir, device="cpu")
    tokenizer = processor.tokenizer
    for commas in (True, False):
        task = get_task("cryptogram", letters="abcdefgh", layout="grid", reference="table", instructions=False,
                        vocabulary="strings", min_word_length=1, max_word_length=3, min_words=2, max_words=2,
                        pair_breaks=True, walk_commas=commas)
        example = task.example(0, "train")
        ids, kinds = encode(tokenizer, example)
        assert len(ids) == len(kinds) and kinds[0] == "prompt"

        def letters(kind):
            return [tokenizer.decode([token]).strip() for token, k in zip(ids, kinds) if k == kind]

        plain, coded = example.meta["message"].replace(" ", ""), example.meta["coded"].replace(" ", "").replace("_", "")
        assert letters("walk") == list(plain) and letters("walk_coded") == list(coded)
        assert letters("chars") == list(plain) and "".join(letters("answer")) == plain
        decode = dict(zip(example.meta["cipher"], example.meta["letters"]))
        assert letters("unknown") == [decode[c] for c in sorted(decode)]
