"""A chat conversation as the prompt text the model sees: messages through the tokenizer's chat
template, with vLLM's options. Shared by ``POST /v1/chat/completions`` (chat.py) and
``LLM.chat`` (llm.py), so both render a conversation the same way.

* ``add_generation_prompt`` (default true): end with the template's opening of an assistant turn.
* ``continue_final_message``: leave the last message open (no end-of-turn after it), for the reply
  to continue it, e.g. a prefilled start of the assistant's answer; the rendered text is cut right
  after that message's text, as Hugging Face's ``apply_chat_template`` does. Not with
  ``add_generation_prompt``.
* ``tools``: the tool definitions, given to the template as ``tools`` (what it does with them is
  the template's business).
* ``chat_template_kwargs``: more variables for the template (``{"enable_thinking": false}``); they
  may not replace the ones above or the template's own (``messages``, ``bos_token``, ...).

Every problem is an ``APIError`` (400) naming the request field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from .errors import bad_request
from .openai_types import ChatMessage
from .tokenizer import Tokenizer, TokenizerError

# OpenAI's roles; "developer" is the newer name of "system". Whether the model's template can
# render "tool"/"function" turns is the template's business (it raises if not).
KNOWN_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
# template variables a request's chat_template_kwargs may not set
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                         "bos_token", "eos_token", "raise_exception"})


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true: set "
                              "add_generation_prompt to false to continue the final message", "continue_final_message")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (set the request field, "
                              "where there is one)", "chat_template_kwargs")


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text (text parts joined by newlines; other parts are a 400)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                  "messages")
            texts.append(part.text)
        return "\n".join(texts)
    return content if content is not None else ""


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the template takes them: ``{"role", "content"[, "name"]}``, text content."""
    plain = []
    for i, message in enumerate(messages):
        if message.role not in KNOWN_ROLES:
            raise bad_request(f"messages[{i}].role: unknown role {message.role!r} (expected one of "
                              f"{', '.join(sorted(KNOWN_ROLES))})", "messages")
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        plain.append(entry)
    return plain


def render_prompt(tokenizer: Tokenizer, messages: list[dict], options: ChatOptions) -> str:
    """The conversation's prompt text (to be encoded without special tokens: the template writes bos)."""
    options.check()
    if not tokenizer.chat_template:
        raise bad_request("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=options.add_generation_prompt,
                                             tools=options.tools, **(options.chat_template_kwargs or {}))
    except (TokenizerError, TemplateError) as exc:
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
    except TypeError as exc:  # a template variable of the wrong type for what the template does with it
        raise bad_request(f"the chat template could not render these messages: {exc}", "chat_template_kwargs") \
            from None
    if options.continue_final_message:
        text = _open_final_message(text, messages[-1]["content"])
    return text


def _open_final_message(rendered: str, final: str) -> str:
    """``rendered`` cut right after the last message's text: whatever the template writes after
    it (an end-of-turn token, the next turn's opening) goes, so the reply continues the message."""
    core = final.strip()
    at = rendered.rfind(core) if core else -1
    if at == -1:
        raise bad_request("continue_final_message needs a final message whose text the chat template writes "
                          "as it is", "continue_final_message")
    end = at + len(core)
    trailing = final[len(final.rstrip()):]  # the message's own trailing whitespace, where the template kept it
    if trailing and rendered.startswith(trailing, end):
        end += len(trailing)
    return rendered[:end]


def reply_role(messages: list[dict], options: ChatOptions) -> str:
    """The role of the generated message (vLLM): the assistant's after a generation prompt, else
    the last message's (the one being continued)."""
    return "assistant" if options.add_generation_prompt else messages[-1]["role"]


def echoed_text(messages: list[dict], role: str) -> str:
    """What ``echo`` puts before the reply: the last message's text when it has the reply's role."""
    last = messages[-1]
    return last["content"] if last["role"] == role else ""
