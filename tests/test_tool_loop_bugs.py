"""The tool-loop bugs other RL frameworks shipped in 2026, pinned on every family whose tool rollouts are on
(read from `support.FAMILIES`, so a family listed there later is covered without an edit here):

- an image a tool returns at turn 3 missing from the forward that computes turn 4 (slime #1847): here it
  is in the inputs of the rollout's turn-4 forward and of the training pass, its pixels and its image
  tokens, and it changes turn 4's log-probs and nothing before it;
- the training pass packed (each prompt once per group) giving other numbers than the plain one on such
  a trajectory (packed = plain within 1e-5, fp32);
- the wrong `pixel_values` slice across tool images (TRL #6274): each image's pixel inputs, in the
  processor's own layout, equal that image's inputs alone, and two tool images swapped swap their rows;
- a chat template dropping images inside tool turns (TRL #5663): each tool image's tokens are inside its
  own `<tool_response>`, as many as the image alone gets.

Two trajectories of one prompt (a group of 2): three calls of a tool painting images of other colours
and sizes, then an answer; two calls, then an answer. Built once per family (tiny builds, fp32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.config import load_config
from vlmrl.models import load_policy
from vlmrl.models.support import FAMILIES
from vlmrl.models.token_inputs import per_token_keys
from vlmrl.rollout.generation import stop_token_ids
from vlmrl.rollout.prompts import image_token_id, model_inputs
from vlmrl.rollout.tool_rollout import ToolBox, ToolRollout, generate_trajectories
from vlmrl.rollout.trajectories import Segment, encode_trajectories, prompt_text, tool_turn
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHES = [kind for kind, family in FAMILIES.items() if family.tool_rollouts is None]
"""Every family with tool rollouts on (each must have a tiny build: `vlmrl tiny-model --arch`)."""
PACKED = [kind for kind in ARCHES if FAMILIES[kind].packing is None]
"""Those whose training pass packs a group's trajectories after their prompt."""
PAINTS = [((20, 160, 10), 56, 56), ((10, 10, 200), 84, 56), ((220, 200, 0), 56, 112),  # trajectory 1
          ((200, 0, 200), 28, 56), ((0, 200, 200), 112, 56)]  # trajectory 2
"""What each call asks the tool for: a colour and a size (width, height), no two alike."""
ANSWERS = ["I see.<answer>3</answer>", "<answer>2</answer>"]


def paint_call(colour: tuple[int, int, int], width: int, height: int) -> str:
    """The text of a call of tests/tool_helpers.py's paint_tool."""
    arguments = {"colour": list(colour), "width": width, "height": height}
    return f'<tool_call>\n{json.dumps({"name": "paint_tool", "arguments": arguments})}\n</tool_call>'


SCRIPT = [[*(paint_call(*p) for p in PAINTS[:3]), ANSWERS[0]], [*(paint_call(*p) for p in PAINTS[3:]), ANSWERS[1]]]
"""Each trajectory's model turns."""


@dataclass
class Built:
    """A family's model, its two trajectories, and the inputs of each `generate` call the rollout made."""

    model: torch.nn.Module
    processor: object
    example: Example
    rollout: ToolRollout
    generated: list[dict[str, torch.Tensor]]
    """The inputs of each turn's `generate` call: [3] is the forward that computes turn 4."""


def scripted(model, processor, turns: list[list[str]], seen: list[dict]) -> None:
    """`model.generate` writes turns[row][k] as row's k-th turn (an answer ends with the stop token) and
    keeps the inputs it was given in `seen`."""
    stop = stop_token_ids(processor, model)[0]
    pad = processor.tokenizer.pad_token_id

    def generate(**kwargs):
        k = len(seen)
        seen.append({key: value for key, value in kwargs.items() if torch.is_tensor(value)})
        texts = [processor.tokenizer(t[k], add_special_tokens=False).input_ids
                 + ([] if t[k].endswith("</tool_call>") else [stop]) for t in turns if len(t) > k]
        width = max(len(t) for t in texts)
        new = torch.tensor([t + [pad] * (width - len(t)) for t in texts])  # (n, t)
        return torch.cat([kwargs["input_ids"], new], dim=1)

    model.generate = generate


