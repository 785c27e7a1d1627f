"""The running `pagedllm serve` processes that read a key file: found by their command
lines, told to reload (SIGHUP), and asked afterwards whether the reload worked.

A signal carries no answer, so each server's `/health` (asked from this machine, which it
answers with its key reloads: how many, the last one's error) is read before and after: a
reload that failed (a file the service user cannot read, a line it cannot parse) is reported
as failed, not as done: the server keeps its old keys, so a revoked key would go on working.
"""
from __future__ import annotations

import json
import os
import signal
import ssl
import time
import urllib.request
from dataclasses import dataclass

# How long a server has to answer after the signal: it reloads between two engine steps.
RELOAD_WAIT_SECONDS = 30.0


@dataclass
class ReloadReport:
    pid: int
    ok: bool | None  # None: its answer could not be read
    detail: str

    def line(self) -> str:
        if self.ok:
            return f"server pid {self.pid} reloaded its keys: {self.detail}"
        if self.ok is None:
            return f"server pid {self.pid} was told to reload; its answer could not be read ({self.detail})"
        return (f"error: server pid {self.pid} did not reload its keys: {self.detail}; it still "
                f"uses the old ones")


def reload_servers(path: str, wait: float = RELOAD_WAIT_SECONDS) -> list[ReloadReport]:
    """SIGHUP every running server that reads this key file; what each said it did."""
    import psutil

    reports = []
    for pid in server_pids(path):
        try:
            proc = psutil.Process(pid)
            url = _health_url(proc)
            before = _reload_status(url)
            proc.send_signal(signal.SIGHUP)
        except psutil.Error:
            continue
        reports.append(_await_reload(pid, url, before, wait))
    return reports


def _await_reload(pid: int, url: str | None, before: dict | None, wait: float) -> ReloadReport:
    if before is None:
        return ReloadReport(pid, None, "its /health does not say" if url else "no listening port found")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.1)
        after = _reload_status(url)
        if after is not None and after["reloads"] > before["reloads"]:
            if after["error"]:
                return ReloadReport(pid, False, after["error"])
            return ReloadReport(pid, True, f"{after['keys']} key(s)")
    return ReloadReport(pid, None, f"no reload within {wait:.0f} s")


def _health_url(proc) -> str | None:
    """Where this server's /health answers from this machine (its listening socket)."""
    try:
        connections = proc.net_connections(kind="inet")
    except AttributeError:  # psutil before 6
        connections = proc.connections(kind="inet")
    scheme = "https" if any(part.startswith("--ssl-certfile") for part in proc.cmdline()) else "http"
    for conn in connections:
        if conn.status == "LISTEN":
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(conn.laddr.ip, conn.laddr.ip)
            host = f"[{host}]" if ":" in host else host
            return f"{scheme}://{host}:{conn.laddr.port}/health"
    return None


def _reload_status(url: str | None) -> dict | None:
    """The server's key reload status from its /health, or None where it gives none."""
    if url is None:
        return None
    # Our own server on this machine: its certificate names its public host, not 127.0.0.1.
    context = ssl._create_unverified_context() if url.startswith("https") else None  # noqa: S323
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as answer:  # noqa: S310
            status = json.load(answer).get("api_keys")
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and "reloads" in status else None


def server_pids(path: str) -> list[int]:
    """The running `pagedllm serve` processes whose key file is this one."""
    import psutil

    target = os.path.realpath(path)
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            key_file = served_key_file(proc.info["cmdline"] or [], proc.info["cwd"])
            if key_file and os.path.realpath(key_file) == target:
                pids.append(proc.info["pid"])
        except (psutil.Error, OSError):
            continue
    return pids


def served_key_file(cmdline: list[str], cwd: str | None) -> str | None:
    """The key file a `pagedllm serve` command line reads (flag or --config), else None."""
    if "serve" not in cmdline or not any("pagedllm" in part for part in cmdline[:3]):
        return None
    found = _flag_value(cmdline, "--api-key-file")
    if found is None:
        config = _flag_value(cmdline, "--config")
        if config is not None:
            import tomllib
            with open(os.path.join(cwd or "", config), "rb") as f:
                table = tomllib.load(f)
            table = table.get("serve", table)
            found = table.get("api-key-file", table.get("api_key_file"))
    return None if found is None else os.path.join(cwd or "", found)


def _flag_value(cmdline: list[str], flag: str) -> str | None:
    for i, part in enumerate(cmdline):
        if part == flag and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if part.startswith(flag + "="):
            return part[len(flag) + 1:]
    return None
