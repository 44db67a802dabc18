"""One measurement of a whole pipeline run (benchmarks/offline/pipeline_run.sh's run folder) as JSON: each
stage's wall time and GPU busy share, the whole run's wall, training's tokens/s, and τ per eval set.

    python benchmarks/pipeline_report.py RUN --out benchmarks/results/pipeline_10k.json --commit SHA --command "..."
    python benchmarks/pipeline_report.py RUN --poll                      # the run's progress, one screen
    python benchmarks/pipeline_report.py --readme-table benchmarks/results/pipeline_10k.json   # docs/benchmarks.md's table
    python benchmarks/pipeline_report.py --readme-results benchmarks/results/pipeline_10k.json # the README's τ and speedups

It reads RUN/logs/dvc.log (every line of ``dvc repro`` after its time: a stage's window runs from DVC's
"Running stage" line to the next stage's line or the end of the dvc command), RUN/logs/gpu.tsv (NVML samples: a window's
``gpu_busy`` is their mean utilisation, 0 to 1, null without samples), dvclive/train/metrics.json (training
tokens: ``train.tokens_per_s`` is those tokens over train's wall, start-up and validation included;
``logged_tokens_per_s`` the median of the rates train logged, its steps alone; ``train.after_first_sync``: the
steps after the first metric lines reached the host, which follow the compilation and the first steps: their
``wall_s``, ``steps``, ``gpu_busy`` and ``tokens_per_s`` (at the run's mean tokens a step), what a GPU kept busy by
the training loop shows; ``first_step_s`` and ``compiled_graphs``: train's log of its first step and of its compile
caches' hits and misses) and dvclive/evaluate/metrics.json
with params.yaml (each set's prompts, τ of the chain, the tree and prompt lookup, and max_new_tokens).
``--readme-results`` takes the speedups from the run's dvclive/evaluate/metrics.json committed beside its JSON as
``<stem>_evaluate_metrics.json``.
``--peer FILE``: benchmarks/peer_train.py's record or benchmarks/peer_tau.py's JSON (its longest peer run):
``peer.tokens_per_s`` is its rate at its median step, ``train_over_peer`` ours over it (``over``); without it
both are null. A per-shard stage (generate@*, extract@*) is
reported summed, with its items under ``items``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

STAGE_LINE = re.compile(r"^Running stage '([^']+)':")
SKIPPED_LINE = re.compile(r"^Stage '([^']+)' didn't change, skipping")
MARK_LINE = "=== "  # pipeline_run.sh's own lines: between DVC's commands, so each ends a stage's window
EXIT_LINE = re.compile(r"^=== exit (-?\d+)")
SESSION_LINE = re.compile(r"^=== session start")
LOCK_LINE = "Updating lock file"


@dataclass
class Window:
    """One stage's run: from its "Running stage" line to the next boundary (``end`` None: still running)."""

    stage: str
    start: float
    end: float | None = None
    locked: bool = False  # DVC wrote its lock entry: the stage finished


@dataclass
class RunLog:
    sessions: list[tuple[float, float | None]] = field(default_factory=list)  # (start, end) of each job
    windows: list[Window] = field(default_factory=list)
    exit_code: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)


def read_log(path: Path) -> RunLog:
    """The stage windows and job sessions of a timestamped ``dvc repro`` log."""
    log = RunLog()
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stamp, _, text = raw.partition("\t")
        try:
            t = float(stamp)
        except ValueError:
            continue
        last = log.lines[-1][0] if log.lines else t
        log.lines.append((t, text))
        current = log.windows[-1] if log.windows and log.windows[-1].end is None else None
        if SESSION_LINE.match(text):  # a job killed before its exit line: its windows end at its last line
            if current:
                current.end = last
            if log.sessions and log.sessions[-1][1] is None:
                log.sessions[-1] = (log.sessions[-1][0], last)
            log.sessions.append((t, None))
            log.exit_code = None
        elif (match := STAGE_LINE.match(text)) or SKIPPED_LINE.match(text) or text.startswith(MARK_LINE):
            if current:
                current.end = t
            if match:
                log.windows.append(Window(match[1], t))
            if exit_match := EXIT_LINE.match(text):
                log.exit_code = int(exit_match[1])
                if log.sessions:
                    log.sessions[-1] = (log.sessions[-1][0], t)
        elif current and text.startswith(LOCK_LINE):
            current.locked = True
    return log


