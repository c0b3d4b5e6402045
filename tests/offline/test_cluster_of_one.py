"""The offline `LLM` is a cluster of one engine, composed as a server's: an `EngineCluster` whose engine's
planner is the `CoServingPolicy` the server's `CoServingPolicyFactory` builds, with the share that has no SLO
(`planner.fill.FillShare`: fine-tuning takes what inference leaves of each iteration). Its jobs are the
cluster's (`ClusterJobs`), placed and ended as on a server; one that no iteration can start fails saying why."""

from __future__ import annotations

from pathlib import Path

from coserve import LLM, SamplingParams
from coserve.contract.job_spec import JobState
from coserve.contract.plan import IterationPlan
from coserve.planner.fill import FillShare
from coserve.planner.policy import CoServingPolicy

EXAMPLES = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(12)]
BATCH_TOKENS = 48


def _llm(model_dir: Path, **kw: int) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_batch_tokens=BATCH_TOKENS, num_kv_blocks=160, block_size=8,
               max_model_len=256, **kw)


def test_the_llm_plans_with_the_servers_planner_and_a_share_with_no_slo(llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(llama_dir)
    assert llm.cluster.engines == ("offline",) and type(llm.policy) is CoServingPolicy
    assert isinstance(llm.policy._share, FillShare)  # noqa: SLF001 - which share the planner was given
    plans: list[IterationPlan] = []
    step = llm.engine.step

    def recording(plan: IterationPlan) -> object:
        plans.append(plan)
        return step(plan)

    llm.engine.step = recording  # type: ignore[method-assign]
    job_id = llm.start_fine_tune(EXAMPLES, str(tmp_path / "job"), {"n_epochs": 1, "batch_size": 4}, {"r": 4})
    assert llm.policy.jobs is not None and llm.policy.jobs.get(job_id) is llm.jobs.job(job_id)  # the planner's host
    llm.generate(["The quick brown fox"] * 3, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    result = llm.wait(job_id)
    assert result.state is JobState.SUCCEEDED and result.adapter_path is not None
    # inference first, fine-tuning in the rest of the budget, and alone in iterations without inference
    assert all(p.num_tokens + p.training.forward_tokens <= BATCH_TOKENS for p in plans)
    assert any(p.num_tokens and p.training.forward_tokens for p in plans)
    assert any(not p.num_tokens and p.training.forward_tokens and p.training.backward_tasklets for p in plans)


def test_a_job_no_iteration_can_start_fails_saying_why(llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(llama_dir, max_loras=1)
    first = llm.start_fine_tune(EXAMPLES, str(tmp_path / "first"), {"n_epochs": 3, "batch_size": 4}, {"r": 4})
    assert llm.cluster.jobs.pause(first)  # it keeps the engine's one adapter slot
    second = llm.start_fine_tune(EXAMPLES, str(tmp_path / "second"), {"n_epochs": 1, "batch_size": 4}, {"r": 4})
    result = llm.wait(second)
    assert result.state is JobState.FAILED and result.adapter_path is None
    assert result.error is not None and result.error.startswith("job_unplaceable: the job cannot start: ")
    assert "adapter slots" in result.error
    assert llm.cluster.jobs.resume(first)
    assert llm.wait(first).state is JobState.SUCCEEDED
