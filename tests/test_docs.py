"""The README is the front door and docs/ the manual: the README stays short and its links resolve,
every page of docs/ is in the mkdocs nav (and every nav entry has its page), the site builds with
`mkdocs build --strict` (no broken link or anchor), and every `vlmrl` command is documented.

No torch: the commands are read from `python -m vlmrl --help`, whose parser imports nothing heavy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
MAX_README_LINES = 200

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""Inline markdown links `[text](target)` (an optional "title" after the target)."""


def relative_links(markdown: str) -> list[str]:
    """The link targets that point into the repository: not URLs, not mail, not bare anchors."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # links inside code blocks are not links
    targets = [target for target in LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def nav_pages(nav) -> list[str]:
    """Every page file named in mkdocs.yml's nav, nested sections included."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def load_mkdocs_config() -> dict:
    """mkdocs.yml as data (it uses no !!python tags, so safe_load reads it)."""
    return yaml.safe_load(MKDOCS_YML.read_text())


def cli_commands() -> list[str]:
    """The subcommands `vlmrl --help` lists: its `{a,b,...}` choices, or (with a metavar) the names
    indented under the positional argument, one per line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "vlmrl", "--help"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    choices = re.search(r"\{([a-z0-9_,-]+)\}", done.stdout)
    if choices:
        return choices.group(1).split(",")
    section = done.stdout.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^ {4}([a-z][a-z0-9_-]*)(?:\s|$)", section, flags=re.M)


def test_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def test_every_relative_link_in_the_readme_points_at_a_file():
    links = relative_links(README.read_text())
    assert links, "the README links to the docs pages"
    missing = [link for link in links if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_relative_links_ignore_urls_anchors_and_code_blocks():
    text = "[a](docs/x.md#y) [b](https://e.org) [c](#top) [d](mailto:a@b)\n```\n[e](f.md)\n```\n[g](h.md \"t\")"
    assert relative_links(text) == ["docs/x.md#y", "h.md"]


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = load_mkdocs_config()
    assert config["docs_dir"] == "docs"
    in_nav = nav_pages(config["nav"])
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(set(in_nav)) == sorted(in_nav), f"a page is in the nav twice: {in_nav}"
    assert sorted(set(pages) - set(in_nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(in_nav) - set(pages)) == [], "nav entries without a page in docs/"


def test_strict_validation_is_on():
    """--strict fails only on warnings: broken links, anchors and omitted pages must be warnings."""
    validation = load_mkdocs_config()["validation"]
    assert set(validation["nav"].values()) == {"warn"}
    assert {"not_found", "anchors", "absolute_links", "unrecognized_links"} <= set(validation["links"])
    assert set(validation["links"].values()) == {"warn"}


def test_the_site_builds_with_mkdocs_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "commands" / "index.html").exists()


def test_every_cli_command_is_documented():
    commands = cli_commands()
    assert {"train", "sft", "eval", "demo"} <= set(commands), f"could not read the commands: {commands}"
    documented = README.read_text() + (DOCS / "commands.md").read_text()
    missing = [name for name in commands if not re.search(rf"`vlmrl {re.escape(name)}(?![\w-])", documented)]
    assert not missing, f"commands in `vlmrl --help` but not in README.md or docs/commands.md: {missing}"


def test_no_documented_command_is_missing_from_the_cli():
    commands = set(cli_commands())
    documented = README.read_text() + (DOCS / "commands.md").read_text()
    named = set(re.findall(r"`vlmrl ([a-z][a-z0-9-]*)", documented))
    assert named - commands == set(), f"documented commands that `vlmrl --help` does not list: {named - commands}"


def test_the_model_tables_are_what_vlmrl_models_prints(capsys):
    """README.md and docs/models.md show `vlmrl models` verbatim, between the same two markers."""
    from vlmrl.cli import main

    capsys.readouterr()
    assert main(["models"]) in (0, None)  # in this process: a fresh one cost 8 s more
    printed = capsys.readouterr().out.strip()
    for page in (README, DOCS / "models.md"):
        text = page.read_text()
        start = text.index("-->", text.index("<!-- `vlmrl models` prints this table")) + len("-->")
        shown = text[start:text.index("<!-- end of `vlmrl models` -->")].strip()
        assert shown == printed, f"{page.name}: paste the output of `vlmrl models` between the markers"
