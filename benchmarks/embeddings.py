"""The embedding model: pagedllm's encoder (embeddings/) against the sentence-transformers
package on the same all-MiniLM-L6-v2 weights, same texts, same run; then the server's
/v1/embeddings with 16 clients at once against one at a time (what batching the queued
requests together buys).

    .venv/bin/python benchmarks/embeddings.py [--threads 2] [--texts 256] [--dtype auto]

Prints texts/s at batch 1 and 64 for each and the ratios, and the lowest cosine between
the two's vectors.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import numpy as np

from pagedllm.embeddings.packaged import packaged_folder
from pagedllm.embeddings.sentence_model import SentenceModel
from timing import parse_args, smoke_or

TEXT = "The committee met on Tuesday to review the budget for the coming year and decide {}."


def per_second(fn, count: int, repeat: int = 3) -> float:
    repeat = smoke_or(repeat, 1)
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return count * repeat / (time.perf_counter() - start)


def server_figures(texts: list[str]) -> tuple[float, float]:
    """Texts/s through the server: 16 clients of 8 texts at once, and the same one by one."""
    import httpx

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
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
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parse_args(parser)
    from sentence_transformers import SentenceTransformer

    texts = [TEXT.format(i) for i in range(smoke_or(args.texts, 128))]
    ours = SentenceModel(packaged_folder(), dtype=args.dtype)
    theirs = SentenceTransformer(packaged_folder(), device="cpu")
    mine_vectors = ours.embed(ours.tokenize(texts)).numpy()
    their_vectors = theirs.encode(texts)
    cosine = (mine_vectors * their_vectors).sum(1) / np.linalg.norm(their_vectors, axis=1)
    print(f"pagedllm's matrix products: {ours.dtype}; lowest cosine to sentence-transformers: "
          f"{cosine.min():.6f}")
    for batch in (1, 64):
        chunk = texts[:batch]
        repeat = 200 if batch == 1 else 10
        mine = per_second(lambda: ours.embed(ours.tokenize(chunk)), batch, repeat)
        reference = per_second(lambda: theirs.encode(chunk, batch_size=batch), batch, repeat)
        print(f"batch {batch:3d}: sentence-transformers {reference:7.0f} texts/s, pagedllm "
              f"{mine:7.0f} texts/s   ratio {mine / reference:.2f}x")
    together, alone = server_figures(texts)
    print(f"server, 16 clients at once: {together:6.0f} texts/s; one at a time: {alone:6.0f} "
          f"texts/s   ratio {together / alone:.2f}x")


if __name__ == "__main__":
    main()
