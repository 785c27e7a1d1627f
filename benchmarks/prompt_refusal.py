"""Refusing a prompt past the context: Tokenizer.encode_within against tokenizing the whole
text (the baseline, what the server did before), same run, the default model's tokenizer.

    .venv/bin/python benchmarks/prompt_refusal.py [--limit 8192]

Prints, per text, both times and their ratio.
"""
from __future__ import annotations

import argparse
import time

from pagedllm.tokenizer import TokenLimitError, Tokenizer
from timing import add_smoke

TEXTS = {
    '"word " x 838,860 (a 4 MiB body)': "word " * ((4 << 20) // 5),
    "120,000 short words": " ".join(f"w{i % 977}" for i in range(120_000)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=8192)
    add_smoke(parser)  # the texts are its sizes: a smoke run is the run
    args = parser.parse_args()
    tok = Tokenizer.from_model_path(None)
    tok.max_token_chars  # computed once per tokenizer; not part of a request's cost
    for name, text in TEXTS.items():
        start = time.perf_counter()
        num_tokens = len(tok.encode(text))
        whole = time.perf_counter() - start
        start = time.perf_counter()
        try:
            tok.encode_within(text, args.limit)
            verdict = "accepted"
        except TokenLimitError as exc:
            verdict = f"refused: at least {exc.num_tokens:,} tokens"
        within = time.perf_counter() - start
        print(f"{name}: {len(text):,} chars, {num_tokens:,} tokens; encode {whole * 1e3:,.0f} ms, "
              f"encode_within({args.limit}) {within * 1e3:.2f} ms ({verdict}); "
              f"{whole / within:,.0f}x less work")


if __name__ == "__main__":
    main()
