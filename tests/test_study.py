"""`vlmrl compare` (study/compare.py, report/compare.py): the study file checked, the grid run in processes
(resumable, failures named), and the comparison's numbers computed by hand."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from vlmrl.study import compare as study_module
from vlmrl.study import processes as study_processes
from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.report.compare import ArmResult, SeedRun, header, markdown, table_rows
from vlmrl.report.tracking import read_metrics
from vlmrl.safety.checkpoint import read_checkpoint
from vlmrl.study.compare import Run, check_runs, load_study, plan, record_specs, spec_changes
from vlmrl.training.trainer import train

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
    with pytest.raises(VlmrlError, match="the names of the arms and before runs must differ"):
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
    with pytest.raises(VlmrlError, match=r"^\{warm_start\} is the warm start's final model, not made before the warm "
                                        r"start that uses it: it cannot be in common \(which applies to every run\)"):
        plan(load_study(write(tmp_path / "f.yaml", warm_in_common)))


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/abs", ".hidden", "", "x" * 101, "a\\b", "tab\\tname"])
def test_an_arm_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, letter_config, name):
    arms = f"arms:\n  - {{name: {json.dumps(name)}, config: {letter_config}}}\n"
    with pytest.raises(VlmrlError) as refused:
        load_study(write(tmp_path / "s.yaml", arms))
    assert str(refused.value) == ("an arm's name must be a plain folder name (letters, digits, . _ - + = @ ,; at most "
                                  f"100, not starting with '.'); got {json.loads(json.dumps(name))!r}")


@pytest.mark.parametrize("name", ["compare.html", "compare.md", "warm_start", "Compare.HTML"])
def test_an_arm_named_like_the_studys_own_output_is_refused(tmp_path, letter_config, name):
    with pytest.raises(VlmrlError) as refused:
        load_study(write(tmp_path / "s.yaml", f"arms:\n  - {{name: {name}, config: {letter_config}}}\n"))
    assert str(refused.value) == (f"arm name {name!r} is taken by the study's own output (compare.html, compare.md, "
                                  "warm_start): rename it")
    same_but_case = f"arms:\n  - {{name: grpo, config: {letter_config}}}\n  - {{name: GRPO, config: {letter_config}}}\n"
    with pytest.raises(VlmrlError, match=r"the names of the arms and before runs must differ \(also in case: some disks ignore it\); got \['grpo', 'GRPO'\]"):
        load_study(write(tmp_path / "t.yaml", same_but_case))
    assert load_study(write(tmp_path / "u.yaml", f"arms:\n  - {{name: dr-grpo_1.5e-4+x, config: {letter_config}}}\n"))


def test_config_paths_are_found_next_to_the_study_file_then_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "studies" / "configs").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    write(tmp_path / "studies" / "configs" / "near.yaml", "seed: 1\n")
    write(tmp_path / "configs" / "cwd.yaml", "seed: 2\n")
    write(tmp_path / "configs" / "near.yaml", "seed: 3\n")  # the study folder's wins
    path = write(tmp_path / "studies" / "s.yaml", "arms:\n  - {name: a, config: configs/near.yaml}\n"
                                                 "  - {name: b, config: configs/cwd.yaml}\n")
    monkeypatch.chdir(tmp_path)
    study = load_study(Path("studies/s.yaml"))
    assert [arm.config for arm in study.arms] == ["studies/configs/near.yaml", "configs/cwd.yaml"]
    monkeypatch.chdir(tmp_path / "configs")  # next to the study file is found from anywhere
    path.write_text("arms:\n  - {name: a, config: configs/near.yaml}\n")
    assert load_study(path).arms[0].config == str(tmp_path / "studies" / "configs" / "near.yaml")
    with pytest.raises(VlmrlError) as missing:
        load_study(write(tmp_path / "studies" / "t.yaml", "arms:\n  - {name: a, config: nowhere.yaml}\n"))
    assert str(missing.value) == (f"study config file 'nowhere.yaml' does not exist (looked in {tmp_path / 'studies'} "
                                  "and in the working directory)")


def test_every_runs_config_is_checked_before_the_first_run(tmp_path, letter_config, capsys):
    arms = (f"  - {{name: grpo, config: {letter_config}, overrides: ['model.name_or_path={{warm_start}}']}}\n"
            f"  - {{name: broken, config: {letter_config}, overrides: [train.lr=-1]}}\n")
    warm = f"warm_start: {{command: sft, config: {letter_config}, overrides: [train.steps=1]}}\n"
    assert main(["compare", str(study_file(tmp_path, letter_config, arms, warm))]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: arm 'broken' ({letter_config}): train.lr must be >= 0; got -1.0\n")
    assert sorted(path.name for path in (tmp_path / "study").iterdir()) == [".lock"]  # no warm start, no run
    assert main(["compare", str(study_file(tmp_path, letter_config, arms, warm.replace("steps=1", "stepz=1")))]) == 2
    assert "error: the warm start (" in capsys.readouterr().err


def test_parallel_times_threads_over_the_cores_is_said(tmp_path, letter_config, monkeypatch, capsys):
    study = load_study(study_file(tmp_path, letter_config, "  - {name: a, config: %s}\n" % letter_config,
                                  "threads: 3\n"))
    monkeypatch.setattr(study_module, "usable_cores", lambda: 4)
    study_module.warn_if_oversubscribed(study)
    assert capsys.readouterr().err == ("warning: parallel 2 x threads 3 = 6 threads on 4 cores: the runs slow each other "
                                       "down, and the table's training times with them; lower parallel or threads\n")
    study.threads = 2
    study_module.warn_if_oversubscribed(study)
    assert capsys.readouterr().err == ""


def finish(run) -> None:
    """Make `run` look finished, as a run that ended leaves its folder."""
    (run.folder / "final").mkdir(parents=True)
    (run.folder / "metrics.jsonl").write_text('{"step": 1}\n')


def test_an_edited_arm_or_warm_start_is_refused_never_reused(tmp_path, letter_config):
    warm = f"warm_start: {{command: sft, config: {letter_config}, overrides: [train.steps=1]}}\n"
    arms = f"  - {{name: grpo, config: {letter_config}, overrides: ['model.name_or_path={{warm_start}}', train.lr=0.01]}}\n"

    def checked(arms_text: str = arms, warm_text: str = warm):
        study = load_study(study_file(tmp_path, letter_config, arms_text, warm_text))
        prepared, grid = plan(study)
        return prepared, grid, check_runs(study, prepared, grid)

    prepared, grid, specs = checked()
    record_specs([*prepared, *grid], specs)
    for run in [*prepared, *grid]:
        finish(run)
    assert checked()[2] == specs  # the same study again: nothing to refuse
    root = tmp_path / "study"
    remedy = f"to keep those runs, give the study another output_dir; to run it again, delete {root / 'grpo'}"
    with pytest.raises(VlmrlError) as edited:
        checked(arms.replace("train.lr=0.01", "train.lr=0.02"))
    assert str(edited.value) == f"arm 'grpo' changed since {root / 'grpo' / 'seed_0'} was made (train.lr: 0.01 -> 0.02): {remedy}"
    letter_config.write_text(letter_config.read_text().replace("max_new_tokens: 4}", "max_new_tokens: 5}"))
    with pytest.raises(VlmrlError, match=r"^the warm start changed since .* \(eval.max_new_tokens: 4 -> 5; "
                                         r"rollout.max_new_tokens: 4 -> 5\)"):  # the config file edited
        checked()
    letter_config.write_text(letter_config.read_text().replace("max_new_tokens: 5}", "max_new_tokens: 4}"))
    with pytest.raises(VlmrlError) as warm_edited:
        checked(warm_text=warm.replace("steps=1", "steps=2"))
    assert str(warm_edited.value) == (
        f"the warm start changed since {root / 'warm_start'} was made (train.steps: 1 -> 2): to keep those runs, give "
        f"the study another output_dir; to run it again, delete {root / 'warm_start'} and the folders of the runs that "
        "use it")
    shutil.rmtree(root / "warm_start")  # the warm start will be made again: the arm made from the old one is refused
    with pytest.raises(VlmrlError, match=r"^arm 'grpo' changed since .* \(the warm start it starts from\)"):
        checked(warm_text=warm.replace("steps=1", "steps=2"))
    for seed in (0, 1):  # a run with no checkpoint and no final model starts anew
        shutil.rmtree(root / "grpo" / f"seed_{seed}" / "final")
    checked(warm_text=warm.replace("steps=1", "steps=2"))
    (root / "grpo" / "seed_0" / "checkpoints" / "step_000001").mkdir(parents=True)
    (root / "grpo" / "seed_0" / "study_spec.json").unlink()
    with pytest.raises(VlmrlError, match=r"holds a run with no readable record of its spec \(study_spec.json; made by"):
        checked(warm_text=warm.replace("steps=1", "steps=2"))
    (root / "grpo" / "seed_0" / "study_spec.json").write_text("{not json")
    with pytest.raises(VlmrlError, match=r"holds a run with no readable record of its spec"):
        checked(warm_text=warm.replace("steps=1", "steps=2"))


def test_before_runs_are_checked(tmp_path, letter_config):
    warm = f"warm_start: {{command: sft, config: {letter_config}}}\n"
    arm = f"  - {{name: grpo, config: {letter_config}, overrides: ['algorithm.teacher={{teacher}}']}}\n"

    def before(*runs: tuple[str, str]) -> str:
        return "before:\n" + "".join(f"  - {{name: {name}, config: {letter_config}, overrides: ['{item}']}}\n"
                                      for name, item in runs)

    def planned(extra: str, arms: str = arm):
        return plan(load_study(study_file(tmp_path, letter_config, arms, extra)))

    prepared, grid = planned(warm + before(("teacher", "model.name_or_path={warm_start}")))
    assert [(run.name, run.folder, run.seed) for run in prepared] == [
        ("warm_start", tmp_path / "study" / "warm_start", None), ("teacher", tmp_path / "study" / "teacher", None)]
    with pytest.raises(VlmrlError) as refused:  # a before run that names itself, or one made after it
        planned(before(("teacher", "algorithm.teacher={judge}"), ("judge", "train.steps=1")))
    assert str(refused.value) == (
        "{judge} is before run 'judge''s final model, not made before before run 'teacher' that uses it: it cannot be "
        "in common (which applies to every run) or in the overrides of before run 'judge' or of a run made before it; "
        "put it in the arms' overrides or in a later before run's")
    with pytest.raises(VlmrlError, match=r"^\{teacher\} is before run 'teacher''s final model"):
        planned("common: ['algorithm.teacher={teacher}']\n" + before(("teacher", "train.steps=1")))
    with pytest.raises(VlmrlError, match="uses {warm_start} but the study has no warm_start"):
        planned(before(("teacher", "model.name_or_path={warm_start}")))
    with pytest.raises(VlmrlError, match=r"^the names of the arms and before runs must differ .* got \['GRPO', 'grpo'\]"):
        planned(before(("GRPO", "train.steps=1")))
    with pytest.raises(VlmrlError) as reserved:
        planned(before(("warm_start", "train.steps=1")))
    assert str(reserved.value) == ("before run name 'warm_start' is taken by the study's own output (compare.html, "
                                   "compare.md, warm_start): rename it")
    with pytest.raises(VlmrlError, match=r"^a before run's name must be a plain folder name"):
        planned(before(("../x", "train.steps=1")))


def test_before_runs_run_in_order_alone_and_their_models_fill_the_overrides(tmp_path, letter_config, monkeypatch):
    """The warm start, then each before run, one at a time with every thread; then the grid, each
    `{name}` its preparatory run's final model."""
    study = load_study(study_file(
        tmp_path, letter_config,
        f"  - {{name: distill, config: {letter_config}, overrides: ['algorithm.teacher={{teacher}}', "
        f"'model.name_or_path={{warm_start}}']}}\n",
        f"threads: 3\nwarm_start: {{command: sft, config: {letter_config}}}\nbefore:\n"
        f"  - {{name: teacher, config: {letter_config}, overrides: ['model.name_or_path={{warm_start}}']}}\n"))
    prepared, grid = plan(study)
    calls = []

    def execute(jobs, parallel, threads, label, stops):
        calls.append(([job.name for job in jobs], parallel, threads, label, jobs[0].argv))
        for job in jobs:
            finish(Run(job.name, None, job.folder, None))
        return [study_processes.Outcome(job, 0) for job in jobs]

    monkeypatch.setattr(study_module, "execute", execute)
    study_module.run_all(study, prepared, grid, "study.yaml")
    root = tmp_path / "study"
    assert [call[:4] for call in calls] == [(["warm_start"], 1, 6, "warm start"), (["teacher"], 1, 6, "teacher"),
                                            (["distill/seed_0", "distill/seed_1"], 2, 3, "study")]
    assert f"model.name_or_path={root / 'warm_start' / 'final'}" in calls[1][4]
    assert {f"algorithm.teacher={root / 'teacher' / 'final'}",
            f"model.name_or_path={root / 'warm_start' / 'final'}"} <= set(calls[2][4])


