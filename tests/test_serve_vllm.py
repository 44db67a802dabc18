"""benchmarks/serve_vllm.py's parts that need no GPU: the run folder read as ``evaluate`` reads it, the acceptance from
vLLM's spec-decode counters, and the results file it adds to. vLLM itself is absent here (it runs on the GPU host, from
benchmarks/offline/vllm_kit.sh); its metrics are stand-ins with the fields of vllm.v1.metrics.reader's Counter and
Vector."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.drafter.export import verifier_facts, write_drafter
from eagle3.lm.loading import load_tokenizer, load_verifier
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from support.repo import ROOT, project_params, with_sources
from support.speculative import TINY_TAPS, random_drafter

sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_vllm  # noqa: E402  (a script beside the benchmarks it imports)

SCRIPT = ROOT / "benchmarks" / "serve_vllm.py"
# evaluate's metrics of a 10k run at K = 7 (a chain sweep of none): per set tau, MT-bench's per turn
METRICS = ROOT / "benchmarks" / "results" / "pipeline_10k_e5941be_evaluate_metrics.json"
HELDOUT = ["Write a short poem about the sea.", "def fibonacci(n):", "Name three rivers."]
MTBENCH = [("Plan a trip to Hawaii.", ["Now make it shorter."])]


def tiny_run(folder: Path, verifier: Path, draft_tokens: int = 7) -> Path:
    """A finished run's folder as serve_vllm reads it: params.yaml, models/, data/prompts/eval and evaluate's metrics."""
    params = project_params()
    params.evaluate.merge_with({"draft_tokens": draft_tokens, "max_new_tokens": 256, "sets": ["heldout", "mtbench"]})
    folder.mkdir()
    OmegaConf.save(params, folder / "params.yaml")
    (folder / "models").mkdir()
    (folder / "models" / "verifier").symlink_to(verifier)
    drafter = folder / "models" / "drafter"
    drafter.mkdir()
    write_drafter(random_drafter(load_verifier(verifier), 512, TINY_TAPS), drafter, verifier_facts(verifier), {})
    (folder / "data" / "prompts" / "eval").mkdir(parents=True)
    (folder / "data" / "prompts" / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(verifier)}))
    rows = {"heldout": [{"id": f"h{i}", "source": "tests", "messages": [{"role": "user", "content": q}]}
                        for i, q in enumerate(HELDOUT)],
            "mtbench": [{"id": f"m{i}", "source": "tests", "messages": [{"role": "user", "content": q}], "followups": later}
                        for i, (q, later) in enumerate(MTBENCH)]}
    for name, records in rows.items():
        (folder / "data" / "prompts" / "eval" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "dvclive" / "evaluate").mkdir(parents=True)
    (folder / "dvclive" / "evaluate" / "metrics.json").write_text(METRICS.read_text())
    return folder


def test_the_run_is_read_as_evaluate_reads_it(tmp_path, tiny_verifier_dir):
    run = serve_vllm.load_run(tiny_run(tmp_path / "run", tiny_verifier_dir), None)
    assert run.settings.max_new_tokens == 256 and run.settings.draft_tokens == 7
    prompts = serve_vllm.prompt_token_ids(run)
    assert [len(prompts[name]) for name in ("heldout", "mtbench")] == [3, 1]
    text = load_tokenizer(tiny_verifier_dir).decode(prompts["heldout"][0])
    assert HELDOUT[0] in text and text.rstrip().endswith("assistant")  # the chat template with its generation prompt
    assert serve_vllm.load_run(run.folder, ["mtbench"]).records.keys() == {"mtbench"}


def test_evaluate_tau_is_the_first_turns_for_a_multi_turn_set_and_the_sweep_for_another_k(tmp_path, tiny_verifier_dir):
    run = serve_vllm.load_run(tiny_run(tmp_path / "run", tiny_verifier_dir), None)
    metrics = json.loads(METRICS.read_text())
    assert serve_vllm.evaluate_tau(run, "heldout", 7) == {"tau": metrics["heldout"]["tau"], "metric": "heldout/tau"}
    assert serve_vllm.evaluate_tau(run, "mtbench", 7) == {"tau": metrics["mtbench"]["turn1"]["tau"],
                                                          "metric": "mtbench/turn1/tau"}
    assert serve_vllm.evaluate_tau(run, "heldout", 3) is None  # no sweep in that run
    swept = {**run.metrics, "heldout": {**run.metrics["heldout"], "chain_k": {"k3": {"tau": 2.5}}}}
    run = serve_vllm.Run(run.folder, run.settings, run.records, swept)
    assert serve_vllm.evaluate_tau(run, "heldout", 3) == {"tau": 2.5, "metric": "heldout/chain_k/k3/tau"}
    assert serve_vllm.evaluate_tau(run, "mtbench", 3) is None  # a sweep pools both turns: not the prompts served


def reading(*engines: tuple[int, list[int]]) -> list:
    """``LLM.get_metrics()`` as vLLM returns it: per engine core (a label set), its drafts and accepted per position."""
    metrics = [SimpleNamespace(name="vllm:num_requests_running", labels={}, value=0)]  # a gauge, not read
    for index, (drafts, per_position) in enumerate(engines):
        labels = {"engine": str(index)}
        metrics += [SimpleNamespace(name="vllm:spec_decode_num_drafts", labels=labels, value=drafts),
                    SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=drafts * len(per_position)),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=sum(per_position)),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels, values=per_position)]
    return metrics


def test_acceptance_is_counted_between_two_readings_of_the_engines_counters():
    before = serve_vllm.spec_counters(reading((100, [60, 30, 10])))
    after = serve_vllm.spec_counters(reading((60, [40, 20, 6]), (50, [27, 14, 5])))  # summed over the label sets
    assert after.accepted == 112 and after.per_position == (67, 34, 11)
    assert serve_vllm.acceptance(after - before) == {"acceptance_length": 2.2, "drafts": 10,
                                                     "acceptance_by_position": [0.7, 0.4, 0.1]}
    with pytest.raises(UserError, match="counted no drafts"):  # the plain engine's counters, or a drafter that never ran
        serve_vllm.acceptance(serve_vllm.spec_counters(reading()))


def test_speedups_pair_repeats_with_the_plain_engines_on_the_same_prompts():
    results = {}
    row = serve_vllm.set_row(results, "heldout", 200)
    serve_vllm.record_timing(row, "plain", 16, 16, [100.0, 110.0, 90.0])
    serve_vllm.record_timing(row, "7", 16, 16, [150.0, 110.0, 180.0])
    assert row["tokens_per_s"]["16"]["without"] == {"median": 100.0, "spread": 0.2, "runs": [100.0, 110.0, 90.0]}
    assert row["speedup"]["16"]["7"] == {"median": 1.5, "spread": 0.6667, "runs": [1.5, 1.0, 2.0]}
    assert serve_vllm.measured(results, "heldout", "plain", [16]) and not serve_vllm.measured(results, "heldout", "plain", [1])
    assert not serve_vllm.measured(results, "heldout", "7", [16])  # its acceptance is not there yet
    serve_vllm.record_timing(row, "7", 16, 20, [150.0])  # other prompts timed: the earlier figures go
    assert row["tokens_per_s"]["16"] == {"prompts": 20, "without": None, "with": {"7": {"median": 150.0, "spread": None,
                                                                                          "runs": [150.0]}}}
    assert "16" not in row["speedup"]
    assert serve_vllm.set_row(results, "heldout", 100) == {"prompts": 100, **{key: {} for key in row if key != "prompts"}}


def test_identical_share_compares_token_for_token():
    assert serve_vllm.identical_share([[1, 2], [3], [4, 5]], [[1, 2], [3, 9], [4, 5]]) == 0.6667
    with pytest.raises(ValueError):
        serve_vllm.identical_share([[1]], [[1], [2]])


def test_without_vllm_the_script_says_so_in_one_line_and_keeps_the_results(tmp_path, tiny_verifier_dir):
    """serve_vllm.py's CPU check: where vLLM is not installed (here) it stops after reading the run, one line, and an
    earlier results file stays as it was; a folder that is no run is named, a broken drafter export refused."""
    run = tiny_run(tmp_path / "run", tiny_verifier_dir)
    out = tmp_path / "serve.json"
    out.write_text('{"sets": {}}\n')
    done = subprocess.run([sys.executable, str(SCRIPT), str(run), "--out", str(out)], cwd=tmp_path, env=with_sources(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("error: vllm is not importable")
    assert "Traceback" not in done.stderr and out.read_text() == '{"sets": {}}\n'
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(out)], cwd=tmp_path, env=with_sources(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"{tmp_path / 'params.yaml'}: not found" in done.stderr and "Traceback" not in done.stderr
    (run / "models" / "drafter" / "model.safetensors").unlink()  # a broken export: refused before vLLM is looked for
    done = subprocess.run([sys.executable, str(SCRIPT), str(run), "--out", str(out)], cwd=tmp_path, env=with_sources(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "model.safetensors: not found" in done.stderr.strip().splitlines()[-1]


def served_results() -> dict:
    """A results file as serve_vllm writes it: one set, K = 7, timed at 1 and 64 requests at once."""
    results = {"commit": "abc1234", "commands": ["python benchmarks/serve_vllm.py /root/run --ks", "python ... --ks 7"],
               "vllm": "0.26.0",
               "max_new_tokens": 256, "turns": "the first user turn of each prompt", "repeats": 3, "timed_prompts": 8,
               "engines": {"plain": {"gpu": "NVIDIA H100 80GB HBM3", "other_gpu_processes": 0, "ready_seconds": 100.0},
                           "7": {"gpu": "NVIDIA H100 80GB HBM3", "other_gpu_processes": 0, "ready_seconds": 110.0}}}
    row = serve_vllm.set_row(results, "mtbench", 80)
    row["acceptance_length"]["7"], row["identical_share"]["7"] = 2.36, 0.9
    row["evaluate_tau"]["7"] = {"tau": 2.42, "metric": "mtbench/turn1/tau"}
    for c, plain, drafted in ((1, [500.0, 400.0, 450.0], [600.0, 500.0, 540.0]), (64, [9000.0] * 3, [4500.0] * 3)):
        serve_vllm.record_timing(row, "plain", c, max(c, 8), plain)
        serve_vllm.record_timing(row, "7", c, max(c, 8), drafted)
    return results


def test_the_speedup_table_has_a_row_per_set_and_k_and_a_column_per_concurrency():
    table = serve_vllm.speedup_table(served_results(), "results.json").splitlines()
    assert table[:3] == ["vLLM 0.26.0 on NVIDIA H100 80GB HBM3 (alone), at abc1234 (`results.json`), by",
                         "`python benchmarks/serve_vllm.py /root/run --ks`;", "`python ... --ks 7`;"]
    assert table[4].endswith("| speedup, 1 at once | speedup, 64 at once |")
    assert table[6] == "| `mtbench` | 80 | 7 | 2.36 | 2.42 | 90% | 1.20× (4%) | 0.50× (0%) |"  # below 1× too
    assert max(map(len, table)) <= 200  # docs/serving.md's lines (tests/test_docs.py)


def test_the_results_notes_follow_the_table():
    """What a run lacked, written into its JSON by hand (``notes``), is printed under the table, a paragraph each."""
    results = served_results() | {"notes": ["The first note.", "The second note."]}
    table = serve_vllm.speedup_table(results, "results.json")
    assert table.endswith("submitted at once, over max(C, 8) prompts.\n\nThe first note.\n\nThe second note.")


GENERATED = re.compile(r"^<!-- generated: serve_vllm.py --speedup-table -->\n(.*?)\n<!-- end generated -->$", re.M | re.S)
RESULTS = ROOT / "benchmarks" / "results" / "serve_vllm_20k.json"


def test_the_docs_speedup_table_is_the_results_json():
    """docs/serving.md's engine speedups are serve_vllm.py --speedup-table of the committed JSON; until a run has
    been served, a marked gap with no figure in it."""
    (section,) = GENERATED.findall((ROOT / "docs" / "serving.md").read_text())
    if RESULTS.is_file():
        source = str(RESULTS.relative_to(ROOT))
        assert section == serve_vllm.speedup_table(json.loads(RESULTS.read_text()), source)
    else:
        assert section.startswith("Not measured yet.") and not re.search(r"\d", section.replace("20k", ""))
