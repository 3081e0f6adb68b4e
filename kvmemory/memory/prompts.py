"""Rendering solutions and questions into token ids that share prefixes.

A graft needs the tokens before it to be exactly the stored ones, so a follow-up is rendered as the
stored entry's token ids followed by the tokens of what the chat template adds after them (the
template's text difference, tokenized on its own). With chat templates that close every turn with a
special token this gives the same ids as rendering the whole conversation. Models without a chat
template get a plain "Problem / Solution / Question" layout built the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

Message = dict[str, str]


def solution_text(solution: str, answer: str | None) -> str:
    """The assistant turn of an entry: the solution, ending with its answer when one is given."""
    solution = solution.strip()
    if answer is None or str(answer).strip() == "" or solution.rstrip(". ").endswith(str(answer).strip()):
        return solution
    return f"{solution}\nThe answer is {str(answer).strip()}."


def entry_messages(problem: str, solution: str, answer: str | None = None) -> list[Message]:
    return [{"role": "user", "content": problem.strip()},
            {"role": "assistant", "content": solution_text(solution, answer)}]


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_text(tokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    if _has_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    parts = []
    for m in messages:
        label = {"user": "Question", "assistant": "Answer", "system": "System"}.get(m["role"], m["role"])
        parts.append(f"{label}: {m['content']}\n\n")
    if add_generation_prompt:
        parts.append("Answer:")
    return "".join(parts)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_ids(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a whole conversation (a leading BOS when the tokenizer uses one)."""
    ids = encode(tokenizer, render_text(tokenizer, messages, add_generation_prompt))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def continuation_ids(tokenizer, prefix: Sequence[Message], new: Sequence[Message],
                     add_generation_prompt: bool = True) -> list[int] | None:
    """Ids of what rendering `prefix + new` adds after rendering `prefix` alone, or None when the
    template does not extend the prefix's text (then the caller renders the whole conversation)."""
    head = render_text(tokenizer, prefix, False)
    full = render_text(tokenizer, list(prefix) + list(new), add_generation_prompt)
    if not full.startswith(head):
        return None
    return encode(tokenizer, full[len(head):])
