"""The one importer of user code: tasks, tools and rewards named `package.module:name` or `path/to/file.py:name`.

`load_object("my_pkg.rewards:brevity", "reward")` imports only the module named (never its siblings);
`load_object("rewards/mine.py:brevity", "reward", base_dir)` runs that file as a module of its own
(a relative path is read from `base_dir`: the config file's folder, else the working directory). A
file is loaded once per process, under a name made from its absolute path (`vlmrl_file_<stem>_<hash>`),
so naming it twice gives the same objects. Every failure, including any exception a user's module
raises while it is imported, is one VlmrlError naming the spec and what it is for.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from vlmrl.errors import VlmrlError


def is_import_spec(spec: str) -> bool:
    """Whether `spec` names user code (`module:name` or `file.py:name`) rather than something built in."""
    return isinstance(spec, str) and ":" in spec and "://" not in spec


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a Python file (`path/to/file.py:name`) rather than a module."""
    return is_import_spec(spec) and spec.rpartition(":")[0].endswith(".py")


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """("package.module" or "path/file.py", "name") of `spec`; VlmrlError when it is not of that form."""
    target, _, attribute = spec.rpartition(":")
    if not target.strip() or not attribute.isidentifier():
        raise VlmrlError(f"{what} {spec!r} must be written package.module:name or path/to/file.py:name")
    return target, attribute


def resolve_file(spec: str, base_dir: str | Path | None) -> str:
    """`spec` with a relative file path made absolute from `base_dir` (a module spec as it is)."""
    if not is_file_spec(spec):
        return spec
    target, _, attribute = spec.rpartition(":")
    path = Path(target).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return f"{path.resolve()}:{attribute}"


def load_module(target: str, what: str, spec: str, base_dir: str | Path | None = None) -> ModuleType:
    """The module `target` ("package.module" or "path/file.py", relative to `base_dir`), imported once."""
    if not target.endswith(".py"):
        try:
            return importlib.import_module(target)
        except Exception as error:  # a user's module may fail at import in any way: report it as config
            raise VlmrlError(f"cannot import the module of {what} {spec!r}: {type(error).__name__}: {error}") from error
    path = Path(resolve_file(f"{target}:x", base_dir).rpartition(":")[0])
    if not path.is_file():
        raise VlmrlError(f"{what} {spec!r}: the file {path} does not exist")
    name = f"vlmrl_file_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file, whatever it raises
        del sys.modules[name]
        raise VlmrlError(f"cannot import the file of {what} {spec!r}: {type(error).__name__}: {error}") from error
    return module


def load_object(spec: str, what: str, base_dir: str | Path | None = None) -> Any:
    """The object `name` of `package.module:name` or `path/to/file.py:name`; `what` ("task", "tool",
    "reward") names it in errors."""
    target, attribute = split_spec(spec, what)
    module = load_module(target, what, spec, base_dir)
    found = getattr(module, attribute, None)
    if found is None:
        where = module.__name__ if not target.endswith(".py") else target
        raise VlmrlError(f"{what} {spec!r}: {where} has no {attribute!r}")
    return found
