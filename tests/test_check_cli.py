"""`ddpify check` / `rules` / `rule` through the typer app: formats, selection, noqa, config, exit codes, --fix."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddpify.check.cli import make_app

runner = CliRunner()
APP = make_app()

BAD = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader


    def main(ds, sampler):
        dist.init_process_group("gloo")
        loader = DataLoader(ds, batch_size=8, shuffle=True, sampler=sampler)
        state = torch.load("ckpt.pt")
        dist.destroy_process_group()
    """
)


def run(*args: str):
    return runner.invoke(APP, list(args))


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    p = tmp_path / "train.py"
    p.write_text(BAD)
    return p


def test_text_output_and_exit_code(bad):
    r = run("check", str(bad))
    assert r.exit_code == 1
    assert f"{bad}:8:43: DDP111 [*] `shuffle=True`" in r.output
    assert f"{bad}:9:13: DDP109 [*]" in r.output
    assert "Found 2 findings (2 fixable with --fix)." in r.output
    assert "\x1b[" not in r.output  # no colour when not a terminal


def test_clean_file_exits_zero(tmp_path):
    p = tmp_path / "ok.py"
    p.write_text("import torch\nprint(torch.ones(1))\n")
    r = run("check", str(p))
    assert r.exit_code == 0 and r.output == "All checks passed!\n"
    assert run("check", "--output-format", "json", str(p)).output == "[]\n"


def test_json_format(bad):
    r = run("check", "--format", "json", str(bad))
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert [d["code"] for d in data] == ["DDP111", "DDP109"]
    assert set(data[0]) == {"path", "line", "column", "end_line", "end_column", "code", "message", "severity", "fixable", "fix"}
    assert data[0]["fix"] == "safe"
    assert data[0]["line"] == 8 and data[0]["column"] == 43 and data[0]["end_line"] == 8
    assert data[0]["fixable"] is True and data[0]["severity"] == "error"


def test_json_empty_is_an_empty_array(tmp_path):
    p = tmp_path / "ok.py"
    p.write_text("x = 1\n")
    r = run("check", "--format", "json", str(p))
    assert r.exit_code == 0 and json.loads(r.output) == []


def test_github_format(bad):
    r = run("check", "--format", "github", str(bad))
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"::error file={bad},line=8,col=43,endLine=8,")
    assert "title=DDP111::DDP111 `shuffle=True`" in lines[0]


def test_select_and_ignore_by_code_and_prefix(bad):
    assert "DDP109" not in run("check", "--ignore", "DDP109", str(bad)).output
    r = run("check", "--select", "DDP10", str(bad))
    assert "DDP109" in r.output and "DDP111" not in r.output
    r = run("check", "--select", "DDP2", str(bad))
    assert r.exit_code == 0
    r = run("check", "--ignore", "DDP109,DDP111", str(bad))
    assert r.exit_code == 0


def test_opinionated_rules_off_by_default(tmp_path):
    p = tmp_path / "t.py"
    p.write_text("import torch.distributed as dist\nfrom torch.utils.data import DataLoader\nl = DataLoader(ds)\n")
    assert run("check", str(p)).exit_code == 0
    r = run("check", "--extend-select", "DDP9", str(p))
    assert r.exit_code == 1 and "DDP902" in r.output


def test_unknown_selector_is_a_usage_error(bad):
    r = run("check", "--select", "XYZ1", str(bad))
    assert r.exit_code == 2 and "unknown rule code" in r.output


def test_missing_path_and_bad_format_are_usage_errors(tmp_path, bad):
    assert run("check", str(tmp_path / "nope.py")).exit_code == 2
    assert run("check", "--format", "xml", str(bad)).exit_code == 2


def test_statistics(bad):
    r = run("check", "--statistics", str(bad))
    assert r.exit_code == 1
    assert "1\tDDP109\t[*] torch-load-without-map-location" in r.output
    assert "1\tDDP111\t[*] shuffle-with-sampler" in r.output


