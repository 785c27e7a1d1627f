"""What tests read off a running system: a condition waited for (events, never a fixed
sleep), a server's Prometheus metric."""
from __future__ import annotations

import time

import httpx


def wait_for(condition, timeout: float = 120.0, what: str = "the condition", every: float = 0.25):
    """condition()'s first true value, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"never happened within {timeout:g} s: {what}")


def metric(server, name: str, *, headers: dict | None = None, missing: float | None = None,
           **labels) -> float:
    """The value of `pagedllm:NAME` (the first sample holding `labels`) on a server (anything
    with a .url, or the URL itself); `missing` when there is none (else AssertionError): a
    labelled counter has no sample before its first count."""
    url = server if isinstance(server, str) else server.url
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith((f"pagedllm:{name}{{", f"pagedllm:{name} ")) and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    if missing is not None:
        return missing
    raise AssertionError(f"no metric {name} {labels or ''}")
