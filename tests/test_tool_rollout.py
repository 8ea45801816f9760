"""Multi-turn rollouts with tools on the tiny models: turns, tool results with images, errors counted
not raised, the turn and token limits, and log-probs of the model's tokens equal to a plain forward
over the whole interleaved sequence (Qwen2.5-VL, Qwen2-VL, Idefics3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.config import load_config
from vlmrl.models import load_policy
from vlmrl.models.support import FAMILIES
from vlmrl.models.tiny_model import ARCHES as BUILDABLE
from vlmrl.rollout.generation import stop_token_ids
from vlmrl.rollout.tool_rollout import ToolBox, ToolRollout, generate_trajectories
from vlmrl.rollout.trajectories import Segment, prompt_text
from vlmrl.tasks import Example
from vlmrl.training.logprobs import LogprobScorer

ARCHES = [a for a in BUILDABLE if FAMILIES[a].tool_rollouts is None]  # every family with tool rollouts
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 56, 28]}}\n</tool_call>'
ANSWER = "<answer>3</answer>"


def settings(*overrides: str):
    return load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=40", "rollout.tools=[zoom]",
                              *overrides]).rollout


def scripted(model, processor, turns: list[list[str]]):
    """Make `model.generate` write turns[row][k] as row's k-th turn (the answer ends with the stop
    token; later tokens are padding), after a real prefill."""
    stop = stop_token_ids(processor, model)[0]
    calls = [0]

    def generate(**kwargs):
        ids = kwargs["input_ids"]
        k = calls[0]
        calls[0] += 1
        rows = [t for t in turns if len(t) > k]  # the rows still going, in order
        texts = [processor.tokenizer(t[k], add_special_tokens=False).input_ids
                 + ([] if t[k].endswith("</tool_call>") else [stop]) for t in rows]
        width = max(len(t) for t in texts)
        pad = processor.tokenizer.pad_token_id
        new = torch.tensor([t + [pad] * (width - len(t)) for t in texts])  # (n, t)
        return torch.cat([ids, new], dim=1)

    model.generate = generate


@pytest.fixture
def example() -> Example:
    original = Image.new("RGB", (112, 56), (255, 255, 255))
    original.paste((200, 10, 10), (0, 0, 56, 28))  # red top-left quarter
    return Example(original.resize((56, 28)), "What is the code?", "3", originals=[original])


def test_a_call_is_run_and_its_image_shown_in_the_next_turn(tiny_model_dir, example):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[CALL, ANSWER], [ANSWER]])
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(settings()))
    assert isinstance(rollout, ToolRollout) and rollout.texts == [ANSWER, ANSWER]
    first, second = rollout.trajectories
    assert [t.role for t in first.turns] == ["assistant", "tool", "assistant"] and not first.cut
    assert first.calls[0].name == "zoom" and first.calls[0].arguments == {"box": [0, 0, 56, 28]}
    (crop,) = first.turns[1].images
    assert crop.size == (448, 224) and crop.getpixel((200, 100)) == (200, 10, 10)  # the red quarter, zoomed
    assert [t.role for t in second.turns] == ["assistant"] and second.calls == []
    kinds = [s.model for s in rollout.segments[0]]
    assert kinds == [True, False, True]
    marked = rollout.completion_mask[0].tolist()
    sizes = [len(s.ids) for s in rollout.segments[0]]
    assert marked[:sum(sizes)] == [1] * sizes[0] + [0] * sizes[1] + [1] * sizes[2]  # the tool's tokens: no loss
    assert int(rollout.completion_mask[1].sum()) == len(rollout.segments[1][0].ids)


def test_errors_are_results_and_limits_cut(tiny_model_dir, example):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    bad = '<tool_call>\n{"name": "zoom", "arguments": {"box": "everywhere"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "segment", "arguments": {}}\n</tool_call>'
    scripted(model, processor, [[bad, unknown, "<tool_call>{oops</tool_call>", CALL], [CALL, CALL, CALL, CALL]])
    config = settings("rollout.max_turns=4")
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(config))
    errors, spam = rollout.trajectories
    assert errors.errors == ["bad_arguments", "unknown_tool", "malformed"]
    assert errors.turns[1].text.count("error: ") == 1 and errors.cut  # a call in the last turn: no answer
    assert len(spam.calls) == 4 and spam.errors == [] and spam.cut and bool(rollout.truncated[1])

    scripted(model, processor, [[CALL, ANSWER], [ANSWER]])
    tight = settings("rollout.max_trajectory_tokens=60")  # the zoomed image alone is more tokens than that
    cut = generate_trajectories(model, processor, [example], ToolBox.from_config(tight))
    assert cut.trajectories[0].cut and [t.role for t in cut.trajectories[0].turns] == ["assistant"]


@pytest.mark.parametrize("arch", ARCHES)
def test_logprobs_of_a_trajectory_equal_a_plain_forward(arch, tiny_model_factory, example):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    plain_generate = model.generate
    scripted(model, processor, [[CALL, ANSWER], ["I see.<answer>4</answer>"]])
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(settings()))
    model.generate = plain_generate
    results = [LogprobScorer(processor, 0.8, True, chunk)(model, rollout)[0] for chunk in (0, 5)]  # (N, T)
    assert (results[0] - results[1]).abs().max() < 1e-6
    for row in range(2):  # each trajectory's text in one processor call, then log-softmax over full logits
        segments = rollout.segments[row]
        text = prompt_text(processor, example) + "".join(
            s.text if not s.model else processor.tokenizer.decode(s.ids, skip_special_tokens=False) for s in segments)
        images = [*example.images, *(im for s in segments for im in s.images)]
        inputs = processor(text=[text], images=[images], return_tensors="pt")
        ids = torch.tensor([i for s in segments for i in s.ids])  # (n,)
        assert torch.equal(inputs["input_ids"][0, -len(ids):], ids)  # the same sequence
        with torch.no_grad():
            logits = model(**inputs).logits[0, -len(ids) - 1:-1].float() / 0.8  # (n, V)
        expected = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)  # (n,)
        mask = rollout.completion_mask[row, :len(ids)].bool()
        assert (results[1][row, :len(ids)][mask] - expected[mask]).abs().max() < 1e-5
        assert (results[1][row, :len(ids)][~mask] == 0).all()


def test_training_on_trajectories_with_tool_calls(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    """Two GRPO steps where half the trajectories zoom first: the step runs end to end, the tool
    statistics are logged, and the weights move."""
    from safetensors.torch import load_file

    from vlmrl.report.tracking import read_metrics
    from vlmrl.rollout import tool_rollout
    from vlmrl.training.trainer import train

    def sample_turn(model, processor, rows, segments, settings):  # row i: zoom first when i is even
        tokens = processor.tokenizer
        stop = stop_token_ids(processor, model)[0]
        first = not any(segments)
        return [Segment(tokens(CALL, add_special_tokens=False).input_ids if first and i % 2 == 0
                        else tokens("a a" if i % 4 else "b a", add_special_tokens=False).input_ids + [stop], model=True)
                for i in range(len(rows))]

    monkeypatch.setattr(tool_rollout, "sample_turn", sample_turn)
    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
        f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=40", "rollout.generation_batch_size=2", "rollout.tools=[zoom]",
        "train.micro_batch_size=8", "train.steps=2", "train.lr=1e-2", "train.log_rollouts_every=1",
        "train.trackers=[]", "algorithm.beta=0.1"])
    run = train(config)
    rows = read_metrics(run / "metrics.jsonl")
    assert all(r["tools/calls"] == pytest.approx(0.5) and r["tools/turns"] == pytest.approx(1.5) for r in rows)
    assert all(r["tools/invalid_calls"] == 0 and r["loss"] is not None and r["kl"] is not None for r in rows)

    logged = [json.loads(line) for line in (run / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    zoomed = logged[0]["turns"]
    assert [t["role"] for t in zoomed] == ["assistant", "tool", "assistant"] and len(zoomed[1]["images"]) == 1
    assert (run / "rollouts" / zoomed[1]["images"][0]).is_file()

    from vlmrl.report import write_report

    page = write_report(run).read_text()  # the viewer shows each turn, the zoomed image inline
    data = json.loads(re.search(r'id="rollout-data">(.*?)</script>', page, re.DOTALL).group(1))
    shown = [c["turns"] for s in data["steps"] for g in s["groups"] for c in g["completions"] if len(c["turns"]) == 3]
    assert shown and [t["role"] for t in shown[0]] == ["assistant", "tool", "assistant"]
    assert data["images"][shown[0][1]["images"][0]].startswith("data:image/png;base64,")
    before, after = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


def test_reference_trajectories_run_their_calls(tiny_model_dir, letter_task):
    from letter_task import LookTask

    from vlmrl.rollout.tool_rollout import reference_rollout

    model, processor = load_policy(tiny_model_dir, device="cpu")
    examples = [LookTask().example(i) for i in range(2)]
    stop_ids = stop_token_ids(processor, model)
    rollout = reference_rollout(processor, examples, ToolBox.from_config(settings()), stop_ids)
    assert rollout.texts == ["a a a a", "a a a a"] and not rollout.truncated.any()
    for row in range(2):
        first, tool, last = rollout.segments[row]
        assert first.model and not tool.model and last.model and last.ids[-1] == stop_ids[0]
        assert tool.images[0].size == (448, 448)  # the zoomed corner of the 56 px image
        assert int(rollout.completion_mask[row].sum()) == len(first.ids) + len(last.ids)


def test_sft_learns_reference_trajectories(tmp_path, tiny_model_dir, letter_task):
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training.sft import sft

    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LookTask",
        f"output_dir={tmp_path / 'sft'}", "rollout.tools=[zoom]", "sft.batch_size=4", "train.micro_batch_size=2",
        "train.steps=3", "train.lr=1e-2", "train.trackers=[]"])
    rows = read_metrics(sft(config) / "metrics.jsonl")
    assert len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"]
    assert all((r["tools/calls"], r["tools/invalid_calls"], r["tools/turns"]) == (1.0, 0.0, 2.0) for r in rows)


def test_sft_whose_every_reference_call_fails_says_so_once_and_logs_it(tmp_path, tiny_model_dir, letter_task, capsys):
    """The reference trajectories call zoom, which the run's tools lack: every call is an error result."""
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training.sft import sft

    config = load_config(None, [
        f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LookTask",
        f"output_dir={tmp_path / 'sft'}", "rollout.tools=[zoom_window]", "sft.batch_size=2",
        "train.micro_batch_size=2", "train.steps=2", "train.trackers=[]"])
    rows = read_metrics(sft(config) / "metrics.jsonl")
    assert [(r["tools/calls"], r["tools/invalid_calls"]) for r in rows] == [(1.0, 1.0), (1.0, 1.0)]
    warnings = re.findall(r"warning: sft[^\r\n]*", capsys.readouterr().err)  # after the progress bar's text
    assert warnings == ["warning: sft: every tool call of the reference trajectories failed at step 1 (unknown_tool "
                        "x 2); the model learns from error results: check rollout.tools against the task's "
                        "reference_turns"]


