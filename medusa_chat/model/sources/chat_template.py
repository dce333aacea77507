"""Turn a conversation into prompt token ids: Vicuna v1.1 for the lmsys models, the tokenizer's own otherwise.

Messages are `{"role": "system"|"user"|"assistant", "content": str | list-of-parts}`; Gradio 6 delivers
content as a list of parts (`[{"type": "text", "text": ...}]`), flattened here so no UI has to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from medusa_chat.errors import PromptError

VICUNA_V11 = "vicuna_v1.1"
TOKENIZER = "tokenizer"
VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
VICUNA_STOP_STRINGS = ("USER:",)  # a model that starts writing the user's next turn has finished its own
ROLES = ("system", "user", "assistant")


def flatten_content(content: Any) -> str:
    """Text of a message's content: a string, a Gradio-style list of parts, or a single part dict.

    Non-text parts (images, files) are dropped: these are text-only models.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if content.get("type", "text") == "text" and isinstance(content.get("text"), str):
            return content["text"]
        return ""
    if isinstance(content, (list, tuple)):
        parts = [flatten_content(part) for part in content]
        return "\n".join(p for p in parts if p)
    raise PromptError(f"cannot read message content of type {type(content).__name__}")


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Plain `{"role", "content": str}` dicts, roles checked; a leading system message stays first."""
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise PromptError(f"message {i} has no role")
        role = message["role"]
        if role not in ROLES:
            raise PromptError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise PromptError("a system message may only come first")
        out.append({"role": role, "content": flatten_content(message.get("content"))})
    if not any(m["role"] != "system" for m in out):
        raise PromptError("the conversation has no user message")
    return out


def vicuna_v11_text(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The Vicuna v1.1 conversation text, exactly as FastChat builds it (sep " ", sep2 "</s>").

    `SYSTEM USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT:` — FastChat puts no space after `</s>`; the
    published Vicuna/Medusa checkpoints were trained on that string.
    """
    system = VICUNA_SYSTEM
    rest = list(messages)
    if rest and rest[0]["role"] == "system":
        system = rest.pop(0)["content"]
    text = system + " "
    for m in rest:
        if m["role"] == "user":
            text += "USER: " + m["content"] + " "
        else:
            text += "ASSISTANT: " + m["content"] + "</s>"
    if add_generation_prompt and (not rest or rest[-1]["role"] == "user"):
        text += "ASSISTANT:"
    return text


def thinking_switch(template: Any) -> dict[str, bool]:
    """`enable_thinking` for a template that reads it (Qwen3's): off unless MEDUSA_CHAT_THINKING=1. A chat reply
    should answer, not open with a long `<think>` block the user waits through (a thinking model's own default);
    off, Qwen3's template closes an empty think block itself. Other templates get nothing extra."""
    from medusa_chat import envvars

    if "enable_thinking" not in str(template):
        return {}
    return {"enable_thinking": envvars.value("MEDUSA_CHAT_THINKING") not in (None, "0")}


def build_prompt_ids(
    tokenizer: Any,
    template: str,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the conversation in `template` ("vicuna_v1.1" or "tokenizer")."""
    if not messages:
        raise PromptError("empty conversation")
    msgs = normalize_messages(messages)
    if template == VICUNA_V11:
        text = vicuna_v11_text(msgs, add_generation_prompt)
        # add_special_tokens=True: Llama tokenizers put <s> first, as in training. "</s>" inside the text is
        # matched as the special token.
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    elif template == TOKENIZER:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("this tokenizer has no chat template; use the vicuna_v1.1 template")
        ids = tokenizer.apply_chat_template(
            msgs,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **thinking_switch(tokenizer.chat_template),
        )
    else:
        raise PromptError(f"unknown chat template {template!r} (expected {VICUNA_V11!r} or {TOKENIZER!r})")
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # some tokenizers answer a batch of one
        ids = ids[0]
    return [int(i) for i in ids]
