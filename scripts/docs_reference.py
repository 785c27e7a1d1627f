"""The docs' reference pages, generated from the code so they cannot go stale:
docs/reference/options.md from the command line's argument parsers (every option of serve,
plan, bench, keys, chat, generate and install-service: its default, what it does, its key in
a `serve --config` file), docs/reference/metrics.md from the server's Prometheus registry
(every metric, its type and meaning).

    .venv/bin/python scripts/docs_reference.py          # write the pages
    .venv/bin/python scripts/docs_reference.py --check  # exit 1 where a page is not current
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PAGES = {"options": os.path.join(ROOT, "docs", "reference", "options.md"),
         "metrics": os.path.join(ROOT, "docs", "reference", "metrics.md")}
COMMANDS = ("serve", "plan", "bench", "chat", "generate", "keys", "install-service")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(
            action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    if isinstance(action.default, str) and action.default.startswith(os.path.expanduser("~")):
        return "`~" + action.default[len(os.path.expanduser("~")):] + "`"
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse formats every help text with %
        text = text % {**vars(action), "prog": "pagedllm"}
    if action.choices and not isinstance(action.choices, dict):
        text += f" (one of: {', '.join(str(c) for c in action.choices)})"
    return _cell(text)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public list of subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _table(parser: argparse.ArgumentParser, config_keys: dict | None) -> list[str]:
    head = "| option | default | what it does |" + (" config key |" if config_keys else "")
    rows = [head, "|---|---|---|" + ("---|" if config_keys else "")]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        row = f"| {names} | {_default(action)} | {_help(action)} |"
        if config_keys is not None:
            key = next((k for k, a in config_keys.items() if a is action), None)
            row += f" `{key}` |" if key else " |"
        rows.append(row)
    return rows


def options_page() -> str:
    from pagedllm.cli.config_file import file_options
    from pagedllm.cli.main import build_parser

    commands = _subcommands(build_parser())
    lines = ["# Command-line options", "",
             "Generated from the argument parsers by `scripts/docs_reference.py` (a test fails "
             "when this page and the parsers disagree). `pagedllm serve --config FILE` reads "
             "the same options from a TOML file: each key is the long option without its "
             "dashes (`max-num-seqs = 8`), the command line winning; `--print-config` writes "
             "the options in effect in that form.", ""]
    for name in COMMANDS:
        parser = commands[name]
        lines += [f"## pagedllm {name}", "", _cell(parser.description or
                                                  _help_of(build_parser(), name)), ""]
        subs = _subcommands(parser)
        lines += _table(parser, file_options(parser) if name == "serve" else None) + [""]
        for sub_name, sub in subs.items():
            lines += [f"### pagedllm {name} {sub_name}", ""]
            lines += _table(sub, None) + [""]
    return "\n".join(lines)


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def metrics_page() -> str:
    from pagedllm.server.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: [], "MODEL")
    metrics.describe_start("pagedllm serve")
    lines = ["# Metrics", "",
             "Every metric `GET /metrics` serves (Prometheus text format), generated from the "
             "server's registry by `scripts/docs_reference.py` (a test fails when this page "
             "and the registry disagree). Engine figures are read from the engine at scrape "
             "time; request figures are counted as requests finish. `model_name` labels "
             "every series (with a model store, each loaded model has its own); per-user "
             "series appear once API keys are on.", "",
             "| metric | type | meaning |", "|---|---|---|"]
    seen = set()
    for family in metrics.registry.collect():
        if family.name in seen:
            continue
        seen.add(family.name)
        kind = family.type + ("" if family.type != "counter" else " (`_total`)")
        lines.append(f"| `{family.name}` | {kind} | {_cell(family.documentation)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 (naming the page) where a page is not what it would be")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    os.environ.pop("PAGEDLLM_KEY_FILE", None)  # defaults as a fresh shell has them
    pages = {"options": options_page() + "\n", "metrics": metrics_page()}
    stale = []
    for name, text in pages.items():
        path = PAGES[name]
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if current == text:
            continue
        if args.check:
            stale.append(os.path.relpath(path, ROOT))
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path, ROOT)}")
    if stale:
        print(f"not current: {', '.join(stale)}; run scripts/docs_reference.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
