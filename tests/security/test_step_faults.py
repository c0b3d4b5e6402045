"""An engine step that fails because of one tenant's work fails that work alone (issue 45, the second line
of defence behind the edge's checks), through the real server (`coserve serve --local` on the tiny llama,
in a thread) and the official clients.

The fault is any error below the edge's validation: here the engine's forward runs whole and then raises
IndexError (what an out-of-vocabulary id raised before the edge refused them) whenever the ATTACKER's
poison token is in its batch. The VICTIM's completions, co-batched with it, finish with the same greedy
tokens as before the attack and no error; its Tinker run trains on. The attacker's request ends with its
own error (a 500 saying the engine could not run it), which no other tenant sees; its failed training
call resolves with its own error, leaves no gradient behind, and its run takes further calls. `/health`
answers within 1 s throughout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from safetensors.torch import load_file

from coserve.forward.transformer import Transformer
from local_server import LocalServer, local_server, scrape

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

ATTACKER, VICTIM = "tml-step-attacker-0123456789", "tml-step-victim-0123456789"
HEALTH_BOUND_S = 1.0
PROMPTS = [list(range(40 + 7 * i, 52 + 7 * i)) for i in range(3)]  # the victim's, as token ids
TOKENS = list(range(5, 37))  # the Tinker runs' data
FAULT = "IndexError: index out of range in self"
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class Poison:
    """The engine's forward raises after it ran whole when `token` is in its batch (None: never)."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.fired = 0

    def wrap(self, real: Any) -> Any:
        def forward(model: Transformer, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            hidden = real(model, batch, *args, **kwargs)
            if self.token is not None and bool((batch.token_ids == self.token).any()):
                self.fired += 1
                raise IndexError("index out of range in self")
            return hidden
        return forward


@pytest.fixture(scope="module")
def poison() -> Iterator[Poison]:
    poison = Poison()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Transformer, "forward", poison.wrap(Transformer.forward))
        yield poison


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("step-faults")


@pytest.fixture(scope="module")
def server(llama_dir: Path, root: Path, poison: Poison) -> Iterator[LocalServer]:
    tenants = {"attacker": {"api_keys": [ATTACKER]}, "victim": {"api_keys": [VICTIM]}}
    with local_server(llama_dir, root, tenants) as srv:
        yield srv


class Health:
    """`/health` polled every 50 ms in a thread; its slowest answer."""

    def __init__(self, url: str) -> None:
        self._url, self._stop = url, threading.Event()
        self.slowest, self.failures, self.polls = 0.0, [], 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(0.05):
                started = time.perf_counter()
                status = http.get(f"{self._url}/health").status_code
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.polls += 1
                if status != 200:
                    self.failures.append(status)

    def check(self) -> None:
        self._stop.set()
        self._thread.join()
        assert self.polls > 0 and not self.failures, self.failures
        assert self.slowest < HEALTH_BOUND_S, f"/health took {self.slowest:.2f} s"


@contextmanager
def health(server: LocalServer) -> Iterator[None]:
    watch = Health(server.url)
    yield
    watch.check()


@contextmanager
def service(server: LocalServer, key: str) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=key)
    try:
        yield client
    finally:
        client.close("success").result()


def shifted(tokens: list[int]) -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                       "weights": np.ones(len(tokens) - 1, np.float32)})


def complete(server: LocalServer, key: str, prompt: list[int], max_tokens: int = 24) -> str:
    """A greedy completion of a token-id prompt."""
    reply = server.client(key).completions.create(model=server.base, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0)
    assert reply.choices[0].finish_reason == "length", reply
    return reply.choices[0].text


