"""`pagedllm keys add | list | revoke`: the API key file edited safely, running servers told.

The file is rewritten whole into a new file and moved over the old one, so a server
reloading meanwhile reads one version or the other. The new file keeps the old one's owner,
group and mode (a new file is 0600): a key file given to a service user (`chown pagedllm:`)
stays readable by that service after root edits it. Before writing, every running `pagedllm
serve` that reads this file is checked to be able to read the result; if one could not, the
edit is refused (a server that cannot re-read its keys keeps the old ones, so a revoked key
would go on working). Afterwards each gets SIGHUP, its signal to reload keys, and is asked
whether the reload worked (running_servers.py); one that failed makes the exit status 1.
"""
from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
import tempfile

from pagedllm.cli.options import positive_int
from pagedllm.cli.running_servers import reload_servers, server_pids
from pagedllm.server.auth import KeyFileError, parse_key_file

DEFAULT_KEY_FILE = "keys.txt"


def add_keys(sub, formatter) -> None:
    keys = sub.add_parser("keys", help="add, list or revoke API keys in a key file",
                          formatter_class=formatter,
                          description="Edits the file `serve --api-key-file` reads, with mode 0600,\n"
                                      "and tells running servers that read it to reload (SIGHUP).")
    keys.add_argument("--file", default=os.environ.get("PAGEDLLM_KEY_FILE", DEFAULT_KEY_FILE),
                      help="the key file ($PAGEDLLM_KEY_FILE when set)")
    # --file also after the action (`keys list --file x`), where people put it.
    file_after = argparse.ArgumentParser(add_help=False)
    file_after.add_argument("--file", default=argparse.SUPPRESS,
                            help="the key file (as before the action)")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    add = actions.add_parser("add", help="create a key for a user and print it once",
                             formatter_class=formatter, parents=[file_after])
    add.add_argument("name", help="the user or team the key is for (shown in metrics and logs)")
    add.add_argument("--weight", type=float, default=None,
                     help="fair-share weight (default: 1)")
    add.add_argument("--max-concurrent", type=positive_int, default=None,
                     help="requests this key may run at once (default: no cap)")
    add.add_argument("--tokens-per-minute", type=positive_int, default=None,
                     help="prompt + generated tokens a minute (default: no cap)")
    add.add_argument("--admin", action="store_true",
                     help="this key may also change what the server serves (load and unload "
                          "LoRA adapters)")
    actions.add_parser("list", help="the names and limits (never the keys)", formatter_class=formatter,
                       parents=[file_after])
    revoke = actions.add_parser("revoke", help="remove a user's key", formatter_class=formatter,
                                parents=[file_after])
    revoke.add_argument("name", help="whose key goes")
    keys.set_defaults(func=cmd_keys)


def cmd_keys(args) -> int:
    try:
        if args.keys_command == "list":
            return _list(args.file)
        if args.keys_command == "add":
            message = _add(args.file, args.name, args.weight, args.max_concurrent,
                           args.tokens_per_minute, args.admin)
        else:
            message = _revoke(args.file, args.name)
    except KeyFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(message)
    reports = reload_servers(args.file)
    print(f"told {len(reports)} running server(s) to reload: pid "
          f"{', '.join(str(r.pid) for r in reports)}" if reports
          else "no running server reads this file; a server started with it will")
    for report in reports:
        print(report.line(), file=sys.stdout if report.ok is not False else sys.stderr)
    return 1 if any(report.ok is False for report in reports) else 0


def _list(path: str) -> int:
    for key in parse_key_file(path):
        limits = [f"weight={key.weight:g}"]
        if key.max_concurrent:
            limits.append(f"max_concurrent={key.max_concurrent}")
        if key.tokens_per_minute:
            limits.append(f"tokens_per_minute={key.tokens_per_minute}")
        if key.admin:
            limits.append("admin=yes")
        print(f"{key.name}\t{' '.join(limits)}")
    return 0


