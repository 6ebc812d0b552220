"""The package as users get it: one version everywhere it is written, a wheel and an sdist that
`twine check` accepts, and a wheel that installs into a fresh virtual environment and converts
the bundled example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ddpify
from cli_in_process import ddpify as run_ddpify

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def test_one_version_everywhere() -> None:
    """pyproject.toml, the package, `ddpify --version`, the changelog and the pinned pre-commit
    examples name the same version."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert ddpify.__version__ == VERSION
    done = run_ddpify("--version")
    assert done.returncode == 0 and done.stdout == f"ddpify {VERSION}\n"
    assert f"## [{VERSION}] - " in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    for page in (ROOT / "README.md", ROOT / "docs" / "pre-commit.md"):
        assert f"rev: v{VERSION}\n" in page.read_text(encoding="utf-8"), f"{page.name} pins another version"


def test_every_pre_commit_hook_is_documented() -> None:
    hooks = re.findall(r"^- id: (\S+)$", (ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"), re.M)
    assert hooks == ["ddpify-check", "ddpify-check-fix", "ddpify-convert-check"]
    page = (ROOT / "docs" / "pre-commit.md").read_text(encoding="utf-8")
    for hook in hooks:
        assert f"| `{hook}` |" in page, f"docs/pre-commit.md does not describe {hook}"
    assert "pre-commit try-repo " in page  # trying the hooks needs no tag


def test_changelog_keeps_a_changelog() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n") and "## [Unreleased]" in text
    versions = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.M)
    assert versions and versions[0] == VERSION
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


def run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_build_check_install_and_convert(tmp_path: Path) -> None:
    """`python -m build`, `twine check --strict`, then the wheel alone in a fresh virtual
    environment (no system site-packages: libcst and typer come from the package index like a
    user's install), outside the checkout: `ddpify --version` and a conversion of the example."""
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    wheels = sorted(dist.glob(f"ddpify-{VERSION}-py3-none-any.whl"))
    sdists = sorted(dist.glob(f"ddpify-{VERSION}.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    checked = run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)], cwd=tmp_path)
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    # nothing of the checkout on the path (PYTHONPATH would show pip its egg-info as installed)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheels[0])], cwd=tmp_path, env=env)
    where = run([str(python), "-c", "import ddpify; print(ddpify.__file__)"], cwd=tmp_path, env=env).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where  # the installed copy, not the checkout
    ddpify_bin = venv / "bin" / "ddpify"
    assert run([str(ddpify_bin), "--version"], cwd=tmp_path, env=env).stdout == f"ddpify {VERSION}\n"
    out = tmp_path / "mnist_convnet_ddp.py"
    run([str(ddpify_bin), "convert", str(ROOT / "examples" / "mnist_convnet.py"), "-o", str(out)], cwd=tmp_path, env=env)
    assert out.read_text(encoding="utf-8") == (ROOT / "examples" / "mnist_convnet_ddp.py").read_text(encoding="utf-8")
