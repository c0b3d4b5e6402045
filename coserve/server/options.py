"""`ServeOptions`: the settings of `coserve serve` (its flags, or a Serve config's `args`), checked
before anything heavy starts, and the scheduler, engine and policy settings they imply. The server is
built from them by `coserve.server.assembly`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coserve.actors.metrics import Slo
from coserve.contract import defaults
from coserve.contract.engine import EngineKind

if TYPE_CHECKING:
    from coserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What `http_options` (host, port) and `coserve serve --local` decide: not application arguments.
NOT_ARGS = frozenset({"host", "port", "local"})
MAX_CHAT_TEMPLATE_BYTES = 2**20


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Settings of `coserve serve` (plain data: the Serve deployment receives them)."""

    model: str
    tenants: str
    data_dir: str = ".coserve/data"
    host: str = "127.0.0.1"
    port: int = 8000
    local: bool = False
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_batch_tokens: int = defaults.MAX_BATCH_TOKENS
    tpot_slo_ms: float | None = None
    ttft_slo_ms: float | None = None
    adapter_slots: int = defaults.ADAPTER_SLOTS
    dtype: str = "auto"
    device: str = "cpu"
    latency_profile: str | None = None  # `coserve profile --json` output (None: learned online)
    max_stall_ms: float | None = None  # fine-tuning bursts spending TPOT slack (CoServingConfig)
    # fine-tuning's least share of an engine's time while a job is runnable (CoServingConfig.finetune_min_share)
    finetune_min_share: float = defaults.FINETUNE_MIN_SHARE
    public_metrics: bool = False  # /metrics without an admin key, tenant labels summed away
    max_request_bytes: int = 4 * 1024 * 1024  # JSON bodies (api.state.DEFAULT_MAX_REQUEST_BYTES: why)
    max_n: int = 16  # the most completions one chat request may ask for (`n`), 1..128
    max_upload_bytes: int = 128 * 1024 * 1024  # POST /v1/files (api.state.DEFAULT_MAX_UPLOAD_BYTES: why)
    dedicated_min_tokens: int | None = None  # jobs training this many tokens go to Ray Train (None: never)
    dedicated_workers: int = 2  # workers of a dedicated run that does not say (finetune.dedicated)
    engine: EngineKind = EngineKind.TORCH  # the backend (`--engine`; coserve.backends.registry)
    engines: int | None = None  # engine actors (`--engines`; None: one per visible GPU, one on the CPU)
    enable_python_graders: bool = False  # run `python` graders in a bubblewrap sandbox (graders.python_grader)
    lenient_params: bool = False  # drop unknown request fields with a log line instead of a 400
    kv_cache_memory_gb: float | None = None  # each engine's KV cache (None: a fixed size on the CPU; on CUDA
    #                                          what gpu_memory_utilization leaves: docs/serving.md#memory)
    gpu_memory_utilization: float | None = None  # CUDA: the GPU's share each engine may use (None: 0.9)
    max_model_len: int | None = None  # the context length (None: the model's)
    # a paused dedicated run keeps its workers this long, then gives them back (finetune.dedicated)
    dedicated_pause_timeout_s: float = defaults.DEDICATED_PAUSE_TIMEOUT_S
    chat_template: str | None = None  # a Jinja file that replaces the model's chat template when serving

    def chat_template_text(self) -> str | None:
        """The `--chat-template` file's text (None: the model's own template).

        Raises:
            ValueError: the file cannot be read, is over `MAX_CHAT_TEMPLATE_BYTES`, or is not UTF-8.
        """
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        try:
            if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
                raise ValueError(f"--chat-template {path}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {path}: cannot be read ({error})") from None

    @property
    def base_model_id(self) -> str:
        """The public id of the base model: its folder's name."""
        return Path(self.model).resolve().name

    def validate(self) -> None:
        """Check every setting before anything heavy starts.

        Raises:
            ValueError: the first bad setting, named as on the command line.
        """
        positive = {"--max-num-seqs": self.max_num_seqs, "--max-batch-tokens": self.max_batch_tokens,
                    "--adapter-slots": self.adapter_slots, "--max-request-bytes": self.max_request_bytes,
                    "--max-upload-bytes": self.max_upload_bytes}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, slo in {"--tpot-slo-ms": self.tpot_slo_ms, "--ttft-slo-ms": self.ttft_slo_ms}.items():
            if slo is not None and not slo > 0:
                raise ValueError(f"{flag} must be > 0, got {slo}")
        if not 0 < self.finetune_min_share < 1:
            raise ValueError(f"--finetune-min-share must be a fraction in (0, 1), got {self.finetune_min_share}")
        if self.max_stall_ms is not None:
            from coserve.planner.settings import DEFAULT_TPOT_SLO_MS

            tpot = self.tpot_slo_ms if self.tpot_slo_ms is not None else DEFAULT_TPOT_SLO_MS
            if not tpot <= self.max_stall_ms < float("inf"):
                raise ValueError(f"--max-stall-ms must be a number >= the TPOT SLO ({tpot:g} ms), "
                                 f"got {self.max_stall_ms}")
        if not 1 <= self.max_n <= 128:
            raise ValueError(f"--max-n must be in 1..128 (OpenAI's bound on n), got {self.max_n}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check_device(self.device)
        self._check_memory_flags()
        self.dedicated_settings()
        if self.local and self.dedicated_min_tokens is not None:
            raise ValueError("--dedicated-min-tokens routes jobs to Ray Train runs: it needs Ray (not --local)")
        self._check_engines()
        if self.engine is EngineKind.VLLM:  # missing or another version: the install command, before loading
            from coserve.vllm.backend import VllmUnavailable, check_vllm

            try:
                check_vllm()
            except VllmUnavailable as error:
                raise ValueError(str(error)) from None
        if self.enable_python_graders:  # their sandbox needs bubblewrap: the package to install, before loading
            from coserve.graders.python_grader import PythonGraderRunner, SandboxUnavailable

            try:
                PythonGraderRunner().check()
            except SandboxUnavailable as error:
                raise ValueError(f"--enable-python-graders: {error}") from None
        self._check_chat_template()
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: not a model folder (no config.json)")
        from coserve.model.config import ModelConfig

        self._check_context(ModelConfig.from_pretrained(self.model))  # an unsupported architecture says so here
        tenants = self.load_tenants()
        if self.latency_profile is not None:  # another model's or machine's profile is refused here
            self.policy_factory(tenants).latency_model()

    def _check_chat_template(self) -> None:
        """`--chat-template` is a readable Jinja template (its rendering is checked on the first request)."""
        text = self.chat_template_text()
        if text is None:
            return
        import jinja2

        try:
            jinja2.Environment().parse(text)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"--chat-template {self.chat_template}: not a Jinja template: {error}") from None

    def _check_memory_flags(self) -> None:
        """The KV cache's size, the GPU's share and the context length, as numbers and for this device."""
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < float("inf"):
            raise ValueError(f"--kv-cache-memory-gb must be a number > 0, got {self.kv_cache_memory_gb}")
        share = self.gpu_memory_utilization
        if share is not None:
            if not 0 < share <= 1:
                raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {share}")
            if not self.device.startswith("cuda"):
                raise ValueError(f"--gpu-memory-utilization applies to CUDA only (--device {self.device}): on the "
                                 f"CPU the KV cache's size is --kv-cache-memory-gb")
            if self.kv_cache_memory_gb is not None:
                raise ValueError("--gpu-memory-utilization and --kv-cache-memory-gb both size the KV cache: "
                                 "give one")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")

    def _check_context(self, config: ModelConfig) -> None:
        """`--max-model-len` within the model's context; a `--kv-cache-memory-gb` that cannot hold it beside
        a fine-tuning window is refused before the model loads (the engine's cache is checked again once
        built: `coserve.contract.kv_capacity`)."""
        from coserve.contract.kv_capacity import kv_capacity_refusal
        from coserve.model.memory import DTYPE_BYTES, cache_tokens

        longest = config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > longest:
            raise ValueError(f"--max-model-len {self.max_model_len} is more than the model's context length "
                             f"({longest} tokens: max_position_embeddings in its config.json)")
        if self.kv_cache_memory_gb is None:
            return
        dtype_bytes = DTYPE_BYTES[self.resolved_dtype()]
        tokens = cache_tokens(config, dtype_bytes, self.kv_cache_memory_gb * 2**30)
        refusal = kv_capacity_refusal(tokens, self.max_model_len or longest)
        if refusal is not None:
            raise ValueError(f"--kv-cache-memory-gb {self.kv_cache_memory_gb:g}: {refusal}")

    def _check_engines(self) -> None:
        if self.engines is None:
            return
        if self.engines < 1:
            raise ValueError(f"--engines must be >= 1, got {self.engines}")
        if self.engines > 1 and self.local:
            raise ValueError(f"--engines {self.engines}: one engine actor per GPU runs on Ray (not --local)")
        if self.engines > 1 and ":" in self.device:
            raise ValueError(f"--engines {self.engines} with --device {self.device}: Ray gives each engine a GPU "
                             "of its own; use --device cuda")
        if os.environ.get("RAY_ADDRESS") is None or self.local:  # else checked on the cluster, once connected
            self.num_engines()

    def num_engines(self) -> int:
        """The engines to run: `--engines`, or one per visible GPU (one on the CPU); 1 with `--local`.

        Raises:
            EnginesUnavailable: more than the Ray cluster (when connected) or this machine has GPUs, or
                cores on the CPU.
        """
        from coserve.server.engine_count import engine_room

        if self.local:
            return 1
        return engine_room(self.device).count(self.engines)

    def load_tenants(self) -> Any:
        """The parsed tenants file. Raises ValueError (with the path) when it is missing or invalid."""
        from coserve.tenancy.tenants import load_tenants

        try:
            return load_tenants(self.tenants)
        except FileNotFoundError:
            raise ValueError(f"--tenants {self.tenants}: no such file") from None

    def dedicated_settings(self) -> Any:
        """Dedicated fine-tuning on Ray Train (`coserve.finetune.dedicated`); None with `--local`.

        Raises:
            ValueError: a threshold < 1 or a worker count outside 1..1024, named as flags.
        """
        from coserve.finetune.dedicated import DedicatedSettings

        settings = DedicatedSettings(min_trained_tokens=self.dedicated_min_tokens,
                                     default_workers=self.dedicated_workers,
                                     use_gpu=self.device.startswith("cuda"), dtype=self.dtype,
                                     pause_timeout_s=self.dedicated_pause_timeout_s)
        return None if self.local else settings

    def engine_config(self) -> Any:
        from coserve.contract.engine_config import EngineConfig

        config = EngineConfig(model=self.model, dtype=self.dtype, device=self.device, max_loras=self.adapter_slots,
                              engine=self.engine, max_num_seqs=self.max_num_seqs,
                              max_batch_tokens=self.max_batch_tokens, kv_cache_memory_gb=self.kv_cache_memory_gb,
                              max_model_len=self.max_model_len)
        if self.gpu_memory_utilization is None:  # the engines' default
            return config
        return dataclasses.replace(config, gpu_memory_utilization=self.gpu_memory_utilization)

    def resolved_dtype(self) -> str:
        """The dtype the engines serve in: `--dtype`, "auto" being the model config's (the same for both
        engines: `coserve.model.config.dtype_name`)."""
        from coserve.model.config import ModelConfig, dtype_name

        return dtype_name(self.dtype, ModelConfig.from_pretrained(self.model))

    def policy_factory(self, tenants: Any) -> Any:
        """The hybrid token policy's factory: SLOs, tenant weights, the latency profile."""
        import json

        from coserve.cluster.policy_factory import CoServingPolicyFactory
        from coserve.planner.latency import ModelFingerprint, engine_machine_id, model_id_from_config

        config = json.loads((Path(self.model) / "config.json").read_text(encoding="utf-8"))
        fingerprint = ModelFingerprint(model_id_from_config(config), engine_machine_id(self.device, self.engine),
                                       self.resolved_dtype())
        return CoServingPolicyFactory(fingerprint, self.tpot_slo_ms, self.ttft_slo_ms, self.latency_profile,
                                      self.max_stall_ms, tenants.weights(), self.finetune_min_share)

    def scheduler_settings(self, tenants: Any) -> Any:
        """The SchedulerActor's settings."""
        from coserve.actors.scheduler_settings import SchedulerSettings
        from coserve.planner.settings import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS

        # The SLOs the policy keeps (its defaults when not given): /metrics counts attainment against them.
        ttft_ms = DEFAULT_TTFT_SLO_MS if self.ttft_slo_ms is None else self.ttft_slo_ms
        tpot_ms = DEFAULT_TPOT_SLO_MS if self.tpot_slo_ms is None else self.tpot_slo_ms
        slo = Slo(ttft_s=ttft_ms / 1000, tpot_s=tpot_ms / 1000)
        return SchedulerSettings(model=self.model, max_num_seqs=self.max_num_seqs,
                                 max_batch_tokens=self.max_batch_tokens,
                                 tenant_limits={name: t.limits for name, t in tenants.tenants.items()}, slo=slo,
                                 data_dir=str(Path(self.data_dir).resolve()), base_model_id=self.base_model_id,
                                 dedicated=self.dedicated_settings(),
                                 enable_python_graders=self.enable_python_graders)


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def options_from_args(args: Mapping[str, Any]) -> ServeOptions:
    """`ServeOptions` from a Serve config's `args`, checked as `coserve serve` checks its flags.

    Raises:
        ValueError: a missing `model` or `tenants`, an unknown argument, a value of the wrong type or out
            of range (named as in the config).
    """
    fields = {f.name: f for f in dataclasses.fields(ServeOptions) if f.name not in NOT_ARGS}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"unknown coserve argument(s) {unknown}; known: {sorted(fields)}")
    missing = [name for name in ("model", "tenants") if name not in args]
    if missing:
        raise ValueError(f"coserve needs the argument(s) {missing}")
    for name, value in args.items():
        _check_type(name, value, str(fields[name].type))
    values = dict(args)
    if "engine" in values:  # a name in the config: the typed setting
        values["engine"] = EngineKind.parse(values["engine"])
    opts = ServeOptions(**values)
    opts.validate()
    return opts


def _check_type(name: str, value: Any, annotation: str) -> None:
    """Check a YAML value against a `ServeOptions` annotation ("int", "float | None", "bool", "str", ...)."""
    if value is None and "None" in annotation:
        return
    if annotation == "bool":
        ok = isinstance(value, bool)
    elif annotation.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"argument {name} must be {annotation}, got {value!r}")
