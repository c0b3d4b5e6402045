"""The victim tenant of benchmarks/soak_tenants.py: it chats (streamed and not, with the base model and,
once it has one, its own fine-tuned model), runs fine-tuning jobs one after another, and trains through the
official `tinker` SDK (forward_backward + optim_step + sample, from the base model and its own saved
weights), each in a thread until `stop`. Every error is recorded with its phase (quiet or attack)."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai
import tinker
from tinker import types

from coserve.bench.run_metrics import percentile_ms

ROWS = [{"messages": [{"role": "user", "content": f"Say the number {i}"},
                      {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]
TOKENS = list(range(5, 37))
TERMINAL = ("succeeded", "failed", "cancelled")
WAIT_S = 900  # a Tinker call not done in 15 minutes is an error
GRACE_S = 60  # how long a call in flight when the soak ends may take still (then it is cut, not an error)


class Cut(Exception):
    """A call of the victim's still in flight `GRACE_S` after the soak ended."""


@dataclass
class Chat:
    """One chat request: when it started, its kind, its time to first token (streamed) and its latency."""

    start: float
    kind: str  # "stream" or "plain"
    model: str  # "base" or "fine-tuned"
    ttft_s: float | None
    latency_s: float


@dataclass
class VictimRecord:
    """What the victim saw; `quiet_at` and `attack_at` split it into its warm-up, the quiet phase and the
    attack."""

    quiet_at: float = float("inf")
    attack_at: float = float("inf")
    chats: list[Chat] = field(default_factory=list)
    errors: list[tuple[float, str, str]] = field(default_factory=list)  # (time, where, what)
    tinker_rounds: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)  # calls in flight when it ended

    def phase(self, at: float) -> str:
        return "attack" if at >= self.attack_at else "quiet" if at >= self.quiet_at else "warm-up"


