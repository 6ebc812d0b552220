"""The documentation site builds with `mkdocs build --strict`: a broken link or anchor, a missing
include, or a rule without its page fails here (and so in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    assert (site / "index.html").is_file()
    for page in ("convert", "what-convert-does", "check", "verify", "pre-commit", "limits", "development", "changelog"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "rules" / "DDP120" / "index.html").is_file()
    assert "Keep a Changelog" in (site / "changelog" / "index.html").read_text(encoding="utf-8")


def copy_of_the_site_sources(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(ROOT / "docs", root / "docs")
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, root / name)
    return root


def test_a_rule_without_its_page_fails_the_build(tmp_path: Path) -> None:
    root = copy_of_the_site_sources(tmp_path)
    (root / "docs" / "rules" / "DDP120.md").unlink()
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "DDP120.md" in done.stdout + done.stderr


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    root = copy_of_the_site_sources(tmp_path)
    page = root / "docs" / "index.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n[gone](verify.md#no-such-section)\n", encoding="utf-8")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "no-such-section" in done.stdout + done.stderr
