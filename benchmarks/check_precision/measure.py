"""Measure the precision of ``ddpify check`` on expert DDP codebases.

Usage::

    python benchmarks/check_precision/measure.py --root /tmp/prec
    python benchmarks/check_precision/measure.py --fetch-help

``--root`` holds one exported snapshot per project, named ``<owner>+<name>``
(see README.md).  For every row of ``projects.tsv`` the script runs
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
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent


def read_tsv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


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
    return "\n".join(lines)


def run_check(root: Path, project: dict[str, str], ddpify_dir: Path = REPO_ROOT) -> tuple[list[dict], int]:
    folder = root / project["repo"].replace("/", "+")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="folder holding <owner>+<name> snapshots")
    parser.add_argument("--projects", type=Path, default=HERE / "projects.tsv")
    parser.add_argument("--labels", type=Path, default=HERE / "labels.tsv")
    parser.add_argument("--fetch-help", action="store_true", help="say which snapshots to export")
    parser.add_argument("--write-unlabelled", type=Path, help="append unlabelled findings here")
    parser.add_argument("--prune", action="store_true", help="list labels that matched no finding")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every finding")
    parser.add_argument("--ddpify", type=Path, default=REPO_ROOT,
                        help="folder whose ddpify package is checked (another checkout: the before figure)")
    parser.add_argument("--only", help="measure only the projects whose repo contains this text")
    args = parser.parse_args()

    projects = read_tsv(args.projects)
    if args.fetch_help or args.root is None:
        print(fetch_help(projects))
        return 0

    labels: dict[tuple[str, str, str, str], dict[str, str]] = {}
    if args.labels.exists():
        for row in read_tsv(args.labels):
            labels[(row["repo"], row["path"], row["line"], row["code"])] = row

    counts: collections.Counter[str] = collections.Counter()
    per_code: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    unlabelled: list[list[str]] = []
    used: set[tuple[str, str, str, str]] = set()
    duplicates = 0
    if args.only:
        projects = [p for p in projects if args.only in p["repo"]]
    for project in projects:
        findings, errors = run_check(args.root, project, args.ddpify)
        counts["errors"] += errors
        seen: set[tuple[str, int, int, str]] = set()
        for finding in findings:
            spot = (finding["path"], finding["line"], finding["column"], finding["code"])
            if spot in seen:
                duplicates += 1
            seen.add(spot)
            key = (project["repo"], finding["path"], str(finding["line"]), finding["code"])
            counts["findings"] += 1
            label = labels.get(key)
            verdict = label["verdict"] if label else "unlabelled"
            if label:
                used.add(key)
            counts[verdict] += 1
            per_code[finding["code"]][verdict] += 1
            if args.verbose:
                print(f"{project['repo']} {finding['path']}:{finding['line']}:{finding['column']} "
                      f"{finding['code']} [{verdict}] {finding['message']}")
            if not label:
                unlabelled.append([*key, "?", finding["message"]])

    if args.write_unlabelled and unlabelled:
        with args.write_unlabelled.open("a", newline="") as handle:
            writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
            writer.writerows(unlabelled)
    if args.prune:
        for key in sorted(set(labels) - used):
            print("stale label:", *key)

    total = counts["findings"]
    false = counts["false"]
    print(f"projects:          {len(projects)}")
    print(f"findings:          {total}")
    print(f"true:              {counts['true']}")
    print(f"debatable:         {counts['debatable']}")
    print(f"false:             {false}")
    print(f"unlabelled:        {counts['unlabelled']}")
    print(f"duplicates:        {duplicates}")
    print(f"internal errors:   {counts['errors']}")
    share = 100.0 * false / total if total else 0.0
    print(f"false-alarm share: {share:.1f}%")
    print("per code (true/debatable/false/unlabelled):")
    for code in sorted(per_code):
        c = per_code[code]
        print(f"  {code}: {c['true']}/{c['debatable']}/{c['false']}/{c['unlabelled']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