def unseen_token(model: Path, texts: list[str]) -> int:
    """A token whose text (plain letters, 3 or more) is in none of `texts`: none of them sampled it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    for token in range(tokenizer.get_vocab_size() - 1, 0, -1):
        piece = tokenizer.decode([token])
        if len(piece.strip()) >= 3 and piece.strip().isalpha() and not any(piece in t for t in texts):
            return token
    raise AssertionError("no unseen token")


def saved(root: Path, path: str) -> Path:
    """The weights file of a saved path (`<data dir>/runs/<run>/<kind>/<name>`)."""
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    return root / "data" / "runs" / run_id / kind / name / "adapter_model.safetensors"


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_an_attackers_step_fault_fails_only_the_attacker(server: LocalServer, poison: Poison,
                                                         llama_dir: Path) -> None:
    before = {i: complete(server, VICTIM, p) for i, p in enumerate(PROMPTS)}
    token = unseen_token(llama_dir, list(before.values()))
    poison.token, fired = token, poison.fired
    retries = metric(scrape(server.url), "coserve_engine_step_retries_total")
    victim_errors: list[str] = []
    attacker_errors: list[openai.APIStatusError] = []

    def victim(i: int) -> str:
        try:
            return complete(server, VICTIM, PROMPTS[i])
        except openai.APIError as error:
            victim_errors.append(str(error))
            raise

    def attacker() -> None:
        with pytest.raises(openai.InternalServerError) as refused:
            complete(server, ATTACKER, [60, 61, token, 62], max_tokens=4)
        attacker_errors.append(refused.value)

    with health(server), ThreadPoolExecutor(12) as pool:
        victims = [pool.submit(victim, i % 3) for i in range(9)]
        time.sleep(0.05)  # the victims run: the attacker's requests join their batches
        attacks = [pool.submit(attacker) for _ in range(3)]
        [a.result() for a in attacks]
        outputs = [v.result() for v in victims]
    assert victim_errors == []
    assert outputs == [before[i % 3] for i in range(9)]  # greedy, token for token
    assert len(attacker_errors) == 3 and poison.fired > fired
    for error in attacker_errors:
        assert error.status_code == 500
        assert error.message.endswith(f"The engine could not run this request: {FAULT}"), error.message
    text = scrape(server.url)
    assert metric(text, "coserve_engine_step_retries_total") > retries  # it was co-batched, and isolated
    assert metric(text, 'coserve_engine_step_faults_total{engine="engine-0",work="request"}') >= 3
    poison.token = None


def test_a_failed_training_call_leaves_no_gradient_and_its_run_goes_on(server: LocalServer, poison: Poison,
                                                                     root: Path) -> None:
    """The attacker's call whose second datum faults (after its first trained) fails with its own error; the
    run's next calls train as if it had never been made (its saved weights equal a run without it), and the
    victim's Tinker run beside it trains with no error."""
    token = 3
    poison.token = token
    adam = types.AdamParams(learning_rate=5e-2)
    good, other = shifted(TOKENS), shifted(TOKENS[4:28])
    bad = shifted(TOKENS[:10] + [token] + TOKENS[10:20])
    with health(server), service(server, ATTACKER) as attacker, service(server, VICTIM) as victim:
        clean = attacker.create_lora_training_client(base_model=server.base, rank=4, seed=1).result()
        hit = attacker.create_lora_training_client(base_model=server.base, rank=4, seed=1).result()
        mine = victim.create_lora_training_client(base_model=server.base, rank=4).result()
        with ThreadPoolExecutor(2) as pool:
            victim_loop = pool.submit(lambda: [(mine.forward_backward([good, other], "cross_entropy").result(),
                                                mine.optim_step(adam).result()) for _ in range(3)])
            clean.forward_backward([good], "cross_entropy").result()
            clean.forward_backward([other], "cross_entropy").result()
            clean.optim_step(adam).result()
            hit.forward_backward([good], "cross_entropy").result()
            with pytest.raises(Exception) as failed:  # noqa: PT011 - the SDK's error for a failed future
                hit.forward_backward([other, bad], "cross_entropy").result()
            assert f"the engine could not run this call: {FAULT}" in str(failed.value), failed.value
            hit.forward_backward([other], "cross_entropy").result()  # the run takes further calls
            hit.optim_step(adam).result()
            assert len(victim_loop.result()) == 3
        want = clean.save_weights_for_sampler("w").result().path
        got = hit.save_weights_for_sampler("w").result().path
    poison.token = None
    a, b = load_file(str(saved(root, want))), load_file(str(saved(root, got)))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-7)
