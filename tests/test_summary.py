"""The headline metrics file: what `dvc exp show` compares runs by."""

from __future__ import annotations

import json

import pytest

from eagle3.summary import headline, main

TRAIN = {"best": {"acc_0": 0.412345, "sim_accept_len": 0.91, "loss": 3.0, "acc_1": 0.2, "step": 40}, "tokens_trained": 5120,
         "train": {"loss": 3.1}, "step": 60}
MERGE = {"hidden_state_bytes": 1_000_000, "records": 28, "train_records": 25, "masked_tokens": 1234}
EVALUATE = {
    "wall_seconds": 12.5,
    "heldout": {"tau": 1.523456, "speedup": 0.5, "speedup_spread": 0.031234, "unstable": False, "prompts": 4, "lossless": 1.0,
                "outside_draft_vocab": 0.036245,
                "tree": {"tau": 1.9, "speedup": 0.6, "speedup_spread": 0.2, "forwards": 9}, "baseline": {"tau": 1.19, "token": 28},
                "ngram": {"tau": 1.3, "tau_matched_rounds": 2.5}, "batch": {"1": {"chain": {"speedup": 0.5}}},
                "chain_k": {"k2": {"tau": 1.4, "speedup": 0.45, "speedup_spread": 0.01}, "best": 2}},  # details: no tau of their own
    "humaneval": {"tau": 1.2, "prompts": 2, "baseline": {"tau": 1.1, "token": 79}},  # timed once: no speedup
}


def test_headline_keeps_tau_speedup_with_spread_baselines_and_training_facts():
    assert headline(TRAIN, MERGE, EVALUATE) == {
        "heldout": {"tau": 1.5235, "speedup": 0.5, "speedup_spread": 0.0312, "unstable": 0, "outside_draft_vocab": 0.0362,
                    "tree_tau": 1.9, "tree_speedup": 0.6,
                    "tree_speedup_spread": 0.2, "baseline_tau": 1.19, "ngram_tau": 1.3},
        "humaneval": {"tau": 1.2, "baseline_tau": 1.1},
        "val": {"acc_0": 0.4123, "sim_accept_len": 0.91},
        "tokens_trained": 5120,
        "steps": 60,
        "samples": 25,
        "answer_tokens_mean": 44.1,
        "hidden_state_bytes": 1_000_000,
    }


def test_tau_against_training_tokens_is_one_row_per_eval_set(tmp_path):
    paths = {name: tmp_path / f"{name}.json" for name in ("train", "merge", "evaluate")}
    for (name, path), data in zip(paths.items(), (TRAIN, MERGE, EVALUATE)):
        path.write_text(json.dumps(data))
    main([*map(str, paths.values()), str(tmp_path / "summary.json"), "--tau-vs-data", str(tmp_path / "tau")])
    assert sorted(p.name for p in (tmp_path / "tau").iterdir()) == ["heldout.json", "humaneval.json"]
    assert json.loads((tmp_path / "tau" / "heldout.json").read_text()) == [
        {"train_tokens": 5120, "chain": 1.5235, "tree": 1.9, "prompt_lookup": 1.3}]
    assert json.loads((tmp_path / "tau" / "humaneval.json").read_text()) == [{"train_tokens": 5120, "chain": 1.2}]


def test_metrics_of_an_older_train_are_refused_with_the_file_named(tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.json" for name in ("train", "merge", "evaluate")}
    for (name, path), data in zip(paths.items(), ({"best": TRAIN["best"]}, MERGE, EVALUATE)):
        path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="lacks \\['tokens_trained', 'step'\\]"):
        main([str(paths["train"]), str(paths["merge"]), str(paths["evaluate"]), str(tmp_path / "summary.json")])


def test_headline_has_tau_by_position_and_each_turn_of_a_multi_turn_set():
    evaluate = {"mtbench": {"tau": 1.6, "prompts": 3, "tau_by_position": {"0-64": 1.7, "64-256": 1.55},
                            "tree": {"tau": 1.9, "tau_by_position": {"0-64": 2.0123456}},
                            "ngram": {"tau": 1.3, "tau_by_position": {"0-64": 1.2}},
                            "turn1": {"tau": 1.7, "prompts": 3, "forwards": 10, "tree": {"tau": 2.0}},
                            "turn2": {"tau": 1.5, "prompts": 3, "forwards": 10, "tree": {"tau": 1.8}}}}
    assert headline(TRAIN, MERGE, evaluate)["mtbench"] == {
        "tau": 1.6, "tree_tau": 1.9, "ngram_tau": 1.3, "turn1_tau": 1.7, "turn2_tau": 1.5,
        "tau_by_position": {"0-64": 1.7, "64-256": 1.55}, "tree_tau_by_position": {"0-64": 2.0123}}
