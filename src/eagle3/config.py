"""Params composition and the checks no YAML schema can express.

``dvc exp run -S group=option`` composes ``conf/`` into ``params.yaml`` with Hydra; plain
``dvc repro`` reads the committed ``params.yaml``. ``eagle3 params -S ...`` composes it the same
way (through DVC's own function) without running anything.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from eagle3.common import UserError
from eagle3.verifier_spec import VerifierSpec

SHARD_NAME = re.compile(r"^(\d{6})-(\d{6})$")


def compose_params(overrides: list[str], conf_dir: str | Path = "conf", output: str | Path = "params.yaml") -> None:
    """Compose ``conf/config.yaml`` with Hydra overrides into ``output``, exactly as DVC does."""
    from hydra.errors import HydraException
    from dvc.utils.hydra import compose_and_dump

    conf_dir = Path(conf_dir).resolve()
    if not (conf_dir / "config.yaml").is_file():
        raise UserError(f"{conf_dir}/config.yaml: not found")
    try:
        compose_and_dump(Path(output), str(conf_dir), None, "config", str(conf_dir), list(overrides))
    except HydraException as err:
        first = str(err).strip().splitlines()[0]
        raise UserError(f"conf/: {first}") from None
    validate(OmegaConf.load(output))


def shard_range(name: str) -> tuple[int, int]:
    """``"000032-001000"`` -> ``(32, 1000)``: a shard is a range of the seeded prompt order."""
    match = SHARD_NAME.match(name)
    if not match or int(match[1]) >= int(match[2]):
        raise UserError(f"params.yaml: dataset.shards: {name!r} is not a range 'SSSSSS-EEEEEE' with start < end")
    return int(match[1]), int(match[2])


def validate(params: DictConfig) -> None:
    """Reject combinations that would fail hours later, naming the key to fix."""
    starts = [shard_range(s) for s in params.dataset.shards]
    for (_, stop), (start, _) in zip(starts, starts[1:]):
        if start != stop:
            raise UserError(f"params.yaml: dataset.shards must be contiguous; a shard ends at {stop}, the next starts at {start}")
    if starts[0][0] != 0:
        raise UserError("params.yaml: dataset.shards must start at 000000")
    VerifierSpec.from_params(params.model)  # taps within model.num_layers, a supported final state
    if params.layout.device == "cpu" and params.layout.dtype != "float32":
        raise UserError("params.yaml: layout.dtype must be float32 on the CPU (bf16 is several times slower there)")
