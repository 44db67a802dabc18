"""A run's drafter served by vLLM: the acceptance length from the engine's own counters beside ``evaluate``'s chain τ
on the same prompts, tokens/s with and without the drafter at several requests in flight, and the share of answers
equal to plain decoding's.

    PYTHONPATH=src:/root/vllm-site:/root/site python benchmarks/serve_vllm.py /root/run \\
        --out benchmarks/results/serve_vllm_20k.json --commit <sha> [--sets mtbench heldout] [--ks 3 5 7] \\
        [--concurrency 1 16 64] [--repeats 3]
    python benchmarks/serve_vllm.py --speedup-table benchmarks/results/serve_vllm_20k.json   # docs/serving.md's table

RUN is a finished ``dvc repro`` (benchmarks/offline/pipeline_run.sh): ``models/verifier``, ``models/drafter``,
``data/prompts/eval/<set>.jsonl``, ``dvclive/evaluate/metrics.json`` and the ``params.yaml`` it ran with, whose
``evaluate`` section (sets, max_prompts, max_new_tokens) and ``model.stop`` are read as ``evaluate`` reads them. vLLM
comes from its kit (benchmarks/offline/vllm_kit.sh, installed into /root/vllm-site), the project's own packages from
the pipeline's kit (/root/site, after vLLM's).

Every prompt of every set is rendered by the project's chat rendering (``eagle3.lm.chat.prompt_ids``) and handed to
vLLM as token ids, so the engine decodes the tokens ``evaluate`` decodes; greedy, up to the run's max_new_tokens, at
EOS or a ``model.stop`` string. A multi-turn set (MT-bench) is served its first turns: its ``evaluate_tau`` is then
``evaluate``'s ``turn1/tau``, which exists at the run's K (``evaluate.draft_tokens``) alone; a single-turn set's is
``tau`` at that K or ``chain_k/k<K>/tau`` where the run swept K (``evaluate.chain_sweep``); otherwise none.

Engines: one plain engine, then one per K (``speculative_config={"method": "eagle3", "model": drafter,
"num_speculative_tokens": K}``), each built once (~110 s on an H100) and shut down before the next. In each:

1. every prompt of a set submitted at once: the answers (the plain engine's are the reference of
   ``identical_share``, the share of answers equal to plain decoding's token for token) and, from the
   spec-decode counters of ``LLM.get_metrics()`` before and after, ``acceptance_length`` = 1 + accepted / drafts
   and ``acceptance_by_position`` (accepted at position i / drafts: the share of drafts whose first i+1 tokens
   were all accepted, as ``evaluate``'s acceptance plot counts them);
2. for each concurrency C: the set's first max(C, ``--timed-prompts``) prompts in waves of C requests at once (the next
   wave once all of the previous are answered), ``--repeats`` times: tokens/s per repeat, median and spread
   ((max - min) / median); ``speedup`` pairs each repeat with the plain engine's same one.

The engines run one after another, so unlike ``evaluate``'s timings the methods are not alternated: a load that
changes between engines shows in the spread of neither. ``engines.<plain|K>`` names the GPU, the processes on it as the
engine started (``other_gpu_processes``, 0: the GPU was ours alone) and the seconds to a ready engine.

The JSON: the commit, the ``commands`` of the calls that wrote it, the vLLM version, ``max_new_tokens``, ``ks``,
``engines`` and per set ``sets.<set>``: ``prompts``, per K ``acceptance_length``, ``evaluate_tau``,
``acceptance_by_position``, ``drafts``, ``identical_share``; per concurrency ``tokens_per_s.<C>`` = {``prompts`` timed,
``without`` (the plain engine), ``with.<K>``}, each {median, spread, runs}, and ``speedup.<C>.<K>``.

The JSON is rewritten after every measurement, so a killed run keeps what it measured, and a later run with the same
``--out`` adds to it: an engine whose every requested measurement is there is not built again (the plain engine's
answers are kept for that in ``--answers``, default RUN/serve_vllm). An engine with every set timed at 1, 16 and 64
takes about five minutes of a call (its start included), so the work splits into calls of ten minutes: ``--ks`` with no
value (the plain engine alone), then ``--ks 7``, ``--ks 3`` and ``--ks 5``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from common import commit
from eagle3.common import UserError, read_json, write_json
from eagle3.decoding.inputs import check_pair, load_eval_sets
from eagle3.decoding.settings import PARAMS, Settings
from eagle3.decoding.timing import median_spread
from eagle3.runner import stage_main
from eagle3.settings import stage_params

# The kit (benchmarks/offline/vllm_kit.sh) leaves flashinfer out. vLLM 0.26.0's sampler imports it to ask whether it may
# sample with it unless told not to, and without it the engine's core process dies while loading and LLM() waits on it
# with no further line (nine minutes on an H200, 2026-12-07). Set before vLLM is imported; the `vllm serve` that
# generate_vllm.py starts inherits it.
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
# The engine's core is a process of its own; forked from this one, which has touched CUDA by then, it died at once
# ("Cannot re-initialize CUDA in forked subprocess", one H100, 2026-12-07). Spawned, it starts clean.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PLAIN = "plain"  # the engine without a drafter


# --- the run ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What the benchmark reads of a run folder."""

    folder: Path
    settings: Settings  # evaluate's, from the run's params.yaml
    records: dict[str, list[dict]]  # per set, its prompt records
    metrics: dict  # evaluate's metrics.json

    @property
    def verifier(self) -> Path:
        return self.folder / "models" / "verifier"

    @property
    def drafter(self) -> Path:
        return self.folder / "models" / "drafter"