def read_samples(path: Path) -> tuple[str | None, list[tuple[float, float, float]]]:
    """(the GPU's name, [(t, utilisation %, memory MiB)]) of gpu_sampler.py's file; (None, []) without NVML."""
    if not path.is_file():
        return None, []
    name, samples = None, []
    for line in path.read_text().splitlines():
        if line.startswith("# gpu: "):
            name = line.removeprefix("# gpu: ")
        elif line and line[0].isdigit():
            t, util, mem = (float(x) for x in line.split("\t"))
            samples.append((t, util, mem))
    return name, samples


def busy(samples: list[tuple[float, float, float]], spans: list[tuple[float, float]]) -> float | None:
    """Mean utilisation (0..1) of the samples inside ``spans``; None where none fall inside."""
    inside = [util for t, util, _ in samples if any(a <= t < b for a, b in spans)]
    return round(statistics.fmean(inside) / 100, 3) if inside else None


def stage_times(log: RunLog, samples: list[tuple[float, float, float]], now: float) -> dict[str, dict]:
    """{stage or group: {wall_s, gpu_busy[, items]}} in the order the stages first ran; a group (``name@item``)
    sums its items' windows. A stage run in several sessions (a resumed job) sums its windows."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for window in log.windows:
        spans.setdefault(window.stage, []).append((window.start, window.end if window.end is not None else now))
    stages: dict[str, dict] = {}
    for stage, own in spans.items():
        group, _, item = stage.partition("@")
        entry = {"wall_s": round(sum(b - a for a, b in own), 1), "gpu_busy": busy(samples, own)}
        if not item:
            stages[stage] = entry
            continue
        summed = stages.setdefault(group, {"wall_s": 0.0, "gpu_busy": None, "items": {}, "spans": []})
        summed["items"][item] = entry
        summed["spans"] += own
        summed["wall_s"] = round(summed["wall_s"] + entry["wall_s"], 1)
    for entry in stages.values():
        if "spans" in entry:
            entry["gpu_busy"] = busy(samples, entry.pop("spans"))
    return stages


def train_rates(run: Path, train_wall: float | None) -> dict:
    """Training tokens over the stage's wall, and the median of the rates train logged over its steps."""
    metrics_file = run / "dvclive/train/metrics.json"
    if not metrics_file.is_file():
        return {"tokens_per_s": None}
    metrics = json.loads(metrics_file.read_text())
    logged = run / "dvclive/train/plots/metrics/train/tokens_per_s.tsv"
    rates = [float(line.split("\t")[-1]) for line in logged.read_text().splitlines()[1:]] if logged.is_file() else []
    tokens = metrics["tokens_trained"]
    return {"tokens_per_s": round(tokens / train_wall) if train_wall else None, "tokens": tokens,
            "steps": metrics.get("step"), "logged_tokens_per_s": round(statistics.median(rates)) if rates else None}


# the train loop's metric lines (training.reporting): a batch of them is stamped when their numbers reach the host
TRAIN_LINE = re.compile(r"eagle3\.training\.reporting: step (\d+) ")


