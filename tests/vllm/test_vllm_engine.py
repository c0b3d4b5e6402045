"""The vLLM engine against coserve's own: greedy parity (tiny model, chunked prefill, a LoRA adapter),
zero-copy weights, the trainer's gradient on vLLM's weights, offline fine-tuning served by vLLM, the
profiler's sweep, and the bad inputs (vLLM missing or of another version). Structured output is in
test_vllm_structured.py; a model vLLM cannot load and SmolLM2 are in test_vllm_models.py (another vLLM
engine: not while this one lives)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from numerics import GRAD_REL_ERR, assert_adam_weights_close
from vllm_support import TEST_KV_GB, require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from coserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from coserve.contract.loss_spec import LossKind, LossSpec  # noqa: E402
from coserve.contract.training_settings import TARGET_MODULES, LoRASettings  # noqa: E402
from coserve.finetune.rollout_batches import fed_batches  # noqa: E402
from coserve.forward.transformer import Transformer  # noqa: E402
from coserve.model.tiny_model import create_random_adapter  # noqa: E402
from coserve.trainer.lora_params import TrainableLoRA  # noqa: E402
from coserve.trainer.windowed import WindowedTrainer, train_sequence  # noqa: E402
from coserve.vllm.backend import INSTALL_COMMAND, VllmUnavailable, check_vllm  # noqa: E402

# Small batches: prompts longer than 48 tokens are prefilled in several chunks on both engines.
SIZES = {"dtype": "float32", "max_num_seqs": 8, "max_batch_tokens": 48}
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 97, 130)]


@pytest.fixture(scope="module")
def vllm_llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), engine="vllm", kv_cache_memory_gb=TEST_KV_GB, max_lora_rank=16, **SIZES)


@pytest.fixture(scope="module")
def native_llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), max_lora_rank=16, **SIZES)


def test_greedy_parity_with_logprobs(vllm_llm: LLM, native_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    ours, theirs = native_llm.generate(PROMPTS, params), vllm_llm.generate(PROMPTS, params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(la) == list(lb)  # the same top-3 ids, in order
            # two fp32 engines' log-probs: test_parity's 1e-5 of the logits' span (~100 for the tiny models)
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-3 and la[t].rank == lb[t].rank for t in la)
    # coserve's scheduler, not vLLM's, decides when an output ends: stop ids, max_tokens, n.
    stop = theirs[1].outputs[0].token_ids[5]
    out = vllm_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], n=2))
    assert [o.token_ids for o in out[0].outputs] == [theirs[1].outputs[0].token_ids[:6]] * 2
    assert out[0].outputs[0].finish_reason == "stop"
    assert vllm_llm.engine.num_sequences == 0  # finished requests were freed in vLLM


def test_sampling_settings_reach_vllm(vllm_llm: LLM) -> None:
    """Seeds, penalties and logit_bias are vLLM's: a seed repeats, a +100 bias forces its token."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, frequency_penalty=0.5)
    a, b = vllm_llm.generate(PROMPTS[:2], seeded), vllm_llm.generate(PROMPTS[1:2], seeded)
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    # A prompt of 130 tokens in chunks of 48: the chunks inside the prompt sample too, and vLLM discards
    # those tokens and rewinds the generator (a CPU generator's state here). Alone, batched with another
    # long prompt, and again with its prefix cached, it is chunked differently and gets the same tokens.
    runs = [vllm_llm.generate(PROMPTS[3:], seeded)[0], vllm_llm.generate(PROMPTS[2:], seeded)[1],
            vllm_llm.generate(PROMPTS[3:], seeded)[0]]
    assert [r.outputs[0].token_ids for r in runs[1:]] == [runs[0].outputs[0].token_ids] * 2
    forced = vllm_llm.generate(PROMPTS[0], SamplingParams(temperature=0.7, max_tokens=5, logit_bias={77: 100}))
    assert forced[0].outputs[0].token_ids == [77] * 5


