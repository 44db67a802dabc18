"""Training-time test: shifts, targets, the loss against a position-by-position reference, metrics."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.attention import KVCache
from eagle3.training.config import Batching
from eagle3.training.data import collate
from eagle3.training.loss import (StepMetrics, Targets, TrainingTimeTest, VerifierHead, metric_sums, select_rows, shift_left,
                                  static_size, step_counts, ttt_loss)
from support.reference import reference_ttt_loss
from support.tiny_drafter import make_drafter, one_thread, random_batch, verifier_head_weight  # noqa: F401 (autouse fixture)


def test_shift_left_and_select_rows_worked_examples():
    x = torch.tensor([[1, 2, 3, 4, 5]])
    assert shift_left(x, 2).tolist() == [[3, 4, 5, 0, 0]]
    assert shift_left(x, 0).tolist() == [[1, 2, 3, 4, 5]]
    assert shift_left(x, 9, fill=-1).tolist() == [[-1] * 5]
    sel = select_rows(torch.tensor([[0, 0, 0, 1, 1, 0]]), torch.arange(6)[None], 4)
    assert sel.positions.tolist() == [2, 3]
    assert [r.tolist() for r in sel.rows] == [[1, 2], [0, 1], [0], []]
    assert [p.tolist() for p in sel.picks] == [[0, 1], [0, 1], [1], []]
    packed = select_rows(torch.tensor([[0, 0, 0, 1, 1, 0]]), torch.tensor([[0, 1, 2, 0, 1, 2]]), 4)
    assert packed.positions.tolist() == [] and all(len(r) == 0 for r in packed.rows)  # nothing crosses into x_3's document
    two = select_rows(torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.arange(3).repeat(2, 1), 2)  # row b is offset by b*T
    assert two.positions.tolist() == [1, 4] and [r.tolist() for r in two.rows] == [[0, 3], []]
    assert two.documents.tolist() == [0, 1]  # one document per row
    docs = select_rows(torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0]]), torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 0]]), 2)
    assert docs.positions.tolist() == [1, 2, 6] and docs.documents.tolist() == [0, 0, 1]  # the 1-token document has none


def test_targets_mask_and_vocab():
    drafter = make_drafter()
    cfg = drafter.config
    weight = verifier_head_weight(cfg, drafter.d2t)
    batch = random_batch(cfg, 2, 12)
    selection = select_rows(batch["loss_mask"], torch.arange(12).repeat(2, 1), 3)
    targets = VerifierHead(weight, drafter.d2t)(batch["final"], selection.positions)
    logits = batch["final"] @ weight.T  # [B, T, V]
    best = logits.argmax(-1)
    in_vocab = drafter.t2d[best]
    assert 0 < int(in_vocab.sum()) < in_vocab.numel()  # both cases occur
    b, s = selection.positions // 12, selection.positions % 12
    assert bool(batch["loss_mask"][b, s + 1].all()) and len(s) == int(batch["loss_mask"][:, 2:].sum())  # s >= 1: step 0 has row s-1
    assert torch.equal(targets.valid, in_vocab[b, s])
    draft_ids = torch.arange(cfg.draft_vocab_size) + drafter.d2t
    assert torch.equal(draft_ids[targets.index][targets.valid], best[b, s][targets.valid])
    torch.testing.assert_close(targets.probs, logits[b, s][:, draft_ids].softmax(-1))


def test_ttt_loss_matches_reference():
    drafter = make_drafter(seed=3)
    cfg = drafter.config
    K, decay = 4, 0.8
    weight = verifier_head_weight(cfg, drafter.d2t, seed=1)
    batch = random_batch(cfg, 2, 9, seed=2)
    batch["loss_mask"][1, 6:] = 0  # a padded tail
    head = VerifierHead(weight, drafter.d2t)
    position_ids = torch.arange(9).repeat(2, 1)
    selection = select_rows(batch["loss_mask"], position_ids, K)
    targets = head(batch["final"], selection.positions)
    ce, sums = TrainingTimeTest(drafter, K, "token")(batch["input_ids"], batch["aux"], position_ids, targets, selection)
    loss = ttt_loss(ce, step_counts(targets, selection, "token"), decay)
    with torch.no_grad():
        expected, acc, counts = reference_ttt_loss(drafter, weight, drafter.d2t, batch["input_ids"], batch["loss_mask"],
                                                   batch["aux"], batch["final"], K, decay)
    assert all(c > 0 for c in counts)
    assert abs(loss.item() - float(expected)) < 1e-5
    summary = StepMetrics(sums).summary(decay)
    assert summary["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert [summary[f"acc_{k}"] for k in range(K)] == pytest.approx(acc)
    loss.backward()
    assert drafter.embed_tokens.grad is None and drafter.fc.weight.grad.abs().sum() > 0


def samples(cfg, lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Items as ``eagle3.hidden_states.loader.HiddenStates`` yields them, with loss masks that reach both ends."""
    items = []
    for i, n in enumerate(lengths):
        batch = random_batch(cfg, 1, n, seed=seed + i)
        item = {k: v[0] for k, v in batch.items()}
        item["loss_mask"] = torch.rand(n, generator=torch.Generator().manual_seed(i)) < 0.7
        item["loss_mask"][[0, 1, -1]] = True  # targets at a document's first tokens and up to its last
        items.append(item)
    return items


