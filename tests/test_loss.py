"""Training-time test: shifts, targets, the loss against a position-by-position reference, metrics."""

from __future__ import annotations

import pytest
import torch

from eagle3.loss import StepMetrics, Targets, TrainingTimeTest, VerifierHead, metric_sums, shift_left, step_counts, ttt_loss
from reference import reference_ttt_loss
from tiny_drafter import make_drafter, random_batch, verifier_head_weight


def test_shift_left_worked_examples():
    x = torch.tensor([[1, 2, 3, 4, 5]])
    assert shift_left(x, 2).tolist() == [[3, 4, 5, 0, 0]]
    assert shift_left(x, 0).tolist() == [[1, 2, 3, 4, 5]]
    assert shift_left(x, 9, fill=-1).tolist() == [[-1] * 5]
    t = Targets(torch.ones(1, 5, 3), torch.tensor([[0, 1, 2, 3, 4]]), torch.ones(1, 5, dtype=torch.bool))
    step = t.at_step(1)  # row t gets position t+2
    assert step.index.tolist() == [[2, 3, 4, 0, 0]] and step.valid.tolist() == [[True] * 3 + [False] * 2]
    assert step.probs[0, 3:].sum() == 0


def test_targets_mask_and_vocab():
    drafter = make_drafter()
    cfg = drafter.config
    weight = verifier_head_weight(cfg, drafter.d2t)
    batch = random_batch(cfg, 2, 12)
    targets = VerifierHead(weight, drafter.d2t)(batch["final"], batch["loss_mask"])
    logits = batch["final"] @ weight.T  # [B, T, V]
    best = logits.argmax(-1)
    in_vocab = drafter.t2d[best]
    assert 0 < int(in_vocab.sum()) < in_vocab.numel()  # both cases occur
    expected = in_vocab.clone()
    expected[:, :-1] &= batch["loss_mask"][:, 1:].bool()  # position s is trained when x_{s+1} is masked in
    expected[:, -1] = False
    assert torch.equal(targets.valid, expected)
    draft_ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
    assert torch.equal((draft_ids[targets.index])[targets.valid], best[targets.valid])
    torch.testing.assert_close(targets.probs, logits[..., draft_ids].softmax(-1))


@pytest.mark.parametrize("pre_norm", [False, True])
def test_ttt_loss_matches_reference(pre_norm):
    drafter = make_drafter(seed=3)
    cfg = drafter.config
    K, decay = 4, 0.8
    weight = verifier_head_weight(cfg, drafter.d2t, seed=1)
    norm_weight = torch.rand(cfg.hidden_size) + 0.5 if pre_norm else None
    batch = random_batch(cfg, 2, 9, seed=2)
    batch["loss_mask"][1, 6:] = 0  # a padded tail
    head = VerifierHead(weight, drafter.d2t, norm_weight, cfg.rms_norm_eps)
    targets = head(batch["final"], batch["loss_mask"])
    ce, sums = TrainingTimeTest(drafter, K)(batch["input_ids"], batch["aux"], targets)
    loss = ttt_loss(ce, step_counts(targets, K), decay)
    with torch.no_grad():
        expected, acc, counts = reference_ttt_loss(drafter, weight, drafter.d2t, batch["input_ids"], batch["loss_mask"],
                                                   batch["aux"], batch["final"], K, decay, norm_weight)
    assert all(c > 0 for c in counts)
    assert abs(loss.item() - float(expected)) < 1e-5
    summary = StepMetrics(sums).summary(decay)
    assert summary["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert [summary[f"acc_{k}"] for k in range(K)] == pytest.approx(acc)
    loss.backward()
    assert drafter.embed_tokens.grad is None and drafter.fc.weight.grad.abs().sum() > 0


def test_metrics_by_hand():
    """Three rows, three steps: acc, conditional acc and simulated acceptance length."""
    right = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)[:, None]  # [K, B=1, T=3]
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)[:, None]
    summary = StepMetrics(metric_sums(torch.zeros(3), right, valid)).summary(0.8)
    assert [summary[f"acc_{k}"] for k in range(3)] == pytest.approx([2 / 3, 2 / 3, 1.0])
    # step 1: rows right at step 0 are {0, 1}; of those, row 0 is right at step 1.
    # step 2: rows right at steps 0, 1 are {0}; it is valid at step 2 and right.
    assert [summary[f"cond_acc_{k}"] for k in range(3)] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert summary["sim_accept_len"] == pytest.approx(2 / 3 + 4 / 9 + 4 / 9)
