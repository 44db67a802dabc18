"""Stage ``train``: data order, schedule, resume after a crash (metric history included), reruns
over a finished run, run ids that follow the hidden-state bytes, the run lock, no orphaned workers,
2-process torchrun = 1 process, learning on real SmolLM2 hidden states, and the exported drafter
passing check-drafter."""

from __future__ import annotations

import csv
import os
import re
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from eagle3.common import UserError, read_json, read_jsonl, sha256_file, try_lock_run, write_json
from eagle3.drafter.export import check_drafter
from eagle3.hidden_states.loader import HiddenStates
from eagle3.lm.loading import verifier_parts
from eagle3.runner import stage_main
from eagle3.train import TrainPaths, main, train
from eagle3.training.ahead import FOLDER, ahead_key, wait_for_compile_ahead
from eagle3.training.checkpoints import lock_run
from eagle3.training.config import Batching, TrainConfig
from eagle3.training.data import DataPlan, InOrder, ValidationSampler, collate, pack
from eagle3.training.loop import Run, Splits, fit, largest_compile_timers
from eagle3.training.loss import StepMetrics, TrainingTimeTest, VerifierHead, static_size
from eagle3.training.parallel import World
from eagle3.training.step import (Optimisation, collate_ttt, compile_step, graphs, lr_factor, make_optimizers, to_device,
                                  train_step, validate, validation_batches)

from support.repo import project_params, with_sources
from support.tiny_drafter import make_drafter, one_thread, random_batch, verifier_head_weight  # noqa: F401 (autouse fixture)
from support.train import (  # noqa: F401 (fixture)
    DEBUG, copy_data, folder_bytes, make_data, part_element, stage_args, stage_params, tiny_data)

CPU = World(0, 1, torch.device("cpu"))


def train_config(**keys) -> TrainConfig:
    """The committed params' train section with ``keys`` replaced (TrainConfig has no defaults of its own;
    conf/train/default.yaml alone does not resolve: its batch size comes from the layout)."""
    return TrainConfig.from_params(OmegaConf.merge(project_params().train, keys))


def test_data_plan_worked_example():
    lengths = [3, 3, 2, 6, 1, 4, 5, 2]
    cfg = train_config(batch_tokens=12, micro_batch_rows=1, pack_tokens=6, epochs=2)
    perms = [torch.randperm(8, generator=torch.Generator().manual_seed(7 * 100_003 + e)).tolist() for e in (0, 1)]
    rows = [[[perm[i] for i in row] for row in pack([lengths[i] for i in perm], 6)] for perm in perms]
    two = [DataPlan(lengths, cfg.batching(2), 7, rank=r, processes=2) for r in (0, 1)]
    assert two[0].steps(cfg.epochs) == len(rows[0]) // 2 + len(rows[1]) // 2
    step = len(rows[0]) // 2  # the first step of epoch 1
    assert two[0].micro_batches(step) == [rows[1][0]] and two[1].micro_batches(step) == [rows[1][1]]
    one = DataPlan(lengths, cfg.batching(1), 7)
    assert one.micro_batches(step) == [rows[1][0], rows[1][1]]  # one process accumulating = two processes
    wide = DataPlan(lengths, train_config(batch_tokens=12, micro_batch_rows=2, pack_tokens=6).batching(1), 7)
    assert wide.micro_batches(0) == [rows[0][0] + rows[0][1]]  # a micro-batch of two rows
    assert [len(r) for r in collate([Items.item(n) for n in (3, 3, 2)], Batching(6, 2, 1))["position_ids"]] == [6, 6]


@pytest.mark.parametrize("processes, micro_rows, expected", [(1, 4, (4, 2)), (1, 3, (2, 4)), (2, 3, (2, 2)), (8, 4, (1, 1))])
def test_the_recipe_fixes_the_global_batch_and_the_layout_only_cuts_it(processes, micro_rows, expected):
    """8 rows a step on any number of processes: micro-batches of the largest size that divides a
    process's share and fits micro_batch_rows, accumulated."""
    batching = train_config(batch_tokens=8 * 2048, pack_tokens=2048, micro_batch_rows=micro_rows).batching(processes)
    assert (batching.batch_size, batching.grad_accum) == expected
    assert batching.batch_size * batching.grad_accum * processes == 8


def test_a_global_batch_the_processes_cannot_share_or_of_partial_rows_is_refused():
    from eagle3.config import validate

    with pytest.raises(UserError, match=r"^params.yaml: train.batch_tokens = 6144: must be a multiple of 4096: whole packed rows of "
                                        r"train.pack_tokens \(2048\) for each of the 2 training processes \(the processes torchrun "
                                        r"started\); it makes 3 rows a step, which they cannot share evenly;"):
        train_config(batch_tokens=3 * 2048, pack_tokens=2048).batching(2)
    with pytest.raises(UserError, match=r"train.batch_tokens = 2048: must be a multiple of 4096: .* it makes 1 row a step, fewer "
                                        r"than the processes;"):
        train_config(batch_tokens=2048, pack_tokens=2048).batching(2)  # smaller than one row per process
    with pytest.raises(UserError, match="train.batch_tokens = 5000: must be a multiple of train.pack_tokens \\(2048\\)"):
        validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "batch_tokens": 5000}}))


