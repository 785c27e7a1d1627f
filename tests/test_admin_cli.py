"""The admin's command line: help with defaults everywhere, one size parser, plan and serve
agreeing, the config file, `keys`, `install-service`, no traceback into a closed pipe."""
from __future__ import annotations

import argparse
import configparser
import json
import os
import stat
import subprocess
import sys

import pytest

from pagedllm.cli import build_parser, engine_config, server_config
from pagedllm.cli.config_file import file_options, to_toml
from pagedllm.cli.main import parse_args, subparser

COMMANDS = ("serve", "chat", "plan", "bench", "generate", "keys", "install-service")


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_that_states_its_default(command):
    parser = subparser(build_parser(), command)
    text = "".join(parser.format_help().split())  # argparse wraps lines, even at hyphens
    for action in _options(parser):
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        if action.default not in (None, False, ""):
            shown = f"(default:{action.default})".replace(" ", "")
            assert shown in text, f"{command} {action.option_strings[0]}: {shown} not in its help"
        elif action.default in (None, ""):
            # None means something ("the model's context", "none"): the help must say what.
            assert "default" in action.help.lower() or "$" in action.help \
                or action.dest in ("config",), f"{command} {action.option_strings[0]} hides its default"


def test_chat_help_says_engine_options_are_in_process_only():
    text = subparser(build_parser(), "chat").format_help()
    assert "ignored with --url" in text


@pytest.mark.parametrize("argv, field, expected", [
    (["serve", "--kv-cache-memory", "64MiB"], "kv_cache_memory", 64 << 20),
    (["serve", "--kv-cache-memory", "0.25"], "kv_cache_memory", 0.25),
    (["serve", "--kv-cache-memory", "100000000"], "kv_cache_memory", 100_000_000),
    (["serve", "--max-memory", "2GiB"], "max_memory", 2 << 30),
    (["serve", "--max-body-bytes", "1MiB"], "max_body_bytes", 1 << 20),
    (["plan", "--memory", "8GiB"], "memory", 8 << 30),
    (["plan", "--memory", "2GB"], "memory", 2 * 10**9),
])
def test_size_strings_are_accepted_by_every_byte_option(argv, field, expected):
    assert getattr(build_parser().parse_args(argv), field) == expected


@pytest.mark.parametrize("argv", [
    ["serve", "--kv-cache-memory", "lots"], ["serve", "--max-memory", "-1"],
    ["serve", "--max-body-bytes", "0"], ["plan", "--memory", "8 potatoes"],
    ["serve", "--block-size", "0"], ["serve", "--threads", "0"], ["serve", "--dtype", "int4"],
])
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert argv[-1] in capsys.readouterr().err


def test_plan_and_serve_agree_byte_for_byte_on_the_default_model():
    from pagedllm.engine.engine import LLMEngine
    from pagedllm.tools.plan import make_plan

    serve = build_parser().parse_args(["serve", "--kv-cache-memory", "8MiB"])
    plan_args = build_parser().parse_args(["plan"])
    assert plan_args.dtype == serve.dtype and plan_args.kv_cache_dtype == serve.kv_cache_dtype
    assert plan_args.block_size == serve.block_size
    plan = make_plan(None, dtype=plan_args.dtype, context=2048, parallels=[1], memory=8 << 30,
                     kv_cache_dtype=plan_args.kv_cache_dtype, block_size=plan_args.block_size)
    engine = LLMEngine(engine_config(serve))
    cache = engine.cache_config
    # What the engine really allocated, per token of its pool.
    allocated = sum(t.numel() * t.element_size() for layer in engine.runner.kv_caches
                    for t in layer if t is not None)
    assert allocated == plan.kv_bytes_per_token * cache.num_blocks * cache.block_size


def test_plan_refuses_a_context_past_the_model(capsys):
    from pagedllm.cli import main

    assert main(["plan", "--context", "100000"]) == 2
    err = capsys.readouterr().err
    assert "100000" in err and "8192" in err


