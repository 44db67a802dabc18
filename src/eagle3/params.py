"""Stage ``params``: the whole params.yaml validated before DVC removes any stage's outputs.

    python -m eagle3.params data/params.ok --conf conf --sources data/sources

``dvc exp run -S key=value`` writes the value into params.yaml and then, stage by stage, deletes
the outputs of a stage whose params changed before running it; a stage that then refused the
value left neither its old outputs nor new ones. This stage declares every section of params.yaml,
so any change runs it first (``verifier``, and through it every stage, depends on its output),
and a bad value stops the run here, before anything is removed. It checks what can be checked
without running a stage: every key is one that conf/ declares (a misspelt ``train.lrr`` or a
``+key`` no code reads is refused, not recorded in dvc.lock) and every key the chosen options
compose is there (a ``~train.lr``), every value (finite ones), the verifier source (its kind, and
the package file or folder it names), the layout's device on this machine (CUDA where there is
none), and the prompt sources' paths and weights. Its output's bytes are the same
for every valid params.yaml, so a valid change reruns only the stages that declare the key.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.params")

import argparse
from functools import partial
from pathlib import Path

from eagle3.common import UserError
from eagle3.config import SCHEMAS, check_conf_keys
from eagle3.prompt_sources.names import configured_sources
from eagle3.prompt_sources.sources import check_local_sources, source_weights
from eagle3.settings import StageParams, section, stage_params
from eagle3.verifier_sources.check import require_source

PARAMS = StageParams("seed", *map(section, SCHEMAS))  # = dvc.yaml: every section
VALID = "params.yaml: valid (checked by the params stage: python -m eagle3.params)\n"
RESTORE = "nothing was run or removed: correct it, or restore the committed params with `git checkout params.yaml`"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.params", description="validate params.yaml as a whole")
    parser.add_argument("out", type=Path, help="the stage's constant output, e.g. data/params.ok")
    parser.add_argument("--conf", type=Path, required=True, help="the Hydra config folder, the schema of the keys, e.g. conf")
    parser.add_argument("--sources", type=Path, required=True, help="the folder of local prompt files, e.g. data/sources")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        conf_keys = partial(check_conf_keys, conf_dir=args.conf, name=Path(args.params).name)
        params = stage_params(PARAMS, args.params, whole=conf_keys)  # every key, value and this machine's device
        require_source(params.model.source)
        sources = configured_sources(params.dataset)
        check_local_sources(sources, args.sources)
        source_weights(sources)
    except UserError as err:
        raise UserError(f"{err}; {RESTORE}") from None
    if not args.out.is_file() or args.out.read_text() != VALID:  # persistent: DVC leaves it, rewritten only if damaged
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(VALID)
