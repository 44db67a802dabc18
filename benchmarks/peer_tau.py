"""τ of our drafter and of the peer trainer's (speculators 0.9.0) on identical hidden states, in one command.

    PYTHONPATH=src:/root/peer-site python benchmarks/peer_tau.py --run /root/run --work /root/peer-tau \\
        --json benchmarks/results/peer_tau_1k.json --device cuda --commit <sha>

``--run`` is a pipeline run folder laid out as dvc.yaml lays it out: ``params.yaml`` (the params the
run used), ``models/verifier``, ``data/merged``, ``data/hidden_states``, ``data/prompts``. In ``--work``:

1. ``ours``: ``python -m eagle3.train`` with the run's params, timed (or ``--ours`` names a trained drafter);
2. ``peer-data``: the merged train and val splits and their hidden states in the peer's format
   (``peer_format.write_peer_data``), then the checks that the conversion is right: our drafter
   converted to its model, saved by it and converted back is bit-identical; on the first train and
   the last val row its data loader gives our tokens, hidden states and mask, its targets agree with
   ours, and its forward with our weights gives our logits at every TTT step;
3. ``peer-tokens``: its own trainer (``peer_train.py``) with its defaults for our epochs over the same
   train split, i.e. the same tokens;
4. ``peer-time``: its trainer again for as many steps as fit in ``--seconds`` (default: our training's
   wall time) at the step time run 3 measured, the epochs those steps need (its own sampler counts them);
5. our ``evaluate`` (dvc.yaml's command, the run's params) of every drafter over the run's eval sets.

``--rate-only`` stops after 3: the peer's training rate on the run's own data, what
``benchmarks/pipeline_report.py --peer`` compares ``train``'s with (``pipeline_run.sh``'s ``PEER_RATE=1``; with
``--ours`` the run's drafter, nothing of ours is trained again). ``--rate-steps N`` caps that run at N steps
(named ``peer-rate``): its steady step time needs a few hundred steps, not our 21 epochs (~7,000 steps at 10k).

The JSON (rewritten after every stage) holds the commit, the command, the checks and per run the
trainer, steps, tokens, wall times, the peer's resolved settings and per eval set τ of the chain and
the tree.

The peer's settings are its trainer's own defaults (``speculators/train/config/schema.py``, derived
ones in ``TrainConfig._resolve_derived_defaults``): Muon on the 2-D weights (lr 1e-3, momentum 0.95,
weight decay 0.1) and AdamW on the rest (lr 1e-3, weight decay 0.01), a linear schedule with 1% warmup
(``trainer._resolve_scheduler_steps``), packed rows of 8,192 tokens, 3 TTT steps weighted equally
(decay 1.0), the fused KL loss, bf16 autocast, clipping at 1.0 (``trainer.train_epoch``), the lm_head
frozen at the verifier's draft-vocabulary rows (``model.DraftVocabMixin``), seed 42. Changed are
only (``PEER_ARCHITECTURE``) the layer, set to ours: no norm before ``fc``, the pre-norm state fed to
the next step, the un-normed hidden state as residual, full attention (its eagle3 defaults differ in
all four, which our drafter format and ``evaluate`` cannot hold, and no weight folding turns one into
the other; its own ``convert`` builds our layer from EAGLE checkpoints), and the data facts (our draft
vocabulary, taps, split and epochs). ``--peer-flags`` adds more of its flags, last, so they win (smoke
runs: ``--peer-flags "--max-steps 2 --epochs 1 --total-seq-len 768"``; ours' depth: ``"--ttt-steps 7"``).
On a CPU (our checks) its attention and loss run eager in float32 (``PEER_ON_CPU``). Under torch 2.11
(the H200 image of 2026-12) its default fused KL loss fails in its compiled backward: pass
``--peer-flags "--loss-implementation eager"``, the same objective (results/peer_tau_1k.json did).

Where its objective differs from ours on the same rows (read in its source, left as it is): its loss
mask is the input token's (``shift_batch`` keeps ``loss_mask[1:]`` beside the target of the next
token), so it never learns the first answer token (ours does) and learns the verifier's guess of the
token after the sample's last one (ours has no such target); at TTT step k a row within k tokens
of its document's end is scored against the next packed document's target (no document check in
``align_for_step``); a target whose verifier argmax lies outside the draft vocabulary is trained
towards, where ours masks it; its lm_head stays frozen, ours trains from the verifier's rows.

Installing the peer, never into the project's dependencies: ``benchmarks/offline/kit.sh`` downloads its
wheels (speculators 0.9.0, hs_connectors 0.9.0, datasets 5.1.0, dill, multiprocess, loguru, openai and
theirs: 3.2 MB) and ``benchmarks/offline/install.sh`` installs them into ``/root/peer-site`` on the GPU
machine (python 3.12, torch 2.11, transformers 5.17, no package registry), whose image has pandas,
python-dateutil, six and xxhash; datasets needs pyarrow >= 24 (that image: 25.0.1), so carry pyarrow
too where a host's is older.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf

from eagle3.common import UserError, read_json, write_json
from eagle3.runner import stage_main
from peer_format import check_round_trip, check_sample, export_peer_checkpoint, last_checkpoint, write_peer_data
from recipe_sweep import run, tau_by_set

PEER_MODULES = ("speculators", "hs_connectors", "datasets", "pandas", "loguru", "openai")  # what its trainer imports
PEER_ARCHITECTURE = ["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", "0"]
PEER_ON_CPU = ["--draft-attn-impl", "eager", "--loss-implementation", "eager", "--hidden-states-dtype", "float32", "--num-workers", "0"]
PEER_RECIPE = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_momentum", "scheduler_type",
               "scheduler_warmup_steps", "ttt_steps", "ttt_step_loss_decay", "loss_fn", "loss_implementation", "total_seq_len",
               "epochs", "max_steps", "hidden_states_dtype", "draft_attn_impl", "seed", "norm_before_residual",
               "norm_before_fc", "norm_output", "embed_requires_grad", "full_attention_indices")
HERE = Path(__file__).parent


def require_peer() -> None:
    missing = [name for name in PEER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"the peer's packages {missing} are not importable: install the wheels named in "
                        f"{Path(__file__).name}'s docstring and put their folder on PYTHONPATH")


def resolved(flags: list[str]):
    """Its ``TrainConfig`` of these flags, flattened (its own argument resolution)."""
    from speculators.train.config import TrainConfig

    return TrainConfig.resolve(flags).flatten()


def peer_flags(run_dir: Path, data: Path, facts: dict, device: str) -> list[str]:
    """Its trainer's flags for our data: its defaults but for the layer (ours) and the data facts."""
    flags = ["--verifier-name-or-path", str(run_dir / "models/verifier"), "--data-path", str(data),
             "--draft-vocab-size", str(facts["draft_vocab_size"]), "--target-layer-ids", *map(str, facts["aux_layers"]),
             "--train-data-ratio", repr(facts["train_data_ratio"]), "--on-missing", "raise", *PEER_ARCHITECTURE]
    return flags + (PEER_ON_CPU if device == "cpu" else [])


