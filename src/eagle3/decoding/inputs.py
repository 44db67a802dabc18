"""What ``evaluate`` decodes besides its params: the eval sets' prompt records (``load_eval_sets``), and the verifier,
drafter and prompts checked to belong together (``check_pair``).

    check_pair(verifier_dir, drafter_dir, prompts_dir)            # a faulty export, another verifier's: refused
    records = load_eval_sets(prompts_dir, settings.sets, settings.max_prompts)

Why apart from the stage: a benchmark serving the run's drafter (benchmarks/serve_vllm.py) reads and refuses the same
inputs as the stage, without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3.common import UserError, read_json, read_jsonl
from eagle3.drafter.export import check_drafter
from eagle3.lm.spec import require_verifier
from eagle3.lm.tokenizer_id import tokenizer_fingerprint


def load_eval_sets(prompts_dir: Path, sets: Sequence[str], max_prompts: int | None) -> dict[str, list[dict]]:
    """Prompt records of each set, at most ``max_prompts`` each (file order); ``followups``, where a record
    has them, checked to be later user turns (strings)."""
    loaded = {}
    for name in sets:
        path = prompts_dir / "eval" / f"{name}.jsonl"
        if not path.is_file():
            raise UserError(f"{path}: eval set {name!r} not found; list only sets of dataset.eval_sets in evaluate.sets")
        records = list(read_jsonl(path))[:max_prompts]
        if not records:
            raise UserError(f"{path}: no prompts; the prompts stage wrote an empty eval set")
        for record in records:
            followups = record.get("followups", [])
            if not (isinstance(followups, list) and all(isinstance(f, str) and f for f in followups)):
                raise UserError(f"{path}: record {record.get('id')!r}: followups must be a list of user turns (non-empty "
                                f"strings), got {followups!r}; rerun prompts")
        loaded[name] = records
    return loaded


def check_pair(verifier_dir: Path, drafter_dir: Path, prompts_dir: Path) -> None:
    """Refuse a drafter export with faults or trained for another verifier, and prompts of another verifier."""
    problems = check_drafter(drafter_dir, verifier_dir)
    if problems:
        raise UserError(f"{drafter_dir}: {problems[0]}" + (f" (and {len(problems) - 1} more; run eagle3 check-drafter)" if len(problems) > 1 else ""))
    tokenizer = tokenizer_fingerprint(verifier_dir)  # not the weights': another machine's import of them differs
    prompts = read_json(prompts_dir / "meta.json").get("tokenizer")
    require_verifier(f"{prompts_dir}/meta.json", "prompts counted with the tokenizer and chat template of", prompts,
                     tokenizer, "this verifier's are", "rerun prompts")