def test_a_short_run_says_it_is_under_trained(caplog):
    from eagle3.training.loop import MIN_STEPS, warn_if_undertrained
    from eagle3.training.step import warmup_steps

    warn_if_undertrained(MIN_STEPS, train_config())
    assert "UNDER-TRAINED" not in caplog.text
    warn_if_undertrained(54, train_config())
    assert "UNDER-TRAINED: only 54 optimizer steps" in caplog.text and "Lower train.batch_tokens" in caplog.text
    caplog.clear()
    warn_if_undertrained(54, train_config(max_steps=54))  # the cap, not the data, makes the run short
    assert "train.max_steps (now 54) caps the run: raise it, or set it to 0" in caplog.text and "train.epochs (now" not in caplog.text
    assert [warmup_steps(f, 600) for f in (0.0, 0.001, 0.03)] == [0, 1, 18]


def test_a_frozen_random_head_is_refused():
    from eagle3.config import validate

    with pytest.raises(UserError, match="train.freeze_lm_head = True: must be false unless train.lm_head_init is verifier"):
        validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "lm_head_init": "random", "freeze_lm_head": True}}))
    validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "lm_head_init": "verifier", "freeze_lm_head": True}}))


def test_muon_with_fsdp_is_refused():
    from eagle3.config import validate

    with pytest.raises(UserError, match="train.optimizer = 'muon': must be adamw with train.fsdp"):
        validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "optimizer": "muon", "fsdp": True}}))
    validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "optimizer": "muon", "fsdp": False}}))


def test_cuda_graphs_need_the_compiled_step_and_stay_off_on_cpus():
    from eagle3.config import validate

    with pytest.raises(UserError, match="train.cuda_graphs = True: must be auto or false with train.compile false"):
        validate(OmegaConf.create({"train": {**OmegaConf.to_container(DEBUG), "compile": False, "cuda_graphs": True}}))
    cuda = World(0, 1, torch.device("cuda"))
    assert graphs(train_config(), cuda) and not graphs(train_config(), CPU) and not graphs(train_config(compile=True), CPU)
    assert not graphs(train_config(), World(0, 2, torch.device("cuda"))) and not graphs(train_config(cuda_graphs=False), cuda)
    items = [Items.item(n) for n in (9, 3, 12)]
    static = collate_ttt(items, Batching(24, 1, 1), 3, static=True)["selection"]
    selected = collate_ttt(items, Batching(24, 1, 1), 3)["selection"]
    assert selected.padded is None and len(static.positions) == static_size(len(selected.positions))


def test_validation_takes_every_sample_once_in_index_order():
    """The worked example of ``InOrder``: the last step takes the rows left, a process without any gets none."""
    plans = [InOrder([3, 3, 2, 6, 1], Batching(6, 1, 1), rank=r, processes=3) for r in range(3)]
    assert [plan.steps(1) for plan in plans] == [2, 2, 2]
    assert [[plan.micro_batches(step) for step in (0, 1)] for plan in plans] == [[[[0, 1]], [[4]]], [[[2]], []], [[[3]], []]]


def test_tokens_trained_counts_every_process_and_epoch():
    lengths = [3, 3, 2, 6, 1, 4, 5, 2]
    cfg = train_config(batch_tokens=12, micro_batch_rows=1, pack_tokens=6, epochs=3)
    plans = [DataPlan(lengths, cfg.batching(2), 7, rank=r, processes=2) for r in (0, 1)]
    steps = plans[0].steps(cfg.epochs)
    brute = sum(lengths[i] for step in range(steps) for plan in plans for micro in plan.micro_batches(step) for i in micro)
    assert plans[0].tokens(steps) == plans[1].tokens(steps) == brute
    assert plans[0].tokens(1) < brute  # a resumed count is a prefix of the same order


def shared_collate(items: list[dict], batching: Batching) -> tuple[dict, dict[str, bool]]:
    """``collate``, and whether each tensor of the batch is in shared memory where it is made (in the worker)."""
    batch = collate(items, batching)
    return batch, {key: value.is_shared() for key, value in batch.items() if isinstance(value, torch.Tensor)}


def test_a_worker_packs_its_rows_in_shared_memory_with_the_same_values():
    """In a DataLoader worker the batch is made in shared memory (sent without a copy: 37 MB a row at 10k), padding
    zeroed as in the training process, where it stays private."""
    items, batching = [Items.item(n, seed=n) for n in (5, 4, 6)], Batching(8, 3, 1)  # two rows filled, the third padding
    loader = DataLoader(items, batch_size=len(items), collate_fn=partial(shared_collate, batching=batching), num_workers=1)
    (from_worker, shared), = list(loader)
    here, private = shared_collate(items, batching)
    assert all(shared.values()) and not any(private.values())
    for key, value in here.items():
        assert torch.equal(from_worker[key], value) if isinstance(value, torch.Tensor) else from_worker[key] == value, key


def test_validation_batches_give_an_idle_process_sample_0_uncounted():
    """Every process reads as many validation micro-batches; one that the last step leaves without rows reads
    sample 0 and does not count it."""
    samplers = [ValidationSampler(InOrder([3, 3, 2, 6, 1], Batching(6, 1, 1), rank=r, processes=3)) for r in range(3)]
    assert [list(sampler) for sampler in samplers] == [[[0, 1], [4]], [[2], [0]], [[3], [0]]]
    assert [[sampler.counted(step) for step in range(len(sampler))] for sampler in samplers] == [[True, True], [True, False], [True, False]]


def test_lr_factor_worked_example():
    assert [round(lr_factor(s, 2, 6, 0.1), 3) for s in (0, 1, 2, 4, 6)] == [0.5, 1.0, 1.0, 0.55, 0.1]


