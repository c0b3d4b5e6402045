"""The grammar check's worker process: `python -m coserve.structured.check_worker MEMORY_BYTES`.

It says `{"ready": true}` once, then answers one request per line on stdin (`{"format", "text"}`, a
`StructuredOutput`) with one line on stdout (`{"error": null}` or `{"error": "why"}`). Its address
space is capped at MEMORY_BYTES (RLIMIT_AS) and it writes no core file: a grammar for which llguidance
allocates past the budget ends this process (Rust aborts when an allocation fails), and the parent
(`guarded_check`) refuses that one request and starts another worker. It exits when stdin closes, so
it never outlives its parent.
"""

from __future__ import annotations

import json
import resource
import sys

from coserve.contract.structured_output import OutputFormat, StructuredOutput
from coserve.structured.llguidance_grammar import compile_error


def _limit_memory(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _answer(line: str) -> str:
    request = json.loads(line)
    # Built directly, not through the constructors: the parent made (and bounded) this spec.
    spec = StructuredOutput(OutputFormat(request["format"]), request["text"])
    return json.dumps({"error": compile_error(spec)})


def main() -> None:
    _limit_memory(int(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(_answer(line), flush=True)


if __name__ == "__main__":
    main()