class Victim:
    """The victim's four loops (two chat clients, its jobs, its Tinker run) against `url` (`.../v1`)."""

    def __init__(self, url: str, model: str, key: str, tinker_key: str, pause_s: float) -> None:
        self.url, self.model, self.key, self.tinker_key, self.pause_s = url, model, key, tinker_key, pause_s
        self.record = VictimRecord()
        self.fine_tuned: str | None = None
        self._stop = threading.Event()
        self._client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
        self.file_id = self._client.files.create(
            file=("victim.jsonl", io.BytesIO("\n".join(json.dumps(r) for r in ROWS).encode())),
            purpose="fine-tune").id
        self._threads = [threading.Thread(target=self._guarded, args=(name, loop), daemon=True)
                         for name, loop in (("chat stream", self._chat_stream), ("chat plain", self._chat_plain),
                                            ("jobs", self._jobs), ("tinker", self._tinker))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=GRACE_S + 180)

    def _result(self, future: Any) -> Any:
        """A Tinker call's answer within `WAIT_S` (TimeoutError past it), or `Cut` `GRACE_S` after `stop`."""
        deadline, stopped_at = time.monotonic() + WAIT_S, None
        while True:
            try:
                return future.result(timeout=2)
            except TimeoutError:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"a Tinker call got no answer in {WAIT_S} s") from None
                if self._stop.is_set():
                    stopped_at = stopped_at or now
                    if now - stopped_at > GRACE_S:
                        raise Cut from None

    def _error(self, where: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.record.errors.append((time.monotonic(), where, text[:300]))

    def _guarded(self, where: str, loop: Any) -> None:
        while not self._stop.is_set():
            try:
                loop()
            except Cut:
                self.record.cut.append(where)
            except Exception as error:  # noqa: BLE001 - any error of the victim is the soak's finding
                self._error(where, error)
                self._stop.wait(1.0)

    def _models(self, turn: int) -> tuple[str, str]:
        if self.fine_tuned is not None and turn % 2:
            return "fine-tuned", self.fine_tuned
        return "base", self.model

    def _chat_stream(self) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            label, model = self._models(turn)
            start = time.monotonic()
            first, finish, usage = None, None, None
            stream = self._client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell me a story about {turn}."}],
                max_tokens=24, temperature=0.7, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if choice.delta.content and first is None:
                        first = time.monotonic()
                    finish = choice.finish_reason or finish
            if finish is None or usage is None:
                self._error("chat stream", f"an incomplete stream (finish {finish}, usage {usage})")
                continue
            ttft = None if first is None else first - start
            self.record.chats.append(Chat(start, "stream", label, ttft, time.monotonic() - start))
            self._stop.wait(self.pause_s)

    def _chat_plain(self) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            label, model = self._models(turn)
            start = time.monotonic()
            reply = self._client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"What is {turn} plus {turn}?"}],
                max_tokens=16, temperature=0.0)
            if reply.choices[0].finish_reason not in ("stop", "length") or reply.choices[0].message.content is None:
                self._error("chat plain", f"an unfinished reply: {reply.choices[0]}")
                continue
            self.record.chats.append(Chat(start, "plain", label, None, time.monotonic() - start))
            self._stop.wait(self.pause_s)

    def _jobs(self) -> None:
        """One job after another: each must succeed; its model is chatted with from then on."""
        start = time.monotonic()
        job = self._client.fine_tuning.jobs.create(model=self.model, training_file=self.file_id, suffix="victim",
                                                   hyperparameters={"n_epochs": 2, "batch_size": 4},
                                                   extra_body={"lora": {"r": 4, "lora_alpha": 8}})
        while job.status not in TERMINAL:
            if self._stop.wait(1.0):
                try:
                    self._client.fine_tuning.jobs.cancel(job.id)
                except openai.BadRequestError:
                    pass  # it ended meanwhile
                ended = self._client.fine_tuning.jobs.retrieve(job.id)
                if ended.status == "cancelled":  # the soak ended it: its progress, not an error
                    self.record.jobs.append({"id": job.id, "phase": "end", "status": f"unfinished ({job.status})",
                                             "seconds": round(time.monotonic() - start, 1),
                                             "trained_tokens": job.trained_tokens or 0,
                                             "started_in": self.record.phase(start)})
                    return
            job = self._client.fine_tuning.jobs.retrieve(job.id)
        self.record.jobs.append({"id": job.id, "phase": self.record.phase(time.monotonic()), "status": job.status,
                                 "seconds": round(time.monotonic() - start, 1), "trained_tokens": job.trained_tokens,
                                 "started_in": self.record.phase(start)})
        if job.status != "succeeded":
            self._error("jobs", f"job {job.id} {job.status}: {job.error}")
            return
        self.fine_tuned = job.fine_tuned_model

    def _tinker(self) -> None:
        """forward_backward + optim_step + sample rounds; every 10 rounds a save, sampled from after."""
        service = tinker.ServiceClient(base_url=f"{self.url.removesuffix('/v1')}/tinker", api_key=self.tinker_key)
        try:
            run = self._result(service.create_lora_training_client(base_model=self.model, rank=4))
            sampler = self._result(service.create_sampling_client(base_model=self.model))
            datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                                loss_fn_inputs={"target_tokens": np.asarray(TOKENS[1:], np.int64),
                                                "weights": np.ones(len(TOKENS) - 1, np.float32)})
            rounds = 0
            while not self._stop.is_set():
                start = time.monotonic()
                out = self._result(run.forward_backward([datum], "cross_entropy"))
                assert len(out.loss_fn_outputs) == 1, out
                self._result(run.optim_step(types.AdamParams(learning_rate=1e-4)))
                sample = self._result(sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                                                     sampling_params=types.SamplingParams(max_tokens=4)))
                assert len(sample.sequences[0].tokens) >= 1, sample
                rounds += 1
                if rounds % 10 == 0:
                    path = self._result(run.save_weights_for_sampler(f"victim-{rounds}")).path
                    sampler = self._result(service.create_sampling_client(model_path=path))
                self.record.tinker_rounds.append((start, time.monotonic() - start))
        finally:
            service.close("success")


def _ms(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": _round(percentile_ms(values, 50)), "p99": _round(percentile_ms(values, 99))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def summarize(record: VictimRecord) -> dict[str, Any]:
    """Per phase: errors, chat TTFT and latency (p50/p99, ms), Tinker rounds; the jobs."""
    out: dict[str, Any] = {"errors": len(record.errors), "calls_cut_by_the_end": record.cut,
                           "error_examples": [f"{record.phase(t)} {where}: {what}" for t, where, what in
                                              record.errors[:8]], "jobs": record.jobs}
    for phase in ("quiet", "attack"):
        chats = [c for c in record.chats if record.phase(c.start) == phase]
        rounds = [s for t, s in record.tinker_rounds if record.phase(t) == phase]
        out[phase] = {
            "errors": sum(1 for t, _, _ in record.errors if record.phase(t) == phase),
            "chat_stream_ttft_ms": _ms([c.ttft_s for c in chats if c.ttft_s is not None]),
            "chat_stream_latency_ms": _ms([c.latency_s for c in chats if c.kind == "stream"]),
            "chat_plain_latency_ms": _ms([c.latency_s for c in chats if c.kind == "plain"]),
            "chats_with_fine_tuned_model": sum(1 for c in chats if c.model == "fine-tuned"),
            "tinker_rounds": len(rounds), "tinker_round_ms": _ms(rounds),
            "jobs_succeeded": sum(1 for j in record.jobs if j["phase"] == phase and j["status"] == "succeeded"),
        }
    return out
