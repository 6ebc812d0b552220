"""The eleven invariants of a DDP conversion, judged from the traces of the verification runs.

Every check reads traces (JSON written by tracer.py) only, so nothing here imports torch. Each
returns a Result: PASS, FAIL or N/A, a one-line summary a user can act on, and the evidence.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

PASS, FAIL, NA = "PASS", "FAIL", "N/A"

TITLES = {
    1: "process group",
    2: "every trained model in DDP",
    3: "disjoint shards, new order each epoch",
    4: "replicas in sync",
    5: "same mathematics as one process",
    6: "one voice",
    7: "portable checkpoints",
    8: "evaluation adds up",
    9: "no hang, no crash",
    10: "runs as one process",
    11: "resumes from its checkpoint",
}


@dataclass
class Result:
    number: int
    status: str
    summary: str
    evidence: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return TITLES[self.number]


@dataclass
class Runs:
    """What the verification runs left: traces per rank, and how each launch ended."""

    nproc: int
    ddp: list  # trace per rank (None: missing) of the converted script under torchrun
    ordered: list  # the same, unshuffled and seeded (compared with `reference`)
    original: dict | None  # the single-process script as written (or the converted stand-in)
    reference: dict | None  # the single-process reference: batch x nproc, unshuffled, seeded
    plain: dict | None  # the converted script under plain python
    stand_in: bool = False  # the original failed here: the converted script as one process stands in
    stacks: dict = field(default_factory=dict)  # (label, rank) -> stacks of a stopped rank
    hung: set = field(default_factory=set)  # labels of runs stopped at the timeout
    stderr: str = ""  # torchrun's stderr, for a crash without a trace
    original_error: str | None = None  # why the original failed here (stand_in)
    resume: list | None = None  # trace per rank of the resume run (None: no resume run was planned)
    resume_how: str = ""  # how the resume run takes the script's load code, or why there is none


# --- helpers -----------------------------------------------------------------------------------


def _ok(trace: dict | None) -> bool:
    return trace is not None and trace.get("exit_code") == 0


def _where(item: dict | None) -> str:
    return f" at {item['where']}" if item and item.get("where") else ""


def _ranks(traces: list) -> str:
    return ", ".join(str(r) for r in traces)


def train_loader(trace: dict | None) -> int | None:
    """The loader whose passes the optimizer steps happened in (most steps)."""
    counts: Counter = Counter()
    for p in (trace or {}).get("passes", []):
        if p.get("steps") and p.get("loader") is not None:
            counts[p["loader"]] += p["steps"]
    return counts.most_common(1)[0][0] if counts else None


def training_passes(trace: dict, loader: int) -> list[dict]:
    return [p for p in trace["passes"] if p["loader"] == loader and p.get("steps")]


TORCH_SAMPLERS = {"RandomSampler", "SequentialSampler", "SubsetRandomSampler", "WeightedRandomSampler", "BatchSampler", "DistributedSampler"}


def sampler_rounds(passes: list[dict], length: int | None) -> list[dict]:
    """Passes of an endless loader (a sampler that starts over inside one iterator) cut into its
    sampler's rounds of `length` indices (in whole batches: where the first index that comes again
    on any rank showed a round ends); other passes as they are."""
    if length is None:
        return passes
    out = []
    for p in passes:
        if p.get("planned") is not None or len(p["indices"]) <= length:
            out.append(p)
            continue
        rounds = [dict(p, indices=[], sizes=[])]
        for batch in batches(p):
            if len(rounds[-1]["indices"]) + len(batch) > length:
                rounds.append(dict(p, indices=[], sizes=[]))
            rounds[-1]["indices"] += batch
            rounds[-1]["sizes"].append(len(batch))
        out += rounds
    return out


def first_round(p: dict) -> int | None:
    """How many indices the pass reads before the batch in which one comes again (None: none does,
    or its sampler is torch's own, which may draw with replacement)."""
    if p.get("planned") is not None or None in p["indices"] or p.get("sampler") in TORCH_SAMPLERS:
        return None
    seen: set = set()
    for batch in batches(p):
        if seen & set(batch) or len(set(batch)) < len(batch):
            return len(seen) or None
        seen |= set(batch)
    return None


def batches(p: dict) -> list[list]:
    out, at = [], 0
    for size in p.get("sizes", []):
        out.append(p["indices"][at : at + size])
        at += size
    return out


def step_differences(a: dict, b: dict) -> list[str]:
    """Where two ranks' parameter checksums first differ: per optimizer, the first step (1-based)
    after which they do; per DDP model, the first training forward before which they do (scripts
    that update parameters by hand have no optimizer steps), or the end."""
    found = []
    for key, what, when, steps in (
        ("optimizer_steps", "optimizer", "after step", "optimizer steps"),
        ("ddp_forwards", "DDP model", "before training forward", "training forwards"),
    ):
        seq_a, seq_b = a.get(key), b.get(key)
        if seq_a is None or seq_b is None:
            continue
        if len(seq_a) != len(seq_b):
            found.append(f"{len(seq_a)} vs {len(seq_b)} {what}s")
            continue
        for i, (sa, sb) in enumerate(zip(seq_a, seq_b)):
            first = next((k for k, (x, y) in enumerate(zip(sa, sb)) if x != y), None)
            if first is not None:
                found.append(f"{what} {i}: ranks first differ {when} {first + 1} (of {len(sa)} / {len(sb)})")
            elif len(sa) != len(sb):
                found.append(f"{what} {i}: {len(sa)} vs {len(sb)} {steps} (identical for the first {min(len(sa), len(sb))})")
    final_a, final_b = a.get("ddp_final"), b.get("ddp_final")
    if final_a is not None and final_b is not None and final_a != final_b and len(final_a) == len(final_b):
        differ = [i for i, (x, y) in enumerate(zip(final_a, final_b)) if x != y]
        found.append(f"DDP model {', '.join(map(str, differ))}: parameters differ at the end of the run")
    final_a, final_b = a.get("final_checksums"), b.get("final_checksums")
    if not found and final_a and final_b and final_a != final_b and len(final_a) == len(final_b):
        differ = [i for i, (x, y) in enumerate(zip(final_a, final_b)) if x != y]  # an edit after the last step
        found.append(f"optimizer {', '.join(map(str, differ))}: parameters differ at the end of the run")
    return found


NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# Clock readings differ from run to run: timestamps, durations, throughput.
TIMES = re.compile(
    r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?"
    r"|\b\d{1,2}:\d\d(?::\d\d)?(?:[.,]\d+)?"
    r"|(?i:\b(?:time|elapsed|took|eta|duration)\b\W*[\d.]+(?:e[-+]?\d+)?\s*(?:ms|s|sec|secs|seconds|min|m)?\b)"
    r"|(?i:[\d.]+\s*(?:ms|s|sec|secs|seconds|it/s|s/it|samples/s|img/s)\b)"
)


def template(line: str) -> str:
    return NUMBER.sub("#", without_times(line)).strip()


def without_times(line: str) -> str:
    return TIMES.sub("<time>", line)


def _lines(trace: dict | None) -> list[tuple[str, str | None]]:
    return [(text, where) for text, where in (trace or {}).get("lines", []) if text.strip()]


def _missing(runs: Runs, traces: list, label: str) -> str | None:
    """Why a run's invariants cannot be judged (a rank left no trace), or None."""
    if all(t is not None for t in traces):
        return None
    missing = [r for r, t in enumerate(traces) if t is None]
    why = "it hung and was stopped (see 9)" if "ddp" in runs.hung else "it crashed or never started (see 9)"
    return f"rank {_ranks(missing)} of the {label} run left no trace: {why}"


# --- 1. process group --------------------------------------------------------------------------


def process_group(runs: Runs) -> Result:
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(1, NA, missing)
    groups = []
    for rank, trace in enumerate(runs.ddp):
        made = trace["init_process_group"]
        if not made:
            return Result(1, FAIL, f"rank {rank} never called init_process_group: each rank trains alone",
                          ["call dist.init_process_group() (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR)"])  # fmt: skip
        groups.append(made[-1])
    sizes = {g["world_size"] for g in groups}
    if sizes != {runs.nproc}:
        return Result(1, FAIL, f"world size {', '.join(map(str, sorted(sizes)))}, not {runs.nproc}: the ranks made separate groups",
                      [f"rank {r}: {g['backend']} group of {g['world_size']}{_where(g)}" for r, g in enumerate(groups)])  # fmt: skip
    ranks = sorted(g["rank"] for g in groups)
    if ranks != list(range(runs.nproc)):
        return Result(1, FAIL, f"the processes took ranks {ranks}, not 0..{runs.nproc - 1}")
    backends = {g["backend"] for g in groups}
    if len(backends) > 1:
        return Result(1, FAIL, f"the ranks use different backends: {', '.join(sorted(backends))}")
    return Result(1, PASS, f"every rank joined one {backends.pop()} group of {runs.nproc}{_where(groups[0])}")


# --- 2. every trained model is wrapped in DDP, before it trains -------------------------------


def wrapped(runs: Runs) -> Result:
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(2, NA, missing)
    trace = runs.ddp[0]
    models, early = trace["ddp_models"], trace["unwrapped_forwards"]
    by_hand = hand_averaged(trace)  # outside DDP, their gradients all-reduced after each backward (MAML's fast weights)
    uncovered = [o for o in trace["uncovered"] if o["optimizer"] not in by_hand]
    early = [f for f in early if not (f.get("optimizers") and set(f["optimizers"]) <= by_hand)]
    if uncovered:
        opt = uncovered[0]
        info = trace["optimizer_info"][opt["optimizer"]]
        named = f" ({early[0]['module']} trained{_where(early[0])})" if early else ""
        return Result(2, FAIL, f"optimizer {opt['optimizer']} ({info['type']}{_where(info)}) trains {opt['missing']} of its "
                      f"{opt['of']} parameters outside DDP{named}: their gradients are never averaged; wrap that model in DDP")  # fmt: skip
    if early:
        first = early[0]
        after = next((m for m in models if m["event"] > first["event"]), None)
        return Result(2, FAIL, f"{first['module']} ran a training forward{_where(first)} before it was wrapped in DDP"
                      f"{_where(after)}: wrap it before the first training step")  # fmt: skip
    hand = [f"optimizer {i} ({trace['optimizer_info'][i]['type']}{_where(trace['optimizer_info'][i])}) trains parameters "
            "outside DDP whose gradients are all-reduced by hand after each backward" for i in sorted(by_hand)]  # fmt: skip
    if not models:
        if by_hand:
            return Result(2, PASS, "no model is wrapped in DDP: every optimizer's gradients are averaged by hand "
                          "(all_reduce after each backward)", hand)  # fmt: skip
        if not trace["optimizers"]:
            return Result(2, NA, "no optimizer and no DDP model in the run")
        return Result(2, FAIL, "no model is wrapped in DistributedDataParallel: gradients are never averaged")
    sharded = all(m.get("kind") == "fsdp2" for m in models)
    how, whose = ("sharded with FSDP2", "sharded") if sharded else ("wrapped in DDP", "DDP")
    shown = [f"{m['module']} ({m['params']} parameters) {how.split()[0]}{_where(m)}" for m in models]
    if by_hand:
        return Result(2, PASS, f"{', '.join(m['module'] for m in models)} {how} before training; the other "
                      "parameters have their gradients averaged by hand", shown + hand)  # fmt: skip
    return Result(2, PASS, f"{', '.join(m['module'] for m in models)} {how} before training; every optimizer "
                  f"trains {whose} parameters only", shown)  # fmt: skip


def hand_averaged(trace: dict) -> set[int]:
    """The optimizers whose parameters outside DDP had their gradients all-reduced by hand at every
    step (the tracer's `hand_averaged`)."""
    return {i for i, done in enumerate(trace.get("hand_averaged") or []) if done}


# --- 3. the training data is sharded -----------------------------------------------------------


def sharded(runs: Runs) -> Result:
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(3, NA, missing)
    loader = train_loader(runs.ddp[0])
    if loader is None:
        replayed = _replayed(runs) or _full_batch_differs(runs)
        if replayed:
            return Result(3, FAIL, replayed)
        if not runs.ddp[0]["loaders"]:
            return Result(3, NA, "the script builds no DataLoader (batches made by hand): nothing to shard")
        return Result(3, NA, "no optimizer step happened while a DataLoader was read")
    info = runs.ddp[0]["loaders"][loader]
    epochs = [training_passes(t, loader) for t in runs.ddp]
    length = min((n for e in epochs for p in e if (n := first_round(p))), default=None)
    epochs = [sampler_rounds(e, length) for e in epochs]
    if all(i is None for e in epochs for p in e for i in p["indices"]):
        return Result(3, NA, f"the training data is an iterable dataset ({info['dataset_type']}){_where(info)}: it has no "
                      "indices to shard; how it splits the stream over ranks is its own code")  # fmt: skip
    n_epochs = min(len(e) for e in epochs)
    universe = _universe(runs.original, info)
    evidence = [f"training loader{_where(info)}: {info['dataset_len']} samples, sampler {epochs[0][0]['sampler']}"]
    for e in range(n_epochs):
        passes = [epochs[r][e] for r in range(runs.nproc)]
        known = all(p.get("planned") is not None for p in passes)
        sets = [set(p["planned"]) if p.get("planned") is not None else set(p["indices"]) - {None} for p in passes]
        if universe and runs.nproc > 1:
            whole = [r for r, s in enumerate(sets) if known and len(s) >= len(universe)]
            if whole:
                return Result(3, FAIL, f"every rank reads the whole training set ({len(universe)} samples, sampler "
                              f"{passes[0]['sampler']}){_where(info)}: give the loader a DistributedSampler", evidence)  # fmt: skip
        pad = _padding(passes[0], len(universe) if universe else None, runs.nproc)
        for a in range(runs.nproc):
            for b in range(a + 1, runs.nproc):
                both = len(sets[a] & sets[b])
                if both > pad:
                    return Result(3, FAIL, f"ranks {a} and {b} both read {both} of the same samples in epoch {e + 1}"
                                  f"{_where(info)}: give the loader a DistributedSampler", evidence)  # fmt: skip
        if known and universe:
            left = len(universe - set().union(*sets))
            if left > (runs.nproc - 1 if passes[0]["sampler"] == "DistributedSampler" else 0):
                return Result(3, FAIL, f"{left} of {len(universe)} training samples are read by no rank in epoch {e + 1}", evidence)
        sizes = "/".join(str(len(s)) for s in sets)
        evidence.append(f"epoch {e + 1}: ranks read {sizes} samples{', disjoint, together all of them' if known else ', disjoint so far'}")
    if same := _same_items(runs):
        return Result(3, FAIL, same, evidence)
    return _order(runs, epochs, n_epochs, evidence)


def _same_items(runs: Runs) -> str | None:
    """The ranks read their own indices, yet fed their models the same inputs in every training
    forward noted, while the original's inputs changed from step to step: the items are drawn at
    random from a seed every rank shares (a dataset whose `__getitem__` ignores the index). A GAN's
    generator may see the same noise on every rank while its critic's real batches differ: no FAIL."""
    noted = [tuple(t.get("forward_inputs") or []) for t in runs.ddp]
    own = (runs.original or {}).get("forward_inputs") or []
    if runs.nproc < 2 or len(set(own)) < 2 or not all(noted) or len(set(noted)) > 1:
        return None
    return (f"the ranks read their own indices, yet fed their models the same batches in all {len(noted[0])} training "
            "forwards noted: the dataset draws its items at random from a seed every rank shares; seed each process "
            "differently once the model is wrapped (torch.manual_seed(seed + rank))")


def _replayed(runs: Runs) -> str | None:
    """Do the ranks replay one run? Every rank fed its model the same inputs in its first training
    forwards, while the original's inputs changed from step to step (so they are drawn, not the
    whole data set each step, which every rank may rightly share)."""
    inputs = [t.get("forward_inputs") or [] for t in runs.ddp]
    first = inputs[0]
    own = (runs.original or {}).get("forward_inputs") or []
    if runs.nproc < 2 or len(first) < 2 or len(set(own)) < 2 or any(i != first for i in inputs[1:]):
        return None
    return (f"every rank trained on the same batches in its first {len(first)} training forwards (one run replayed "
            f"{runs.nproc} times): the batches come from no sharded DataLoader, and every rank makes or draws the same ones; "
            "seed what draws batches, episodes or environment steps by rank, or shard the data")  # fmt: skip


def _full_batch_differs(runs: Runs) -> str | None:
    """Full-batch training (the original fed its model the same inputs every step) on data that
    differs between ranks: each rank built its data its own way (a vocabulary from a set's order,
    which each process's hash seed decides; an unseeded random dataset)."""
    inputs = [(t.get("forward_inputs") or [])[:1] for t in runs.ddp]
    own = (runs.original or {}).get("forward_inputs") or []
    if runs.nproc < 2 or len(own) < 2 or len(set(own)) != 1 or not all(inputs) or len({i[0] for i in inputs}) == 1:
        return None
    return ("the original trains on the same data every step (full batch), but the ranks' first training inputs "
            "differ: each rank built its data its own way (a vocabulary in a set's order, which each process's hash "
            "seed decides; data made at random without a seed); build it alike on every rank (sorted(set(...)), a seed)")  # fmt: skip


def _universe(original: dict | None, info: dict) -> set | None:
    loader = train_loader(original)
    if original is not None and loader is not None:
        first = training_passes(original, loader)[0]
        if first.get("planned") is not None:
            return set(first["planned"])
    return set(range(info["dataset_len"])) if info.get("dataset_len") is not None else None


def _padding(p: dict, n: int | None, nproc: int) -> int:
    """Samples a DistributedSampler repeats to give every rank as many (it pads, it does not drop)."""
    if p["sampler"] != "DistributedSampler" or n is None:
        return 0
    return nproc * math.ceil(n / nproc) - n


def _order(runs: Runs, epochs: list, n_epochs: int, evidence: list[str]) -> Result:
    shuffled = _original_shuffles(runs.original)
    if shuffled is False:
        return Result(3, PASS, "each rank reads its own part of the training set every epoch (the original does not shuffle)", evidence)
    if n_epochs < 2:
        return Result(3, PASS, "each rank reads its own part of the training set (one epoch ran: the order across epochs "
                      "is not checked; let the script run two)", evidence)  # fmt: skip
    first, second = (_sequence(epochs[0][0]), _sequence(epochs[0][1]))
    if first == second:
        return Result(3, FAIL, "rank 0 reads its shard in the same order in epochs 1 and 2: call "
                      "sampler.set_epoch(epoch) at the start of every epoch", evidence)  # fmt: skip
    return Result(3, PASS, "each rank reads its own part of the training set, in a new order every epoch", evidence)


def _sequence(p: dict) -> list:
    return p["planned"] if p.get("planned") is not None and p.get("planned_in_order") else p["indices"]


def _original_shuffles(original: dict | None) -> bool | None:
    loader = train_loader(original)
    if loader is None:
        return None
    passes = training_passes(original, loader)
    if passes[0].get("shuffle"):
        return True
    if len(passes) > 1:
        return passes[0]["indices"] != passes[1]["indices"]
    return passes[0]["indices"] != sorted(passes[0]["indices"], key=lambda i: (i is None, i))


# --- 4. replicas in sync -----------------------------------------------------------------------


def in_sync(runs: Runs) -> Result:
    traces = [t for t in runs.ddp if t is not None]
    if len(traces) < runs.nproc:
        return Result(4, NA, _missing(runs, runs.ddp, "torchrun"))
    steps = [len(s) for s in traces[0]["optimizer_steps"]]
    forwards = [len(f) for f in traces[0]["ddp_forwards"]]
    if not any(steps) and not any(forwards):
        return Result(4, NA, "no optimizer step and no DDP training forward ran")
    problems = []
    for r in range(1, len(traces)):
        problems += [f"rank 0 vs rank {r}: {p}" for p in step_differences(traces[0], traces[r])]
    if problems:
        hint = "gradients are not averaged"
        if traces[0]["no_sync_steps"]:
            hint = f"{traces[0]['no_sync_steps']} optimizer steps ran inside model.no_sync(), so their gradients were never averaged"
        elif not traces[0]["ddp_models"]:
            hint = "no model is wrapped in DDP, so gradients are never averaged"
        return Result(4, FAIL, f"the ranks' parameters part: {problems[0].split(': ', 1)[1]} ({hint})", problems[:8])
    what = f"{sum(steps)} optimizer steps" if any(steps) else f"{sum(forwards)} training forwards"
    return Result(4, PASS, f"every rank holds the same parameters after each of {what}")


# --- 5. the same mathematics as one process with the global batch ------------------------------


def same_math(runs: Runs) -> Result:
    reference, ordered = runs.reference, runs.ordered
    if not _ok(reference):
        return Result(5, NA, "the single-process reference run failed" + (f": {_last_line(reference)}" if reference else ""))
    if not all(_ok(t) for t in ordered):
        return Result(5, NA, "the unshuffled torchrun run did not finish (see 9)")
    diff = ordered[0].get("reference_diff") or {}
    ref_losses = reference["losses"]
    rank_losses = [t["losses"] for t in ordered]
    n = min([len(ref_losses)] + [len(x) for x in rank_losses])
    mean = [sum(x[i] for x in rank_losses) / len(rank_losses) for i in range(n)]
    curves = [f"{f'losses, one process, {runs.nproc}x batch:':<32}{_numbers(ref_losses[:n])}",
              f"{'losses, mean over the ranks:':<32}{_numbers(mean)}"]  # fmt: skip
    data = _same_batches(reference, ordered)
    if data is not None:
        return Result(5, NA, f"the ranks' unshuffled batches are not the reference's ({data}), so the runs cannot be compared", curves)
    apart = next((i for i in range(n) if not math.isclose(ref_losses[i], mean[i], rel_tol=1e-4, abs_tol=1e-6)), None)
    if diff.get("error"):
        return Result(5, FAIL, f"the converted script trains other parameters than the original: {diff['error']}", curves)
    if apart is None and diff.get("allclose") and n:
        return Result(5, PASS, f"the first {n} losses and the parameters after training equal one process at "
                      f"{runs.nproc}x the batch (max |difference| {diff['max_abs']:.2g})", curves)  # fmt: skip
    random = sorted(set(reference["randomness"]) | {r for t in ordered for r in t["randomness"]})
    if random:
        return Result(5, NA, f"{'; '.join(random)}: the runs differ by construction, so they are not compared", curves)
    if train_loader(reference) is None and apart is not None:
        return Result(5, NA, "the batches are made by hand (no DataLoader), so the ranks' data cannot be matched with "
                      "one process's", curves)  # fmt: skip
    if apart is not None:
        return Result(5, FAIL, f"the losses part at step {apart + 1}: {ref_losses[apart]:.6g} (one process at {runs.nproc}x "
                      f"the batch) vs {mean[apart]:.6g} (mean over ranks): the ranks do not compute the global batch's "
                      "gradient", curves)  # fmt: skip
    if not n:
        return Result(5, NA, "no loss was seen (no backward() of a scalar loss)")
    return Result(5, FAIL, f"the parameters after training differ from one process at {runs.nproc}x the batch by "
                  f"{diff.get('max_abs', float('nan')):.3g} ({diff.get('where')})", curves)  # fmt: skip


def _same_batches(reference: dict, ordered: list) -> str | None:
    """Why the ranks' first batches (together) are not the reference's, or None when they are."""
    loader, ranks_loader = train_loader(reference), train_loader(ordered[0])
    if loader is None or ranks_loader is None:
        return None
    ref = batches(training_passes(reference, loader)[0])
    mine = [batches(training_passes(t, ranks_loader)[0]) for t in ordered]
    if all(i is None for b in ref for i in b):
        return "an iterable dataset's batches have no indices to match"
    for i, together in enumerate(zip(*mine)):
        if i >= len(ref):
            break
        if sorted(x for b in together for x in b if x is not None) != sorted(x for x in ref[i] if x is not None):
            return f"batch {i + 1} differs"
    return None


def _numbers(values: list[float], most: int = 8) -> str:
    shown = " ".join(f"{v:.5g}" for v in values[:most])
    return shown + (" ..." if len(values) > most else "")


def _last_line(trace: dict | None) -> str:
    error = (trace or {}).get("error") or ""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no trace"


# --- 6. one voice: prints and files ------------------------------------------------------------


def one_voice(runs: Runs) -> Result:
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(6, NA, missing)
    problems, evidence = [], []
    original = Counter(template(text) for text, _ in _lines(runs.original))
    per_rank = [Counter(template(text) for text, _ in _lines(t)) for t in runs.ddp]
    where = {template(text): w for t in runs.ddp for text, w in _lines(t) if w}
    for line, count in sorted(original.items()):
        printed = [r for r, c in enumerate(per_rank) if c[line]]
        total = sum(c[line] for c in per_rank)
        if len(printed) > 1 and total > count:
            problems.append(f"`{line}`{_at(where.get(line))} is printed by ranks {_ranks(printed)} ({total} times; "
                            f"the original prints it {count}): print on rank 0 only")  # fmt: skip
    extra = {line for c in per_rank[1:] for line in c if not original[line]}
    for line in sorted(extra):
        if sum(1 for c in per_rank if c[line]) > 1:
            problems.append(f"`{line}`{_at(where.get(line))} is printed by several ranks: print on rank 0 only")
    lost = [line for line in original if not any(c[line] for c in per_rank)]
    if lost and runs.original is not None and not runs.stand_in:
        evidence.append(f"printed by the original, by no rank: {', '.join(f'`{x}`' for x in lost[:3])}")
    problems += _files(runs, evidence)
    if problems:
        return Result(6, FAIL, problems[0], problems[1:] + evidence)
    others = sum(sum(c.values()) for c in per_rank[1:])
    evidence.insert(0, f"lines printed: {sum(per_rank[0].values())} by rank 0, {others} by the other ranks")
    return Result(6, PASS, "each message and each file comes from one rank", evidence)


def _at(where: str | None) -> str:
    return f" ({where})" if where else ""


def _relative(path: str, trace: dict) -> str:
    """A file as seen from the run's folder (each run has its own copy)."""
    root = trace.get("cwd") or ""
    return path[len(root) + 1 :] if root and path.startswith(root + "/") else path


def _files(runs: Runs, evidence: list[str]) -> list[str]:
    writers: dict = defaultdict(dict)  # path -> rank -> first write
    readers: dict = defaultdict(dict)
    for rank, trace in enumerate(runs.ddp):
        for f in trace["files"]:
            if f["mode"] == "a-unused":
                continue  # opened to append (a log handler) and never written
            book = writers if f["mode"] == "w" else readers
            book[_relative(f["path"], trace)].setdefault(rank, f)
    problems = []
    for path, ranks in sorted(writers.items()):
        if len(ranks) > 1:
            first = ranks[min(ranks)]
            problems.append(f"{path} is written by ranks {_ranks(sorted(ranks))}{_at(first.get('where'))}: write it on rank 0 only")
            continue
        (writer, write), = ranks.items()
        for reader, read in readers.get(path, {}).items():
            if reader != writer and read["sync"] <= write["sync"]:
                problems.append(f"rank {reader} reads {path}{_at(read.get('where'))} while rank {writer} writes it"
                                f"{_at(write.get('where'))}, with no barrier between: wait (dist.barrier()) before reading")  # fmt: skip
    original_writes = {template(_relative(f["path"], runs.original)) for f in (runs.original or {}).get("files", []) if f["mode"] == "w"}
    written = {template(p) for p in writers}
    if runs.original is not None and not runs.stand_in:
        lost = sorted(original_writes - written)
        if lost:  # the runs train on different data and may stop at different points: evidence only
            evidence.append(f"written by the original, by no rank: {', '.join(lost[:3])}")
    if writers:
        evidence.append(f"files written: {', '.join(sorted(writers)[:6])}{' ...' if len(writers) > 6 else ''}")
    return problems


# --- 7. portable checkpoints --------------------------------------------------------------------


def checkpoints(runs: Runs) -> Result:
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(7, NA, missing)
    trace = next((t for t in runs.ddp if t["saves"]), runs.ddp[0])
    models = trace["ddp_models"]
    good = []
    for save in trace["saves"]:
        if save.get("keys") is None:
            continue
        if save["loads_into"] is not None:
            good.append(f"{save['path']}{_at(save.get('where'))} loads into {models[save['loads_into']]['module']}")
        elif save["module_prefix"] and save.get("unprefixed_loads_into") is not None:
            model = models[save["unprefixed_loads_into"]]["module"]
            return Result(7, FAIL, f"{save['path']}{_at(save.get('where'))} holds the DDP wrapper's state_dict: its keys start "
                          f"with `module.`, so {model} cannot load it; save model.module.state_dict()")  # fmt: skip
    if not good:
        stopped = f" (the run was stopped {trace['stopped']}: a save after training happens only when the script ends)" if trace.get("stopped") else ""
        return Result(7, NA, f"no model state_dict was saved during the run{stopped}")
    return Result(7, PASS, f"{len(good)} saved state_dict(s) load into the original model", good[:6])


# --- 8. evaluation adds up ----------------------------------------------------------------------

EVALUATION = re.compile(
    r"(?i)(?<![a-z])(val|valid|validation|test|eval|evaluation|acc|accuracy|top-?[0-9]+|ppl|perplexity|f1|score)(?![a-z])"
)


def evaluation(runs: Runs, math_result: Result | None = None) -> Result:
    if not _ok(runs.reference) or not all(_ok(t) for t in runs.ordered):
        return Result(8, NA, "the runs that compare results did not finish (see 5 and 9)")
    mine = [(text, w) for text, w in _lines(runs.ordered[0]) if EVALUATION.search(text)]
    theirs = [(text, w) for text, w in _lines(runs.reference) if EVALUATION.search(text)]
    if not theirs:
        return Result(8, NA, "the script prints no evaluation results (no line mentions val/test/accuracy)")
    if math_result is not None and math_result.status != PASS:
        return Result(8, NA, "the trained models differ from the reference (see 5), so their metrics cannot be compared")
    by_template: dict = defaultdict(list)
    for text, w in mine:
        by_template[template(text)].append((text, w))
    seen: Counter = Counter()
    compared = 0
    for text, _ in theirs:
        key = template(text)
        if seen[key] >= len(by_template[key]):
            continue
        other, where = by_template[key][seen[key]]
        seen[key] += 1
        compared += 1
        if not _numbers_agree(evaluated_part(text), evaluated_part(other)):
            return Result(8, FAIL, f"rank 0 reports `{other.strip()}`{_at(where)}; one process on the same data reports "
                          f"`{text.strip()}`: the metric covers one rank's shard; all-reduce its sums across ranks", [])  # fmt: skip
    if not compared:
        return Result(8, NA, "the converted script prints none of the original's evaluation lines")
    return Result(8, PASS, f"{compared} evaluation line(s) printed by rank 0 equal one process's on the same data")


SEGMENT = re.compile(r"\s*[|,;\t]\s*")


def evaluated_part(line: str) -> str:
    """The parts of a printed line that report evaluation: `Epoch 3 | train loss: 0.41 | test
    accuracy: 0.92` -> `test accuracy: 0.92`. A training loss on the same line is the last
    step's, on this rank's batch (what DDP scripts log), not an evaluation; a line with no
    separators is compared whole."""
    parts = SEGMENT.split(without_times(line))  # `23:26:51,976` is a time, not two parts
    return " | ".join(part for part in parts if EVALUATION.search(part))


def _numbers_agree(a: str, b: str) -> bool:
    xs, ys = NUMBER.findall(without_times(a)), NUMBER.findall(without_times(b))
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        digits = len(x.split(".")[1].split("e")[0].split("E")[0]) if "." in x else 0
        slack = max(10.0 ** -digits, 10.0 ** -(len(y.split(".")[1]) if "." in y else 0))
        if not math.isclose(float(x), float(y), rel_tol=1e-4, abs_tol=slack * 1.01):
            return False
    return True


# --- 9. no hang, no crash; 10. plain python -----------------------------------------------------


def finished(runs: Runs) -> Result:
    for key, label, traces in (("ddp", "torchrun", runs.ddp), ("ordered", "unshuffled torchrun", runs.ordered)):
        if key in runs.hung:
            stacks = [f"rank {r}: " + ("finished the script; the others waited for it" if traces[r] is not None
                      else stack_summary(runs.stacks.get((key, r), ""))) for r in range(runs.nproc)]  # fmt: skip
            stuck = next((s for r, s in enumerate(stacks) if traces[r] is None), "no stacks")
            return Result(9, FAIL, f"the {label} run hung and was stopped at the timeout; {stuck}", stacks)
        for rank, trace in enumerate(traces):
            if trace is not None and trace["exit_code"] != 0:
                return Result(9, FAIL, f"rank {rank} of the {label} run failed: {_last_line(trace)}",
                              (trace.get("error") or "").splitlines()[-12:])  # fmt: skip
        lost = [r for r, t in enumerate(traces) if t is None]
        if lost and key == "ddp":
            stacks = [f"rank {r}: {stack_summary(runs.stacks[(key, r)])}" for r in range(runs.nproc) if (key, r) in runs.stacks]
            return Result(9, FAIL, f"rank {_ranks(lost)} of the {label} run died without a trace", stacks + runs.stderr.splitlines()[-12:])
    stopped = runs.ddp[0].get("stopped") if runs.ddp[0] else None
    return Result(9, PASS, "every run finished" + (f" (stopped by verify {stopped})" if stopped else ""))


def stack_summary(text: str) -> str:
    """Where a stopped process was (faulthandler's dump): the script's innermost frames, and the
    library call it was in."""
    for block in text.strip().split("\n\n"):
        frames = [_frame(line.strip()) for line in block.splitlines() if line.strip().startswith("File ")]
        own = [f for f, mine in frames if mine]
        if own:
            inside = f" (in {frames[0][0]})" if not frames[0][1] else ""
            return ", from ".join(own[:3]) + inside
    return "no frames of the script"


def _frame(line: str) -> tuple[str, bool]:
    """`file:line in function`, and whether it is the script's own code."""
    m = re.match(r'File "([^"]+)", line (\d+) in (\S+)', line)
    if not m:
        return line, False
    path = m.group(1)
    mine = not any(part in path for part in ("site-packages", "tracer.py", "/lib/python", "<frozen"))
    return f"{path.rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}", mine


def plain_python(runs: Runs) -> Result:
    trace = runs.plain
    if trace is None:
        return Result(10, FAIL, "the converted script under plain python left no trace (it crashed or hung)")
    if trace["exit_code"] != 0:
        return Result(10, FAIL, f"`python converted.py` fails: {_last_line(trace)}", (trace.get("error") or "").splitlines()[-8:])
    sizes = {g["world_size"] for g in trace["init_process_group"]}
    if sizes - {1}:
        return Result(10, FAIL, f"under plain python it made a group of {sizes}, not one process")
    steps = sum(len(s) for s in trace["optimizer_steps"])
    return Result(10, PASS, f"`python converted.py` trains as one process ({steps} optimizer steps)")


# --- 11. resumes from its checkpoint -------------------------------------------------------------


def resumes(runs: Runs) -> Result:
    """A second torchrun run that takes the script's own load code (session.py, resume.py) loads
    the checkpoint rank 0 saved, and every rank ends with the same parameters. Whether that
    checkpoint holds the unwrapped model's keys is 7's."""
    if runs.resume is None:
        return Result(11, NA, runs.resume_how)
    missing = _missing(runs, runs.ddp, "torchrun")
    if missing:
        return Result(11, NA, missing)
    saved = [s for s in runs.ddp[0]["saves"] if s.get("keys") and s.get("file")]
    if not saved or runs.ddp[0]["exit_code"] != 0:
        stopped = f" (the run was stopped {runs.ddp[0]['stopped']})" if runs.ddp[0].get("stopped") else ""
        why = "the torchrun run failed (see 9)" if runs.ddp[0]["exit_code"] else f"rank 0 saved no state_dict{stopped}"
        return Result(11, NA, f"{why}: nothing to resume from")
    checkpoint, traces = saved[-1], runs.resume
    name = _relative(checkpoint["file"], runs.ddp[0])
    if "resume" in runs.hung or any(t is None for t in traces):
        lost = [r for r, t in enumerate(traces) if t is None]
        how = "hung and was stopped" if "resume" in runs.hung else "left no trace"
        stacks = [f"rank {r}: {stack_summary(runs.stacks[('resume', r)])}" for r in lost if ("resume", r) in runs.stacks]
        return Result(11, FAIL, f"resuming from {name} ({runs.resume_how}): rank {_ranks(lost)} {how}", stacks)
    for rank, trace in enumerate(traces):
        if trace["exit_code"] != 0:
            return Result(11, FAIL, f"rank {rank} fails to resume from {name} ({runs.resume_how}): {_last_line(trace)}",
                          (trace.get("error") or "").splitlines()[-8:])  # fmt: skip
    loaded = {r: next((x for x in t["loads"] if x["file"] == checkpoint["file"]), None) for r, t in enumerate(traces)}
    readers = [r for r, x in loaded.items() if x]
    if not readers:
        read = sorted({_relative(x["file"], traces[0]) for t in traces for x in t["loads"]})
        return Result(11, NA, f"the resume run ({runs.resume_how}) did not load {name}"
                      + (f"; it loaded {', '.join(read[:3])}" if read else ""))  # fmt: skip
    checksums = [t["final_checksums"] + t["ddp_final"] for t in traces]
    if not any(checksums):
        return Result(11, NA, f"the resume run loaded {name} but trained no parameters to compare")
    parted = [f"rank 0 vs rank {r}: {p}" for r in range(1, len(traces)) for p in step_differences(traces[0], traces[r])]
    parted += [f"rank {r} reported {len(c)} parameter checksums, rank 0 {len(checksums[0])}"
               for r, c in enumerate(checksums) if len(c) != len(checksums[0])]  # fmt: skip
    if parted:
        return Result(11, FAIL, f"after resuming from {name} (loaded by rank {_ranks(readers)}), the ranks' parameters "
                      "differ: load the checkpoint on every rank before wrapping in DDP, or into model.module on every rank",
                      parted[:8])  # fmt: skip
    where = _at(loaded[readers[0]].get("where"))
    return Result(11, PASS, f"a second run ({runs.resume_how}) loads {name}{where} on rank {_ranks(readers)}; every "
                  "rank then holds the same parameters")  # fmt: skip


# A failure that follows from an earlier one is reported there: a script without one process
# group also reads all the data and prints on every rank, an unwrapped model also parts the ranks.
FOLLOWS = {2: (1,), 3: (1,), 4: (1, 2), 5: (1, 2, 4), 6: (1,), 7: (1,), 8: (1, 2, 4, 5), 11: (1, 2, 4, 7)}


def check_all(runs: Runs) -> list[Result]:
    """The eleven verdicts, in order; a failure that follows from an earlier one is N/A, naming it."""
    five = same_math(runs)
    results = [process_group(runs), wrapped(runs), sharded(runs), in_sync(runs), five, one_voice(runs),
               checkpoints(runs), evaluation(runs, five), finished(runs), plain_python(runs), resumes(runs)]  # fmt: skip
    for result in results:
        cause = next((n for n in FOLLOWS.get(result.number, ()) if results[n - 1].status == FAIL), None)
        if result.status == FAIL and cause is not None:
            result.status = NA
            result.summary = f"follows from {cause} ({TITLES[cause]}): {result.summary}"
    return results