@pytest.fixture(scope="module")
def built(tiny_model_factory):
    """`built(arch)`: the family's `Built`, made once per module (tests/tool_helpers.py's paint_tool
    importable here and in the tool worker)."""
    cache: dict[str, Built] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))

        def make(arch: str) -> Built:
            if arch not in cache:
                model, processor = load_policy(tiny_model_factory(arch), device="cpu")
                plain_generate, seen = model.generate, []
                scripted(model, processor, SCRIPT, seen)
                prompt = Image.new("RGB", (56, 84), (200, 10, 10))
                example = Example(prompt, "How many shapes?", "3", originals=[prompt])
                settings = load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=4000",
                                              "rollout.max_turns=4", "rollout.tools=[tool_helpers:paint_tool]"]).rollout
                rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(settings))
                model.generate = plain_generate
                cache[arch] = Built(model, processor, example, rollout, seen)
            return cache[arch]

        yield make


def alone(processor, image: Image.Image) -> dict[str, torch.Tensor]:
    """The processor's inputs for a prompt holding `image` alone."""
    example = Example(image, "x", "x")
    return model_inputs(processor(text=[prompt_text(processor, example)], images=[[image]], return_tensors="pt"))


def pixel_keys(inputs: dict[str, torch.Tensor]) -> list[str]:
    """The inputs that do not run along the tokens (pixel values, grids, sizes, pixel masks)."""
    along = per_token_keys(inputs)
    return [k for k, v in inputs.items() if torch.is_tensor(v) and k not in along]


def per_image(value: torch.Tensor, singles: list[torch.Tensor]) -> list[torch.Tensor]:
    """`value`, one pixel input of one sequence's images in the processor's layout, cut into each image's
    part, given each image's input alone (`singles`): along the first dim by the singles' lengths (under a
    leading batch dim of 1 where the processor puts one), each part cropped to its single's shape. Whatever
    a part holds beyond that (a processor pads smaller images to the largest) must be zeros: a part holds
    no other image's pixels."""
    if value.shape[0] == 1 and len(singles) > 1 and all(s.shape[0] == 1 for s in singles):  # (1, images, ...)
        return per_image(value[0], [s[0] for s in singles])
    sizes = [s.shape[0] for s in singles]
    assert value.shape[0] == sum(sizes), (value.shape, sizes)
    parts = []
    for part, single in zip(value.split(sizes), singles):
        assert part.dim() == single.dim() and all(a >= b for a, b in zip(part.shape, single.shape))
        corner = tuple(slice(0, n) for n in single.shape)
        rest = part.clone()
        rest[corner] = 0
        assert not rest.any()  # padding only
        parts.append(part[corner])
    return parts


def assert_images_are(inputs: dict[str, torch.Tensor], images: list[Image.Image], processor, model) -> None:
    """`inputs` (one sequence) hold exactly `images`, in order: each image's pixel inputs equal its own
    alone, and its image tokens are as many as it gets alone."""
    singles = [alone(processor, image) for image in images]
    keys = pixel_keys(singles[0])
    assert keys and set(keys) <= set(inputs)
    for key in keys:
        for k, (part, single) in enumerate(zip(per_image(inputs[key].cpu(), [s[key] for s in singles]), singles)):
            assert torch.equal(part, single[key][0] if part.dim() < single[key].dim() else single[key]), (key, k)
    token = image_token_id(processor, model.config)
    assert int((inputs["input_ids"] == token).sum()) == sum(int((s["input_ids"] == token).sum()) for s in singles)


def tool_images(built: Built, row: int) -> list[Image.Image]:
    """The images the tool returned in trajectory `row`, in order."""
    return [image for segment in built.rollout.segments[row] if not segment.model for image in segment.images]