def test_evaluation_with_tools_reports_tool_use_and_keeps_the_turns(tiny_model_dir, letter_task, tmp_path):
    from letter_task import LookTask

    from vlmrl.evaluation.evaluate import EvalSettings, evaluate, format_table, save_evaluation

    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[CALL, "a a"], ["b"], [CALL, CALL, "a"]])
    examples = [LookTask().example(i, split="test") for i in range(3)]
    evaluation = evaluate(model, processor, LookTask(), examples,
                          EvalSettings(batch_size=3, max_new_tokens=40, tools=["zoom"]), show_progress=False)
    tools = evaluation.results["tools"]
    assert tools["calls"] == pytest.approx(1.0) and tools["turns"] == pytest.approx(2.0)
    assert tools["invalid_calls"] == 0 and tools["cut"] == 0
    assert evaluation.results["accuracy"] == pytest.approx(2 / 3)
    assert [t["role"] for t in evaluation.records[0]["turns"]] == ["assistant", "tool", "assistant"]
    assert evaluation.records[0]["turns"][1]["images"] == 1
    assert "tool use per answer" in format_table(evaluation.results)
    assert save_evaluation(evaluation, tmp_path).is_file()


def test_a_turn_ends_at_its_stop_token_or_at_the_end_of_a_call(tiny_model_dir):
    from vlmrl.rollout.tool_rollout import turn_end

    model, processor = load_policy(tiny_model_dir, device="cpu")
    tokens, stop = processor.tokenizer, stop_token_ids(processor, model)
    call = tokens(CALL, add_special_tokens=False).input_ids
    answer = tokens(ANSWER, add_special_tokens=False).input_ids
    assert turn_end(call + answer, stop, tokens) == len(call)  # the call ends the turn
    assert turn_end(answer + [stop[0]] + call, stop, tokens) == len(answer) + 1  # the stop token comes first
    assert turn_end(answer, stop, tokens) == len(answer)  # neither: every token


