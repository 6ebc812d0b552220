"""Time `check` and `convert` per thousand lines against libcst's bare parse, and `check` over a tree.

    python benchmarks/bench_check.py [--repeat 5] [--files 300]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import libcst as cst

from ddpify.check.config import Config
from ddpify.check.rule import select_rules
from ddpify.check.runner import check_paths, check_source, iter_python_files

ROOT = Path(__file__).resolve().parent.parent


def corpus() -> list[Path]:
    files = sorted((ROOT / "fixtures" / "check" / "clean").glob("*.py"))
    files += sorted((ROOT / "fixtures" / "convert").glob("*.in.py"))
    files += sorted((ROOT / "examples").glob("*.py"))
    return files


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def per_file(files: list[Path], repeat: int) -> None:
    sources = [(str(p), p.read_text(encoding="utf-8")) for p in files]
    kloc = sum(s.count("\n") + 1 for _, s in sources) / 1000
    codes = select_rules(None)

    def parse():
        for _, s in sources:
            cst.parse_module(s)

    def check():
        for p, s in sources:
            check_source(s, p, codes)

    try:
        from ddpify.engine import convert_source
        from ddpify.engine import parse as engine_parse
    except ImportError:  # pragma: no cover
        convert_source = None
    convert_failures: list[str] = []

    def convert():
        convert_failures.clear()
        engine_parse.cache_clear()  # a cold conversion: the engine keeps its last few trees
        for p, s in sources:
            try:
                convert_source(s, p)
            except Exception as exc:  # NotImplementedError / ConvertError until convert handles the file
                convert_failures.append(f"{Path(p).name}: {type(exc).__name__}")

    t_parse = best_of(repeat, parse)
    t_check = best_of(repeat, check)
    print(f"corpus: {len(sources)} files, {kloc * 1000:.0f} lines (best of {repeat})")
    print(f"  libcst parse : {t_parse / kloc * 1000:8.1f} ms per 1000 lines   (1.0x)")
    print(f"  check        : {t_check / kloc * 1000:8.1f} ms per 1000 lines   ({t_check / t_parse:.1f}x parse)")
    if convert_source is not None:
        t_convert = best_of(repeat, convert)
        note = f"   [{len(convert_failures)} files raised: {', '.join(convert_failures[:3])}]" if convert_failures else ""
        print(f"  convert      : {t_convert / kloc * 1000:8.1f} ms per 1000 lines   ({t_convert / t_parse:.1f}x parse){note}")


def tree(files: list[Path], count: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ddpify-bench-"))
    try:
        for i in range(count):
            src = files[i % len(files)]
            folder = tmp / f"pkg{i // 50}"
            folder.mkdir(exist_ok=True)
            shutil.copy(src, folder / f"m{i}_{src.name}")
        lines = sum(p.read_text().count("\n") + 1 for p in tmp.rglob("*.py"))
        codes = frozenset(select_rules(None))
        tasks = [(p, codes) for p in iter_python_files([tmp], Config())]
        cores = os.cpu_count() or 1
        print(f"tree: {len(tasks)} files, {lines} lines")
        for jobs in sorted({1, cores}):
            start = time.perf_counter()
            results = check_paths(tasks, jobs=jobs)
            elapsed = time.perf_counter() - start
            n = sum(len(r.findings) for r in results)
            print(f"  check --jobs {jobs:<3}: {elapsed:6.2f} s  ({len(tasks) / elapsed:6.1f} files/s, {n} findings)")
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--files", type=int, default=300)
    args = parser.parse_args()
    files = corpus()
    per_file(files, args.repeat)
    tree(files, args.files)


if __name__ == "__main__":
    main()
