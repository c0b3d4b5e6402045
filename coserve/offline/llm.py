"""The offline API, shaped like vLLM's `LLM`: switch by changing the import.

    from coserve import LLM, SamplingParams, LoRARequest
    llm = LLM(model="path/to/hf-folder", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

The `LLM` is a cluster of one engine, composed as a server's engine is (`EngineCluster`, its planner a
`CoServingPolicy` from the same `CoServingPolicyFactory`), with a share that has no SLO: fine-tuning jobs
get what the inference tokens leave of each iteration (`planner.fill`). Each iteration is
`EngineCluster.step` (the planner plans inference first, then the jobs' work; the engine executes; the
result is applied, the jobs' rollout loops advanced); this front end turns the token ids of the requests
that advanced into text (stop strings, logprobs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coserve.backends.registry import build_engine
from coserve.cluster.engine_cluster import EngineCluster
from coserve.cluster.policy_factory import CoServingPolicyFactory
from coserve.contract import defaults
from coserve.contract.engine import EngineKind
from coserve.contract.engine_config import EngineConfig
from coserve.contract.loss_spec import LossSpec
from coserve.contract.plan import TokenLogprobs
from coserve.contract.sampling import AdapterRef, EosIds, SamplingParams
from coserve.contract.training_settings import HyperparameterRequest, LoRASettings
from coserve.frontend.adapter_check import AdapterChecker
from coserve.frontend.chat_template import encode_chat
from coserve.frontend.output_tracker import OutputTracker
from coserve.inference.request import Request, RequestStatus, expand_request
from coserve.inference.scheduler_config import SchedulerConfig
from coserve.jobs.prepared_job import FIRST_TRAINING_ADAPTER_ID, prepare_job
from coserve.offline.finetune import FineTuneResult, OfflineJobs
from coserve.offline.lora_request import LoRARequest
from coserve.offline.outputs import CompletionOutput, RequestOutput
from coserve.offline.reinforcement import offline_grading
from coserve.planner.latency import ModelFingerprint, engine_machine_id, model_id_from_config
from coserve.planner.share_kinds import ShareKind
from coserve.structured.guarded_check import GrammarCheck

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing_extensions import TypeIs

ENGINE = "offline"  # the cluster's one engine
PromptType = str | dict[str, Any]
ChatMessages = list[dict[str, Any]]


@dataclass(slots=True)
class _Run:
    """A request the `LLM` runs, and the text side of its output."""

    request: Request
    output: OutputTracker


class LLM:
    """Generate text offline with a base model and LoRA adapters, in continuous batches.

    Args:
        model: HF-format model folder.
        tokenizer: tokenizer folder (default: the model folder).
        dtype: "auto", "float32", "bfloat16" or "float16"; "auto" is the model config's dtype on both
            engines (`coserve.model.config.dtype_name`: a float32 model stays float32 on vLLM's CPU too).
            `engine.layout.dtype` says what serves.
        device: "cpu", "cuda", "cuda:1", ...
        max_num_seqs: sequences in flight at once.
        max_batch_tokens: tokens per iteration (`max_num_batched_tokens` is accepted too).
        max_model_len: context length (default: the model's).
        num_kv_blocks / kv_cache_memory_gb: size of the paged KV cache.
        max_loras / max_lora_rank: adapter slots in the bank and the largest rank they take.
        native_kernels: use the C paged-decode kernel on CPU in float32 (else pure torch).
        gpu_memory_utilization: on CUDA, the share of the memory left free by the weights that the
            KV cache takes (default 0.9).
        engine: "torch" (coserve's engine; "native" names it too) or "vllm" (vLLM's, with fine-tuning on
            its weights; needs vLLM installed: `make vllm`). On "vllm", vLLM sizes its own KV cache (`num_kv_blocks` and
            `block_size` are its) and caches prefixes itself.
        enable_lora, enforce_eager: accepted for vLLM compatibility (LoRA is always on; coserve has
            no CUDA graphs to skip). `use_tqdm` of `generate` and
            `chat` likewise: no progress bar is drawn.
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "cpu", seed: int = 0, max_num_seqs: int = defaults.MAX_NUM_SEQS,
                 max_batch_tokens: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, block_size: int = defaults.BLOCK_SIZE,
                 num_kv_blocks: int | None = None, kv_cache_memory_gb: float | None = None,
                 enable_prefix_caching: bool = True, max_loras: int = defaults.ADAPTER_SLOTS,
                 max_lora_rank: int = defaults.MAX_LORA_RANK,
                 native_kernels: bool = True, gpu_memory_utilization: float = 0.9,
                 enable_lora: bool = True, enforce_eager: bool = True,
                 engine: str | EngineKind = EngineKind.TORCH) -> None:
        from transformers import AutoTokenizer  # the tokenizer only; no modeling code

        batch_tokens = max_batch_tokens or max_num_batched_tokens or defaults.MAX_BATCH_TOKENS
        self.engine = build_engine(EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
            max_model_len=max_model_len, max_loras=max_loras, max_lora_rank=max_lora_rank, seed=seed,
            native_kernels=native_kernels, gpu_memory_utilization=gpu_memory_utilization,
            engine=EngineKind.parse(engine), max_num_seqs=max_num_seqs, max_batch_tokens=batch_tokens))
        # After the engine: a folder that is not a supported model is reported as such first.
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        layout, model_config = self.engine.layout, self.engine.model_config
        # A decode is one token: no more sequences run at once than the token budget holds.
        self.scheduler_config = SchedulerConfig(
            max_model_len=layout.max_model_len, max_num_seqs=min(max_num_seqs, batch_tokens),
            max_batch_tokens=batch_tokens,
            block_size=layout.block_size,
            enable_prefix_caching=enable_prefix_caching and not layout.engine_owns_kv_cache)
        # The server's composition of an engine's planner, with the share that has no SLO; a backward
        # iteration may take the whole depth of what inference leaves (offline, memory is the only bound).
        planner = CoServingPolicyFactory(
            ModelFingerprint(model_id_from_config(dataclasses.asdict(model_config)),
                             engine_machine_id(device, self.engine.config.engine), layout.dtype),
            share=ShareKind.FILL, max_backward_token_layers=batch_tokens * model_config.num_layers)
        self.cluster = EngineCluster()
        self.policy = self.cluster.add_engine(
            ENGINE, lambda shared: planner(self.scheduler_config, layout, shared)).policy
        self._eos = EosIds.resolve(self.tokenizer, model_config.eos_token_ids)
        self.cluster.jobs.serve_rollouts(offline_grading(self.tokenizer), self._eos)
        self.jobs = OfflineJobs(self.cluster.jobs)
        self._ids = itertools.count()
        self._adapters = AdapterChecker(model_config, layout.max_lora_rank)
        self._grammars = GrammarCheck()

    def get_tokenizer(self) -> object:
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in the prompts' order.

        Args:
            prompts: strings, or `{"prompt_token_ids": [...]}` dicts, or a list of either.
            sampling_params: one for all prompts, or one per prompt.
            lora_request: one adapter for all prompts, or one (or None) per prompt.

        Raises:
            ValueError: a prompt longer than the context, bad sampling parameters, list lengths
                that do not match the prompts.
            AdapterError: an adapter that cannot be served.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        loras = _per_prompt(lora_request, len(prompt_list), "lora_request")
        groups = [self._prepare(p, sp, lr) for p, sp, lr in zip(prompt_list, params, loras)]
        tracked = [t for _, _, items in groups for t in items]
        self._admit_all([t.request for t in tracked])
        self._run_to_completion(tracked)
        return [self._request_output(rid, prompt, tracked) for rid, prompt, tracked in groups]

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts = []
        for conversation in conversations:
            text, token_ids = encode_chat(self.tokenizer, conversation, chat_template, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text, through the tokenizer's (or the given) chat template."""
        return str(self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt))

    # ------------------------------------------------------------------------------ internals

    def _admit_all(self, requests: list[Request]) -> None:
        """Queue every request, or none of them: a bad prompt leaves nothing half-submitted."""
        added: list[str] = []
        try:
            for request in requests:
                self.cluster.submit(request)
                added.append(request.request_id)
        except ValueError:
            for request_id in added:
                self.cluster.abort(request_id)
            raise

    def _prepare(self, prompt: PromptType, params: SamplingParams,
                 lora: LoRARequest | None) -> tuple[str, str | None, list[_Run]]:
        text: str | None
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r}")
        params.check_vocab(self.engine.layout.vocab_size)
        if params.structured_output is not None:
            if not self.engine.layout.structured_output:
                raise ValueError("structured_output: this engine does not enforce grammars")
            self._grammars.check(params.structured_output)  # StructuredOutputError is a ValueError
        adapter = self._adapter_ref(lora)
        request_id = str(next(self._ids))
        children = expand_request(request_id, token_ids, params, self._eos, adapter)
        return request_id, text, [_Run(c, OutputTracker(c.sampling, self.tokenizer)) for c in children]

    def _adapter_ref(self, lora: LoRARequest | None) -> AdapterRef | None:
        if lora is None:
            return None
        # Fail here, with the adapter's own error, rather than inside an engine iteration.
        self._adapters.check(lora.lora_int_id, lora.lora_path)
        return AdapterRef(adapter_id=lora.lora_int_id, name=lora.lora_name, path=lora.lora_path)

    def start_fine_tune(self, examples: Sequence[dict[str, Any] | list[dict[str, Any]]], output_dir: str,
                        hyperparameters: HyperparameterRequest | Mapping[str, Any] | None = None,
                        lora: LoRASettings | Mapping[str, Any] | None = None,
                        seed: int = 0, job_id: str | None = None,
                        validation: Sequence[dict[str, Any] | list[dict[str, Any]]] = (),
                        loss: LossSpec | None = None) -> str:
        """Start a LoRA fine-tuning job on chat examples; returns its id at once.

        The job trains in the same iterations as every later `generate`/`chat` call; `wait`
        finishes it. Examples are OpenAI fine-tuning lines (`{"messages": [...], "tools": [...]}`,
        tool calls included: docs/training-files.md) or message lists; the loss is on assistant
        tokens (messages with `"weight": 0` excluded). `hyperparameters`: a `HyperparameterRequest`,
        or OpenAI's `n_epochs`, `batch_size`, `learning_rate_multiplier` (each may be "auto"; see
        `HyperparameterRequest.resolve`); `lora`: a `LoRASettings`, or its fields by PEFT's names (`r`,
        `lora_alpha`, `target_modules`, `use_rslora`; default r=16, alpha=32, all seven projections). Checkpoints
        are written to `output_dir/ckpt-step-N` at each epoch's end, the adapter to `output_dir/final`; the
        `validation` examples' mean loss is measured at each epoch's end (`validation_losses`).
        `loss=LossSpec(LossKind.DPO, beta=...)` trains DPO on preference rows (`{"input": ...,
        "preferred_output": ..., "non_preferred_output": ...}`: docs/training-files.md), the base
        model as the reference; None is supervised (cross-entropy).

        Raises:
            TooFewExamplesError: fewer than 10 usable examples.
            SettingsError: a bad setting (`param` names it).
        """
        adapter_id = self.jobs.next_adapter_id()
        prepared = prepare_job(
            self.tokenizer, examples, job_id=job_id or f"ftjob-{adapter_id - FIRST_TRAINING_ADAPTER_ID}",
            tenant="offline", adapter_id=adapter_id, num_layers=self.engine.model_config.num_layers,
            max_len=self.scheduler_config.max_model_len, output_dir=output_dir,
            hyperparameters=_hyperparameters(hyperparameters), lora=_lora_settings(lora), seed=seed,
            base_model_name_or_path=self.engine.config.model, validation=validation, loss=loss)
        return self.jobs.submit(prepared.spec, prepared.dataset.warnings)

    def start_reinforcement(self, rows: Sequence[Mapping[str, Any]], grader: Mapping[str, Any], output_dir: str,
                            hyperparameters: HyperparameterRequest | Mapping[str, Any] | None = None,
                            lora: LoRASettings | Mapping[str, Any] | None = None, seed: int = 0,
                            samples: int = 4, max_tokens: int = 64, loss: LossSpec | None = None,
                            job_id: str | None = None, validation: Sequence[Mapping[str, Any]] = (),
                            eval_interval: int | None = None) -> str:
        """Start a reinforcement fine-tuning job (GRPO); returns its id at once.

        Each batch samples `samples` completions (at most `max_tokens` each) of each of its rows' prompts
        from the adapter being trained, grades them with `grader` (OpenAI's grader JSON: docs/graders.md),
        and trains the group-relative advantages with `loss` (default `importance_sampling`). `rows`:
        `{"messages": [...], <fields the grader reads>}`. `validation` rows are sampled and graded at step
        0, every `eval_interval` steps and at the end (validation events with `valid_reward_mean`). `wait`
        finishes it; each step's event carries `train_reward_mean`.

        Raises:
            TooFewExamplesError: fewer than 10 rows.
            SettingsError: a bad row, grader or setting (`param` names it).
        """
        from coserve.offline.reinforcement import prepare_reinforcement

        adapter_id = self.jobs.next_adapter_id()
        prepared = prepare_reinforcement(
            self.tokenizer, rows, grader, job_id=job_id or f"ftjob-{adapter_id - FIRST_TRAINING_ADAPTER_ID}",
            adapter_id=adapter_id, num_layers=self.engine.model_config.num_layers,
            max_len=self.scheduler_config.max_model_len, output_dir=output_dir,
            hyperparameters=_hyperparameters(hyperparameters), lora=_lora_settings(lora), seed=seed,
            samples=samples, max_tokens=max_tokens, loss=loss, base_model_name_or_path=self.engine.config.model,
            validation=validation, eval_interval=eval_interval)
        return self.jobs.submit(prepared.spec)

    def wait(self, job_id: str) -> FineTuneResult:
        """Run iterations (with any queued inference) until the job ends; returns its result. A job that no
        iteration can start (it waits for a placement the engine cannot give: `ClusterJobs`) fails, saying why."""
        while not self.jobs.ended(job_id):
            if not self.cluster.has_work(ENGINE) and self.cluster.jobs.waiting_reason(job_id) is not None:
                self.jobs.give_up(job_id)
                break
            self._iteration({})
        return self.jobs.result(job_id)

    def fine_tune(self, examples: Sequence[dict[str, Any] | list[dict[str, Any]]], output_dir: str,
                  hyperparameters: HyperparameterRequest | Mapping[str, Any] | None = None,
                  lora: LoRASettings | Mapping[str, Any] | None = None,
                  seed: int = 0, validation: Sequence[dict[str, Any] | list[dict[str, Any]]] = (),
                  loss: LossSpec | None = None) -> FineTuneResult:
        """`start_fine_tune` then `wait`: train a LoRA adapter and return where it is."""
        return self.wait(self.start_fine_tune(examples, output_dir, hyperparameters, lora, seed,
                                              validation=validation, loss=loss))

    def _run_to_completion(self, tracked: list[_Run]) -> None:
        by_id = {t.request.request_id: t for t in tracked}
        while self.cluster.has_work(ENGINE):
            self._iteration(by_id)

    def step(self) -> None:
        """Run one iteration (queued inference first, fine-tuning in what is left) for a driver that
        interleaves other work, such as a server's job manager."""
        self._iteration({})

    def _iteration(self, by_id: dict[str, _Run]) -> None:
        """One iteration: inference first, fine-tuning in what is left, then the outputs."""
        step = self.cluster.step(ENGINE, self.engine)
        for fault in step.result.faults:  # a request the engine could not run ends alone (aborted)
            logger.warning("request %s failed: %s", fault.request_id, fault.message)
        logprobs = step.logprobs()
        for request in step.advanced:
            item = by_id.get(request.request_id)
            if item is not None:
                self._on_token(item, logprobs.get(request.request_id))

    def _on_token(self, item: _Run, lp: TokenLogprobs | None) -> None:
        item.output.add(item.request.output_token_ids[-1:], None if lp is None else [lp])
        if item.output.stopped and not item.request.is_finished:
            self.cluster.abort(item.request.request_id, RequestStatus.FINISHED_STOPPED)

    def _request_output(self, request_id: str, prompt: str | None,
                        tracked: list[_Run]) -> RequestOutput:
        outputs = []
        for index, item in enumerate(tracked):
            token_ids = list(item.request.output_token_ids)
            outputs.append(CompletionOutput(
                index=index, text=item.output.final_text(), token_ids=token_ids,
                cumulative_logprob=item.output.cumulative_logprob, logprobs=item.output.logprobs,
                finish_reason=item.request.finish_reason, stop_reason=item.output.stop_reason))
        return RequestOutput(request_id=request_id, prompt=prompt,
                             prompt_token_ids=list(tracked[0].request.prompt_token_ids),
                             outputs=outputs, finished=True)


def _per_prompt(value: object, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _is_conversation(messages: ChatMessages | Sequence[ChatMessages]) -> TypeIs[ChatMessages]:
    """One conversation (a list of message dicts), rather than a list of conversations."""
    return bool(messages) and isinstance(messages[0], dict)


def _lora_settings(lora: LoRASettings | Mapping[str, Any] | None) -> LoRASettings | None:
    """The caller's LoRA settings as the typed contract (a mapping is read by PEFT's names)."""
    if lora is None or isinstance(lora, LoRASettings):
        return lora
    return LoRASettings.from_dict(lora)


def _hyperparameters(requested: HyperparameterRequest | Mapping[str, Any] | None
                     ) -> HyperparameterRequest | None:
    """The caller's hyperparameters as the typed contract (a mapping is read as OpenAI's JSON)."""
    if requested is None or isinstance(requested, HyperparameterRequest):
        return requested
    return HyperparameterRequest.from_dict(requested)
