"""Time `convert` and `check` on whole projects as multiples of libcst's bare parse of their files.

    python benchmarks/bench_projects.py [--repeat 3] [--corpus DIR]

Projects: every fixture project (fixtures/projects/<name>/, fixtures/unseen/<case>/, entry from
the case's .toml or the test's table) and, with --corpus (the folder `third_party.py rebuild`
writes, e.g. /tmp/ddpify-corpus), every corpus script with its companion modules
(files/<id>.py beside files/<id>_deps/). A project's parse is libcst's `parse_module` of every
module the entry reaches (`find_project`); `convert` is `convert_project` (the one program:
every module parsed, indexed once and converted, verification included); `check` is
`check_source` on each of those modules. Best of --repeat, CPU time.

Targets (issue 21): convert <= 8x, check <= 3x the parse of the same files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_ENTRIES = {  # tests/test_projects.py's cases
    "library_trainer": "projects/regress/regress.py",
    "kaggle_engine": "train.py",
    "cifar_utils": "train.py",
    "template_trainer": "train.py",
}


def fixture_projects() -> list[Path]:
    entries = [ROOT / "fixtures" / "projects" / name / entry for name, entry in PROJECT_ENTRIES.items()]
    for case in sorted((ROOT / "fixtures" / "unseen").glob("*.toml")):
        entries.append(case.with_suffix("") / tomllib.loads(case.read_text())["entry"])
    return entries


def corpus_projects(corpus: Path, work: Path) -> list[Path]:
    """Each corpus script in a folder of its own with its companion modules beside it."""
    entries = []
    for script in sorted((corpus / "files").glob("*.py")):
        folder = work / script.stem
        folder.mkdir()
        (folder / "pyproject.toml").write_text("")
        shutil.copy(script, folder / script.name)
        deps = corpus / "files" / f"{script.stem}_deps"
        if deps.is_dir():
            shutil.copytree(deps, folder, dirs_exist_ok=True)
        entries.append(folder / script.name)
    return entries


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def measure(name: str, entries: list[Path], repeat: int) -> None:
    import libcst as cst

    from ddpify.analysis.project import find_project
    from ddpify.check.rule import select_rules
    from ddpify.check.runner import check_source
    from ddpify.engine import ConvertError
    from ddpify.engine import parse as engine_parse
    from ddpify.projects import convert_project

    files, failures = [], []
    for entry in entries:
        try:
            files += [(path, path.read_text(encoding="utf-8")) for path in find_project(entry).files]
        except Exception as exc:  # noqa: BLE001 - a project that does not parse is measured without it
            failures.append(f"{entry.name}: {type(exc).__name__}")
    lines = sum(text.count("\n") + 1 for _, text in files)
    codes = sorted(select_rules(None))

    def parse():
        for _, text in files:
            cst.parse_module(text)

    def check():
        for path, text in files:
            check_source(text, str(path), codes)

    def convert():
        engine_parse.cache_clear()  # a cold conversion: the engine keeps its last few trees
        for entry in entries:
            try:
                convert_project(entry)
            except ConvertError:
                pass  # a refusal still costs its analysis

    convert()  # warm up imports and caches once
    t_parse, t_check, t_convert = best_of(repeat, parse), best_of(repeat, check), best_of(repeat, convert)
    print(f"{name}: {len(entries)} projects, {len(files)} modules, {lines} lines (best of {repeat})")
    print(f"  libcst parse : {t_parse * 1000:8.0f} ms  1.0x")
    print(f"  check        : {t_check * 1000:8.0f} ms  {t_check / t_parse:4.1f}x parse (target 3x)")
    print(f"  convert      : {t_convert * 1000:8.0f} ms  {t_convert / t_parse:4.1f}x parse (target 8x)")
    if failures:
        print(f"  not measured: {', '.join(failures)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--corpus", type=Path, help="the folder third_party.py rebuilt (holds files/)")
    args = parser.parse_args()
    sys.setrecursionlimit(10000)
    measure("fixture projects", fixture_projects(), args.repeat)
    if args.corpus is not None:
        with tempfile.TemporaryDirectory() as work:
            measure(f"corpus projects ({args.corpus})", corpus_projects(args.corpus, Path(work)), args.repeat)


if __name__ == "__main__":
    main()