def steps_after_first_sync(log: RunLog, samples: list[tuple[float, float, float]], tokens_per_step: float | None) -> dict | None:
    """The train loop's steps from its first metric sync to its last line: wall, steps, GPU busy share and tokens/s
    (at the run's mean tokens a step); None without two syncs. Why: train's wall includes the start-up and
    compilation, when the GPU idles by design."""
    train = next((w for w in reversed(log.windows) if w.stage == "train"), None)
    lines = [(t, int(m[1])) for t, text in log.lines if train and train.start <= t <= (train.end or t)
             and (m := TRAIN_LINE.search(text))]
    if not lines or lines[0][0] == lines[-1][0]:
        return None
    first_sync = lines[0][0]
    synced = max(step for t, step in lines if t == first_sync)
    (end, last) = lines[-1]
    wall, steps = end - first_sync, last - synced
    return {"wall_s": round(wall, 1), "steps": steps, "gpu_busy": busy(samples, [(first_sync, end)]),
            "tokens_per_s": round(steps * tokens_per_step / wall) if tokens_per_step else None}


# train's own lines about its compiled step (training.loop): the first step's seconds, and where its graphs came from
FIRST_STEP_LINE = re.compile(r"fit's wall time: .*?the first step \(compiling\) ([\d.]+) s")
GRAPHS_LINE = re.compile(r"compiled graphs: (.*)$")


def compiled_step(log: RunLog) -> dict:
    """``first_step_s`` (its compilation, or its lookup in torch.compile's caches) and ``compiled_graphs`` (their hits
    and misses: a step compiled ahead, ``eagle3.training.ahead``, is all hits) from train's log; null where absent."""
    found = {"first_step_s": None, "compiled_graphs": None}
    for _, text in log.lines:
        if m := FIRST_STEP_LINE.search(text):
            found["first_step_s"] = float(m[1])
        elif m := GRAPHS_LINE.search(text):
            found["compiled_graphs"] = m[1].strip()
    return found


def peer_rate(path: Path | None) -> dict:
    """The peer trainer's tokens/s, from peer_train.py's record or the longest peer run of a peer_tau.py JSON:
    ``tokens_per_s`` over its steps after the first at its median step (its start-up, compilation and
    recompiles behind it: the rate most in its favour), ``whole_run_tokens_per_s`` over its wall."""
    if path is None:
        return {"tokens_per_s": None}
    record = json.loads(path.read_text())
    if "runs" in record:
        peers = [run for run in record["runs"] if run.get("trainer", "").startswith("speculators")]
        if not peers:
            raise SystemExit(f"{path}: no run with a speculators trainer in its runs")
        record = max(peers, key=lambda run: run["train_seconds"])
        seconds = record["train_seconds"]
    else:
        seconds = record["seconds"]
    tokens, steps, median = record["tokens"], record.get("steps"), record.get("step_median_seconds")
    whole = round(tokens / seconds)
    steady = round(tokens / steps / median) if steps and median else None
    return {"tokens_per_s": steady or whole, "whole_run_tokens_per_s": whole, "tokens": tokens, "steps": steps,
            "seconds": seconds, "step_median_s": median, "source": path.name}


# evaluate's line for each set it finished (evaluate.py's log.info): what an unfinished run has measured
SET_LINE = re.compile(r"INFO [\w.]+: (?P<name>[\w-]+): chain tau (?P<tau>[\d.]+), .*?; tree tau (?P<tree>[\d.]+); "
                      r"baselines tau [\d.]+ \(most frequent\), (?P<ngram>[\d.]+) \(ngram\); (?P<prompts>\d+) prompts")


def logged_sets(log: RunLog, max_new: int) -> dict[str, dict]:
    """The sets an unfinished ``evaluate`` logged as done (its metrics file is written at its end)."""
    found = (SET_LINE.search(text) for _, text in log.lines)
    return {m["name"]: {"prompts": int(m["prompts"]), "max_new_tokens": max_new, "tau": float(m["tau"]),
                        "tree_tau": float(m["tree"]), "ngram_tau": float(m["ngram"]), "from": "log"} for m in found if m}


