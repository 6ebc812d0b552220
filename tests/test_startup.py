"""What a command loads before it can work: the start-up a user waits for on every call
(`benchmarks/bench_startup.py` times it). Each module left out here costs as much to import as
libcst itself: libcst.matchers and libcst.codemod (the conversion uses isinstance checks, and
codemod's import visitors only when an import is merged or removed), pydantic (typer 0.29 and
later import it for every command), torch (convert and check never import it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("libcst.matchers", "libcst.codemod", "pydantic", "torch")
LOADED = """
import json, sys
from ddpify.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("@@modules " + json.dumps(sorted(sys.modules)))
"""


def loaded_by(*args: str) -> set[str]:
    """The modules a fresh interpreter holds after `ddpify ARGS`."""
    done = subprocess.run([sys.executable, "-c", LOADED, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = next((l for l in done.stdout.splitlines() if l.startswith("@@modules ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    return set(json.loads(line.removeprefix("@@modules ")))


def heavy(modules: set[str]) -> list[str]:
    """The modules of HEAVY (and their submodules) among `modules`."""
    return sorted(m for m in modules if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY)))


@pytest.mark.parametrize("example", ["mnist.py", "mnist_convnet.py"])
def test_convert_loads_libcst_but_not_matchers_codemod_pydantic_or_torch(tmp_path, example):
    modules = loaded_by("convert", f"examples/{example}", "-o", str(tmp_path / "out.py"))
    assert (tmp_path / "out.py").exists() and "ddpify.convert.wrap_model" in modules, "the conversion ran"
    assert heavy(modules) == []


def test_check_loads_no_matchers_codemod_pydantic_or_torch():
    modules = loaded_by("check", "examples/mnist.py")
    assert "ddpify.check.runner" in modules, "the check ran"
    assert heavy(modules) == []


def test_help_loads_no_libcst():
    modules = loaded_by("--help")
    assert "typer" in modules
    assert sorted(m for m in modules if m == "libcst" or m.startswith("libcst.")) == []
