"""The offline API, shaped like vLLM's `LLM`: switch by changing the import.

    from coserve import LLM, SamplingParams, LoRARequest
    llm = LLM(model="path/to/hf-folder", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

One loop drives everything: the policy plans an iteration, the engine executes it, the policy
applies the result, and this front end turns token ids into text (stop strings, logprobs).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from coserve.detokenizer import TextTracker, to_logprob_dict
from coserve.lora_request import LoRARequest
from coserve.outputs import CompletionOutput, RequestOutput
from coserve.platform.engine import Engine, EngineConfig
from coserve.platform.lora import load_peft_adapter
from coserve.policies.adapter_slots import AdapterSlots
from coserve.policies.config import SchedulerConfig
from coserve.policies.fcfs import FCFSPolicy
from coserve.policies.kv_blocks import KVBlockManager
from coserve.policies.plan import TokenLogprobs
from coserve.policies.request import AdapterRef, Request, RequestStatus, SamplingParams

PromptType = str | dict
ChatMessages = list[dict]


@dataclass
class _Tracked:
    """Front-end state of one child request (one of a prompt's `n` completions)."""

    request: Request
    tracker: TextTracker
    logprobs: list[dict] | None
    cumulative_logprob: float | None


class LLM:
    """Generate text offline with a base model and LoRA adapters, in continuous batches.

    Args:
        model: HF-format model folder.
        tokenizer: tokenizer folder (default: the model folder).
        dtype: "auto", "float32", "bfloat16" or "float16".
        device: "cpu", "cuda", "cuda:1", ...
        max_num_seqs: sequences in flight at once.
        max_batch_tokens: tokens per iteration (`max_num_batched_tokens` is accepted too).
        max_model_len: context length (default: the model's).
        num_kv_blocks / kv_cache_memory_gb: size of the paged KV cache.
        max_loras / max_lora_rank: adapter slots in the bank and the largest rank they take.
        native_kernels: use the C paged-decode kernel on CPU in float32 (else pure torch).
        gpu_memory_utilization: on CUDA, the share of the memory left free by the weights that the
            KV cache takes (default 0.9).
        enable_lora, enforce_eager: accepted for vLLM compatibility (LoRA is always on; coserve has
            no CUDA graphs to skip). `use_tqdm` of `generate` and
            `chat` likewise: no progress bar is drawn.
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "cpu", seed: int = 0, max_num_seqs: int = 64,
                 max_batch_tokens: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_gb: float | None = None,
                 enable_prefix_caching: bool = True, max_loras: int = 4, max_lora_rank: int = 64,
                 native_kernels: bool = True, gpu_memory_utilization: float = 0.9,
                 enable_lora: bool = True, enforce_eager: bool = True) -> None:
        from transformers import AutoTokenizer  # the tokenizer only; no modeling code

        self.engine = Engine(EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
            max_model_len=max_model_len, max_loras=max_loras, max_lora_rank=max_lora_rank, seed=seed,
            native_kernels=native_kernels, gpu_memory_utilization=gpu_memory_utilization))
        # After the engine: a folder that is not a supported model is reported as such first.
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        layout = self.engine.layout
        self.scheduler_config = SchedulerConfig(
            max_model_len=layout.max_model_len, max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens or max_num_batched_tokens or 2048,
            block_size=layout.block_size, enable_prefix_caching=enable_prefix_caching)
        self.policy = FCFSPolicy(
            self.scheduler_config,
            KVBlockManager(layout.num_kv_blocks, layout.block_size, enable_prefix_caching),
            AdapterSlots(layout.num_adapter_slots))
        cfg = self.engine.model_config
        self._eos = self.tokenizer.eos_token_id
        if self._eos is None and cfg.eos_token_ids:
            self._eos = cfg.eos_token_ids[0]
        self._extra_eos = [t for t in cfg.eos_token_ids if t != self._eos]
        self._ids = itertools.count()
        self._validated_adapters: dict[int, str] = {}

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
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = self.apply_chat_template(conversation, chat_template, add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, chat_template: str | None = None,
                            add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text, through the tokenizer's (or the given) chat template."""
        return self.tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------------------ internals

    def _admit_all(self, requests: list[Request]) -> None:
        """Queue every request, or none of them: a bad prompt leaves nothing half-submitted."""
        added: list[str] = []
        try:
            for request in requests:
                self.policy.add_request(request)
                added.append(request.request_id)
        except ValueError:
            for request_id in added:
                self.policy.abort(request_id)
            raise

    def _prepare(self, prompt: PromptType, params: SamplingParams,
                    lora: LoRARequest | None) -> tuple[str, str | None, list[_Tracked]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r}")
        adapter = self._adapter_ref(lora)
        request_id = str(next(self._ids))
        tracked = []
        for index in range(params.n):
            child = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            if self._extra_eos and not child.ignore_eos:
                child.stop_token_ids = child.stop_token_ids + self._extra_eos
            request = Request(request_id=f"{request_id}-{index}", prompt_token_ids=token_ids,
                              sampling=child, eos_token_id=self._eos, adapter=adapter,
                              arrival_time=time.monotonic())
            want_lp = child.logprobs is not None
            tracked.append(_Tracked(request, TextTracker(self.tokenizer, child),
                                    [] if want_lp else None, 0.0 if want_lp else None))
        return request_id, text, tracked

    def _adapter_ref(self, lora: LoRARequest | None) -> AdapterRef | None:
        if lora is None:
            return None
        known = self._validated_adapters.get(lora.lora_int_id)
        if known is None:
            # Fail here, with the adapter's own error, rather than inside an engine iteration. The
            # check reads the adapter on the CPU: no device memory for a copy the engine reloads.
            engine = self.engine
            load_peft_adapter(lora.lora_path, lora.lora_int_id, engine.model_config,
                              engine.layout.max_lora_rank, torch.float32, torch.device("cpu"))
            self._validated_adapters[lora.lora_int_id] = lora.lora_path
        elif known != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already used for {known}")
        return AdapterRef(adapter_id=lora.lora_int_id, name=lora.lora_name, path=lora.lora_path)

    def _run_to_completion(self, tracked: list[_Tracked]) -> None:
        by_id = {t.request.request_id: t for t in tracked}
        while self.policy.has_work():
            plan = self.policy.plan()
            result = self.engine.step(plan)
            logprobs = {s.request_id: s.logprobs for s in result.sampled}
            for request in self.policy.update(plan, result):
                item = by_id.get(request.request_id)
                if item is not None:
                    self._on_token(item, logprobs.get(request.request_id))

    def _on_token(self, item: _Tracked, lp: TokenLogprobs | None) -> None:
        request = item.request
        if item.logprobs is not None and lp is not None:
            item.logprobs.append(to_logprob_dict(lp, self.tokenizer))
            item.cumulative_logprob += lp.logprob
        if item.tracker.check_stop(list(request.output_token_ids)) and not request.is_finished:
            self.policy.abort(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _request_output(self, request_id: str, prompt: str | None,
                        tracked: list[_Tracked]) -> RequestOutput:
        outputs = []
        for index, item in enumerate(tracked):
            token_ids = list(item.request.output_token_ids)
            outputs.append(CompletionOutput(
                index=index, text=item.tracker.final_text(token_ids), token_ids=token_ids,
                cumulative_logprob=item.cumulative_logprob, logprobs=item.logprobs,
                finish_reason=item.request.finish_reason, stop_reason=_stop_reason(item)))
        return RequestOutput(request_id=request_id, prompt=prompt,
                             prompt_token_ids=list(tracked[0].request.prompt_token_ids),
                             outputs=outputs, finished=True)


def _stop_reason(item: _Tracked) -> int | str | None:
    if item.tracker.stopped is not None:
        return item.tracker.stopped.stop
    outputs = item.request.output_token_ids
    if outputs and outputs[-1] in item.request.sampling.stop_token_ids:
        return outputs[-1]
    return None


def _per_prompt(value: object, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
