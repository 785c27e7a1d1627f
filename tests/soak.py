"""The soak load, shared by the hardening test and benchmarks/soak_memory.py: waves of
streaming requests, about half dropped by the client at a random moment, then a wait until
the server's metrics say it is idle again."""
from __future__ import annotations

import concurrent.futures
import json
import random
import time

import httpx

from probes import metric


def soak_round(url, rounds_seed, num_requests=160, wave=16):
    """Waves of 16 streaming requests; about half are dropped by the client at a random
    moment (some before the first byte), the rest read to the end. With 8 slots and a queue
    of 2, each wave also meets 429s."""
    rng = random.Random(rounds_seed)
    plans = [rng.choice(["full", "drop"]) for _ in range(num_requests)]
    drop_after = [rng.randint(0, 6) for _ in range(num_requests)]

    def one(i):
        body = {"prompt": f"Soak {rounds_seed}-{i}: tell me", "max_tokens": 12, "stream": True,
                "ignore_eos": True, "temperature": 1.0, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    return "429", None
                assert r.status_code == 200, r.read()
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if plans[i] == "drop" and len(lines) > drop_after[i]:
                            return "dropped", None  # leaving the block closes the connection
                assert lines[-1] == "[DONE]", lines[-3:]
                usage = json.loads(lines[-2])["usage"]
                return "full", usage["completion_tokens"]

    results = []
    with concurrent.futures.ThreadPoolExecutor(wave) as pool:
        for start in range(0, num_requests, wave):
            results += list(pool.map(one, range(start, min(start + wave, num_requests))))
    return results


def wait_idle(url):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (metric(url, "num_requests_running") == 0 and metric(url, "num_requests_waiting") == 0
                and metric(url, "kv_cache_usage_perc") == 0.0):
            return
        time.sleep(0.2)
    raise AssertionError("the server did not return to idle after the soak")
