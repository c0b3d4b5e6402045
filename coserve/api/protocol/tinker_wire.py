"""The protobuf body of Tinker's `forward_backward` and `forward` (the SDK sends them as
`application/x-protobuf`, optionally zstd-compressed), decoded with the `protobuf` library.

The schema is the part of the SDK's `tinker_public.proto` (package `tinker_public`, Apache-2.0) that a
training request uses, with the SDK's field numbers: `ForwardBackwardRequest`, `Datum`, `Chunk` and its
kinds, `Tensor` (dense or CSR) and `LossConfigValue`. It is declared here as a descriptor (the protobuf
library builds the message classes from it at import, no generated code), so the server does not need
the SDK. Fields this schema leaves out (provenance spans) are skipped by the parser, as protobuf does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

_SCHEMA = """
name: "coserve_tinker_wire.proto"
package: "tinker_public"
syntax: "proto3"
enum_type { name: "DType" value { name: "DTYPE_UNSPECIFIED" number: 0 } value { name: "DTYPE_FLOAT32" number: 1 }
            value { name: "DTYPE_INT64" number: 2 } value { name: "DTYPE_INT32" number: 3 }
            value { name: "DTYPE_BFLOAT16" number: 4 } }
enum_type { name: "StopReason" value { name: "STOP_REASON_STOP" number: 0 }
            value { name: "STOP_REASON_LENGTH" number: 1 } }
message_type { name: "SampledSequence"
  field { name: "stop_reason" number: 1 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".tinker_public.StopReason" }
  field { name: "tokens" number: 2 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "logprobs" number: 3 label: LABEL_OPTIONAL type: TYPE_BYTES oneof_index: 0 proto3_optional: true }
  oneof_decl { name: "_logprobs" } }
message_type { name: "SampleResponse"
  field { name: "sequences" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE
      type_name: ".tinker_public.SampledSequence" }
  field { name: "prompt_logprobs" number: 2 label: LABEL_OPTIONAL type: TYPE_BYTES
      oneof_index: 0 proto3_optional: true }
  field { name: "prompt_cache_hit_tokens" number: 4 label: LABEL_OPTIONAL type: TYPE_INT32 }
  oneof_decl { name: "_prompt_logprobs" } }
message_type { name: "BatchedTensor"
  field { name: "data" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "offsets" number: 2 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "dtype" number: 3 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".tinker_public.DType" }
  field { name: "trailing_shape" number: 4 label: LABEL_REPEATED type: TYPE_INT64 } }
message_type { name: "ArrayRecord"
  field { name: "type_tag" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "fields" number: 2 label: LABEL_REPEATED type: TYPE_MESSAGE
      type_name: ".tinker_public.ArrayRecord.FieldsEntry" }
  field { name: "num_datums" number: 3 label: LABEL_OPTIONAL type: TYPE_INT64 }
  nested_type { name: "FieldsEntry" options { map_entry: true }
    field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE
        type_name: ".tinker_public.BatchedTensor" } } }
message_type { name: "ForwardBackwardOutput"
  field { name: "loss_fn_output_type" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "loss_fn_outputs" number: 2 label: LABEL_REPEATED type: TYPE_MESSAGE
      type_name: ".tinker_public.ArrayRecord" }
  field { name: "metrics" number: 3 label: LABEL_REPEATED type: TYPE_MESSAGE
          type_name: ".tinker_public.ForwardBackwardOutput.MetricsEntry" }
  nested_type { name: "MetricsEntry" options { map_entry: true }
    field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_DOUBLE } } }
message_type { name: "SparseCsr"
  field { name: "values" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "crow_indices" number: 2 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "col_indices" number: 3 label: LABEL_OPTIONAL type: TYPE_BYTES } }
message_type { name: "Tensor"
  field { name: "dense" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES oneof_index: 0 }
  field { name: "sparse_csr" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".tinker_public.SparseCsr"
          oneof_index: 0 }
  field { name: "dtype" number: 3 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".tinker_public.DType" }
  field { name: "shape" number: 4 label: LABEL_REPEATED type: TYPE_INT64 }
  oneof_decl { name: "encoding" } }
message_type { name: "EncodedTextChunk" field { name: "tokens" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES } }
message_type { name: "ImageChunk" field { name: "data" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES }
  field { name: "format" number: 2 label: LABEL_OPTIONAL type: TYPE_STRING } }
