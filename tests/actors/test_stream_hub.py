"""`StreamHub` and `SubmissionState`: token streams read batch by batch until `done`, every request of one
gateway replica in one `poll`, a stream forgotten once its last batch is read (or, unread, after its
TTL), and each child's tokens, logprobs and finish reason sent once."""

from __future__ import annotations

import asyncio

from coserve.actors.stream_hub import UNREAD_TTL_S, StreamHub
from coserve.actors.streams import SubmissionState
from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import EosIds, SamplingParams
from coserve.inference.request import Request, RequestStatus, expand_request


def children(request_id: str, n: int = 1, logprobs: int | None = None) -> list[Request]:
    return expand_request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, n=n, logprobs=logprobs),
                          EosIds(eos=None, extra=()), arrival_time=0.0)


def test_a_child_sends_its_tokens_logprobs_and_finish_once() -> None:
    async def main() -> None:
        kids = children("r", n=2, logprobs=0)
        state = SubmissionState("t", kids, prompt_tokens=3, estimate=11, arrival=0.0)
        lp = TokenLogprobs(token_id=7, logprob=-1.0, rank=1, top_token_ids=[], top_logprobs=[])
        kids[0].append_output_token(7)
        assert state.on_token(0, now=0.5, logprobs=lp) == 0.5  # the first token: its TTFT
        state.emit()
        kids[0].append_output_token(8)
        state.on_token(0, now=0.7)
        kids[0].status = RequestStatus.FINISHED_LENGTH_CAPPED
        state.emit()
        state.emit()  # nothing new: nothing sent
        batch = state.take()
        assert [(d.index, d.token_ids, d.finish_reason) for d in batch.deltas] == [(0, [7], None), (0, [8], "length")]
        assert batch.deltas[0].logprobs == [lp] and batch.deltas[1].logprobs == []
        assert state.completion_tokens() == 2 and abs(state.tpot(0) - 0.2) < 1e-9 and state.tpot(1) is None
        assert not batch.done and not state.all_finished()

    asyncio.run(main())


def test_stream_until_done_then_forgotten() -> None:
    async def main() -> None:
        hub = StreamHub()
        kids = children("r")
        state = SubmissionState("t", kids, 3, 7, 0.0)
        hub.add("r", state)
        kids[0].append_output_token(5)
        state.emit()
        state.close()
        batches = [batch async for batch in hub.stream("r")]
        assert [t for b in batches for d in b.deltas for t in d.token_ids] == [5] and batches[-1].done
        assert hub.get("r") is None
        unknown = [batch async for batch in hub.stream("r")]
        assert unknown[0].done and "unknown request" in unknown[0].error

    asyncio.run(main())


def test_poll_returns_one_origins_requests() -> None:
    async def main() -> None:
        hub = StreamHub()
        states = {}
        for rid, origin in (("a", "gw-1"), ("b", "gw-1"), ("c", "gw-2")):
            states[rid] = SubmissionState("t", children(rid), 3, 7, 0.0, hub.notifier(origin), origin)
            hub.add(rid, states[rid])
        assert await hub.poll("gw-1", timeout_s=0.01) == {}
        for rid in ("a", "c"):
            states[rid].children[0].append_output_token(9)
            states[rid].emit()
        got = await hub.poll("gw-1", timeout_s=1.0)
        assert set(got) == {"a"} and got["a"].deltas[0].token_ids == [9]
        states["b"].close()
        got = await hub.poll("gw-1", timeout_s=1.0)
        assert set(got) == {"b"} and got["b"].done and hub.get("b") is None
        assert set(await hub.poll("gw-2", timeout_s=1.0)) == {"c"}

    asyncio.run(main())


def test_an_unread_finished_stream_is_dropped_after_its_ttl() -> None:
    async def main() -> None:
        now = [0.0]
        hub = StreamHub(clock=lambda: now[0])
        state = SubmissionState("t", children("r"), 3, 7, 0.0)
        hub.add("r", state)
        state.close()
        state.closed_at = 0.0
        now[0] = UNREAD_TTL_S / 2
        hub.drop_unread()
        assert hub.get("r") is state and hub.live() == []
        now[0] = UNREAD_TTL_S + 1
        hub.drop_unread()
        assert hub.get("r") is None

    asyncio.run(main())
