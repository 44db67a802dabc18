"""The evaluate stage: consistent metrics, chain and tree and both baselines reported, foreign drafters refused."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf

from support.repo import ROOT, project_params, run
from eagle3.common import UserError
from eagle3.config import validate
from eagle3.drafter.export import verifier_facts, write_drafter
from eagle3.decoding.speculative import StopStrings, Target, greedy_decode, speculative_decode
from eagle3.decoding.tree import EagleProposer
from eagle3.decoding.config import TreeShape
from eagle3.config import compose_params
from eagle3.decoding.evaluation import Conversations, decode_phased, decode_tau, evaluate, outside_draft_vocab, phase_ends
from eagle3.decoding.graphed import DecodeGraphs
from eagle3.decoding.session import Session
from eagle3.decoding.inputs import check_pair, load_eval_sets
from eagle3.evaluate import main
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import load_tokenizer, load_verifier, read_meta
from eagle3.decoding.acceptance import acceptance_stats, bucket_names, tau_by_position
from eagle3.decoding.baselines import baselines, most_frequent_token
from eagle3.decoding.settings import Settings
from eagle3.decoding.timing import Run, batched, disagreeing, median_spread, timings
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from support.models import import_rounded_the_other_way, verifier_model
from support.speculative import K, QUESTIONS, TINY_TAPS, TableDrafter, encode, greedy_tables, random_drafter

FOLLOWUPS = ["Now say it in one word.", "Why?"]


def eval_params(**evaluate):
    """The committed params with an evaluate section for the tiny verifier (keyword arguments replace its keys)."""
    params = project_params()
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["a"], "max_prompts": None,
                       "baseline": True, "batch_sizes": [3], "repeats": 1, "timed_prompts": None, "timed_new_tokens": None,
                       "chain_sweep": [], "cuda_graphs": True, "position_buckets": [4],
                       "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}, **evaluate}
    params.layout.threads = 1
    return params


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


@pytest.mark.parametrize("key, value, message", [
    ("batch_sizes", [], "evaluate.batch_sizes = \\[\\]: must be a non-empty list of integers >= 1"),
    ("repeats", -1, "evaluate.repeats = -1: must be an integer >= 0"),
    ("chain_sweep", [0, 3], "evaluate.chain_sweep = \\[0, 3\\]: must be a list of integers >= 1"),
    ("timed_prompts", 0, "evaluate.timed_prompts = 0: must be an integer >= 1, or null"),
])
def test_impossible_timing_settings_are_one_clear_error(key, value, message):
    params = project_params()
    params.evaluate[key] = value
    with pytest.raises(UserError, match=message):
        validate(params)


def test_a_chain_sweep_with_nothing_timed_is_refused():
    params = project_params()
    params.evaluate.repeats, params.evaluate.chain_sweep = 0, [2, 3]
    with pytest.raises(UserError, match=r"evaluate.chain_sweep = \[2, 3\]: must be \[\] with evaluate.repeats 0"):
        validate(params)


def test_evaluate_reports_every_method_per_set_lossless(tiny_verifier_dir):
    """The typed core on loaded models, no files: chain, tree and both baselines per set, outputs as plain greedy."""
    torch.set_num_threads(1)
    verifier = load_verifier(tiny_verifier_dir)
    tokenizer = load_tokenizer(tiny_verifier_dir)
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    params = project_params()
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["a", "b"], "max_prompts": None,
                       "baseline": True, "batch_sizes": [2, 1], "repeats": 2, "timed_prompts": 2, "chain_sweep": [2, 3],
                       "cuda_graphs": True, "timed_new_tokens": None, "position_buckets": [4], "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
    settings = Settings.from_params(params)
    sets = {"a": [encode(tokenizer, q) for q in QUESTIONS], "b": [encode(tokenizer, QUESTIONS[0])]}
    reports = evaluate(Session.create(verifier, drafter, settings, {2}), sets)
    assert list(reports) == ["a", "b"]
    for name, report in reports.items():
        assert report["plain"]["prompts"] == len(sets[name]) and report["plain"]["tokens"] > 0
        for method in ("chain", "tree"):
            assert report[method]["lossless"] == 1 and 1 <= report[method]["tau"] <= 4
            for size in (2, 1):  # every batch size timed twice: median and spread
                timing = report["batch"][size][method]
                assert timing["speedup"] > 0 and timing["speedup_spread"] >= 0 and timing["tokens_per_s_spread"] >= 0
        assert report["baseline"]["tau"] >= 1 and report["ngram"]["tau"] >= 1
        assert report["ngram"]["tau_matched_rounds"] >= report["ngram"]["tau"] and 0 <= report["ngram"]["matched_rounds"] <= 1
    assert reports["b"]["chain"]["forwards"] < reports["a"]["chain"]["forwards"]
    assert reports["a"]["plain"]["timed_prompts"] == 2 and reports["b"]["plain"]["timed_prompts"] == 1  # τ: all 3 prompts
    for name in sets:  # every set, on its timed prompts
        sweep = reports[name]["chain_k"]
        assert set(sweep["tau"]) == {"k2", "k3"} and sweep["best"] in (2, 3) and sweep["tau"]["k3"] >= 1


def test_outside_draft_vocab_counts_the_answer_tokens_the_drafter_cannot_propose(tiny_verifier_dir):
    """Every (V // Vd)-th token is in the draft vocabulary of random_drafter: answers of 3 such tokens and 1 other
    -> a quarter of them outside; no answer tokens -> 0."""
    drafter = random_drafter(load_verifier(tiny_verifier_dir), 512, TINY_TAPS)
    step = drafter.config.vocab_size // 512
    assert outside_draft_vocab(drafter, [[0, step + 1], [3 * step, step]]) == 0.25
    assert outside_draft_vocab(drafter, [[], []]) == 0.0


@pytest.mark.parametrize("repeats", [2, 1, 0])
def test_evaluate_main_writes_metrics_and_plots(tmp_path, tiny_verifier_dir, monkeypatch, repeats):
    """Timings are metrics only with their spread: two repeats give speedups per batch size and the
    unstable flag, one (the CPU demo's) none; zero (evaluate=tau) times nothing: no speedup plot, no
    lossless; τ and its plots in every case."""
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
                       "baseline": True, "batch_sizes": [2, 1], "repeats": repeats, "timed_prompts": None, "chain_sweep": [],
                       "cuda_graphs": True, "timed_new_tokens": None, "position_buckets": [4], "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
    params.layout.threads = 1
    OmegaConf.save(params, tmp_path / "params.yaml")
    out = tmp_path / "dvclive" / "evaluate"
    monkeypatch.chdir(tmp_path)
    main([str(tiny_verifier_dir), str(drafter_dir), str(prompts_dir), str(out), "--params", str(tmp_path / "params.yaml")])
    metrics = json.loads((out / "metrics.json").read_text())["heldout"]
    assert metrics["prompts"] == 2 and metrics.get("lossless", 1) == 1 and metrics["tree"].get("lossless", 1) == 1
    assert ("lossless" in metrics) == (repeats > 0)
    assert 1 <= metrics["tau"] <= 4 and metrics["baseline"]["tau"] >= 1 and metrics["ngram"]["tau"] >= 1
    assert 1 <= metrics["tree"]["tau"] <= 4 and metrics["ngram"]["tau_matched_rounds"] >= metrics["ngram"]["tau"]
    assert 0 <= metrics["outside_draft_vocab"] <= 1
    assert json.loads((out / "metrics.json").read_text())["wall_seconds"] > 0
    speedup_plot = out / "plots" / "custom" / "speedup" / "heldout.json"
    speedups = json.loads(speedup_plot.read_text()) if repeats else []
    assert [row["batch_size"] for row in speedups] == ([2, 1] if repeats else []) and all(row["drafter"] > 0 and row["tree"] > 0 for row in speedups)
    if repeats <= 1:
        assert speedup_plot.is_file() == (repeats == 1)
        assert not any("speedup" in key or "tokens_per_s" in key for key in json.dumps(metrics).split('"')[1::2])
    else:
        assert metrics["speedup"] == pytest.approx(speedups[0]["drafter"], abs=1e-4) and metrics["speedup_spread"] >= 0 and metrics["tree"]["speedup"] > 0
        assert metrics["unstable"] in (True, False) and metrics["plain_tokens_per_s_spread"] >= 0
        assert set(metrics["batch"]) == {"2", "1"} and metrics["batch"]["1"]["tree"]["speedup_spread"] >= 0
    acceptance = json.loads((out / "plots" / "custom" / "acceptance" / "heldout.json").read_text())
    assert [row["position"] for row in acceptance] == [1, 2, 3]
    assert metrics["tau"] == pytest.approx(1 + sum(row["drafter"] for row in acceptance), abs=1e-3)
    tau = json.loads((out / "plots" / "custom" / "tau" / "heldout.json").read_text())
    assert sum(row["drafter"] for row in tau) == pytest.approx(1)


def test_evaluate_stops_at_the_verifier_specs_stop_strings(tiny_verifier_dir):
    """model.stop reaches evaluate's decoding: a base model's answers end at its end-of-turn text, for
    every method, and the baselines are replayed on those answers."""
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(tiny_verifier_dir), load_tokenizer(tiny_verifier_dir)
    prompts = [encode(tokenizer, q) for q in QUESTIONS]
    plain = greedy_decode(verifier, prompts, 8, {2})
    params = project_params()
    params.model.stop = [tokenizer.decode(plain[0][2:4])]
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["a"], "max_prompts": None,
                       "baseline": True, "batch_sizes": [3], "repeats": 1, "timed_prompts": None, "chain_sweep": [],
                       "cuda_graphs": True, "timed_new_tokens": None, "position_buckets": [4], "tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
    settings = Settings.from_params(params)
    assert settings.stop == tuple(params.model.stop)
    stops = StopStrings(tokenizer, settings.stop)
    report = evaluate(Session.create(verifier, random_drafter(verifier, 512, TINY_TAPS), settings, {2}, stops), {"a": prompts})["a"]
    served = greedy_decode(verifier, prompts, 8, {2}, stops)
    assert len(served[0]) <= 4 and report["plain"]["tokens"] == sum(map(len, served)) < sum(map(len, plain))
    assert report["chain"]["lossless"] == report["tree"]["lossless"] == 1


def test_repeated_timings_give_median_spread_and_a_flag_past_ten_percent():
    """The timings docstring's example; a speedup is paired with plain decoding's same repeat."""
    assert median_spread([10, 12, 11]) == (11, pytest.approx(2 / 11)) and median_spread([5.0]) == (5.0, None)
    runs = {"plain": Run([[1] * 10], [[]], [10.0, 12.0]), "chain": Run([[1] * 10], [[0] * 5], [5.0, 8.0]),
            "tree": Run([[1] * 10], [[0] * 5], [5.0, 5.1])}
    timing = timings(runs)
    assert timing["chain"]["speedup"] == pytest.approx(1.75) and timing["chain"]["speedup_spread"] == pytest.approx(0.5 / 1.75)
    assert timing["plain"]["tokens_per_s"] == pytest.approx((1 + 10 / 12) / 2)
    assert disagreeing(timing) == ["plain/tokens_per_s", "chain/tokens_per_s", "chain/speedup", "tree/speedup"]
    once = timings({name: Run(run.outputs, run.accepted, run.seconds[:1]) for name, run in runs.items()})
    assert once["chain"]["speedup_spread"] is None and disagreeing(once) == []


def test_prompt_lookup_tau_per_sequence_and_per_matched_round():
    """ngram/tau counts every forward (a round without a match too); tau_matched_rounds only those it drafted for."""
    prompt, output = torch.tensor([5, 6, 7, 8]), [9, 5, 6, 7, 1, 2, 3]  # only the 5 after 9 matches (-> 6, 7, both right)
    report = baselines([prompt], [output], 2)  # forwards at 9 (no match), 5 (6, 7 right), 1, 2 (none): [0, 2, 0, 0]
    assert report["ngram"]["forwards"] == 4 and report["ngram"]["tau"] == pytest.approx(1.5)
    assert report["ngram"]["tau_matched_rounds"] == pytest.approx(3) and report["ngram"]["matched_rounds"] == pytest.approx(1 / 4)


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
        target = Target(verifier=verifier, layer_ids=taps, eos_ids=eos)
        assert [d.tokens for d in speculative_decode(target, EagleProposer(drafter, shape), prompts, 16)] == expected
    table = greedy_tables(verifier, prompts, 16 + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    spec = speculative_decode(target, EagleProposer(TableDrafter(table, verifier.config.vocab_size), TreeShape.chain(K)),
                              prompts, 16)
    assert [d.tokens for d in spec] == expected and max(spec[0].accepted) > 0


@pytest.mark.slow
def test_dvc_repro_evaluate_lists_tau_and_speedup_and_renders_plots(make_project, tiny_verifier_dir):
    """The dvc.yaml block: deps and params resolve, the plots draw the drafter beside the baselines."""
    repo = make_project("evaluate.max_prompts=2", "evaluate.max_new_tokens=6", "evaluate.draft_tokens=3",
                        "evaluate.tree.num_steps=3", "evaluate.tree.topk=2", "evaluate.tree.num_draft_tokens=6",
                        "evaluate.sets=[heldout]", "evaluate.repeats=2", "layout.threads=1")
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
    assert all(key in metrics for key in ("tau", "speedup", "speedup_spread", "unstable"))
    assert all("tau" in metrics[m] for m in ("tree", "ngram", "baseline"))
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)["data"]
    for path in ("dvclive/evaluate/plots/custom/acceptance/heldout.json", "dvclive/evaluate/plots/custom/tau/heldout.json"):
        fields = {row["field"] for row in plots[path][0]["content"]["data"]["values"]}
        assert plots[path][0]["type"] == "vega" and fields == {"drafter", "tree", "baseline", "ngram"}  # in one chart
        assert plots[path][0]["content"]["encoding"]["color"]["field"] == "field"  # a colour per method
    speedup = plots["dvclive/evaluate/plots/custom/speedup/heldout.json"][0]["content"]["data"]["values"]
    assert {(row["batch_size"], row["field"]) for row in speedup} == {(32, "drafter"), (32, "tree")}


def test_throughput_benchmark_runs_on_the_cpu_with_a_tiny_shape(tmp_path):
    """benchmarks/evaluate_throughput.py, whose CUDA run is the H200 check: on the CPU its static layout
    (eager) decodes exactly as the growing caches, and its table and JSON have every part."""
    command = [sys.executable, str(ROOT / "benchmarks" / "evaluate_throughput.py"), "--device", "cpu", "--tiny",
               "--json", str(tmp_path / "bench.json")]
    out = run(command, ROOT).stdout
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert [(row[0], row[1], row[2]) for row in table] == [
        *[("| graph", size, method) for size in ("1", "4") for method in ("plain", "chain", "tree")],
        *[("| oracle", "2", method) for method in ("plain", "chain", "tree")],
        *[("| chain_k", "1", m) for m in ("plain", "k2", "k3")], *[("| eager", "1", method) for method in ("plain", "chain", "tree")]]
    results = json.loads((tmp_path / "bench.json").read_text())
    assert all(value == 1 for method in results["check"]["2"].values() for key, value in method.items() if key.startswith("same_"))
    assert results["graph"]["4"]["tree"]["speedup_spread"] >= 0 and results["chain_k"]["1"]["best_k"] in (2, 3)
    oracle = results["oracle"]["check 2"]  # a second drafter through the same graphs: its own, accepting whole chains
    assert oracle["chain"]["tau_graph"] == oracle["chain"]["tau_eager"] > 4 and oracle["tree"]["same_accepted_as_eager"] == 1


def reimported_elsewhere(monkeypatch, verifier_dir, out):
    """``verifier_dir``'s source imported as another machine's torch imports it: some weights rounded the
    other way, so another build of the same verifier."""
    meta = read_meta(verifier_dir)
    import_rounded_the_other_way(monkeypatch, verifier_model(name=meta["name"], copy_weights=True, source=meta["source"]), out)
    return out


def test_prompts_are_checked_by_the_tokenizer_they_were_counted_with(tmp_path, tiny_verifier_dir, monkeypatch):
    """Prompts composed and a drafter trained on one machine are evaluated with the verifier imported on
    another; a changed chat template still refuses them."""
    (tmp_path / "sources").mkdir()
    (tmp_path / "sources" / "mine.jsonl").write_text("".join(json.dumps({"prompt": f"Tell me about number {i}."}) + "\n"
                                                             for i in range(12)))
    params = project_params()
    params.dataset.sources = [{"kind": "jsonl", "path": str(tmp_path / "sources" / "mine.jsonl")}]
    params.dataset.shards, params.dataset.eval_sets = ["000000-000004"], {"heldout": 2}
    OmegaConf.save(params, tmp_path / "params.yaml")
    run([sys.executable, "-m", "eagle3.prompts", str(tiny_verifier_dir), str(tmp_path / "prompts"), "--sources",
         str(tmp_path / "sources"), "--params", str(tmp_path / "params.yaml")], tmp_path)

    other = reimported_elsewhere(monkeypatch, tiny_verifier_dir, tmp_path / "other-machine")
    (tmp_path / "drafter").mkdir()
    write_drafter(random_drafter(load_verifier(tiny_verifier_dir), 512, TINY_TAPS), tmp_path / "drafter",
                  verifier_facts(tiny_verifier_dir), {})
    check_pair(other, tmp_path / "drafter", tmp_path / "prompts")

    with (other / "chat_template.jinja").open("a") as template:
        template.write("{{ '\\n' }}")
    with pytest.raises(UserError, match=r"prompts/meta.json: prompts counted with the tokenizer and chat template of "
                                        r"verifier [0-9a-f]{16}, this verifier's are [0-9a-f]{16}; rerun prompts"):
        check_pair(other, tmp_path / "drafter", tmp_path / "prompts")


def test_tau_by_position_buckets_forwards_by_their_first_new_token():
    """The acceptance docstring's example: forwards start at answer index 1, then 1 + accepted + 1, ..."""
    assert bucket_names([64, 256]) == ["0-64", "64-256", "256+"]
    assert tau_by_position([[2, 0, 1]], [4]) == {"0-4": 3.0, "4+": 1.5}
    assert tau_by_position([[0, 0], [1]], [2, 8]) == {"0-2": 1.5, "2-8": 1.0}  # starts 1, 2 and 1; no forward past 8


def test_tau_covers_every_prompt_whatever_the_timings_cover(tiny_verifier_dir):
    """The default's shape: τ decoded once over every prompt at the largest batch, timings on a few prompts and
    tokens. τ, its buckets and the baselines are those of a run timing every prompt and token (one decode in all)."""
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(tiny_verifier_dir), load_tokenizer(tiny_verifier_dir)
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    sets = {"a": [encode(tokenizer, q) for q in QUESTIONS]}
    whole = evaluate(Session.create(verifier, drafter, Settings.from_params(eval_params()), {2}), sets)["a"]
    quick = Settings.from_params(eval_params(batch_sizes=[1, 3], repeats=2, timed_prompts=1, timed_new_tokens=4))
    report = evaluate(Session.create(verifier, drafter, quick, {2}), sets)["a"]
    for method in ("chain", "tree", "baseline", "ngram"):
        for key in ("tau", "forwards", "acceptance", "tau_by_position"):
            assert report[method][key] == whole[method][key], (method, key)
    assert report["plain"]["tokens"] == whole["plain"]["tokens"] and report["plain"]["timed_prompts"] == 1
    assert report["chain"]["lossless"] == report["tree"]["lossless"] == 1  # over the 3 timed at batch 3, 4 tokens each
    assert set(report["batch"]) == {1, 3} and report["batch"][1]["chain"]["speedup_spread"] is not None
    assert set(whole["chain"]["tau_by_position"]) == {"0-4", "4+"}
    tau_only = evaluate(Session.create(verifier, drafter, Settings.from_params(eval_params(batch_sizes=[1, 3], repeats=0)), {2}), sets)["a"]
    for method in ("chain", "tree", "baseline", "ngram"):  # evaluate=tau: the same τ, nothing timed
        assert tau_only[method]["tau"] == whole[method]["tau"] and "lossless" not in tau_only.get(method, {})
    assert tau_only["batch"] == {} and tau_only["plain"]["timed_prompts"] == 0 and "draft_cost" not in tau_only["chain"]


def test_taus_decode_goes_on_in_phases_regrouped_by_forwards_with_every_forward_counted(smollm2_dir, monkeypatch):
    """decode_tau: each method decodes in phases (here 4, 8, 12 tokens), each phase's answers ordered by forwards so
    far (the tree's first by the chain's), a paused answer going on from its last token. The answers are greedy's,
    in prompt order, and no token comes without its forward: 1 + sum(accepted + 1) tokens, as in one decode."""
    import eagle3.decoding.evaluation as evaluation

    calls, decode = [], evaluation.speculative_decode
    monkeypatch.setattr(evaluation, "speculative_decode", lambda target, proposer, prompts, max_new, pause: calls.append((prompts, pause))
                        or decode(target, proposer, prompts, max_new, pause=pause))
    monkeypatch.setattr(evaluation, "FIRST_PHASE", 4)
    assert phase_ends(12) == [4, 8, 12]
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(smollm2_dir), load_tokenizer(smollm2_dir)
    prompts = [encode(tokenizer, q) for q in QUESTIONS]
    eos = {greedy_decode(verifier, prompts[:1], 12, set())[0][6]}  # the first answer ends at its 7th token, others later
    drafter = random_drafter(verifier, 32000, tuple(project_params().model.aux_layers))
    session = Session.create(verifier, drafter, Settings.from_params(eval_params(max_new_tokens=12)), eos)
    runs = decode_tau(session, prompts, batch_size=2)
    greedy = greedy_decode(verifier, prompts, 12, eos)
    assert runs["chain"].outputs == runs["tree"].outputs == greedy and len({len(a) for a in greedy}) > 1
    for run in runs.values():
        assert all(len(tokens) == 1 + sum(a + 1 for a in accepted) for tokens, accepted in zip(run.outputs, run.accepted))
    whole = speculative_decode(session.target, EagleProposer(drafter, TreeShape.chain(3)), prompts, 12)
    assert runs["chain"].accepted == [d.accepted for d in whole]  # as one decode, forward for forward
    ats = [pause.at for _, pause in calls]  # per batch of 2: the chain's phases 4, 8, 12, then the tree's, the same
    assert ats[: len(ats) // 2] == ats[len(ats) // 2 :] == sorted(ats[: len(ats) // 2]) and set(ats) == {4, 8, 12}
    for batch, pause in calls:  # a later phase: answers not ended, each prompt going on from its answer's last token
        if pause.at > 4:
            for prompt, answer in zip(batch, pause.answered):
                j = next(j for j in range(3) if prompt.tolist() == prompts[j].tolist() + answer[:-1])
                assert answer == greedy[j][: len(answer)] and 4 <= len(answer) < len(greedy[j])
    forwards = [len(a) for a in runs["chain"].accepted]
    tree_first = [p.tolist() for batch, pause in calls[len(calls) // 2 :] if pause.at == 4 for p in batch]
    assert tree_first == [prompts[i].tolist() for i in sorted(range(3), key=lambda i: -forwards[i])]


def test_batches_of_parallel_columns_are_filled_to_the_captured_rows():
    assert list(batched([["a", "b", "c"], [1, 2, 3]], 2, rows=2)) == [(2, [["a", "b"], [1, 2]]), (1, [["c", "c"], [3, 3]])]
    assert list(batched([["a", "b", "c"]], 2, rows=None)) == [(2, [["a", "b"]]), (1, [["c"]])]  # eager: no filling


def test_a_paused_answer_goes_on_accepting_as_one_decode_would(tiny_verifier_dir, monkeypatch):
    """A partly right drafter (identical prompts, so its table fits any batch row) decoded in phases of 4, 8 and 12
    tokens accepts forward for forward what one decode accepts: a pause never cuts a round short. The same in the
    GPU's static caches (run eagerly), chain and tree: each phase's prefill and rounds fit their columns."""
    import eagle3.decoding.evaluation as evaluation

    monkeypatch.setattr(evaluation, "FIRST_PHASE", 4)
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(tiny_verifier_dir), load_tokenizer(tiny_verifier_dir)
    prompts = [encode(tokenizer, QUESTIONS[0])] * 3
    eos = {tokenizer.eos_token_id}
    table = greedy_tables(verifier, prompts, 12 + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    drafter = TableDrafter(table, verifier.config.vocab_size)
    session = Session(target=Target(verifier=verifier, layer_ids=(0,), eos_ids=eos), drafter=drafter,
                      settings=Settings.from_params(eval_params(max_new_tokens=12)))
    static = session.with_graphs(DecodeGraphs(len(prompts[0]), 12, capture=False))
    whole = speculative_decode(session.target, EagleProposer(drafter, TreeShape.chain(K)), prompts, 12)
    for shape in (TreeShape.chain(K), TreeShape(3, 2, 6)):
        phased = decode_phased(session, prompts, 2, "m", shape)
        assert phased.outputs == greedy_decode(verifier, prompts, 12, eos) and max(phased.accepted[0]) > 0
        assert decode_phased(static, prompts, 2, "m", shape).accepted == phased.accepted
        if shape.topk == 1:
            assert phased.accepted == [d.accepted for d in whole]


def write_eval_set(prompts_dir, tiny_verifier_dir, name, records):
    (prompts_dir / "eval").mkdir(parents=True, exist_ok=True)
    (prompts_dir / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tiny_verifier_dir)}))
    (prompts_dir / "eval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_followup_turn_is_asked_after_the_verifiers_own_answer(tiny_verifier_dir):
    """The second turn's prompt is the first turn, the verifier's greedy answer to it and the followup, rendered
    with the chat template; only conversations with a followup left go on."""
    tokenizer = load_tokenizer(tiny_verifier_dir)
    verifier = load_verifier(tiny_verifier_dir)
    records = [{"id": "0", "messages": [{"role": "user", "content": QUESTIONS[0]}], "followups": FOLLOWUPS},
               {"id": "1", "messages": [{"role": "user", "content": QUESTIONS[1]}]}]
    chats = Conversations(tokenizer, records, "cpu")
    assert chats.turns == 3 and [chats.rows(t) for t in (1, 2, 3)] == [2, 1, 1]
    first = [torch.tensor(prompt_ids(tokenizer, r["messages"])) for r in records]
    answers = greedy_decode(verifier, first, 8, {2})
    second = chats.next_turn(answers)
    expected = records[0]["messages"] + [{"role": "assistant", "content": tokenizer.decode(answers[0], skip_special_tokens=True)},
                                         {"role": "user", "content": FOLLOWUPS[0]}]
    assert len(second) == 1 and second[0].tolist() == prompt_ids(tokenizer, expected)
    assert len(second[0]) + 8 <= chats.longest_prompt(8)
    third = chats.next_turn(greedy_decode(verifier, second, 8, {2}))
    assert len(third) == 1 and len(third[0]) <= chats.longest_prompt(8) and chats.next_turn(greedy_decode(verifier, third, 8, {2})) == []


def test_multi_turn_set_pools_its_turns_with_a_breakdown(tmp_path, tiny_verifier_dir, monkeypatch):
    """A set with followups (as MT-bench): τ over both turns' forwards, each turn's beside it, through the stage."""
    verifier = load_verifier(tiny_verifier_dir)
    drafter_dir, prompts_dir = tmp_path / "drafter", tmp_path / "prompts"
    drafter_dir.mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), drafter_dir, verifier_facts(tiny_verifier_dir), {})
    records = [{"id": str(i), "source": "mtbench", "messages": [{"role": "user", "content": q}], "followups": FOLLOWUPS[:1]}
               for i, q in enumerate(QUESTIONS)]
    write_eval_set(prompts_dir, tiny_verifier_dir, "mtbench", records)
    params = eval_params(sets=["mtbench"])
    OmegaConf.save(params, tmp_path / "params.yaml")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    main([str(tiny_verifier_dir), str(drafter_dir), str(prompts_dir), str(out), "--params", str(tmp_path / "params.yaml")])
    metrics = json.loads((out / "metrics.json").read_text())["mtbench"]
    turns = metrics["turn1"], metrics["turn2"]
    assert [t["prompts"] for t in turns] == [3, 3] and metrics["prompts"] == 3
    assert metrics["forwards"] == sum(t["forwards"] for t in turns)  # τ pools both turns' forwards
    pooled = sum(t["tau"] * t["forwards"] for t in turns) / metrics["forwards"]
    assert metrics["tau"] == pytest.approx(pooled, abs=1e-3) and metrics["lossless"] == 1
    assert all("tau" in t["tree"] and "tau" in t["ngram"] and "tau" in t["baseline"] for t in turns)
    assert set(metrics["tau_by_position"]) == {"0-4", "4+"} and metrics["ngram"]["tau_by_position"] and metrics["tree"]["tau_by_position"]


def test_followups_that_are_not_user_turns_are_refused(tmp_path, tiny_verifier_dir):
    write_eval_set(tmp_path, tiny_verifier_dir, "mtbench", [{"id": "q1", "messages": [{"role": "user", "content": "hi"}],
                                                             "followups": [{"role": "user"}]}])
    with pytest.raises(UserError, match=r"mtbench.jsonl: record 'q1': followups must be a list of user turns"):
        load_eval_sets(tmp_path, ["mtbench"], None)


@pytest.mark.parametrize("overrides, sizes, tokens, sweep", [
    ([], [32], 64, []),
    (["dataset=10k", "layout=gpu1"], [1, 64], 256, []),
    (["dataset=10k", "layout=gpu1", "evaluate=sweep"], [1, 4, 16, 64], 256, [2, 3, 4, 5, 6, 7]),
    (["dataset=10k", "layout=gpu1", "evaluate=tau"], [1, 64], 256, []),
])
def test_layouts_size_the_measurement_and_the_sweep_is_a_named_config(tmp_path, overrides, sizes, tokens, sweep):
    """GPU layouts: tau over 256-token answers, timings at batch 1 and 64; -S evaluate=sweep times every size and K."""
    compose_params(overrides, conf_dir=ROOT / "conf", output=tmp_path / "params.yaml")
    evaluate_params = OmegaConf.load(tmp_path / "params.yaml").evaluate
    assert (list(evaluate_params.batch_sizes), evaluate_params.max_new_tokens, list(evaluate_params.chain_sweep)) == (sizes, tokens, sweep)
    assert evaluate_params.repeats == (0 if "evaluate=tau" in overrides else 1 if not overrides else 3)