def load_run(folder: Path, sets: list[str] | None) -> Run:
    """The run's params, the eval sets (``sets``, else the run's ``evaluate.sets``) and ``evaluate``'s metrics; a
    drafter export with a fault, or prompts of another verifier, refused as ``evaluate`` refuses them (before minutes
    of engine start)."""
    for needed in ("params.yaml", "models/verifier", "models/drafter", "dvclive/evaluate/metrics.json"):
        if not (folder / needed).exists():
            raise UserError(f"{folder / needed}: not found; RUN must be a finished dvc repro (benchmarks/offline/pipeline_run.sh)")
    settings = Settings.from_params(stage_params(PARAMS, folder / "params.yaml"))
    check_pair(folder / "models" / "verifier", folder / "models" / "drafter", folder / "data" / "prompts")  # as evaluate
    records = load_eval_sets(folder / "data" / "prompts", sets or settings.sets, settings.max_prompts)
    return Run(folder, settings, records, read_json(folder / "dvclive" / "evaluate" / "metrics.json"))


def multi_turn(records: list[dict]) -> bool:
    return any(record.get("followups") for record in records)


def evaluate_tau(run: Run, name: str, k: int) -> dict | None:
    """``evaluate``'s chain τ of set ``name`` at K = ``k`` on the prompts served here, and the metric it is, or None
    where the run has none: {"tau": 2.42, "metric": "mtbench/turn1/tau"}."""
    if k == run.settings.draft_tokens:
        path = ["turn1", "tau"] if multi_turn(run.records[name]) else ["tau"]
    elif multi_turn(run.records[name]):
        return None  # the sweep pools the turns; the first turns alone are measured at the run's K only
    else:
        path = ["chain_k", f"k{k}", "tau"]
    found = run.metrics.get(name)
    for part in path:
        found = found.get(part) if isinstance(found, dict) else None
    return {"tau": found, "metric": "/".join([name, *path])} if isinstance(found, (int, float)) else None


def prompt_token_ids(run: Run) -> dict[str, list[list[int]]]:
    """Each set's prompts as the verifier's token ids, rendered as ``evaluate`` renders them."""
    from eagle3.lm.chat import prompt_ids
    from eagle3.lm.loading import load_tokenizer

    tokenizer = load_tokenizer(run.verifier, run.settings.trust_remote_code)
    return {name: [prompt_ids(tokenizer, record["messages"]) for record in rows] for name, rows in run.records.items()}


# --- what the engine's counters say ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, summed over their labels (an engine's, or a difference of two readings)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.per_position), len(before.per_position))
        padded = [list(c.per_position) + [0] * (width - len(c.per_position)) for c in (self, before)]
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(*padded)))