def eval_sets(run: Path, log: RunLog) -> dict[str, dict]:
    """Each eval set's prompt count, max_new_tokens and τ (chain, tree, prompt lookup) from evaluate's metrics,
    or, where evaluate did not finish, from its lines for the sets it did (marked ``"from": "log"``): a metrics
    file there is another run's (a variant starts from a copy of the first run's)."""
    metrics_file = run / "dvclive/evaluate/metrics.json"
    max_new = yaml.safe_load((run / "params.yaml").read_text())["evaluate"]["max_new_tokens"]
    evaluated = [window for window in log.windows if window.stage == "evaluate"]
    if not metrics_file.is_file() or (evaluated and not evaluated[-1].locked):
        return logged_sets(log, max_new)
    metrics = json.loads(metrics_file.read_text())
    return {name: {"prompts": s["prompts"], "max_new_tokens": max_new, "tau": s["tau"], "tree_tau": s["tree"]["tau"],
                   "ngram_tau": s["ngram"]["tau"],
                   # records older than the metric have none
                   **({"outside_draft_vocab": s["outside_draft_vocab"]} if "outside_draft_vocab" in s else {})}
            for name, s in metrics.items() if isinstance(s, dict) and "tau" in s}


def report(run: Path, commit: str, command: str, peer: Path | None, now: float | None = None) -> dict:
    log = read_log(run / "logs/dvc.log")
    gpu, samples = read_samples(run / "logs/gpu.tsv")
    if now is None:  # an open window ends at the newest record of the run (so a report rebuilt later reads the same)
        now = max([t for t, _ in log.lines] + [t for t, _, _ in samples], default=time.time())
    stages = stage_times(log, samples, now)
    train = train_rates(run, stages.get("train", {}).get("wall_s"))
    tokens_per_step = train["tokens"] / train["steps"] if train.get("steps") else None
    train["after_first_sync"] = steps_after_first_sync(log, samples, tokens_per_step)
    train.update(compiled_step(log))
    peer = peer_rate(peer)
    sessions = [(a, b if b is not None else now) for a, b in log.sessions]
    return {
        "commit": commit, "command": command, "gpu": gpu,
        "total_wall_s": round(sum(b - a for a, b in sessions), 1),
        "gpu_busy": busy(samples, sessions),
        "finished": log.exit_code == 0,
        "stages": stages,
        "train": train, "peer": peer,
        "train_over_peer": over(train, peer),
        "sets": eval_sets(run, log),
    }


def over(train: dict, peer: dict) -> dict | None:
    """Our trainer's tokens/s over the peer's (a fair ratio only where the run measured both on one GPU): ``steady`` ours
    after the first metric sync against its median step, ``whole_run`` train's wall against the peer's steady rate
    (our start-up and compilation counted, its not: the comparison least in our favour); None without a peer."""
    if not peer["tokens_per_s"] or not train.get("tokens_per_s"):
        return None
    steady = (train.get("after_first_sync") or {}).get("tokens_per_s")
    return {"steady": round(steady / peer["tokens_per_s"], 2) if steady else None,
            "whole_run": round(train["tokens_per_s"] / peer["tokens_per_s"], 2)}


def percent(share: float | None) -> str:
    return "–" if share is None else f"{round(share * 100)} %"


def readme_table(result: dict) -> str:
    """The timing table (docs/benchmarks.md, "The whole run, timed"): a row per stage (a group with its item count), then the whole run."""
    rows = ["| stage | wall | GPU busy |", "|---|---|---|"]
    for name, stage in result["stages"].items():
        label = f"`{name}` ×{len(stage['items'])}" if "items" in stage else f"`{name}`"
        rows.append(f"| {label} | {stage['wall_s']:.0f} s | {percent(stage['gpu_busy'])} |")
    rows.append(f"| whole run | {result['total_wall_s']:.0f} s | {percent(result['gpu_busy'])} |")
    return "\n".join(rows)


def evaluate_metrics(source: Path) -> tuple[Path, dict]:
    """The run's dvclive/evaluate/metrics.json as committed beside its JSON (``<stem>_evaluate_metrics.json``), which
    holds the speedups evaluate timed; {} where there is none (a run that did not finish evaluate)."""
    path = source.with_name(f"{source.stem}_evaluate_metrics.json")
    return path, json.loads(path.read_text()) if path.is_file() else {}


