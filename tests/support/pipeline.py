"""The whole pipeline in a temporary project: test datasets, the fast overrides, `-S` lists, the stages a run ran."""

from __future__ import annotations

import json

import yaml

SMALL = {"name": "small", "shards": ["000000-000008"], "eval_sets": {"heldout": 2, "humaneval": 1, "math": 1}}

# A small local prompt file instead of the 755 MB `evals` registry keeps the `prompts` stage quick
# where the test is about other stages (`write_local_prompts` writes it).
LOCAL_SOURCE = {"sources": [{"kind": "jsonl", "path": "data/sources/prompts.jsonl"}], "heldout_fraction": 0.2,
                "eval_sets": {"heldout": 1, "humaneval": 1, "math": 1}}


# train=debug with rows of 512 tokens: tiny answers fill a fraction of debug's 2,048-token rows, and
# the CPU's masked attention costs the whole row squared (a tiny family's 4 steps: 13.6 s -> 1.5 s).
SMALL_ROWS = ["train=debug", "train.pack_tokens=512", "train.batch_tokens=512"]

# The tiny verifier, short answers and a few training steps: the whole pipeline in about a minute.
FAST = ["model=tiny-random", "generate.max_new_tokens=16", "merge.min_tokens=1", *SMALL_ROWS,
        "evaluate.max_new_tokens=8", "layout.threads=1"]


def add_dataset(repo, spec):
    demo = yaml.safe_load((repo / "conf" / "dataset" / "demo.yaml").read_text())
    (repo / "conf" / "dataset" / f"{spec['name']}.yaml").write_text(yaml.safe_dump({**demo, **spec}))


def write_local_prompts(repo, count: int = 30) -> None:
    """LOCAL_SOURCE's file: ``count`` one-line questions."""
    prompts = [{"messages": [{"role": "user", "content": f"Name a fact about the number {i}."}]} for i in range(count)]
    (repo / "data" / "sources" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


def overrides(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("-S", pair)]


def stage_lines(output: str) -> list[str]:
    return sorted(line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage"))