def spec_counters(metrics: list) -> SpecCounters:
    """The spec-decode counters of ``LLM.get_metrics()`` (Counter: ``.name``, ``.value``; the per-position Vector:
    ``.values``), each summed over its labels (one set per engine core); zeros where an engine has none (plain)."""
    sums = {field: sum(m.value for m in metrics if m.name == name) for field, name in SPEC_COUNTERS.items()}
    vectors = [m.values for m in metrics if m.name == PER_POSITION]
    per_position = [0] * max(map(len, vectors), default=0)
    for values in vectors:
        for i, accepted in enumerate(values):
            per_position[i] += accepted
    return SpecCounters(**sums, per_position=tuple(per_position))


def acceptance(counted: SpecCounters) -> dict:
    """Mean acceptance length (tokens per verifier forward: 1 + accepted / drafts) and, per draft position i, the share
    of drafts whose position i was accepted. Example: 10 drafts, 12 accepted as [7, 4, 1] -> 2.2, [0.7, 0.4, 0.1]."""
    if counted.drafts <= 0:
        raise UserError("vLLM counted no drafts: the drafter did not run (is disable_log_stats on, or the method not eagle3?)")
    return {"acceptance_length": round(1 + counted.accepted / counted.drafts, 4), "drafts": counted.drafts,
            "acceptance_by_position": [round(n / counted.drafts, 4) for n in counted.per_position]}


def identical_share(answers: list[list[int]], plain: list[list[int]]) -> float:
    """The share of answers equal token for token to plain decoding's of the same prompt."""
    return round(sum(a == p for a, p in zip(answers, plain, strict=True)) / len(plain), 4)


def rate(values: list[float]) -> dict:
    """Repeated tokens/s (or speedups): {"median", "spread", "runs"}."""
    median, spread = median_spread(values)
    return {"median": round(median, 2 if median > 10 else 4), "spread": None if spread is None else round(spread, 4),
            "runs": [round(v, 2) for v in values]}


def speedup(with_drafter: list[float], without: list[float]) -> dict:
    """Each repeat's tokens/s over the plain engine's same repeat: median and spread."""
    return rate([w / p for w, p in zip(with_drafter, without)])


# --- the results file --------------------------------------------------------------------------------------------------


def engine_name(k: int | None) -> str:
    return PLAIN if k is None else str(k)


def timing_of(row: dict, engine: str, c: int) -> dict | None:
    """An engine's tokens/s at concurrency ``c`` in set ``row``, None where not measured."""
    timing = row.get("tokens_per_s", {}).get(str(c), {})
    return timing.get("without") if engine == PLAIN else timing.get("with", {}).get(engine)


def measured(results: dict, name: str, engine: str, concurrency: list[int]) -> bool:
    """Whether ``results`` hold every measurement of ``engine`` on set ``name`` this run asks for."""
    row = results.get("sets", {}).get(name, {})
    timed = all(timing_of(row, engine, c) for c in concurrency)
    return timed and (engine == PLAIN or engine in row.get("acceptance_length", {}))


def set_row(results: dict, name: str, prompts: int) -> dict:
    """Set ``name``'s entry of ``results``, made on first use; a set served with other prompts starts afresh."""
    row = results.setdefault("sets", {}).setdefault(name, {})
    if row.get("prompts") != prompts:
        row.clear()
        row["prompts"] = prompts
    for key in ("acceptance_length", "evaluate_tau", "acceptance_by_position", "drafts", "identical_share", "tokens_per_s",
                "speedup"):
        row.setdefault(key, {})
    return row


def record_timing(row: dict, engine: str, c: int, prompts: int, rates: list[float]) -> None:
    """One engine's tokens/s at concurrency ``c`` over ``prompts`` prompts, and its speedup over the plain engine's
    (where measured on as many prompts)."""
    timing = row["tokens_per_s"].get(str(c))
    if not timing or timing["prompts"] != prompts:  # other prompts timed before: those figures compare with none of these
        timing = row["tokens_per_s"][str(c)] = {"prompts": prompts, "without": None, "with": {}}
        row["speedup"].pop(str(c), None)
    if engine == PLAIN:
        timing["without"] = rate(rates)
    else:
        timing["with"][engine] = rate(rates)
        if timing["without"]:
            row["speedup"].setdefault(str(c), {})[engine] = speedup(rates, timing["without"]["runs"])


def answers_path(folder: Path, name: str, prompts: list[list[int]]) -> Path:
    """The plain engine's answers to set ``name``, named by its prompts (other prompts: another file)."""
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return folder / f"{name}.{digest}.plain.json"


