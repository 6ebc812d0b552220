"""Facts from a brief run of the original script (`ddpify convert --run`), read from its trace.

The tracer (ddpify/verify/tracer.py) runs the script as one process and notes, with the script
line of each, what it did: the loaders and which one fed the optimizer steps, the optimizers and
the models whose first training forward ran (on which device, and their batches), the files
written and read, what each torch.save stored, the environment variables set and the seeds. This
module turns that JSON into facts the passes can ask by module and line, before they fall back on
the static analysis. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Site:
    """Where something happened: a module of the project (dotted name, "" for the entry) and a line."""

    module: str
    line: int
    path: str  # as the run saw it, relative to the project root

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Stored:
    """One thing a torch.save stored: "state_dict" (of the trained model `model`; `prefixed`: its
    keys start with `module.`), "module" (a whole module of class `model`; `trained`: a model an
    optimizer trains), or "optimizer" (an optimizer's state_dict); `key`: the key of the saved
    dict it sits under, None for the saved object itself."""

    kind: str
    key: str | None = None
    model: str | None = None
    prefixed: bool = False
    trained: bool = False

    def __str__(self) -> str:
        what = {"state_dict": f"{self.model}'s state_dict" + (" (keys with `module.`)" if self.prefixed else ""),
                "module": f"the whole {self.model}" + ("" if self.trained else " (a module no optimizer trains)"),
                "optimizer": "an optimizer's state"}[self.kind]  # fmt: skip
        return what if self.key is None else f"{what} under {self.key!r}"


@dataclass(frozen=True)
class Saved:
    """A torch.save the run saw: where, and what it stored."""

    site: Site
    stores: tuple[Stored, ...]

    @property
    def holds_model(self) -> bool:
        """Does it store a trained model: its state_dict, or the module itself?"""
        return any(s.kind == "state_dict" or s.kind == "module" and s.trained for s in self.stores)


@dataclass
class RunFacts:
    """What the original did in a brief run, by site."""

    steps: int = 0  # optimizer steps taken
    train_loader: Site | None = None  # where the DataLoader that fed the optimizer steps was made
    pass_starts: list[Site] = field(default_factory=list)  # where a pass over it began (`for` over it, `iter(it)`)
    loaders: list[Site] = field(default_factory=list)
    loaderless: bool = False  # optimizer steps with no DataLoader pass (generated batches, episodes, hand slicing)
    drawn: bool = False  # the models' inputs changed from step to step (not the whole data set every step)
    models: list[tuple[str, Site]] = field(default_factory=list)  # (class, first training forward)
    optimizers: list[tuple[str, Site]] = field(default_factory=list)
    env_set: list[tuple[str, Site]] = field(default_factory=list)
    seeds: list[tuple[str, Site]] = field(default_factory=list)  # (torch | numpy | random | torch.cuda, where)
    written: list[tuple[str, Site]] = field(default_factory=list)  # (path relative to the run's folder, where)
    read_back: list[tuple[Site, Site]] = field(default_factory=list)  # (where a file was read, where it was written before)
    saves: list[Saved] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # model class -> the device of its parameters
    batch_devices: dict[str, str] = field(default_factory=dict)  # model class -> the device of its first training batch
    cuda_available: bool | None = None  # could the run see a GPU (None: no model trained)

    @classmethod
    def from_trace(cls, trace: dict, entry: str, cwd: str = "") -> RunFacts:
        """`entry`: the script's path relative to the project root; `cwd`: the folder the run ran
        in, relative to that root (the run names its lines relative to it)."""
        at = _Sites(entry, trace.get("cwd") or "", cwd)
        loaders = trace.get("loaders", [])
        steps: Counter = Counter()
        for p in trace.get("passes", []):
            if p.get("steps") and p.get("loader") is not None:
                steps[p["loader"]] += p["steps"]
        total = sum(len(s) for s in trace.get("optimizer_steps", []))
        trained = steps.most_common(1)[0][0] if steps else None
        by_id = {item["id"]: item for item in loaders}
        facts = cls(
            steps=total,
            train_loader=at.site((by_id.get(trained) or {}).get("where")),
            loaders=[s for s in (at.site(item.get("where")) for item in loaders) if s],
            loaderless=total > 0 and not steps,
            drawn=len(set(trace.get("forward_inputs") or [])) > 1,
        )
        starts = (("", p.get("where")) for p in trace.get("passes", []) if trained is not None and p["loader"] == trained)
        facts.pass_starts = [site for _, site in _sited(at, starts)]
        facts.models = _sited(at, ((f["module"], f.get("where")) for f in trace.get("unwrapped_forwards", [])))
        facts.optimizers = _sited(at, ((o["type"], o.get("where")) for o in trace.get("optimizer_info", [])))
        facts.env_set = _sited(at, ((e["name"], e.get("where")) for e in trace.get("env_set", [])))
        facts.seeds = _sited(at, ((s["kind"], s.get("where")) for s in trace.get("seeds", [])))
        written = ((at.relative(f["path"]), f.get("where")) for f in trace.get("files", []) if "r" not in f["mode"])
        facts.written = _sited(at, ((p, w) for p, w in written if p is not None))
        facts.read_back = _read_back(at, trace.get("files", []))
        facts.saves = _saves(at, trace.get("saves", []))
        for f in trace.get("unwrapped_forwards", []):
            if f.get("device"):
                facts.devices.setdefault(f["module"], f["device"])
            if f.get("batch_device"):
                facts.batch_devices.setdefault(f["module"], f["batch_device"])
        facts.cuda_available = trace.get("cuda_available")
        return facts

    def saved_at(self, module: str, first: int, last: int) -> list[Saved]:
        """The saves the run saw at lines `first`..`last` of `module`."""
        return [s for s in self.saves if first <= s.site.line <= last and _same(s.site.module, module)]

    def on_cpu_beside_a_gpu(self) -> list[str]:
        """The models that trained on the CPU although the run could see a GPU."""
        return [m for m, d in self.devices.items() if self.cuda_available and d == "cpu"]

    def writer_of(self, module: str, line: int) -> Site | None:
        """Where the file the run read at `module:line` had been written."""
        return next((w for r, w in self.read_back if r.line == line and _same(r.module, module)), None)

    def lines(self, what: str, module: str) -> set[int]:
        """The lines of `module` where the run saw `what`: "train_loader", "pass_start", "loader", "env:NAME",
        "seed", "optimizer", "model", "write", "save" (a torch.save), "model_save" (a torch.save
        of a trained model's state_dict or of the model itself)."""
        if what == "train_loader":
            sites = [self.train_loader] if self.train_loader else []
        elif what == "pass_start":
            sites = self.pass_starts
        elif what == "read_back":
            sites = [r for r, _ in self.read_back]
        elif what == "loader":
            sites = self.loaders
        elif what in ("save", "model_save"):
            sites = [s.site for s in self.saves if what == "save" or s.holds_model]
        elif what.startswith("env:"):
            sites = [s for name, s in self.env_set if name == what[4:]]
        else:
            sites = [s for _, s in {"seed": self.seeds, "optimizer": self.optimizers, "model": self.models,
                                    "write": self.written}[what]]  # fmt: skip
        return {s.line for s in sites if _same(s.module, module)}

    def summary(self) -> list[str]:
        """What the run told the conversion, a line each, for the summary."""
        out = [f"the run took {self.steps} optimizer step(s)"]
        if self.train_loader:
            out.append(f"the training batches came from the DataLoader made at {self.train_loader}")
        elif self.loaderless:
            how = "a different batch each step" if self.drawn else "the same data every step"
            out.append(f"the training batches came from no DataLoader ({how})")
        out += [f"{cls} trains (first training forward at {site})" for cls, site in self.models]
        out += [self._placement(cls) for cls in self.devices]
        out += [f"the checkpoint saved at {s.site} stores " + _listed([str(x) for x in s.stores])
                for s in self.saves if s.stores]  # fmt: skip
        out += [f"the script sets {name} at {site}" for name, site in self.env_set]
        if self.seeds:
            out.append("the script seeds " + ", ".join(sorted({kind for kind, _ in self.seeds}))
                       + " at " + ", ".join(sorted({str(s) for _, s in self.seeds})))  # fmt: skip
        return out


    def _placement(self, cls: str) -> str:
        line = f"{cls} trained on {self.devices[cls]}"
        if cls in self.batch_devices:
            line += f", its batches on {self.batch_devices[cls]}"
        if cls in self.on_cpu_beside_a_gpu():
            line += " (a GPU was there: it stays on the CPU, so each process trains it there and DDP gets no device_ids)"
        return line


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _saves(at: _Sites, saves: list[dict]) -> list[Saved]:
    """Each save site once, with what the first save there stored."""
    found: dict[Site, Saved] = {}
    for item in saves:
        site = at.site(item.get("where"))
        if site is None or site in found:
            continue
        stores = tuple(
            Stored(s["kind"], s.get("key"), s.get("model") or s.get("module"), bool(s.get("prefixed")), bool(s.get("trained")))
            for s in item.get("stores") or ()
        )
        found[site] = Saved(site, stores)
    return list(found.values())


def _same(found: str, module: str) -> bool:
    """Is a site's module (named from its path under the root) the project's `module`?"""
    return found == module or bool(module) and found.endswith("." + module)


def _read_back(at: _Sites, files: list[dict]) -> list[tuple[Site, Site]]:
    """Each read of a file the run had written before, with where it was written."""
    pairs, writers = [], {}
    for item in files:
        where = at.site(item.get("where"))
        if where is None:
            continue
        if any(m in item["mode"] for m in "wax"):
            writers.setdefault(item["path"], where)
        elif item["path"] in writers and (where, writers[item["path"]]) not in pairs:
            pairs.append((where, writers[item["path"]]))
    return pairs


def _sited(at: _Sites, items) -> list[tuple[str, Site]]:
    found = []
    for what, where in items:
        site = at.site(where)
        if site is not None and (what, site) not in found:
            found.append((what, site))
    return found


@dataclass
class _Sites:
    """The run's `file:line` strings (relative to the folder it ran in) as sites by module."""

    entry: str
    cwd: str  # absolute, as the run saw it
    base: str = ""  # the run's folder relative to the project root

    def site(self, where: str | None) -> Site | None:
        if not where or ":" not in where:
            return None
        path, _, line = where.rpartition(":")
        path = os.path.normpath(os.path.join(self.base, path))
        if path.startswith(".."):
            return None  # outside the run's folder: not the project's code
        module = "" if path == os.path.normpath(self.entry) else path.removesuffix(".py").replace(os.sep, ".")
        return Site(module.removesuffix(".__init__"), int(line), path)

    def relative(self, path: str) -> str | None:
        if not self.cwd:
            return None
        rel = os.path.relpath(path, self.cwd)
        return None if rel.startswith("..") else rel
