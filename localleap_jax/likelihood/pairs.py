"""Text to (context ids, continuation ids) as each family's authors split a likelihood request.

Plain tokenization, no chat template. Trailing whitespace of the context moves to the continuation; the
continuation's ids are those of the whole string after the context's own ids (a token merging across the
boundary is in neither half, as in lm-eval's and the authors' `_encode_pair`). Dream appends EOS to the whole
string (its estimator never masks that last token, it only conditions on it).
"""

from __future__ import annotations

from localleap_jax.errors import LikelihoodError, PromptTypeError
from localleap_jax.families import FAMILIES, family_of


def encode_pair(model_or_tokenizer, context: str, continuation: str, family: str | None = None,
                add_bos_token: bool = False) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the family's authors split them (`Family.pairs_end_with_eos`): LLaDA's
    `_encode_pair` (the tokenizer's own special tokens, e.g. its BOS), or Dream's (EOS appended to the whole;
    `add_bos_token` prepends the BOS text, Dream's option). Given an `ll.Model` the family is its own; given a
    tokenizer, `family` (a family's name, default "llada")."""
    config = getattr(model_or_tokenizer, "config", None)
    tokenizer = model_or_tokenizer.tokenizer if config is not None else model_or_tokenizer
    family = family or (config.family if config is not None else "llada")
    if family not in FAMILIES:
        raise LikelihoodError(f"encode_pair: family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if not hasattr(tokenizer, "hf") and not callable(getattr(tokenizer, "encode", None)):
        raise LikelihoodError(f"encode_pair takes an ll.Model or its tokenizer (model.tokenizer), got "
                              f"{type(model_or_tokenizer).__name__}")
    dream = family_of(family).pairs_end_with_eos
    hf = getattr(tokenizer, "hf", tokenizer)
    if not isinstance(context, str) or not isinstance(continuation, str):
        raise PromptTypeError(f"encode_pair takes two strings, got {type(context).__name__} and "
                              f"{type(continuation).__name__}")
    if dream and add_bos_token and hf.bos_token:
        context = hf.bos_token + context
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if dream:
        whole = hf.encode(context + continuation) + [hf.eos_token_id]
        context_ids = hf.encode(context)
    else:
        whole = hf(context + continuation)["input_ids"]
        context_ids = hf(context)["input_ids"]
    return list(context_ids), list(whole[len(context_ids):])
