"""Tools over an exported drafter folder that ``eagle3 check-drafter`` runs beside its check: the
command line converting it for speculators, a rewrite of an older export's config.json, and the draft
vocabulary against what is at hand beside the drafter (the verifier's tokenizer, merge's vocabulary file).

    eagle3 check-drafter models/drafter --verifier models/verifier [--vocab data/merged/vocab.safetensors] [--rewrite-config]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.common import read_json, write_json
from eagle3.drafter.export import TOKEN_IDS, config_from_export, engine_config, verifier_facts
from eagle3.lm.loading import weights_dir


def speculators_command(folder: str | Path, verifier_folder: str | Path | None = None) -> str:
    """The ``speculators convert`` (0.9.0) command line for this drafter, its taps filled in.

    speculators reads neither tap key of config.json and, without ``eagle_aux_hidden_state_layer_ids``
    in ``--algorithm-kwargs``, silently converts with the default taps; it takes our ids (vLLM's
    convention), since vLLM reads them from its config. Its verifier is the folder of the weights.
    """
    folder = Path(folder)
    taps = json.dumps({"eagle_aux_hidden_state_layer_ids": list(read_json(folder / "meta.json")["aux_layers"])})
    verifier = weights_dir(verifier_folder) if verifier_folder else "<verifier weights folder>"
    named = folder if folder.name else folder.resolve()  # "." has no name to derive the output's from
    return (f"speculators convert {folder} --algorithm eagle3 --verifier {verifier} "
            f"--output-path {named.with_name(named.name + '-speculators')} --algorithm-kwargs '{taps}'")


def rewrite_config(folder: str | Path, verifier_folder: str | Path | None = None) -> Path:
    """Rewrite config.json from meta.json's taps and the config's shape (an export of an older version);
    the token ids from ``verifier_folder``, else as meta.json recorded them, else as config.json had them."""
    folder = Path(folder)
    meta, config = read_json(folder / "meta.json"), read_json(folder / "config.json")
    cfg = config_from_export(config, meta["aux_layers"])
    verifier = verifier_facts(verifier_folder) if verifier_folder else meta.get("verifier") or {}
    token_ids = {key: verifier[key] if verifier.get(key) is not None else config.get(key) for key in TOKEN_IDS}
    write_json(folder / "config.json", engine_config(cfg, token_ids))
    for stale in ("config.vllm.json", "config.sglang.json"):  # per-engine copies of older exports
        (folder / stale).unlink(missing_ok=True)
    return folder / "config.json"


def vocab_problems(folder: str | Path, verifier_folder: str | Path | None, vocab_file: str | Path | None) -> list[str]:
    """``d2t``/``t2d`` against what is at hand: every target id a token of the verifier's tokenizer (``tokenizer.json``;
    a vocabulary remapped consistently to another passes the export's own checks), and the very map of merge's
    vocabulary file, which training copied into the drafter."""
    from safetensors.torch import load_file

    tensors = load_file(Path(folder) / "model.safetensors")
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        return []  # the export's own check names what is missing
    targets = torch.arange(len(d2t)) + d2t.long()  # target id = draft id + d2t[draft id]
    problems = []
    tokenizer = Path(verifier_folder) / "tokenizer.json" if verifier_folder else None
    if tokenizer is not None and tokenizer.is_file():
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        if len(targets) and int(targets.max()) >= size:
            problems.append(f"model.safetensors: d2t maps draft tokens to ids up to {int(targets.max())}, which {tokenizer} "
                            f"does not have (its {size} tokens): a vocabulary of another tokenizer")
    if vocab_file is not None:
        merged = load_file(vocab_file)
        for name, ours in (("d2t", d2t), ("t2d", t2d)):
            theirs = merged[name]
            if ours.shape != theirs.shape or not torch.equal(ours.long(), theirs.long()):
                problems.append(f"model.safetensors: {name} is not {vocab_file}'s (the draft vocabulary merge chose): "
                                f"{mismatch(ours, theirs)}; train on this merge (`dvc repro train`) or check against the "
                                "vocabulary file of the drafter's own run")
    return problems


def mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    if ours.shape != theirs.shape:
        return f"shape {list(ours.shape)}, the file's {list(theirs.shape)}"
    differ = (ours.long() != theirs.long()).nonzero().flatten()
    first = int(differ[0])
    return f"{len(differ)} entries differ, first at index {first} ({int(ours[first])}, the file's {int(theirs[first])})"
