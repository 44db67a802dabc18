"""The evaluate stage: consistent metrics, chain and tree and both baselines reported, foreign drafters refused."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, project_params, run
from eagle3.common import UserError
from eagle3.config import validate
from eagle3.drafter.export import verifier_facts, write_drafter
from eagle3.drafter.speculative import EagleProposer, TreeShape, greedy_decode, speculative_decode
from eagle3.evaluate import Settings, acceptance_stats, check_pair, evaluate, main, most_frequent_token
from eagle3.verifiers.loading import load_tokenizer, load_verifier, tokenizer_fingerprint
from test_speculative import QUESTIONS, K, TableDrafter, encode, greedy_tables, random_drafter

TINY_TAPS = (1, 2, 3)


def test_acceptance_stats_match_docstring_and_tau():
    stats = acceptance_stats([0, 2, 1, 2], k=2)
    assert stats["tau"] == pytest.approx(2.25) and stats["forwards"] == 4
    assert stats["acceptance"] == pytest.approx([0.75, 0.5])
    assert stats["conditional"] == pytest.approx([0.75, 2 / 3])
    assert stats["tau_distribution"] == pytest.approx([0.25, 0.25, 0.5])
    assert most_frequent_token([[3, 5, 5], [3, 9]]) == 3  # tie between 3 and 5: the lower id


@pytest.mark.parametrize("tree, message", [
    ({"num_steps": 2, "topk": 2, "num_draft_tokens": 9}, "evaluate.tree: num_draft_tokens must be in 2..7"),
    ({"num_steps": 2, "topk": 2, "num_draft_tokens": 1}, "evaluate.tree: num_draft_tokens must be in 2..7"),
    ({"num_steps": 0, "topk": 2, "num_draft_tokens": 4}, "num_steps and topk must be >= 1"),
    ({"num_steps": 2, "topk": 2}, "evaluate.tree = .*: must be null, or integers"),
])
def test_impossible_tree_is_one_clear_error_when_params_compose(tree, message):
    """Refused by the params check (``eagle3 params``, every stage's view), not after training."""
    params = project_params()
    params.evaluate.tree = tree
    with pytest.raises(UserError, match=message):
        validate(params)


def test_evaluate_reports_every_method_per_set_lossless(tiny_verifier_dir):
    """The typed core on loaded models, no files: chain, tree and both baselines per set, outputs as plain greedy."""
    torch.set_num_threads(1)
    verifier = load_verifier(tiny_verifier_dir)
    tokenizer = load_tokenizer(tiny_verifier_dir)
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    params = project_params()
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["a", "b"], "max_prompts": None,
                       "baseline": True, "batch_size": 2, "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
    settings = Settings.from_params(params)
    sets = {"a": [encode(tokenizer, q) for q in QUESTIONS], "b": [encode(tokenizer, QUESTIONS[0])]}
    reports = evaluate(verifier, drafter, sets, settings, {2})
    assert list(reports) == ["a", "b"]
    for name, report in reports.items():
        assert report["plain"]["prompts"] == len(sets[name]) and report["plain"]["tokens"] > 0
        for method in ("chain", "tree"):
            assert report[method]["lossless"] == 1 and 1 <= report[method]["tau"] <= 4 and report[method]["speedup"] > 0
        assert report["baseline"]["tau"] >= 1 and report["ngram"]["tau"] >= 1
    assert reports["b"]["chain"]["forwards"] < reports["a"]["chain"]["forwards"]


def test_evaluate_main_writes_metrics_and_plots(tmp_path, tiny_verifier_dir, monkeypatch):
    verifier = load_verifier(tiny_verifier_dir)
    drafter_dir, prompts_dir = tmp_path / "drafter", tmp_path / "prompts"
    drafter_dir.mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), drafter_dir, verifier_facts(tiny_verifier_dir), {})
    (prompts_dir / "eval").mkdir(parents=True)
    (prompts_dir / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tiny_verifier_dir)}))
    records = [{"id": str(i), "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    (prompts_dir / "eval" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    params = project_params()
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["heldout"], "max_prompts": 2,
                       "baseline": True, "batch_size": 2, "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
    params.layout.threads = 1
    OmegaConf.save(params, tmp_path / "params.yaml")
    out = tmp_path / "dvclive" / "evaluate"
    monkeypatch.chdir(tmp_path)
    main([str(tiny_verifier_dir), str(drafter_dir), str(prompts_dir), str(out), "--params", str(tmp_path / "params.yaml")])
    metrics = json.loads((out / "metrics.json").read_text())["heldout"]
    assert metrics["prompts"] == 2 and metrics["lossless"] == 1 and metrics["tree"]["lossless"] == 1
    assert 1 <= metrics["tau"] <= 4 and metrics["speedup"] > 0 and metrics["baseline"]["tau"] >= 1
    assert 1 <= metrics["tree"]["tau"] <= 4 and metrics["tree"]["speedup"] > 0 and metrics["ngram"]["tau"] >= 1
    assert json.loads((out / "metrics.json").read_text())["wall_seconds"] > 0
    acceptance = json.loads((out / "plots" / "custom" / "acceptance" / "heldout.json").read_text())
    assert [row["position"] for row in acceptance] == [1, 2, 3]
    assert metrics["tau"] == pytest.approx(1 + sum(row["drafter"] for row in acceptance), abs=1e-3)
    tau = json.loads((out / "plots" / "custom" / "tau" / "heldout.json").read_text())
    assert sum(row["drafter"] for row in tau) == pytest.approx(1)


def test_drafter_of_another_verifier_is_refused(tmp_path, tiny_verifier_dir):
    verifier = load_verifier(tiny_verifier_dir)
    facts = {**verifier_facts(tiny_verifier_dir), "fingerprint": "0123456789abcdef"}
    (tmp_path / "drafter").mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), tmp_path / "drafter", facts, {})
    with pytest.raises(UserError, match="trained for verifier 0123456789abcdef"):
        check_pair(tiny_verifier_dir, tmp_path / "drafter", tmp_path / "prompts")