def _read_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if any(_is_key_line(line) for line in lines):
        parse_key_file(path)  # never edit a file the server would refuse
    return lines  # no key yet (a new, empty file): the first `add` fills it


def _is_key_line(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _add(path: str, name: str, weight, max_concurrent, tokens_per_minute,
         admin: bool = False) -> str:
    if not name or any(c.isspace() for c in name) or name.startswith("#"):
        raise KeyFileError(f"a key name is one word, not starting with #: got {name!r}")
    lines = _read_lines(path)
    if any(line.split()[:1] == [name] for line in lines):
        raise KeyFileError(f"{path} already has a key named {name}; revoke it first")
    key = secrets.token_urlsafe(24)
    options = [f"{field}={value:g}" if isinstance(value, float) else f"{field}={value}"
               for field, value in (("weight", weight), ("max_concurrent", max_concurrent),
                                    ("tokens_per_minute", tokens_per_minute)) if value is not None]
    options += ["admin=yes"] if admin else []
    _write(path, lines + [" ".join([name, key, *options])])
    return f"added {name} to {path}; the key (shown only now):\n{key}"


def _revoke(path: str, name: str) -> str:
    lines = _read_lines(path)
    kept = [line for line in lines if line.split()[:1] != [name]]
    if len(kept) == len(lines):
        raise KeyFileError(f"{path} has no key named {name}")
    if not any(_is_key_line(line) for line in kept):
        serving = server_pids(path)
        if serving:  # it would keep the old keys: a server never runs with none
            raise KeyFileError(f"{name} holds the last key of {path}, which the running "
                               f"server(s) {', '.join(map(str, serving))} read; a server needs "
                               f"at least one key (add another first, or stop the server)")
        _write(path, kept)
        return (f"revoked {name} in {path}; it holds no keys now, and a server refuses to "
                f"start with it until `pagedllm keys add` puts one back")
    _write(path, kept)
    return f"revoked {name} in {path}"


def _write(path: str, lines: list[str]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    old = os.stat(path) if os.path.exists(path) else None
    if old is not None:
        _check_servers_can_read(path, old.st_uid, old.st_gid, old.st_mode)
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".keys-")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        if old is not None:
            _keep_owner_and_mode(temp, path, old)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def _keep_owner_and_mode(temp: str, path: str, old: os.stat_result) -> None:
    os.chmod(temp, stat.S_IMODE(old.st_mode))
    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(temp, old.st_uid, old.st_gid)
        except PermissionError as exc:
            raise KeyFileError(
                f"{path} belongs to uid {old.st_uid} (gid {old.st_gid}); rewritten by this user "
                f"it would belong to uid {os.geteuid()} and a server running as its owner might "
                f"not read it. Run this as root or as the file's owner") from exc


def _check_servers_can_read(path: str, uid: int, gid: int, mode: int) -> None:
    """Refuse an edit a running server reading this file could not re-read."""
    import psutil

    for pid in server_pids(path):
        try:
            proc = psutil.Process(pid)
            if not _can_read(proc.uids().effective, _groups(proc), uid, gid, mode):
                raise KeyFileError(
                    f"the server pid {pid} (uid {proc.uids().effective}) reads {path} but could "
                    f"not read it (owner uid {uid}, gid {gid}, mode {stat.S_IMODE(mode):o}); it "
                    f"would keep its old keys. Give the file to the server's user (chown) first")
        except psutil.Error:
            continue


def _can_read(proc_uid: int, proc_groups: set[int], uid: int, gid: int, mode: int) -> bool:
    if proc_uid == 0:
        return True
    if proc_uid == uid:
        return bool(mode & stat.S_IRUSR)
    if gid in proc_groups:
        return bool(mode & stat.S_IRGRP)
    return bool(mode & stat.S_IROTH)


def _groups(proc) -> set[int]:
    groups = {proc.gids().effective}
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups |= {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return groups