def test_an_edited_before_run_is_refused_and_so_are_the_runs_that_use_it(tmp_path, letter_config):
    warm = f"warm_start: {{command: sft, config: {letter_config}, overrides: [train.steps=1]}}\n"
    teacher = (f"before:\n  - {{name: teacher, config: {letter_config}, "
               f"overrides: ['model.name_or_path={{warm_start}}', train.steps=1]}}\n")
    arms = (f"  - {{name: distill, config: {letter_config}, overrides: ['algorithm.teacher={{teacher}}']}}\n"
            f"  - {{name: plain, config: {letter_config}}}\n")

    def checked(warm_text: str = warm, teacher_text: str = teacher):
        study = load_study(study_file(tmp_path, letter_config, arms, warm_text + teacher_text))
        prepared, grid = plan(study)
        return prepared, grid, check_runs(study, prepared, grid)

    prepared, grid, specs = checked()
    assert "before" not in specs["teacher"] and specs["teacher"]["warm_start"] is not None
    assert specs["distill/seed_0"]["warm_start"] is None and list(specs["distill/seed_0"]["before"]) == ["teacher"]
    record_specs([*prepared, *grid], specs)
    for run in [*prepared, *grid]:
        finish(run)
    assert checked()[2] == specs
    root = tmp_path / "study"
    with pytest.raises(VlmrlError) as edited:
        checked(teacher_text=teacher.replace("steps=1", "steps=2"))
    assert str(edited.value) == (
        f"before run 'teacher' changed since {root / 'teacher'} was made (train.steps: 1 -> 2): to keep those runs, "
        f"give the study another output_dir; to run it again, delete {root / 'teacher'} and the folders of the runs "
        "that use it")
    shutil.rmtree(root / "teacher")  # made again from the new spec: the arm that uses the old one is refused
    with pytest.raises(VlmrlError, match=r"^arm 'distill' changed since .* \(the run 'teacher' it uses\)"):
        checked(teacher_text=teacher.replace("steps=1", "steps=2"))
    shutil.rmtree(root / "distill")
    checked(teacher_text=teacher.replace("steps=1", "steps=2"))  # the arm that does not use it is kept
    record_specs(checked()[0], checked()[2])
    finish(checked()[0][1])
    shutil.rmtree(root / "warm_start")  # a new warm start makes a new teacher: the teacher's spec says so
    with pytest.raises(VlmrlError, match=r"^before run 'teacher' changed since .* \(the warm start it starts from\)"):
        checked(warm_text=warm.replace("steps=1", "steps=3"))


