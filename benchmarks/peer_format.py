"""One run's training data and drafters in the peer trainer's formats (speculators 0.9.0), and its
checkpoints back in ours, with the checks that the conversion is right.

    facts = write_peer_data(merged, hidden_states, verifier, out, max_length=8192)
    export_peer_checkpoint(checkpoint, verifier, merged, draft_head, drafter_out, training)
    checks = check_conversion(peer_data, facts, merged, hidden_states, verifier, drafter, work)

Why: ``peer_tau.py`` trains the peer on exactly our hidden states and evaluates its drafter with
our ``evaluate``; a silent shift, a wrong norm or a dropped weight here would compare nothing.

Its formats, as its source reads and writes them (speculators 0.9.0, hs_connectors 0.9.0):

- rows: ``prepare_data`` saves (``save_to_disk``) what ``build_speculator_training_dataset``
  (``data_generation/preprocessing.py``) returns: ``input_ids``, ``loss_mask`` (1 on the
  assistant's tokens, unshifted, as ours) and ``seq_len``, torch format. Rows that are already
  tokens pass through that function unchanged, so it is called here rather than imitated.
- hidden states: ``<data>/hidden_states/hs_<row>.safetensors`` (hs_connectors ``FileTransfer``) with
  ``token_ids`` [T] and ``hidden_states`` [T, 4, H]: the 3 tapped layers, then the last layer's
  output *before* the final norm (``ArrowDataset`` splits off ``[:, -1]``; ``Eagle3DraftModel``
  computes the targets as ``verifier_lm_head(verifier_norm(h))``, ``models/eagle3/core.py``). Our
  ``final`` is after the norm, so ``final / norm.weight`` is stored: the norm of that is ``final``
  again up to eps and bf16 rounding (its RMS is 1 - O(eps)).
- split: ``ArrowDataset`` trains on the first ``int(rows * train_data_ratio)`` rows and validates
  on the rest, so our train rows come first, then our val rows, and the ratio lands between.
- vocabulary: ``<data>/d2t-<Vd>.npy`` and ``t2d-<Vd>.npy`` (``train/cli.py`` ``parse_vocab_mappings``):
  ours, so both drafters draft over the same tokens.
- checkpoint: ``save_pretrained`` of its ``Eagle3DraftModel``, our tensor names but ``layers.0.*``
  for ``midlayer.*`` (its ``convert/eagle/eagle3_converter.py`` renames ``midlayer.`` to
  ``layers.0.``; ``PEER_NAMES`` is that rename and its inverse), plus its copy of the verifier's
  embedding, which our export leaves out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.common import UserError, read_json
from eagle3.drafter.attention import KVCache
from eagle3.drafter.export import EXPORT_NAMES, load_drafter
from eagle3.drafter.model import DraftConfig
from eagle3.hidden_states.loader import HiddenStates
from eagle3.lm.loading import verifier_parts
from eagle3.training.checkpoints import Trained, export
from eagle3.training.loss import shift_left
from peer_speculators import import_peer, peer_model

OUR_LAYER, PEER_LAYER = "midlayer.", "layers.0."
PEER_NAMES = {name: PEER_LAYER + name.removeprefix(OUR_LAYER) if name.startswith(OUR_LAYER) else name for name in EXPORT_NAMES}
VERIFIER_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # its copies, not drafter weights


def peer_state(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our drafter's tensors under the peer's names."""
    return {PEER_NAMES[name]: tensor for name, tensor in ours.items()}


