"""The drafter ``train`` builds for a verifier: its shape from the verifier's config and the params, its embedding (and,
as ``train.lm_head_init`` says, its head) from the verifier's tensors, in training-time test; and the verifier head
that makes its targets.

    ttt, head = make_drafter(Verifier(config, tensors, d2t, aux_layers), draft_head, cfg, world)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from eagle3.common import UserError
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.training.config import TrainConfig
from eagle3.training.loss import TrainingTimeTest, VerifierHead
from eagle3.training.parallel import World


class Verifier(NamedTuple):
    """What the drafter takes from the verifier: its LM config and tensors (``verifier_parts``), the draft vocabulary
    (``d2t``: merge's) and the tapped layers."""

    config: Any
    tensors: dict[str, Tensor]
    d2t: Tensor
    aux_layers: list[int]


def make_drafter(verifier: Verifier, draft_head: dict[str, Any], cfg: TrainConfig,
                 world: World) -> tuple[TrainingTimeTest, VerifierHead]:
    """The drafter to train on ``world.device`` (its weights drawn from torch's generator: seed it first), in its
    training-time test, and the verifier head that makes its targets; ``draft_head``: params ``model.draft_head``."""
    try:
        draft = DraftConfig.from_verifier(verifier.config, len(verifier.d2t), verifier.aux_layers, draft_head)
    except ValueError as err:
        raise UserError(f"params.yaml: model.draft_head: {err}") from None
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    tensors, d2t = verifier.tensors, verifier.d2t.to(world.device)
    drafter = Eagle3Drafter(draft, tensors["embed"].to(world.device, dtype)).to(world.device)
    drafter.set_draft_vocab(d2t)
    if cfg.lm_head_init == "verifier":
        drafter.init_head(tensors["head"].to(world.device), tensors["norm"].to(world.device))
    drafter.lm_head.requires_grad_(not cfg.freeze_lm_head)  # frozen: no gradient, no optimizer state
    head = VerifierHead(tensors["head"].to(world.device, dtype), d2t).to(world.device)
    return TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation), head