def test_what_changed_between_two_specs():
    before = {"command": "sft", "config": {"train": {"lr": 0.1, "steps": 5}, "gone": 1}, "warm_start": "abc"}
    after = {"command": "train", "config": {"train": {"lr": 0.2, "steps": 5}, "added": 2}, "warm_start": "abd"}
    assert spec_changes(before, after) == ['command: "sft" -> "train"', "train.lr: 0.1 -> 0.2",
                                           "the warm start it starts from"]  # keys only one spec has: no change


def test_a_second_study_on_a_busy_folder_is_refused(tmp_path, letter_config, held_elsewhere, capsys):
    path = study_file(tmp_path, letter_config, "  - {name: a, config: %s}\n" % letter_config)
    with held_elsewhere(tmp_path / "study") as pid:
        assert main(["compare", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'study'} is in use by another vlmrl compare (process {pid}): "
                                       "wait for it to end or stop it, or use another folder\n")
    with held_elsewhere(tmp_path / "study" / "a" / "seed_1") as pid:  # a trainer left by a killed study
        assert main(["compare", str(path)]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {tmp_path / 'study' / 'a' / 'seed_1'} is in use by another vlmrl run (process {pid}), perhaps of an "
        "earlier study that was killed: wait for it to end or stop it, then run the study again\n")


