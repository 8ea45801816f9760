"""`vlmrl report`: a self-contained, escaped HTML page from a run directory the test writes itself."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from vlmrl.cli import main
from vlmrl.errors import VlmrlError
from vlmrl.report import write_report
from vlmrl.report.charts import build_charts
from vlmrl.report.rollouts import MAX_STEPS, pick_steps
from vlmrl.report.rundir import read_run_dir
from vlmrl.report.svg import PALETTE

HOSTILE_COMPLETION = "<think>count</think><script>alert(1)</script><answer>3</answer>"
HOSTILE_PROMPT = "How many circles? </script><img src=x onerror=alert(2)>"
HOSTILE_ANSWER = "3 & <b>bold</b>"


def make_run_dir(root: Path, steps: int = 40, rollout_every: int = 10, groups: int = 3, group_size: int = 4,
                 with_evals: bool = True) -> Path:
    """A run directory as the trainer writes it: config, metrics, rollouts with images, eval, alarms."""
    run = root / "run-a"
    (run / "rollouts" / "images").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "task:\n  name: shapes\nmodel:\n  name_or_path: runs/<tiny>-model\n"
        "rollout:\n  prompts_per_step: 3\n  group_size: 4\nalgorithm:\n  beta: 0.04\n")
    rows = []
    for step in range(1, steps + 1):
        t = step / steps
        row = {"step": step, "reward": 0.2 + 0.6 * t, "reward_std": 0.3, "accuracy": 0.1 + 0.7 * t,
               "reward/format": min(1.0, 0.5 + t), "reward/accuracy_gate": 0.6 * t,
               "loss": 0.1 * math.cos(step), "kl": 1e-4 * 10 ** (2 * t), "completion_length": 40 - 10 * t,
               "truncated": 0.1 * (1 - t), "grad_norm": 1 + 0.1 * math.sin(step), "lr": 1e-6,
               "seconds": 1.5, "time/generate": 1.0, "time/train": 0.4, "tokens_per_s": 800 + step,
               "adv/mean": 0.0, "adv/std": 0.9, "clip_fraction": None}
        if step % 10 == 0 and with_evals:  # the trainer's held-out eval every 10 steps
            row |= {"eval/test/accuracy": 0.05 + 0.6 * t, "eval/test/reward/format": 0.9,
                    "eval/test/completion_tokens": 30.0}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 41, "rew')

    for index in range(groups):
        image = Image.new("RGB", (96, 96), "white")
        draw = ImageDraw.Draw(image)
        for k in range(index + 1):
            draw.ellipse((8 + 28 * k, 30, 30 + 28 * k, 52), fill="#1f5fbf")
        image.save(run / "rollouts" / "images" / f"img{index}.png")
    for step in range(rollout_every, steps + 1, rollout_every):
        lines = []
        for group in range(groups):
            for g in range(group_size):
                total = 2.0 * (g == 0) + (g == 1)
                lines.append({"step": step, "group": group, "image": f"images/img{group}.png",
                              "prompt": HOSTILE_PROMPT if group == 0 else f"How many circles? ({step}.{group})",
                              "answer": HOSTILE_ANSWER if group == 0 else str(group + 1),
                              "completion": HOSTILE_COMPLETION if g == 1 else f"<answer>{g}</answer>",
                              "rewards": {"total": total, "accuracy": float(g == 0), "format": 1.0},
                              "advantage": total - 0.75, "truncated": g == 3, "length": 10 + g})
        (run / "rollouts" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if with_evals:
        (run / "evals").mkdir()
        for step, accuracy in [(20, 0.35), (40, 0.65)]:  # only the newest is shown
            (run / "evals" / f"step_{step:06d}_test.json").write_text(json.dumps(
                {"results": {"task": "shapes", "n": 64, "accuracy": accuracy, "rewards": {"format": 0.9}},
                 "settings": {"seed": 0}, "examples": [{"completion": "<i>x</i>"}]}))
        (run / "final").mkdir()
        (run / "final" / "eval_shapes_ood.json").write_text(json.dumps(  # from `vlmrl eval`
            {"results": {"task": "shapes", "n": 64, "accuracy": 0.41, "pass_at_k": {"k": 4, "pass@4": 0.8},
                         "blind": {"blank": {"accuracy": 0.2, "drop": 0.21}, "shuffled": None}},
             "settings": {"batch_size": 16}}))
    (run / "alarms.jsonl").write_text(json.dumps(
        {"step": 25, "kind": "kl_spike", "message": "KL rose 100x over its median <script>alert(3)</script>"}) + "\n")
    return run


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return make_run_dir(tmp_path)


def test_report_is_one_self_contained_file(run_dir):
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    page = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page must fetch nothing"
    assert "<link" not in page and "@import" not in page
    assert page.count("data:image/png;base64,") == 3  # one per distinct image, though 4 steps use them
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # the fixed panels first, then the other keys by prefix
    titles = re.findall(r"<figcaption>([^<]*)", page)
    assert titles == ["Reward (mean over completions; per component)",
                      "Accuracy: training samples and held-out eval", "KL to the reference (log scale)",
                      "Completion length (tokens)", "Truncated share of completions", "Time per step (s)",
                      "Loss", "Held-out reward (per component)", "grad_norm", "tokens_per_s"]
    assert ("Constant throughout: reward_std <b>0.3</b> · lr <b>1e-06</b> · adv/mean <b>0</b> · "
            "adv/std <b>0.9</b>") in page
    assert "clip_fraction" not in page  # only ever null: nothing to plot
    tables = re.findall(r"<h3>([^<]*)</h3><table>(.*?)</table>", page)
    assert [name for name, _ in tables] == ["evals/step_000040_test.json", "final/eval_shapes_ood.json"]
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", rows) for _, rows in tables]
    assert cells[0] == ["accuracy", "0.65", "n", "64", "rewards.format", "0.9"]
    assert cells[1] == ["accuracy", "0.41", "pass_at_k.pass@4", "0.8", "blind.blank.accuracy", "0.2",
                        "n", "64", "pass_at_k.k", "4", "blind.blank.drop", "0.21"]
    assert "1 unreadable JSONL lines were skipped" in page


def test_every_model_and_dataset_string_is_escaped(run_dir):
    page = write_report(run_dir).read_text()
    own_scripts = re.findall(r"<script\b[^>]*>", page)
    assert own_scripts == ['<script type="application/json" id="rollout-data">', "<script>"]
    for raw in ("<script>alert", "<img src=x", "<b>bold", "<i>x</i>", "<tiny>"):
        assert raw not in page, raw
    assert "KL rose 100x over its median &lt;script&gt;alert(3)&lt;/script&gt;" in page
    assert "runs/&lt;tiny&gt;-model" in page
    data = json.loads(re.search(r'id="rollout-data">(.*?)</script>', page, re.DOTALL).group(1))
    completions = [c["text"] for s in data["steps"] for g in s["groups"] for c in g["completions"]]
    assert HOSTILE_COMPLETION in completions  # intact after JSON.parse: shown as text, not lost


def test_viewer_data_ranks_completions_and_marks_best_and_worst(run_dir):
    page = write_report(run_dir).read_text()
    data = json.loads(re.search(r'id="rollout-data">(.*?)</script>', page, re.DOTALL).group(1))
    assert [s["step"] for s in data["steps"]] == [10, 20, 30, 40]
    group = data["steps"][0]["groups"][0]
    assert [c["rewards"]["total"] for c in group["completions"]] == [2.0, 1.0, 0.0, 0.0]
    assert [c["mark"] for c in group["completions"]] == ["best", "", "", "worst"]
    assert [c["advantage"] for c in group["completions"]] == [1.25, 0.25, -0.75, -0.75]
    assert group["prompt"] == HOSTILE_PROMPT and group["answer"] == HOSTILE_ANSWER
    assert group["mean"] == 0.75 and group["signal"] is True
    assert data["images"][group["image"]].startswith("data:image/png;base64,")


def test_rollout_steps_are_capped_evenly_with_first_and_last(tmp_path):
    assert pick_steps([5, 10], 24) == [5, 10]
    picked = pick_steps(list(range(1, 101)), 24)
    assert len(picked) == 24 and picked[0] == 1 and picked[-1] == 100 and picked == sorted(set(picked))
    run = make_run_dir(tmp_path, steps=200, rollout_every=2, groups=2, group_size=2, with_evals=False)
    page = write_report(run).read_text()
    data = json.loads(re.search(r'id="rollout-data">(.*?)</script>', page, re.DOTALL).group(1))
    assert len(data["steps"]) == MAX_STEPS and data["steps_total"] == 100
    assert f"{MAX_STEPS} of 100 logged steps" in page
    assert len(page) < 400_000  # 200 steps of 17 metrics and 24 rollout steps


def test_kl_chart_is_log_scale_and_accuracy_holds_train_and_eval(run_dir):
    run = read_run_dir(run_dir)
    charts = {c.title: c for c in build_charts(run.metrics)}
    kl = charts["KL to the reference (log scale)"]
    assert kl.log_y and [s.name for s in kl.series] == ["kl"]
    accuracy = charts["Accuracy: training samples and held-out eval"]
    assert [s.name for s in accuracy.series] == ["accuracy", "eval/test/accuracy"]
    assert accuracy.series[1].steps == [10.0, 20.0, 30.0, 40.0] and accuracy.y_range == (0.0, 1.0)
    assert [s.name for s in charts["Reward (mean over completions; per component)"].series] == [
        "reward", "reward/format", "reward/accuracy_gate"]
    assert [s.name for s in charts["Held-out reward (per component)"].series] == ["eval/test/reward/format"]
    assert [s.name for s in charts["Completion length (tokens)"].series] == [
        "completion_length", "eval/test/completion_tokens"]


def test_missing_or_empty_run_dir_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(VlmrlError, match="does not exist"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no metrics.jsonl rows" in err
    assert len(err.strip().splitlines()) == 1


def test_report_command_writes_to_out(run_dir, tmp_path, capsys):
    out = tmp_path / "elsewhere" / "r.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert out.is_file() and not (run_dir / "report.html").exists()
    assert str(out) in capsys.readouterr().out


# --------------------------------------------------------------------------- in a real browser


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    message = "no chromium binary on PATH (apt-get install chromium)"
    if os.environ.get("VLMRL_REQUIRE_BROWSER") or os.environ.get("CI"):
        pytest.fail(f"{message}: CI requires the browser tests (.ci/run installs it)")
    pytest.skip(f"{message}: browser test skipped")


def _open_in_chromium(url: str, profile: Path, screenshot: Path | None = None) -> tuple[str, list[str]]:
    """(the DOM after scripts ran, the browser console's lines) for `url` in headless Chromium."""
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
               "--window-size=1280,2200", "--virtual-time-budget=2000", "--dump-dom", url]
    if screenshot is not None:
        command.append(f"--screenshot={screenshot}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    return result.stdout, [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def test_page_loads_in_headless_chromium_without_console_errors(run_dir, tmp_path):
    _chromium()
    page = write_report(run_dir)
    shot = tmp_path / "report.png"
    dom, console = _open_in_chromium(page.as_uri(), tmp_path / "profile", screenshot=shot)
    assert console == [], "\n".join(console)  # no errors, no CSP violations, no logging at all
    # The viewer ran: the latest step's first group, the hostile strings in it as text nodes.
    assert '<option value="3">step 40</option>' in dom and "group 1 of 3" in dom
    assert 'class="completion best"' in dom and "advantage +1.25" in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and "<script>alert(1)" not in dom
    assert "&lt;img src=x onerror=alert(2)&gt;" in dom
    _assert_plots_drawn(shot)


def test_viewer_opens_at_the_step_and_group_in_the_address(run_dir, tmp_path):
    _chromium()
    page = write_report(run_dir)
    dom, console = _open_in_chromium(page.as_uri() + "#step=20&group=2", tmp_path / "profile")
    assert console == [], "\n".join(console)
    assert "group 2 of 3" in dom and "How many circles? (20.1)" in dom
    assert "advantage +1.25" in dom


def _assert_plots_drawn(shot: Path) -> None:
    """The screenshot holds many pixels of the first two series colours: the plots were drawn."""
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=int)  # (H, W, 3)

    def near(colour: str) -> int:
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(pixels - rgb).max(axis=-1) < 40).sum())

    blue, vermillion = near(PALETTE[0]), near(PALETTE[1])
    assert blue > 2000 and vermillion > 500, (blue, vermillion)


def test_a_long_band_is_drawn_with_at_most_max_points_a_side():
    from vlmrl.report.svg import MAX_POINTS, Chart, Series, render_chart

    steps = [float(i) for i in range(20 * MAX_POINTS)]
    series = Series("arm", steps, [0.5] * len(steps), [0.4] * len(steps), [0.6] * len(steps))
    band = render_chart(Chart("accuracy", [series])).split('class="band" d="')[1].split('"')[0]
    assert band.count("L") + band.count("M") <= 2 * MAX_POINTS
