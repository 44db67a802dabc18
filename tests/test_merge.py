"""Stage ``merge`` and the loader: seeded manifest, dedupe, filters, draft vocabulary, statistics."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.numpy import load_file

from eagle3.common import UserError, prompt_group, read_json, read_jsonl, write_json
from eagle3.config import validate
from eagle3.extract import extract, stage_arguments
from eagle3.hidden_states.loader import HiddenStates
from eagle3.merge import draft_vocab, merge
from eagle3.training.config import Batching
from eagle3.training.data import collate, pack

from support.data import conversation, stored_sample, tiny_params, write_generated
from support.repo import project_params

SHARDS = ["000000-000006", "000006-000012"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_verifier_dir, tiny_model_params):
    """Two extracted shards; the second repeats a record of the first, has a too short and a too long answer."""
    root = tmp_path_factory.mktemp("merge")
    first = [conversation(i) for i in range(6)]
    short = conversation(7)
    short["messages"][-1]["content"] = "Yes."
    second = [conversation(6), short, conversation(8, answer_sentences=25), {**conversation(2), "id": "dup"}, conversation(9), conversation(10)]
    params = tiny_params(tiny_model_params)
    for shard, records in zip(SHARDS, (first, second)):
        extract(tiny_verifier_dir, write_generated(root / "generated" / shard, records), root / "hidden" / shard, *stage_arguments(params))
    return root


def merge_params(seed: int = 0, **cfg):
    params = project_params()
    params.seed = seed
    params.dataset.shards = SHARDS
    params.merge = OmegaConf.merge(params.merge, {"max_tokens": 200, "val_fraction": 0.25, "draft_vocab_size": 64, **cfg})
    return params


def run_merge(root, verifier, name: str, **kwargs) -> dict:
    return merge(verifier, root / "hidden", root / name, root / f"metrics-{name}", merge_params(**kwargs))


def test_draft_vocab_rule():
    counts = np.array([0, 5, 0, 9, 5, 1])
    d2t, t2d, filled = draft_vocab(counts, 3)
    target = np.arange(3) + d2t  # target = draft + d2t[draft]
    assert target.tolist() == [1, 3, 4] and d2t.dtype == np.int64
    assert t2d.tolist() == [False, True, False, True, True, False] and t2d.sum() == 3 and filled == 0
    d2t, t2d, filled = draft_vocab(counts, 100)  # Vd = min(100, V); never-seen ids fill by id order
    assert len(d2t) == 6 and t2d.all() and filled == 2
    d2t, _, filled = draft_vocab(np.array([0, 0, 7, 0]), 2)
    assert (np.arange(2) + d2t).tolist() == [0, 2] and filled == 1


def test_merge_is_deterministic_filters_and_builds_the_vocab(shards, tiny_verifier_dir):
    stats = run_merge(shards, tiny_verifier_dir, "a")
    again = run_merge(shards, tiny_verifier_dir, "b")
    other = run_merge(shards, tiny_verifier_dir, "c", seed=1)
    for name in ("manifest.jsonl", "vocab.safetensors"):
        assert (shards / "a" / name).read_bytes() == (shards / "b" / name).read_bytes()
    assert stats == again
    rows = list(read_jsonl(shards / "a" / "manifest.jsonl"))
    shuffled = list(read_jsonl(shards / "c" / "manifest.jsonl"))
    assert [r["id"] for r in rows] != [r["id"] for r in shuffled]  # another seed, another order
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in shuffled)
    assert {"dup", conversation(7)["id"], conversation(8)["id"]}.isdisjoint(r["id"] for r in rows)
    assert (stats["dropped_duplicates"], stats["dropped_too_few_masked"], stats["dropped_too_long"]) == (1, 1, 1)
    assert stats["input_samples"] == 12 and stats["records"] == 9 == len(rows)
    assert (stats["train_records"], stats["val_records"]) == (7, 2) == (sum(r["split"] == "train" for r in rows), sum(r["split"] == "val" for r in rows))

    vocab = load_file(shards / "a" / "vocab.safetensors")
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    assert d2t.dtype == np.int64 and d2t.shape == (64,) and t2d.dtype == bool and t2d.shape == (49152,)
    target = np.arange(64) + d2t
    assert (np.diff(target) > 0).all() and t2d.sum() == 64 and t2d[target].all()
    counts = train_target_counts(shards, rows)
    assert counts[target].min() >= counts[~t2d].max()  # the 64 most frequent targets
    assert stats["vocab_coverage"] == pytest.approx(counts[target].sum() / counts.sum())
    assert read_json(shards / "metrics-a" / "metrics.json")["vocab_coverage"] == stats["vocab_coverage"]
    histogram = read_json(shards / "metrics-a" / "plots" / "custom" / "length_histogram.json")
    assert sum(point["samples"] for point in histogram) == 9


def test_a_prompts_answers_stay_on_one_side_of_the_split(tmp_path, tiny_verifier_dir, tiny_model_params):
    """generate.samples=3 records (ids <first>, <first>-1, <first>-2): all kept answers of a prompt share a
    split; different answers to one prompt are all kept, one identical to another is a duplicate."""
    records = []
    for i in range(8):
        first = conversation(i)
        records += [first, *({**conversation(i, answer_sentences=1 + (i + k) % 4), "id": f"{first['id']}-{k}"} for k in (1, 2))]
    records[2] = {**records[0], "id": records[2]["id"]}  # prompt 0's answer 2 repeats its answer 0
    shard = "000000-000008"
    extract(tiny_verifier_dir, write_generated(tmp_path / "generated" / shard, records), tmp_path / "hidden" / shard,
            *stage_arguments(tiny_params(tiny_model_params)))
    params = merge_params()
    params.dataset.shards = [shard]
    stats = merge(tiny_verifier_dir, tmp_path / "hidden", tmp_path / "merged", tmp_path / "metrics", params)

    sides: dict[str, set] = {}
    for row in read_jsonl(tmp_path / "merged" / "manifest.jsonl"):
        sides.setdefault(prompt_group(row["id"]), set()).add(row["split"])
    assert len(sides) == 8 and all(len(split) == 1 for split in sides.values())
    assert sorted(split.pop() for split in sides.values()) == ["train"] * 6 + ["val"] * 2  # 0.25 of the prompts
    assert (stats["records"], stats["dropped_duplicates"]) == (23, 1)

    # merge.train_prompts: the first prompts of the same shuffled train split, each with all its answers; the
    # validation split as before
    params.merge.train_prompts = 4
    fewer = merge(tiny_verifier_dir, tmp_path / "hidden", tmp_path / "fewer", tmp_path / "metrics-fewer", params)
    rows = list(read_jsonl(tmp_path / "merged" / "manifest.jsonl"))
    kept = list(read_jsonl(tmp_path / "fewer" / "manifest.jsonl"))
    train = [row for row in rows if row["split"] == "train"]
    first_four = list(dict.fromkeys(prompt_group(row["id"]) for row in train))[:4]
    assert [row for row in kept if row["split"] == "train"] == [row for row in train if prompt_group(row["id"]) in first_four]
    assert [row for row in kept if row["split"] == "val"] == [row for row in rows if row["split"] == "val"]
    assert fewer["left_out_records"] == stats["train_records"] - fewer["train_records"] > 0 == stats["left_out_records"]


def train_target_counts(root, rows) -> np.ndarray:
    counts = np.zeros(49152, dtype=np.int64)
    for row in rows:
        if row["split"] == "train":
            stored = stored_sample(root / "hidden" / row["shard"], row)
            np.add.at(counts, stored["input_ids"][stored["loss_mask"].bool()].numpy(), 1)
    return counts


def test_whole_vocabulary_when_vd_exceeds_v(shards, tiny_verifier_dir):
    stats = run_merge(shards, tiny_verifier_dir, "full", draft_vocab_size=100_000)
    vocab = load_file(shards / "full" / "vocab.safetensors")
    assert vocab["d2t"].shape == (49152,) and (vocab["d2t"] == 0).all() and vocab["t2d"].all()
    assert stats["vocab_coverage"] == 1.0 and stats["draft_vocab_filled"] == 49152 - stats["distinct_targets"]


def test_merge_reads_only_listed_shards_and_refuses_another_verifier(shards, tiny_verifier_dir, tmp_path):
    root = tmp_path / "hidden"
    shutil.copytree(shards / "hidden", root)
    shutil.copytree(root / SHARDS[1], root / "000012-000018")  # stale shard of a bigger scale
    merge(tiny_verifier_dir, root, tmp_path / "merged", tmp_path / "metrics", merge_params())
    assert {row["shard"] for row in read_jsonl(tmp_path / "merged" / "manifest.jsonl")} == set(SHARDS)
    meta = read_json(root / SHARDS[1] / "meta.json")
    meta["verifier"]["fingerprint"] = "0" * 16
    write_json(root / SHARDS[1] / "meta.json", meta)
    with pytest.raises(UserError, match=f"{SHARDS[1]}/meta.json: extracted with verifier 0+"):
        merge(tiny_verifier_dir, root, tmp_path / "merged2", tmp_path / "metrics2", merge_params())
    assert not (tmp_path / "merged2").exists()


def test_dataset_packs_into_rows_of_the_stored_precision(shards, tiny_verifier_dir):
    """bf16 states stay bf16 through the loader (half the bytes of float32; the CPU widens them on arrival)."""
    run_merge(shards, tiny_verifier_dir, "loader")
    rows = [r for r in read_jsonl(shards / "loader" / "manifest.jsonl") if r["split"] == "train"]
    dataset = HiddenStates(shards / "loader", shards / "hidden", "train")
    assert dataset.lengths == [row["length"] for row in rows] and len(rows) == 7
    capacity = 2 * max(dataset.lengths)
    layout = pack(dataset.lengths, capacity)
    batch = collate([dataset[i] for row in layout for i in row], Batching(capacity, len(layout), 1))
    assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.bool
    assert batch["aux"].shape == (len(layout), capacity, 3 * 64) and batch["aux"].dtype == torch.bfloat16
    assert batch["final"].shape == (len(layout), capacity, 64) and batch["tokens"] == sum(dataset.lengths)
    for r, members in enumerate(layout):
        start = 0
        for i in members:
            stored, end = stored_sample(shards / "hidden" / rows[i]["shard"], rows[i]), start + rows[i]["length"]
            assert batch["position_ids"][r, start:end].tolist() == list(range(rows[i]["length"]))
            assert torch.equal(batch["input_ids"][r, start:end], stored["input_ids"].long())
            assert torch.equal(batch["aux"][r, start:end], stored["aux"])
            assert torch.equal(batch["final"][r, start:end], stored["final"])
            start = end
        assert not batch["loss_mask"][r, start:].any() and not batch["aux"][r, start:].any()
    assert len(HiddenStates(shards / "loader", shards / "hidden", "val")) == 2


def test_source_repeats_weigh_the_training_split_by_source(tmp_path, tiny_verifier_dir, tiny_model_params):
    """merge.source_repeats: a source's training samples twice, another's a seeded half, the rest once; the validation
    split as before; the same rows on a second run; each sample's source named from its generated record."""
    records = [{**conversation(i), "source": f"data/sources/{'a' if i % 2 else 'b'}.jsonl#{i}"} for i in range(16)]
    shard = "000000-000016"
    extract(tiny_verifier_dir, write_generated(tmp_path / "generated" / shard, records), tmp_path / "hidden" / shard,
            *stage_arguments(tiny_params(tiny_model_params)))
    params = merge_params()
    params.dataset.shards = [shard]
    params.dataset.sources = [{"kind": "jsonl", "path": f"data/sources/{name}.jsonl", "label": name} for name in "ab"]
    source = {r["id"]: r["source"].split("/")[-1][0] for r in records}

    def rows(name: str, **repeats) -> list[dict]:
        params.merge.source_repeats = repeats
        merge(tiny_verifier_dir, tmp_path / "hidden", tmp_path / name, tmp_path / f"metrics-{name}", params, tmp_path / "generated")
        return list(read_jsonl(tmp_path / name / "manifest.jsonl"))

    once, weighed, again = rows("once"), rows("weighed", a=2, b=0.5), rows("again", a=2, b=0.5)
    train = [row["id"] for row in once if row["split"] == "train"]
    repeated = [row["id"] for row in weighed if row["split"] == "train"]
    assert [row for row in weighed if row["split"] == "val"] == [row for row in once if row["split"] == "val"]
    assert all(repeated.count(i) == 2 for i in train if source[i] == "a")
    kept_b = [i for i in train if source[i] == "b" and i in repeated]
    assert all(repeated.count(i) == 1 for i in kept_b) and 0 < len(kept_b) < sum(source[i] == "b" for i in train)
    assert weighed == again and read_json(tmp_path / "metrics-weighed" / "metrics.json")["repeated_records"] == len(repeated) - len(train)

    params.merge.source_repeats = {"a": 0, "b": 0}  # nothing left to train on: one line, nothing written
    with pytest.raises(UserError, match="merge.source_repeats = {'a': 0, 'b': 0}: leaves no training sample"):
        merge(tiny_verifier_dir, tmp_path / "hidden", tmp_path / "none", tmp_path / "metrics-none", params, tmp_path / "generated")
    assert not (tmp_path / "none").exists()

    params.merge.source_repeats = {"c": 2}  # a name no source has: refused by the schema, in one line
    with pytest.raises(UserError, match=r"merge.source_repeats = \{'c': 2\}: must be keyed by the names of dataset.sources \(a, b\)"):
        validate(params)
