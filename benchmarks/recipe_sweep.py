"""Recipe choices measured, not guessed: train and evaluate several recipes on the same data in one
lease, and write every run's τ per eval set beside its training facts as one JSON.

    python benchmarks/recipe_sweep.py --params params.yaml --work /root/sweep --json results.json \\
        [--only NAME ...] [--parallel 6]

``--params``: a composed params.yaml of the scale (e.g. ``eagle3 params -S dataset=1k -S layout=gpu1``)
whose ``models/verifier`` and ``data/prompts`` exist in the current folder. Each data variant
(answer length) is generated, extracted and merged once with the pipeline's own stage modules and
those params plus the variant's overrides; each recipe variant then trains and evaluates on it,
several at once on the one GPU (a SmolLM2-sized drafter leaves most of an H200 idle). Nothing here
needs DVC: it runs the commands of dvc.yaml with explicit ``--params`` files, one folder per run.
The JSON is rewritten after every finished run, so a poll sees partial results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from eagle3.decoding.report import eval_set_headline, has_tau

# Answer lengths: what `generate` and `extract` change (the scale's prompts are the same).
DATA = {
    "long": {},  # the scale's own settings (GPU scales: 2,048-token answers, generate/long.yaml)
    "short": {"generate.max_new_tokens": 128, "generate.name": "default", "extract.max_length": 2048, "extract.name": "default"},
}

def recipe(batch_tokens: int, lr: float, epochs: int, **extra) -> tuple[str, dict]:
    """A recipe named by its full schedule (global batch, peak lr, epochs) and any other overrides, so a
    name means the same run whatever the scale's defaults are when it is read."""
    size = f"{batch_tokens // 1024}k" if batch_tokens % 1024 == 0 else str(batch_tokens)
    name = f"b{size}-lr{lr:.0e}-e{epochs}".replace("e-0", "e-")
    name += "".join(f"-{key.split('.')[-1]}{value}" for key, value in extra.items())
    return name, {"train.batch_tokens": batch_tokens, "train.lr": lr, "train.epochs": epochs, **extra}


# Recipes: overrides of the composed params; "data" picks the answers. The 1k sweep of
# results/recipe_sweep_1k.json (whose names were relative: "default" there is b8k-lr3e-4-e3, the
# default then) chose b4k-lr1e-3-e3; the longer schedules are the next to measure (τ still rose).
ROW_2K = {"train.pack_tokens": 2048, "train.micro_batch_rows": 1}  # one 2,048-token row a step
ROW_8K = {"train.pack_tokens": 8192, "train.micro_batch_rows": 1}  # one 8,192-token row a step, as the peer packs
PEER_EACH = [{"train.optimizer": "muon"}, {"train.freeze_lm_head": True}, {"train.ttt_steps": 3, "train.step_decay": 1.0},
             {"train.weight_decay": 0.1}, {"train.min_lr_ratio": 0.0}]
