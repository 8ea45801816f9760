"""The share of image attention a decoded letter puts on its table cell: token grids, spans, shares."""

from __future__ import annotations

import pytest

from vlmrl.evaluation.cell_attention import RegionAttention, box_token_mask, region_attention, span_token_indices
from vlmrl.models import load_policy
from vlmrl.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")

READABLE = dict(letters="etaoinshr", layout="grid", cell_px=28, entries_per_row=3, min_word_length=3,
                max_word_length=3, min_words=2, max_words=2, instructions=False, reference="chars",
                held_out="messages_and_ciphers")


def test_box_token_mask_takes_the_tokens_whose_centre_is_inside():
    mask = box_token_mask((28, 0, 56, 28), (84, 84), (3, 3))
    assert mask.tolist() == [[False, True, False], [False, False, False], [False, False, False]]
    # a processor that resized 84 -> 168 px gives 6 x 6 tokens: the same cell is 2 x 2 of them
    assert box_token_mask((28, 0, 56, 28), (84, 84), (6, 6)).nonzero().tolist() == [[0, 2], [0, 3], [1, 2], [1, 3]]


def test_span_token_indices_picks_the_first_token_overlapping_each_span():
    offsets = [(0, 7), (7, 9), (9, 11), (11, 13)]  # "<chars>", " t", " h", " e"
    assert span_token_indices(offsets, [(8, 9, (0, 0, 1, 1)), (12, 13, (0, 0, 1, 1))]) == [1, 3]


def test_region_attention_summary_reports_ratios_to_uniform():
    result = RegionAttention(per_layer=[0.1, 0.4], uniform=0.125, spans=6)
    assert result.share == pytest.approx(0.25) and result.best_layer == 1
    assert result.summary() == {"share": pytest.approx(0.25), "uniform": 0.125, "ratio": pytest.approx(2.0),
                                "per_layer": [0.1, 0.4], "best_layer": 1, "best_share": 0.4,
                                "best_ratio": pytest.approx(3.2), "spans": 6}


@pytest.fixture(scope="module")
def policy(tiny_model_factory):
    return load_policy(tiny_model_factory("qwen2_5_vl"), device="cpu")


def test_a_box_over_the_whole_image_holds_all_the_image_attention(policy):
    model, processor = policy
    task = get_task("cryptogram", **READABLE)
    examples = [task.example(i, "test") for i in range(3)]
    spans = [[(a, b, (0, 0, 84, 84)) for a, b, _ in task.answer_regions(e)] for e in examples]
    result = region_attention(model, processor, examples, spans, batch_size=2)
    assert result.spans == 18 and result.uniform == pytest.approx(1.0)
    assert result.per_layer == pytest.approx([1.0] * model.config.get_text_config().num_hidden_layers)


def test_the_letters_cells_get_their_share_of_a_model_that_looks_everywhere(policy):
    model, processor = policy
    task = get_task("cryptogram", **READABLE)
    examples = [task.example(i, "test") for i in range(4)]
    result = region_attention(model, processor, examples, [task.answer_regions(e) for e in examples])
    assert result.spans == 24 and result.uniform == pytest.approx(1 / 9)
    # an untrained model spreads its attention: within 10% of uniform on every layer
    assert all(abs(share / result.uniform - 1) < 0.1 for share in result.per_layer)
    assert all(0.0 <= share <= 1.0 for share in result.per_layer)
