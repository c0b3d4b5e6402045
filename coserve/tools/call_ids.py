"""Tool-call ids as a family's templates take them.

Mistral templates refuse any id that is not 9 characters ("Tool call IDs should be alphanumeric strings
with length 9!"), and OpenAI's ids (`call_` and 24 more) or a training file's (`call_1`) are not. Before
such a template renders a conversation, each id becomes 9 letters and digits derived from it: the same
id always gives the same one, so a call and the `tool` message that answers it still match. An id that
already has that shape is kept.
"""

from __future__ import annotations

import hashlib
import string

_ALPHABET = string.ascii_letters + string.digits
MISTRAL_ID_LENGTH = 9


def keep_id(call_id: str) -> str:
    """The id as the client sent it (templates that do not check ids)."""
    return call_id


def nine_char_id(call_id: str) -> str:
    """`call_id` if it is 9 ASCII letters and digits, else 9 such characters derived from it."""
    if len(call_id) == MISTRAL_ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(MISTRAL_ID_LENGTH):
        number, digit = divmod(number, len(_ALPHABET))
        chars.append(_ALPHABET[digit])
    return "".join(chars)