PEER_CHOICES = [{}, *PEER_EACH, {key: value for choice in PEER_EACH for key, value in choice.items()}]
RECIPES = dict([
    recipe(8192, 3e-4, 3), recipe(16384, 3e-4, 3), recipe(4096, 3e-4, 3), recipe(8192, 1e-3, 3), recipe(8192, 3e-4, 6),
    recipe(4096, 1e-3, 3),  # the default since that sweep
    recipe(4096, 1e-3, 3, **{"train.ttt_steps": 5}), recipe(4096, 1e-3, 3, **{"train.lm_head_init": "random"}),
    recipe(4096, 1e-3, 3, **{"merge.draft_vocab_size": 49152}),
    recipe(4096, 1e-3, 3, **{"train.weight_decay": 0.01, "train.min_lr_ratio": 0.0}),
    recipe(4096, 1e-3, 3, data="short"),
    recipe(4096, 1e-3, 6), recipe(4096, 1e-3, 10), recipe(4096, 2e-3, 10), recipe(4096, 5e-4, 10),  # >= pack_tokens
    # Smaller global batches (more optimizer steps for the same tokens), rows as short as the batch:
    recipe(2048, 1e-3, 3, **ROW_2K, data="short"),  # full answers need rows of >= 3,072 tokens
    recipe(768, 3e-4, 1, **{"train.pack_tokens": 768, "train.micro_batch_rows": 1}, data="short"),  # the 1 x 768 row
    # train=1k (one 2,048-token row a step, 20 epochs, short answers) with each document weighing the same
    # in the loss (train.loss_normalisation: sequence), beside the same recipe per token, in one lease:
    recipe(2048, 1e-3, 20, **ROW_2K, data="short"),
    recipe(2048, 1e-3, 20, **ROW_2K, **{"train.loss_normalisation": "sequence"}, data="short"),
    # train=10k for longer (--params of dataset=10k): its 3 epochs (2,659 steps) peaked at the end; 4 epochs ~3,550 steps
    recipe(2048, 1e-3, 4, **ROW_2K, data="short"),
    # Why the peer trainer (results/peer_tau_1k.json) leads on held-out at equal time: ours at its rows and
    # tokens (ROW_8K, 44 epochs: peer_tau_1k_ours_8k.json's run again), then each of its choices ours can
    # take alone (Muon, frozen lm_head, 3 TTT steps weighted equally, weight decay 0.1, a decay to 0), then all five.
    *(recipe(8192, 1e-3, 44, **ROW_8K, **peer, data="short") for peer in PEER_CHOICES),
    # At 10k (--params of dataset=10k) the peer's equal-time run (results/peer_tau_10k.json) trained 21 epochs of
    # 8,192-token rows and led by 1.1 held-out τ: ours at its rows and epochs with its 3 equal TTT steps (about 3/7
    # of a 7-step run's time), with all five of its choices, and with our 7 TTT steps (about twice as long).
    *(recipe(8192, 1e-3, 21, **ROW_8K, **peer, data="short") for peer in (PEER_EACH[2], PEER_CHOICES[-1], {})),
])


def run(command: list[str], log: Path) -> None:
    """Run a stage command, its output appended to ``log``; raise with the log's tail on failure."""
    start = time.time()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    print(f"{time.time() - start:7.1f} s  rc {code}  {' '.join(command[2:4])} -> {log}", flush=True)
    if code:
        raise RuntimeError(f"{command[2]} failed (rc {code}); see {log}:\n{log.read_text()[-3000:]}")


def write_params(base, overrides: dict, path: Path) -> Path:
    params = OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items() if k != "data"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(params, path, resolve=True)
    return path


def make_data(base, name: str, work: Path, shards_at_once: int = 1) -> Path:
    """generate -> extract for every shard of one answer length, ``shards_at_once`` shards side by side (each
    stage process's start-up is most of a small shard's time); returns its folder."""
    folder = work / f"data-{name}"
    shared = {"backend.cache_memory": round(base.backend.cache_memory / shards_at_once, 3)}  # the shards share one GPU
    params = write_params(base, {**DATA[name], **shared}, folder / "params.yaml")
    py = [sys.executable, "-m"]

    def one(shard: str) -> None:
        run([*py, "eagle3.generate", "models/verifier", f"data/prompts/shards/{shard}.jsonl", str(folder / "generated" / shard),
             "--metrics", str(folder / "metrics" / f"generate-{shard}.json"), "--params", str(params),
             "--journal-dir", str(folder / "journal")], folder / f"generate-{shard}.log")
        run([*py, "eagle3.extract", "models/verifier", str(folder / "generated" / shard), str(folder / "hidden_states" / shard),
             "--params", str(params)], folder / f"extract-{shard}.log")

    with ThreadPoolExecutor(shards_at_once) as pool:
        list(pool.map(one, base.dataset.shards))  # in order: a smaller scale's prefix of shards is ready first
    return folder