def test_noqa(tmp_path):
    src = BAD.replace('sampler=sampler)', 'sampler=sampler)  # noqa: DDP111').replace(
        'torch.load("ckpt.pt")', 'torch.load("ckpt.pt")  # noqa'
    )
    p = tmp_path / "t.py"
    p.write_text(src)
    assert run("check", str(p)).exit_code == 0
    p.write_text(BAD.replace('sampler=sampler)', 'sampler=sampler)  # noqa: DDP109'))
    r = run("check", str(p))
    assert "DDP111" in r.output  # a noqa for another code suppresses nothing here


def test_config_discovered_from_parent_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.ddpify]\nignore = ["DDP109"]\n'
        'per-file-ignores = {"scripts/*" = ["DDP111"]}\nexclude = ["vendored"]\n'
    )
    (tmp_path / "scripts").mkdir()
    (tmp_path / "vendored").mkdir()
    (tmp_path / "scripts" / "a.py").write_text(BAD)
    (tmp_path / "b.py").write_text(BAD)
    (tmp_path / "vendored" / "c.py").write_text(BAD)
    r = run("check", "--format", "json", str(tmp_path))
    got = {(Path(d["path"]).name, d["code"]) for d in json.loads(r.output)}
    assert got == {("b.py", "DDP111")}
    # a file under the config's folder finds it too
    r = run("check", "--format", "json", str(tmp_path / "scripts" / "a.py"))
    assert json.loads(r.output) == []


def test_config_select_and_cli_override(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ddpify]\nselect = ["DDP109"]\n')
    (tmp_path / "t.py").write_text(BAD)
    codes = {d["code"] for d in json.loads(run("check", "--format", "json", str(tmp_path)).output)}
    assert codes == {"DDP109"}
    codes = {d["code"] for d in json.loads(run("check", "--format", "json", "--select", "DDP111", str(tmp_path)).output)}
    assert codes == {"DDP111"}


def test_bad_config_is_a_usage_error(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.ddpify]\nselekt = ["DDP1"]\n')
    (tmp_path / "t.py").write_text(BAD)
    r = run("check", str(tmp_path))
    assert r.exit_code == 2 and "selekt" in r.output


def test_directory_walk_skips_default_excludes(tmp_path):
    for d in (".venv", "build", "__pycache__", "node_modules", "pkg"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "t.py").write_text(BAD)
    r = run("check", "--format", "json", str(tmp_path))
    assert {Path(d["path"]).parent.name for d in json.loads(r.output)} == {"pkg"}


def test_parse_error_reported_and_others_still_checked(tmp_path, bad):
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n    pass\n")
    r = run("check", "--format", "json", str(tmp_path))
    data = json.loads(r.output)
    assert r.exit_code == 1
    assert any(d["code"] == "DDP000" and d["path"].endswith("broken.py") for d in data)
    assert any(d["code"] == "DDP111" and d["path"].endswith("train.py") for d in data)


def test_parallel_jobs_give_the_same_result(tmp_path):
    for i in range(8):
        (tmp_path / f"t{i}.py").write_text(BAD)
    one = json.loads(run("check", "--format", "json", "--jobs", "1", str(tmp_path)).output)
    many = json.loads(run("check", "--format", "json", "--jobs", "2", str(tmp_path)).output)
    assert one == many and len(one) == 16


def test_fix_rewrites_and_is_stable(bad):
    r = run("check", "--fix", str(bad))
    assert r.exit_code == 0, r.output
    assert "Fixed 2 findings." in r.output
    text = bad.read_text()
    assert 'DataLoader(ds, batch_size=8, sampler=sampler)' in text
    assert 'torch.load("ckpt.pt", map_location="cpu")' in text
    compile(text, str(bad), "exec")
    assert run("check", "--fix", str(bad)).exit_code == 0
    assert bad.read_text() == text


def test_fix_leaves_report_only_findings(tmp_path):
    p = tmp_path / "t.py"
    p.write_text(BAD.replace('"ckpt.pt")', '"ckpt.pt")\n    dist.barrier() if False else None\n    torch.save(state, "x.pt")'))
    r = run("check", "--fix", str(p))
    assert r.exit_code == 1
    assert "DDP301" in r.output and "DDP111" not in r.output


def test_rules_and_rule_pages():
    r = run("rules")
    assert r.exit_code == 0
    assert "DDP120" in r.output and "save-ddp-state-dict" in r.output
    r = run("rule", "ddp120")
    assert r.exit_code == 0
    assert "# save-ddp-state-dict (DDP120)" in r.output and "## Why is this bad?" in r.output
    assert run("rule", "DDP999").exit_code == 2


