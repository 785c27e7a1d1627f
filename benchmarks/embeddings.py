"""The embedding model: pagedllm's encoder (embeddings/) against the sentence-transformers
package on the same all-MiniLM-L6-v2 weights, same texts, same run; then the server's
/v1/embeddings with 16 clients at once against one at a time (what batching the queued
requests together buys).

    .venv/bin/python benchmarks/embeddings.py [--threads 2] [--texts 256]

Prints texts/s for each and the ratios, and the largest difference between the vectors.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time

import numpy as np

from pagedllm.embeddings.packaged import packaged_folder
from pagedllm.embeddings.sentence_model import SentenceModel
from timing import parse_args

TEXT = "The committee met on Tuesday to review the budget for the coming year and decide {}."


def per_second(fn, count: int, repeat: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return count * repeat / (time.perf_counter() - start)


def server_figures(texts: list[str]) -> tuple[float, float]:
    """Texts/s through the server: 16 clients of 8 texts at once, and the same one by one."""
    import httpx

    sys.path.insert(0, "tests")
    from server_process import ServerProcess

    server = ServerProcess("--embedding-model", "all-minilm", "--kv-cache-memory", str(64 << 20),
                           log_path="/tmp/pagedllm-embeddings-bench.log")
    try:
        bodies = [{"model": "all-minilm", "input": texts[i:i + 8]} for i in range(0, 128, 8)]

        def post(body):
            return httpx.post(server.url + "/v1/embeddings", json=body, timeout=120).raise_for_status()

        def together():
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(post, bodies))

        def alone():
            for body in bodies:
                post(body)

        return per_second(together, 128), per_second(alone, 128)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=256)
    args = parse_args(parser)
    from sentence_transformers import SentenceTransformer

    texts = [TEXT.format(i) for i in range(args.texts)]
    ours = SentenceModel(packaged_folder())
    theirs = SentenceTransformer(packaged_folder(), device="cpu")
    diff = np.abs(ours.embed(ours.tokenize(texts)).numpy() - theirs.encode(texts)).max()
    mine = per_second(lambda: ours.embed(ours.tokenize(texts)), len(texts))
    reference = per_second(lambda: theirs.encode(texts, batch_size=32), len(texts))
    print(f"largest difference between the vectors: {diff:.2e}")
    print(f"sentence-transformers: {reference:8.0f} texts/s")
    print(f"pagedllm encoder:      {mine:8.0f} texts/s   ratio {mine / reference:.2f}x")
    together, alone = server_figures(texts)
    print(f"server, 16 clients at once: {together:6.0f} texts/s; one at a time: {alone:6.0f} "
          f"texts/s   ratio {together / alone:.2f}x")


if __name__ == "__main__":
    main()