def speed_points(metrics: dict) -> list[tuple[str, str]]:
    """(batch size, method) of every speedup evaluate timed, batch sizes ascending: the results table's last columns."""
    sizes = {size for s in metrics.values() if isinstance(s, dict) for size in s.get("batch", {})}
    return [(size, method) for size in sorted(sizes, key=int) for method in ("chain", "tree")]


def speedup(metrics: dict, name: str, size: str, method: str) -> float | None:
    return metrics.get(name, {}).get("batch", {}).get(size, {}).get(method, {}).get("speedup")


def below_one(metrics: dict, points: list[tuple[str, str]], sets: list[str]) -> str:
    """Where drafting decoded slower than plain decoding, by batch size: what the table's readers must not miss."""
    parts = []
    for size in dict.fromkeys(size for size, _ in points):
        timed = [(name, method) for name in sets for s, method in points if s == size and speedup(metrics, name, size, method)]
        slower = [(name, method) for name, method in timed if speedup(metrics, name, size, method) < 1]
        if slower and slower == timed:
            parts.append(f"at batch {size} on every set, chain and tree")
        elif slower:
            parts.append(f"at batch {size}: " + ", ".join(f"`{name}`'s {method}" for name, method in slower))
    return f"Below 1× (slower than plain decoding): {'; '.join(parts)}." if parts else "No speedup below 1×."


def readme_results(result: dict, source: Path) -> str:
    """The README's headline from ``source``: the run's commit, GPU and command, τ per eval set it measured and the
    speedups evaluate timed (from the metrics beside ``source``), train's pace, and whether it finished (an
    unfinished run's sets are those evaluate had logged as done)."""
    metrics_path, metrics = evaluate_metrics(source)
    points = speed_points(metrics)
    timed = f"; speedups from `{metrics_path}`" if points else ""
    whole = f": {result['total_wall_s']:.0f} s, GPU {percent(result['gpu_busy'])} busy" if result["finished"] else ""
    lines = [f"One `dvc repro` at {result['commit']} on {result['gpu'] or 'no GPU'} (`{source}`{timed}):",
             f"`{result['command']}`{whole}.", "",
             "| eval set | prompts | new tokens, at most | chain τ | tree τ | prompt lookup τ | chain / prompt lookup | "
             + "".join(f"{method}, batch {size} | " for size, method in points).rstrip(" "),
             "|---|---|---|---|---|---|---|" + "---|" * len(points)]
    for name, s in result["sets"].items():
        cells = [f"{value:.2f}×" if (value := speedup(metrics, name, size, method)) else "–" for size, method in points]
        lines.append(f"| `{name}` | {s['prompts']} | {s['max_new_tokens']} | **{s['tau']:.2f}** | **{s['tree_tau']:.2f}** | "
                     f"{s['ngram_tau']:.2f} | {s['tau'] / s['ngram_tau']:.2f}× |" + "".join(f" {cell} |" for cell in cells))
    if points:
        lines += ["", below_one(metrics, points, list(result["sets"]))]
        unstable = [f"`{name}`" for name in result["sets"] if metrics.get(name, {}).get("unstable")]
        if unstable:
            lines[-1] += f" Timings whose repeats disagreed (`unstable`): {', '.join(unstable)}."
    outside = [f"`{name}` {100 * s['outside_draft_vocab']:.1f} %" for name, s in result["sets"].items() if "outside_draft_vocab" in s]
    if outside:
        lines += ["", f"Answer tokens outside the draft vocabulary (each ends a chain): {', '.join(outside)}."]
    train, train_stage = result["train"], result["stages"].get("train")
    if train["tokens_per_s"] and train_stage:
        lines += ["", f"`train`: {train['steps']:,} steps, {train['tokens'] / 1e6:.1f}M training tokens, "
                      f"{train['tokens_per_s'] / 1000:.1f}k tokens/s over its {train_stage['wall_s']:.0f} s, "
                      f"GPU {percent(train_stage['gpu_busy'])} busy."]
        if steady := train.get("after_first_sync"):
            lines[-1] += (f" After the first metric sync (compilation and first steps behind it): {steady['steps']:,} steps "
                          f"in {steady['wall_s']:.0f} s, GPU {percent(steady['gpu_busy'])} busy.")
        if ratio := result.get("train_over_peer"):
            peer = result["peer"]
            lines += ["", f"The peer trainer (`{peer['source']}`): {peer['tokens_per_s'] / 1000:.1f}k "
                          f"tokens/s at its median step over {peer['steps']:,} steps; ours {ratio['whole_run']:.2f}× that over "
                          f"train's whole wall" + (f", {ratio['steady']:.2f}× after the first sync." if ratio["steady"] else ".")]
    if not result["finished"]:
        logged = [f"`{name}`" for name, s in result["sets"].items() if s.get("from") == "log"]
        lines += [f"**Unfinished** (`\"finished\": false`): the run stopped inside `{list(result['stages'])[-1]}`; "
                  f"the table holds only the sets it had finished ({', '.join(logged) or 'none'}, from its log lines),",
                  f"and the whole run's {result['total_wall_s']:.0f} s is a lower bound."]
    return "\n".join(lines)