def epochs_for(steps: int, data: Path, facts: dict, config: dict) -> int:
    """The fewest epochs holding ``steps`` optimizer steps, counted by its own packing sampler.

    Why exact: its loop stops at ``--max-steps`` only within an epoch; every further epoch would
    still train one step. Its sampler packs each epoch's permutation anew, so epochs differ in steps.
    """
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = load_from_disk(str(data))["seq_len"][: facts["train_rows"]]
    sampler = MultipackDistributedBatchSamplerV2(config["total_seq_len"], lengths, num_replicas=1, rank=0, seed=config["seed"])
    epochs, done = 0, 0
    while done < steps:
        done += len(sampler._generate_batches(epochs))
        epochs += 1
    return epochs


def once(path: Path, compute: Callable[[], dict]) -> dict:
    """``compute()``, kept in ``path``: a rerun of the same command reads it instead. A lease's per-call
    time limit then costs at most the stage it cut (each stage starts its folder afresh)."""
    if not path.is_file():
        write_json(path, compute())
    return read_json(path)


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def train_peer(name: str, flags: list[str], work: Path, run_dir: Path, draft_head: dict) -> dict:
    """Its trainer with ``flags`` (later ones win) in ``work/name``, its last checkpoint exported as our drafter folder."""
    folder = fresh(work / name)
    flags = flags + ["--save-path", str(folder / "checkpoints"), "--log-dir", str(folder / "logs")]
    config = resolved(flags)
    start = time.time()
    run([sys.executable, str(HERE / "peer_train.py"), "--record", str(folder / "record.json"), "--", *flags], folder / "train.log")
    seconds = time.time() - start
    record = read_json(folder / "record.json")
    checkpoint = last_checkpoint(folder / "checkpoints")
    export_peer_checkpoint(checkpoint, run_dir / "models/verifier", run_dir / "data/merged", draft_head, folder / "drafter",
                           {"trainer": "speculators 0.9.0", "checkpoint": str(checkpoint), "steps": record["steps"], "argv": flags})
    return {"name": name, "trainer": "speculators 0.9.0", "drafter": str(folder / "drafter"), "steps": record["steps"],
            "tokens": record["tokens"], "epochs": config["epochs"], "train_seconds": round(seconds, 1),
            "step_seconds": record["step_seconds"], "step_median_seconds": record["step_median_seconds"],
            "first_step_end_seconds": record["first_step_end"],
            "settings": {key: config[key] for key in PEER_RECIPE}, "command": shlex.join(["python", "benchmarks/peer_train.py", "--", *flags])}


