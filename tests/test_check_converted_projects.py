"""`ddpify check` agrees with `ddpify convert` on whole projects: every fixture project and
every unseen-code case, converted, then checked as a user checks a folder (each module with the
modules it imports and the files that import it). Check finds nothing there that the conversion
did not leave as a TODO (tests/test_converted_lint_clean.py does the same for one-file goldens)."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

from ddpify.check.config import Config
from ddpify.check.rule import all_rules
from ddpify.check.runner import check_paths, iter_python_files
from ddpify.projects import convert_project

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = {  # tests/test_projects.py's cases: folder -> entry
    "library_trainer": "projects/regress/regress.py",
    "kaggle_engine": "train.py",
    "cifar_utils": "train.py",
    "template_trainer": "train.py",
}
UNSEEN = {p.stem: tomllib.loads(p.read_text())["entry"] for p in sorted((ROOT / "fixtures" / "unseen").glob("*.toml"))}
CASES = [("projects", name, entry) for name, entry in PROJECTS.items()] + [("unseen", name, entry) for name, entry in UNSEEN.items()]
DEFAULT = frozenset(r.CODE for r in all_rules() if r.DEFAULT)
TODO = re.compile(r"#\s*TODO\(ddpify\):")


def compiles(path: Path) -> bool:
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError:
        return False
    return True


@pytest.mark.parametrize("group,name,entry", CASES, ids=[f"{g}/{n}" for g, n, _ in CASES])
def test_check_finds_nothing_in_a_converted_project(tmp_path: Path, group: str, name: str, entry: str):
    project = tmp_path / name
    shutil.copytree(ROOT / "fixtures" / group / name, project)
    result = convert_project(project / entry)
    assert result.changed, f"{name}: nothing converted"
    for path, (converted, _source, encoding) in result.changed.items():
        path.write_text(converted.code, encoding=encoding)
    files = iter_python_files([project], Config())
    unexplained = []
    for checked in check_paths([(f, DEFAULT) for f in files], jobs=1):
        assert checked.error is None, checked.error
        lines = Path(checked.path).read_text().splitlines()
        for f in checked.findings:
            if f.code == "DDP000" and not compiles(ROOT / "fixtures" / group / name / Path(checked.path).relative_to(project)):
                continue  # the file was broken before the conversion (the case says so)
            if any(TODO.search(line) for line in lines[max(f.line - 4, 0) : f.line]):
                continue  # the conversion said it at the line
            unexplained.append(f"{Path(checked.path).relative_to(project)}:{f.line}: {f.code} {f.message}")
    assert not unexplained, f"{name}: check disagrees with convert:\n" + "\n".join(unexplained)
