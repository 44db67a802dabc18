"""A verifier sharded over processes (``layout.verifier: {tp, ep}``): the same hidden states as a whole copy.

transformers' tensor parallelism runs on CPU processes too (gloo), so the stage's own torchrun
launch is tested here: ``python -m eagle3.extract`` with tp 2 starts two processes that each hold
half of every sharded weight (and, with ep 2, half of the experts), rank 0 writes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from support import tiny_kimi
from eagle3.common import UserError, read_jsonl
from eagle3.extract import extract, stage_arguments
from eagle3.hidden_states.capture import Settings
from eagle3.lm.loading import Placement, text_config
from eagle3.verifier import import_verifier
from support.data import conversation, stored_sample, tiny_params, write_generated


def sharded_extract(verifier, generated, out, params, tp: int, ep: int):
    """The extract stage as dvc runs it, with the verifier over ``tp`` CPU processes."""
    params.layout.verifier = {"tp": tp, "ep": ep}
    params.layout.extract_workers = tp
    params.layout.threads = 1
    OmegaConf.save(params, out.parent / "params.yaml")
    command = [sys.executable, "-m", "eagle3.extract", str(verifier), str(generated), str(out), "--params", str(out.parent / "params.yaml")]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_states(whole, sharded):
    one, two = list(read_jsonl(whole / "index.jsonl")), list(read_jsonl(sharded / "index.jsonl"))
    assert [(e["id"], e["length"], e["masked"]) for e in one] == [(e["id"], e["length"], e["masked"]) for e in two]
    for a, b in zip(one, two):
        x, y = stored_sample(whole, a), stored_sample(sharded, b)
        assert torch.equal(x["input_ids"], y["input_ids"])
        for name in ("aux", "final"):  # bf16 storage of fp32 states summed in another order
            torch.testing.assert_close(x[name].float(), y[name].float(), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def kimi_verifier(tmp_path_factory, tiny_kimi_dir):
    out = tmp_path_factory.mktemp("kimi") / "verifier"
    import_verifier(tiny_kimi.model_params({"kind": "hf", "id": str(tiny_kimi_dir), "dtype": "float32"}), out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, ep", [("llama", 1), ("kimi", 2)])
def test_tp2_hidden_states_equal_a_whole_copy(family, ep, tmp_path, tiny_verifier_dir, tiny_model_params, kimi_verifier):
    verifier, model = (tiny_verifier_dir, tiny_model_params) if family == "llama" else (
        kimi_verifier, tiny_kimi.model_params({"kind": "hf", "id": str(kimi_verifier)}))
    generated = write_generated(tmp_path / "generated", [conversation(i, reasoning="Think first." if i % 2 else None) for i in range(5)])
    params = tiny_params(model, max_length=300)
    params.layout.threads = 1
    extract(verifier, generated, tmp_path / "whole", *stage_arguments(params))
    sharded_extract(verifier, generated, tmp_path / "sharded", params, tp=2, ep=ep)
    assert_same_states(tmp_path / "whole", tmp_path / "sharded")
    assert not list((tmp_path / "sharded").parent.glob(".sharded.tmp-*"))  # only rank 0 wrote, once


def placement_params(tiny_model_params, **layout):
    params = tiny_params(tiny_model_params)
    params.layout = OmegaConf.merge(params.layout, layout)
    return params


def test_impossible_placements_are_refused_with_one_line(tiny_verifier_dir, tiny_model_params):
    config = text_config(tiny_verifier_dir)  # 4 heads, 2 KV heads, a TP plan
    with pytest.raises(UserError, match="num_key_value_heads"):
        Placement(tp=4, ep=1).check(config, "cpu")
    with pytest.raises(UserError, match="GPUs; this node has"):
        Placement(tp=2 * max(1, torch.cuda.device_count()), ep=1).check(config, "cuda")
    from transformers import AutoConfig

    with pytest.raises(UserError, match="no tensor-parallel plan"):
        Placement(tp=2, ep=1).check(AutoConfig.for_model("gpt2"), "cpu")
    with pytest.raises(UserError, match="no expert-parallel plan"):
        Placement(tp=2, ep=2).check(config, "cpu")
    with pytest.raises(UserError, match=r"^params.yaml: layout.verifier = \{'tp': 2\}: must be \{tp: an integer >= 1, ep: 1 or tp\}$"):
        Placement.from_params(OmegaConf.create({"verifier": {"tp": 2}}))  # no fallback for a missing key
    with pytest.raises(UserError, match="ep: 1 or tp"):
        Settings.from_params(placement_params(tiny_model_params, verifier={"tp": 2, "ep": 4}, extract_workers=2))
    with pytest.raises(UserError, match="set extract_workers to tp"):
        Settings.from_params(placement_params(tiny_model_params, verifier={"tp": 2, "ep": 1}, extract_workers=1))


@pytest.mark.slow
def test_sharded_evaluate_decodes_as_a_whole_copy(tmp_path, tiny_verifier_dir):
    """evaluate with tp 2: both processes decode every prompt in lockstep; the same τ as a whole copy."""
    import json

    from eagle3.drafter.export import verifier_facts, write_drafter
    from eagle3.evaluate import main
    from eagle3.lm.loading import load_verifier
    from eagle3.lm.tokenizer_id import tokenizer_fingerprint
    from support.repo import project_params
    from support.speculative import QUESTIONS, TINY_TAPS, random_drafter

    drafter_dir, prompts_dir = tmp_path / "drafter", tmp_path / "prompts"
    drafter_dir.mkdir()
    write_drafter(random_drafter(load_verifier(tiny_verifier_dir), 512, TINY_TAPS), drafter_dir, verifier_facts(tiny_verifier_dir), {})
    (prompts_dir / "eval").mkdir(parents=True)
    (prompts_dir / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tiny_verifier_dir)}))
    records = [{"id": str(i), "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    (prompts_dir / "eval" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    params = project_params()
    params.evaluate = OmegaConf.merge(params.evaluate, {"draft_tokens": 3, "max_new_tokens": 8, "sets": ["heldout"], "max_prompts": 2,
                                                         "baseline": False, "tree": None})
    params.layout.threads = 1
    runs = {}
    for tp in (1, 2):
        params.layout.verifier = {"tp": tp, "ep": 1}
        OmegaConf.save(params, tmp_path / f"params-{tp}.yaml")
        args = [str(tiny_verifier_dir), str(drafter_dir), str(prompts_dir), str(tmp_path / f"live-{tp}"), "--params", str(tmp_path / f"params-{tp}.yaml")]
        if tp == 1:
            main(args)
        else:
            result = subprocess.run([sys.executable, "-m", "eagle3.evaluate", *args], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr[-3000:]
        runs[tp] = json.loads((tmp_path / f"live-{tp}" / "metrics.json").read_text())["heldout"]
    assert runs[2]["lossless"] == 1 and runs[2]["tau"] == runs[1]["tau"] and runs[2]["forwards"] == runs[1]["forwards"]
