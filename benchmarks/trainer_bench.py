"""`coserve bench trainer` from a checkout: `.venv/bin/python benchmarks/trainer_bench.py --quick`."""

import sys

from coserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "trainer", *sys.argv[1:]]))
