"""Shared fixtures: offline tiny models built once per test session, and a small test image."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

TESTS = Path(__file__).parent
"""This folder: tests/letter_task.py lives here (the trainer tests' tasks, loaded by import path)."""

# torch.compile's CPU kernels are cached on disk by a key without the vector width they were built
# for: a suite run under ATEN_CPU_CAPABILITY=avx2 after one without (how a second CPU kind is tried on
# one machine) loaded the AVX-512 kernels behind an AVX2 caller, and every other 8 lanes of a compiled
# result came back 0 (tests/test_stochastic_rounding.py's compiled noise). One cache per capability,
# for this process and the ones the tests start. A fresh machine (CI) has no cache to mix up.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / (
    f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'default')}")))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (once) and return the folder of a tiny model of the given architecture."""
    from vlmrl.models import build_tiny_model

    built: dict[str, str] = {}

    def make(arch: str = "qwen2_5_vl") -> str:
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = str(build_tiny_model(out, size="tiny", arch=arch, seed=0))
        return built[arch]

    return make


@pytest.fixture(scope="session")
def windowed_model_factory(tiny_model_factory, tmp_path_factory):
    """The tiny build of a family with its text layers' sliding window set to `window` tokens (the
    builds' window, 4096, is longer than any test's sequence)."""
    import json
    import shutil

    def make(arch: str, window: int = 6) -> str:
        folder = shutil.copytree(tiny_model_factory(arch), tmp_path_factory.mktemp(f"window-{arch}") / arch)
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["sliding_window"] = window
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> str:
    """The default tiny model: Qwen2.5-VL architecture."""
    return tiny_model_factory("qwen2_5_vl")


@pytest.fixture
def circle_image() -> Image.Image:
    """A real PIL image: two blue circles on white, 112x112."""
    image = Image.new("RGB", (112, 112), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 40, 40), fill="blue")
    draw.ellipse((60, 60, 100, 100), fill="blue")
    return image


@pytest.fixture
def letter_task(monkeypatch):
    """Make `letter_task:LetterTask` / `letter_task:ColorTask` importable as task names."""
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny-model tests: one torch thread is fastest, and many times faster on a busy
    machine. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def held_elsewhere():
    """A context manager: `with held_elsewhere(folder) as pid:` another process holds `folder`
    (vlmrl.safety.folder_lock) until the block ends, then it is killed."""
    import contextlib
    import os
    import subprocess
    import sys

    code = ("import sys, time; from vlmrl.safety.folder_lock import hold; hold(sys.argv[1], 'a test'); "
            "print('held', flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}

    @contextlib.contextmanager
    def holding(folder):
        process = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, env=env)
        try:
            assert process.stdout.readline() == b"held\n"
            yield process.pid
        finally:
            process.kill()
            process.wait()
            process.stdout.close()

    return holding
