"""Thin wrapper over transformers' tokenizer: chat template, EOS ids and stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m2r2.errors import InputError

Message = dict[str, str]


class ChatTokenizer:
    """Encodes chat messages with the model's own template and knows which ids end a turn."""

    def __init__(self, model_dir: Path, extra_eos: list[int] | None = None) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        eos: set[int] = set(extra_eos or [])
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        # Chat models end a turn with their template's end marker, which is not always "eos".
        for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>"):
            tid = self.hf.convert_tokens_to_ids(marker)
            if isinstance(tid, int) and tid != self.hf.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_ids = sorted(eos)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        """Token ids of ``messages`` followed by the assistant-turn prompt."""
        if not messages or not any(m.get("content", "").strip() for m in messages if m.get("role") == "user"):
            raise InputError("the prompt is empty")
        for m in messages:
            check_utf8(m.get("content", ""))
        if self.hf.chat_template:
            return token_ids(self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return self.encode(text)

    def encode_conversation(self, messages: list[Message]) -> list[int]:
        """Token ids of a whole conversation (user and assistant turns) in the chat template, without the
        assistant-turn prompt: what a training store and MoEfication read from ``{"messages": [...]}`` records."""
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.hf.chat_template:
            return token_ids(self.hf.apply_chat_template(msgs, tokenize=True))
        return self.encode("\n".join(f"{m['role']}: {m['content']}" for m in msgs))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.hf.encode(text, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))


def token_ids(encoded: Any) -> list[int]:
    """The ids of what ``apply_chat_template(..., tokenize=True)`` returns: a list, or (transformers 5) a
    ``BatchEncoding`` whose iteration yields its keys, not ids."""
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def check_utf8(text: str) -> None:
    """Text read from invalid UTF-8 (argv, stdin) carries lone surrogates the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"the prompt is not valid UTF-8 (bad byte at character {e.start})") from None


def messages_for(prompt: str, system: str | None = None, history: list[Message] | None = None) -> list[Message]:
    """Chat messages for one user turn, with an optional system prompt and earlier turns."""
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.extend(history or [])
    msgs.append({"role": "user", "content": prompt})
    return msgs
