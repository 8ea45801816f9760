"""`vlmrl compare` (study.py, report/compare.py): the study file checked, the grid run in processes
(resumable, failures named), and the comparison's numbers computed by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from vlmrl import study as study_module
from vlmrl.cli import main
from vlmrl.errors import VlmrlError
from vlmrl.report.compare import ArmResult, SeedRun, markdown, table_rows
from vlmrl.study import load_study, plan

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def letter_config(tmp_path, tiny_model_dir) -> Path:
    """A one-file config of a tiny run of the letter task (2 prompts x G=2, 4 tokens, eval every 2)."""
    return write(tmp_path / "letters.yaml", f"""
model: {{name_or_path: {tiny_model_dir}, device: cpu}}
task: {{name: "letter_task:LetterTask"}}
rollout: {{prompts_per_step: 2, group_size: 2, generation_batch_size: 2, max_new_tokens: 4}}
train: {{steps: 2, lr: 0.01, trackers: [], log_rollouts_every: 0, micro_batch_size: 4}}
sft: {{batch_size: 2}}
eval: {{every: 2, n: 2, batch_size: 2, max_new_tokens: 4}}
""")


def study_file(tmp_path: Path, config: Path, arms: str, extra: str = "") -> Path:
    return write(tmp_path / "study.yaml", f"output_dir: {tmp_path / 'study'}\nseeds: [0, 1]\nparallel: 2\n"
                                          f"{extra}arms:\n{arms}")


def test_the_study_file_is_checked(tmp_path, letter_config):
    good = "  - {name: grpo, config: %s}\n" % letter_config
    with pytest.raises(VlmrlError, match="unknown study key 'seed'; did you mean seeds"):
        load_study(write(tmp_path / "a.yaml", f"seed: 1\narms:\n{good}"))
    with pytest.raises(VlmrlError, match="arm names must differ"):
        load_study(write(tmp_path / "b.yaml", f"arms:\n{good}{good}"))
    with pytest.raises(VlmrlError, match="study config file 'nowhere.yaml' does not exist"):
        load_study(write(tmp_path / "c.yaml", "arms:\n  - {name: x, config: nowhere.yaml}\n"))
    with pytest.raises(VlmrlError, match="command must be train or sft"):
        load_study(write(tmp_path / "d.yaml", f"arms:\n  - {{name: x, command: eval, config: {letter_config}}}\n"))
    uses_warm = f"arms:\n  - {{name: x, config: {letter_config}, overrides: ['model.name_or_path={{warm_start}}']}}\n"
    with pytest.raises(VlmrlError, match="uses {warm_start} but the study has no warm_start"):
        plan(load_study(write(tmp_path / "e.yaml", uses_warm)))
    warm_in_common = (f"common: ['model.name_or_path={{warm_start}}']\n"
                      f"warm_start: {{command: sft, config: {letter_config}}}\narms:\n{good}")
    with pytest.raises(VlmrlError, match="cannot be in common or in the warm start's own overrides"):
        plan(load_study(write(tmp_path / "f.yaml", warm_in_common)))


def test_a_run_with_a_checkpoint_resumes_and_a_finished_one_is_done(tmp_path, letter_config):
    study = load_study(study_file(tmp_path, letter_config, "  - {name: grpo, config: %s}\n" % letter_config))
    _, grid = plan(study)
    assert [run.name for run in grid] == ["grpo/seed_0", "grpo/seed_1"]
    run = grid[1]
    assert run.argv(study, "")[-2:] == [f"output_dir={run.folder}", "seed=1"]
    (run.folder / "checkpoints" / "step_000001").mkdir(parents=True)
    assert run.argv(study, "")[-1] == "resume=true" and not run.finished
    (run.folder / "final").mkdir()
    (run.folder / "metrics.jsonl").write_text("")
    assert run.finished


def test_a_small_study_runs_resumes_and_reports(tmp_path, letter_config, monkeypatch, capsys):
    """2 arms (GRPO, more SFT) x 2 seeds after a shared SFT warm start, 2 processes at a time; then a
    third arm that fails is named with its log while the report keeps the others."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]))
    arms = (f"  - {{name: grpo, config: {letter_config}, overrides: ['model.name_or_path={{warm_start}}']}}\n"
            f"  - {{name: more-sft, command: sft, config: {letter_config}, overrides: [train.steps=3]}}\n")
    warm = f"warm_start: {{command: sft, config: {letter_config}, overrides: [train.steps=1]}}\n"
    path = study_file(tmp_path, letter_config, arms, warm)
    assert main(["compare", str(path)]) == 0
    root = tmp_path / "study"
    assert f"done: {root / 'compare.html'}" in capsys.readouterr().out
    table = (root / "compare.md").read_text().splitlines()
    assert table[0].startswith("| arm | runs | held-out accuracy") and len(table) == 4
    assert table[2].startswith("| grpo | 2 | ") and table[3].startswith("| more-sft | 2 | ")
    assert "| 2 |" in table[2] and "| 3 |" in table[3]  # each arm's steps
    saved = yaml.safe_load((root / "grpo" / "seed_1" / "config.yaml").read_text())
    assert saved["seed"] == 1 and saved["model"]["name_or_path"] == str(root / "warm_start" / "final")
    page = (root / "compare.html").read_text()
    assert "eval/test/accuracy vs step" in page and "reward vs training seconds" in page and 'class="band"' in page

    def not_again(*args, **kwargs):
        raise AssertionError("a finished run was started again")

    monkeypatch.setattr(study_module, "start", not_again)
    assert main(["compare", str(path)]) == 0  # everything finished: nothing runs, the report is rewritten
    monkeypatch.undo()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]))
    broken = arms + f"  - {{name: broken, config: {letter_config}, overrides: [train.lr=-1]}}\n"
    assert main(["compare", str(study_file(tmp_path, letter_config, broken, warm))]) == 2
    err = capsys.readouterr().err
    assert "error: 2 of 6 runs failed: broken/seed_0 (exit 2; see" in err and "run.log" in err
    assert "train.lr must be >= 0" in (root / "broken" / "seed_0" / "run.log").read_text()
    assert "| broken | 0 (2 missing) | n/a |" in (root / "compare.md").read_text()