def turn_spans(segments: list[Segment]) -> list[slice]:
    """Where each model turn's tokens are among the trajectory's completion positions."""
    spans, start = [], 0
    for segment in segments:
        if segment.model:
            spans.append(slice(start, start + len(segment.ids)))
        start += len(segment.ids)
    return spans


def forward_inputs(model, run) -> list[dict[str, torch.Tensor]]:
    """The inputs of every forward of `model` while `run()` runs."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({k: v for k, v in kwargs.items() if torch.is_tensor(v)}),
        with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("arch", ARCHES)
def test_a_tool_image_is_in_the_forward_that_computes_the_next_turn(arch, built):
    """The image the tool returned after turn 3 (and those before it) is in the rollout's turn-4
    forward and in the training pass's: pixels and image tokens; another turn-3 image of the same size
    changes turn 4's log-probs and leaves turns 1 to 3's as they were."""
    b = built(arch)
    painted = tool_images(b, 0)
    assert [(image.size, image.getpixel((image.width - 1, image.height - 1))) for image in painted] == [
        ((w, h), colour) for colour, w, h in PAINTS[:3]]  # the tool's three images, each its own
    images = [*b.example.images, *painted]
    assert len(b.generated) == 4 and b.generated[3]["input_ids"].shape[0] == 1  # turn 4: trajectory 1 alone
    assert_images_are(b.generated[3], images, b.processor, b.model)
    one = b.rollout.select([0])
    scorer = LogprobScorer(b.processor, 1.0, False, 0)
    with torch.no_grad():
        (training,) = forward_inputs(b.model, lambda: scorer(b.model, one))
        assert_images_are(training, images, b.processor, b.model)
        segments = list(one.segments[0])
        third = segments[5]
        assert not third.model and third.images == [painted[2]]
        segments[5] = replace(third, images=[Image.new("RGB", painted[2].size, (255, 255, 255))])
        before = scorer(b.model, one)[0][0]  # (T,)
        after = scorer(b.model, replace(one, segments=[segments]))[0][0]
    spans = turn_spans(one.segments[0])
    assert len(spans) == 4
    for span in spans[:3]:
        assert (before[span] - after[span]).abs().max() < 1e-6  # nothing before the image changed
    assert (before[spans[3]] - after[spans[3]]).abs().max() > 1e-4  # turn 4 sees the turn-3 image


@pytest.mark.parametrize("arch", PACKED)
def test_the_packed_training_pass_equals_the_plain_one_with_several_tool_images(arch, built):
    """Two trajectories with five tool images of five sizes: the packed pass (one sequence, the prompt
    once; dense mask and block attention) gives the plain pass's log-probs (1e-5), its one pack holding
    the prompt image, then each trajectory's tool images, in order."""
    b = built(arch)
    with torch.no_grad():
        plain = LogprobScorer(b.processor, 1.0, False, 0)(b.model, b.rollout)[0]  # (2, T)
        for blocks in (False, True):
            results = []
            inputs = forward_inputs(b.model, lambda: results.append(
                LogprobScorer(b.processor, 1.0, True, 5, blocks)(b.model, b.rollout)[0]))
            assert len(inputs) == 1 and inputs[0]["input_ids"].shape[0] == 1  # one pack: the group
            assert (plain - results[0]).abs().max() < 1e-5
    images = [*b.example.images, *tool_images(b, 0), *tool_images(b, 1)]
    assert_images_are(inputs[0], images, b.processor, b.model)