def speedup_table(results: dict, source: str) -> str:
    """docs/serving.md's engine speedups: where and how it was measured, then a row per set and K."""
    engines = results.get("engines", {}).values()
    gpus = sorted({str(e["gpu"]) for e in engines}) or ["an unknown GPU"]
    alone = all(e["other_gpu_processes"] == 0 for e in engines)
    concurrency = sorted({int(c) for row in results["sets"].values() for c in row["tokens_per_s"]})
    lines = [f"vLLM {results['vllm']} on {' and '.join(gpus)} ({'alone' if alone else 'shared with other processes'}), "
             f"at {results['commit']} (`{source}`), by", *[f"`{command}`;" for command in results["commands"]], "",
             "| eval set | prompts | K | acceptance length | `evaluate`'s τ | answers equal to plain | "
             + " | ".join(f"speedup, {c} at once" for c in concurrency) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(concurrency)]
    for name, row in results["sets"].items():
        for k in sorted(row["acceptance_length"], key=int):
            tau = row["evaluate_tau"].get(k)
            cells = [f"`{name}`", str(row["prompts"]), k, f"{row['acceptance_length'][k]:.2f}",
                     f"{tau['tau']:.2f}" if tau else "–", f"{row['identical_share'][k]:.0%}"]
            for c in concurrency:
                ratio = row["speedup"].get(str(c), {}).get(k)
                cells.append(f"{ratio['median']:.2f}× ({ratio['spread']:.0%})" if ratio and ratio["spread"] is not None
                             else f"{ratio['median']:.2f}×" if ratio else "–")
            lines.append("| " + " | ".join(cells) + " |")
    note = (f"Greedy, up to {results['max_new_tokens']} new tokens, {results['turns']}. Speedup: tokens/s with the drafter "
            f"over plain decoding's on the same prompts, the median of {results['repeats']} repeats (in brackets their "
            f"spread, (max - min) / median); C requests submitted at once, over max(C, {results['timed_prompts']}) prompts.")
    notes = [line for text in results.get("notes", []) for line in ["", *textwrap.wrap(text, 118)]]  # what the run lacked
    return "\n".join([*lines, "", *textwrap.wrap(note, 118), *notes])


# --- the engine (on the GPU host) --------------------------------------------------------------------------------------


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError("vllm is not importable: install benchmarks/offline/vllm_kit.sh's kit and put /root/vllm-site on "
                        "PYTHONPATH")


def build_engine(run: Run, k: int | None, gpu_memory: float):
    """vLLM's offline engine on the run's verifier, drafting with its drafter at K = ``k`` (None: no drafter)."""
    from vllm import LLM

    spec = None if k is None else {"method": "eagle3", "model": str(run.drafter), "num_speculative_tokens": k}
    return LLM(model=str(run.verifier), speculative_config=spec, disable_log_stats=False, seed=0,
               gpu_memory_utilization=gpu_memory, trust_remote_code=run.settings.trust_remote_code)


def close_engine(llm) -> None:
    """Shut the engine's core process down now, so the next engine has the GPU's memory (deleting the LLM leaves
    that to the garbage collector)."""
    llm.llm_engine.engine_core.shutdown()


def greedy(run: Run):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=run.settings.max_new_tokens, stop=list(run.settings.stop) or None)