def ttt_loss_and_grads(drafter, head, batch, steps: int, decay: float, normalisation: str = "token",
                       static: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``static``: the selection padded as CUDA graphs take it (``Selection.pad``)."""
    drafter.zero_grad(set_to_none=True)
    selection = select_rows(batch["loss_mask"], batch["position_ids"], steps)
    if static:
        selection = selection.pad(batch["position_ids"].numel())
    targets = head(batch["final"], selection.positions, selection.padded)
    ttt = TrainingTimeTest(drafter, steps, normalisation)
    ce, sums = ttt(batch["input_ids"], batch["aux"], batch["position_ids"], targets, selection)
    loss = ttt_loss(ce, step_counts(targets, selection, normalisation), decay)
    loss.backward()
    return loss.detach(), sums, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_packed_rows_equal_padded_samples():
    """Samples packed into one row (with a padding tail) give the loss, metrics and gradients of
    the same samples each alone in a right-padded row: nothing crosses a document boundary."""
    drafter = make_drafter(seed=5).float()
    cfg, K = drafter.config, 4
    head = VerifierHead(verifier_head_weight(cfg, drafter.d2t, seed=2), drafter.d2t)
    items = samples(cfg, [9, 3, 12, 6], seed=40)
    packed = collate(items, Batching(pack_tokens=35, batch_size=1, grad_accum=1))
    assert packed["position_ids"][0].tolist() == [*range(9), *range(3), *range(12), *range(6), *range(5)]
    padded = [collate([item], Batching(pack_tokens=12, batch_size=1, grad_accum=1)) for item in items]
    padded = {key: torch.cat([p[key] for p in padded]) for key in ("input_ids", "loss_mask", "aux", "final", "position_ids")}
    loss_packed, sums_packed, grads_packed = ttt_loss_and_grads(drafter, head, packed, K, 0.8)
    loss_padded, sums_padded, grads_padded = ttt_loss_and_grads(drafter, head, padded, K, 0.8)
    assert float(loss_packed) > 0 and grads_packed.keys() == grads_padded.keys() and "lm_head.weight" in grads_packed
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums_packed, sums_padded, rtol=1e-5, atol=1e-5)
    for name in grads_packed:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_a_padded_selection_adds_nothing(normalisation):
    """Two packed rows whose selection is padded to a static size (what CUDA graphs replay) give the loss, every
    metric sum and every gradient of the selection as selected: the appended targets are never valid, the
    appended rows land in a dropped slot. Row 0's first token is a scored row, where an appended row would
    overwrite its flags if it pointed there."""
    drafter = make_drafter(seed=5).float()
    cfg, K = drafter.config, 3
    head = VerifierHead(verifier_head_weight(cfg, drafter.d2t, seed=2), drafter.d2t)
    batch = collate(samples(cfg, [9, 3, 12, 6], seed=40), Batching(pack_tokens=18, batch_size=2, grad_accum=1))
    selection = select_rows(batch["loss_mask"], batch["position_ids"], K)
    padded = selection.pad(36)
    assert len(padded.positions) > len(selection.positions) and 0 in selection.rows[0]
    assert {len(t) for t in padded.tensors()} == {len(padded.positions)} and padded.padded.sum() >= 1
    want = ttt_loss_and_grads(drafter, head, batch, K, 0.8, normalisation)
    got = ttt_loss_and_grads(drafter, head, batch, K, 0.8, normalisation, static=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6, msg=name)


def test_static_sizes_are_few_and_leave_room():
    """At most 8 sizes an octave, each above its count by at least one target and at most an eighth."""
    sizes = {static_size(n) for n in range(2048, 4096)}
    assert len(sizes) == 8 and [static_size(n) for n in (1, 3, 3198, 4096)] == [2, 4, 3328, 4608]
    assert all(n < static_size(n) <= n + max(1, n // 8) for n in range(1, 5000))


def test_sequence_normalisation_of_one_document_is_token_normalisation():
    """A batch of one document (and its padding tail): the mean over documents is that document's mean."""
    drafter = make_drafter(seed=5).float()
    head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t, seed=2), drafter.d2t)
    batch = collate(samples(drafter.config, [12], seed=40), Batching(pack_tokens=15, batch_size=1, grad_accum=1))
    loss_token, sums_token, grads_token = ttt_loss_and_grads(drafter, head, batch, 4, 0.8, "token")
    loss_sequence, sums_sequence, grads_sequence = ttt_loss_and_grads(drafter, head, batch, 4, 0.8, "sequence")
    assert float(loss_token) > 0 and grads_token.keys() == grads_sequence.keys()
    torch.testing.assert_close(loss_sequence, loss_token, rtol=1e-6, atol=1e-6)
    for name in grads_token:
        torch.testing.assert_close(grads_sequence[name], grads_token[name], rtol=1e-5, atol=1e-6, msg=name)
    assert StepMetrics(sums_sequence).summary(0.8) == pytest.approx(StepMetrics(sums_token).summary(0.8), rel=1e-6)


