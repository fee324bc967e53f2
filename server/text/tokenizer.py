"""The embedded text model's byte-level tokenizer and chat template (pure Python, no torch).

Token ids 0..255 are the bytes of UTF-8 text, so any string round-trips and the prompt length in
tokens is its length in bytes (plus the special tokens the template adds). A few ids above 255
are special tokens; they never appear in decoded text.

Chat template: ``<bos>`` then, per message, a role token, the content's bytes and ``<end>``; the
prompt ends with ``<assistant>`` so the model continues as the assistant. Generation stops at
``<eos>`` or ``<end>`` (unless ``ignore_eos``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "BOS",
    "EOS",
    "END",
    "ROLE_TOKENS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "STOP_TOKENS",
    "ByteTokenizer",
    "ChatMessage",
]

BOS = 256
EOS = 257
END = 258  # end of a chat turn
ROLE_TOKENS: Mapping[str, int] = {"system": 259, "user": 260, "assistant": 261, "developer": 259, "tool": 262}
SPECIAL_TOKENS: frozenset[int] = frozenset({BOS, EOS, END, *ROLE_TOKENS.values()})
#: Tokens that end a generation (unless the request sets ``ignore_eos``).
STOP_TOKENS: frozenset[int] = frozenset({EOS, END})
#: Embedding rows: the 263 ids above, padded to a multiple of 8.
VOCAB_SIZE = 264


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One chat message after validation.

    Args:
        role: ``system``, ``developer``, ``user``, ``assistant`` or ``tool``.
        content: its text.
    """

    role: str
    content: str


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus the special tokens above."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """The byte ids of ``text`` (lone surrogates are encoded as ``?`` rather than failing).

        Args:
            text: any string.
        """
        return list(text.encode("utf-8", errors="replace"))

    def completion_prompt(self, prompt: str) -> list[int]:
        """``<bos>`` + the prompt's bytes.

        Args:
            prompt: the raw prompt of ``/v1/completions``.
        """
        return [BOS, *self.encode(prompt)]

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The chat template applied to ``messages``, ending with the assistant role token.

        Args:
            messages: the conversation so far.
        """
        ids = [BOS]
        for m in messages:
            ids.append(ROLE_TOKENS[m.role])
            ids.extend(self.encode(m.content))
            ids.append(END)
        ids.append(ROLE_TOKENS["assistant"])
        return ids

    @staticmethod
    def token_bytes(token: int) -> bytes:
        """The bytes a token stands for in output text (empty for special tokens).

        Args:
            token: a token id.
        """
        return bytes((token,)) if 0 <= token < 256 else b""

    def decode(self, tokens: Iterable[int]) -> str:
        """Decode tokens to text (invalid UTF-8 becomes U+FFFD; special tokens vanish).

        Args:
            tokens: token ids.
        """
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")
