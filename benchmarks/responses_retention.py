"""Turn-2..5 time to first token of Responses API conversations, with and without the KV retention of
stored responses, on SmolLM2 in one process (`coserve serve --local`, in a thread).

Several tenants each hold a 5-turn conversation; the turns of all tenants are interleaved round by round,
and between rounds another tenant's chat traffic goes through the whole KV cache (a cache of a few
conversations' size: what a busy server's prefix cache looks like to one conversation). Two arms, the same
tokens: **retained** (each turn continues the last with `previous_response_id`; a stored response keeps
its conversation's KV) and **stateless** (`store: false`, the whole conversation sent as items each turn:
only the ordinary prefix cache, which the traffic churns). Each turn is streamed; TTFT is the time from
the request to its first `response.output_text.delta`; `cached_tokens` comes from its `response.completed`.

usage (from the repository root)::

    .venv/bin/python benchmarks/responses_retention.py --json benchmarks/out/responses_retention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from local_server import LocalServer, local_server  # noqa: E402

KEYS = [f"sk-conv-{n}-0123456789" for n in range(8)]
CHURN_KEY = "sk-churn-0123456789"
QUESTIONS = ["Tell me about the sea.", "Why is it salty?", "What lives there?", "How deep is it?",
             "Summarize what you said."]


def _turn(server: LocalServer, key: str, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Stream one response: (seconds to its first text delta, the completed response)."""
    client = server.client(key).with_options(timeout=600)
    start = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    with client.responses.create(model=server.base, stream=True, **request) as events:
        for event in events:
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response.model_dump()
    return (first if first is not None else time.perf_counter() - start), final


def _churn(server: LocalServer, round_index: int, requests: int, words: int) -> None:
    client = server.client(CHURN_KEY).with_options(timeout=600)
    for n in range(requests):
        text = " ".join(f"filler{round_index}-{n}-{w}" for w in range(words))
        client.chat.completions.create(model=server.base, messages=[{"role": "user", "content": text}],
                                       max_completion_tokens=4, temperature=0)


def _context(tenant: int, words: int) -> str:
    """A document the first turn asks about: what makes a conversation's history long."""
    return " ".join(f"fact{tenant}-{n}" for n in range(words))


def run_arm(server: LocalServer, retained: bool, tenants: int, turns: int, max_tokens: int,
            churn: tuple[int, int], context_words: int) -> list[dict[str, Any]]:
    """One arm: every tenant's conversation, turn by turn, churn between rounds; one row per turn."""
    previous: dict[int, str | None] = dict.fromkeys(range(tenants))
    history: dict[int, list[dict[str, Any]]] = {t: [] for t in range(tenants)}
    rows = []
    for turn in range(turns):
        for tenant in range(tenants):
            text = QUESTIONS[turn % len(QUESTIONS)]
            if turn == 0:
                text = f"Read this: {_context(tenant, context_words)}\n{text}"
            question = {"role": "user", "content": f"(conversation {tenant}) {text}"}
            if retained:
                request = {"input": [question], "previous_response_id": previous[tenant]}
            else:
                request = {"input": [*history[tenant], question], "store": False}
            ttft, final = _turn(server, KEYS[tenant], {**request, "max_output_tokens": max_tokens, "temperature": 0})
            usage = final["usage"]
            rows.append({"arm": "retained" if retained else "stateless", "tenant": tenant, "turn": turn + 1,
                         "ttft_s": ttft, "input_tokens": usage["input_tokens"],
                         "cached_tokens": usage["input_tokens_details"]["cached_tokens"]})
            row = rows[-1]
            print(f"{row['arm']:9} tenant {tenant} turn {turn + 1}: TTFT {ttft * 1000:7.0f} ms, "
                  f"{row['cached_tokens']:4}/{row['input_tokens']:4} prompt tokens cached", flush=True)
            previous[tenant] = final["id"]
            history[tenant] += [question, *[_as_input(item) for item in final["output"]]]
        _churn(server, turn, *churn)
    return rows


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if value is not None and key != "phase"}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ("retained", "stateless"):
        later = [r for r in rows if r["arm"] == arm and r["turn"] >= 2]
        turn2 = [r for r in later if r["turn"] == 2]
        out[arm] = {"turn2_ttft_median_s": statistics.median(r["ttft_s"] for r in turn2),
                    "turns2to5_ttft_median_s": statistics.median(r["ttft_s"] for r in later),
                    "turns2to5_cached_share": sum(r["cached_tokens"] for r in later)
                    / max(1, sum(r["input_tokens"] for r in later)),
                    "turns2to5_input_tokens_mean": statistics.mean(r["input_tokens"] for r in later)}
    out["turn2_speedup"] = out["stateless"]["turn2_ttft_median_s"] / out["retained"]["turn2_ttft_median_s"]
    out["turns2to5_speedup"] = (out["stateless"]["turns2to5_ttft_median_s"]
                                / out["retained"]["turns2to5_ttft_median_s"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/coserve/models/smollm2-135m-instruct")
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens a turn (default 16)")
    parser.add_argument("--context-words", type=int, default=150,
                        help="words of a document in each conversation's first turn (default 150)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.1, help="the KV cache (default 0.1 GB: ~2,200 "
                                                                       "SmolLM2 tokens in float32)")
    parser.add_argument("--churn", type=int, nargs=2, default=(3, 150), metavar=("REQUESTS", "WORDS"),
                        help="chat requests of WORDS words between rounds (default 3 x 150)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    tenants = {f"t{n}": {"api_keys": [KEYS[n]]} for n in range(args.tenants)} | {"churn": {"api_keys": [CHURN_KEY]}}
    with tempfile.TemporaryDirectory() as root, \
            local_server(args.model, Path(root), tenants, kv_cache_memory_gb=args.kv_cache_gb, max_model_len=1024,
                         max_batch_tokens=512) as server:
        _turn(server, KEYS[0], {"input": "warm up", "max_output_tokens": 2, "store": False})
        arms = (args.tenants, args.turns, args.max_tokens, tuple(args.churn), args.context_words)
        rows = run_arm(server, False, *arms)
        rows += run_arm(server, True, *arms)
    result = {"machine": platform.platform(), "args": {k: str(v) for k, v in vars(args).items()},
              "summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