@pytest.mark.parametrize("arch", ARCHES)
def test_swapped_tool_images_swap_their_pixel_rows(arch, built):
    """A trajectory with the first two tool images swapped: each image's pixel inputs move with it (no
    part of one holds another's), the rest stay, and each tool turn's image tokens follow its image (the
    packed pass's inputs: test_the_packed_training_pass_...). Two trajectories with 4 and 3 images scored in
    one plain forward get the log-probs each gets alone, and the rollout's batched turn-3 forward gives
    each trajectory the next-token logits it gets alone."""
    b = built(arch)
    first, second, third = tool_images(b, 0)
    tokens = b.processor.tokenizer
    call = tokens(SCRIPT[0][0], add_special_tokens=False).input_ids
    answer = tokens(ANSWERS[0], add_special_tokens=False).input_ids

    def trajectory(images: list[Image.Image]) -> list[Segment]:
        turns = []
        for k, image in enumerate(images):
            turns += [Segment(call, model=True), tool_turn(b.processor, b.example, f"image {k}", [image])]
        return turns + [Segment(answer, model=True)]

    token = image_token_id(b.processor, b.model.config)
    order, swapped = [first, second, third], [second, first, third]
    parts = {}
    for name, images in (("order", order), ("swapped", swapped)):
        segments = trajectory(images)
        inputs = encode_trajectories(b.processor, [b.example], [segments], torch.device("cpu"))
        assert_images_are(inputs, [*b.example.images, *images], b.processor, b.model)
        singles = [alone(b.processor, image) for image in [*b.example.images, *images]]
        parts[name] = {key: per_image(inputs[key], [s[key] for s in singles]) for key in pixel_keys(singles[0])}
        counts = [int((torch.tensor(s.ids) == token).sum()) for s in segments if not s.model]
        assert counts == [int((single["input_ids"] == token).sum()) for single in singles[1:]]
    for key, rows in parts["order"].items():
        moved = parts["swapped"][key]
        assert [torch.equal(x, y) for x, y in zip(rows, [moved[0], moved[2], moved[1], moved[3]])] == [True] * 4, key
    assert any(not torch.equal(x, y) for x, y in zip(parts["order"]["pixel_values"][1:3],
                                                    parts["swapped"]["pixel_values"][1:3]))  # the swap is seen
    scorer = LogprobScorer(b.processor, 1.0, False, 0)
    with torch.no_grad():  # two trajectories of 4 and 3 images in one plain forward: each its own images
        together = scorer(b.model, b.rollout)[0]  # (2, T)
        for row in range(2):
            single = scorer(b.model, b.rollout.select([row]))[0][0]  # (T_row,)
            assert (together[row, :len(single)] - single).abs().max() < 1e-5
        batch = b.generated[2]  # the rollout's turn-3 forward: both trajectories, left-padded, 3 images each
        assert batch["input_ids"].shape[0] == 2
        last = b.model(**batch).logits[:, -1]  # (2, V)
        for row in range(2):
            inputs = encode_trajectories(b.processor, [b.example], [b.rollout.segments[row][:4]], torch.device("cpu"))
            assert (last[row] - b.model(**inputs).logits[0, -1]).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ARCHES)
def test_the_chat_template_keeps_each_tool_image_inside_its_tool_turn(arch, built):
    """Each tool turn, as the family's chat template and processor write it, holds its image's tokens,
    as many as the image gets alone, between its own `<tool_response>` and `</tool_response>`; and the
    turn-4 forward's ids end with those tool turns as they are."""
    b = built(arch)
    token = image_token_id(b.processor, b.model.config)
    decode = b.processor.tokenizer.decode
    for row in range(2):
        tools = [s for s in b.rollout.segments[row] if not s.model]
        assert [len(s.images) for s in tools] == [1] * len(tools) and len(tools) == len(SCRIPT[row]) - 1
        for segment in tools:
            ids = torch.tensor(segment.ids)
            where = (ids == token).nonzero().flatten().tolist()
            assert len(where) == int((alone(b.processor, segment.images[0])["input_ids"] == token).sum()) > 0
            head, tail = decode(segment.ids[:where[0]]), decode(segment.ids[where[-1] + 1:])
            assert head.count("<tool_response>") == 1 and "</tool_response>" not in head
            assert tail.count("</tool_response>") == 1 and "<tool_response>" not in tail
    ids = b.generated[3]["input_ids"][0].tolist()  # prompt, then three calls and their results
    so_far = [i for segment in b.rollout.segments[0][:6] for i in segment.ids]
    assert ids[-len(so_far):] == so_far and decode(ids).count("</tool_response>") == 3