def test_a_run_with_a_checkpoint_resumes_and_a_finished_one_is_done(tmp_path, letter_config):
    study = load_study(study_file(tmp_path, letter_config, "  - {name: grpo, config: %s}\n" % letter_config))
    _, grid = plan(study)
    assert [run.name for run in grid] == ["grpo/seed_0", "grpo/seed_1"]
    run = grid[1]
    assert run.argv(study, {})[-2:] == [f"output_dir={run.folder}", "seed=1"]
    (run.folder / "checkpoints" / "step_000001").mkdir(parents=True)
    assert run.argv(study, {})[-1] == "resume=true" and not run.finished
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

    monkeypatch.setattr(study_processes, "start", not_again)
    assert main(["compare", str(path)]) == 0  # everything finished: nothing runs, the report is rewritten
    monkeypatch.undo()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]))
    broken = arms + f"  - {{name: broken, config: {letter_config}, overrides: [task.name=letter_task:Missing]}}\n"
    assert main(["compare", str(study_file(tmp_path, letter_config, broken, warm))]) == 2
    err = capsys.readouterr().err
    assert "error: 2 of 6 runs did not finish: broken/seed_0 failed (exit 2; see" in err and "run.log" in err
    assert "Missing" in (root / "broken" / "seed_0" / "run.log").read_text()
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
    line = markdown(header([arm], "test"), table_rows([arm], "test")).splitlines()[2]
    assert line == "| grpo | 2 (1 missing) | 60.0% ± 14.1% | 0: 50.0%, 1: 70.0% | 0.400 | 2 | 6 s |"
    by_step = arm.curve("reward", against_clock=False)
    assert (by_step.steps, by_step.values, by_step.low, by_step.high) == ([1.0, 2.0], [0.15000000000000002, 0.4],
                                                                          [0.1, 0.3], [0.2, 0.5])
    by_clock = arm.curve("reward", against_clock=True)
    assert by_clock.steps == [3.0, 6.0]  # the seeds' mean cumulative seconds: (2 + 4) / 2, (4 + 8) / 2


