"""`pagedllm serve --config FILE`: serve's options from a TOML file, the command line winning.

Each key is a long option without its dashes (`max-num-seqs = 8`; `max_num_seqs` works too),
turned into the same words the command line would give and parsed by the same parser, so
a file value is checked, converted and defaulted exactly like a flag. `--print-config`
writes the options in effect in the same form, so a file round-trips.
"""
from __future__ import annotations

import argparse
import tomllib

from pagedllm.units import byte_text

# Options that are about this invocation, not the server's settings.
NOT_IN_FILE = {"help", "config", "print_config", "func", "command"}


class ConfigFileError(ValueError):
    pass


def file_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options a config file may set, by their long name without dashes."""
    options, dests = {}, set()
    for action in parser._actions:  # argparse has no public list of a parser's options
        longs = [s for s in action.option_strings if s.startswith("--")]
        # An alias of an option already listed (--enforce-eager of --cuda-graphs) is not a
        # key of its own: the file says the value once.
        if longs and action.dest not in NOT_IN_FILE and action.dest not in dests:
            options[longs[0][2:]] = action
            dests.add(action.dest)
    return options


def config_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The file's settings as command-line words for `parser`."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from exc
    table = table.get("serve", table)  # a [serve] table, or the options at the top level
    options = file_options(parser)
    argv = []
    for key, value in table.items():
        if key == "models" and isinstance(value, dict):
            continue  # the model store's entries: models_table()
        name = key.replace("_", "-")
        action = options.get(name)
        if action is None:
            raise ConfigFileError(f"{path}: unknown option {key!r}; known: {', '.join(sorted(options))}")
        flag = "--" + name
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            if not isinstance(value, bool):
                raise ConfigFileError(f"{path}: {key} is true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv += [flag if value else "--no-" + name]
            else:
                argv += [flag] if value else []
        elif isinstance(value, (dict, bool)) or value is None:
            raise ConfigFileError(f"{path}: {key} takes a value like its command-line option, "
                                  f"got {value!r}")
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_with_config(parser: argparse.ArgumentParser, subparser: argparse.ArgumentParser,
                      argv: list[str]) -> argparse.Namespace:
    """Parse argv; when it names --config, the file's words go first so the command line's
    own options (later) win."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config")
    known, _ = probe.parse_known_args(argv[1:])
    if not known.config:
        return parser.parse_args(argv)
    try:
        from_file = config_argv(known.config, subparser)
    except ConfigFileError as exc:
        parser.exit(2, f"error: {exc}\n")
    return parser.parse_args(argv[:1] + from_file + argv[1:])


def to_toml(args: argparse.Namespace, parser: argparse.ArgumentParser,
            models: dict | None = None) -> str:
    """The options in effect as a config file: every option, defaults commented out; then a
    model store's [models] entries as the file gave them."""
    lines = ["# pagedllm serve --config FILE: one option a line; the command line wins.", ""]
    for name, action in file_options(parser).items():
        value = getattr(args, action.dest)
        prefix = "# " if value == action.default or value is None else ""
        if value is None:
            value = ""
        elif _is_size(action) and isinstance(value, int) and not isinstance(value, bool) \
                and not byte_text(value).isdigit():
            value = byte_text(value)  # "512MiB", not 536870912
        lines.append(f"{prefix}{name} = {_toml_value(value)}")
    for name, entry in (models or {}).items():
        entry = {"path": entry} if isinstance(entry, str) else entry
        lines += ["", f"[models.{_toml_key(name)}]"]
        lines += [f"{_toml_key(key)} = {_toml_value(value)}" for key, value in entry.items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    bare = key.replace("-", "").replace("_", "").isalnum()
    return key if bare else _toml_value(key)


def _is_size(action: argparse.Action) -> bool:
    from pagedllm.cli.options import memory_amount, size

    return action.type in (size, memory_amount)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def models_table(path: str) -> dict:
    """The file's [models] table (a model store's entries; serving/model_store.py reads
    them), or {} without one."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # config_argv has said why already
    models = table.get("models", table.get("serve", {}).get("models", {}))
    if not isinstance(models, dict):
        raise ConfigFileError(f"{path}: [models] is a table of NAME = {{ path = ... }} entries")
    return models
