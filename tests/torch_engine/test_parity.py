"""Parity of coserve's own forward with transformers (and peft for LoRA), fp32 on CPU.

A batch of prompts of different lengths is generated together, with prefill split into chunks by a
small token budget and with a KV cache too small for all of them, so requests are preempted and
recomputed. Greedy tokens must be equal and logprobs equal to within float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coserve import LLM, LoRARequest, SamplingParams
from coserve.contract.plan import IterationPlan
from coserve.model.tiny_model import create_random_adapter
from reference import greedy_reference, random_prompts

STEPS = 10
LENGTHS = [5, 23, 11, 40, 17]
# The tiny models' weights are peaked on purpose (stable greedy decoding), so logits span about
# +-100. A log-prob is a logit minus a log-sum-exp; both carry the forward's rounding of the logits, which is
# relative to their span S: each K-product reduction (K <= 256) leaves 2 sqrt(K) u = 2e-6 of S per side and
# layer, ~4 chained reductions (2 layers) and a paged, chunked attention against a dense one: 1e-5 x S.
LOGPROB_TOL_OF_SPAN = 1e-5


class PlanRecorder:
    """Wraps Engine.step to keep the plans it executed."""

    def __init__(self, llm: LLM) -> None:
        self.plans: list[IterationPlan] = []
        step = llm.engine.step

        def recording_step(plan: IterationPlan):  # noqa: ANN202
            self.plans.append(plan)
            return step(plan)

        llm.engine.step = recording_step  # type: ignore[method-assign]

    def preempted_ids(self) -> set[str]:
        resent = set()
        seen = set()
        for plan in self.plans:
            for new in plan.new_sequences:
                if new.request_id in seen:
                    resent.add(new.request_id)
                seen.add(new.request_id)
        return resent


def make_llm(model_dir: Path, **kwargs: object) -> LLM:
    # 64-token context, 4-token blocks: 16 blocks hold one full sequence; 24 cannot hold five.
    settings = dict(dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=24,
                    max_batch_tokens=24)
    settings.update(kwargs)
    return LLM(model=str(model_dir), **settings)


def assert_matches(outputs: list, references: list[tuple[list[int], list[torch.Tensor]]]) -> None:
    for out, (ref_tokens, ref_rows) in zip(outputs, references):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, (lp, row) in enumerate(zip(completion.logprobs, ref_rows)):
            tol = LOGPROB_TOL_OF_SPAN * float(row.max() - row.min())
            top = torch.topk(row, 3)
            assert list(lp)[0] == ref_tokens[step]
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert lp[token_id].logprob == pytest.approx(value, abs=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_parity_with_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model_dir = model_dirs[arch]
    llm = make_llm(model_dir)
    recorder = PlanRecorder(llm)
    prompts = random_prompts(llm.engine.model_config.vocab_size, LENGTHS, seed=1)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_matches(outputs, [greedy_reference(hf, p, STEPS) for p in prompts])
    assert recorder.preempted_ids(), "the small KV cache should have forced a preemption"
    chunked = [c for plan in recorder.plans for c in plan.chunks if 1 < c.num_tokens and c.start > 0]
    assert chunked, "the token budget should have split a prompt into prefill chunks"
    mixed = [p for p in recorder.plans
             if any(c.num_tokens == 1 for c in p.chunks) and any(c.num_tokens > 1 for c in p.chunks)]
    assert mixed, "some iteration should mix decodes with prefill chunks"


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    all_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "attn": create_random_adapter(llama_dir, root / "attn", seed=1, b_std=0.2, r=8, lora_alpha=16,
                                      target_modules=["q_proj", "v_proj", "down_proj"]),
        "all": create_random_adapter(llama_dir, root / "all", seed=2, b_std=0.2, r=4, lora_alpha=8,
                                     use_rslora=True, target_modules=all_modules),
    }


def _peft_references(llama_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                     names: list[str | None]) -> list:
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters["attn"], adapter_name="attn")
    model.load_adapter(adapters["all"], adapter_name="all")
    refs = []
    for prompt, name in zip(prompts, names):
        if name is None:
            with model.disable_adapter():
                refs.append(greedy_reference(model, prompt, STEPS))
        else:
            model.set_adapter(name)
            refs.append(greedy_reference(model, prompt, STEPS))
    return refs


@pytest.mark.parametrize("max_loras", [2, 1])
def test_multi_lora_parity_with_peft(llama_dir: Path, adapters: dict[str, Path],
                                     max_loras: int) -> None:
    """Base-model rows and two adapters in one batch; with one slot, LRU eviction swaps them."""
    names = [None, "attn", "all", "attn", None, "all"]
    ids = {"attn": 1, "all": 2}
    llm = make_llm(llama_dir, max_loras=max_loras, max_lora_rank=8, num_kv_blocks=64)
    recorder = PlanRecorder(llm)
    prompts = random_prompts(llm.engine.model_config.vocab_size, [5, 17, 9, 30, 12, 7], seed=3)
    loras = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    assert_matches(outputs, _peft_references(llama_dir, adapters, prompts, names))
    slot_of = {n.request_id: n.adapter_slot for p in recorder.plans for n in p.new_sequences}
    mixes = [{slot_of[c.request_id] for c in p.chunks} for p in recorder.plans]
    loads = [load for p in recorder.plans for load in p.adapter_loads]
    if max_loras == 1:
        assert len(loads) >= 3, "one slot for two adapters must evict and reload"
    else:
        assert len(loads) == 2
        assert any(len(m) == 3 for m in mixes), "base and both adapters should share an iteration"
