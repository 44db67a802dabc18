"""Params: composition, the checks no YAML schema can express, and each stage's declared view.

``dvc exp run -S group=option`` composes ``conf/`` into ``params.yaml`` with Hydra; plain
``dvc repro`` reads the committed ``params.yaml``. ``eagle3 params -S ...`` composes it the same
way (through DVC's own function) without running anything, and writes it only once it is valid.

A stage reads its params through ``stage_params(PARAMS)``: only the keys it declares (the same
list as its ``params:`` in dvc.yaml, checked by a test), validated before it does anything else.
Reading an undeclared key fails, so a stage cannot depend on a param DVC does not track, and a
bad value set with ``dvc exp run -S`` stops the stage with the same one-line error as here.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from eagle3.common import UserError, at_finish
from eagle3.launch import USER_ERROR
from eagle3.lm.spec import VerifierSpec

SHARD_NAME = re.compile(r"^(\d{6})-(\d{6})$")
SOURCE_KEYS = {  # dataset.sources: the keys of an entry, by kind (docs/data.md), besides kind, label and weight
    "evals": ("folders", "exclude", "folder_temperature"),
    "jsonl": ("path",),
    "parquet": ("path",),
    "sharegpt": ("path", "package", "file"),
    "hf": ("name", "subset", "split"),
}
SOURCE_KINDS = tuple(SOURCE_KEYS)
STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
_ABSENT = object()


def compose_params(overrides: list[str], conf_dir: str | Path = "conf", output: str | Path = "params.yaml") -> None:
    """Compose ``conf/config.yaml`` with Hydra overrides into ``output``, exactly as DVC does.

    The composition goes to a temporary file beside ``output`` and replaces it only once valid.
    """
    from hydra.errors import HydraException
    from dvc.utils.hydra import compose_and_dump

    conf_dir, output = Path(conf_dir).resolve(), Path(output)
    if not (conf_dir / "config.yaml").is_file():
        raise UserError(f"{conf_dir}/config.yaml: not found")
    handle, scratch = tempfile.mkstemp(prefix=f".{output.name}.tmp-", dir=output.parent)
    os.close(handle)
    try:
        compose_and_dump(Path(scratch), str(conf_dir), None, "config", str(conf_dir), list(overrides))
        composed = OmegaConf.load(scratch)
        check_known_keys(composed, conf_dir, output.name)  # a `+key=value` override adds what no conf/ file declares
        validate(composed)
        os.replace(scratch, output)
    except HydraException as err:
        first = str(err).strip().splitlines()[0]
        raise UserError(f"conf/: {first}") from None
    finally:
        Path(scratch).unlink(missing_ok=True)


def stage_params(keys: Iterable[str], path: str | os.PathLike = "params.yaml", schema: Path | None = None) -> DictConfig:
    """The declared ``keys`` of the params file, validated; reading any other key raises. With ``schema``
    (the conf/ folder: the params stage), every key of the whole file must be one it declares.

    When the stage finishes (``stage_main``), the file must still hold these values, else the stage
    fails (``_require_unchanged``). Under torchrun every process validates the same values: only
    rank 0 prints the error.
    """
    path, keys = Path(path), tuple(keys)
    if not path.is_file():
        raise UserError(f"{path}: not found; run from the repository root or compose it with `eagle3 params`")
    params, view = OmegaConf.load(path), OmegaConf.create()
    for key in keys:
        value = OmegaConf.select(params, key, default=_ABSENT)
        if value is _ABSENT:
            raise UserError(f"{path}: {key} is missing; recompose it with `eagle3 params`")
        OmegaConf.update(view, key, value, force_add=True)
    with _reported_by_rank0():
        if schema is not None:
            check_known_keys(params, schema, path.name)
        validate(view)
    started = _declared_values(params, keys)
    at_finish(lambda: _require_unchanged(path, keys, started))
    OmegaConf.set_struct(view, True)
    return view


@contextlib.contextmanager
def _reported_by_rank0() -> Iterator[None]:
    """A UserError inside is printed by rank 0 only; the other torchrun processes exit USER_ERROR silently."""
    try:
        yield
    except UserError:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(USER_ERROR) from None
        raise


def _declared_values(params: DictConfig, keys: Iterable[str]) -> dict[str, Any]:
    """The leaves of the declared ``keys``, by dotted name: ``{"evaluate.tree.topk": 4, ...}``."""
    leaves: dict[str, Any] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for child, item in value.items():
                add(f"{name}.{child}", item)
        else:
            leaves[name] = value

    for key in keys:
        add(key, _get(params, key))
    return leaves


def _require_unchanged(path: Path, keys: Iterable[str], started: dict[str, Any]) -> None:
    """Refuse to finish when the params file no longer holds the declared values the stage started with.

    A `dvc exp run -S` refused by DVC's lock while this stage ran has already rewritten params.yaml
    (DVC releases its lock while a stage's command runs), and DVC would record the new values
    for outputs made with the old ones: a stage failing here gets no dvc.lock entry.
    """
    try:
        now = _declared_values(OmegaConf.load(path), keys)
    except (OSError, yaml.YAMLError):
        now = {}
    changed = [key for key in sorted(started.keys() | now.keys()) if started.get(key, _ABSENT) != now.get(key, _ABSENT)]
    if changed:
        shown = ", ".join(f"{key} {_shown(started.get(key, _ABSENT))} -> {_shown(now.get(key, _ABSENT))}" for key in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        with _reported_by_rank0():
            raise UserError(f"{path}: changed while this stage ran ({shown}{more}): its outputs are of the values it "
                            f"started with, so nothing is recorded; run `dvc repro` again for the new values, or first "
                            f"`git checkout {path}` for the old ones")


def _shown(value: Any) -> str:
    return "(missing)" if value is _ABSENT else repr(value)


def shard_range(name: str) -> tuple[int, int]:
    """``"000032-001000"`` -> ``(32, 1000)``: a shard is a range of the seeded prompt order."""
    match = SHARD_NAME.match(str(name))
    if not match or int(match[1]) >= int(match[2]):
        raise UserError(f"params.yaml: dataset.shards: {name!r} is not a range 'SSSSSS-EEEEEE' with start < end")
    return int(match[1]), int(match[2])


# --- known keys: conf/ is the schema --------------------------------------------------------------

# Mappings whose entries no conf/ file can list; the code that reads them checks their keys.
OPEN_MAPS = (
    "dataset.eval_sets",    # eval set names (_check_eval_sets, the prompts stage)
    "model.draft_head",     # overrides of the drafter's shape (DraftConfig.create)
    "model.source.config",  # a random verifier's transformers config (verifier_sources.random_weights)
)
Schema = dict[str, "Schema | None"]  # None: a value conf/ declares as a scalar, a list or an empty mapping


def conf_schema(conf_dir: str | Path = "conf") -> Schema:
    """Every key conf/ declares: config.yaml's own at the top, and under each group's name the union of
    the keys its options declare (so a key of any option, e.g. backend.port of sglang, is known).

    Every key is declared with its comment in conf/, so a key added there is known here too.
    """
    conf_dir = Path(conf_dir)
    schema = _declared(_conf_file(conf_dir / "config.yaml"))
    for option in sorted(conf_dir.glob("*/*.yaml")):
        schema = _union(schema, {option.parent.name: _declared(_conf_file(option))})
    return schema


def _conf_file(path: Path) -> dict:
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"{path}: not readable YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: not a mapping of keys")
    return {key: value for key, value in loaded.items() if key != "defaults"}  # Hydra's list of options, not a key


def _declared(value: Any) -> Schema | None:
    return {str(key): _declared(item) for key, item in value.items()} if isinstance(value, dict) and value else None


def _union(first: Schema | None, second: Schema | None) -> Schema | None:
    if not isinstance(first, dict) or not isinstance(second, dict):
        return first if isinstance(first, dict) else second
    return {key: _union(first.get(key), second.get(key)) for key in first.keys() | second.keys()}


def check_known_keys(params: DictConfig | dict, conf_dir: str | Path = "conf", name: str = "params.yaml") -> None:
    """Refuse the first key of ``params`` that no conf/ file declares, in one line with the nearest known key.

    Within a section or a mapping conf/ declares with keys, every key must be declared (``OPEN_MAPS``
    excepted); lists (e.g. dataset.sources, checked by ``_check_sources``) are values.
    """
    values = OmegaConf.to_container(params) if isinstance(params, DictConfig) else params
    _check_keys(values, conf_schema(conf_dir), "", Path(conf_dir), name)


def _check_keys(values: Any, schema: Schema | None, prefix: str, conf_dir: Path, name: str) -> None:
    if not isinstance(values, dict) or not isinstance(schema, dict):
        return
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if str(key) not in schema:
            section = dotted.split(".")[0]
            where = conf_dir / section if (conf_dir / section).is_dir() and "." in dotted else conf_dir / "config.yaml"
            nearest = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = (f"did you mean {prefix}{nearest[0]}?" if nearest else
                    f"no file of {where}/ declares it" if where.is_dir() else f"{where} does not declare it")
            raise UserError(f"{name}: {dotted}: unknown key ({hint})")
        if dotted not in OPEN_MAPS:
            _check_keys(value, schema[str(key)], f"{dotted}.", conf_dir, name)


# --- value checks: key -> (test, what is allowed) -------------------------------------------------


def _int(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(low: float, high: float = float("inf"), open_low: bool = False) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and (v > low if open_low else v >= low) and v <= high

    return check


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _one_of(*allowed: Any) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in allowed), f"one of {list(allowed)}"


POSITIVE = (_int(1), "an integer >= 1")
NON_NEGATIVE = (_int(0), "an integer >= 0")
BOOL = (_bool, "true or false")
FRACTION = (_number(0, 1), "a number in [0, 1]")

CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": NON_NEGATIVE,
    "dataset.heldout_fraction": FRACTION,
    "dataset.unseen_folders": (lambda v: _int(0)(v) or (isinstance(v, float) and 0 <= v < 1),
                               "a share of each evals source's folders in [0, 1) or a count per source (an int >= 0)"),
    "dataset.max_prompt_tokens": POSITIVE,
    "model.copy_weights": BOOL,
    "model.trust_remote_code": BOOL,
    "model.num_layers": POSITIVE,
    "model.max_position_embeddings": POSITIVE,
    "layout.device": _one_of("cpu", "cuda"),
    "layout.dtype": _one_of("float32", "bfloat16", "float16"),
    "layout.extract_workers": POSITIVE,
    "layout.train_procs": POSITIVE,
    "layout.nnodes": POSITIVE,
    "layout.threads": POSITIVE,
    "generate.max_new_tokens": POSITIVE,
    "generate.temperature": (_number(0), "a number >= 0"),
    "generate.top_p": (_number(0, 1, open_low=True), "a number in (0, 1]"),
    "generate.samples": POSITIVE,
    "generate.sample_temperatures": ((lambda v: isinstance(v, list) and bool(v) and all(_number(0)(t) for t in v)),
                                     "a non-empty list of numbers >= 0 (cycled over the answers after the first)"),
    "backend.batch_size": POSITIVE,
    "backend.batch_tokens": ((lambda v: v is None or _int(1)(v)), "an integer >= 1, or null for no token budget"),
    "backend.pad_multiple": POSITIVE,
    "backend.cuda_graphs": BOOL,
    "backend.cache_memory": (_number(0, 1, open_low=True), "a number in (0, 1]: the share of the GPU memory free"),
    "backend.concurrency": POSITIVE,
    "backend.timeout": (_number(0, open_low=True), "a number > 0"),
    "backend.max_retries": NON_NEGATIVE,
    "backend.backoff": (_number(0), "a number >= 0"),
    "backend.backoff_max": (_number(0), "a number >= 0"),
    "backend.port": ((lambda v: _int(1)(v) and v < 65536), "a port number in [1, 65535]"),
    "backend.health_timeout": (_number(0, open_low=True), "a number > 0"),
    "extract.dtype": _one_of(*STORAGE_DTYPES),
    "extract.max_length": POSITIVE,
    "extract.batch_tokens": POSITIVE,
    "extract.part_bytes": POSITIVE,
    "merge.val_fraction": ((lambda v: _number(0, 1)(v) and v < 1), "a number in [0, 1)"),
    "merge.min_tokens": POSITIVE,
    "merge.max_tokens": POSITIVE,
    "merge.draft_vocab_size": POSITIVE,
    "train.ttt_steps": POSITIVE,
    "train.step_decay": (_number(0, 1, open_low=True), "a number in (0, 1]"),
    "train.loss_normalisation": _one_of("token", "sequence"),
    "train.optimizer": _one_of("adamw", "muon"),
    "train.lr": (_number(0, open_low=True), "a number > 0"),
    "train.min_lr_ratio": FRACTION,
    "train.warmup_fraction": ((lambda v: _number(0, 1)(v) and v < 1), "a number in [0, 1)"),
    "train.weight_decay": (_number(0), "a number >= 0"),
    "train.epochs": POSITIVE,
    "train.max_steps": (_int(0), "an integer >= 0 (0: run the epochs)"),
    "train.batch_tokens": POSITIVE,
    "train.micro_batch_rows": POSITIVE,
    "train.pack_tokens": POSITIVE,
    "train.lm_head_init": _one_of("random", "verifier"),
    "train.freeze_lm_head": BOOL,
    "train.clip": (_number(0, open_low=True), "a number > 0"),
    "train.log_every": POSITIVE,
    "train.val_every": POSITIVE,
    "train.checkpoint_every": POSITIVE,
    "train.fsdp": BOOL,
    "train.num_workers": NON_NEGATIVE,
    "train.compile": _one_of("auto", True, False),
    "evaluate.draft_tokens": POSITIVE,
    "evaluate.batch_sizes": ((lambda v: isinstance(v, list) and bool(v) and all(_int(1)(x) for x in v)),
                             "a non-empty list of integers >= 1"),
    "evaluate.repeats": POSITIVE,
    "evaluate.cuda_graphs": BOOL,
    "evaluate.timed_prompts": ((lambda v: v is None or _int(1)(v)), "an integer >= 1, or null for all"),
    "evaluate.chain_sweep": ((lambda v: isinstance(v, list) and all(_int(1)(x) for x in v)), "a list of integers >= 1 (chain K)"),
    "evaluate.max_new_tokens": POSITIVE,
    "evaluate.timed_new_tokens": ((lambda v: v is None or _int(1)(v)), "an integer >= 1, or null for max_new_tokens"),
    "evaluate.position_buckets": ((lambda v: isinstance(v, list) and all(_int(1)(x) for x in v) and v == sorted(set(v))),
                                  "a list of increasing integers >= 1 (answer positions)"),
    "evaluate.max_prompts": ((lambda v: v is None or _int(1)(v)), "an integer >= 1, or null for all"),
    "evaluate.baseline": BOOL,
}


def _get(params: DictConfig, key: str) -> Any:
    value = OmegaConf.select(params, key, default=_ABSENT)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value


def refuse(key: str, value: Any, allowed: str) -> UserError:
    """The one-line error of a params value: its key, the value and what is allowed."""
    return UserError(f"params.yaml: {key} = {value!r}: must be {allowed}")


def validate(params: DictConfig) -> None:
    """Reject values and combinations that would fail hours later: one line with key, value, what is allowed.

    Checks only the keys present, so a stage validates exactly the keys it declares.
    """
    for key, (ok, allowed) in CHECKS.items():
        value = _get(params, key)
        if value is not _ABSENT and not ok(value):
            raise refuse(key, value, allowed)
    for check in (_check_shards, _check_sources, _check_eval_sets, _check_tree, _check_model, _check_relations):
        check(params)


def _check_shards(params: DictConfig) -> None:
    shards = _get(params, "dataset.shards")
    if shards is _ABSENT:
        return
    if not isinstance(shards, list) or not shards:
        raise refuse("dataset.shards", shards, "a non-empty list of ranges 'SSSSSS-EEEEEE'")
    ranges = [shard_range(s) for s in shards]
    if ranges[0][0] != 0:
        raise refuse("dataset.shards", shards, "contiguous ranges starting at 000000")
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if start != stop:
            raise refuse("dataset.shards", shards, f"contiguous ranges (one ends at {stop:06d}, the next starts at {start:06d})")


def _check_sources(params: DictConfig) -> None:
    sources, extra = _get(params, "dataset.sources"), _get(params, "dataset.extra_sources")
    if sources is not _ABSENT and (not isinstance(sources, list) or not sources):
        raise refuse("dataset.sources", sources, "a non-empty list of {kind: ...} entries")
    if extra is not _ABSENT and not isinstance(extra, list):
        raise refuse("dataset.extra_sources", extra, "a list of {kind: ...} entries (a preset's sources), [] for none")
    for key, entries in (("dataset.sources", sources), ("dataset.extra_sources", extra)):
        for index, spec in enumerate(entries if isinstance(entries, list) else []):
            _check_source(f"{key}[{index}]", spec)


def _check_source(key: str, spec: Any) -> None:
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in SOURCE_KINDS:
        raise refuse(f"{key}.kind", kind, f"one of {list(SOURCE_KINDS)}")
    known = ("kind", "label", "weight", *SOURCE_KEYS[kind])
    for name in spec:
        if name not in known:
            nearest = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {key}.{nearest[0]}?" if nearest else f"a {kind} source has {list(known)}"
            raise UserError(f"params.yaml: {key}.{name}: unknown key ({hint})")
    if kind in ("jsonl", "parquet") and not spec.get("path"):
        raise refuse(f"{key}.path", spec.get("path"), f"the path of the {kind} file")
    if kind == "sharegpt" and not (spec.get("path") or (spec.get("package") and spec.get("file"))):
        raise refuse(key, spec, "a sharegpt source with a `path`, or a `package` and its `file`")
    if kind == "hf" and not spec.get("name"):
        raise refuse(f"{key}.name", spec.get("name"), "a HF dataset name")


def _check_eval_sets(params: DictConfig) -> None:
    """Counts per eval set (which sets exist, the prompts stage knows), and sets of those to evaluate."""
    sets = _get(params, "dataset.eval_sets")
    counts = [n.get("prompts") if isinstance(n, dict) else n for n in sets.values()] if isinstance(sets, dict) else None
    if sets is not _ABSENT and (counts is None or not all(_int(0)(n) for n in counts)):
        raise refuse("dataset.eval_sets", sets, "a mapping of eval set names to prompt counts >= 0 (or to "
                     "{prompts: n, kind: ..., ...})")
    chosen = _get(params, "evaluate.sets")
    if chosen is not _ABSENT and (not isinstance(chosen, list) or not chosen):
        raise refuse("evaluate.sets", chosen, "a non-empty list of eval set names")
    if _ABSENT not in (sets, chosen) and set(chosen) - set(sets):
        raise refuse("evaluate.sets", chosen, f"sets that dataset.eval_sets builds ({sorted(sets)})")



TREE_KEYS = ("num_steps", "topk", "num_draft_tokens")


def tree_shape_problem(num_steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """Why SGLang's tree expansion cannot fill this draft tree, or None when it can."""
    most = topk + (num_steps - 1) * topk**2  # nodes the expansion produces
    if min(num_steps, topk) < 1:
        return f"num_steps and topk must be >= 1, got {num_steps} and {topk}"
    if not 2 <= num_draft_tokens <= most + 1:
        return (f"num_draft_tokens must be in 2..{most + 1} (1 + the {most} nodes of {num_steps} steps of "
                f"top-{topk}), got {num_draft_tokens}")
    return None


def _check_tree(params: DictConfig) -> None:
    """evaluate.tree: null, or a shape SGLang's tree expansion can fill (refused here, not after training)."""
    tree = _get(params, "evaluate.tree")
    if tree is _ABSENT or tree is None:
        return
    if not isinstance(tree, dict) or set(tree) != set(TREE_KEYS) or not all(_int(0)(tree[key]) for key in TREE_KEYS):
        raise refuse("evaluate.tree", tree, "null, or integers num_steps, topk and num_draft_tokens")
    problem = tree_shape_problem(*(tree[key] for key in TREE_KEYS))
    if problem:
        raise UserError(f"params.yaml: evaluate.tree: {problem}")


def _check_model(params: DictConfig) -> None:
    """The model keys' types here; the verifier spec applies its rules (the taps within model.num_layers
    when the view has it, the final state; extract checks the taps against the verifier's own layers)."""
    layers = _get(params, "model.aux_layers")
    if layers is not _ABSENT and (not isinstance(layers, list) or not all(_int(0)(k) for k in layers)):
        raise refuse("model.aux_layers", layers, "a list of layer ids")
    if "model" in params:
        VerifierSpec.from_params(params.model).check_taps()


def batch_share_problem(batch_tokens: int, pack_tokens: int, processes: int, counted_by: str) -> str | None:
    """What train.batch_tokens must be so that ``processes`` training processes (their count as
    ``counted_by`` sets it) take equal shares of whole packed rows of the global batch, or None when
    they do. ``validate`` checks the layout's count, ``train`` the count torchrun started.

    Worked example: batch_tokens 6144, pack_tokens 2048 make 3 rows a step: None for 1 or 3
    processes; for 2, "a multiple of 4096: ... it makes 3 rows a step, which they cannot share
    evenly ..."; for 8, "a multiple of 16384: ... it makes 3 rows a step, fewer than the processes ...".
    """
    rows = batch_tokens // pack_tokens  # a whole number: checked before
    if rows % processes == 0:
        return None
    share = "fewer than the processes" if rows < processes else "which they cannot share evenly"
    return (f"a multiple of {processes * pack_tokens}: whole packed rows of train.pack_tokens ({pack_tokens}) for each of the "
            f"{processes} training processes ({counted_by}); it makes {rows} row{'s' * (rows != 1)} a step, {share}; "
            "the layout cuts the recipe's global batch, it never changes it")

def _check_relations(params: DictConfig) -> None:
    device, dtype = _get(params, "layout.device"), _get(params, "layout.dtype")
    if device == "cpu" and dtype not in (_ABSENT, "float32"):
        raise refuse("layout.dtype", dtype, "float32 on the CPU (bf16 is several times slower there)")
    context, new = _get(params, "model.max_position_embeddings"), _get(params, "generate.max_new_tokens")
    if _ABSENT not in (context, new) and context <= new:
        raise refuse("generate.max_new_tokens", new, f"smaller than model.max_position_embeddings ({context}), the verifier's context")
    _check_sample_temperatures(params)
    low, high = _get(params, "merge.min_tokens"), _get(params, "merge.max_tokens")
    if _ABSENT not in (low, high) and high < low:
        raise refuse("merge.max_tokens", high, f">= merge.min_tokens ({low})")
    batch, row = _get(params, "train.batch_tokens"), _get(params, "train.pack_tokens")
    if _ABSENT not in (batch, row) and batch % row:
        raise refuse("train.batch_tokens", batch, f"a multiple of train.pack_tokens ({row}): the global batch is whole packed rows")
    procs, nodes = _get(params, "layout.train_procs"), _get(params, "layout.nnodes")
    if _ABSENT not in (batch, row, procs, nodes):
        problem = batch_share_problem(batch, row, procs * nodes, "layout.train_procs x layout.nnodes")
        if problem:
            raise refuse("train.batch_tokens", batch, problem)
    if _get(params, "train.optimizer") == "muon" and _get(params, "train.fsdp") is True:
        raise refuse("train.optimizer", "muon", "adamw with train.fsdp (Muon orthogonalises whole matrices, FSDP shards them)")
    if _get(params, "train.freeze_lm_head") is True and _get(params, "train.lm_head_init") != "verifier":
        raise refuse("train.freeze_lm_head", True, "false unless train.lm_head_init is verifier (it keeps the lm_head at its start)")


def _check_sample_temperatures(params: DictConfig) -> None:
    """At most one answer to a prompt is greedy: greedy decoding gives one answer, so another is its copy."""
    samples, first = _get(params, "generate.samples"), _get(params, "generate.temperature")
    others = _get(params, "generate.sample_temperatures")
    if _ABSENT in (samples, first, others):
        return
    temperatures = [first] + [others[(k - 1) % len(others)] for k in range(1, samples)]
    greedy = [k for k, t in enumerate(temperatures) if t == 0]
    if len(greedy) > 1:
        raise refuse("generate.sample_temperatures", others,
                     f"free of 0 for the {samples} answers of generate.samples: answers {greedy} would be at temperature 0 "
                     "(answer 0 at generate.temperature), one greedy answer repeated")
