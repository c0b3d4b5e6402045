"""The Tinker API driven by the official `tinker` SDK (0.38), unmodified, against a real server on the
tiny llama: supervised and RL loops, log-probs and gradients against transformers + peft, exact resume,
tenant isolation, and refusals."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from local_server import LocalServer, local_server
from numerics import sum_rel

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

KEY, OTHER = "tml-tenant-a-0123456789", "tml-tenant-b-0123456789"
LIMITED = "tml-tenant-c-0123456789"  # one concurrent run, 60 trained tokens per run, little storage
TOKENS = list(range(5, 45))  # a sequence the runs learn
LR, EPS = 1e3, 1e3  # one AdamW step that reads back the gradient (test_the_gradient_...)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinker")


@pytest.fixture(scope="module")
def server(llama_dir: Path, root: Path) -> Iterator[LocalServer]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    tenants = {"a": {"api_keys": [KEY]}, "b": {"api_keys": [OTHER]},
               "c": {"api_keys": [LIMITED], "limits": {"max_concurrent_jobs": 1, "max_training_tokens_per_job": 60,
                                                      "max_stored_bytes": 100_000}}}
    with local_server(llama_dir, root, tenants) as srv:
        yield srv


@pytest.fixture
def sc(server: LocalServer) -> Iterator[Any]:
    """Tenant a's ServiceClient for one test."""
    with service(server) as client:
        yield client


@contextmanager
def service(server: LocalServer, key: str = KEY) -> Iterator[Any]:
    """A ServiceClient, closed at the end (its session's runs end and free their adapter slots)."""
    client = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=key)
    try:
        yield client
    finally:
        client.close("success").result()


def datum(tokens: list[int], weights: list[float] | None = None) -> Any:
    """A datum the way tinker-cookbook builds one: inputs, targets shifted by one, weights."""
    w = np.ones(len(tokens) - 1, dtype=np.float32) if weights is None else np.asarray(weights[1:], np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": w})


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "adapter_model.safetensors"))


def run_folder(root: Path, path: str) -> Path:
    """Where the server keeps a saved path (`<data dir>/runs/<run>/<kind>/<name>`)."""
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    return root / "data" / "runs" / run_id / kind / name