def test_tool_tags_that_are_special_tokens_stay_in_the_text_and_may_be_sampled(tiny_model_dir):
    """Qwen's tokenizer has <tool_call> and </tool_call> as single added tokens: a turn's text keeps
    them (other special tokens are dropped) and sampling does not ban them."""
    from tokenizers import AddedToken

    from vlmrl.rollout.tool_rollout import tool_tag_ids, turn_text

    _, processor = load_policy(tiny_model_dir, device="cpu")
    tokens = processor.tokenizer
    tokens.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)],
                      special_tokens=True)
    open_id, close_id = tokens.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert tool_tag_ids(tokens) == {open_id, close_id}
    end = tokens.convert_tokens_to_ids("<|im_end|>")
    ids = tokens("Look.", add_special_tokens=False).input_ids
    assert turn_text(tokens, ids + [open_id] + tokens(" {}", add_special_tokens=False).input_ids
                     + [close_id, end]) == "Look.<tool_call> {}</tool_call>"


@pytest.mark.parametrize("arch", [a for a in ARCHES if FAMILIES[a].packing is None])
def test_packed_trajectories_compute_each_prompt_once_with_the_plain_numbers(arch, tiny_model_factory, example):
    """Training on trajectories with train.pack_groups: one forward per group [prompt, trajectory 1,
    trajectory 2, ...]: the plain path's log-probs (1e-5) and gradients, the prompt's image once;
    under the dense mask and with block attention."""
    from vlmrl.models.loading import counting_vision_rows

    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    other = Example(Image.new("RGB", (56, 56), (0, 0, 200)), "Count it.", "1")
    plain_generate = model.generate
    scripted(model, processor, [[CALL, ANSWER], ["I see.<answer>4</answer>"], [CALL, CALL, "<answer>1</answer>"],
                                ["no"]])
    rollout = generate_trajectories(model, processor, [example, other], ToolBox.from_config(settings()))
    model.generate = plain_generate
    model.train()
    results = {}
    for pack, blocks in [(False, False), (True, False), (True, True)]:  # packed: dense mask, then blocks
        model.zero_grad()
        with counting_vision_rows(model) as rows:
            logp, _ = LogprobScorer(processor, 0.8, pack, 5, blocks)(model, rollout)  # (N, T)
        (logp.sum() + (logp ** 2).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[pack, blocks] = (logp.detach(), grads, sum(rows))
    plain, plain_grad, plain_rows = results[False, False]
    for packed, packed_grad, packed_rows in (results[True, False], results[True, True]):
        assert (plain - packed).abs().max() < 1e-5
        assert torch.nn.functional.cosine_similarity(plain_grad, packed_grad, dim=0) >= 0.9999
        assert packed_rows < plain_rows  # each prompt's image once per group, not once per trajectory


def test_under_auto_decoding_later_turns_keep_the_dynamic_cache(tiny_model_dir, example, monkeypatch):
    """A later turn's rows and length are new each time: "auto" compiles only the first turn, whose
    shapes repeat from step to step; a decode path named outright holds for every turn."""
    from vlmrl.rollout import tool_rollout

    model, processor = load_policy(tiny_model_dir, device="cpu")
    decodes = []
    real = tool_rollout.sample

    def spy(model, processor, inputs, settings, suppressed):
        decodes.append(settings.decode)
        return real(model, processor, inputs, settings, suppressed)

    monkeypatch.setattr(tool_rollout, "sample", spy)
    for decode in ("auto", "static"):
        scripted(model, processor, [[CALL, ANSWER], [CALL, CALL, ANSWER]])
        generate_trajectories(model, processor, [example], ToolBox.from_config(settings(f"rollout.decode={decode}",
                                                                                        "rollout.max_turns=3")))
    assert decodes == ["auto", "dynamic", "dynamic", "static", "static", "static"]


@pytest.fixture
def helpers(monkeypatch):
    """tests/tool_helpers.py importable by the tools' import paths (here and in the tool worker)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def tool_call(name: str, **arguments) -> str:
    """The text of a call of `name` with these arguments."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.mark.parametrize("arch", [a for a in ("qwen2_5_vl", "idefics3", "gemma3", "llava") if a in ARCHES])
def test_a_family_s_image_and_control_tokens_in_tool_text_are_defused(arch, tiny_model_factory, example, helpers):
    """A tool writing `<image>` (Idefics3, LLaVA), `<start_of_image>` (Gemma 3), `<|image_pad|>` (Qwen) or
    an end-of-turn token adds no special token to the trajectory: its tool turn holds exactly the special
    tokens of a plain text result, and the model reads the markers broken."""
    from tool_helpers import MARKERS

    from vlmrl.rollout.tool_rollout import family_markers
    from vlmrl.rollout.trajectories import tool_turn

    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    scripted(model, processor, [[tool_call("marker_tool"), ANSWER], [ANSWER]])
    rollout = generate_trajectories(model, processor, [example],
                                    ToolBox.from_config(settings("rollout.tools=[tool_helpers:marker_tool]")))
    trajectory, segment = rollout.trajectories[0], rollout.segments[0][1]
    assert [t.role for t in trajectory.turns] == ["assistant", "tool", "assistant"] and trajectory.errors == []
    tokens = processor.tokenizer
    special = {i for i, token in tokens.added_tokens_decoder.items() if token.special} | set(tokens.all_special_ids)
    plain = tool_turn(processor, example, "plain words", [])
    assert [i for i in segment.ids if i in special] == [i for i in plain.ids if i in special]
    response = segment.text.split("<tool_response>")[1].split("</tool_response>")[0]
    own = family_markers(processor) & set(MARKERS.split())  # the family's markers the tool wrote
    assert own and not [m for m in own if m in response] and all(f"{m[0]} {m[1:]}" in response.replace("| >", "|>")
                                                                 for m in own)


def test_a_tool_drawing_on_the_example_image_leaves_the_prompt_image_as_it_was(tiny_model_dir, helpers):
    """The prompt image the model trains on is the tool's context image (no separate original): the
    tool draws on its copy."""
    image = Image.new("RGB", (56, 56), (0, 0, 200))
    example = Example(image, "What colour?", "blue")
    before = image.tobytes()
    model, processor = load_policy(tiny_model_dir, device="cpu")
    scripted(model, processor, [[tool_call("draw_tool"), ANSWER], [ANSWER]])
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(
        settings("rollout.tools=[tool_helpers:draw_tool]")))
    (drawn,) = rollout.trajectories[0].turns[1].images
    assert drawn.getcolors() == [(56 * 56, (0, 0, 0))]  # the tool's own copy, painted
    assert example.images[0].tobytes() == before and example.originals[0].tobytes() == before