def train_ours(run_dir: Path, work: Path, device: str) -> dict:
    """dvc.yaml's train command on the run's data and params, timed."""
    folder = fresh(work / "ours")
    command = [sys.executable, "-m", "eagle3.train", str(run_dir / "models/verifier"), str(run_dir / "data/merged"),
               str(run_dir / "data/hidden_states"), str(folder / "drafter"), "--checkpoints", str(folder / "checkpoints"),
               "--live", str(folder / "train"), "--device", device, "--params", str(run_dir / "params.yaml")]
    start = time.time()
    run(command, folder / "train.log")
    seconds = time.time() - start
    metrics = read_json(folder / "train" / "metrics.json")
    return {"name": "ours", "trainer": "eagle3", "drafter": str(folder / "drafter"), "steps": metrics["step"],
            "tokens": metrics["tokens_trained"], "train_seconds": round(seconds, 1), "command": shlex.join(["python", *command[1:]])}


def given_ours(drafter: Path) -> dict:
    training = read_json(drafter / "meta.json")["training"]
    return {"name": "ours", "trainer": "eagle3", "drafter": str(drafter), "steps": training.get("steps"), "tokens": None,
            "train_seconds": None, "command": f"(trained before: {drafter})"}


def evaluate(row: dict, run_dir: Path, work: Path) -> dict:
    """dvc.yaml's evaluate command on one drafter: its time and τ of the chain and the tree per eval set."""
    out = fresh(work / f"{row['name']}-evaluate")
    start = time.time()
    run([sys.executable, "-m", "eagle3.evaluate", str(run_dir / "models/verifier"), row["drafter"], str(run_dir / "data/prompts"),
         str(out / "live"), "--params", str(run_dir / "params.yaml")], out / "evaluate.log")
    return {"evaluate_seconds": round(time.time() - start, 1),
            "sets": {name: {"chain_tau": s["tau"], "tree_tau": s.get("tree_tau"), "prompts": s["prompts"]}
                     for name, s in tau_by_set(out / "live" / "metrics.json").items()}}


def check(data: Path, facts: dict, run_dir: Path, drafter: Path, params, work: Path) -> dict:
    """``peer_format``'s checks of the conversion: the round trip, and the first train and the last val row
    over our TTT steps (at least its 3)."""
    paths = (run_dir / "data/merged", run_dir / "data/hidden_states", run_dir / "models/verifier")
    draft_head, steps = OmegaConf.to_container(params.model.draft_head) or {}, max(3, int(params.train.ttt_steps))
    return {"round_trip": check_round_trip(drafter, paths[2], paths[0], draft_head, fresh(work / "round-trip")),
            "samples": [check_sample(data, facts, *paths, drafter, row, steps) for row in (0, facts["rows"] - 1)]}


