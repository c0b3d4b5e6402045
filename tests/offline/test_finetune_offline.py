"""The offline fine-tuning entry point (`LLM.fine_tune` / `start_fine_tune` + `wait`), co-served with
`generate`: greedy inference is token for token what it is without training, the checkpoints and the final
adapter are PEFT folders that peft loads to the same logits and that the running engine serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from coserve import LLM, LoRARequest, SamplingParams
from coserve.contract.job_spec import JobState
from coserve.contract.plan import IterationPlan
from coserve.model.tiny_model import create_random_adapter
from numerics import sum_rel
from reference import greedy_reference

EXAMPLES = [{"messages": [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
            for i in range(12)]
PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


def _llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_batch_tokens=48, num_kv_blocks=160, block_size=8, max_model_len=512,
               max_lora_rank=16)


def _outputs(llm: LLM, adapter: LoRARequest) -> list[tuple[list[int], list]]:
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[None, adapter, None])
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def adapter_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapter") / "lora"
    create_random_adapter(llama_dir, out, seed=1, r=8, lora_alpha=16)
    return out


def test_inference_is_bit_identical_while_a_job_trains(llama_dir: Path, adapter_dir: Path,
                                                      tmp_path: Path) -> None:
    adapter = LoRARequest("other", 1, str(adapter_dir))
    alone = _outputs(_llm(llama_dir), adapter)

    llm = _llm(llama_dir)
    job_id = llm.start_fine_tune(EXAMPLES, str(tmp_path / "job"),
                                 {"n_epochs": 1, "batch_size": 4}, {"r": 4})
    job = llm.jobs.job(job_id)
    engine_step = llm.engine.step
    mixed: list[int] = []  # iterations with inference tokens and fine-tuning forward tokens together

    def recording(plan: IterationPlan) -> object:
        if plan.num_tokens > 0 and plan.training.forward_tokens > 0:
            mixed.append(plan.step_id)
        return engine_step(plan)

    llm.engine.step = recording  # type: ignore[method-assign]
    together = _outputs(llm, adapter)
    assert mixed, "no iteration held inference and fine-tuning tokens together"
    assert job.trained_tokens > 0 or job.position.step > 0 or llm.engine.training.sequences, \
        "the job did not train during generate"
    # Greedy tokens bit for bit. Logprobs only to fp32 rounding: the fused batch has more rows, and
    # a GEMM's rounding depends on the batch shape (as in vLLM, batch composition is not invariant).
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(together, alone):
        assert tokens == ref_tokens
        for step, ref in zip(logprobs, ref_logprobs):
            assert step.keys() == ref.keys()
            assert all(abs(step[k].logprob - ref[k].logprob) <= 1e-6 * 100 for k in ref)
    result = llm.wait(job_id)
    assert result.state == JobState.SUCCEEDED


def test_fine_tune_saves_servable_peft_adapters(llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    result = llm.fine_tune(EXAMPLES, str(tmp_path / "job"),
                           {"n_epochs": 2, "batch_size": 6, "learning_rate_multiplier": 10},
                           {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
                           seed=3)
    assert result.state == JobState.SUCCEEDED and result.error is None
    assert result.checkpoints == [str(tmp_path / "job" / "ckpt-step-2"),
                                  str(tmp_path / "job" / "ckpt-step-4")]
    assert len(result.losses) == 4 and result.trained_tokens > 0
    assert result.adapter_path == str(tmp_path / "job" / "final")

    # The same engine serves the new adapter and the first epoch's checkpoint at once; peft gives the
    # same greedy tokens and logits for each.
    prompt = llm.get_tokenizer().encode("What is 3 plus 3?")
    served_logprobs = []
    for lora_id, path in enumerate((result.checkpoints[0], result.adapter_path), start=7):
        served = llm.generate({"prompt_token_ids": prompt}, GREEDY,
                              lora_request=LoRARequest(f"mine-{lora_id}", lora_id, path))[0].outputs[0]
        hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
        tokens, rows = greedy_reference(PeftModel.from_pretrained(hf, path), prompt, GREEDY.max_tokens)
        assert served.token_ids == tokens, path
        span = float(rows[0].max() - rows[0].min())
        for step, row in zip(served.logprobs, rows):
            for token_id, lp in step.items():
                assert abs(lp.logprob - float(row[token_id])) <= 1e-5 * span, path
        served_logprobs.append(served.logprobs)
    # The adapter moved away from the base model (B starts at zero), and on from its first epoch.
    base = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0]
    assert base.logprobs != served_logprobs[1] and served_logprobs[0] != served_logprobs[1]


def test_bad_fine_tuning_input_is_refused_with_the_setting_named(llama_dir: Path,
                                                                  tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    with pytest.raises(ValueError, match="at least 10 examples"):
        llm.start_fine_tune(EXAMPLES[:9], str(tmp_path / "a"))
    with pytest.raises(ValueError, match="n_epochs"):
        llm.start_fine_tune(EXAMPLES, str(tmp_path / "b"), {"n_epochs": 0})
    with pytest.raises(ValueError, match="target_modules"):
        llm.start_fine_tune(EXAMPLES, str(tmp_path / "c"), lora={"target_modules": ["fc1"]})
    with pytest.raises(ValueError, match="unknown LoRA setting"):
        llm.start_fine_tune(EXAMPLES, str(tmp_path / "d"), lora={"rank": 4})
    # An example with no trained token is skipped and counted; an overlong one is truncated.
    silent = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "no", "weight": 0}]}
    long = {"messages": [{"role": "user", "content": "word " * 700},
                         {"role": "assistant", "content": "ok"}]}
    job_id = llm.start_fine_tune([silent, long, *EXAMPLES], str(tmp_path / "e"),
                                 {"n_epochs": 1, "batch_size": 12})
    result = llm.wait(job_id)
    assert result.state == JobState.SUCCEEDED
    assert any("skipped" in w for w in result.warnings) and any("truncated" in w for w in result.warnings)


def test_validation_loss_each_epoch_equals_peft_on_the_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    from trainer_data import prepare_dataset

    llm = _llm(llama_dir)
    held_out = [{"messages": [{"role": "user", "content": f"What is {i} times two?"},
                              {"role": "assistant", "content": f"Twice {i} is {2 * i}, of course."}]}
                for i in range(3)]
    result = llm.fine_tune(EXAMPLES, str(tmp_path / "job"), {"n_epochs": 2, "batch_size": 6,
                                                            "learning_rate_multiplier": 10},
                           {"r": 4}, validation=held_out)
    assert result.state == JobState.SUCCEEDED and len(result.validation_losses) == 2
    assert result.validation_losses[0] != result.validation_losses[1]  # the adapter changed between

    sequences = prepare_dataset(llm.get_tokenizer(), held_out, 512).sequences
    for checkpoint, measured in zip(result.checkpoints, result.validation_losses):
        hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(hf, checkpoint)
        total = count = 0.0
        with torch.no_grad():
            for seq in sequences:
                labels = torch.where(seq.trained, seq.token_ids, torch.full_like(seq.token_ids, -100))
                loss = model(input_ids=seq.token_ids[None], labels=labels[None]).loss
                total += float(loss) * seq.num_trained
                count += seq.num_trained
        # a mean of same-sign cross-entropy terms over the held-out tokens (numerics.sum_rel)
        assert measured == pytest.approx(total / count, rel=sum_rel(int(count)))
