"""A hostile tenant's requests of issue 45, one HTTP request each, with what the server must answer.

Each `TenantAttack` is a method, a path and a body (no client: whoever sends it picks one), and either the
statuses of its refusal (a 4xx naming what is wrong) or, for a request that is served, a check of the
answer that says the attack was contained (a python grader that scores 0: nothing escaped; a formula that
overflows: reward 0 with its error flag). `verdict` reads an answer against that. The cases: python
grader escapes (`grader_escapes.py`), out-of-vocabulary token ids in Tinker's `forward_backward` and
`forward` and in a completions prompt, a zstd bomb, CSR shapes of 2^40 rows and of a huge sparse matrix,
a save's name ending in a newline, telemetry past its caps, poisoned uploads (a lone surrogate, nesting
100,000 deep, invalid UTF-8), big powers in `calculate_output`, a grader of thousands of graders,
`rouge_l` on texts past its bound, a job on another tenant's file. The soak
(benchmarks/soak_tenants.py) sends them in a loop beside a victim tenant; the flows that take several
calls (idle Tinker runs, saves past the quota, session floods, a DPO job on a poisoned file) are there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from coserve.api.protocol.tinker_wire import PROTOBUF, ForwardBackwardRequest
from coserve.bench.grader_escapes import EscapeTarget, escapes

JSON = "application/json"
TOKENS = list(range(5, 37))  # a datum's tokens: ids every vocabulary has


@dataclass(frozen=True)
class TenantAttack:
    """One request of the attacker (its API key is added by the sender: `X-API-Key` on `/tinker/`,
    a bearer token elsewhere).

    Attributes:
        method, path: the HTTP request.
        content: the body's bytes (None: `upload` is sent instead).
        content_type: the body's type; `encoding` its `content-encoding` (zstd) when set.
        upload: a file sent as `POST /v1/files`'s multipart `file`, purpose `fine-tune`.
        refused: the statuses of its refusal; empty when it is served and `contained` judges the answer.
        contained: whether a served answer (its JSON) shows the attack contained.
    """

    method: str
    path: str
    content: bytes | None = None
    content_type: str = JSON
    encoding: str | None = None
    upload: bytes | None = None
    refused: frozenset[int] = frozenset()
    contained: Callable[[Any], bool] | None = None


def verdict(attack: TenantAttack, status: int, answer: Any) -> str:
    """`refused` (a 4xx; `refused-other` when not one of the attack's statuses), `contained` (a served
    answer its check accepts), `ESCAPED` (a served answer it does not), `server_error` (a 5xx)."""
    if status >= 500:
        return "server_error"
    if 400 <= status < 500:
        return "refused" if status in attack.refused or not attack.refused else "refused-other"
    if attack.contained is None:
        return "ESCAPED"  # a refusal was due and it was served
    try:
        return "contained" if attack.contained(answer) else "ESCAPED"
    except (KeyError, TypeError, AttributeError):
        return "ESCAPED"


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _refused(method: str, path: str, body: Any, *statuses: int) -> TenantAttack:
    return TenantAttack(method, path, _json(body), refused=frozenset(statuses))


# ---- Tinker: forward_backward bodies (the SDK's protobuf, built from the server's own schema)


def forward_backward_body(run_id: str, data: list[tuple[list[int], list[int]]], forward_only: bool = False) -> Any:
    """A `ForwardBackwardRequest` message of cross-entropy data, each (model_input, target_tokens)."""
    message = ForwardBackwardRequest(model_id=run_id, seq_id=1, loss_fn="cross_entropy", forward_only=forward_only)
    for inputs, targets in data:
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(inputs, np.int32).tobytes()
        for name, values, dtype, code in (("target_tokens", targets, np.int64, 2),
                                          ("weights", [1.0] * len(targets), np.float32, 1)):
            tensor = datum.loss_fn_inputs[name]
            tensor.dense, tensor.dtype = np.asarray(values, dtype).tobytes(), code
            tensor.shape.append(len(values))
    return message


def csr_body(run_id: str, shape: list[int], rows: int) -> bytes:
    """A forward_backward whose `weights` are a CSR tensor of `shape` with `rows` row pointers."""
    message = forward_backward_body(run_id, [(TOKENS[:-1], TOKENS[1:])])
    weights = message.data[0].loss_fn_inputs["weights"]
    weights.ClearField("dense")
    del weights.shape[:]
    weights.shape.extend(shape)
    weights.sparse_csr.values = b""
    weights.sparse_csr.crow_indices = np.zeros(rows, np.int64).tobytes()
    weights.sparse_csr.col_indices = b""
    return bytes(message.SerializeToString())


def zstd_bomb(declared: int = 2**30) -> bytes:
    """About 32 KB of zstd whose frame declares (and holds) `declared` bytes of zeros: python-zstandard's
    one-shot `decompress` trusts the declared size over `max_output_size`."""
    stream = zstandard.ZstdCompressor(level=3).compressobj(size=declared)
    zeros = bytes(2**24)
    return b"".join(stream.compress(zeros) for _ in range(declared // len(zeros))) + stream.flush()


def _fb(body: bytes, status: int, encoding: str | None = None) -> TenantAttack:
    return TenantAttack("POST", "/tinker/api/v1/forward_backward", body, PROTOBUF, encoding,
                        refused=frozenset({status}))


def _data(run_id: str, data: list[tuple[list[int], list[int]]], forward_only: bool = False) -> bytes:
    return bytes(forward_backward_body(run_id, data, forward_only).SerializeToString())


def tinker_attacks(run_id: str, vocab: int, bomb: bytes) -> dict[str, TenantAttack]:
    """Bodies past the Tinker API's bounds, against the attacker's run `run_id` (`bomb`: `zstd_bomb()`,
    built once: it takes half a second)."""
    seq = TOKENS[:3] + [vocab + 7] + TOKENS[3:]  # the issue's ~100-byte call: one id past the vocabulary
    oov = (seq[:-1], seq[1:])
    api = "/tinker/api/v1"
    telemetry = {"events": [{}] * 101, "platform": "x", "sdk_version": "x", "session_id": "s", "process_uuid": "p"}
    return {
        "tinker_oov_forward_backward": _fb(_data(run_id, [oov]), 400),
        "tinker_oov_forward": _fb(_data(run_id, [oov], forward_only=True), 400),
        "tinker_oov_target_tokens": _fb(_data(run_id, [(TOKENS[:-1], TOKENS[1:-1] + [10**9])]), 400),
        "tinker_zstd_bomb": _fb(bomb, 413, "zstd"),
        "tinker_csr_shape_2_40": _fb(csr_body(run_id, [2**40, 1], 2), 400),
        "tinker_csr_rows_10_7": _fb(csr_body(run_id, [10**7, 1], 2), 400),  # the 635 bytes
        "tinker_sparse_shape_2_20_squared": _fb(csr_body(run_id, [2**20, 2**20], 2**18), 400),
        "tinker_save_name_newline": _refused("POST", f"{api}/save_weights_for_sampler",
                                             {"model_id": run_id, "path": "x\n"}, 400),
        "tinker_save_name_traversal": _refused("POST", f"{api}/save_weights_for_sampler",
                                               {"model_id": run_id, "path": "../x"}, 400),
        "tinker_telemetry_2_mib": TenantAttack("POST", f"{api}/telemetry", b"{" + b" " * 2**21 + b"}",
                                               refused=frozenset({413})),
        "tinker_telemetry_101_events": _refused("POST", f"{api}/telemetry", telemetry, 400),
    }


# ---- OpenAI endpoints: token ids, uploads, graders, another tenant's data

EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}
ROUGE = {"type": "text_similarity", "name": "r", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "evaluation_metric": "rouge_l"}
USER, ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}
PAIR = {"input": {"messages": [USER]}, "preferred_output": [ANSWER],
        "non_preferred_output": [{"role": "assistant", "content": "no"}]}


def jsonl(*rows: Any) -> bytes:
    """Rows as JSONL (`ensure_ascii`: a lone surrogate is written as its `\\udxxx` escape)."""
    return "\n".join(json.dumps(row) for row in rows).encode()


POISONED_UPLOADS = {  # each passed upload before issue 45, or was a 500
    "upload_dpo_lone_surrogate": jsonl(PAIR, {**PAIR, "preferred_output": [{"role": "assistant",
                                                                             "content": "\udfff"}]}),
    "upload_chat_lone_surrogate": jsonl({"messages": [{"role": "user", "content": "hi \ud800"}, ANSWER]}),
    "upload_nested_100k_deep": jsonl({"messages": [USER, ANSWER]}) + b"\n" + b"[" * 100_000 + b"]" * 100_000,
    "upload_invalid_utf8": jsonl({"messages": [USER, ANSWER]}) + b'\n{"messages": "\xff\xfe"}',
}


def _graded(grader: dict[str, Any], sample: str, item: dict[str, Any]) -> bytes:
    return _json({"grader": grader, "model_sample": sample, "item": item})


def _scored_zero(flag: str) -> Callable[[Any], bool]:
    return lambda answer: answer["reward"] == 0.0 and bool(answer["metadata"]["errors"][flag])


def _nest(leaf: dict[str, Any], widths: tuple[int, ...]) -> dict[str, Any]:
    for level, width in enumerate(widths):
        leaf = {"type": "multi", "name": f"l{level}", "calculate_output": "g0",
                "graders": {f"g{i}": leaf for i in range(width)}}
    return leaf


def openai_attacks(model: str, vocab: int, victim_file: str) -> dict[str, TenantAttack]:
    """Requests past the OpenAI endpoints' bounds, and reads of another tenant's file `victim_file`."""
    grade = "/v1/fine_tuning/alpha/graders/run"
    words = "word " * 1999  # 1,999 x 1,999 words of ROUGE-L: 4 s of the GIL before its bound
    uploads = {name: TenantAttack("POST", "/v1/files", upload=data, refused=frozenset({400}))
               for name, data in POISONED_UPLOADS.items()}
    return {
        "completions_oov_prompt": _refused("POST", "/v1/completions",
                                           {"model": model, "prompt": [5, vocab + 3], "max_tokens": 2}, 400),
        **uploads,
        "formula_4000000_pow_1000000": TenantAttack("POST", grade, _graded(
            {"type": "multi", "name": "m", "calculate_output": "4000000 ^ 1000000 * exact",
             "graders": {"exact": EXACT}}, "x", {"answer": "x"}), contained=_scored_zero("formula_parse_error")),
        "formula_1000_pow_1000": TenantAttack("POST", grade, _graded(
            {"type": "multi", "name": "m", "calculate_output": "1000 ^ 1000", "graders": {"exact": EXACT}},
            "x", {"answer": "x"}), contained=_scored_zero("formula_parse_error")),
        "grader_of_8192_rouge_l": TenantAttack("POST", grade, _graded(_nest({**ROUGE, "reference": "x"}, (32, 32, 8)),
                                                                      "word " * 1000, {}), refused=frozenset({400})),
        "rouge_l_huge_texts": TenantAttack("POST", grade, _graded(ROUGE, words, {"answer": words}),
                                           contained=_scored_zero("other_error")),
        "grader_sample_over_65536": TenantAttack("POST", grade, _graded(EXACT, "x" * 70_000, {"answer": "x"}),
                                                 refused=frozenset({400})),
        "job_on_victims_file": _refused("POST", "/v1/fine_tuning/jobs", {"model": model, "training_file": victim_file},
                                        400, 404),
        "read_victims_file": TenantAttack("GET", f"/v1/files/{victim_file}/content", refused=frozenset({404})),
    }


def escape_attacks(target: EscapeTarget, secrets: tuple[str, ...]) -> dict[str, TenantAttack]:
    """The python grader escapes as `graders/run` requests: contained when the grader scored 0 with no
    runtime error, and no string of `secrets` (API keys) is anywhere in the answer."""
    def contained(answer: Any) -> bool:
        text, errors = json.dumps(answer), answer["metadata"]["errors"]
        return answer["reward"] == 0.0 and not errors["python_grader_runtime_error"] \
            and not any(secret in text for secret in secrets)

    return {name: TenantAttack("POST", "/v1/fine_tuning/alpha/graders/run", _graded(
        {"type": "python", "name": "attack", "source": source}, "x", item), contained=contained)
        for name, (source, item) in escapes(target).items()}


def dpo_job_rows() -> bytes:
    """A DPO file that passes upload and fails its job: tools the tiny models' chat template cannot render
    (a template that can: its `lora_alpha` of 1e30 diverges)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    return jsonl(*[{**PAIR, "input": {"messages": [{"role": "user", "content": f"hi {i}"}], "tools": tools}}
                   for i in range(10)])


def dpo_job_request(model: str, file_id: str) -> dict[str, Any]:
    """`POST /v1/fine_tuning/jobs` for `dpo_job_rows`'s file."""
    return {"model": model, "training_file": file_id, "method": {"type": "dpo", "dpo": {"hyperparameters": {
        "n_epochs": 1, "batch_size": 2}}}, "lora": {"r": 4, "lora_alpha": 1e30}}
