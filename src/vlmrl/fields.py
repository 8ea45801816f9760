"""Dataclass fields from outside: their docstrings, one rule for coercing values, and building.

The run config (`vlmrl.config`) and the task parameters (`vlmrl.tasks.base`) are both dataclasses
filled from YAML, from `key=value` on the command line, or from Python keyword arguments. They read
their values here, so a value means the same thing in both:

- a string is first read as YAML ("3" -> 3, "yes"/"true" -> True as YAML 1.1 does, "1e-6" -> 1e-06,
  "[a, b]" -> a list), except where the field takes text as it is (str, Any);
- then the type is checked strictly: bool only from a bool; int only from an integer (not a bool,
  not 3.0); float from an int or a float; str from a str (numbers and paths are written as text);
  list and tuple from a list or tuple, or from comma-separated text ("red,blue"; one value,
  "wandb", is a list of one: `train.trackers=wandb`); a
  Literal must be one of its choices; a union tries each option in turn; a dataclass is built from
  a mapping, recursively; a dict stays a dict; Any passes through.

A number field may also carry a `Range` (declared once, with the field: `ranged(default, RANGE)`):
`build` holds its value to it after the type and the instance's own `validate()`, so every float a run
uses is bounded to what it is used as (a temperature whose exp() overflows float32, a weight whose
weighted sum does: one line naming the key, the range and why). A text field that names a local path
(`path_field`) has a leading `~` expanded to the home folder.

A wrong value is a one-line VlmrlError naming the field and the type it must have; an unknown name
is one naming the closest valid names. `Naming` says how a caller's messages name things
("train.lr", "parameter max_words of task 'cryptogram'"). No torch here: tasks import this module.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import numbers
import os
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from vlmrl.errors import VlmrlError


class FieldTypeError(VlmrlError):
    """A value that does not fit its field's type (a union goes on to its next option on this)."""


@dataclasses.dataclass(frozen=True)
class Naming:
    """How errors about the fields of a dataclass name things; one per caller (config, tasks)."""

    noun: str = "key"
    """What a name is called in `unknown NOUN 'x'`: "config key", "parameter"."""
    label: str = "{key}"
    """How a value error names its field; {key} becomes the path ("train.lr", "targets[1]")."""
    owner: str = ""
    """Said after an unknown name, e.g. " of task 'shapes'"."""
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Old name -> new name: an unknown name found here says what it is called now."""
    candidates: tuple[str, ...] = ()
    """Names to suggest from; empty = every dotted key of the class `build` starts from."""

    def name(self, key: str) -> str:
        """The field `key` as value errors name it."""
        return self.label.replace("{key}", key)


MAX_YAML_DEPTH = 100
"""Deepest nesting of mappings and lists a YAML text may have: a config is three levels deep, task
parameters a few more; PyYAML builds a node per level recursively, so 5000 levels overflowed
Python's stack (a RecursionError) before this limit."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing (a YAMLError at the place) what it would let through: a key
    written twice in one mapping, which YAML forbids and PyYAML resolves silently by keeping the last,
    and nesting deeper than MAX_YAML_DEPTH. Merge keys (`<<: *base`) may still be overridden."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}  # key -> the line it was first written on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in lines
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {lines[key]}): a key may appear "
                                    "once in a mapping", key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class _Loader(StrictLoader):
    """YAML 1.1 as PyYAML reads it, except that 1e-6 (no dot) is a float, as in YAML 1.2."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"))


def read_text(text: str) -> Any:
    """`text` read as one YAML value ("3" -> 3, "yes" -> True, "1e-6" -> 1e-06, "[a, b]" -> a
    list, "" -> None); text that is not valid YAML is returned as it is."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a number field may take: [low, high] (or (low, high] with `low_open`), and why."""

    low: float
    high: float
    why: str
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high  # NaN is in no range

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


def ranged(default: float, bounds: Range) -> Any:
    """A dataclass field with `default` whose value `build` holds to `bounds` (`check_ranges`)."""
    return dataclasses.field(default=default, metadata={"range": bounds})


def field_range(f: dataclasses.Field) -> Range | None:
    """The Range a field was declared with (`ranged`), or None."""
    return f.metadata.get("range")


def check_ranges(instance: Any, naming: Naming = Naming(), prefix: str = "") -> None:
    """A one-line VlmrlError for the first number field of dataclass `instance` outside its Range:
    `algorithm.sapo_tau_pos must be in [0.01, 100] (why); got 1e+300`."""
    for f in dataclasses.fields(instance):
        bounds, value = field_range(f), getattr(instance, f.name)
        if (bounds is not None and isinstance(value, numbers.Real) and not isinstance(value, bool)
                and value not in bounds):
            raise VlmrlError(f"{naming.name(prefix + f.name)} must be in {bounds} ({bounds.why}); got {value}")