def test_odd_tool_results_become_turns_the_processor_and_the_rollout_log_take(tiny_model_dir, example, helpers,
                                                                                tmp_path):
    """A 2 x 1000 strip (beyond Qwen's aspect limit), CMYK and F images, and text with a lone surrogate:
    each is a tool turn the processor encodes and the rollout log stores."""
    from vlmrl.report.rollout_log import store_image

    model, processor = load_policy(tiny_model_dir, device="cpu")
    calls = [tool_call("strip_tool", width=2, height=1000), tool_call("mode_tool", mode="CMYK"),
             tool_call("mode_tool", mode="F"), tool_call("surrogate_tool")]
    scripted(model, processor, [[*calls, ANSWER], [ANSWER]])
    tools = "rollout.tools=[tool_helpers:strip_tool,tool_helpers:mode_tool,tool_helpers:surrogate_tool]"
    rollout = generate_trajectories(model, processor, [example], ToolBox.from_config(
        settings("rollout.max_turns=5", "rollout.max_new_tokens=2000", tools)))
    trajectory = rollout.trajectories[0]
    assert [t.role for t in trajectory.turns] == ["assistant", "tool"] * 4 + ["assistant"] and trajectory.errors == []
    shown = [t.images for t in trajectory.turns if t.role == "tool"]
    assert [[(i.mode, i.size) for i in images] for images in shown] == [
        [("RGB", (50, 1000))], [("RGB", (28, 28))], [("RGB", (28, 28))], []]
    assert "left ? right" in trajectory.turns[7].text
    assert all((tmp_path / store_image(tmp_path, i)).is_file() for images in shown for i in images)


def test_a_cpu_bound_tool_in_a_rollout_is_an_error_turn_at_its_timeout(tiny_model_dir, example, helpers, tmp_path):
    """A tool that computes forever costs the step its timeout (0.5 s), not the rest of the run."""
    import time

    model, processor = load_policy(tiny_model_dir, device="cpu")
    box = ToolBox.from_config(settings("rollout.tools=[tool_helpers:busy_tool,tool_helpers:pid_tool]",
                                       "rollout.tool_timeout_s=0.5"))
    scripted(model, processor, [[tool_call("pid_tool"), ANSWER], [ANSWER]])
    generate_trajectories(model, processor, [example], box)  # the worker started
    scripted(model, processor, [[tool_call("busy_tool", pid_file=str(tmp_path / "pid")), ANSWER], [ANSWER]])
    start = time.perf_counter()
    rollout = generate_trajectories(model, processor, [example], box)
    assert time.perf_counter() - start < 3.0
    trajectory = rollout.trajectories[0]
    assert trajectory.errors == ["timeout"] and rollout.texts == [ANSWER, ANSWER]
    assert "error: tool busy_tool ran past its 0.5 s limit and was stopped" in trajectory.turns[1].text
