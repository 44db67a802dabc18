"""Train's compiled step, built ahead while extract holds the GPU (``layout.compile_ahead``).

Why: on a fresh GPU host the train stage's first step compiled for ~30 s (dynamo, AOT autograd, Inductor's code
generation and kernel builds) with the GPU idle, the longest idle stretch of a 10k run (train 61 % busy, 92 % over
its steps). What it compiles depends only on shapes and settings known once the verifier is imported: the drafter's
sizes, the ``train`` params, the rows' layout. So the warm server (``eagle3.warm``) starts this process beside the
first ``extract`` command: it builds train's drafter for the verifier (its draft vocabulary drawn at random: the graphs
do not read values), compiles it as the stage does and runs one step on random rows of the stage's format, then
exits. torch.compile's caches (Inductor's FX graph cache, AOT autograd's) then hold what train's compile would write,
and train's first step reads them. Nothing train writes changes: a cache hit is the code its compile would produce.

    python -m eagle3.training.ahead models/verifier --params params.yaml   # what the warm server runs, detached

Once per verifier, params and training code (``ahead_key``): ``.eagle3/compile-ahead/<key>/`` holds its ``lock``
while it runs (train waits for it there: ``wait_for_compile_ahead``) and ``done`` once it succeeded; what it prints
goes to ``.eagle3/compile-ahead/log``. A failure only logs: train then compiles as it would have.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3.common import sha256_file, stable_hash, to_plain, try_lock_run
from eagle3.hidden_states.config import ExtractSettings
from eagle3.layout import LayoutSettings
from eagle3.lm.spec import ModelSettings
from eagle3.settings import StageParams, keys_of, section, stage_params
from eagle3.training.checkpoints import PACKAGE, training_code
from eagle3.training.config import TrainConfig
from eagle3.training.parallel import World
from eagle3.training.mixture import MixtureSettings
from eagle3.training.step import compiles

log = logging.getLogger(__name__)

PARAMS = StageParams(section(TrainConfig), section(ModelSettings), keys_of(MixtureSettings, "draft_vocab_size"),  # what decides
                     keys_of(ExtractSettings, "dtype"),                                                     # whether and what
                     keys_of(LayoutSettings, "device", "train_procs", "nnodes", "compile_ahead"))           # it compiles
FOLDER = Path(".eagle3") / "compile-ahead"
WAIT_S = 180  # the longest train waits for a running compile ahead (train's own cold compile: 29-40 s on one H100)
DOCUMENT_TOKENS = 300  # the random rows' documents: about the 10k data's prompt and answer together


def ahead_key(verifier: Path, values) -> str | None:
    """What train's compiled step depends on (the params ``values`` that shape the drafter, its rows and its step, the
    verifier's config, the training code), hashed; None where train compiles nothing ahead: ``layout.compile_ahead``
    off, or not one CUDA process that compiles its step (``train.compile``)."""
    layout = values.layout
    if not layout.compile_ahead or layout.device != "cuda" or layout.train_procs * layout.nnodes != 1:
        return None
    if not compiles(TrainConfig.from_params(values.train), World(0, 1, torch.device("cuda"))):
        return None
    shaping = {key: to_plain(OmegaConf.select(values, key)) for key in PARAMS}
    code = {str(file.relative_to(PACKAGE)): sha256_file(file) for file in training_code()}
    return stable_hash({"params": shaping, "verifier": sha256_file(verifier / "config.json"), "code": code})


def wait_for_compile_ahead() -> None:
    """Wait (at most ``WAIT_S``) for a compile ahead still running in this folder: compiling beside it, train would
    repeat its work instead of reading its caches."""
    unfinished = [f for f in FOLDER.iterdir() if f.is_dir() and not (f / "done").exists()] if FOLDER.is_dir() else []
    deadline = time.monotonic() + WAIT_S
    for folder in unfinished:
        fd = try_lock_run(folder)
        if fd is None:  # running
            log.info("waiting for the compile ahead of train's step to finish (its log: %s)", FOLDER / "log")
            while (fd := try_lock_run(folder)) is None and time.monotonic() < deadline:
                time.sleep(0.5)
        if fd is not None:
            os.close(fd)


def random_rows(config, values, batching, generator: torch.Generator) -> dict:
    """One micro-batch as train's loader makes it for the verifier of LM ``config`` and the params ``values``
    (``collate_ttt``, the selection padded for CUDA graphs): documents of random tokens and states, the second half of
    each under the loss mask, filling the rows."""
    from eagle3.hidden_states.storage import encode_states, training_states
    from eagle3.lm.spec import VerifierSpec
    from eagle3.training.step import collate_ttt

    taps = len(VerifierSpec.from_params(values.model).aux_layers)
    count = batching.batch_size * max(1, batching.pack_tokens // DOCUMENT_TOKENS)
    length = min(DOCUMENT_TOKENS, batching.pack_tokens)

    def states(name: str, groups: int) -> torch.Tensor:  # stored as extract stores them, read as training reads them
        random = torch.randn(length, groups * config.hidden_size, generator=generator)
        return training_states(encode_states(name, random, values.extract.dtype, groups), name)

    items = [{"input_ids": torch.randint(0, config.vocab_size, (length,), generator=generator),
              "loss_mask": torch.arange(length) >= length // 2, "aux": states("aux", taps), "final": states("final", 1)}
             for _ in range(count)]
    return collate_ttt(items, batching, int(values.train.ttt_steps), static=True)


def compile_step_ahead(verifier: Path, values) -> None:
    """Build, compile and run one step of train's drafter for ``verifier`` and the params ``values``."""
    from eagle3.lm.loading import verifier_parts
    from eagle3.lm.spec import VerifierSpec
    from eagle3.training.drafter import Verifier, make_drafter
    import eagle3.training.parallel as parallel
    from eagle3.training.step import (Optimisation, compile_step, graphs, make_optimizers, start_compile_workers, to_device,
                                      train_step)

    start_compile_workers()
    cfg, world = TrainConfig.from_params(values.train), parallel.init_world("cuda")
    spec, (config, tensors) = VerifierSpec.from_params(values.model), verifier_parts(verifier)
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(values.merge.draft_vocab_size), config.vocab_size)  # as merge caps it
    d2t = torch.randperm(config.vocab_size, generator=generator)[:vocab].sort().values - torch.arange(vocab)
    ttt, head = make_drafter(Verifier(config, tensors, d2t, spec.aux_layers), spec.draft_head, cfg, world)
    compile_step(ttt, head, graphs(cfg, world))
    model = parallel.wrap(ttt, world, cfg.fsdp)
    optimizers = make_optimizers(model, cfg, fused=True)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0) for optimizer in optimizers]
    batching = cfg.batching(world.size)
    micro = [to_device(random_rows(config, values, batching, generator), world.device) for _ in range(batching.grad_accum)]
    start = time.perf_counter()
    train_step(model, head, micro, Optimisation(optimizers, schedulers), cfg, world)
    torch.cuda.synchronize()
    log.info("train's step compiled and run in %.1f s", time.perf_counter() - start)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.training.ahead",
                                     description="compile train's step ahead, into torch.compile's caches")
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    values = stage_params(PARAMS, args.params)
    key = ahead_key(args.verifier, values)
    if key is None:
        log.info("%s: train compiles no step ahead on this layout", args.params)
        return
    folder = FOLDER / key
    folder.mkdir(parents=True, exist_ok=True)
    fd = try_lock_run(folder)
    if fd is None or (folder / "done").exists():  # running in another process, or done before
        return
    compile_step_ahead(args.verifier, values)
    (folder / "done").write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
