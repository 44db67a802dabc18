"""The ``eagle3`` command: project tools that are not pipeline stages.

    eagle3 params [-S group=option ...]   compose params.yaml from conf/ (as `dvc exp run -S` does)
    eagle3 check-drafter DIR [--verifier models/verifier] [--vocab FILE] [--rewrite-config]
                                          validate an exported drafter for SGLang and vLLM; exit 1 on faults
    eagle3 s3 serve|status|stop           local S3 server for the DVC remote (rclone serve s3)
    eagle3 push [-r REMOTE] [-a] [-T] [-A] `dvc push`, once every object it sends matches its hash
    eagle3 gc [--rev REV ...] [--dry-run] `dvc gc -w`, only once every kept revision is in the remote
    eagle3 report [REV ...] [--out report] dvc.yaml's plots as HTML and PNG files that need no network
"""

from __future__ import annotations

import argparse
import sys

from eagle3 import report
from eagle3.common import INTERRUPTED, UserError, check_lock_file, naming_params_file
from eagle3.lifecycle import gc, push, s3
from eagle3.runner import setup_logging


def _params(args: argparse.Namespace) -> None:
    from eagle3.config import compose_params

    compose_params(args.set_param, conf_dir=args.conf, output=args.output)
    print(f"composed {args.output}")


def _check_drafter(args: argparse.Namespace) -> None:
    from eagle3.drafter.export import check_drafter
    from eagle3.drafter.tools import rewrite_config, speculators_command, vocab_problems

    if args.rewrite_config:
        print(f"wrote {rewrite_config(args.folder, args.verifier)}")
    problems = check_drafter(args.folder, args.verifier)
    problems += [] if problems else vocab_problems(args.folder, args.verifier, args.vocab)
    for problem in problems:
        print(f"{args.folder}: {problem}")
    if problems:
        raise SystemExit(1)
    print(f"{args.folder}: ok")
    print(f"for speculators (it ignores config.json's taps): {speculators_command(args.folder, args.verifier)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    params = commands.add_parser("params", help="compose params.yaml from conf/")
    params.add_argument("-S", "--set-param", action="append", default=[], help="Hydra override, e.g. dataset=1k")
    params.add_argument("--conf", default="conf")
    params.add_argument("--output", default="params.yaml")
    params.set_defaults(func=_params)
    check = commands.add_parser("check-drafter", help="validate an exported drafter for SGLang/vLLM")
    check.add_argument("folder", help="exported drafter folder, e.g. models/drafter")
    check.add_argument("--verifier", help="verifier folder to check sizes, context, fingerprint and tokens against")
    check.add_argument("--vocab", help="merge's vocabulary file (data/merged/vocab.safetensors) the drafter's d2t/t2d must equal")
    check.add_argument("--rewrite-config", action="store_true",
                       help="first rewrite config.json from meta.json's taps and the verifier's token ids (exports of older versions)")
    check.set_defaults(func=_check_drafter)
    s3.add_parser(commands)
    push.add_parser(commands)
    gc.add_parser(commands)
    report.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        check_lock_file()  # every command: the damage a kill of DVC leaves stops every dvc command too
        args.func(args)
    except UserError as err:
        parser_exit = f"error: {naming_params_file(str(err), getattr(args, 'output', None))}"  # eagle3 params --output
        raise SystemExit(parser_exit) from None
    except KeyboardInterrupt:
        print(f"eagle3 {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None


if __name__ == "__main__":
    main()
