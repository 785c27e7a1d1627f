"""Resident memory of a server over soak rounds (tests/soak.py's load: 13 waves of 16
streaming requests, about half dropped at random, 429s from the queue bound), the server idle
after each round. The first round is the baseline; later rounds print their growth over it.

    .venv/bin/python benchmarks/soak_memory.py [--kv-cache-memory 33554432] [--rounds 4]

Extra environment for the server (MALLOC_ARENA_MAX=2, say) is passed on.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_process import ServerProcess  # noqa: E402
from soak import soak_round, wait_idle  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from timing import add_smoke, smoke_or  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-memory", type=int, default=32 << 20)
    parser.add_argument("--rounds", type=int, default=4)
    add_smoke(parser)
    args = parser.parse_args()
    args.rounds = smoke_or(args.rounds, 1)
    log = os.path.join(tempfile.mkdtemp(), "server.log")
    server = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(args.kv_cache_memory),
                           "--max-num-seqs", "8", "--max-queue", "2", "--max-tokens-limit", "16",
                           log_path=log)
    try:
        first = None
        for number in range(1, args.rounds + 1):
            soak_round(server.url, number, num_requests=smoke_or(160, 16))
            wait_idle(server.url)
            rss = psutil.Process(server.proc.pid).memory_info().rss >> 20
            first = rss if first is None else first
            print(f"round {number}: {rss:,} MiB ({rss - first:+,} MiB over round 1)", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