def each_target_ce(drafter, head, batch, steps: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The soft CE of every target at every step, scored one target at a time: [K, N] (0 where step k
    does not score it), with the targets' validity [N] and each step's picks."""
    selection = select_rows(batch["loss_mask"], batch["position_ids"], steps)
    targets = head(batch["final"], selection.positions)
    ttt, n = TrainingTimeTest(drafter, steps, "token"), len(selection.positions)
    with torch.no_grad():
        ce = [ttt(batch["input_ids"], batch["aux"], batch["position_ids"], Targets(targets.probs, targets.index, torch.arange(n) == j),
                  selection)[0] for j in range(n)]
    return torch.stack(ce, 1), targets.valid, selection.picks


def test_sequence_normalisation_is_the_mean_over_documents_of_their_mean_ce():
    """Documents of 11 and 5 tokens in one row: step k's loss is the mean, over the documents with a
    valid target at step k, of each one's mean CE over its valid targets (the short one has none at
    the last step); computed here from each target's own CE."""
    drafter = make_drafter(seed=5).float()
    head = VerifierHead(verifier_head_weight(drafter.config, drafter.d2t, seed=2), drafter.d2t)
    K, decay = 4, 0.8
    batch = collate(samples(drafter.config, [11, 5], seed=40), Batching(pack_tokens=18, batch_size=1, grad_accum=1))
    ce, valid, picks = each_target_ce(drafter, head, batch, K)
    positions = select_rows(batch["loss_mask"], batch["position_ids"], K).positions
    document = (positions >= 11).long()  # [N]: 1 where s is in the second document
    expected, counted = 0.0, []
    for k in range(K):
        means = []
        for d in (0, 1):
            mine = [int(j) for j in picks[k] if document[j] == d and valid[j]]
            if mine:
                means.append(sum(float(ce[k, j]) for j in mine) / len(mine))
        expected += decay**k * sum(means) / max(len(means), 1)
        counted.append(len(means))
    assert counted == [2, 2, 2, 1]  # the short document's last target (s = 3) needs row s-k-1 >= 0: k <= 2
    loss_sequence, _, _ = ttt_loss_and_grads(drafter, head, batch, K, decay, "sequence")
    loss_token, _, _ = ttt_loss_and_grads(drafter, head, batch, K, decay, "token")
    assert float(loss_sequence) == pytest.approx(expected, rel=1e-5)
    assert abs(float(loss_sequence) - float(loss_token)) > 1e-3  # the documents' weights differ from their target counts'


