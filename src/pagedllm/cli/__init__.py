"""The `pagedllm` command line: serve | chat | generate | plan | bench | keys | install-service.

One module a concern: options.py (the help formatter, sizes, engine options), serve.py,
commands.py (the client-side commands), config_file.py (`serve --config`), keys.py,
service.py, main.py (the parser and main)."""
from pagedllm.cli.main import build_parser, main, parse_args
from pagedllm.cli.options import engine_config
from pagedllm.cli.serve import server_config

__all__ = ["build_parser", "engine_config", "main", "parse_args", "server_config"]
