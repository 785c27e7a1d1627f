"""The `pagedllm` command: its parser (one subcommand a module) and main()."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm.cli.commands import add_client_commands
from pagedllm.cli.config_file import parse_with_config, to_toml
from pagedllm.cli.keys import add_keys
from pagedllm.cli.options import HelpFormatter
from pagedllm.cli.serve import add_serve_args
from pagedllm.cli.service import add_install_service


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", formatter_class=HelpFormatter,
                                     description="An LLM inference server for a team sharing one machine.")
    parser.add_argument("--version", action="version", version=f"pagedllm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI- and Ollama-compatible HTTP server",
                           formatter_class=HelpFormatter)
    add_serve_args(serve)
    add_client_commands(sub, HelpFormatter)
    add_keys(sub, HelpFormatter)
    add_install_service(sub, HelpFormatter)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedllm")
    except PackageNotFoundError:
        return "unknown (not installed)"


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        args = parse_with_config(parser, subparser(parser, "serve"), argv)
    else:
        args = parser.parse_args(argv)
    return args


def _quiet_noisy_loggers(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "print_config", False):
        from pagedllm.cli.config_file import models_table

        models = models_table(args.config) if args.config else {}
        print(to_toml(args, subparser(build_parser(), "serve"), models), end="")
        return 0
    _quiet_noisy_loggers(getattr(args, "log_level", "info"))
    from pagedllm.kernels import UnsupportedISAError, capabilities

    try:
        capabilities()  # a bad PAGEDLLM_CPU_ISA is refused here, before any loading
    except UnsupportedISAError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`pagedllm plan --json | head`): not an error. Point stdout at
        # /dev/null so Python's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
