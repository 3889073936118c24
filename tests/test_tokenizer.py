"""Tokenizer wrapper: chat template, left padding, pad/mask guard, decoding up to EOS/EOT."""

import numpy as np
import pytest

import localleap_jax as ll
from localleap_jax.tokenizer import Tokenizer, TokenizerError


def test_chat_template_is_llada_format(converted):
    tok = ll.load(converted, dtype="float32").tokenizer
    assert tok.chat("What is 2 + 3?") == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n"
                                          "What is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_encode_batch_left_pads_with_a_mask(converted):
    tok = ll.load(converted, dtype="float32").tokenizer
    prompts = ["hi", "a much longer prompt than the first"]
    ids, mask = tok.encode_batch(prompts)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    for row, m, p in zip(ids, mask, prompts):
        real = tok.encode(p)
        assert row[m].tolist() == real
        assert (row[~m] == tok.pad_id).all() and not m[: len(m) - len(real)].any()  # padding on the left
    ids8, mask8 = tok.encode_batch(prompts, pad_to_multiple_of=8)
    extra = -ids.shape[1] % 8
    assert extra > 0  # the case: the longest prompt is not already a multiple of 8
    assert ids8.shape[1] == ids.shape[1] + extra
    np.testing.assert_array_equal(ids8[:, extra:], ids)  # the added columns are padding, on the left
    assert (ids8[:, :extra] == tok.pad_id).all() and not mask8[:, :extra].any()
    with pytest.raises(TypeError):
        tok.encode_batch("one string")


@pytest.mark.parametrize("prompts, message", [
    (["hi", None], r"^prompt 1 is None; a prompt must be a str$"),
    ([b"hi"], r"^prompt 0 is bytes b'hi'; a prompt must be a str \(decode it first: \.decode\('utf-8'\)\)$"),
    ([[5, 6]], r"^prompt 0 is list \[5, 6\]; a prompt must be a str \(token ids go to ll.generate directly"),
    (None, r"^encode_batch takes a list of prompts \(str\), not None$"),
    (b"hi", r"^encode_batch takes a list of prompts \(str\), not bytes"),
])
def test_prompts_that_are_not_text_are_named(converted, prompts, message):
    """None, bytes or ids once encoded as "None" / "b'hi'" / "[5, 6]" text, silently (issue #22)."""
    tok = ll.load(converted, dtype="float32").tokenizer
    with pytest.raises(TypeError, match=message):
        tok.encode_batch(prompts)


@pytest.mark.parametrize("prompts, message", [
    ("one string", r"^encode_batch takes a list of prompts \(str\), not str 'one string' \(one prompt: \['one string'\]\)$"),
    ([], r"^encode_batch got no prompts: pass a list of one or more prompts \(str\)$"),
    ([None], r"^prompt 0 is None; a prompt must be a str$"),
])
def test_what_is_not_a_list_of_prompts_is_one_library_error(converted, prompts, message):
    """Issue #47: these were a bare TypeError / ValueError; each is an ll.LocalLeapError now (a TypeError still where
    it was one), saying what to pass."""
    tok = ll.load(converted, dtype="float32").tokenizer
    with pytest.raises(ll.LocalLeapError, match=message):
        tok.encode_batch(prompts)


def test_a_prompt_holding_the_mask_token_is_refused(converted):
    """The mask token's text in a prompt encodes to the mask id, which the model reads as a position to generate
    (issue #47: ll.generate decoded such a prompt into garbage). Refused in one line naming the prompt."""
    tok = ll.load(converted, dtype="float32").tokenizer
    text = "What is 2 + <|mdm_mask|>?"
    assert tok.mask_id in tok.hf(text, add_special_tokens=False)["input_ids"]  # the case: the text is the mask id
    with pytest.raises(TokenizerError, match=r"^prompt 1 holds the mask token '<\|mdm_mask\|>' \(id 2\), which the "
                                             r"model reads as a position to generate"):
        tok.encode_batch(["What is 2 + 2?", text])
    with pytest.raises(TokenizerError, match=r"^the prompt holds the mask token"):
        tok.encode(text, chat=False)
    assert tok.encode_batch(["What is 2 + mdm_mask?"])[0].size  # the words alone are text


def test_a_canvas_models_prompt_may_hold_its_unused_mask_token():
    """A uniform-noise canvas model (DiffusionGemma) has no mask position: its tokenizer, as ll.load builds it, takes
    a prompt holding the mask token's text (Gemma's reserved <mask>), which a masked model's refuses."""
    from localleap_jax.checkpoint import EMBEDDED_MODELS
    from localleap_jax.checkpoint.reading import _tokenizer_of
    from localleap_jax.families import read_config_file

    path = EMBEDDED_MODELS["embedded-dg"]
    config = read_config_file(path / "config.json")
    tok = _tokenizer_of(path, config)
    text = f"a {tok.hf.convert_ids_to_tokens(config.mask_token_id)} b"
    assert config.mask_token_id in tok.encode(text, chat=False)  # the case: the text is the mask id, and it passes
    assert not tok.masked


def test_decode_generated_takes_a_generation_or_ids_with_their_prompt_length(converted):
    """Issue #47: decode_generated(out.tokens) returned the prompt's text (an array was taken as generated ids only).
    An array now needs prompt_length; a Generation carries its own."""
    tok = ll.load(converted, dtype="float32").tokenizer
    prompt = tok.hf("Question: 7 apples?", add_special_tokens=False)["input_ids"]
    answer = tok.hf(" 7 apples", add_special_tokens=False)["input_ids"]
    tokens = np.array([prompt + answer + [tok.eos_id]])
    out = ll.Generation(tokens=tokens, nfe=np.ones(1), forward_passes=1, full_passes=1, prompt_length=len(prompt),
                        seconds=0.0, compile_seconds=0.0)
    assert tok.decode_generated(out) == tok.decode_generated(tokens, prompt_length=len(prompt)) == [" 7 apples"]
    with pytest.raises(TokenizerError, match=r"^decode_generated takes ll.generate's output \(a Generation\), or token "
                                             r"ids with prompt_length=N \(0: all generated\); got ndarray int64\[1, \d+\] "
                                             r"alone, which may hold the prompt \(out.tokens does\)$"):
        tok.decode_generated(tokens)
    for bad, message in ((dict(prompt_length=99), r"^prompt_length=99 must be a whole number in \[0, \d+\]"),
                         (dict(prompt_length=1.5), r"^prompt_length=1.5 must be a whole number")):
        with pytest.raises(TokenizerError, match=message):
            tok.decode_generated(tokens, **bad)
    with pytest.raises(TokenizerError, match=r"^decode_generated: prompt_length=0 beside a Generation"):
        tok.decode_generated(out, prompt_length=0)


def test_pad_equal_to_mask_is_refused(tiny_tokenizer):
    with pytest.raises(TokenizerError, match="pad id .* equals the mask id"):
        Tokenizer(tiny_tokenizer, mask_id=tiny_tokenizer.mask_token_id, eos_id=tiny_tokenizer.eos_token_id,
                  pad_id=tiny_tokenizer.mask_token_id)


def test_decode_generated_stops_at_eos_or_eot(converted):
    tok = ll.load(converted, dtype="float32").tokenizer
    text = tok.hf("7 apples", add_special_tokens=False)["input_ids"]
    gen = np.array([text + [tok.eot_id, *text], text + [tok.eos_id, *text], text + text + [text[0]]])
    out = tok.decode_generated(gen, prompt_length=0)
    assert out[0] == "7 apples" and out[1] == "7 apples" and out[2] == "7 apples7 apples7"