def test_the_comparison_has_a_column_for_every_other_accuracy_logged():
    first, second = rows([None, 0.5], [0.1, 0.3], 2.0), rows([None, 0.7], [0.2, 0.5], 4.0)
    first[1] |= {"eval/ood/accuracy": 0.25, "eval/test/blank/accuracy": 0.2, "eval/test/reward/accuracy": 0.5}
    second[1] |= {"eval/ood/accuracy": 0.35, "eval/test/blank/accuracy": 0.2}
    arm = ArmResult("grpo", [SeedRun(0, first), SeedRun(1, second)], missing=[])
    columns = header([arm], "test")
    assert columns == ["arm", "runs", "held-out accuracy (mean ± std)", "ood/accuracy", "test/blank/accuracy",
                       "per seed", "final reward", "steps", "training time"]
    # ood: 0.25 and 0.35 -> 30.0% ± 7.1%; blank: 20.0% both -> ± 0.0%
    assert markdown(columns, table_rows([arm], "test")).splitlines()[2] == (
        "| grpo | 2 | 60.0% ± 14.1% | 30.0% ± 7.1% | 20.0% ± 0.0% | 0: 50.0%, 1: 70.0% | 0.400 | 2 | 6 s |")


def test_the_shipped_study_plans_its_grid():
    study = load_study(TESTS.parent / "studies" / "shapes_rl_vs_sft.yaml")
    prepared, grid = plan(study)
    assert [run.name for run in prepared] == ["warm_start"] and len(grid) == 7 * 3
    assert [arm.name for arm in study.arms] == ["sft-equal-time", "sft-longer", "grpo", "dapo", "dr-grpo", "gspo",
                                                "cispo"]
    assert all("seed=" in run.argv(study, {"warm_start": "w"})[-1] for run in grid)