def test_plan_json_into_a_closed_pipe_exits_0():
    done = subprocess.run(f"set -o pipefail; {sys.executable} -m pagedllm.cli plan --json | head -1",
                          shell=True, executable="/bin/bash", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{" and "Traceback" not in done.stderr


# -- config file ----------------------------------------------------------------------------

# A value for every serve option that differs from its default (so a dropped option shows).
NON_DEFAULTS = {
    "model": "/models/x.gguf", "dtype": "float32", "exact-activations": True,
    "int8-activations": True,
    "kv-cache-dtype": "int8", "block-size": 32, "max-num-seqs": "6",
    "max-num-batched-tokens": 512, "kv-cache-memory": "64MiB", "max-model-len": 4096,
    "no-prefix-caching": True, "max-memory": "3GiB", "threads": 1, "speculative": "ngram",
    "num-speculative-tokens": 3, "draft-model": "/models/draft.gguf", "device": "cpu", "host": "0.0.0.0",
    "port": 9001, "served-model-name": "team-model", "model-alias": "gpt-4o-mini,claude-*",
    "embedding-model": "all-minilm", "replicas-per-node": 1,
    "log-level": "debug", "max-prompts-per-request": 32,
    "shutdown-grace": 5.5, "max-body-bytes": "2MiB", "header-timeout": 3.0,
    "max-connections-per-client": 7, "ssl-certfile": "/etc/c.pem", "ssl-keyfile": "/etc/k.pem",
    "api-key-file": "/etc/keys.txt", "insecure-no-auth": True, "public-metrics": True,
    "shared-prefix-cache": True, "allowed-origins": "http://a.example,http://b.example",
    "max-queue": 9, "max-prompt-tokens": 1000, "max-tokens-limit": 500, "request-timeout": 12.5,
    "bench-results": "/srv/bench", "reasoning-parser": "deepseek_r1", "reasoning-budget": 64,
    "chat-template": "/srv/template.jinja", "tool-call-parser": "mistral", "replicas": 3, "ray-address": "10.0.0.1:6379",
    "threads-per-replica": 1, "router": "pow2", "models-dir": "/srv/models",
    "max-loaded-models": 2, "keep-alive": "10m", "embedding-dtype": "float32",
    "pooling": "mean", "gpu-memory-utilization": 0.8, "cuda-graphs": True, "overlap-steps": True, "gpu-4bit-weights": True,
    "gpu-fp8-weights": True,
    "engine-process": True, "engine-stall-timeout": 12.5, "insecure-ray-cluster": True,
    "lora": "sql=/srv/sql-lora,tone=/srv/tone.gguf", "enable-lora": True, "max-loras": 2,
    "max-lora-rank": 64,
}


def _toml(table: dict) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return repr(v) if isinstance(v, (int, float)) else f'"{v}"'
    return "".join(f"{k} = {value(v)}\n" for k, v in table.items())


def _as_argv(table: dict) -> list[str]:
    argv = []
    for key, v in table.items():
        argv += [f"--{key}"] if v is True else [f"--{key}", str(v)]
    return argv


def test_the_table_covers_every_serve_option():
    assert set(file_options(subparser(build_parser(), "serve"))) == set(NON_DEFAULTS)


def test_config_file_sets_every_option_as_the_command_line_would(tmp_path):
    path = tmp_path / "pagedllm.toml"
    path.write_text(_toml(NON_DEFAULTS))
    from_file = vars(parse_args(["serve", "--config", str(path)]))
    from_cli = vars(parse_args(["serve", *_as_argv(NON_DEFAULTS)]))
    from_file.pop("config")
    from_cli.pop("config")
    assert from_file == from_cli


def test_a_models_table_is_the_stores_not_an_option(tmp_path):
    from pagedllm.cli.config_file import models_table

    path = tmp_path / "pagedllm.toml"
    path.write_text('max-loaded-models = 2\n[models.chat]\npath = "chat.gguf"\n'
                    'max-model-len = 2048\n[models.coder]\npath = "coder"\n')
    args = parse_args(["serve", "--config", str(path)])
    assert args.max_loaded_models == 2
    assert models_table(str(path)) == {"chat": {"path": "chat.gguf", "max-model-len": 2048},
                                       "coder": {"path": "coder"}}
    assert models_table(str(tmp_path / "missing.toml")) == {}


def test_print_config_keeps_the_models_table(tmp_path, capsys):
    from pagedllm.cli.config_file import models_table
    from pagedllm.cli.main import main

    path = tmp_path / "pagedllm.toml"
    path.write_text('max-loaded-models = 2\n[models.chat]\npath = "chat.gguf"\n'
                    'max-model-len = 2048\naliases = ["gpt-4o-mini", "x \\"y\\""]\n'
                    '[models."odd name"]\npath = "coder"\n')
    assert main(["serve", "--config", str(path), "--print-config"]) == 0
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(capsys.readouterr().out)
    assert models_table(str(dumped)) == models_table(str(path))
    assert parse_args(["serve", "--config", str(dumped)]).max_loaded_models == 2


def test_print_config_round_trips(tmp_path):
    args = parse_args(["serve", *_as_argv(NON_DEFAULTS)])
    path = tmp_path / "dumped.toml"
    path.write_text(to_toml(args, subparser(build_parser(), "serve")))
    again = parse_args(["serve", "--config", str(path)])
    assert server_config(again) == server_config(args)
    for name, action in file_options(subparser(build_parser(), "serve")).items():
        assert getattr(again, action.dest) == getattr(args, action.dest), name
    defaults = to_toml(parse_args(["serve"]), subparser(build_parser(), "serve"))
    assert "# port = 8000" in defaults  # defaults are written commented out


def test_command_line_wins_over_the_file(tmp_path):
    path = tmp_path / "pagedllm.toml"
    path.write_text('[serve]\nport = 9000\nmax_queue = 4\n')  # a [serve] table, underscores
    args = parse_args(["serve", "--config", str(path), "--port", "9100"])
    assert (args.port, args.max_queue) == (9100, 4)


@pytest.mark.parametrize("text, message", [
    ("prot = 8000\n", "unknown option 'prot'"),
    ("port = \"eighty\"\n", "invalid int value"),
    ("insecure-no-auth = \"yes\"\n", "is true or false"),
    ("port = 80\nport = 81\n", "not valid TOML"),
    ("max-queue = { a = 1 }\n", "takes a value"),
])
def test_bad_config_files_are_refused_with_the_reason(tmp_path, text, message, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve", "--config", str(path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(tmp_path / "nope.toml")])
    assert "cannot read config file" in capsys.readouterr().err


def test_the_documented_example_config_loads():
    example = os.path.join(os.path.dirname(__file__), "..", "docs", "pagedllm.toml")
    args = parse_args(["serve", "--config", example])
    assert server_config(args).host == "127.0.0.1"


# -- keys -----------------------------------------------------------------------------------

def _keys(path, *argv):
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", "keys", "--file", str(path), *argv],
                          capture_output=True, text=True, timeout=60)


def test_keys_add_list_revoke(tmp_path):
    from pagedllm.server.auth import parse_key_file

    path = tmp_path / "keys.txt"
    added = _keys(path, "add", "alice", "--weight", "2", "--tokens-per-minute", "5000")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[1]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert _keys(path, "add", "bob", "--admin").returncode == 0
    [alice, bob] = parse_key_file(str(path))
    assert (alice.name, alice.key, alice.weight, alice.tokens_per_minute) == ("alice", key, 2.0, 5000)
    assert bob.admin and not alice.admin
    listed = _keys(path, "list")
    assert "alice\tweight=2 tokens_per_minute=5000" in listed.stdout
    assert "bob\tweight=1 admin=yes" in listed.stdout
    assert key not in listed.stdout  # keys are shown once, when made
    again = _keys(path, "add", "alice")
    assert again.returncode == 2 and "already has a key named alice" in again.stderr
    assert _keys(path, "revoke", "alice").returncode == 0
    assert [k.name for k in parse_key_file(str(path))] == ["bob"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    gone = _keys(path, "revoke", "alice")
    assert gone.returncode == 2 and "no key named alice" in gone.stderr
    # The last key, with a server reading the file: refused (it would keep its old keys).
    server = subprocess.Popen(["/bin/bash", "-c", "trap '' HUP; sleep 60; true  # pagedllm",
                               "serve", "--api-key-file", str(path)])
    try:
        last = _keys(path, "revoke", "bob")
        assert last.returncode == 2 and "last key" in last.stderr
        assert f"running server(s) {server.pid}" in last.stderr
    finally:
        server.kill()
        server.wait()
    # With none: done, saying what a server would make of the empty file.
    last = _keys(path, "revoke", "bob")
    assert last.returncode == 0 and "holds no keys now" in last.stdout, last.stderr
    assert "no running server reads this file" in last.stdout
    # An empty file (made by hand, or emptied so) takes a first key.
    assert _keys(path, "add", "carol").returncode == 0
    assert [k.name for k in parse_key_file(str(path))] == ["carol"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    first = _keys(empty, "add", "alice")
    assert first.returncode == 0, first.stderr
    assert [k.name for k in parse_key_file(str(empty))] == ["alice"]


@pytest.mark.parametrize("argv, message", [
    (["add", "two words"], "one word"),
    (["add", "#hash"], "one word"),
    (["add", "x", "--max-concurrent", "0"], "must be 1 or more"),
])
def test_keys_bad_input(tmp_path, argv, message):
    done = _keys(tmp_path / "keys.txt", *argv)
    assert done.returncode == 2 and message in done.stderr


def test_keys_refuses_to_edit_a_broken_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("alice short\n")
    done = _keys(path, "add", "bob")
    assert done.returncode == 2 and "shorter than 8" in done.stderr
    assert path.read_text() == "alice short\n"


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as and run as another user")
def test_keys_keep_a_service_users_file_readable_by_its_server(tmp_path):
    """Root edits a key file a service user owns: owner, group and mode stay, so the server
    (running as that user) re-reads it and a revoked key stops working; a file that server
    could not read is refused before it is written."""
    path = tmp_path / "keys.txt"
    assert _keys(path, "add", "alice").returncode == 0 and _keys(path, "add", "bob").returncode == 0
    os.chmod(tmp_path, 0o755)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o640)
    assert _keys(path, "revoke", "alice").returncode == 0
    after = os.stat(path)
    assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (NOBODY, NOBODY, 0o640)
    # A "server" reading the file, as nobody (its command line is all the CLI looks at).
    server = subprocess.Popen(["/bin/bash", "-c", "trap '' HUP; sleep 60; true  # pagedllm", "serve",
                               "--api-key-file", str(path)], user=NOBODY, group=NOBODY)
    try:
        added = _keys(path, "add", "carol")
        assert added.returncode == 0 and f"pid {server.pid}" in added.stdout
        os.chown(path, 0, 0)
        os.chmod(path, 0o600)
        refused = _keys(path, "add", "dave")
        assert refused.returncode == 2 and f"pid {server.pid}" in refused.stderr
        assert "dave" not in path.read_text()
    finally:
        server.kill()
        server.wait()


def test_who_can_read_a_key_file():
    from pagedllm.cli.keys import _can_read

    assert _can_read(0, {0}, 1000, 1000, 0o600)  # root reads anything
    assert _can_read(1000, {1000}, 1000, 1000, 0o600)
    assert not _can_read(1001, {1001}, 1000, 1000, 0o600)
    assert _can_read(1001, {1001, 50}, 1000, 50, 0o640)  # through a group
    assert not _can_read(1001, {1001}, 1000, 50, 0o640)
    assert _can_read(1001, {1001}, 1000, 50, 0o604)


def test_keys_finds_the_servers_that_read_the_file(tmp_path):
    from pagedllm.cli.running_servers import served_key_file as _served_key_file

    config = tmp_path / "p.toml"
    config.write_text('api-key-file = "k.txt"\n')
    assert _served_key_file(["python", "-m", "pagedllm.cli", "serve", "--api-key-file", "k.txt"],
                            str(tmp_path)) == str(tmp_path / "k.txt")
    assert _served_key_file(["/venv/bin/pagedllm", "serve", "--api-key-file=/etc/k"], "/") == "/etc/k"
    assert _served_key_file(["/venv/bin/pagedllm", "serve", "--config", "p.toml"],
                            str(tmp_path)) == str(tmp_path / "k.txt")
    assert _served_key_file(["/venv/bin/pagedllm", "chat"], "/") is None
    assert _served_key_file(["vim", "serve", "--api-key-file", "k.txt"], "/") is None


def test_key_file_readable_by_others_is_warned_about(tmp_path):
    from pagedllm.server.auth import permission_warning

    path = tmp_path / "keys.txt"
    path.write_text("alice 0123456789abcdef\n")
    os.chmod(path, 0o644)
    assert "chmod 600" in permission_warning(str(path))
    os.chmod(path, 0o600)
    assert permission_warning(str(path)) is None


# -- install-service ------------------------------------------------------------------------

def test_install_service_prints_a_unit_running_this_installation(capsys):
    from pagedllm.cli import main

    assert main(["install-service", "--user", "llm", "--config", "/etc/p/p.toml"]) == 0
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(capsys.readouterr().out)
    service = unit["Service"]
    executable, *rest = service["ExecStart"].split()
    assert os.access(executable, os.X_OK) and rest == ["serve", "--config", "/etc/p/p.toml"]
    assert service["User"] == "llm" and service["ExecReload"].endswith("-HUP $MAINPID")
    assert service["Restart"] == "on-failure" and int(service["TimeoutStopSec"]) > 30
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_install_service_writes_where_told(tmp_path, capsys):
    from pagedllm.cli import main

    path = tmp_path / "pagedllm.service"
    assert main(["install-service", "--write", str(path)]) == 0
    assert "[Service]" in path.read_text() and "systemctl daemon-reload" in capsys.readouterr().out
    assert main(["install-service", "--write", str(tmp_path / "no" / "such" / "dir")]) == 2


def test_a_running_server_honours_keys_added_and_revoked(tmp_path):
    import time

    import httpx

    from server_process import ServerProcess

    path = tmp_path / "keys.txt"
    alice = _keys(path, "add", "alice").stdout.strip().splitlines()[1]
    server = ServerProcess("--api-key-file", str(path), "--kv-cache-memory", str(64 << 20),
                           log_path=str(tmp_path / "log"))

    def status(key):
        return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=30).status_code

    def eventually(key, code):
        deadline = time.monotonic() + 20  # SIGHUP is handled between engine steps
        while status(key) != code:
            assert time.monotonic() < deadline, f"still not {code}"
            time.sleep(0.1)

    try:
        assert status(alice) == 200
        added = _keys(path, "add", "bob")
        assert "told 1 running server(s) to reload" in added.stdout
        # ... and its answer read back: the reload is known to have worked.
        assert f"server pid {server.proc.pid} reloaded its keys: 2 key(s)" in added.stdout
        assert added.returncode == 0
        eventually(added.stdout.strip().splitlines()[1], 200)
        # A stream of alice's that is running when her key is revoked ends then, with a
        # final chunk saying why (it would otherwise run its 2,000 tokens).
        lines: list[str] = []
        body = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {alice}"}) as stream:
            for line in stream.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # streaming: revoke now
                    revoked = _keys(path, "revoke", "alice")
                    assert "told 1 running server(s) to reload" in revoked.stdout
        final = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert "revoked" in final["choices"][0]["error"]["message"]
        assert sum(1 for line in lines if line.startswith("data: {")) < 2000
        eventually(alice, 401)
        # A reload that fails (a line the server cannot parse) is reported as failed: the
        # server keeps its old keys.
        from pagedllm.cli.running_servers import reload_servers

        path.write_text("carol short\n")
        [report] = reload_servers(str(path))
        assert report.ok is False and "line 1" in report.detail
        assert "did not reload its keys" in report.line() and "old ones" in report.line()
        assert status(added.stdout.strip().splitlines()[1]) == 200  # bob's key still works
    finally:
        server.stop()


def test_keys_exit_1_when_a_server_did_not_reload(tmp_path, monkeypatch, capsys):
    from pagedllm.cli import keys, main
    from pagedllm.cli.running_servers import ReloadReport

    monkeypatch.setattr(keys, "reload_servers", lambda path: [
        ReloadReport(41, True, "2 key(s)"), ReloadReport(42, False, "Permission denied"),
        ReloadReport(43, None, "no reload within 30 s")])
    assert main(["keys", "--file", str(tmp_path / "k.txt"), "add", "dave"]) == 1
    out, err = capsys.readouterr()
    assert "told 3 running server(s) to reload: pid 41, 42, 43" in out
    assert "server pid 41 reloaded its keys: 2 key(s)" in out
    assert "server pid 43 was told to reload; its answer could not be read" in out
    assert "error: server pid 42 did not reload its keys: Permission denied" in err


def test_version_and_key_file_after_the_action(tmp_path, capsys):
    from pagedllm.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("pagedllm ")
    path = tmp_path / "keys.txt"
    assert _keys(path, "add", "alice").returncode == 0
    after = subprocess.run([sys.executable, "-m", "pagedllm.cli", "keys", "list", "--file",
                            str(path)], capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and after.stdout.startswith("alice\t")


def test_help_shows_a_default_of_zero():
    from pagedllm.cli.main import build_parser, subparser

    text = subparser(build_parser(), "bench").format_help()
    assert "seed of the random prompts (default: 0)" in " ".join(text.split())


def test_print_config_writes_sizes_as_people_do():
    from pagedllm.units import byte_text, parse_bytes

    args = parse_args(["serve", "--kv-cache-memory", "2GiB", "--max-body-bytes", "3000"])
    text = to_toml(args, subparser(build_parser(), "serve"))
    assert 'kv-cache-memory = "2GiB"' in text and "max-body-bytes = 3000" in text
    assert '# max-body-bytes' not in text and '"4MiB"' in to_toml(
        parse_args(["serve"]), subparser(build_parser(), "serve"))
    for n in (1, 1000, 1 << 10, 3 << 20, 5 << 30, (1 << 30) + 1):
        assert parse_bytes(byte_text(n)) == n


@pytest.mark.parametrize("state_dir, line", [
    ("/var/lib/pagedllm", "StateDirectory=pagedllm"),
    ("/var/lib/llm/team-a/", "StateDirectory=llm/team-a"),
    ("/srv/pagedllm", None),
])
def test_install_service_state_dir_is_the_one_systemd_makes(state_dir, line, tmp_path, capsys):
    """StateDirectory= is where WorkingDirectory and the kernel cache point (systemd makes it
    under /var/lib); a folder elsewhere gets no StateDirectory, and the next steps make it."""
    from pagedllm.cli import main

    path = tmp_path / "p.service"
    assert main(["install-service", "--state-dir", state_dir, "--write", str(path)]) == 0
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(path.read_text())
    service = unit["Service"]
    assert service["WorkingDirectory"] == state_dir
    if line is None:
        assert "StateDirectory" not in service
        assert f"install -d -o pagedllm -g pagedllm {state_dir}" in capsys.readouterr().out
    else:
        assert f"StateDirectory={service['StateDirectory']}" == line