def rows(accuracy: list[float | None], reward: list[float], seconds: float) -> list[dict]:
    out = []
    for step, (acc, rew) in enumerate(zip(accuracy, reward), start=1):
        row = {"step": step, "reward": rew, "seconds": seconds}
        if acc is not None:
            row["eval/test/accuracy"] = acc
        out.append(row)
    return out


def test_the_comparison_numbers_by_hand():
    arm = ArmResult("grpo", [SeedRun(0, rows([None, 0.5], [0.1, 0.3], 2.0)),
                             SeedRun(1, rows([None, 0.7], [0.2, 0.5], 4.0))], missing=[2])
    # accuracy at the last evaluation: 0.5 and 0.7 -> mean 60.0%, sample std 14.1%
    line = markdown(table_rows([arm], "test")).splitlines()[2]
    assert line == "| grpo | 2 (1 missing) | 60.0% ± 14.1% | 0: 50.0%, 1: 70.0% | 0.400 | 2 | 6 s |"
    by_step = arm.curve("reward", against_clock=False)
    assert (by_step.steps, by_step.values, by_step.low, by_step.high) == ([1.0, 2.0], [0.15000000000000002, 0.4],
                                                                          [0.1, 0.3], [0.2, 0.5])
    by_clock = arm.curve("reward", against_clock=True)
    assert by_clock.steps == [3.0, 6.0]  # the seeds' mean cumulative seconds: (2 + 4) / 2, (4 + 8) / 2


def test_the_shipped_study_plans_its_grid():
    study = load_study(TESTS.parent / "studies" / "shapes_rl_vs_sft.yaml")
    warm, grid = plan(study)
    assert warm is not None and len(grid) == 7 * 3
    assert [arm.name for arm in study.arms] == ["sft-equal-time", "sft-longer", "grpo", "dapo", "dr-grpo", "gspo",
                                                "cispo"]
    assert all("seed=" in run.argv(study, "w")[-1] for run in grid)