def poll(run: Path, lines: int = 15) -> str:
    """One screen: the job's state, each stage's wall so far, the GPU's last sample, the log's last lines."""
    log = read_log(run / "logs/dvc.log") if (run / "logs/dvc.log").is_file() else RunLog()
    _, samples = read_samples(run / "logs/gpu.tsv")
    now = time.time()
    if not log.sessions:
        out = [f"{run}: not started"]
    else:
        wall = sum((b if b is not None else now) - a for a, b in log.sessions)
        state = "running" if log.sessions[-1][1] is None else f"exit {log.exit_code}"
        out = [f"{run}: {state}, {wall:.0f} s of job ({len(log.sessions)} session(s))"]
    for name, stage in stage_times(log, samples, now).items():
        count = f" ({len(stage['items'])} items)" if "items" in stage else ""
        out.append(f"  {name}{count}: {stage['wall_s']:.0f} s, GPU busy {percent(stage['gpu_busy'])}")
    if log.windows and log.windows[-1].end is None:
        out.append(f"  now: {log.windows[-1].stage}, {now - log.windows[-1].start:.0f} s in")
    if samples:
        t, util, mem = samples[-1]
        out.append(f"  GPU {now - t:.0f} s ago: {util:.0f} % busy, {mem / 1024:.1f} GiB")
    out += [f"  | {text[:150]}" for _, text in (log.lines[-lines:] if lines > 0 else [])]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", help="the run folder (benchmarks/offline/pipeline_run.sh)")
    parser.add_argument("--out", type=Path, help="the JSON to write (default: print it)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--command", default="", help="the command that made the run, as recorded")
    parser.add_argument("--peer", type=Path, help="peer_train.py's record or peer_tau.py's JSON")
    parser.add_argument("--poll", action="store_true", help="print the run's progress instead")
    parser.add_argument("--lines", type=int, default=15, help="with --poll: the log's last lines shown")
    parser.add_argument("--readme-table", type=Path, metavar="JSON", help="print docs/benchmarks.md's timing table of this JSON")
    parser.add_argument("--readme-results", type=Path, metavar="JSON", help="print the README's results of this JSON")
    args = parser.parse_args()
    if args.readme_table:
        print(readme_table(json.loads(args.readme_table.read_text())))
        return
    if args.readme_results:
        print(readme_results(json.loads(args.readme_results.read_text()), args.readme_results))
        return
    if args.run is None:
        parser.error("RUN is required (or --readme-table / --readme-results JSON)")
    if args.poll:
        print(poll(args.run, args.lines))
        return
    if not (args.run / "logs/dvc.log").is_file():
        raise SystemExit(f"{args.run}/logs/dvc.log not found: run benchmarks/offline/pipeline_run.sh first")
    text = json.dumps(report(args.run, args.commit, args.command, args.peer), indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