def our_state(peer: dict[str, torch.Tensor], d2t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A peer checkpoint's drafter tensors under our names; refuses weights our drafter has no place for.

    Without a draft vocabulary (Vd = V) it saves no ``d2t``/``t2d``: they are the identity then.
    """
    names = {peer_name: ours for ours, peer_name in PEER_NAMES.items()}
    extra = sorted(set(peer) - set(names) - set(VERIFIER_COPIES))
    if extra:
        raise UserError(f"the peer checkpoint has {extra}, which our drafter has not: train it with our layer "
                        "(peer_tau.PEER_ARCHITECTURE) and one layer")
    state = {names[name]: tensor for name, tensor in peer.items() if name in names}
    state.setdefault("d2t", d2t)
    state.setdefault("t2d", torch.ones(len(d2t), dtype=torch.bool))
    return state


# --- data ------------------------------------------------------------------------------------------


def pre_norm(final: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A pre-norm state whose RMSNorm (weight ``norm_weight``) is ``final`` [T, H], up to eps: final / w."""
    return torch.where(norm_weight != 0, final / norm_weight, torch.zeros_like(final))


def peer_states(sample: dict[str, torch.Tensor], final_state: str, norm_weight: torch.Tensor) -> torch.Tensor:
    """Its ``hidden_states`` [T, 4, H] bf16 of one of our samples: aux [T, 3H] as 3 layers, then the final state."""
    final = sample["final"] if final_state == "pre-norm" else pre_norm(sample["final"], norm_weight)
    tokens, width = final.shape
    layers = sample["aux"].view(tokens, -1, width)  # [T, 3, H]: ascending taps, as aux concatenates them
    return torch.cat([layers, final[:, None]], 1).to(torch.bfloat16)


def write_peer_data(merged: Path, hidden_states: Path, verifier: Path, out: Path, max_length: int) -> dict:
    """Our train then val split as its training folder ``out`` (empty); returns the facts its trainer needs."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    splits = {name: HiddenStates(merged, hidden_states, name) for name in ("train", "val")}
    longest = max(max(split.lengths) for split in splits.values())
    if longest > max_length:
        raise UserError(f"{merged}: a sample of {longest} tokens is longer than the peer's total_seq_len {max_length}, "
                        "which would cut its row but not its hidden states; raise --total-seq-len")
    meta = splits["train"].meta
    norm = verifier_parts(verifier)[1]["norm"].float()
    (out / "hidden_states").mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": []}
    for split in splits.values():
        for i in range(len(split)):
            sample = split[i]
            save_file({"hidden_states": peer_states(sample, meta["final_state"], norm), "token_ids": sample["input_ids"]},
                      out / "hidden_states" / f"hs_{len(rows['input_ids'])}.safetensors")
            rows["input_ids"].append(sample["input_ids"].tolist())
            rows["loss_mask"].append(sample["loss_mask"].int().tolist())
    dataset = build_speculator_training_dataset(Dataset.from_dict(rows), None, max_length=max_length, num_proc=1)
    if len(dataset) != len(rows["input_ids"]):  # row i must stay hs_<i>
        raise UserError(f"{merged}: the peer's preprocessing dropped {len(rows['input_ids']) - len(dataset)} rows")
    dataset.save_to_disk(str(out))  # beside hidden_states/, as prepare_data and its offline generation lay it out
    vocab = load_file(merged / "vocab.safetensors")
    np.save(out / f"d2t-{len(vocab['d2t'])}.npy", vocab["d2t"].numpy())
    np.save(out / f"t2d-{len(vocab['d2t'])}.npy", vocab["t2d"].numpy())
    n_train, n = len(splits["train"]), len(rows["input_ids"])
    return {"rows": n, "train_rows": n_train, "train_data_ratio": (n_train + 0.5) / n, "draft_vocab_size": len(vocab["d2t"]),
            "aux_layers": list(meta["aux_layers"]), "final_state": meta["final_state"], "train_tokens": sum(splits["train"].lengths)}


# --- checkpoints -----------------------------------------------------------------------------------


def draft_config(verifier: Path, merged: Path, draft_head: dict) -> DraftConfig:
    """The drafter shape ``eagle3.train`` builds for this verifier and merge."""
    d2t = load_file(merged / "vocab.safetensors")["d2t"]
    return DraftConfig.from_verifier(verifier_parts(verifier)[0], len(d2t), read_json(merged / "meta.json")["aux_layers"], draft_head)


# Its config.json's switches of the layer, and the value that is our layer. The same tensor names
# hold either value of norm_before_residual: only the config tells them apart.
OUR_LAYER_SWITCHES = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def layer_problems(config: dict) -> list[str]:
    """How a checkpoint's config.json (its ``Eagle3SpeculatorConfig``) is not our drafter's layer."""
    problems = [f"{key} is {config.get(key)}" for key, ours in OUR_LAYER_SWITCHES.items() if config.get(key, ours) != ours]
    layers = config.get("transformer_layer_config", {})
    if layers.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {layers['num_hidden_layers']}")
    if "sliding_attention" in (layers.get("layer_types") or []):
        problems.append("its layer attends within a sliding window")
    return problems


def export_peer_checkpoint(checkpoint: Path, verifier: Path, merged: Path, draft_head: dict, out: Path, training: dict) -> None:
    """Its ``checkpoint/model.safetensors`` as our drafter folder ``out`` (``eagle3.train.export``: check-drafter must pass)."""
    problems = layer_problems(read_json(checkpoint / "config.json"))
    if problems:
        raise UserError(f"{checkpoint}/config.json: not our drafter's layer ({'; '.join(problems)}); train it with "
                        "peer_tau.PEER_ARCHITECTURE")
    d2t = load_file(merged / "vocab.safetensors")["d2t"]
    state = our_state(load_file(checkpoint / "model.safetensors"), d2t)
    export(out, verifier, Trained(state, draft_config(verifier, merged, draft_head), verifier_parts(verifier)[1]["embed"], d2t), training)


def last_checkpoint(save_path: Path) -> Path:
    """Its trainer's last epoch folder (``<save_path>/<epoch>/``): the weights at the end of training."""
    epochs = sorted((int(p.name), p) for p in save_path.iterdir() if p.name.isdigit() and (p / "model.safetensors").is_file())
    if not epochs:
        raise UserError(f"{save_path}: no checkpoint of the peer's training")
    return epochs[-1][1]


# --- checks ----------------------------------------------------------------------------------------


def peer_drafter(drafter, verifier: Path):
    """Its ``Eagle3DraftModel`` (eager attention, fp32) holding our drafter's weights, with the verifier's head and norm."""
    speculators, _ = import_peer()
    tensors = verifier_parts(verifier)[1]
    cfg = drafter.config
    model = peer_model(speculators, cfg, drafter.d2t, tensors["head"].float(), tensors["embed"].float(), "eager",
                       norm_before_residual=False)
    missing, unexpected = model.load_state_dict(peer_state(drafter.state_dict()), strict=False)
    if unexpected or set(missing) - set(VERIFIER_COPIES):
        raise AssertionError(f"rename table: unexpected {unexpected}, missing {missing}")
    with torch.no_grad():
        model.verifier_norm.weight.copy_(tensors["norm"])
    return model.eval()


def check_round_trip(drafter_dir: Path, verifier: Path, merged: Path, draft_head: dict, work: Path) -> dict:
    """Our export -> its model -> its ``save_pretrained`` -> our export again: the same tensors, bit for bit."""
    ours = load_drafter(drafter_dir, verifier_parts(verifier)[1]["embed"].float())
    peer = peer_drafter(ours, verifier)
    peer.save_pretrained(work / "peer-save", state_dict={k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                                         for k, v in peer.state_dict().items()})
    export_peer_checkpoint(work / "peer-save", verifier, merged, draft_head, work / "drafter", {"round_trip": str(drafter_dir)})
    before, after = load_file(drafter_dir / "model.safetensors"), load_file(work / "drafter" / "model.safetensors")
    differ = sorted(name for name in before if not torch.equal(before[name], after.get(name, torch.empty(0))))
    if differ or set(before) != set(after):
        raise AssertionError(f"round trip changed {differ or sorted(set(before) ^ set(after))}")
    return {"tensors": len(before), "identical": True}


def our_logits(drafter, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Our TTT unroll over one sample (``TrainingTimeTest``'s steps): logits [T, Vd] of every row, per step."""
    T = len(input_ids)
    rows, positions = torch.arange(T), torch.arange(T)[None]
    cache, hidden, out = KVCache(starts=torch.zeros(1, T, dtype=torch.long)), drafter.fc(aux[None]), []
    for k in range(steps):
        hidden = drafter.step(shift_left(input_ids[None], k + 1), hidden, positions + k, cache, None if k == 0 else rows)
        out.append(drafter.logits(hidden)[0])
    return out


def peer_logits(model, batch: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Its forward over one shifted sample: the lm_head's logits [T-1, Vd] of every TTT step (a forward hook)."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    try:  # eager: its compiled pieces are for training, and inductor's CPU build of them fails on some hosts
        with torch.compiler.set_stance("force_eager"):
            model(hidden_states=batch["hidden_states"][None], input_ids=batch["input_ids"][None],
                  document_ids=torch.zeros(1, len(batch["input_ids"]), dtype=torch.long),
                  position_ids=batch["position_ids"][None], ttt_steps=steps)
    finally:
        hook.remove()
    return seen


@torch.no_grad()
def check_sample(peer_data: Path, facts: dict, merged: Path, hidden_states: Path, verifier: Path, drafter_dir: Path,
                 row: int, steps: int, tokens: int = 256) -> dict:
    """Row ``row`` as its data loader gives it (``ArrowDataset`` + ``shift_batch``) against our sample:
    the same tokens, hidden states and mask (one step shifted, as its ``shift_batch`` documents), targets
    within bf16 rounding of ours, and its forward with our weights giving our logits at each of ``steps`` TTT steps.

    Its targets cannot equal ours exactly: its norm re-normalizes our bf16-rounded post-norm state,
    which scales each token's logits by 1 / rms(final / w) (a few outlier dimensions carry most of
    that rms, so their rounding shows: up to 0.2% on SmolLM2), and final / w is rounded to bf16 again.
    """
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    split, index = ("train", row) if row < facts["train_rows"] else ("val", row - facts["train_rows"])
    ours = HiddenStates(merged, hidden_states, split)[index]
    peer_set = ArrowDataset(max_len=10**9, datapath=peer_data, on_missing="raise", train_ratio=facts["train_data_ratio"],
                            split=split, hidden_states_dtype=torch.float32)
    shifted = shift_batch(peer_set[index])  # row t: input x_{t+1}, hidden g_t, target from the state at t+1
    T = min(tokens, len(ours["input_ids"]))
    ids, aux, mask = ours["input_ids"][:T], ours["aux"][:T].float(), ours["loss_mask"][:T]
    batch = {key: value[: T - 1].float() if value.is_floating_point() else value[: T - 1]  # its collate casts; bf16 stored
             for key, value in shifted.items() if key != "lengths"}
    same = {"input_ids": torch.equal(batch["input_ids"], ids[1:]), "hidden_states": torch.equal(batch["hidden_states"], aux[:-1]),
            "loss_mask": torch.equal(batch["loss_mask"].bool(), mask[1:])}
    if not all(same.values()):
        raise AssertionError(f"row {row}: the peer's sample differs from ours: {same}")
    drafter = load_drafter(drafter_dir, verifier_parts(verifier)[1]["embed"].float())
    model = peer_drafter(drafter, verifier)
    theirs = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))  # [T-1, Vd]
    final = ours["final"][1:T].float()  # as stored (bf16); the copied head is fp32, as its collate casts
    head = model.verifier_lm_head(final)  # ours: lm_head(final), final post-norm
    pre = pre_norm(final, model.verifier_norm.weight)  # its norm of this is ours / rms(pre), before bf16 storage
    scale = (pre.pow(2).mean(-1) + model.verifier_norm.variance_epsilon).rsqrt()  # [T-1]: 1 but for our bf16 rounding of final
    target_agree = float((theirs.argmax(-1) == head.argmax(-1)).float().mean())
    if target_agree < 0.97:
        raise AssertionError(f"row {row}: the peer's target argmax agrees with ours on only {target_agree:.3f} of the tokens")
    worst = [float((a[: T - 1] - b).abs().max()) for a, b in zip(our_logits(drafter, aux, ids, steps), peer_logits(model, batch, steps))]
    if max(worst) > 1e-3:
        raise AssertionError(f"row {row}: the peer's forward with our weights gives other logits (max |diff| per step {worst})")
    return {"row": row, "split": split, "tokens": T, **{f"same_{k}": v for k, v in same.items()},
            "target_scale_max_deviation": float(f"{float((scale - 1).abs().max()):.2e}"),
            "target_argmax_agreement": round(target_agree, 4), "target_logit_max_abs_diff": round(float((theirs - head).abs().max()), 4),
            "logits_max_abs_diff_per_step": [float(f"{w:.2e}") for w in worst]}