def merged(base, data: Path, overrides: dict) -> Path:
    """The merge of ``data`` with the merge keys of ``overrides`` (one folder per distinct merge)."""
    keys = {k: v for k, v in overrides.items() if k.startswith("merge.")}
    folder = data / ("merged-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in sorted(keys.items())) if keys else "merged")
    if not (folder / "meta.json").is_file():
        params = write_params(base, {**DATA[data.name.removeprefix("data-")], **keys}, folder.with_name(folder.name + ".yaml"))
        run([sys.executable, "-m", "eagle3.merge", "models/verifier", str(data / "hidden_states"), str(folder),
             str(folder.with_name(folder.name + "-metrics")), "--params", str(params)], data / "merge.log")
    return folder


def train_and_evaluate(base, name: str, overrides: dict, data: Path, mix: Path, work: Path, threads: int, device: str) -> dict:
    folder = work / "runs" / name
    params = write_params(base, {**DATA[data.name.removeprefix("data-")], **overrides}, folder / "params.yaml")
    py = [sys.executable, "-m"]
    start = time.time()
    run([*py, "eagle3.train", "models/verifier", str(mix), str(data / "hidden_states"), str(folder / "drafter"),
         "--checkpoints", str(folder / "checkpoints"), "--live", str(folder / "train"), "--device", device,
         "--threads", str(threads), "--params", str(params)], folder / "train.log")
    trained = time.time() - start
    run([*py, "eagle3.evaluate", "models/verifier", str(folder / "drafter"), "data/prompts", str(folder / "evaluate"),
         "--params", str(params)], folder / "evaluate.log")
    return result(name, overrides, data, mix, folder, trained, time.time() - start - trained)


def result(name: str, overrides: dict, data: Path, mix: Path, folder: Path, train_s: float, evaluate_s: float) -> dict:
    train = json.loads((folder / "train" / "metrics.json").read_text())
    merge = json.loads((mix.with_name(mix.name + "-metrics") / "metrics.json").read_text())
    sets = tau_by_set(folder / "evaluate" / "metrics.json")
    best = train["best"]
    return {"name": name, "overrides": overrides, "data": data.name, "steps": train["step"], "train_tokens": train["tokens_trained"],
            "samples": merge["train_records"], "answer_tokens_mean": round(merge["masked_tokens"] / max(1, merge["records"]), 1),
            "best_step": best.get("step"), "val_sim_accept_len": best["sim_accept_len"], "val_acc_0": best["acc_0"],
            "train_seconds": round(train_s, 1), "evaluate_seconds": round(evaluate_s, 1), "sets": sets}


def tau_by_set(metrics: Path) -> dict:
    """An evaluate metrics.json as {set: the summary stage's headline (tau, <method>_tau, speedups) and prompts}."""
    return {name: {**eval_set_headline(report), "prompts": report.get("prompts")}
            for name, report in json.loads(metrics.read_text()).items() if has_tau(report)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="recipe names (default: all)")
    parser.add_argument("--parallel", type=int, default=6, help="runs training/evaluating at once")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per training process")
    parser.add_argument("--shards-at-once", type=int, default=1, help="shards generated and extracted side by side")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--set", nargs="*", default=[], help="overrides of every run, e.g. train.max_steps=3 (smoke runs)")
    parser.add_argument("--commit", default="", help="the commit measured (where the tree has no .git)")
    args = parser.parse_args()
    base = OmegaConf.merge(OmegaConf.load(args.params), OmegaConf.from_dotlist(args.set))
    unknown = sorted(set(args.only or ()) - RECIPES.keys())
    if unknown:
        parser.error(f"--only: no recipe named {', '.join(unknown)}; the recipes: {', '.join(RECIPES)}")
    recipes = {k: v for k, v in RECIPES.items() if not args.only or k in args.only}
    needed = sorted({v.get("data", "long") for v in recipes.values()})
    started = time.time()
    data_pool = ThreadPoolExecutor(len(needed))  # answer lengths side by side: one GPU holds both
    datasets = {name: data_pool.submit(make_data, base, name, args.work, args.shards_at_once) for name in needed}
    merging = threading.Lock()  # recipes sharing a merge wait for the first to write it
    report = {"commit": args.commit, "command": " ".join(sys.argv), "params": str(args.params), "runs": []}

    def one(name: str) -> None:
        try:
            data = datasets[recipes[name].get("data", "long")].result()  # a recipe starts once its answers exist
            with merging:
                mix = merged(base, data, recipes[name])
            row = train_and_evaluate(base, name, recipes[name], data, mix, args.work, args.threads, args.device)
        except Exception as err:  # one failed recipe must not cost the others
            row = {"name": name, "overrides": recipes[name], "error": str(err)[-2000:]}
        report["runs"].append(row)
        args.json.write_text(json.dumps(report, indent=1))

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, recipes))
    report["wall_seconds"] = round(time.time() - started, 1)
    args.json.write_text(json.dumps(report, indent=1))
    for row in report["runs"]:
        sets = " ".join(f"{s}:{v['tau']:.2f}/{v.get('tree_tau', 0):.2f}/{v.get('ngram_tau', 0):.2f}" for s, v in row.get("sets", {}).items())
        print(f"{row['name']:16s} steps {row.get('steps', '-'):>5} tokens {row.get('train_tokens', '-'):>9} {sets or row.get('error', '')[:200]}")


if __name__ == "__main__":
    main()