class Items(Dataset):
    """In-memory samples shaped like ``eagle3.hidden_states.loader.HiddenStates`` items; optionally crashes."""

    def __init__(self, cfg, count: int, seed: int, crash_after: int | None = None):
        self.items = [self.item(10 + (i * 3) % 7, cfg, seed + i) for i in range(count)]
        self.left = crash_after

    @staticmethod
    def item(length: int, cfg=None, seed: int = 0) -> dict[str, torch.Tensor]:
        batch = random_batch(cfg or make_drafter().config, 1, length, seed=seed)
        return {k: (v[0].bool() if k == "loss_mask" else v[0]) for k, v in batch.items()}

    def __len__(self):
        return len(self.items)

    @property
    def lengths(self):
        return [len(item["input_ids"]) for item in self.items]

    def __getitem__(self, i):
        if self.left is not None:
            self.left -= 1
            if self.left < 0:
                raise RuntimeError("killed")
        return self.items[i]


def one_step(micro: list[dict], cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``train_step`` of a fresh debug drafter (SGD, lr 1) over ``micro``: (metric sums, grad norm, new weights)."""
    drafter = make_drafter(seed=11)
    head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t), drafter.d2t)
    model = TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    sums, norm = train_step(model, head, micro, Optimisation([optimizer], [scheduler]), cfg, CPU)
    return sums, norm, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_sequence_normalisation_is_the_same_however_the_batch_is_cut():
    """Two rows of two documents each, as one micro-batch of 2 rows or 2 micro-batches of 1 row: the same
    step (loss, gradient norm, weights), since documents are counted over the whole global batch, as
    token normalisation counts targets. The step is not token normalisation's."""
    dcfg = make_drafter().config
    items = [Items.item(n, dcfg, seed) for seed, n in enumerate([9, 3, 12, 6])]  # rows [9, 3] and [12, 6] of 18 tokens
    cfg = train_config(loss_normalisation="sequence", ttt_steps=3, pack_tokens=18, batch_tokens=36)
    whole = [collate_ttt(items, Batching(18, 2, 1), cfg.ttt_steps)]
    cut = [collate_ttt(items[:2], Batching(18, 1, 1), cfg.ttt_steps), collate_ttt(items[2:], Batching(18, 1, 1), cfg.ttt_steps)]
    assert torch.equal(torch.cat([b["position_ids"] for b in cut]), whole[0]["position_ids"])
    (sums_whole, norm_whole, weights_whole), (sums_cut, norm_cut, weights_cut) = one_step(whole, cfg), one_step(cut, cfg)
    loss_whole, loss_cut = (StepMetrics(sums).summary(cfg.step_decay)["loss"] for sums in (sums_whole, sums_cut))
    assert loss_cut == pytest.approx(loss_whole, rel=1e-5)
    torch.testing.assert_close(norm_cut, norm_whole, rtol=1e-5, atol=1e-6)
    for name in weights_whole:
        torch.testing.assert_close(weights_cut[name], weights_whole[name], rtol=1e-5, atol=1e-6, msg=name)
    _, norm_token, _ = one_step(whole, train_config(loss_normalisation="token", ttt_steps=3, pack_tokens=18, batch_tokens=36))
    assert abs(float(norm_token) - float(norm_whole)) > 1e-4 * float(norm_whole)


def fit_debug(run_dir: Path, train_set: Dataset, val_set: Dataset, cfg: TrainConfig,
              live_dir: Path | None = None) -> tuple[dict, dict]:
    from dvclive import Live

    drafter = make_drafter(seed=11)
    head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t), drafter.d2t)
    live = Live(str(live_dir), dvcyaml=False, save_dvc_exp=False) if live_dir else None
    summary, best_weights = fit(TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation), head,
                                Splits(train_set, val_set), cfg, Run(run_dir, 0, live), CPU)
    if live:
        live.end()
    return summary, best_weights