def equal_time_steps(seconds: float, peer: dict) -> int:
    """Its optimizer steps whose run takes ``seconds``: its fixed costs (start, compilation, validation,
    saving) as run ``peer`` paid them, then its steady step time, the median step (the mean counts
    inductor's recompiles of the first epochs as steps: on the 1k data it read 0.185 s for a 0.113 s
    step, and the equal-time run trained 171 s of 281)."""
    if not peer["step_median_seconds"]:
        raise UserError(f"the equal-tokens peer run trained {peer['steps']} step(s): too few to time a step; give it more")
    fixed = peer["train_seconds"] - peer["steps"] * peer["step_median_seconds"]
    return max(1, math.floor((seconds - fixed) / peer["step_median_seconds"]))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/peer_tau.py", description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="pipeline run folder (params.yaml, models/, data/)")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder; rerunning the command resumes after its last finished stage")
    parser.add_argument("--json", type=Path, required=True, help="result file, e.g. benchmarks/results/peer_tau_1k.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ours", type=Path, help="an already trained drafter of this run (default: train ours here)")
    parser.add_argument("--seconds", type=float, help="training time of the equal-time peer run (default: ours, as timed here)")
    parser.add_argument("--peer-flags", default="", help="more of its trainer's flags, last (they win), e.g. \"--max-steps 2 --epochs 1\"")
    parser.add_argument("--commit", default="", help="the commit measured (where the tree has no .git)")
    parser.add_argument("--rate-only", action="store_true", help="stop after the equal-tokens peer run (its tokens/s): no "
                        "equal-time run, no evaluate")
    parser.add_argument("--rate-steps", type=int, help="with --rate-only: at most this many peer steps (its steady rate)")
    args = parser.parse_args(argv)
    if args.rate_steps is not None and not (args.rate_only and args.rate_steps > 1):
        parser.error("--rate-steps needs --rate-only and at least 2 steps (a step time is between two steps)")
    require_peer()
    run_dir, work, started = args.run.resolve(), args.work.resolve(), time.time()
    work.mkdir(parents=True, exist_ok=True)
    params = OmegaConf.load(run_dir / "params.yaml")
    if int(params.train.max_steps):
        raise UserError(f"{run_dir}/params.yaml: train.max_steps is {params.train.max_steps}; the peer trains our epochs: set it to 0")
    draft_head = OmegaConf.to_container(params.model.draft_head) or {}
    extra = shlex.split(args.peer_flags)
    report = {"commit": args.commit, "command": shlex.join(sys.argv), "device": args.device, "run": str(run_dir), "runs": []}

    def save() -> None:
        args.json.write_text(json.dumps({**report, "wall_seconds": round(time.time() - started, 1)}, indent=1))

    ours = given_ours(args.ours) if args.ours else once(work / "ours.json", lambda: train_ours(run_dir, work, args.device))
    report["runs"].append(ours)
    data = work / "peer-data"
    total_seq_len = resolved(["--verifier-name-or-path", str(run_dir / "models/verifier"), *extra])["total_seq_len"]
    facts = once(work / "peer-data.json", lambda: write_peer_data(run_dir / "data/merged", run_dir / "data/hidden_states",
                                                                   run_dir / "models/verifier", fresh(data), total_seq_len))
    report["data"] = facts
    report["checks"] = once(work / "checks.json", lambda: check(data, facts, run_dir, Path(ours["drafter"]), params, work))
    save()
    flags = peer_flags(run_dir, data, facts, args.device)
    tokens_flags = flags + ["--epochs", str(int(params.train.epochs)), *extra]
    name = "peer-tokens"
    if args.rate_steps:
        tokens_flags, name = tokens_flags + ["--max-steps", str(args.rate_steps)], "peer-rate"
    equal_tokens = once(work / f"{name}.json", lambda: train_peer(name, tokens_flags, work, run_dir, draft_head))
    report["runs"].append(equal_tokens)
    save()
    if args.rate_only:
        return
    seconds = args.seconds or ours["train_seconds"]
    if seconds:
        steps = equal_time_steps(seconds, equal_tokens)
        time_flags = flags + ["--epochs", str(epochs_for(steps, data, facts, resolved(flags + extra))), "--max-steps", str(steps), *extra]
        equal_time = once(work / "peer-time.json", lambda: train_peer("peer-time", time_flags, work, run_dir, draft_head))
        report["runs"].append({**equal_time, "time_budget_seconds": round(seconds, 1)})
        save()
    for row in report["runs"]:
        row.update(once(work / f"{row['name']}-evaluate.json", lambda: evaluate(row, run_dir, work)))
        save()
    for row in report["runs"]:
        sets = " ".join(f"{name} {s['chain_tau']:.3f}/{s['tree_tau']:.3f}" for name, s in row["sets"].items())
        print(f"{row['name']:12s} steps {row['steps']:>6} tokens {row['tokens'] or '-':>9} train {row['train_seconds'] or '-':>7} s  "
              f"chain/tree τ: {sets}")


if __name__ == "__main__":
    stage_main(main)