@pytest.mark.slow
def test_smollm2_random_and_partly_right_drafters_are_lossless(smollm2_dir):
    """The real verifier: a random exported-shape drafter and a partly right one decode exactly greedily."""
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(smollm2_dir), load_tokenizer(smollm2_dir)
    taps = tuple(project_params().model.aux_layers)
    drafter = random_drafter(verifier, 32000, taps)
    eos = {tokenizer.eos_token_id}
    prompts = [encode(tokenizer, question) for question in QUESTIONS[:2]]
    expected = greedy_decode(verifier, prompts, 16, eos)
    for shape in (TreeShape.chain(K), TreeShape(3, 2, 6)):
        assert [d.tokens for d in speculative_decode(verifier, EagleProposer(drafter, shape), prompts, taps, 16, eos)] == expected
    table = greedy_tables(verifier, prompts, 16 + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    spec = speculative_decode(verifier, EagleProposer(TableDrafter(table, verifier.config.vocab_size), TreeShape.chain(K)),
                              prompts, taps, 16, eos)
    assert [d.tokens for d in spec] == expected and max(spec[0].accepted) > 0


@pytest.mark.slow
def test_dvc_repro_evaluate_lists_tau_and_speedup_and_renders_plots(make_project, tiny_verifier_dir):
    """The dvc.yaml block: deps and params resolve, the plots draw the drafter beside the baselines."""
    repo = make_project("evaluate.max_prompts=2", "evaluate.max_new_tokens=6", "evaluate.draft_tokens=3",
                        "evaluate.tree.num_steps=3", "evaluate.tree.topk=2", "evaluate.tree.num_draft_tokens=6",
                        "evaluate.sets=[heldout]", "layout.threads=1")
    shutil.copytree(tiny_verifier_dir, repo / "models" / "verifier")
    verifier = load_verifier(tiny_verifier_dir)
    (repo / "models" / "drafter").mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), repo / "models" / "drafter", verifier_facts(tiny_verifier_dir), {})
    (repo / "data" / "prompts" / "eval").mkdir(parents=True)
    (repo / "data" / "prompts" / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tiny_verifier_dir)}))
    records = [{"id": str(i), "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    (repo / "data" / "prompts" / "eval" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run(["dvc", "repro", "-s", "evaluate"], repo)
    metrics = json.loads((repo / "dvclive" / "evaluate" / "metrics.json").read_text())["heldout"]
    assert all(key in metrics for key in ("tau", "speedup")) and all("tau" in metrics[m] for m in ("tree", "ngram", "baseline"))
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)["data"]
    for path in ("dvclive/evaluate/plots/custom/acceptance/heldout.json", "dvclive/evaluate/plots/custom/tau/heldout.json"):
        fields = {row["field"] for row in plots[path][0]["content"]["data"]["values"]}
        assert plots[path][0]["type"] == "vega" and fields == {"drafter", "tree", "baseline", "ngram"}  # in one chart


def test_throughput_benchmark_runs_on_the_cpu_with_a_tiny_shape():
    """benchmarks/evaluate_throughput.py, whose CUDA run is the H200 measurement: its table has every method per run."""
    out = run([sys.executable, str(ROOT / "benchmarks" / "evaluate_throughput.py"), "--device", "cpu", "--tiny"], ROOT).stdout
    table = [line for line in out.splitlines() if line.startswith("| ") and "batch_size" not in line]
    assert [row.split(" | ")[2] for row in table] == ["plain", "chain", "tree"] * 2


def reimported_elsewhere(verifier_dir, out):
    """``verifier_dir`` as another machine's torch/transformers imports the same GGUF: other bf16 weight
    bytes, so another fingerprint, and another transformers_version in the model's configs; same tokenizer."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(verifier_dir, out)
    tensors = load_file(out / "model.safetensors")
    save_file({name: t + 1e-3 if t.is_floating_point() else t for name, t in tensors.items()}, out / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**config, "transformers_version": "5.17.0"}, indent=2))
    meta = json.loads((out / "meta.json").read_text())
    meta["fingerprint"] = {**meta["fingerprint"], "id": "51c7b9e4aaaaaaaa"}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def test_prompts_are_checked_by_the_tokenizer_they_were_counted_with(tmp_path, tiny_verifier_dir):
    """Prompts composed on one machine are evaluated with the verifier imported on another; a changed
    chat template still refuses them."""
    (tmp_path / "sources").mkdir()
    (tmp_path / "sources" / "mine.jsonl").write_text("".join(json.dumps({"prompt": f"Tell me about number {i}."}) + "\n"
                                                             for i in range(12)))
    params = project_params()
    params.dataset.sources = [{"kind": "jsonl", "path": str(tmp_path / "sources" / "mine.jsonl")}]
    params.dataset.shards, params.dataset.eval_sets = ["000000-000004"], {"heldout": 2}
    OmegaConf.save(params, tmp_path / "params.yaml")
    run([sys.executable, "-m", "eagle3.prompts", str(tiny_verifier_dir), str(tmp_path / "prompts"), "--sources",
         str(tmp_path / "sources"), "--params", str(tmp_path / "params.yaml")], tmp_path)

    other = reimported_elsewhere(tiny_verifier_dir, tmp_path / "other-machine")
    (tmp_path / "drafter").mkdir()
    write_drafter(random_drafter(load_verifier(other), 512, TINY_TAPS), tmp_path / "drafter", verifier_facts(other), {})
    check_pair(other, tmp_path / "drafter", tmp_path / "prompts")

    with (other / "chat_template.jinja").open("a") as template:
        template.write("{{ '\\n' }}")
    with pytest.raises(UserError, match=r"prompts/meta.json: prompts counted with the tokenizer and chat template of "
                                        r"verifier [0-9a-f]{16}, this verifier's are [0-9a-f]{16}; rerun prompts"):
        check_pair(other, tmp_path / "drafter", tmp_path / "prompts")