def test_main_cli_registers_commands():
    from ddpify.cli import app

    r = runner.invoke(app, ["rules"])
    assert r.exit_code == 0 and "DDP101" in r.output


def test_check_reads_coding_cookies_and_fix_keeps_encoding_and_bom(tmp_path):
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + BAD.encode())
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbf" + BAD.encode())
    r = run("check", "--fix", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert latin.read_bytes().startswith(b"# -*- coding: latin-1 -*-\n# caf\xe9\n")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
    assert 'map_location="cpu"' in latin.read_bytes().decode("latin-1") and 'map_location="cpu"' in bom.read_text("utf-8-sig")


def test_fix_with_a_file_it_cannot_write_reports_it_in_one_line_and_fixes_the_others(tmp_path, monkeypatch):
    import ddpify.check.runner as runner_module

    locked, free = tmp_path / "locked.py", tmp_path / "free.py"
    locked.write_text(BAD)
    free.write_text(BAD)
    real = runner_module.write_atomic

    def write_atomic(path, data):  # a read-only file (this suite may run as root, who writes anyway)
        if path == locked:
            raise PermissionError(13, "Permission denied", str(path))
        real(path, data)

    monkeypatch.setattr(runner_module, "write_atomic", write_atomic)
    r = run("check", "--fix", "--jobs", "1", str(tmp_path))
    assert "Traceback" not in r.output
    assert 'map_location="cpu"' in free.read_text() and locked.read_text() == BAD
    assert f"{locked}: cannot write the fixes: Permission denied" in r.output, r.output
    assert r.exit_code == 2


UNSAFE = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    def main(net):
        dist.init_process_group("gloo")
        model = DDP(net)
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), "model.pt")
        dist.barrier()  # written before any rank reads it
        state = torch.load("model.pt")
        dist.destroy_process_group()
    """
)


def test_exit_zero_and_the_formats_agree(bad):
    assert run("check", "--exit-zero", str(bad)).exit_code == 0
    assert run("check", "--exit-zero", str(bad / "missing.py")).exit_code == 2  # errors still fail
    text = run("check", str(bad)).output
    assert run("check", "--output-format", "concise", str(bad)).output == text  # one line per finding either way
    assert run("check", "--format", "json", str(bad)).output == run("check", "--output-format", "json", str(bad)).output
    lines = run("check", "--output-format", "json-lines", str(bad)).output.splitlines()
    assert [json.loads(line) for line in lines] == json.loads(run("check", "--output-format", "json", str(bad)).output)
    r = run("check", "--output-format", "yaml", str(bad))
    assert r.exit_code == 2 and "unknown format 'yaml'" in r.output


def _sarif_validator():
    import jsonschema  # in the test extra: a missing one fails, never skips
    schema = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
    assert schema["id"].endswith("/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json")  # OASIS's own
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_sarif_is_sarif_2_1_0_with_every_rule(bad, tmp_path, monkeypatch):
    from ddpify.check.rule import all_rules

    monkeypatch.chdir(tmp_path)
    r = run("check", "--output-format", "sarif", "train.py")
    assert r.exit_code == 1
    log = json.loads(r.output)
    validator = _sarif_validator()
    assert list(validator.iter_errors(log)) == []
    assert log["version"] == "2.1.0" and log["$schema"] == "https://json.schemastore.org/sarif-2.1.0.json"
    (sarif_run,) = log["runs"]
    driver = sarif_run["tool"]["driver"]
    assert driver["name"] == "ddpify" and driver["version"]
    assert "informationUri" not in driver  # the package declares no repository URL: none is invented
    assert [rule["id"] for rule in driver["rules"]] == [r.CODE for r in all_rules()]  # stable ids, every rule
    for rule, cls in zip(driver["rules"], all_rules()):
        assert rule["name"] == cls.NAME and rule["shortDescription"]["text"] == cls.MESSAGE
        assert rule["fullDescription"]["text"] == cls.summary() and rule["help"]["markdown"] == cls.doc()
        assert "helpUri" not in rule
        assert rule["defaultConfiguration"]["level"] == ("error" if cls.SEVERITY == "error" else "warning")
    results = sarif_run["results"]
    assert [res["ruleId"] for res in results] == ["DDP111", "DDP109"]
    for res in results:
        assert driver["rules"][res["ruleIndex"]]["id"] == res["ruleId"] and res["level"] == "error"
        location = res["locations"][0]["physicalLocation"]
        assert location["artifactLocation"] == {"uri": "train.py", "uriBaseId": "%SRCROOT%"}
    assert results[0]["locations"][0]["physicalLocation"]["region"] == {
        "startLine": 8, "startColumn": 43, "endLine": 8, "endColumn": 55
    }
    # an absolute path under the current folder is still relative to the checkout
    assert json.loads(run("check", "--output-format", "sarif", str(bad)).output) == log
    # and a clean run is a valid log with every rule and no result
    (tmp_path / "ok.py").write_text("x = 1\n")
    clean = json.loads(run("check", "--output-format", "sarif", "ok.py").output)
    assert list(validator.iter_errors(clean)) == [] and clean["runs"][0]["results"] == []


def test_sarif_paths_in_subfolders_and_outside_the_checkout(tmp_path, monkeypatch):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "train.py").write_text(BAD)
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    log = json.loads(run("check", "--output-format", "sarif", str(tmp_path / "src")).output)
    assert list(_sarif_validator().iter_errors(log)) == []
    location = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert location == {"uri": (tmp_path / "src" / "pkg" / "train.py").as_uri()}  # no %SRCROOT% to be under
    monkeypatch.chdir(tmp_path)
    log = json.loads(run("check", "--output-format", "sarif", "src").output)
    location = log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert location == {"uri": "src/pkg/train.py", "uriBaseId": "%SRCROOT%"}


def test_the_sarif_validator_rejects_a_broken_log(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = json.loads(run("check", "--output-format", "sarif", "train.py").output)
    del log["runs"][0]["results"][0]["message"]
    assert list(_sarif_validator().iter_errors(log))


def test_unsafe_fixes_need_their_own_flag(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(UNSAFE)
    r = run("check", str(p))
    assert f"{p}:10:20: DDP120 `state_dict()`" in r.output  # no [*]: --fix alone will not apply it
    assert f"{p}:12:13: DDP109 [*]" in r.output
    assert "Found 2 findings (1 fixable with --fix). (1 hidden fix can be enabled with the --unsafe-fixes option.)" in r.output
    safe = run("check", "--fix", str(p))
    assert "Fixed 1 finding." in safe.output and "model.state_dict()" in p.read_text()
    assert "map_location" in p.read_text()
    unsafe = run("check", "--fix", "--unsafe-fixes", str(p))
    assert unsafe.exit_code == 0 and "Fixed 1 finding." in unsafe.output and "All checks passed!" in unsafe.output
    assert "model.module.state_dict()" in p.read_text()
    assert "DDP120  default  unsafe" in run("rules").output and "DDP109  default  safe" in run("rules").output


def test_only_unsafe_fixes_left(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(UNSAFE.replace('torch.load("model.pt")', 'torch.load("model.pt", map_location="cpu")'))
    r = run("check", "--fix", str(p))
    assert r.exit_code == 1 and "Fixed" not in r.output
    assert r.output.endswith("Found 1 finding. (1 hidden fix can be enabled with the --unsafe-fixes option.)\n")
    data = json.loads(run("check", "--output-format", "json", str(p)).output)
    assert [(d["code"], d["fixable"], d["fix"]) for d in data] == [("DDP120", False, "unsafe")]
    data = json.loads(run("check", "--output-format", "json", "--unsafe-fixes", str(p)).output)
    assert [(d["code"], d["fixable"], d["fix"]) for d in data] == [("DDP120", True, "unsafe")]
    assert f"{p}:10:20: DDP120 [*]" in run("check", "--unsafe-fixes", str(p)).output
    page = run("rule", "DDP120").output
    assert "fixable with --fix --unsafe-fixes (an unsafe fix: see Fix safety)." in page and "/ DDP;" in page
    assert "fixable with --fix;" not in page and "fixable with --fix." in run("rule", "DDP109").output


def test_statistics_in_json_and_text(bad, tmp_path):
    r = run("check", "--statistics", "--output-format", "json", str(bad))
    assert r.exit_code == 1
    assert json.loads(r.output) == [{"code": "DDP109", "count": 1}, {"code": "DDP111", "count": 1}]
    r = run("check", "--statistics", "--exit-zero", str(bad))
    assert r.exit_code == 0 and r.output.endswith("Found 2 findings (2 fixable with --fix).\n")
    clean = tmp_path / "clean.py"
    clean.write_text("x = 1\n")
    assert json.loads(run("check", "--statistics", "--output-format", "json", str(clean)).output) == []


def test_exit_zero_keeps_the_output(bad, tmp_path):
    r = run("check", "--exit-zero", "--output-format", "json", str(bad))
    assert r.exit_code == 0 and len(json.loads(r.output)) == 2
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n")
    assert run("check", "--exit-zero", str(broken)).exit_code == 0  # a syntax error is a finding (DDP000)
    binary = tmp_path / "blob.py"
    binary.write_bytes(b"\x00\xff\xfe" * 10)
    r = run("check", "--exit-zero", str(binary))
    assert r.exit_code == 2 and "error: " in r.output  # a file it cannot read is an error, not a finding


def test_formats_in_help_and_the_old_flag_hidden():
    out = run("check", "--help").output
    assert "--output-format" in out and "--exit-zero" in out and "--unsafe-fixes" in out
    assert "--format " not in out


def test_help_strings_are_short_sentences():
    import typer.main

    from ddpify.check.cli import make_app

    group = typer.main.get_command(make_app())
    for command in group.commands.values():
        assert command.help and command.help.strip().endswith("."), command.name
        for param in command.params:
            text = getattr(param, "help", None)
            if param.param_type_name == "option" or text:  # typer carries its own click: no import of click
                assert text and text[0].isupper() and text.endswith(".") and len(text) <= 80, (command.name, param.name, text)


def test_output_quieted_by_a_helper_of_another_module_is_not_flagged(tmp_path: Path):
    """`utils.init_distributed(...)` replaces `print` with a master-only one and turns the other
    ranks' logging down (the helper research code keeps in utils.py): the entry's prints and
    info logs are the master's, so DDP302 and DDP303 stay silent; without the helper they fire."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "utils.py").write_text(textwrap.dedent(
        """\
        import builtins
        import logging

        import torch.distributed as dist


        def init_distributed():
            dist.init_process_group("gloo")
            master = dist.get_rank() == 0
            shown = builtins.print

            def print_on_master(*args, **kwargs):
                if master or kwargs.pop("force", False):
                    shown(*args, **kwargs)

            builtins.print = print_on_master
            logging.getLogger().setLevel(logging.INFO if master else logging.ERROR)
        """
    ))  # fmt: skip
    entry = textwrap.dedent(
        """\
        import logging

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import utils

        log = logging.getLogger(__name__)
        logging.basicConfig(level=logging.INFO)


        def fit(net, batches, sgd):
            utils.init_distributed()
            net = DDP(net)
            for r in range(2):
                batches.sampler.set_epoch(r)
                for x in batches:
                    sgd.zero_grad()
                    net(x).sum().backward()
                    sgd.step()
                print("round", r)
                log.info("round %d", r)
            dist.destroy_process_group()
        """
    )
    (tmp_path / "train.py").write_text(entry)
    quiet = run("check", str(tmp_path / "train.py"))
    assert quiet.exit_code == 0, quiet.output
    (tmp_path / "train.py").write_text(entry.replace("    utils.init_distributed()\n", '    dist.init_process_group("gloo")\n'))
    loud = run("check", str(tmp_path / "train.py"))
    assert "DDP302" in loud.output and "DDP303" in loud.output, loud.output


