"""Stage ``train``: data order, schedule, resume after a crash, 2-process torchrun = 1 process,
learning on real SmolLM2 hidden states, and the exported drafter passing check-drafter."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from eagle3.common import read_json
from eagle3.export import check_drafter
from eagle3.extract import extract_shard
from eagle3.loss import TrainingTimeTest, VerifierHead
from eagle3.merge import merge
from eagle3.parallel import World
from eagle3.train import TrainConfig, fit, lr_factor, step_batches, train

from conftest import ROOT, project_params
from test_extract import conversation, tiny_params, write_generated
from tiny_drafter import make_drafter, random_batch, verifier_head_weight, one_thread  # noqa: F401 (autouse fixture)

CPU = World(0, 1, torch.device("cpu"))
DEBUG = OmegaConf.load(ROOT / "conf" / "train" / "debug.yaml")


def test_step_batches_worked_example():
    cfg = TrainConfig(batch_size=2, grad_accum=1)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 100_003 + 1)).tolist()
    assert step_batches(10, 3, cfg, 7, World(0, 2, CPU.device)) == [perm[4:6]]
    assert step_batches(10, 3, cfg, 7, World(1, 2, CPU.device)) == [perm[6:8]]
    one = step_batches(10, 3, TrainConfig(batch_size=2, grad_accum=2), 7, CPU)
    assert one == [perm[4:6], perm[6:8]]  # one process accumulating = two processes


def test_lr_factor_worked_example():
    assert [round(lr_factor(s, 2, 6, 0.1), 3) for s in (0, 1, 2, 4, 6)] == [0.5, 1.0, 1.0, 0.55, 0.1]


class Items(Dataset):
    """In-memory samples shaped like ``eagle3.data.HiddenStates`` items; optionally crashes."""

    def __init__(self, cfg, count: int, seed: int, crash_after: int | None = None):
        self.items = []
        for i in range(count):
            batch = random_batch(cfg, 1, 10 + (i * 3) % 7, seed=seed + i)
            self.items.append({k: (v[0].bool() if k == "loss_mask" else v[0]) for k, v in batch.items()})
        self.left = crash_after

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.left is not None:
            self.left -= 1
            if self.left < 0:
                raise RuntimeError("killed")
        return self.items[i]


def fit_debug(run_dir: Path, train_set: Dataset, val_set: Dataset, cfg: TrainConfig) -> dict:
    drafter = make_drafter(seed=11)
    head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t), drafter.d2t)
    return fit(TrainingTimeTest(drafter, cfg.ttt_steps), head, train_set, val_set, cfg, 0, run_dir, CPU)


def test_resume_after_crash_equals_uninterrupted(tmp_path):
    cfg = TrainConfig.from_params(OmegaConf.merge(DEBUG, {"max_steps": 7, "checkpoint_every": 3, "val_every": 2}))
    dcfg = make_drafter().config
    val = Items(dcfg, 3, seed=100)
    whole = fit_debug(tmp_path / "whole", Items(dcfg, 6, seed=0), val, cfg)
    # Killed during step 5 (after the checkpoint of step 3 and a validation at step 4).
    with pytest.raises(RuntimeError, match="killed"):
        fit_debug(tmp_path / "resumed", Items(dcfg, 6, seed=0, crash_after=2 * 4 + 1), val, cfg)
    assert torch.load(tmp_path / "resumed" / "latest.pt", weights_only=False)["step"] == 3
    resumed = fit_debug(tmp_path / "resumed", Items(dcfg, 6, seed=0), val, cfg)
    a = torch.load(tmp_path / "whole" / "latest.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "latest.pt", weights_only=False)
    assert a["step"] == b["step"] == 7
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert resumed["best"] == pytest.approx(whole["best"])
    assert resumed["train"]["loss"] == pytest.approx(whole["train"]["loss"], rel=1e-5)


# --- the whole stage on data extracted and merged by the real stages -------------------------------


def make_data(root: Path, verifier: Path, model_params, records: int, draft_vocab_size: int) -> Path:
    shard = "000000-000032"
    params = tiny_params(model_params)
    params.layout.threads = 1  # a busy 2-core machine runs one thread faster than two
    extract_shard(verifier, write_generated(root / "generated" / shard, [conversation(i) for i in range(records)]),
                  root / "hidden" / shard, params)
    params.dataset.shards = [shard]
    params.merge = OmegaConf.merge(params.merge, {"val_fraction": 0.25, "draft_vocab_size": draft_vocab_size, "min_tokens": 4})
    merge(verifier, root / "hidden", root / "merged", root / "metrics-merge", params)
    return root


def stage_params(path: Path, **train) -> Path:
    params = project_params()
    params.train = OmegaConf.merge(DEBUG, train)
    OmegaConf.save(params, path)
    return path


def stage_args(root: Path, verifier: Path, name: str, params: Path) -> list[str]:
    return [str(verifier), str(root / "merged"), str(root / "hidden"), str(root / name / "drafter"),
            "--checkpoints", str(root / name / "checkpoints"), "--live", str(root / name / "live"), "--params", str(params)]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny_verifier_dir, tiny_model_params):
    return make_data(tmp_path_factory.mktemp("train"), tiny_verifier_dir, tiny_model_params, records=12, draft_vocab_size=256)


def namespace(args: list[str]) -> Namespace:
    """The parsed command line of ``stage_args`` (paths as ``eagle3.train.main`` parses them)."""
    verifier, merged, hidden, out = map(Path, args[:4])
    options = dict(zip(args[4::2], args[5::2]))
    return Namespace(verifier=verifier, merged=merged, hidden_states=hidden, out=out,
                     checkpoints=Path(options["--checkpoints"]), live=Path(options["--live"]))


def final_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    (run,) = (root / name / "checkpoints").iterdir()
    return torch.load(run / "latest.pt", weights_only=False)["model"]


def test_two_processes_equal_one(tiny_data, tiny_verifier_dir):
    """torchrun --nproc-per-node 2 (gloo, batch 2 each) == one process (batch 4), same global batches."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    one = stage_params(tiny_data / "one.yaml", batch_size=4, max_steps=3)
    two = stage_params(tiny_data / "two.yaml", batch_size=2, max_steps=3)
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eagle3.train",
                            *stage_args(tiny_data, tiny_verifier_dir, "two", two), "--threads", "1"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train(namespace(stage_args(tiny_data, tiny_verifier_dir, "one", one)), OmegaConf.load(one), CPU)  # meanwhile, one process in this one
    finally:
        output = run.communicate()[0]
    assert run.returncode == 0, output[-3000:]
    a, b = final_weights(tiny_data, "one"), final_weights(tiny_data, "two")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    meta_one, meta_two = (read_json(tiny_data / n / "drafter" / "meta.json")["training"] for n in ("one", "two"))
    assert meta_two["processes"] == 2 and meta_one["best"]["sim_accept_len"] == pytest.approx(meta_two["best"]["sim_accept_len"], rel=1e-4)
    assert check_drafter(tiny_data / "two" / "drafter", tiny_verifier_dir) == []