message_type { name: "DmelChunk" field { name: "dmel" number: 1 label: LABEL_OPTIONAL type: TYPE_BYTES } }
message_type { name: "Chunk"
  field { name: "encoded_text" number: 1 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".tinker_public.EncodedTextChunk" oneof_index: 0 }
  field { name: "image" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".tinker_public.ImageChunk"
          oneof_index: 0 }
  field { name: "dmel" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".tinker_public.DmelChunk"
          oneof_index: 0 }
  oneof_decl { name: "chunk" } }
message_type { name: "LossConfigValue"
  field { name: "number" number: 1 label: LABEL_OPTIONAL type: TYPE_DOUBLE oneof_index: 0 }
  field { name: "text" number: 2 label: LABEL_OPTIONAL type: TYPE_STRING oneof_index: 0 }
  oneof_decl { name: "value" } }
message_type { name: "Datum"
  field { name: "model_input" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".tinker_public.Chunk" }
  field { name: "loss_fn_inputs" number: 2 label: LABEL_REPEATED type: TYPE_MESSAGE
          type_name: ".tinker_public.Datum.LossFnInputsEntry" }
  nested_type { name: "LossFnInputsEntry" options { map_entry: true }
    field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".tinker_public.Tensor" } } }
message_type { name: "ForwardBackwardRequest"
  field { name: "model_id" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "seq_id" number: 2 label: LABEL_OPTIONAL type: TYPE_INT32 }
  field { name: "data" number: 3 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".tinker_public.Datum" }
  field { name: "loss_fn" number: 4 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "loss_fn_config" number: 5 label: LABEL_REPEATED type: TYPE_MESSAGE
          type_name: ".tinker_public.ForwardBackwardRequest.LossFnConfigEntry" }
  field { name: "forward_only" number: 6 label: LABEL_OPTIONAL type: TYPE_BOOL }
  field { name: "loss_fn_config_v2" number: 7 label: LABEL_REPEATED type: TYPE_MESSAGE
          type_name: ".tinker_public.ForwardBackwardRequest.LossFnConfigV2Entry" }
  nested_type { name: "LossFnConfigEntry" options { map_entry: true }
    field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_DOUBLE } }
  nested_type { name: "LossFnConfigV2Entry" options { map_entry: true }
    field { name: "key" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
    field { name: "value" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE
            type_name: ".tinker_public.LossConfigValue" } } }
"""


def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()  # its own pool: the SDK's classes may be loaded in this process
    pool.Add(text_format.Parse(_SCHEMA, descriptor_pb2.FileDescriptorProto()))
    return pool


_POOL = _pool()
ForwardBackwardRequest: Any = message_factory.GetMessageClass(
    _POOL.FindMessageTypeByName("tinker_public.ForwardBackwardRequest"))
ForwardBackwardOutput: Any = message_factory.GetMessageClass(
    _POOL.FindMessageTypeByName("tinker_public.ForwardBackwardOutput"))
SampleResponse: Any = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("tinker_public.SampleResponse"))
PROTOBUF = "application/x-protobuf"


def forward_backward_output(per_datum_logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one batched float32 `logprobs` field over the data (the SDK's v1 shape)."""
    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for name, value in metrics.items():
        out.metrics[name] = value
    record = out.loss_fn_outputs.add(num_datums=len(per_datum_logprobs))
    arrays = [np.asarray(values, dtype=np.float32) for values in per_datum_logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    batched = record.fields["logprobs"]
    batched.data = b"".join(a.tobytes() for a in arrays)
    batched.offsets = offsets.tobytes()
    batched.dtype = 1  # float32
    return bytes(out.SerializeToString())


def sample_response(sequences: list[tuple[list[int], list[float] | None, bool]]) -> bytes:
    """`SampleResponse`: per sequence its tokens, their log-probs and whether it stopped on length."""
    out = SampleResponse()
    for tokens, logprobs, length in sequences:
        seq = out.sequences.add(stop_reason=1 if length else 0, tokens=np.asarray(tokens, np.int32).tobytes())
        if logprobs is not None:
            seq.logprobs = np.asarray(logprobs, np.float32).tobytes()
    return bytes(out.SerializeToString())