def test_each_file_of_a_project_is_parsed_once_per_run(tmp_path: Path, monkeypatch):
    """A checked file that other checked files import is parsed once, not once per importer and
    again when it is checked itself (one worker: the run's only process)."""
    import libcst

    from ddpify.check.config import Config
    from ddpify.check.rule import select_rules
    from ddpify.check.runner import check_paths, iter_python_files

    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "helpers.py").write_text("import torch.distributed as dist\n\n\ndef is_main():\n    return dist.get_rank() == 0\n")
    for name in ("train", "evaluate", "export"):
        (tmp_path / f"{name}.py").write_text("import torch.distributed as dist\nfrom helpers import is_main\n\nif is_main():\n    print('ready')\n")
    parsed: list[str] = []
    real = libcst.parse_module
    monkeypatch.setattr(libcst, "parse_module", lambda text, *a, **k: parsed.append(text) or real(text, *a, **k))
    files = iter_python_files([tmp_path], Config())
    results = check_paths([(f, frozenset(select_rules(None))) for f in files], jobs=1)
    assert len(results) == 4 and not any(r.error for r in results)
    assert len(parsed) == 4, f"{len(parsed)} parses of 4 files"


@pytest.mark.parametrize("finished", [True, False], ids=["caller-finishes", "nobody-finishes"])
def test_a_helper_module_is_checked_with_the_files_that_import_it(tmp_path: Path, finished: bool):
    """`dist_utils.py` starts the group, sets nothing and builds the shuffling sampler; the
    training script that imports it destroys the group, sets the GPU and the sampler's epoch:
    the helper is not told it misses them (DDP105, DDP102, DDP112). When no file of the project
    does, the helper is told."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "dist_utils.py").write_text(textwrap.dedent(
        """\
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler


        def start_group():
            dist.init_process_group("nccl")


        def sharded(dataset, batch):
            return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset))
        """
    ))  # fmt: skip
    finish = "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n" if finished else ""
    epoch = "        loader.sampler.set_epoch(epoch)\n" if finished else ""
    end = "    dist.destroy_process_group()\n" if finished else ""
    (tmp_path / "run.py").write_text(
        "import os\n\nimport torch\nimport torch.distributed as dist\n\nfrom common.dist_utils import sharded, start_group\n\n\n"
        "def main(dataset):\n    start_group()\n" + finish + "    loader = sharded(dataset, 32)\n    for epoch in range(3):\n"
        + epoch + "        for batch in loader:\n            pass\n" + end + "\n\nif __name__ == '__main__':\n    main(list(range(64)))\n"
    )
    result = runner.invoke(APP, ["check", str(tmp_path), "--output-format", "json", "--select", "DDP102,DDP105,DDP112"])
    codes = sorted(f["code"] for f in json.loads(result.stdout))
    assert codes == ([] if finished else ["DDP102", "DDP105", "DDP112"]), result.stdout


def test_a_script_that_only_imports_a_distributed_module_is_not_distributed(tmp_path: Path):
    """`evaluate.py` shares the training's settings module, which uses torch.distributed when a
    group exists; it starts no group itself and is run with plain `python`: no rule about ranks
    applies to it. `train.py` starts the group through a helper of that module: it is distributed."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "settings.py").write_text(textwrap.dedent(
        """\
        import os

        import torch.distributed as dist


        def run_name(default):
            names = [os.environ.get("RUN", default)]
            if dist.is_initialized():
                dist.broadcast_object_list(names)
            return names[0]


        def start():
            dist.init_process_group("gloo")
        """
    ))  # fmt: skip
    body = "import torch\n\nimport settings\n\n{start}name = settings.run_name('base')\nweights = torch.load(name + '.pt')\nprint('loaded', name)\n"
    (tmp_path / "evaluate.py").write_text(body.format(start=""))
    (tmp_path / "train.py").write_text(body.format(start="settings.start()\n"))
    result = runner.invoke(APP, ["check", str(tmp_path), "--output-format", "json", "--select", "DDP109,DDP302"])
    found = sorted((Path(f["path"]).name, f["code"]) for f in json.loads(result.stdout))
    assert found == [("train.py", "DDP109"), ("train.py", "DDP302")], result.stdout


