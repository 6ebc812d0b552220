"""Measure the precision of ``ddpify check`` on expert DDP codebases.

Usage::

    python benchmarks/check_precision/measure.py --root /tmp/prec
    python benchmarks/check_precision/measure.py --root /tmp/prec --fetch --pypi-only
    python benchmarks/check_precision/measure.py --projects heldout.tsv --root /tmp/held
    python benchmarks/check_precision/measure.py --fetch-help

``--root`` holds one exported snapshot per project, named ``<owner>+<name>``
(see README.md).  A project whose commit column reads ``pypi:NAME==VERSION``
is a distribution from PyPI: ``--fetch`` downloads it with ``pip download
--no-deps`` and unpacks it into the root.  For every row of ``projects.tsv`` the script runs
``python -m ddpify check --output-format json`` on the project's paths (from
the project's folder, so the paths in findings are the ones in the table),
matches each finding to ``labels.tsv`` by (repo, path, line, code) and prints
the counts: findings, true, debatable, false, the false-alarm share,
unlabelled findings and duplicates (one code at one line and column twice).

``--write-unlabelled FILE`` appends a row per unlabelled finding (verdict
``?``) for labelling by hand; ``--prune`` prints labels no finding matched.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent


def read_tsv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


def is_pypi(project: dict[str, str]) -> bool:
    return project["commit"].startswith("pypi:")


def project_folder(root: Path, project: dict[str, str]) -> Path:
    return root / project["repo"].replace("/", "+")


def fetch_pypi(root: Path, project: dict[str, str]) -> Path:
    """Download the pinned distribution with ``pip download --no-deps`` and unpack it (once)."""
    folder = project_folder(root, project)
    if folder.exists():
        return folder
    spec = project["commit"].removeprefix("pypi:")
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "--quiet", "--dest", download, spec],
            check=True, capture_output=True, text=True,
        )
        (archive,) = Path(download).iterdir()
        unpacked = folder.with_name(folder.name + ".partial")
        shutil.rmtree(unpacked, ignore_errors=True)  # left by an interrupted run
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as wheel:
                wheel.extractall(unpacked)
        else:
            with tarfile.open(archive) as sdist:
                sdist.extractall(unpacked, filter="data")
        unpacked.rename(folder)
    return folder


def fetch_help(projects: list[dict[str, str]]) -> str:
    lines = [
        "Export each snapshot to DIR/<owner>+<name> at the commit below, e.g.:",
        "  git clone https://github.com/OWNER/NAME DIR/OWNER+NAME",
        "  git -C DIR/OWNER+NAME checkout COMMIT",
        "(only the *.py files are needed).",
        "",
    ]
    for row in projects:
        lines.append(f"{row['repo']}\t{row['commit']}")
    lines.append("Rows whose commit reads pypi:NAME==VERSION are fetched by --fetch (pip download).")
    return "\n".join(lines)


def run_check(root: Path, project: dict[str, str], ddpify_dir: Path = REPO_ROOT) -> tuple[list[dict], int]:
    folder = project_folder(root, project)
    paths = project["paths"].split()
    if not any((folder / marker).exists() for marker in (".git", "pyproject.toml", "setup.py", "setup.cfg")):
        (folder / ".git").mkdir()  # an export has no .git: mark the root a clone would have, as check finds it
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ddpify_dir) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "ddpify", "check", "--output-format", "json",
         "--exit-zero", "-j", "1", *paths],
        cwd=folder, env=env, capture_output=True, text=True, check=False,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    if done.returncode != 0 and not errors:
        raise SystemExit(f"{project['repo']}: check failed\n{done.stderr}")
    for line in errors:
        print(f"{project['repo']}: {line}", file=sys.stderr)
    return json.loads(done.stdout or "[]"), len(errors)


@dataclasses.dataclass
class Measurement:
    projects: int = 0
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_code: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    unlabelled: list = dataclasses.field(default_factory=list)
    used: set = dataclasses.field(default_factory=set)
    duplicates: int = 0
    lines: list = dataclasses.field(default_factory=list)

    @property
    def share(self) -> float:
        total = self.counts["findings"]
        return 100.0 * self.counts["false"] / total if total else 0.0

    def report(self) -> str:
        c = self.counts
        lines = [
            f"projects:          {self.projects}",
            f"findings:          {c['findings']}",
            f"true:              {c['true']}",
            f"debatable:         {c['debatable']}",
            f"false:             {c['false']}",
            f"unlabelled:        {c['unlabelled']}",
            f"duplicates:        {self.duplicates}",
            f"internal errors:   {c['errors']}",
            f"false-alarm share: {self.share:.1f}%",
            "per code (true/debatable/false/unlabelled):",
        ]
        for code in sorted(self.per_code):
            n = self.per_code[code]
            lines.append(f"  {code}: {n['true']}/{n['debatable']}/{n['false']}/{n['unlabelled']}")
        return "\n".join(lines)


def read_labels(path: Path) -> dict[tuple[str, str, str, str], dict[str, str]]:
    if not path.exists():
        return {}
    return {(row["repo"], row["path"], row["line"], row["code"]): row for row in read_tsv(path)}


def measure(root: Path, projects: list[dict[str, str]], labels: dict, ddpify_dir: Path = REPO_ROOT,
            fetch: bool = False) -> Measurement:
    """Check every project and match its findings to the labels."""
    result = Measurement(projects=len(projects))
    for project in projects:
        if fetch and is_pypi(project):
            fetch_pypi(root, project)
        findings, errors = run_check(root, project, ddpify_dir)
        result.counts["errors"] += errors
        seen: set[tuple[str, int, int, str]] = set()
        for finding in findings:
            spot = (finding["path"], finding["line"], finding["column"], finding["code"])
            if spot in seen:
                result.duplicates += 1
            seen.add(spot)
            key = (project["repo"], finding["path"], str(finding["line"]), finding["code"])
            result.counts["findings"] += 1
            label = labels.get(key)
            verdict = label["verdict"] if label else "unlabelled"
            if label:
                result.used.add(key)
            result.counts[verdict] += 1
            result.per_code[finding["code"]][verdict] += 1
            result.lines.append(f"{project['repo']} {finding['path']}:{finding['line']}:{finding['column']} "
                                f"{finding['code']} [{verdict}] {finding['message']}")
            if not label:
                result.unlabelled.append([*key, "?", " ".join(finding["message"].split())])  # one row each
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="folder holding <owner>+<name> snapshots")
    parser.add_argument("--projects", type=Path, default=HERE / "projects.tsv",
                        help="projects table (heldout.tsv: the held-out codebases)")
    parser.add_argument("--labels", type=Path, default=HERE / "labels.tsv")
    parser.add_argument("--fetch-help", action="store_true", help="say which snapshots to export")
    parser.add_argument("--fetch", action="store_true", help="download the pypi: projects missing from the root")
    parser.add_argument("--pypi-only", action="store_true", help="measure only the pypi: projects")
    parser.add_argument("--write-unlabelled", type=Path, help="append unlabelled findings here")
    parser.add_argument("--prune", action="store_true", help="list labels of these projects that matched no finding")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every finding")
    parser.add_argument("--ddpify", type=Path, default=REPO_ROOT,
                        help="folder whose ddpify package is checked (another checkout: the before figure)")
    parser.add_argument("--only", help="measure only the projects whose repo contains this text")
    args = parser.parse_args()

    projects = read_tsv(args.projects if args.projects.is_absolute() or args.projects.exists()
                        else HERE / args.projects)
    if args.fetch_help or args.root is None:
        print(fetch_help(projects))
        return 0
    if args.only:
        projects = [p for p in projects if args.only in p["repo"]]
    if args.pypi_only:
        projects = [p for p in projects if is_pypi(p)]

    labels = read_labels(args.labels)
    result = measure(args.root, projects, labels, args.ddpify, fetch=args.fetch)
    if args.verbose:
        print("\n".join(result.lines))
    if args.write_unlabelled and result.unlabelled:
        new_file = not args.write_unlabelled.exists() or not args.write_unlabelled.stat().st_size
        with args.write_unlabelled.open("a", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
            if new_file:
                writer.writerow(["repo", "path", "line", "code", "verdict", "reason"])
            writer.writerows(result.unlabelled)
    if args.prune:
        measured = {p["repo"] for p in projects}
        for key in sorted(k for k in set(labels) - result.used if k[0] in measured):
            print("stale label:", *key)
    print(result.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