def test_the_weak_teacher_study_plans_its_grid():
    study = load_study(TESTS.parent / "studies" / "shapes_weak_teacher.yaml")
    prepared, grid = plan(study)
    assert [run.name for run in prepared] == ["warm_start"] and len(grid) == 6 * 3
    assert [arm.name for arm in study.arms] == ["sft-equal-time", "sft-longer", "grpo", "dapo", "dr-grpo", "gspo"]
    assert "task.params.teacher_error=0.3" in study.common and "eval.blind_check=true" in study.common
    specs = check_runs(study, prepared, grid)  # every run's config resolves and validates
    assert len(specs) == 1 + 6 * 3


def test_the_distillation_study_plans_its_grid(tmp_path):
    study = load_study(TESTS.parent / "studies" / "distill.yaml")
    study.output_dir = str(tmp_path / "study")  # not the study's own folder: it may be running
    prepared, grid = plan(study)
    assert [run.name for run in prepared] == ["warm_start", "teacher"] and len(grid) == 3 * 3
    assert [arm.name for arm in study.arms] == ["distill", "grpo-distill", "grpo"]
    specs = check_runs(study, prepared, grid)  # every run's config resolves and validates
    teacher = str(Path(study.output_dir) / "teacher" / "final")
    assert [specs[f"{arm}/seed_0"]["config"]["algorithm"]["teacher"] for arm in ("distill", "grpo-distill", "grpo")] \
        == [teacher, teacher, ""]
    assert specs["teacher"]["config"]["seed"] not in study.seeds


def test_the_losses_study_plans_its_grid(tmp_path):
    study = load_study(TESTS.parent / "studies" / "shapes_losses_2026.yaml")
    study.output_dir = str(tmp_path / "study")  # not the study's own folder: it may be running
    prepared, grid = plan(study)
    assert [run.name for run in prepared] == ["warm_start"] and len(grid) == 6 * 3
    specs = check_runs(study, prepared, grid)
    algorithm = {arm.name: specs[f"{arm.name}/seed_0"]["config"]["algorithm"] for arm in study.arms}
    assert algorithm["sapo"]["surrogate"] == "sapo" and algorithm["grpo-icepop"]["tis_mode"] == "token_mask"
    assert algorithm["grpo-mis"]["tis_mode"] == "sequence_mask" and algorithm["grpo-off-policy-mask"]["off_policy_mask"] == 0.5


# --------------------------------------------------------------------------- a study stopped, then continued

STOP_STEPS = 8
TIMING = ("seconds", "tokens_per_s", "time/")


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


@pytest.fixture(scope="module")
def stop_config(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny letter-task run of STOP_STEPS steps (evaluated at 4 and 8) whose only checkpoint is
    the one a stop saves."""
    return write(tmp_path_factory.mktemp("stop") / "letters.yaml", f"""
model: {{name_or_path: {tiny_model_dir}, device: cpu}}
task: {{name: "letter_task:LetterTask"}}
rollout: {{prompts_per_step: 2, group_size: 2, generation_batch_size: 2, max_new_tokens: 4}}
train: {{steps: {STOP_STEPS}, lr: 0.01, trackers: [], log_rollouts_every: 0, micro_batch_size: 4, save_every: 0}}
eval: {{every: 4, n: 2, batch_size: 2, max_new_tokens: 4}}
""")


@pytest.fixture(scope="module")
def uninterrupted(stop_config, tmp_path_factory) -> list[dict]:
    """The metrics of the study's run never stopped (one thread, as the study's runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, str(TESTS))
    try:
        run = train(load_config(stop_config, [f"output_dir={tmp_path_factory.mktemp('straight')}", "seed=0"]))
    finally:
        sys.path.remove(str(TESTS))
        torch.set_num_threads(threads)
    return without_timing(read_metrics(run / "metrics.jsonl"))