def logged(folder: Path, name: str) -> list[float]:
    """The values of one dvclive metric, in step order."""
    with (folder / f"{name}.tsv").open() as handle:
        return [float(row[name]) for row in csv.DictReader(handle, delimiter="\t")]


@pytest.mark.slow
def test_learns_on_smollm2_hidden_states(tmp_path, smollm2_dir):
    """Loss falls and accuracy rises on hidden states of the real SmolLM2; the export passes check-drafter."""
    model = project_params().model
    root = make_data(tmp_path, smollm2_dir, model, records=8, draft_vocab_size=512)
    params = project_params()
    params.model.draft_head = {"intermediate_size": 256}
    params.train = OmegaConf.merge(DEBUG, {"max_steps": 16, "batch_size": 3, "lr": 2e-3, "warmup_steps": 3, "val_every": 8,
                                           "checkpoint_every": 100, "log_every": 4})
    args = namespace(stage_args(root, smollm2_dir, "run", tmp_path / "unused.yaml"))
    summary = train(args, params, CPU)
    losses, accs = (logged(args.live / "plots" / "metrics" / "train", name) for name in ("loss", "acc_0"))
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert accs[-1] > accs[0] + 0.1, accs
    assert summary["best"]["sim_accept_len"] > 0
    assert check_drafter(args.out, smollm2_dir) == []
    metrics = read_json(args.live / "metrics.json")
    assert metrics["best"]["sim_accept_len"] == pytest.approx(summary["best"]["sim_accept_len"])
    assert {"acc_0", "acc_2", "cond_acc_1", "tokens_per_s", "lr"} <= set(metrics["train"])