def test_print_replaced_by_a_helper_that_the_importer_calls(tmp_path: Path):
    """`engine.py` prints every few steps and imports `misc.py`, whose `start_distributed()`
    replaces `print` with a master-only one; `main.py` calls it, then the engine. The engine's
    prints are the master's: DDP302 stays silent there. Without the call, it fires."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "misc.py").write_text(textwrap.dedent(
        """\
        import builtins

        import torch.distributed as dist


        def start_distributed():
            dist.init_process_group("gloo")
            first = dist.get_rank() == 0
            real_print = builtins.print

            def master_print(*args, **kwargs):
                if first:
                    real_print(*args, **kwargs)

            builtins.print = master_print
        """
    ))  # fmt: skip
    (tmp_path / "engine.py").write_text(textwrap.dedent(
        """\
        import torch.distributed as dist

        import misc


        def train_epoch(model, loader, opt):
            for step, (x, y) in enumerate(loader):
                loss = (model(x) - y).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step % 10 == 0:
                    print("step", step, loss.item(), dist.get_world_size())
        """
    ))  # fmt: skip
    for calls in (True, False):
        start = "misc.start_distributed()\n" if calls else "dist.init_process_group('gloo')\n"
        (tmp_path / "main.py").write_text(
            "import torch.distributed as dist\n\nimport engine\nimport misc\n\n" + start + "engine.train_epoch(None, [], None)\n"
        )
        result = runner.invoke(APP, ["check", str(tmp_path / "engine.py"), "--output-format", "json", "--select", "DDP302"])
        assert [f["code"] for f in json.loads(result.stdout)] == ([] if calls else ["DDP302"]), (calls, result.stdout)


@pytest.mark.parametrize("launcher_sets_up", [True, False], ids=["launcher-sets-up", "launcher-does-not"])
def test_a_trainer_is_checked_with_what_its_launcher_does(tmp_path: Path, launcher_sets_up: bool):
    """`launch.py` spawns one worker per GPU; each worker sees only its own GPU
    (`CUDA_VISIBLE_DEVICES` from its rank) and turns logging down off rank 0, then runs
    `trainer.fit()`. The trainer's `cuda:0` and its info logs are then right (DDP106, DDP303
    silent); when the launcher does neither, both fire."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "trainer.py").write_text(textwrap.dedent(
        """\
        import logging

        import torch
        import torch.distributed as dist

        log = logging.getLogger(__name__)
        logging.basicConfig(level=logging.INFO)


        def fit(rank, world):
            dist.init_process_group("nccl", rank=rank, world_size=world)
            gpu = torch.device("cuda:0")
            weights = torch.zeros(4, device=gpu)
            for step in range(3):
                weights += 1
                log.info("step %d", step)
        """
    ))  # fmt: skip
    setup = (
        "    os.environ['CUDA_VISIBLE_DEVICES'] = str(gpus[rank])\n"
        "    logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.ERROR)\n"
    ) if launcher_sets_up else ""
    (tmp_path / "launch.py").write_text(
        "import logging\nimport os\n\nimport torch.multiprocessing as mp\n\nimport trainer\n\n\n"
        "def worker(rank, gpus):\n" + setup + "    trainer.fit(rank, len(gpus))\n\n\n"
        "if __name__ == '__main__':\n    mp.spawn(worker, args=([0, 1],), nprocs=2)\n"
    )
    result = runner.invoke(APP, ["check", str(tmp_path / "trainer.py"), "--output-format", "json", "--select", "DDP106,DDP303"])
    codes = sorted(f["code"] for f in json.loads(result.stdout))
    assert codes == ([] if launcher_sets_up else ["DDP106", "DDP303"]), result.stdout


DDP_SCRIPT = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(4, 4))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), "m.pt")
        print(model.config)
    dist.destroy_process_group()
    """
)


def test_to_fsdp2_turns_off_the_advice_that_is_ddps_own(tmp_path):
    """`--to fsdp2`: "use `model.module`" (DDP120, DDP124) is the wrong advice for a script
    moving to FSDP2, where there is no wrapper; the rules that hold for both stay on."""
    from ddpify.check.rule import all_rules

    p = tmp_path / "train.py"
    p.write_text(DDP_SCRIPT)
    codes = {f["code"] for f in json.loads(run("check", "--output-format", "json", str(p)).output)}
    assert {"DDP120", "DDP124"} <= codes
    r = run("check", "--output-format", "json", "--to", "fsdp2", str(p))
    assert not {f["code"] for f in json.loads(r.output)} & {r.CODE for r in all_rules() if r.DDP_ONLY}
    assert run("check", "--to", "fsdp3", str(p)).exit_code == 2
    assert "off under --to fsdp2" in run("rule", "DDP120").output
