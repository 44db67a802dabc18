"""The ``eagle3`` command: project tools that are not pipeline stages.

    eagle3 params [-S group=option ...]   compose params.yaml from conf/ (as `dvc exp run -S` does)
"""

from __future__ import annotations

import argparse

from eagle3.common import UserError, setup_logging


def _params(args: argparse.Namespace) -> None:
    from eagle3.config import compose_params

    compose_params(args.set_param, conf_dir=args.conf, output=args.output)
    print(f"composed {args.output}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    params = commands.add_parser("params", help="compose params.yaml from conf/")
    params.add_argument("-S", "--set-param", action="append", default=[], help="Hydra override, e.g. dataset=1k")
    params.add_argument("--conf", default="conf")
    params.add_argument("--output", default="params.yaml")
    params.set_defaults(func=_params)
    return parser


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as err:
        parser_exit = f"error: {err}"
        raise SystemExit(parser_exit) from None


if __name__ == "__main__":
    main()
