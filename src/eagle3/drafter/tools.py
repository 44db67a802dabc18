"""Tools over an exported drafter folder that ``eagle3 check-drafter`` runs beside its check: the
command line converting it for speculators, and a rewrite of an older export's config.json.

    eagle3 check-drafter models/drafter --verifier models/verifier [--rewrite-config]
"""

from __future__ import annotations

import json
from pathlib import Path

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