def stop_a_study(tmp_path: Path, way: str, study: Path, run: Path) -> tuple[subprocess.Popen, int, str]:
    """Start `vlmrl compare STUDY` as a terminal would (its own process group), stop it `way` once
    `run` has logged its first step; its process, the run's process id and the study's stderr."""
    err_path = tmp_path / "stderr.txt"
    with (tmp_path / "stdout.txt").open("w") as out, err_path.open("w") as err:  # files: a full pipe stalls
        process = subprocess.Popen([sys.executable, "-m", "vlmrl", "compare", str(study)], stdout=out, stderr=err,
                                   start_new_session=True)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
        time.sleep(0.02)
    child = int((run / ".lock").read_text())  # the trainer that holds the run folder
    if way == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    elif way == "sigterm to the study":
        process.send_signal(signal.SIGTERM)
    elif way == "sigkill to the study":
        process.kill()  # nothing passed on: the run's parent-death signal stops it
    else:
        os.kill(child, signal.SIGTERM)
    process.wait(timeout=180)
    deadline = time.monotonic() + 180  # a run outliving a killed study ends on its own, maybe unreaped
    while ended(child) is False and time.monotonic() < deadline:
        time.sleep(0.05)
    return process, child, err_path.read_text()


def ended(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("way", [pytest.param("ctrl-c", marks=pytest.mark.slow),  # 16-25 s each: the suite keeps
                                 pytest.param("sigterm to the study", marks=pytest.mark.slow),  # the sigkill one
                                 pytest.param("sigterm to a run", marks=pytest.mark.slow),
                                 pytest.param("sigkill to the study", marks=pytest.mark.skipif(
                                     not sys.platform.startswith("linux"), reason="Linux's parent-death signal"))])
def test_a_study_stopped_any_way_continues_exactly(tmp_path, stop_config, uninterrupted, way, monkeypatch, capsys):
    """Ctrl-C, SIGTERM or SIGKILL to the study, SIGTERM to one of its runs: the run saves a checkpoint
    after its step, no process is left, the study says how to continue (killed, it cannot), and the
    same command continues the run to exactly the metrics of a run never stopped."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]))
    study = write(tmp_path / "study.yaml", f"output_dir: {tmp_path / 'study'}\nseeds: [0]\n"
                                           f"arms:\n  - {{name: a, config: {stop_config}}}\n")
    run = tmp_path / "study" / "a" / "seed_0"
    process, child, err = stop_a_study(tmp_path, way, study, run)
    assert ended(child)  # the trainer has ended: no orphan
    done = len(read_metrics(run / "metrics.jsonl"))
    assert 1 <= done < STOP_STEPS and read_checkpoint(run / "checkpoints" / f"step_{done:06d}")["step"] == done
    name = "SIGINT" if way == "ctrl-c" else "SIGTERM"  # killed, the study's runs get the kernel's SIGTERM
    assert f"interrupted: {name} received: stopped after step {done} with a checkpoint" in (run / "run.log").read_text()
    where = f"a/seed_0 stopped by {name}: continues from its checkpoint at step {done}"
    if way == "sigkill to the study":  # killed at once: no word from it
        assert process.returncode == -signal.SIGKILL
    elif way == "sigterm to a run":  # the study goes on without it, and says so
        assert process.returncode == 2
        assert err.splitlines()[-1] == (f"error: 1 of 1 runs did not finish: {where}; the comparison in "
                                        f"{tmp_path / 'study' / 'compare.html'} holds the others; run the same "
                                        "command again to continue them")
    else:
        assert process.returncode == 128 + getattr(signal, name)
        assert err.splitlines()[-1] == (f"interrupted: {name} received: the study stopped ({where}); to continue, run "
                                        f"the same command again: vlmrl compare {study}")
    assert main(["compare", str(study)]) == 0
    assert without_timing(read_metrics(run / "metrics.jsonl")) == uninterrupted
