"""Prompt fitting: each request's context becomes one chat-formatted prompt that fits beside the generation
canvas, or the whole batch of requests is refused before anything is generated; and answers are cut at the
request's stop strings.

A prompt longer than the model leaves room for (max_sequence_length - gen_length) is refused; with
`truncate_fewshot` whole few-shot examples are dropped from its front instead (never the chat template's
tokens or the question), counted per request as `fewshot_dropped`."""

from __future__ import annotations

import dataclasses

from localleap_jax.errors import LocalLeapError
from localleap_jax.tokenizer import BOS_TOKEN, Tokenizer, check_prompt


class PromptTooLongError(LocalLeapError, ValueError):
    """Prompts that do not fit beside the generation canvas; refused before anything is generated."""

    def __init__(self, too_long: int, total: int, excess: int, room: int, max_sequence_length: int,
                 gen_length: int, truncating: bool, bare: tuple[tuple[int, int], ...] = ()):
        self.truncating = truncating  # few-shot examples were already dropped where they could be
        # (document id, tokens) of each over-long prompt that stays too long with every few-shot example dropped:
        # for these only a shorter canvas, fewer problems or a longer window helps (empty: truncation would do)
        self.bare = bare
        self.too_long, self.room, self.max_sequence_length = too_long, room, max_sequence_length
        self.summary = (f"{too_long} of {total} prompts are longer than the {room} tokens the model leaves for a "
                        f"prompt (max_sequence_length {max_sequence_length} - gen_length {gen_length}), by up to "
                        f"{excess} tokens")
        if truncating:
            advice = ("truncate_fewshot could not make them fit (the question alone is too long, or lm-eval "
                      "chat-formatted the prompt, which leaves no few-shot text to cut): lower gen_length")
        elif bare:  # dropping few-shot examples would not be enough for these: say what is
            longest = max(n for _, n in bare)
            room_left = max_sequence_length - longest
            advice = (f"{len(bare)} of them stay too long with every few-shot example dropped (up to {longest} "
                      f"tokens): " + (f"gen_length={room_left} or less in --model_args leaves them room, or "
                                      if room_left > 0 else "")
                      + "leave those documents out (--limit), or use a model with a longer window"
                      + ("; truncate_fewshot=True fits the others" if len(bare) < too_long else ""))
        else:
            advice = ("pass truncate_fewshot=True in --model_args to drop few-shot examples, or lower --num_fewshot "
                      "or gen_length")
        super().__init__(f"{self.summary}; {advice}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the chat-formatted prompt that is generated from
    fewshot_dropped: int  # few-shot examples removed to make it fit


def cut_at_until(text: str, until: list[str] | str | None) -> str:
    """The text up to the earliest of the stop strings."""
    if isinstance(until, str):
        until = [until]
    for stop in until or ():
        if stop:
            text = text.split(stop, 1)[0]
    return text


def fewshot_spans(context: str, doc: dict, delimiter: str) -> tuple[list[int], int] | None:
    """(where each few-shot example starts, where the question starts) in an lm-eval context, or None.

    lm-eval builds a context as [description] example_1 + delimiter + ... + example_k + delimiter +
    question, every example rendered by the question's template. The question is found through the
    document it was rendered from (the last occurrence of its longest text field in the context); it
    starts after the last delimiter before that, and the text between is the template's prefix
    (gsm8k: "Question: "). An example starts after a delimiter followed by that prefix, so a delimiter
    inside an example (a few GSM8K questions hold blank lines) does not split it."""
    fields = sorted((v for v in (doc or {}).values() if isinstance(v, str) and v.strip() and v in context),
                    key=len, reverse=True)
    if not fields or not delimiter:
        return None
    anchor = context.rfind(fields[0])
    cut = context.rfind(delimiter, 0, anchor)
    if cut < 0:
        return None  # no few-shot examples
    question = cut + len(delimiter)
    prefix = context[question:anchor]
    starts = [0] if context.startswith(prefix) else []
    at = context.find(delimiter)
    while 0 <= at < cut:
        after = at + len(delimiter)
        if context.startswith(prefix, after) and after not in starts:
            starts.append(after)
        at = context.find(delimiter, after)
    return (starts, question) if starts else None


def encode(tokenizer: Tokenizer, context: str, chat: bool, what: str = "the context") -> list[int]:
    # A context lm-eval already chat-formatted (--apply_chat_template) starts with BOS: keep it as is.
    return tokenizer.encode(context, chat=chat and not context.startswith(BOS_TOKEN), what=what)


def fit(request, room: int, tokenizer: Tokenizer, chat: bool, truncate_fewshot: bool, delimiter: str,
        what: str = "the context") -> Prompt:
    """The prompt of one request; with truncate_fewshot, whole few-shot examples are dropped from the
    front until it fits (the chat template is applied afterwards, so its tokens always stay)."""
    context = request.args[0]
    ids = encode(tokenizer, context, chat, what)
    if len(ids) <= room or not truncate_fewshot or context.startswith(BOS_TOKEN):
        return Prompt(ids, 0)  # (a context lm-eval chat-formatted has no few-shot text to cut safely)
    spans = fewshot_spans(context, getattr(request, "doc", None) or {}, delimiter)
    if spans is None:
        return Prompt(ids, 0)
    starts, question = spans
    cuts = starts[1:] + [question]
    for dropped, cut in enumerate(cuts, 1):
        ids = encode(tokenizer, context[:starts[0]] + context[cut:], chat, what)
        if len(ids) <= room:
            break
    return Prompt(ids, dropped)


def fit_all(requests, tokenizer: Tokenizer, chat: bool, truncate_fewshot: bool, delimiter: str,
            max_sequence_length: int, gen_length: int) -> list[Prompt]:
    """Every request's prompt, fitted beside the canvas or refused (all at once, before any work)."""
    room = max_sequence_length - gen_length
    for i, r in enumerate(requests):  # a context that is not text: one line naming it, before any work
        check_prompt(r.args[0], f"request {i}'s context")
    prompts = [fit(r, room, tokenizer, chat, truncate_fewshot, delimiter, f"request {i}'s context")
               for i, r in enumerate(requests)]
    over = [len(p.ids) - room for p in prompts if len(p.ids) > room]
    if over:
        bare = []  # the over-long prompts that no truncation of few-shot examples makes fit
        for i, (r, p) in enumerate(zip(requests, prompts)):
            if len(p.ids) > room:
                alone = p if truncate_fewshot else fit(r, 0, tokenizer, chat, True, delimiter)  # room 0: drop all
                if len(alone.ids) > room:
                    doc_id = getattr(r, "doc_id", None)
                    bare.append((i if doc_id is None else doc_id, len(alone.ids)))
        raise PromptTooLongError(len(over), len(prompts), max(over), room, max_sequence_length, gen_length,
                                 truncate_fewshot, tuple(sorted(bare)))
    return prompts