def live_files(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(skip)}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = TrainingTimeTest(make_drafter(), 2, "token")
    muon, adamw = make_optimizers(model, train_config(optimizer="muon"), fused=False)
    names = {id(p): name for name, p in model.named_parameters()}
    on_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    on_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert "drafter.fc.weight" in on_muon and any(name.endswith("o_proj.weight") for name in on_muon)
    assert "drafter.lm_head.weight" in on_adamw and any(name.endswith("norm.weight") for name in on_adamw)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert on_muon | on_adamw == trained and not on_muon & on_adamw
    (only,) = make_optimizers(model, train_config(optimizer="adamw"), fused=False)
    assert {names[id(p)] for p in only.param_groups[0]["params"]} == trained


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_crash_equals_uninterrupted(tmp_path, optimizer):
    cfg = TrainConfig.from_params(OmegaConf.merge(DEBUG, {"max_steps": 7, "checkpoint_every": 3, "val_every": 2, "pack_tokens": 32,
                                                          "batch_tokens": 32, "optimizer": optimizer}))
    dcfg = make_drafter().config
    val = Items(dcfg, 3, seed=100)
    whole, whole_best = fit_debug(tmp_path / "whole", Items(dcfg, 6, seed=0), val, cfg, tmp_path / "live-whole")
    # Killed during step 5 (after the checkpoint of step 3 and a validation at step 4).
    with pytest.raises(RuntimeError, match="killed"):
        fit_debug(tmp_path / "resumed", Items(dcfg, 6, seed=0, crash_after=2 * 4 + 1), val, cfg, tmp_path / "live-resumed")
    assert torch.load(tmp_path / "resumed" / "latest.pt", weights_only=False)["step"] == 3
    shutil.rmtree(tmp_path / "live-resumed")  # DVC removes the stage's metrics and plots before a rerun
    resumed, resumed_best = fit_debug(tmp_path / "resumed", Items(dcfg, 6, seed=0), val, cfg, tmp_path / "live-resumed")
    # The whole metric history of steps 1..7 (replayed up to the checkpoint), equal up to float noise.
    whole_live, resumed_live = (live_files(tmp_path / f"live-{n}", skip=("tokens_per_s",)) for n in ("whole", "resumed"))
    assert whole_live.keys() == resumed_live.keys() and "plots/metrics/train/loss.tsv" in whole_live
    for name in ("plots/metrics/train/loss.tsv", "plots/metrics/val/sim_accept_len.tsv"):
        rows = [[r.split("\t") for r in files[name].decode().splitlines()] for files in (whole_live, resumed_live)]
        assert [r[0] for r in rows[0]] == [r[0] for r in rows[1]] and len(rows[0]) > 2, name  # every step
        assert [float(r[1]) for r in rows[0][1:]] == pytest.approx([float(r[1]) for r in rows[1][1:]], rel=1e-5)
    a = torch.load(tmp_path / "whole" / "latest.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "latest.pt", weights_only=False)
    assert a["step"] == b["step"] == 7
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert resumed["best"] == pytest.approx(whole["best"])
    for name in whole_best:  # the weights of the best validation: kept in the checkpoint with its metrics
        torch.testing.assert_close(resumed_best[name], whole_best[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(b["best_weights"][name], resumed_best[name]), name
    assert resumed["train"]["loss"] == pytest.approx(whole["train"]["loss"], rel=1e-5)


# --- the whole stage on data extracted and merged by the real stages -------------------------------


def train_paths(args: list[str]) -> TrainPaths:
    """The paths of ``stage_args``, as ``eagle3.train.main`` hands them to ``train``."""
    verifier, merged, hidden, out = map(Path, args[:4])
    options = dict(zip(args[4::2], args[5::2]))
    return TrainPaths(verifier, merged, hidden, out, Path(options["--checkpoints"]), Path(options["--live"]))


def train_with(paths: TrainPaths, params: Path | DictConfig) -> dict:
    """``train`` with the typed arguments ``eagle3.train.main`` reads from ``params`` (a file, or loaded)."""
    params = OmegaConf.load(params) if isinstance(params, Path) else params
    return train(paths, TrainConfig.from_params(params.train), int(params.seed), OmegaConf.to_container(params.model.draft_head), CPU)


def final_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    (run,) = [p for p in (root / name / "checkpoints").iterdir() if p.is_dir()]
    return torch.load(run / "latest.pt", weights_only=False)["model"]


def test_rerun_is_idempotent_and_training_deterministic(tiny_data, tiny_verifier_dir, caplog):
    """A rerun over a finished run (what `dvc repro -f -s train` does, after DVC deleted the outputs
    and the metrics) trains nothing and writes the same export, metrics and plots; a second run from
    scratch exports the same bytes; nothing clock-dependent is inside the export."""
    params = stage_params(tiny_data / "idem.yaml", max_steps=4)
    args = train_paths(stage_args(tiny_data, tiny_verifier_dir, "idem", params))
    with caplog.at_level("INFO", logger="eagle3"):
        train_with(args, params)
    assert "fit's wall time:" in caplog.text and "waiting for rows" in caplog.text and "checkpointing" in caplog.text
    first, first_live = folder_bytes(args.out), folder_bytes(args.live)
    assert b"tokens_per_s" not in first["meta.json"]
    shutil.rmtree(args.out)
    shutil.rmtree(args.live)
    caplog.clear()
    with caplog.at_level("INFO", logger="eagle3"):
        train_with(args, params)
    assert "at step 4" in caplog.text and "step 1 loss" not in caplog.text  # resumed finished, trained nothing
    assert folder_bytes(args.out) == first
    assert folder_bytes(args.live) == first_live
    again = train_paths(stage_args(tiny_data, tiny_verifier_dir, "again", params))
    train_with(again, params)
    assert folder_bytes(again.out) == first


def record_digest(part: Path) -> None:
    """Record ``part``'s current bytes in its shard's meta.json, as a re-extraction writing them would."""
    meta = read_json(part.parent / "meta.json")
    meta["sha256"][part.name] = sha256_file(part)
    write_json(part.parent / "meta.json", meta)


def run_dirs(checkpoints: Path) -> set[str]:
    return {p.name for p in checkpoints.iterdir() if p.is_dir()}


def test_run_id_follows_hidden_state_bytes(tiny_data, tiny_verifier_dir, tmp_path, caplog):
    """Different hidden states under the same merged manifest (re-extracted: one bit differs, and
    its shard records it) never resume another run's checkpoint; restoring the original bytes
    resumes the original run."""
    root = copy_data(tiny_data, tmp_path)
    params = stage_params(tmp_path / "p.yaml", max_steps=2)
    args = train_paths(stage_args(root, tiny_verifier_dir, "run", params))
    train_with(args, params)
    (original,) = run_dirs(args.checkpoints)
    part = next((root / "hidden").rglob("part-*.safetensors"))
    pristine = part.read_bytes()
    at = next(a for a in (part_element(part, "aux", i) for i in range(64)) if pristine[a] & 1)
    with part.open("r+b") as handle:  # clear the lowest mantissa bit: finite, a hair smaller, passes the load checks
        handle.seek(at)
        handle.write(bytes([pristine[at] ^ 1]))
    record_digest(part)
    caplog.clear()
    with caplog.at_level("INFO", logger="eagle3"):
        train_with(args, params)
    assert "resumed" not in caplog.text
    assert len(run_dirs(args.checkpoints)) == 2
    part.write_bytes(pristine)
    record_digest(part)
    caplog.clear()
    with caplog.at_level("INFO", logger="eagle3"):
        train_with(args, params)
    assert f"{original} at step 2" in caplog.text and len(run_dirs(args.checkpoints)) == 2


def error_line(args: list[str], monkeypatch, capsys) -> str:
    """The one error line of ``python -m eagle3.train ARGS``, which must exit 2."""
    monkeypatch.setattr(sys, "argv", ["eagle3.train", *args])
    with pytest.raises(SystemExit) as exit:
        stage_main(main)
    assert exit.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    return line


def test_corrupted_hidden_state_is_refused_in_one_line(tiny_data, tiny_verifier_dir, tmp_path, monkeypatch, capsys):
    """One flipped byte pair in a part (an aux value becomes -2.35e38): train stops before training
    with one line naming the part, its recorded digest and what to do, and exits 2. Had its shard
    recorded the damaged bytes, the read of the sample stops it, naming part and sample."""
    root = copy_data(tiny_data, tmp_path)
    row = next(r for r in read_jsonl(root / "merged" / "manifest.jsonl") if r["split"] == "val")  # every val sample is read
    part = root / "hidden" / row["shard"] / row["part"]
    width = 3 * read_json(root / "merged" / "meta.json")["hidden_size"]
    at = part_element(part, "aux", row["offset"] * width + 7)
    with part.open("r+b") as handle:
        handle.seek(at)
        handle.write(bytes([0x31, 0xFF]))  # bf16 0xFF31, little-endian: -2.35e38
    params = stage_params(tmp_path / "p.yaml", max_steps=2)
    args = stage_args(root, tiny_verifier_dir, "run", params)
    line = error_line(args, monkeypatch, capsys)
    assert line.startswith(f"error: {part} has sha256 ") and "not the " in line and "extract recorded" in line, line
    assert line.endswith(f"re-extract it (`dvc repro -f extract@{row['shard']}`) or restore it (`dvc checkout --force {part.parent}`)")
    record_digest(part)
    line = error_line(args, monkeypatch, capsys)
    assert f"{part}: sample {row['id']}" in line and "aux holds -2.35e+38" in line, line
    assert not (root / "run" / "drafter").exists()


def test_a_token_id_beyond_the_vocabulary_is_refused_where_it_is_read(tiny_data, tmp_path):
    """An input_ids flip to an id the verifier's embedding does not have (it failed 4 steps into
    training with an IndexError): one line naming part and sample."""
    root = copy_data(tiny_data, tmp_path)
    dataset = HiddenStates(root / "merged", root / "hidden", "train")
    row = dataset.rows[0]
    part = root / "hidden" / row["shard"] / row["part"]
    with part.open("r+b") as handle:
        handle.seek(part_element(part, "input_ids", row["offset"] + 1))
        handle.write((dataset.vocab_size + 5).to_bytes(4, "little"))
    with pytest.raises(UserError) as caught:
        dataset[0]
    assert str(caught.value).startswith(f"{part}: sample {row['id']} (tokens {row['offset']}..{row['offset'] + row['length']}): "
                                        f"input_ids holds token id {dataset.vocab_size + 5}, outside the verifier's vocabulary "
                                        f"[0, {dataset.vocab_size})"), caught.value


def test_second_trainer_on_one_run_is_refused(tiny_data, tiny_verifier_dir, tmp_path):
    params = stage_params(tmp_path / "p.yaml", max_steps=2)
    args = train_paths(stage_args(copy_data(tiny_data, tmp_path), tiny_verifier_dir, "run", params))
    train_with(args, params)
    (run_dir,) = [p for p in args.checkpoints.iterdir() if p.is_dir()]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from eagle3.training.checkpoints import lock_run; "
                               "lock_run(__import__('pathlib').Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)",
                               str(run_dir)], stdout=subprocess.PIPE, text=True, env=with_sources())
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(UserError, match=f"another trainer \\(pid {holder.pid}\\) is writing this run"):
            train_with(args, params)
    finally:
        holder.kill()
        holder.wait()
    lock_run(run_dir)  # free again once the holder is gone


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigkill_of_the_launcher_ends_torchrun_workers(tiny_data, tiny_verifier_dir, tmp_path):
    """`kill -9` of the process running the stage (DVC) ends the torchrun agent and its workers,
    which torchrun starts in their own session. A stand-in plays DVC: it runs the stage command
    through bash with DVC_STAGE set, as `dvc repro` does."""
    params = stage_params(tmp_path / "p.yaml", max_steps=1000, batch_tokens=4 * 128, micro_batch_rows=2, checkpoint_every=1000,
                          val_every=1000)
    command = " ".join([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eagle3.train",
                        *stage_args(copy_data(tiny_data, tmp_path), tiny_verifier_dir, "run", params), "--threads", "1"])
    env = with_sources(OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; "
                                 "subprocess.run(['bash', '-c', sys.argv[1]], env={**os.environ, 'DVC_STAGE': 'train'})", command],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "live" / "plots").is_dir():  # training has started
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()[-3000:]
        time.sleep(0.2)
    started = descendants(launcher.pid)
    assert len(started) >= 3  # torchrun agent + 2 workers
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while [p for p in started if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in started if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running after the launcher was killed: {left}"


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_equal_one(tiny_data, tiny_verifier_dir, fsdp):
    """torchrun --nproc-per-node 2 (gloo, batch 2 each; DDP, or FSDP: the lm_head a unit, the rest the root) == one
    process (batch 4), same global batches."""
    env = with_sources(OMP_NUM_THREADS="1")
    one_name, two_name = (f"{n}-{'fsdp' if fsdp else 'ddp'}" for n in ("one", "two"))  # the module's data: a folder each run
    head = {"lm_head_init": "verifier", "freeze_lm_head": True}
    one = stage_params(tiny_data / f"{one_name}.yaml", batch_tokens=4 * 128, micro_batch_rows=4, max_steps=3, **head)
    two = stage_params(tiny_data / f"{two_name}.yaml", batch_tokens=4 * 128, micro_batch_rows=4, max_steps=3, fsdp=fsdp, **head)
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eagle3.train",
                            *stage_args(tiny_data, tiny_verifier_dir, two_name, two), "--threads", "1"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train_with(train_paths(stage_args(tiny_data, tiny_verifier_dir, one_name, one)), one)  # meanwhile, one process in this one
    finally:
        output = run.communicate()[0]
    assert run.returncode == 0, output[-3000:]
    a, b = final_weights(tiny_data, one_name), final_weights(tiny_data, two_name)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    meta_one, meta_two = (read_json(tiny_data / n / "drafter" / "meta.json")["training"] for n in (one_name, two_name))
    assert meta_two["processes"] == 2 and meta_one["best"]["sim_accept_len"] == pytest.approx(meta_two["best"]["sim_accept_len"], rel=1e-4)
    assert check_drafter(tiny_data / two_name / "drafter", tiny_verifier_dir) == []
    # The head started from the verifier's and stayed there (train.freeze_lm_head), without optimizer state.
    d2t = load_file(tiny_data / "merged" / "vocab.safetensors")["d2t"]
    verifier = verifier_parts(tiny_verifier_dir)[1]
    assert torch.equal(a["drafter.lm_head.weight"], verifier["head"][torch.arange(len(d2t)) + d2t].float())
    (run,) = [p for p in (tiny_data / one_name / "checkpoints").iterdir() if p.is_dir()]
    optimizer = torch.load(run / "latest.pt", weights_only=False)["optimizer"]["state"]
    assert "drafter.lm_head.weight" not in optimizer and "drafter.fc.weight" in optimizer
    exported = load_file(tiny_data / one_name / "drafter" / "model.safetensors")
    assert torch.equal(exported["lm_head.weight"].float(), a["drafter.lm_head.weight"].to(exported["lm_head.weight"].dtype).float())


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
    params.train = OmegaConf.merge(DEBUG, {"max_steps": 16, "batch_tokens": 128, "pack_tokens": 128, "lr": 2e-3, "warmup_fraction": 0.2, "val_every": 8,
                                           "checkpoint_every": 100, "log_every": 4})
    args = train_paths(stage_args(root, smollm2_dir, "run", tmp_path / "unused.yaml"))
    summary = train_with(args, params)
    losses, accs = (logged(args.live / "plots" / "metrics" / "train", name) for name in ("loss", "acc_0"))
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert accs[-1] > accs[0] + 0.1, accs
    assert summary["best"]["sim_accept_len"] > 0
    assert check_drafter(args.out, smollm2_dir) == []
    metrics = read_json(args.live / "metrics.json")
    assert metrics["best"]["sim_accept_len"] == pytest.approx(summary["best"]["sim_accept_len"])
    assert {"acc_0", "acc_2", "cond_acc_1", "tokens_per_s", "lr"} <= set(metrics["train"])


# --- the step on the CPU stays the eager one; the compiled step computes the same -------------------

# A 6-step debug run's history (step, prefix, loss, grad norm) and final weight sums, recorded from the
# eager step before train.compile existed (d196e95): the CPU path must still give them.
RECORDED_HISTORY = [(1, "train", 11.6010046005, 7.500782012939453), (2, "train", 12.0928869247, 9.046989440917969),
                    (3, "train", 12.2872247696, 7.707400798797607), (3, "val", 12.2625732422, None),
                    (4, "train", 11.4623212814, 8.108936309814453), (5, "train", 10.5215120316, 6.896149635314941),
                    (6, "train", 10.8031997681, 7.722618103027344), (6, "val", 12.2397937775, None)]
RECORDED_WEIGHT_SUMS = {"drafter.fc.weight": 5.523046751543006, "drafter.midlayer.self_attn.q_proj.weight": -2.2992898474039976,
                        "drafter.midlayer.mlp.down_proj.weight": 4.650217320813681, "drafter.lm_head.weight": 2.875307001195324,
                        "drafter.norm.weight": 66.41917771100998}


def recorded_run(run_dir: Path, **keys) -> dict:
    cfg = TrainConfig.from_params(OmegaConf.merge(DEBUG, {"max_steps": 6, "checkpoint_every": 3, "val_every": 3, "pack_tokens": 32,
                                                          "batch_tokens": 32, **keys}))
    dcfg = make_drafter().config
    fit_debug(run_dir, Items(dcfg, 6, seed=0), Items(dcfg, 3, seed=100), cfg)
    return torch.load(run_dir / "latest.pt", weights_only=False)


def test_the_cpu_step_is_the_eager_one_it_always_was(tmp_path):
    """compile auto leaves CPUs eager: the same bytes as compile false, and the history and weights recorded before
    the compiled step existed (metric lines now reach the host in batches: the same numbers)."""
    auto, eager = recorded_run(tmp_path / "auto"), recorded_run(tmp_path / "eager", compile=False)
    for name in auto["model"]:
        assert torch.equal(auto["model"][name], eager["model"][name]), name
    history = [(step, prefix, metrics["loss"], metrics.get("grad_norm")) for step, prefix, metrics in auto["history"]]
    assert [h[:2] for h in history] == [h[:2] for h in RECORDED_HISTORY]
    for (_, _, loss, norm), (_, _, want_loss, want_norm) in zip(history, RECORDED_HISTORY):
        assert loss == pytest.approx(want_loss, rel=1e-6) and norm == (want_norm and pytest.approx(want_norm, rel=1e-6))
    for name, total in RECORDED_WEIGHT_SUMS.items():
        assert float(auto["model"][name].double().sum()) == pytest.approx(total, rel=1e-6), name


@pytest.mark.parametrize("workers", [0, 2])
def test_states_held_on_the_device_train_the_same_bytes(tmp_path, workers):
    """train.states_on_device true (rows gathered from one tensor of every sample's states, as on a GPU; packed in the
    training process or by DataLoader workers) trains the weights and history that reading each row from the split
    does: the same rows, padding included."""
    held = recorded_run(tmp_path / "held", states_on_device=True, num_workers=workers)
    read = recorded_run(tmp_path / "read", states_on_device=False)
    for name in read["model"]:
        assert torch.equal(held["model"][name], read["model"][name]), name
    assert [(s, p, m["loss"]) for s, p, m in held["history"]] == [(s, p, m["loss"]) for s, p, m in read["history"]]


@pytest.mark.parametrize("staging_bytes", [256 << 20, 1])  # all samples sent at once; sent a buffer of one or two at a time
def test_resident_rows_are_the_collated_rows(monkeypatch, staging_bytes):
    """A packed micro-batch of ``Resident`` items, gathered, is the micro-batch collated from the samples themselves:
    states, padding (zeros) and the host tensors, however many host buffers the states went through."""
    from eagle3.training import resident as module
    from eagle3.training.resident import Resident

    monkeypatch.setattr(module, "STAGING_BYTES", staging_bytes)
    items = Items(make_drafter().config, 5, seed=3)
    batching = Batching(pack_tokens=32, batch_size=2, grad_accum=1)
    resident = Resident(items, torch.device("cpu"), "test")
    rows = [4, 0, 2, 1]
    want = collate([items[i] for i in rows], batching)
    got = collate([resident[i] for i in rows], batching)
    got.update(resident.gather(got.pop("token")))
    assert pickle.loads(pickle.dumps(resident)).aux is None  # a spawned worker gets the host side only
    assert want.keys() == got.keys()
    for key in ("input_ids", "loss_mask", "aux", "final", "position_ids"):
        assert torch.equal(want[key], got[key]), key
    assert got["tokens"] == want["tokens"]


def test_metric_lines_queue_on_the_device_and_keep_their_steps():
    """Lines closed every 2 steps reach the host together, each with its own step, sums and mean grad norm; steps of an
    open line (a sync between two lines) stay in that line."""
    from eagle3.training.reporting import SYNC_EVERY, Window, train_metrics

    clock, sums = Window(), torch.zeros(6, 2)
    sums[:, 0] = torch.tensor([4.0, 2.0, 3.0, 1.0, 1.0, 3.0])
    for step in range(1, 6):
        clock.add(10, torch.tensor(float(step)))
        if step % 2 == 0:
            clock.close(step, sums * step, lr=0.1 * step)
    lines = train_metrics(clock, 1.0, CPU)
    assert [step for step, _ in lines] == [2, 4] and not clock.lines
    assert [m["grad_norm"] for _, m in lines] == [1.5, 3.5] and [m["lr"] for _, m in lines] == [0.2, pytest.approx(0.4)]
    assert lines[0][1]["loss_0"] == pytest.approx(2.0) and lines[0][1]["acc_0"] == pytest.approx(1 / 3)
    clock.add(10, torch.tensor(6.0))
    clock.close(6, sums, lr=0.6)
    assert train_metrics(clock, 1.0, CPU)[0][1]["grad_norm"] == 5.5  # steps 5 and 6
    for _ in range(SYNC_EVERY):
        clock.add(1, torch.tensor(1.0))
    assert clock.full()


@pytest.mark.slow
def test_the_compiled_step_matches_the_eager_one(monkeypatch):
    """compile true on the CPU (inductor's C++ kernels): two steps whose batches select different numbers of rows give
    the eager step's metric sums, gradient norm and weights within float tolerance, compiled once (the selection's
    sizes are dynamic from the first step; a validation reuses the training graph)."""
    from torch._dynamo.utils import counters

    dcfg = make_drafter().config
    cfg = train_config(ttt_steps=2, pack_tokens=40, batch_tokens=40, compile=True)
    batches = [collate_ttt([Items.item(n, dcfg, seed) for n in lengths], Batching(40, 1, 1), 2)
               for seed, lengths in enumerate([[12, 20], [30, 9]])]
    assert len(batches[0]["selection"].positions) != len(batches[1]["selection"].positions)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        drafter = make_drafter(seed=11)
        head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t), drafter.d2t)
        model = TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation)
        if compiled:
            compile_step(model, head)
        optimizers = make_optimizers(model, cfg, fused=False)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
        steps = [train_step(model, head, [to_device(b, torch.device("cpu"))], Optimisation(optimizers, schedulers), cfg, CPU)
                 for b in batches]
        validate(model, head, validation_batches(Items(dcfg, 3, seed=7), cfg, CPU), cfg, CPU)  # no graph of its own
        runs.append((steps, {name: p.detach().clone() for name, p in model.named_parameters()}, counters["stats"]["unique_graphs"]))
    (eager_steps, eager_weights, _), (compiled_steps, compiled_weights, graphs) = runs
    for (sums, norm), (want_sums, want_norm) in zip(compiled_steps, eager_steps):
        torch.testing.assert_close(sums, want_sums, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(norm, want_norm, rtol=1e-4, atol=1e-5)
    for name in eager_weights:
        torch.testing.assert_close(compiled_weights[name], eager_weights[name], rtol=1e-4, atol=1e-5, msg=name)
    assert graphs == 2  # the TTT unroll and the verifier head, each once for both batches
    assert "_compile.compile_inner" in largest_compile_timers()  # what the loop logs after a compiled run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are a GPU's")
def test_the_graphed_step_matches_the_compiled_one():
    """train.cuda_graphs on one GPU: steps whose selections pad to two sizes (one size twice: a replay), then a
    validation, give the compiled step's metric sums, gradient norms and weights within bf16 tolerance."""
    cuda = World(0, 1, torch.device("cuda"))
    dcfg = make_drafter().config
    items = [[Items.item(n, dcfg, seed) for n in lengths] for seed, lengths in enumerate([[12, 20], [30, 9], [14, 18]])]
    runs = []
    for cuda_graphs in (False, True):
        torch._dynamo.reset()
        cfg = train_config(ttt_steps=2, pack_tokens=40, batch_tokens=40, compile=True, cuda_graphs=cuda_graphs)
        batches = [collate_ttt(docs, Batching(40, 1, 1), 2, static=cuda_graphs) for docs in items]
        drafter = make_drafter(seed=11)
        head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t), drafter.d2t).cuda()
        drafter = drafter.cuda()
        model = TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation)
        compile_step(model, head, graphs(cfg, cuda))
        optimizers = make_optimizers(model, cfg, fused=True)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in optimizers]
        steps = [[t.clone() for t in train_step(model, head, [to_device(b, cuda.device)], Optimisation(optimizers, schedulers),
                                                cfg, cuda)] for b in batches]
        metrics = validate(model, head, validation_batches(Items(dcfg, 3, seed=7), cfg, cuda), cfg, cuda)
        runs.append((steps, metrics, {name: p.detach().float().cpu() for name, p in model.named_parameters()}))
    (compiled_steps, compiled_metrics, compiled_weights), (graphed_steps, graphed_metrics, graphed_weights) = runs
    for (sums, norm), (want_sums, want_norm) in zip(graphed_steps, compiled_steps):
        torch.testing.assert_close(sums, want_sums, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(norm, want_norm, rtol=2e-2, atol=1e-3)
    assert graphed_metrics == pytest.approx(compiled_metrics, rel=2e-2, abs=2e-2)
    for name in compiled_weights:
        torch.testing.assert_close(graphed_weights[name], compiled_weights[name], rtol=2e-2, atol=1e-3, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="train compiles its step on GPUs")
def test_the_step_compiled_ahead_is_the_one_train_reads(tiny_data, tiny_verifier_dir, tiny_model_params, tmp_path):
    """``eagle3.training.ahead`` (what the warm server starts beside extract) on an empty compile cache, and the train
    stage started while it runs: train waits for it, then finds every graph of its step in the caches (no compile of
    its own), and trains the weights a cold compile trains."""
    params = OmegaConf.load(stage_params(tmp_path / "p.yaml", max_steps=3, batch_tokens=2 * 128, micro_batch_rows=2))
    params.model, params.merge.draft_vocab_size = tiny_model_params, 256  # tiny_data's taps and draft vocabulary
    params.layout.device, params.layout.compile_ahead = "cuda", True
    OmegaConf.save(params, tmp_path / "p.yaml")
    folder = tmp_path / ".eagle3" / "compile-ahead" / ahead_key(tiny_verifier_dir, params)
    env = with_sources(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    ahead = subprocess.Popen([sys.executable, "-m", "eagle3.training.ahead", str(tiny_verifier_dir), "--params", "p.yaml"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (folder / "lock").exists():
        assert ahead.poll() is None, ahead.stdout.read()
        time.sleep(0.1)

    def train_stage(name: str, env: dict) -> str:
        stage = subprocess.run([sys.executable, "-m", "eagle3.train", *stage_args(tiny_data, tiny_verifier_dir, name, tmp_path / "p.yaml"),
                                "--device", "cuda"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert stage.returncode == 0, stage.stderr[-3000:]
        return stage.stderr

    warm = train_stage("ahead-warm", env)
    assert ahead.wait() == 0 and (folder / "done").exists(), ahead.stdout.read()
    assert "waiting for the compile ahead of train's step" in warm
    assert re.search(r"AOT autograd cache [1-9]\d* hits, 0 misses", warm), warm[-2000:]
    cold = train_stage("ahead-cold", with_sources(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cold-cache")))
    assert re.search(r"AOT autograd cache 0 hits, [1-9]\d* misses", cold), cold[-2000:]
    warm_weights, cold_weights = (load_file(tiny_data / name / "drafter" / "model.safetensors") for name in ("ahead-warm", "ahead-cold"))
    for name in cold_weights:
        torch.testing.assert_close(warm_weights[name], cold_weights[name], rtol=0, atol=0, msg=name)


def test_train_waits_once_for_a_running_compile_ahead(tmp_path, monkeypatch, caplog):
    """``wait_for_compile_ahead`` beside the compile ahead's log: a finished one and an unlocked one (a failed
    run) are not waited for; a running one (its lock held) is, until it lets go, with one line said."""
    monkeypatch.chdir(tmp_path)
    for name in ("finished", "failed", "running"):
        (FOLDER / name).mkdir(parents=True)
    (FOLDER / "log").write_text("its output\n")
    (FOLDER / "finished" / "done").write_text("")
    held = try_lock_run(FOLDER / "running")
    threading.Timer(1.0, os.close, [held]).start()
    start = time.monotonic()
    with caplog.at_level("INFO", logger="eagle3"):
        wait_for_compile_ahead()
    assert 0.9 < time.monotonic() - start < 10
    assert caplog.text.count("waiting for the compile ahead") == 1
