"""`vlmrl tasks show` prints the system turn a model is shown before the prompt, when there is one."""

from __future__ import annotations

import json

from vlmrl.cli import main
from vlmrl.tasks.inspect import show_task


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_tasks_show_prints_the_system_turn(tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "answer": "4"},
                                             {"prompt": "What is 3+3?", "answer": "6"}])
    text = show_task("dataset", {"path": data, "system": "You count carefully.\nAnswer in one word."}, n=1)
    assert "system:\n    You count carefully.\n    Answer in one word.\nprompt:\n    What is 2+2?" in text
    assert main(["tasks", "show", "dataset", f"path={data}", "system=Be brief.", "--n", "1"]) == 0
    assert "system:\n    Be brief.\nprompt:" in capsys.readouterr().out


def test_tasks_show_prints_no_system_line_without_a_system_turn(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "answer": "4"},
                                             {"prompt": "What is 3+3?", "answer": "6"}])
    assert "system:" not in show_task("dataset", {"path": data}, n=2)
    assert "system:" not in show_task("shapes", {}, n=1)
