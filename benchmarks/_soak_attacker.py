"""The attacker tenant of benchmarks/soak_tenants.py: every case of issue 45 in a loop, in four threads.

One thread sends the single requests of `coserve/bench/tenant_attacks.py` (python grader escapes, token
ids past the vocabulary, a zstd bomb, huge CSR shapes, poisoned uploads, big powers, thousands of graders,
ROUGE-L past its bound, names ending in a newline, telemetry past its caps, another tenant's file) one
after another; one wakes its idle Tinker runs (more than the engine has adapter slots) all at once, again
and again; one saves past its storage quota (the futures never read; the bytes on disk checked once its
run's next call is done); one floods `create_session` and `telemetry` and runs a DPO job on a poisoned
file. After each setsid grader: whether its grandchild outlived it. Each answer is counted as
`<status> <verdict>` per case."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
from tinker import types

from coserve.bench.grader_escapes import GRANDCHILD_TOKEN, EscapeTarget, alive
from coserve.bench.tenant_attacks import (
    TOKENS,
    TenantAttack,
    dpo_job_request,
    dpo_job_rows,
    escape_attacks,
    openai_attacks,
    tinker_attacks,
    verdict,
    zstd_bomb,
)

IDLE_RUNS = 8  # twice the engine's 4 adapter slots (the case)
ACCEPTABLE = ("refused", "refused-other", "contained", "served", "pending")  # pending: its own call, at the end
SESSION = {"tags": [], "sdk_version": "x"}
TELEMETRY = {"events": [], "platform": "x", "sdk_version": "x", "session_id": "s", "process_uuid": "p"}


def _datum() -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(TOKENS[1:], np.int64),
                                       "weights": np.ones(len(TOKENS) - 1, np.float32)})


class Attacker:
    """The attacker against `root` (`http://127.0.0.1:PORT`), its OpenAI key and its Tinker key."""

    def __init__(self, root: str, model: str, vocab: int, keys: tuple[str, str], target: EscapeTarget,
                 secrets: tuple[str, ...], victim_file: str, quota: int, data_dir: Path) -> None:
        self.root, self.model, self.quota, self.data_dir = root, model, quota, data_dir
        self.key, self.tinker_key = keys
        self.answers: dict[str, Counter[str]] = {}
        self.examples: dict[str, dict[str, str]] = {}
        self.timeline: list[tuple[float, float, str]] = []  # (start, end, case) of what it sent
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._http = httpx.Client(base_url=root, timeout=300)
        self._service = tinker.ServiceClient(base_url=f"{root}/tinker", api_key=self.tinker_key)
        self._run = self._service.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
        self._idle = [self._service.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
                      for _ in range(IDLE_RUNS)]
        self._saves, self._job, self._job_file, self._session = 0, None, None, "none"
        self.requests = {**escape_attacks(target, secrets), **openai_attacks(model, vocab, victim_file),
                         **tinker_attacks(self._run.model_id, vocab, zstd_bomb())}
        self._threads = [threading.Thread(target=self._loop, args=(loop,), daemon=True)
                         for loop in (self._requests, self._flows, self._wake_idle_runs, self._saves_past_quota)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=600)
        self._finish_job(final=True)
        self._check_grandchild()
        self._service.close("success")
        self._http.close()

    def _note(self, case: str, status: str, kind: str, text: str = "") -> None:
        with self._lock:
            self.answers.setdefault(case, Counter())[f"{status} {kind}"] += 1
            if text:
                self.examples.setdefault(case, {}).setdefault(f"{status} {kind}", text[:240])

    def _loop(self, round_: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                round_()
            except Exception as error:  # noqa: BLE001 - the attacker's own failure, reported
                self._note("attacker_loop", type(error).__name__, "attacker-error", str(error))
                self._stop.wait(1.0)

    def send(self, attack: TenantAttack) -> httpx.Response:
        tinker_path = attack.path.startswith("/tinker/")
        headers = {"X-API-Key": self.tinker_key} if tinker_path else {"Authorization": f"Bearer {self.key}"}
        if attack.upload is not None:
            return self._http.post(attack.path, headers=headers, data={"purpose": "fine-tune"},
                                   files={"file": ("train.jsonl", attack.upload)})
        headers["content-type"] = attack.content_type
        if attack.encoding:
            headers["content-encoding"] = attack.encoding
        return self._http.request(attack.method, attack.path, headers=headers, content=attack.content)

    def _requests(self) -> None:
        for name, attack in self.requests.items():
            if self._stop.is_set():
                return
            start = time.monotonic()
            try:
                answer = self.send(attack)
                self.timeline.append((start, time.monotonic(), name))
            except httpx.HTTPError as error:
                self._note(name, f"connection: {type(error).__name__}", "server_error", str(error))
                continue
            try:
                body = answer.json()
            except ValueError:
                body = None
            self._note(name, str(answer.status_code), verdict(attack, answer.status_code, body), answer.text)
            if name == "grader_setsid_grandchild":
                self._check_grandchild()

    def _check_grandchild(self) -> None:
        time.sleep(0.3)
        left = alive(GRANDCHILD_TOKEN)
        self._note("grader_setsid_grandchild_outlived", "alive" if left else "none",
                   "ESCAPED" if left else "contained", str(left) if left else "")

    def _flows(self) -> None:
        for flow in (self._session_flood, self._telemetry_flood, self._dpo_job):
            if self._stop.is_set():
                return
            start = time.monotonic()
            flow()
            self.timeline.append((start, time.monotonic(), flow.__name__.strip("_")))

    def _failed(self, case: str, error: Exception) -> None:
        if isinstance(error, tinker.APIStatusError):
            kind = "refused" if 400 <= error.status_code < 500 else "server_error"
            self._note(case, str(error.status_code), kind, str(error))
        else:  # a failed future: the attacker's own call failed
            self._note(case, type(error).__name__, "failed", str(error))

    def _wait(self, case: str, future: Any) -> None:
        """The answer of one of its calls, however long it takes, until the soak ends (then: pending)."""
        while True:
            try:
                future.result(timeout=5)
            except TimeoutError:
                if self._stop.is_set():
                    self._note(case, "pending at the end", "pending")
                    return
                continue
            except Exception as error:  # noqa: BLE001 - reported
                self._failed(case, error)
                return
            self._note(case, "ok", "served")
            return

    def _wake_idle_runs(self) -> None:
        """The idle runs all call forward_backward at once; each must be served (slots shared, not held)."""
        futures = [run.forward_backward([_datum()], "cross_entropy") for run in self._idle]
        for future in futures:
            self._wait("idle_runs_wake_all_at_once", future)

    def _post(self, case: str, path: str, body: dict[str, Any]) -> httpx.Response:
        answer = self._http.post(path, headers={"X-API-Key": self.tinker_key}, json=body)
        kind = "served" if answer.status_code == 200 else verdict(TenantAttack("POST", path), answer.status_code,
                                                                  None)
        self._note(case, str(answer.status_code), kind, "" if answer.status_code == 200 else answer.text)
        return answer

    def _saves_past_quota(self) -> None:
        """Saves with unread futures until one is refused, then the bytes on disk against the quota, then
        every save deleted (the SDK's checkpoint deletion) for the next round."""
        for _ in range(6):
            self._saves += 1
            if self._post("saves_past_quota", "/tinker/api/v1/save_weights_for_sampler",
                          {"model_id": self._run.model_id, "path": f"q{self._saves}"}).status_code != 200:
                break
        self._wait("saves_then_forward", self._run.forward([_datum()], "cross_entropy"))
        if self._stop.is_set():
            return
        saved = self.data_dir / "runs" / self._run.model_id / "sampler_weights"
        names = sorted(p.name for p in saved.iterdir()) if saved.is_dir() else []
        stored = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) if saved.is_dir() else 0
        within = stored <= self.quota
        self._note("saves_on_disk_within_quota", f"{len(names)} kept" if within else "over",
                   "contained" if within else "ESCAPED",
                   "" if within else f"{stored} bytes in {names}, quota {self.quota}")
        rest = tinker.RestClient(base_url=f"{self.root}/tinker", api_key=self.tinker_key)
        for name in names:
            self._wait("delete_checkpoint", rest.delete_checkpoint(self._run.model_id, f"sampler_weights/{name}"))

    def _session_flood(self) -> None:
        """80 sessions (the cap is 64 open), then 40 sampling sessions on one of them."""
        for _ in range(80):
            answer = self._post("create_session_flood", "/tinker/api/v1/create_session", SESSION)
            if answer.status_code == 200:
                self._session = answer.json().get("session_id", self._session)
        for seq in range(40):  # on the last session it opened (gone 120 s after: a 404)
            self._post("create_sampling_session_flood", "/tinker/api/v1/create_sampling_session",
                       {"session_id": self._session, "base_model": self.model, "sampling_session_seq_id": seq})

    def _telemetry_flood(self) -> None:
        for _ in range(40):
            self._post("telemetry_flood", "/tinker/api/v1/telemetry", TELEMETRY)

    def _dpo_job(self) -> None:
        """A DPO job on a file that passes upload and cannot train; the next one once it has ended."""
        if self._job is not None:
            self._finish_job(final=False)
            return
        headers = {"Authorization": f"Bearer {self.key}"}
        upload = self._http.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                                 files={"file": ("dpo.jsonl", dpo_job_rows())})
        if upload.status_code != 200:
            self._note("dpo_job_poisoned", f"upload {upload.status_code}", "refused", upload.text)
            return
        self._job_file = upload.json()["id"]
        created = self._http.post("/v1/fine_tuning/jobs", headers=headers,
                                  json=dpo_job_request(self.model, self._job_file))
        if created.status_code != 200:
            self._note("dpo_job_poisoned", f"create {created.status_code}",
                       "refused" if created.status_code < 500 else "server_error", created.text)
            return
        self._job = created.json()["id"]

    def _finish_job(self, final: bool) -> None:
        if self._job is None:
            return
        headers = {"Authorization": f"Bearer {self.key}"}
        job = self._http.get(f"/v1/fine_tuning/jobs/{self._job}", headers=headers).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            error = job.get("error") or {}
            self._note("dpo_job_poisoned", f"job {job['status']} ({error.get('code')})", "contained",
                       error.get("message") or "")
        elif not final:
            return
        else:
            self._note("dpo_job_poisoned", f"job {job['status']} at the end", "contained")
            self._http.post(f"/v1/fine_tuning/jobs/{self._job}/cancel", headers=headers)
        self._http.delete(f"/v1/files/{self._job_file}", headers=headers)
        self._job = None

    def in_flight(self, start: float, end: float) -> list[str]:
        """The cases it was sending between `start` and `end` (the requests thread's and the floods')."""
        return sorted({case for begun, ended, case in list(self.timeline) if begun < end and ended > start})

    def summary(self) -> dict[str, Any]:
        """Per case: its answers; the cases with an answer that is neither a refusal nor contained."""
        with self._lock:
            answers = {name: dict(counts) for name, counts in sorted(self.answers.items())}
            bad = sorted(name for name, counts in answers.items()
                         if any(key.rsplit(" ", 1)[-1] not in ACCEPTABLE for key in counts))
            return {"cases": len(answers), "not_refused_or_contained": bad, "answers": answers,
                    "examples": self.examples}
