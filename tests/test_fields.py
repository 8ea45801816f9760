"""Fields: one rule for values from YAML, the command line and Python; docstrings; suggestions."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

from vlmrl.config import Config, from_dict
from vlmrl.errors import VlmrlError
from vlmrl.fields import FieldTypeError, Naming, all_keys, build, closest, coerce, field_docs, read_text, type_name
from vlmrl.tasks import get_task


@dataclass
class Inner:
    """A nested section."""

    size: int = 1
    """How big."""


@dataclass
class Base:
    """Fields every kind has."""

    seed: int = 0
    """The seed
    over two lines."""
    name: str = "base"
    """The base's word for it."""


@dataclass
class Child(Base):
    """A subclass with its own fields."""

    name: str = "child"
    """The child's word for it."""
    ratio: float = 0.5
    undocumented_after: bool = False
    """Flag."""
    inner: Inner = field(default_factory=Inner)
    """The nested section."""

    def validate(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise VlmrlError(f"ratio must be in [0, 1]; got {self.ratio}")


def test_read_text_is_yaml_with_exponent_floats():
    assert read_text("3") == 3 and read_text("yes") is True and read_text("off") is False
    assert read_text("1e-6") == 1e-6 and read_text("1.5E+3") == 1500.0 and read_text(".5e1") == 5.0
    assert read_text("[a, 2]") == ["a", 2] and read_text("") is None and read_text("null") is None
    assert read_text("e5") == "e5" and read_text("1e") == "1e" and read_text("[a, b") == "[a, b"


def test_field_docs_include_bases_subclass_first_on_one_line():
    assert field_docs(Child) == {"seed": "The seed over two lines.", "name": "The child's word for it.",
                                 "undocumented_after": "Flag.", "inner": "The nested section."}

    @dataclass
    class Local:
        x: int = 0
        """Defined inside a function (indented source)."""

    assert field_docs(Local) == {"x": "Defined inside a function (indented source)."}


def test_type_names_keys_and_suggestions():
    assert [type_name(h) for h in (int, list[str], tuple[str, ...], str | None, Optional[int])] == [
        "int", "list[str]", "tuple[str, ...]", "str | None", "Optional[int]"]
    assert all_keys(Child) == ["seed", "name", "ratio", "undocumented_after", "inner", "inner.size"]
    assert closest("ratoi", all_keys(Child)) == ["ratio"]
    assert closest("zzz", all_keys(Child)) == []


@pytest.mark.parametrize("hint, value, expected", [
    (int, 3, 3), (int, "3", 3), (int, " 12 ", 12), (bool, "yes", True), (bool, "False", False),
    (bool, True, True), (float, 2, 2.0), (float, "1e-6", 1e-6), (float, "0.25", 0.25),
    (str, "yes", "yes"), (str, "007", "007"), (str, 7, "7"), (str, 0.5, "0.5"), (str, Path("a/b"), "a/b"),
    (list[int], "[1, 2]", [1, 2]), (list[int], (1, "2"), [1, 2]), (tuple[str, ...], "red,blue", ("red", "blue")),
    (list[str], "a,b", ["a", "b"]), (list[str], "wandb", ["wandb"]), (list[int], "3", [3]),
    (tuple[str, ...], "(red, blue)", ("red", "blue")), (tuple[int, ...], "1", (1,)),
    (tuple[int, str], [1, 2], (1, "2")), (Literal["a", "b"], "b", "b"), (Literal[1, 2], "2", 2),
    (str | None, None, None), (str | None, "null", "null"), (int | None, "null", None), (int | str, "3", 3),
    (dict[str, Any], {"a": "1"}, {"a": "1"}), (dict[str, Any], "{a: 1}", {"a": 1}), (Any, "3", "3"),
])
def test_coerce_follows_the_one_rule(hint, value, expected):
    result = coerce(hint, value, "k")
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("hint, value, message", [
    (int, 3.0, "k must be an integer; got 3.0"),
    (int, True, "k must be an integer; got true"),
    (int, "3.0", "k must be an integer; got '3.0'"),
    (bool, 1, "k must be true or false; got 1"),
    (bool, "1", "k must be true or false; got '1'"),
    (float, True, "k must be a number; got true"),
    (float, "heavy", "k must be a number; got 'heavy'"),
    (str, False, "k must be text; got false"),
    (list[str], 3, "k must be a list of texts; got 3"),
    (list[int], [1, "x"], "k[1] must be an integer; got 'x'"),
    (tuple[int, int], [1], "k must be a list of 2 integers; got [1]"),
    (tuple[str, ...], 3, "k must be a list of texts (or comma-separated text); got 3"),
    (Literal[1, 2], True, "k must be one of 1 or 2; got true"),
    (Literal["a", "b"], "c", "k must be one of a or b; got 'c'"),
    (int | None, "x", "k must be an integer or null; got 'x'"),
    (bool | Literal["auto"], "maybe", "k must be true, false or auto; got 'maybe'"),
    (int | Literal["auto"], [1], "k must be an integer or auto; got [1]"),
    (list[Literal["a", "b"]], "c", "k[0] must be one of a or b; got 'c'"),  # text is a list of one
    (dict[str, Any], [1], "k must be a mapping; got [1]"),
    (Inner, 3, "k must be a mapping; got 3"),
])
def test_coerce_refuses_what_does_not_fit_in_one_line(hint, value, message):
    with pytest.raises(FieldTypeError) as error:
        coerce(hint, value, "k")
    assert str(error.value) == message


def test_build_coerces_recurses_validates_and_names_unknown_keys():
    built = build(Child, {"seed": "4", "inner": {"size": "2"}, "undocumented_after": "on"})
    assert built == Child(seed=4, inner=Inner(size=2), undocumented_after=True)
    assert build(Child, {"inner": None}).inner == Inner()
    with pytest.raises(VlmrlError, match=r"^ratio must be in \[0, 1\]; got 2\.0$"):
        build(Child, {"ratio": 2})
    with pytest.raises(VlmrlError, match=r"^unknown key 'inner\.sise'; did you mean inner\.size, inner\?$"):
        build(Child, {"inner": {"sise": 1}})
    with pytest.raises(VlmrlError, match=r"^unknown key 'zzz'; valid: seed, name, ratio, undocumented_after, inner$"):
        build(Child, {"zzz": 1})
    naming = Naming(noun="option", label="option {key} of Child", owner=" of Child", renamed={"old": "ratio"})
    with pytest.raises(VlmrlError, match=r"^option 'old' of Child was renamed to 'ratio'; use the new name$"):
        build(Child, {"old": 1}, naming)
    with pytest.raises(VlmrlError, match=r"^option inner\.size of Child must be an integer; got 'big'$"):
        build(Child, {"inner": {"size": "big"}}, naming)


@pytest.mark.parametrize("value", ["3", 3, 3.0, "3.0", "yes", True, "two", None])
def test_config_and_task_parameters_read_a_value_alike(value):
    """An int field of the config (train.steps) and of a task (cryptogram max_words) take and refuse
    the same values; so do a bool field of each (model.freeze_vision, shapes distractors)."""
    def outcome(make):
        try:
            return make()
        except VlmrlError as error:
            return "error: " + str(error).split(" must be ")[1]

    assert outcome(lambda: from_dict(Config, {"train": {"steps": value}}).train.steps) == outcome(
        lambda: get_task("cryptogram", max_words=value).params.max_words)
    assert outcome(lambda: from_dict(Config, {"model": {"freeze_vision": value}}).model.freeze_vision) == outcome(
        lambda: get_task("shapes", distractors=value).params.distractors)


def test_importing_fields_does_not_import_torch():
    code = "import sys, vlmrl.fields, vlmrl.tasks.base\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