def test_lora_adapter_parity(vllm_llm: LLM, native_llm: LLM, llama_dir: Path, tmp_path: Path) -> None:
    adapter = create_random_adapter(llama_dir, tmp_path / "a", seed=1, b_std=0.2, r=8, lora_alpha=16,
                                    target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=16)
    base = vllm_llm.generate(PROMPTS, params)
    ours = native_llm.generate(PROMPTS, params, lora_request=[lora, None, lora, lora])
    theirs = vllm_llm.generate(PROMPTS, params, lora_request=[lora, None, lora, lora])
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert theirs[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter did something


def test_trainer_weights_are_views_of_vllms(vllm_llm: LLM) -> None:
    weights = vllm_llm.engine.model.weights
    vllm_params = {p.data_ptr() for p in vllm_llm.engine.runtime.llm.llm_engine.engine_core.engine_core
                   .model_executor.driver_worker.worker.model_runner.model.parameters()}
    layer = weights.layers[0]
    for tensor in (weights.embed, weights.final_norm, layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w,
                   layer.input_norm, layer.post_norm):
        assert tensor.data_ptr() in vllm_params


def test_lora_gradient_on_vllm_weights_equals_native(vllm_llm: LLM, native_llm: LLM) -> None:
    cfg = native_llm.engine.model_config
    settings = LoRASettings(r=8, lora_alpha=16, target_modules=TARGET_MODULES)
    grads = []
    for model in (native_llm.engine.model, vllm_llm.engine.model):
        assert isinstance(model, Transformer)
        lora = TrainableLoRA.init(cfg, settings, seed=5)
        g = torch.Generator().manual_seed(6)
        for b in lora.b.values():  # B = 0 would leave A without a gradient
            b.data.copy_(torch.randn(b.shape, generator=g) * 0.05)
        ids = torch.arange(7, 7 + 45)
        trained = torch.arange(45) >= 10
        train_sequence(WindowedTrainer(model, lora), ids, trained, forward_windows=[16, 16, 13])
        grads.append(torch.cat([p.grad.flatten() for p in lora.parameters()]))
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert grads[0].norm() > 0 and rel <= GRAD_REL_ERR, rel  # numerics.GRAD_REL_ERR, in the 2-norm


def _examples(n: int = 10) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Say the word number {i}."},
                          {"role": "assistant", "content": f"Word {i}: banana {i * 7}."}]} for i in range(n)]


def test_offline_fine_tune_on_vllm_is_served_by_vllm(vllm_llm: LLM, native_llm: LLM, tmp_path: Path) -> None:
    """The same job trained on both engines gives the same adapter (same trainer, same weights), and
    vLLM serves the adapter it trained exactly as coserve's engine serves it."""
    hyper, lora = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 10.0}, {"r": 8, "lora_alpha": 16}
    theirs = vllm_llm.fine_tune(_examples(), str(tmp_path / "v"), hyperparameters=hyper, lora=lora, seed=2)
    ours = native_llm.fine_tune(_examples(), str(tmp_path / "n"), hyperparameters=hyper, lora=lora, seed=2)
    from safetensors.torch import load_file

    a = load_file(str(Path(ours.adapter_path) / "adapter_model.safetensors"))
    b = load_file(str(Path(theirs.adapter_path) / "adapter_model.safetensors"))
    assert_adam_weights_close(a, b, learning_rate=1e-3, steps=10)  # 2 epochs of 5 steps at 10 x 1e-4
    chat = [{"role": "user", "content": "Say the word number 3."}]
    params = SamplingParams(temperature=0, max_tokens=12)
    served = vllm_llm.chat(chat, params, lora_request=LoRARequest("ft", 7, theirs.adapter_path))
    reference = native_llm.chat(chat, params, lora_request=LoRARequest("ft", 7, theirs.adapter_path))
    base = vllm_llm.chat(chat, params)
    assert served[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert served[0].outputs[0].token_ids != base[0].outputs[0].token_ids


def _pairs(n: int = 10) -> list[dict]:
    return [{"input": {"messages": [{"role": "user", "content": f"Say the word number {i}."}]},
             "preferred_output": [{"role": "assistant", "content": f"Word {i}."}],
             "non_preferred_output": [{"role": "assistant", "content": f"Banana {i * 7}, and more."}]}
            for i in range(n)]


def test_dpo_on_vllm_takes_its_reference_from_vllms_weights(vllm_llm: LLM, native_llm: LLM,
                                                            tmp_path: Path) -> None:
    """A DPO job trained on vLLM's weights (the reference pass through them with the adapter off) gives
    the adapter the native engine gives, and it learnt the preference on both."""
    hyper, lora = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 10.0}, {"r": 8, "lora_alpha": 16}
    loss = LossSpec(LossKind.DPO, beta=0.5)
    theirs = vllm_llm.fine_tune(_pairs(), str(tmp_path / "v"), hyperparameters=hyper, lora=lora, seed=2,
                                loss=loss)
    ours = native_llm.fine_tune(_pairs(), str(tmp_path / "n"), hyperparameters=hyper, lora=lora, seed=2,
                                loss=loss)
    from safetensors.torch import load_file

    a = load_file(str(Path(ours.adapter_path) / "adapter_model.safetensors"))
    b = load_file(str(Path(theirs.adapter_path) / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for key, t in a.items() if "lora_B" in key)  # it trained
    assert_adam_weights_close(a, b, learning_rate=1e-3, steps=10)  # 2 epochs of 5 steps at 10 x 1e-4
    assert theirs.losses[-1] < theirs.losses[0] and ours.losses[-1] < ours.losses[0]


def test_missing_or_other_vllm_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(VllmUnavailable, match=f"found vLLM 0.31.2.*`{INSTALL_COMMAND}`"):
        check_vllm()
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VllmUnavailable, match=f"not installed.*`{INSTALL_COMMAND}`"):
        check_vllm()