@pytest.mark.skipif(not torch.cuda.is_available(), reason="training fuses its elementwise ops on CUDA only")
def test_fused_training_on_gpu_matches_eager_cpu():
    """The training unroll on a GPU (compiled norms, RoPE, SwiGLU, chain merge and soft CE, fused
    FlexAttention; fp32) gives the CPU's eager loss, metrics and gradients on packed documents."""
    drafter = make_drafter(seed=5).float()
    cfg, K = drafter.config, 4
    weight = verifier_head_weight(cfg, drafter.d2t, seed=2)
    batch = collate(samples(cfg, [140, 33, 200, 61], seed=40), Batching(pack_tokens=300, batch_size=2, grad_accum=1))
    results = []
    for device in ("cpu", "cuda"):
        on = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        results.append(ttt_loss_and_grads(drafter.to(device), VerifierHead(weight.to(device), drafter.d2t), on, K, 0.8))
    (loss_cpu, sums_cpu, grads_cpu), (loss_gpu, sums_gpu, grads_gpu) = results
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sums_gpu.cpu(), sums_cpu, rtol=1e-4, atol=1e-3)
    for name in grads_cpu:
        torch.testing.assert_close(grads_gpu[name].cpu(), grads_cpu[name], rtol=1e-3, atol=1e-4, msg=name)

def test_metrics_by_hand():
    """Three rows, three steps: acc, conditional acc and simulated acceptance length; a target
    outside the draft vocabulary (not valid) is a miss, a row without a target is not counted."""
    right = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)  # [K, rows]
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    scored = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # row 2 has no target at step 2
    summary = StepMetrics(metric_sums(torch.zeros(3), valid.sum(1).float(), right, valid, scored)).summary(0.8)
    # step 2: row 0 is right, row 1's target is no draft token (a miss, as in decoding), row 2 has none.
    assert [summary[f"acc_{k}"] for k in range(3)] == pytest.approx([2 / 3, 2 / 3, 1 / 2])
    # step 1: rows right at step 0 are {0, 1}; of those, row 0 is right at step 1.
    # step 2: rows right at steps 0, 1 are {0}; it is right at step 2.
    assert [summary[f"cond_acc_{k}"] for k in range(3)] == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert summary["sim_accept_len"] == pytest.approx(2 / 3 + 4 / 9 + 2 / 9)


def test_accuracy_counts_targets_outside_the_draft_vocab_as_misses():
    """A drafter that agrees with the verifier on every target its vocabulary holds scores that
    coverage, not 1: decoding can never accept the other targets."""
    drafter = make_drafter(seed=3)
    batch = random_batch(drafter.config, 1, 12, seed=2)
    position_ids = torch.arange(12)[None]
    selection = select_rows(batch["loss_mask"], position_ids, 1)
    with torch.no_grad():  # the drafter's own step-0 argmax at every target
        cache = KVCache(starts=torch.zeros_like(position_ids))
        h2 = drafter.step(shift_left(batch["input_ids"], 1), drafter.fc(batch["aux"]), position_ids, cache)
        agree = drafter.logits(h2.flatten(0, 1)[selection.rows[0]]).argmax(-1)
    n, vd = len(selection.positions), drafter.config.draft_vocab_size
    index = torch.zeros(n, dtype=torch.long).index_put_((selection.picks[0],), agree)
    valid = torch.arange(n) % 3 > 0  # a third of the targets are no draft token
    targets = Targets(torch.full((n, vd), 1 / vd), index, valid)
    _, sums = TrainingTimeTest(drafter, 1, "token")(batch["input_ids"], batch["aux"], position_ids, targets, selection)
    summary = StepMetrics(sums).summary(0.8)
    assert n >= 6 and summary["acc_0"] == pytest.approx(float(valid.float().mean()))
    assert summary["sim_accept_len"] == pytest.approx(summary["acc_0"])
