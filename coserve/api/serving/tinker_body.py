"""A `forward_backward` / `forward` body as a call, decoded off the event loop and bounded by construction.

The body is protobuf (`tinker_wire`), zstd-compressed when its `Content-Encoding` says so. Everything
between the bytes and the call runs in `DECODE_THREADS` threads of its own (`decode_call`), never on the
event loop, so a large or hostile body delays no other request and `/health`:

1. decompression is streamed (`zstandard`'s `stream_reader`, read in chunks) with a hard cap on its
   output, `max_bytes` (the server's `--max-request-bytes`): a body that decompresses to more is a 413,
   whatever its frame header declares (python-zstandard's one-shot `decompress` trusts a declared
   content size over `max_output_size`). The frame's window is capped too (`MAX_WINDOW_BYTES`): a frame
   asking for a larger one is refused before its buffer is allocated;
2. the protobuf parse (its memory is about 20 times the bytes at worst, for a body of empty messages);
3. the checks of `tinker_data` (token ids against the vocabulary, shapes against the sequence, sizes).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zstandard
from google.protobuf.message import DecodeError

from coserve.api.protocol.base import ProtocolError
from coserve.api.protocol.tinker_wire import ForwardBackwardRequest
from coserve.api.serving.tinker_data import ModelBounds, forward_backward_call
from coserve.contract.training_calls import ForwardBackwardCall

DECODE_THREADS = 2  # bodies decoded at once; more wait their turn
MAX_WINDOW_BYTES = 2**23  # zstd levels up to 19 use at most this window (8 MiB)
_READ_BYTES = 2**20
_POOL = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="tinker-decode")


def decompress(body: bytes, max_bytes: int) -> bytes:
    """The zstd `body` decompressed, every frame of it; a 413 past `max_bytes`, a 400 if it is not zstd."""
    out = bytearray()
    try:
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        with decompressor.stream_reader(body, read_across_frames=True) as reader:
            while chunk := reader.read(min(_READ_BYTES, max_bytes + 1 - len(out))):
                out += chunk
                if len(out) > max_bytes:
                    raise ProtocolError(f"The zstd body decompresses to more than {max_bytes} bytes, the "
                                        "largest body this server takes.", status=413, code="request_too_large")
    except zstandard.ZstdError as error:
        raise ProtocolError(f"The zstd body does not decompress: {error}.", code="invalid_body") from None
    return bytes(out)


def parse_call(body: bytes, zstd: bool, max_bytes: int, bounds: ModelBounds) -> tuple[str, ForwardBackwardCall]:
    """The body's run id and call (`decode_call` runs this in a thread)."""
    if zstd:
        body = decompress(body, max_bytes)
    try:
        message = ForwardBackwardRequest.FromString(body)
    except DecodeError as error:
        raise ProtocolError(f"The body is not a ForwardBackwardRequest: {error}.", code="invalid_body") from None
    return str(message.model_id), forward_backward_call(message, bounds)


async def decode_call(body: bytes, zstd: bool, max_bytes: int, bounds: ModelBounds) -> tuple[str, Any]:
    """`parse_call` off the event loop, in the decode threads."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, parse_call, body, zstd, max_bytes, bounds)