def test_profiler_measures_vllm_iterations(vllm_llm: LLM, tmp_path: Path) -> None:
    """`coserve profile --engine vllm`'s sweep on this engine: the designed work, earlier tokens computed
    by unmeasured prefills first (vLLM owns the KV cache). Last in the module: it loads its own adapters."""
    from coserve.bench.profiler import Scenario, SweepSettings, _Harness

    engine = vllm_llm.engine
    harness = _Harness(engine, [str(create_random_adapter(engine.config.model, tmp_path / "p", seed=3, r=8,
                                                          target_modules=["q_proj"]))],
                       SweepSettings(iterations=4, finetune_length=64))
    (features, seconds), _ = harness.measure(Scenario((16, 140), (130, 8), 1, 24, 0, 0))
    assert seconds > 0
    assert (features.decode_tokens, features.decode_context) == (2, 17 + 141)
    assert (features.prefill_tokens, features.ft_forward_tokens) == (8, 24)
    (features, _), _ = harness.measure(Scenario((), None, 0, 0, 1, 16))
    assert features.ft_backward_token_layers == 16
    assert engine.num_sequences == 0  # every measured sequence was freed in vLLM


def test_reinforcement_rollouts_on_vllm_sample_each_steps_weights(vllm_llm: LLM, tmp_path: Path) -> None:
    """vLLM keeps its own adapters, so each step's weights are exported to it once (`training_adapters`);
    every rollout's sampling log-probs are then peft's for the weights of the step that sampled it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = [{"messages": [{"role": "user", "content": f"Write something about {i}."}], "letter": "e"}
            for i in range(10)]
    grader = {"type": "text_similarity", "name": "e", "input": "{{ sample.output_text }}",
              "reference": "{{ item.letter }}", "evaluation_metric": "fuzzy_match"}
    adapters = vllm_llm.engine.training_adapters
    exports = adapters.exports
    job_id = vllm_llm.start_reinforcement(rows, grader, str(tmp_path / "out"), {"n_epochs": 2, "batch_size": 10},
                                          {"r": 4}, seed=5, samples=2, max_tokens=5)
    job = vllm_llm.jobs.job(job_id)
    fed = []
    source = fed_batches(job.source)
    feed = source.feed
    source.feed = lambda batch: (fed.append(batch), feed(batch))[1]  # type: ignore[method-assign]
    result = vllm_llm.wait(job_id)
    assert result.state.value == "succeeded", result.error
    assert adapters.exports - exports == 2  # the initial weights, then step 1's: once each
    model_dir = vllm_llm.engine.config.model
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      result.checkpoints[0])
    for model, batch in ((base, fed[0]), (tuned, fed[1])):
        for rollout in batch.rollouts:
            ids = torch.tensor(rollout.prompt_token_ids + rollout.completion_token_ids)
            with torch.no_grad():
                logits = model(input_ids=ids[None]).logits[0, :-1].float()
            expected = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
            # vLLM's decode (bf16-free, fp32, its own attention and sampler kernels) against one full
            # transformers forward: test_parity's 1e-5 of the logits' span (~100 for the tiny models)
            torch.testing.assert_close(torch.tensor(rollout.sampling_logprobs),
                                       expected[len(rollout.prompt_token_ids) - 1:], rtol=1e-3, atol=1e-3)