def decode(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:
    """The answers (token ids) to ``prompts``, all submitted at once, and the seconds it took."""
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return [list(output.outputs[0].token_ids) for output in outputs], seconds


def timed_rates(llm, prompts: list[list[int]], params, c: int, repeats: int) -> list[float]:
    """Tokens/s per repeat over ``prompts`` in waves of ``c`` requests at once."""
    rates = []
    for _ in range(repeats):
        tokens, seconds = 0, 0.0
        for start in range(0, len(prompts), c):
            answers, took = decode(llm, prompts[start : start + c], params)
            tokens, seconds = tokens + sum(map(len, answers)), seconds + took
        rates.append(tokens / seconds)
    return rates


def gpu_facts() -> dict:
    """The GPU's name and how many processes use it now (nvidia-smi; None each where it cannot tell): 0 others when an
    engine starts means it had the GPU alone."""
    def query(what: str) -> list[str] | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"], capture_output=True,
                                 text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        return [line.strip() for line in out.splitlines() if line.strip()]

    names, processes = query("gpu=name"), query("compute-apps=pid")
    return {"gpu": names[0] if names else None, "other_gpu_processes": None if processes is None else len(processes)}


def serve_engine(run: Run, k: int | None, prompts: dict[str, list[list[int]]], args, results: dict, save) -> None:
    """Build one engine, measure it on every set that lacks its measurements, shut it down."""
    engine = engine_name(k)
    facts, started = gpu_facts(), time.perf_counter()  # the processes on the GPU before ours
    llm = build_engine(run, k, args.gpu_memory)
    results.setdefault("engines", {})[engine] = {**facts, "ready_seconds": round(time.perf_counter() - started, 1)}
    try:
        params = greedy(run)
        for name, ids in prompts.items():
            row = set_row(results, name, len(ids))
            before = spec_counters(llm.get_metrics())
            answers, _ = decode(llm, ids, params)
            plain_file = answers_path(args.answers, name, ids)
            if k is None:
                args.answers.mkdir(parents=True, exist_ok=True)
                write_json(plain_file, answers)
            else:
                accepted = acceptance(spec_counters(llm.get_metrics()) - before)
                for key, value in accepted.items():
                    row[key][engine] = value
                row["evaluate_tau"][engine] = evaluate_tau(run, name, k)
                row["identical_share"][engine] = identical_share(answers, read_json(plain_file))
            save()
            for c in args.concurrency:
                timed = ids[: max(c, args.timed_prompts)]
                record_timing(row, engine, c, len(timed), timed_rates(llm, timed, params, c, args.repeats))
                save()
    finally:
        close_engine(llm)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", help="a finished dvc repro's folder (models/, data/prompts, dvclive/evaluate)")
    parser.add_argument("--out", type=Path, help="the results JSON (added to where it exists)")
    parser.add_argument("--speedup-table", type=Path, help="print docs/serving.md's table of this results JSON, and stop")
    parser.add_argument("--sets", nargs="+", help="eval sets (default: the run's evaluate.sets)")
    parser.add_argument("--ks", nargs="*", type=int, default=[3, 5, 7],
                        help="drafted tokens per verifier forward (none: the plain engine alone)")
    parser.add_argument("--concurrency", nargs="*", type=int, default=[1, 16, 64], help="requests in flight, timed")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per engine, set and concurrency")
    parser.add_argument("--timed-prompts", type=int, default=8, help="prompts timed at least (at concurrency 1 too)")
    parser.add_argument("--gpu-memory", type=float, default=0.8, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--answers", type=Path, help="the plain engine's answers (default RUN/serve_vllm)")
    parser.add_argument("--commit", help="the commit measured (default: this checkout's)")
    args = parser.parse_args(argv)
    if args.speedup_table:
        print(speedup_table(read_json(args.speedup_table), str(args.speedup_table)))
        return
    if not (args.run and args.out):
        raise UserError("give RUN and --out (or --speedup-table FILE)")
    if min([*args.ks, *args.concurrency, args.repeats, args.timed_prompts]) < 1:
        raise UserError("--ks, --concurrency, --repeats and --timed-prompts take positive numbers")
    args.answers = args.answers or args.run / "serve_vllm"
    run = load_run(args.run, args.sets)
    require_vllm()
    prompts = prompt_token_ids(run)
    results = read_json(args.out) if args.out.is_file() else {}
    import vllm

    command = shlex.join(["python", "benchmarks/serve_vllm.py", *argv])
    results["commands"] = [*results.get("commands", []), command]  # the calls that measured what the file holds
    results.update(commit=args.commit or commit(), vllm=vllm.__version__, max_new_tokens=run.settings.max_new_tokens, evaluate_k=run.settings.draft_tokens,
                   turns="the first user turn of each prompt")
    results["ks"] = sorted({*results.get("ks", []), *args.ks})
    results.update(concurrency=args.concurrency, repeats=args.repeats, timed_prompts=args.timed_prompts)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, results)

    engines = [None, *args.ks]
    for k in engines:
        todo = {name: ids for name, ids in prompts.items()
                if not measured(results, name, engine_name(k), args.concurrency)
                or (k is None and not answers_path(args.answers, name, ids).is_file())}
        if todo:
            print(f"engine {engine_name(k)}: {', '.join(todo)}", file=sys.stderr, flush=True)
            serve_engine(run, k, todo, args, results, save)
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    stage_main(main)
