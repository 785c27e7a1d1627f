"""`python -m pagedllm.kernels [--all]`: build the kernels ahead of serving, so no request
waits for g++. By default only the level serving will use on this CPU (what `make install`
does); `--all` every level this CPU runs (the tests compare them). Progress is printed while
it compiles: the level, files done, seconds so far."""
import argparse
import sys
import threading
import time

from pagedllm.kernels import capabilities, kernels_for
from pagedllm.kernels.build import SOURCES, compiled_files, is_built

PROGRESS_SECONDS = 15


def build_with_progress(level: str) -> bool:
    if is_built(level):
        ok = kernels_for(level) is not None
        print(f"{level}: already built" if ok else f"{level}: failed to load", flush=True)
        return ok
    start = time.time()
    print(f"{level}: compiling {len(SOURCES)} files (needs g++; about a minute on 2 cores)",
          flush=True)
    done = threading.Event()

    def report():
        while not done.wait(PROGRESS_SECONDS):
            print(f"{level}: {compiled_files(level, start)}/{len(SOURCES)} files compiled, "
                  f"{time.time() - start:.0f} s", flush=True)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        ok = kernels_for(level) is not None
    finally:
        done.set()
    print(f"{level}: {'built' if ok else 'FAILED'} in {time.time() - start:.0f} s", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.kernels")
    parser.add_argument("--all", action="store_true",
                        help="every level this CPU runs, not only the one serving uses")
    args = parser.parse_args(argv)
    caps = capabilities()
    levels = list(caps.available) if args.all else [caps.level]
    failed = [level for level in levels if not build_with_progress(level)]
    print(f"this CPU runs up to {caps.best}; serving uses {caps.level}")
    if failed:
        print(f"error: the {', '.join(failed)} kernels did not build", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