def path_field(default: str) -> Any:
    """A dataclass field of text that names a local path: `build` expands a leading `~` (`~/runs` is
    the home folder's runs/, never a folder named `~`), as a shell would."""
    return dataclasses.field(default=default, metadata={"path": True})


def expand_home(value: str, name: str) -> str:
    """`value` with a leading `~` or `~user` expanded; a VlmrlError naming field `name` when it names
    no home folder."""
    if not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise VlmrlError(f"{name}: {value!r} starts with a ~ that names no home folder here; write the whole path")
    return expanded


# --------------------------------------------------------------------------- docs and names


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` or of one of its bases (the
    subclass's own wins), on one line; a class whose source cannot be read adds nothing."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(klass: type) -> dict[str, str]:
    """Field docstrings in the body of `klass` itself: a string literal right after `name: hint`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def type_name(hint: Any) -> str:
    """A type hint in Python's notation, as the parameter table of `vlmrl tasks list` writes it: int,
    list[str], tuple[str, ...], str | None (errors write `describe_type`'s words)."""
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    return str(hint).replace("typing.", "")


def describe_type(hint: Any) -> str:
    """A type hint as a user reads it in an error, in the words of YAML rather than Python's:
    `bool | Literal["auto"]` is "true, false or auto", int "an integer", list[str] "a list of texts"."""
    origin = typing.get_origin(hint) or hint
    if origin in (typing.Union, types.UnionType) or origin is Literal or hint is bool:
        words = _choices(hint)
        if origin is Literal:
            return f"one of {_either(words)}"
        return _either(words)
    if hint is Any:
        return "any value"
    if dataclasses.is_dataclass(hint) or origin is dict:
        return "a mapping"
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(set(args)) == 1:
                return f"a list of {len(args)} {_plural(args[0])}"
            return f"a list of {len(args)} items ({'; '.join(describe_type(arg) for arg in args)})"
        listed = f"a list of {_plural(args[0])}" if args and args[0] is not Any else "a list"
        return listed + (" (or comma-separated text)" if origin is tuple else "")
    return _WORDS.get(hint, (None, None))[0] or getattr(hint, "__name__", str(hint))


_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("text", "texts"),
          bool: ("true or false", "true/false values"), type(None): ("null", "nulls")}
"""Each plain type as a user reads it: alone, and in a list."""


def _choices(hint: Any) -> list[str]:
    """The values a bool, Literal or None allow as YAML writes them, and the other options of a union
    described (`describe_type`)."""
    origin = typing.get_origin(hint) or hint
    if hint is bool:
        return ["true", "false"]
    if hint is type(None):
        return ["null"]
    if origin is Literal:
        return [str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in typing.get_args(hint)]
    if origin in (typing.Union, types.UnionType):
        return [word for option in typing.get_args(hint) for word in _choices(option)]
    return [describe_type(hint)]


def _either(words: list[str]) -> str:
    """"a", "a or b", "a, b or c"."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _plural(hint: Any) -> str:
    """Items of type `hint` in a list: "texts", "integers", "items, each one of a, b or c"."""
    if hint in _WORDS:
        return _WORDS[hint][1]
    return f"items, each {describe_type(hint)}"


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass `cls` (nested dataclass fields included), depth first."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], prefix + f.name + "."))
    return keys


def closest(name: str, candidates: typing.Iterable[str]) -> list[str]:
    """Up to three of `candidates` that look like `name`, closest first ("did you mean ...?")."""
    return difflib.get_close_matches(str(name), list(candidates), n=3, cutoff=0.5)


# --------------------------------------------------------------------------- building


def build(cls: type, data: Mapping[str, Any], naming: Naming = Naming(), prefix: str = "") -> Any:
    """`cls(**data)` for dataclass `cls`, each value coerced to its field's type hint, then the
    instance's `validate()` (when it has one) called and its fields' Ranges checked. Keys are named `prefix + name` in errors; an
    unknown one is a VlmrlError with the closest valid keys (or its new name, see Naming.renamed)."""
    if not isinstance(data, Mapping):
        raise VlmrlError(f"{cls.__name__} needs a mapping of field names to values, got {data!r}")
    if not naming.candidates:
        naming = dataclasses.replace(naming, candidates=tuple(all_keys(cls, prefix)))
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    values = {}
    for name, value in data.items():
        if name not in names:
            raise _unknown(prefix + str(name), [prefix + n for n in names], naming)
        values[name] = coerce(hints[name], value, prefix + name, naming)
    for f in dataclasses.fields(cls):
        if f.metadata.get("path") and isinstance(values.get(f.name), str):
            values[f.name] = expand_home(values[f.name], naming.name(prefix + f.name))
    instance = cls(**values)
    validate = getattr(instance, "validate", None)
    if callable(validate):
        validate()
    check_ranges(instance, naming, prefix)
    return instance


def _unknown(key: str, valid: list[str], naming: Naming) -> VlmrlError:
    """The error for unknown name `key`: its new name when it was renamed, else the closest names
    (or, when none is close, the `valid` names at its level)."""
    if key in naming.renamed:
        return VlmrlError(f"{naming.noun} {key!r}{naming.owner} was renamed to {naming.renamed[key]!r}; "
                          "use the new name")
    close = closest(key, naming.candidates)
    hint = f"did you mean {', '.join(close)}?" if close else f"valid: {', '.join(valid)}"
    return VlmrlError(f"unknown {naming.noun} {key!r}{naming.owner}; {hint}")


def coerce(hint: Any, value: Any, key: str, naming: Naming = Naming()) -> Any:
    """`value` as type `hint` by the rule in this module's docstring, or a one-line VlmrlError
    naming field `key` (FieldTypeError when the value does not fit the type)."""
    origin = typing.get_origin(hint) or hint
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _coerce_dataclass(hint, value, key, naming)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(hint, value, key, naming)
    if origin is Literal:
        return _coerce_literal(hint, value, key, naming)
    if origin in (list, tuple):
        return _coerce_sequence(hint, value, key, naming)
    if hint is str:
        return _coerce_str(value, key, naming)
    return _coerce_plain(hint, value, key, naming)


def _mismatch(naming: Naming, key: str, hint: Any, value: Any) -> FieldTypeError:
    """The error for a value that does not fit `hint`, both written as a user reads them."""
    return FieldTypeError(f"{naming.name(key)} must be {describe_type(hint)}; got {shown(value)}")


def shown(value: Any) -> str:
    """A value as YAML writes it, text quoted: true, null, 3.0, 'big', [1, 'x']."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(shown(item) for item in value)}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _coerce_dataclass(hint: type, value: Any, key: str, naming: Naming) -> Any:
    """A nested dataclass from a mapping (None, an empty YAML section, gives the defaults)."""
    read = read_text(value) if isinstance(value, str) else value
    if read is None:
        read = {}
    if not isinstance(read, Mapping):
        raise _mismatch(naming, key, hint, value)
    return build(hint, read, naming, key + ".")


def _coerce_union(hint: Any, value: Any, key: str, naming: Naming) -> Any:
    """The value as the first option of the union it fits, in the order written."""
    for option in typing.get_args(hint):
        try:
            return coerce(option, value, key, naming)
        except FieldTypeError:
            continue
    raise _mismatch(naming, key, hint, value)


def _coerce_literal(hint: Any, value: Any, key: str, naming: Naming) -> Any:
    """The choice equal to the value (or to the value's text read as YAML); True is not 1."""
    choices = typing.get_args(hint)
    candidates = [value, read_text(value)] if isinstance(value, str) else [value]
    for candidate in candidates:
        for choice in choices:
            if candidate == choice and isinstance(candidate, bool) == isinstance(choice, bool):
                return choice
    raise _mismatch(naming, key, hint, value)


def _coerce_sequence(hint: Any, value: Any, key: str, naming: Naming) -> list | tuple:
    """A list or tuple with each item coerced; also from comma-separated text (one value: a list of one)."""
    origin = typing.get_origin(hint) or hint
    items = value
    if isinstance(value, str):
        items = read_text(value)
        if not isinstance(items, (list, tuple)):
            items = [part.strip() for part in value.strip("()[]").split(",") if part.strip()]
    if not isinstance(items, (list, tuple)):
        raise _mismatch(naming, key, hint, value)
    args = typing.get_args(hint)
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(items):
            raise _mismatch(naming, key, hint, value)
        item_hints = list(args)
    else:
        item_hints = [args[0] if args else Any] * len(items)
    coerced = [coerce(h, item, f"{key}[{i}]", naming) for i, (h, item) in enumerate(zip(item_hints, items))]
    return tuple(coerced) if origin is tuple else coerced


def _coerce_str(value: Any, key: str, naming: Naming) -> str:
    """Text as it is; a number or a path written as text; nothing else (not a bool)."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return os.fspath(value)
    raise _mismatch(naming, key, str, value)


def _coerce_plain(hint: Any, value: Any, key: str, naming: Naming) -> Any:
    """bool, int, float, dict, None or any other class; text is read as YAML first."""
    read = read_text(value) if isinstance(value, str) else value
    origin = typing.get_origin(hint) or hint
    if hint is bool:
        fits = isinstance(read, bool)
    elif hint is int:
        fits = isinstance(read, numbers.Integral) and not isinstance(read, bool)
    elif hint is float:
        fits = isinstance(read, numbers.Real) and not isinstance(read, bool)
    elif origin is dict:
        fits = isinstance(read, Mapping)
    else:
        fits = isinstance(origin, type) and isinstance(read, origin)
    if not fits:
        raise _mismatch(naming, key, hint, value)
    if origin in (int, float, dict):
        return origin(read)
    return read
