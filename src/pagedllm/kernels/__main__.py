"""`python -m pagedllm.kernels`: build the kernels of every CPU level this host can run (make
install does it, so neither serving nor the tests wait for g++) and say which level runs."""
import sys

from pagedllm.kernels import capabilities, kernels_for


def main() -> int:
    caps = capabilities()
    failed = [level for level in caps.available if kernels_for(level) is None]
    print(f"kernels built for {', '.join(caps.available)}; this CPU runs up to {caps.best}, "
          f"serving uses {caps.level}")
    if failed:
        print(f"error: the {', '.join(failed)} kernels did not build", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