def test_a_supervised_loop_trains_saves_and_samples(server: LocalServer, sc: Any) -> None:
    tc = sc.create_lora_training_client(base_model=server.base, rank=8).result()
    batch = [datum(TOKENS[:20]), datum(TOKENS[10:40])]
    losses = []
    for step in range(8):
        fb = tc.forward_backward(batch, loss_fn="cross_entropy")
        optim = tc.optim_step(types.AdamParams(learning_rate=2e-2 * (1 - step / 10), beta1=0.9, beta2=0.95, eps=1e-8))
        result, stepped = fb.result(), optim.result()
        logprobs = [out["logprobs"].to_numpy() for out in result.loss_fn_outputs]
        weights = [d.loss_fn_inputs["weights"].to_numpy() for d in batch]
        total = sum(w.sum() for w in weights)
        nll = -sum(float(np.dot(lp, w)) for lp, w in zip(logprobs, weights, strict=True)) / total
        # the server's sum against numpy's over the same fp32 log-probs: a <= 29-term sum (numerics.sum_rel)
        assert result.metrics["loss:sum"] == pytest.approx(nll * total, rel=sum_rel(29))
        assert [len(lp) for lp in logprobs] == [19, 29]
        assert stepped.metrics is not None and stepped.metrics["step:max"] == step + 1
        losses.append(nll)
    assert losses[-1] < 0.5 * losses[0], losses
    saved = tc.save_weights_for_sampler("final").result()
    sampler = sc.create_sampling_client(model_path=saved.path).result()
    out = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[10:16]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in out.sequences)
    assert out.sequences[0].tokens[:3] == TOKENS[16:19]  # it learned the sequence
    # The same weights are an OpenAI model id at once.
    model_id = "tinker:" + saved.path.removeprefix("tinker://").replace("/sampler_weights/", ":")
    reply = server.client(KEY).completions.create(
        model=model_id, prompt="hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text is not None


def test_forward_logprobs_equal_the_reference_model(server: LocalServer, sc: Any, llama_dir: Path) -> None:
    """A fresh LoRA (B = 0) is the base model: forward's log-probs equal transformers' on every token."""
    from transformers import AutoModelForCausalLM

    tc = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    tokens = TOKENS[:33]
    result = tc.forward([datum(tokens)], "cross_entropy").result()
    mine = result.loss_fn_outputs[0]["logprobs"].to_numpy()
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    # test_parity's bound for one token's log-prob: 1e-5 of the logits' span (~+-100 for the tiny models)
    np.testing.assert_allclose(mine, ref, atol=2e-4)


def test_the_gradient_equals_the_full_sequence_reference(server: LocalServer, sc: Any, llama_dir: Path,
                                                         root: Path) -> None:
    """AdamW's first step from a known adapter moves each weight by -lr * g / (|g| + eps): with a large
    eps the gradient g of every LoRA weight, A and B, reads back from the saved weights, and equals
    peft's full-sequence backward (a sequence longer than one forward window, weights, two data) to a
    relative error of 1e-4 per tensor (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    first.forward_backward([datum(TOKENS[:12])], "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    start = first.save_weights_for_sampler("start").result().path  # B != 0 now
    tc = sc.create_training_client_from_state(start).result()
    long_seq = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=300)]
    weights = [0.0] * 40 + [1.0] * 200 + [0.5] * 60
    data = [datum(long_seq, weights), datum(TOKENS[:25])]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=EPS)).result()
    end = tc.save_weights_for_sampler("end").result().path
    before, after = adapter_tensors(run_folder(root, start)), adapter_tensors(run_folder(root, end))

    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run_folder(root, start)), is_trainable=True)
    loss = torch.zeros(())
    for tokens, w in ((long_seq, weights), (TOKENS[:25], [1.0] * 25)):
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        loss = loss - (logprobs * torch.tensor(w[1:])).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(before) > 0
    for name, grad in grads.items():  # each tensor's gradient, read back: d = -lr g / (|g| + eps)
        key = name.replace(".default", "")
        moved = after[key].double() - before[key].double()
        mine = -EPS * moved / (LR - moved.abs())
        error = ((mine - grad.double()).norm() / grad.double().norm()).item()
        assert error < 1e-4, (key, error)



def test_save_state_then_load_state_resumes_bit_identical(server: LocalServer, sc: Any, root: Path) -> None:
    """A run loaded from a saved state holds it bit for bit (adapter, AdamW moments, step), and the same
    two steps from it land where the original run's did (to fp32 rounding: the scheduler may cut the
    forward windows differently, which changes the order of float sums, not the math)."""
    tc = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    adam = types.AdamParams(learning_rate=1e-2)

    def steps(client: Any, name: str) -> str:
        for k in range(2):
            client.forward_backward([datum(TOKENS[k:k + 20])], "cross_entropy").result()
            client.optim_step(adam).result()
        return str(client.save_weights_for_sampler(name).result().path)

    steps(tc, "before")
    state = tc.save_state("mid").result().path
    straight = steps(tc, "straight")
    loaded = sc.create_training_client_from_state_with_optimizer(state).result()
    assert loaded.model_id != tc.model_id
    again = loaded.save_state("reloaded").result().path
    saved, reloaded = run_folder(root, state), run_folder(root, again)
    assert (saved / "adapter_model.safetensors").read_bytes() == (reloaded / "adapter_model.safetensors").read_bytes()
    moments = [torch.load(f / "optimizer.pt", weights_only=True) for f in (saved, reloaded)]
    assert moments[0]["step_count"] == moments[1]["step_count"] == 2
    for s0, s1 in zip(moments[0]["adamw"]["state"].values(), moments[1]["adamw"]["state"].values(), strict=True):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)
    resumed = steps(loaded, "resumed")
    a, b = adapter_tensors(run_folder(root, straight)), adapter_tensors(run_folder(root, resumed))
    for key in a:  # the same steps, kernels and batches from the same state: only thread scheduling differs
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    listed = sc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    assert {(c.checkpoint_type, c.tinker_path) for c in listed} >= {("training", state), ("sampler", straight)}


def test_tenants_cannot_see_or_load_each_others_runs(server: LocalServer, sc: Any) -> None:
    mine = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    future = mine.forward_backward([datum(TOKENS[:10])], "cross_entropy")
    future.result()
    mine.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler_path = mine.save_weights_for_sampler("private").result().path
    state_path = mine.save_state("private-state").result().path
    headers = {"X-API-Key": OTHER}
    base = f"{server.url}/tinker/api/v1"
    import httpx

    assert httpx.post(f"{base}/get_info", json={"model_id": mine.model_id}, headers=headers).status_code == 404
    assert httpx.get(f"{base}/training_runs/{mine.model_id}/checkpoints", headers=headers).status_code == 404
    with service(server, OTHER) as theirs:
        with pytest.raises(tinker.APIStatusError) as refused:
            theirs.create_training_client_from_state(state_path).result()
        assert refused.value.status_code == 404
        with pytest.raises(tinker.APIStatusError):
            theirs.create_sampling_client(model_path=sampler_path).result().sample(
                prompt=types.ModelInput.from_ints([5, 6]), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=2)).result()
    session = httpx.post(f"{base}/create_session", json={"tags": [], "sdk_version": "x"}, headers=headers).json()
    submitted = httpx.post(f"{base}/optim_step", headers=headers, json={
        "model_id": mine.model_id, "adam_params": {"learning_rate": 1e-3}, "seq_id": 99})
    assert submitted.status_code == 404 and session["session_id"]
    model_id = "tinker:" + sampler_path.removeprefix("tinker://").replace("/sampler_weights/", ":")
    with pytest.raises(Exception, match="does not exist|not found|model_not_found"):
        server.client(OTHER).completions.create(model=model_id, prompt="hi", max_tokens=2)


def test_an_rl_loop_raises_a_verifiable_reward(server: LocalServer, sc: Any) -> None:
    """tinker-cookbook's basic RL loop: sample a group per prompt, reward, center the rewards in the group,
    train with importance_sampling on the sampler's log-probs, optim_step. Reward: the share of the 4
    sampled tokens whose id is even."""
    tc = sc.create_lora_training_client(base_model=server.base, rank=8).result()
    prompt = types.ModelInput.from_ints([5, 6])
    rewards = []
    for _ in range(10):
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(prompt=prompt, num_samples=8,
                             sampling_params=types.SamplingParams(max_tokens=4, temperature=1.5)).result()
        reward = np.array([sum(t % 2 == 0 for t in s.tokens) / 4 for s in out.sequences])
        rewards.append(float(reward.mean()))
        advantages = reward - reward.mean()
        data = []
        for seq, advantage in zip(out.sequences, advantages, strict=True):
            tokens = [5, 6, *seq.tokens]
            n = len(seq.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], np.int64),
                "logprobs": np.asarray([0.0] + list(seq.logprobs), np.float32),
                "advantages": np.asarray([0.0] + [advantage] * n, np.float32)}))
        if np.any(advantages):
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.2, rewards


def test_what_coserve_cannot_train_is_refused(server: LocalServer, sc: Any) -> None:
    import httpx

    tc = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    shifted_wrong = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                                loss_fn_inputs={"target_tokens": np.asarray([9, 9, 9], np.int64),
                                                "weights": np.ones(3, np.float32)})
    with pytest.raises(tinker.BadRequestError, match="shifted by one"):
        tc.forward_backward([shifted_wrong], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="Unknown loss_fn"):
        tc.forward_backward([datum(TOKENS[:5])], "dro").result()
    with pytest.raises(tinker.RequestFailedError, match="no gradient"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    missing = httpx.post(f"{server.url}/tinker/api/v1/unload_model", headers={"X-API-Key": KEY}, json={})
    assert missing.status_code == 404 and "unload_model" in missing.json()["error"]["message"]
    unknown = httpx.post(f"{server.url}/tinker/api/v1/optim_step", headers={"X-API-Key": KEY}, json={
        "model_id": tc.model_id, "adam_params": {"learning_rate": 1e-3}, "dimuon": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "dimuon"
    assert httpx.post(f"{server.url}/tinker/api/v1/get_info", json={"model_id": tc.model_id}).status_code == 401


def test_runs_hold_adapter_slots_only_for_their_calls(server: LocalServer) -> None:
    """Six runs against the engine's four adapter slots, each doing calls in turn: every call is done (a
    run between calls gives its slot back, its state kept, and takes one again for its next call), and
    another tenant's chat with a sampler's weights is served meanwhile."""
    with service(server) as holder, service(server, OTHER) as other:
        runs = [holder.create_lora_training_client(base_model=server.base, rank=2).result() for _ in range(6)]
        mine = other.create_lora_training_client(base_model=server.base, rank=2).result()
        mine.forward_backward([datum(TOKENS[:8])], "cross_entropy").result()
        model = "tinker:" + mine.save_weights_for_sampler("served").result().path.removeprefix(
            "tinker://").replace("/sampler_weights/", ":")
        for _ in range(2):
            for run in runs:
                run.forward_backward([datum(TOKENS[:8])], "cross_entropy").result()
            reply = server.client(OTHER).completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
            assert reply.choices[0].text is not None
        for run in runs:  # each run's gradient came back with it: two calls' worth, one step
            assert run.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["step:max"] == 1


def test_a_tenants_quotas_apply_to_its_runs(server: LocalServer, root: Path) -> None:
    """Concurrent runs count against max_concurrent_jobs, trained tokens against
    max_training_tokens_per_job, saved weights against max_stored_bytes (removed when over it)."""
    with service(server, LIMITED) as limited:
        tc = limited.create_lora_training_client(base_model=server.base, rank=4).result()
        with pytest.raises(tinker.APIStatusError, match="max_concurrent_jobs|at once"):
            limited.create_lora_training_client(base_model=server.base, rank=4).result()
        tc.forward_backward([datum(TOKENS[:40])], "cross_entropy").result()
        with pytest.raises(tinker.APIStatusError, match="max_training_tokens_per_job"):
            tc.forward_backward([datum(TOKENS[:30])], "cross_entropy").result()
        first = tc.save_weights_for_sampler("fits").result().path  # about 68 kB at rank 4
        assert run_folder(root, first).is_dir()
        with pytest.raises(tinker.RequestFailedError, match="max_stored_bytes"):
            tc.save_weights_for_sampler("over").result()
        assert not run_folder(root, first.replace("/fits", "/over")).exists()


def test_forward_backward_custom_trains_the_users_loss(server: LocalServer, sc: Any, root: Path) -> None:
    """The SDK's custom loss: `forward`, the user's loss on the client, its gradient sent back as
    cross-entropy weights. A loss of -2 x the weighted log-probs moves the weights exactly as
    cross-entropy with weights 2 does (two runs from the same saved adapter, the same AdamW step)."""
    first = sc.create_lora_training_client(base_model=server.base, rank=4).result()
    first.forward_backward([datum(TOKENS[:12])], "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    start = first.save_weights_for_sampler("custom-start").result().path

    def doubled(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-2.0 * (lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs))
        return loss, {"doubled:sum": float(loss.detach())}

    custom = sc.create_training_client_from_state(start).result()
    result = custom.forward_backward_custom([datum(TOKENS[3:30])], doubled).result()
    assert result.metrics["loss:sum"] == pytest.approx(result.metrics["doubled:sum"])  # the same float, echoed
    custom.optim_step(types.AdamParams(learning_rate=LR, eps=EPS)).result()
    reference = sc.create_training_client_from_state(start).result()
    reference.forward_backward([datum(TOKENS[3:30], [2.0] * 27)], "cross_entropy").result()
    reference.optim_step(types.AdamParams(learning_rate=LR, eps=EPS)).result()
    a = adapter_tensors(run_folder(root, custom.save_weights_for_sampler("custom").result().path))
    b = adapter_tensors(run_folder(root, reference.save_weights_for_sampler("weighted").result().path))
    for key in a:  # one Adam step from gradients equal to GRAD_REL_ERR: the same relative step (numerics)
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
