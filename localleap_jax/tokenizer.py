"""The tokenizer of a checkpoint: chat template, left padding, and decoding up to EOS/EOT.

Wraps the Hugging Face fast tokenizer stored beside the weights (tokenizer.json +
tokenizer_config.json, which holds the chat template). No remote code is ever run.
`make_tokenizer` builds a small byte-level BPE tokenizer with LLaDA's (or Dream's ChatML) special
tokens and chat format, for the embedded model and for tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from localleap_jax.errors import PromptTypeError, TokenizerError, first_line

MASK_TOKEN = "<|mdm_mask|>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftext|>"
EOT_TOKEN = "<|eot_id|>"
HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>")
# ChatML (Dream, Qwen2): a turn is <|im_start|>role\n...<|im_end|>; EOS = pad = <|endoftext|>.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The token that ends an assistant turn, by family: whichever of these the vocabulary holds.
END_OF_TURN_TOKENS = (EOT_TOKEN, IM_END)

# LLaDA-8B-Instruct's chat template (Llama-3 style headers, BOS first, EOT after each turn).
LLADA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# A ChatML template of the Qwen2 form, for the small Dream-style test tokenizer only: a real Dream
# checkpoint brings its own template in tokenizer_config.json.
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


class Tokenizer:
    """Chat formatting, left-padded batches and generated-text decoding for one model."""

    def __init__(self, hf_tokenizer, *, mask_id: int, eos_id: int, pad_id: int | None = None,
                 end_ids: Sequence[int] = (), masked: bool = True):
        self.hf = hf_tokenizer
        # True: the model reads mask_id as a position to generate, so a prompt must not hold it (encode refuses it);
        # False: a uniform-noise canvas model, which never reads its mask id as one.
        self.masked = bool(masked)
        self.end_ids = tuple(int(t) for t in end_ids)  # more ids that end a row (a model listing several EOS ids)
        self.mask_id = int(mask_id)
        self.eos_id = int(eos_id)
        self.pad_id = int(eos_id if pad_id is None else pad_id)
        vocab = hf_tokenizer.get_vocab()
        eot = next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), None)
        self.eot_id = None if eot is None else int(eot)  # end of turn: LLaDA <|eot_id|>, Dream <|im_end|>
        if self.pad_id == self.mask_id:
            raise TokenizerError(f"pad id {self.pad_id} equals the mask id: padding would be read as "
                                 "positions to generate")
        for name, value in (("mask", self.mask_id), ("eos", self.eos_id), ("pad", self.pad_id)):
            if not 0 <= value < self.vocab_size:
                raise TokenizerError(f"{name} id {value} is not a token of the tokenizer (it has {self.vocab_size} ids)")

    @classmethod
    def from_dir(cls, path: str | Path, *, mask_id: int, eos_id: int, pad_id: int | None = None,
                 end_ids: Sequence[int] = (), masked: bool = True) -> "Tokenizer":
        from transformers import PreTrainedTokenizerFast

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(path))
        except Exception as e:  # a damaged tokenizer.json / tokenizer_config.json: one line naming it
            raise TokenizerError(f"the tokenizer in {path} cannot be read ({type(e).__name__}: {first_line(e)})") from None
        return cls(hf, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id, end_ids=end_ids, masked=masked)

    @property
    def vocab_size(self) -> int:
        """How many ids this tokenizer can decode (0 .. vocab_size-1). The model's embedding may have
        more rows (Dream: 152064 rows, 151667 ids): ids past this must never be generated."""
        return len(self.hf)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids a generated text ends at: EOS, the end of turn, and every other id that ends a row of the model
        (`end_ids`: config.json's eos_token_id list, DiffusionGemma's)."""
        ids = (self.eos_id,) if self.eot_id is None else (self.eos_id, self.eot_id)
        return ids + tuple(t for t in self.end_ids if t not in ids)

    def chat(self, prompt: str) -> str:
        """The prompt as one user turn followed by the assistant header."""
        if not self.hf.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass chat=False")
        return self.hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)

    def encode(self, prompt: str, chat: bool = True, *, what: str = "the prompt") -> list[int]:
        """The ids of one prompt (as one user turn of the chat template with `chat`); a prompt that is not text, or
        whose text holds the mask token (a masked model would read it as a position to generate), is refused in one
        line naming it (`what`)."""
        check_prompt(prompt, what)
        text = self.chat(prompt) if chat else prompt
        # The chat template already holds BOS; never let the tokenizer add its own specials.
        ids = self.hf(text, add_special_tokens=False)["input_ids"]
        if self.masked and self.mask_id in ids:
            token = self.hf.convert_ids_to_tokens(self.mask_id)
            raise TokenizerError(f"{what} holds the mask token {token!r} (id {self.mask_id}), which the model reads as "
                                 "a position to generate: remove it from the text (or spell it differently)")
        return ids

    def encode_batch(self, prompts: Sequence[str], chat: bool = True, pad_to_multiple_of: int = 1
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded ids [B, Lp] int32 and a mask [B, Lp] bool that is True on real tokens."""
        if isinstance(prompts, (str, bytes, bytearray)) or prompts is None or not hasattr(prompts, "__iter__"):
            hint = f" (one prompt: [{prompts!r:.30}])" if isinstance(prompts, str) else ""
            raise PromptTypeError(f"encode_batch takes a list of prompts (str), not {_what(prompts)}{hint}")
        prompts = list(prompts)
        if not prompts:
            raise TokenizerError("encode_batch got no prompts: pass a list of one or more prompts (str)")
        for i, p in enumerate(prompts):
            check_prompt(p, f"prompt {i}")
        encoded = [self.encode(p, chat, what=f"prompt {i}") for i, p in enumerate(prompts)]
        if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, (int, np.integer)) \
                or pad_to_multiple_of < 1:
            raise TokenizerError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive whole number")
        return left_pad(encoded, self.pad_id, pad_to_multiple_of)

    def decode_generated(self, out, prompt_length: int | None = None) -> list[str]:
        """Text of each row's generated part, cut at the first EOS/EOT.

        `out` is a `Generation` (ll.generate's output: its `tokens` and `prompt_length`), or token ids [B, L] with
        `prompt_length`, how many of each row's ids are the prompt (0: every id is generated). An array alone is
        refused: it may hold the prompt (out.tokens does), whose text would be returned as the answer.
        """
        if hasattr(out, "tokens") and hasattr(out, "prompt_length"):
            if prompt_length is not None and prompt_length != out.prompt_length:
                raise TokenizerError(f"decode_generated: prompt_length={prompt_length!r} beside a Generation, whose "
                                     f"prompt_length is {out.prompt_length}: pass the Generation alone")
            ids, prompt_length = out.tokens, out.prompt_length
        elif prompt_length is None:
            raise TokenizerError(f"decode_generated takes ll.generate's output (a Generation), or token ids with "
                                 f"prompt_length=N (0: all generated); got {_what(out)} alone, which may hold the "
                                 "prompt (out.tokens does)")
        else:
            ids = out
        try:
            gen = np.asarray(ids)
        except (ValueError, TypeError):
            gen = None
        if gen is None or gen.ndim != 2 or gen.size and not np.issubdtype(gen.dtype, np.integer):
            raise TokenizerError(f"decode_generated takes token ids [batch, length] (integers), got {_what(ids)}")
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, (int, np.integer)) \
                or not 0 <= prompt_length <= gen.shape[1]:
            raise TokenizerError(f"prompt_length={prompt_length!r} must be a whole number in [0, {gen.shape[1]}] "
                                 "(the row length)")
        return [self.hf.decode(cut_at_stop(row, self.stop_ids), skip_special_tokens=True)
                for row in gen[:, prompt_length:]]

    def save(self, path: str | Path) -> None:
        self.hf.save_pretrained(str(path))


def _what(value) -> str:
    if value is None:
        return "None"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} {value.dtype}{list(value.shape)}"
    return f"{type(value).__name__} {value!r:.40}"


def check_prompt(prompt, what: str) -> None:
    """A prompt is text: None, bytes, token ids or anything else is refused in one line naming what was given."""
    if isinstance(prompt, str):
        return
    hint = (" (decode it first: .decode('utf-8'))" if isinstance(prompt, (bytes, bytearray))
            else " (token ids go to ll.generate directly, left-padded with their mask)"
            if isinstance(prompt, (list, tuple)) or hasattr(prompt, "dtype") else "")
    raise PromptTypeError(f"{what} is {_what(prompt)}; a prompt must be a str{hint}")


def cut_at_stop(ids: Iterable[int], stop_ids: Sequence[int]) -> list[int]:
    out = []
    for t in ids:
        if int(t) in stop_ids:
            break
        out.append(int(t))
    return out


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, pad_to_multiple_of: int = 1) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        raise ValueError("no prompts given")
    width = max(len(r) for r in rows)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = r
            mask[i, width - len(r):] = True
    return ids, mask


def make_tokenizer(texts: Iterable[str], vocab_size: int = 512, *, chat: str = "llada", mask_token: str = MASK_TOKEN):
    """Train a byte-level BPE tokenizer with a family's special tokens and chat template (a family's own choice:
    `localleap_jax.families.make_tokenizer(family, texts, vocab_size)`).

    chat="llada": specials first (ids 0..5), LLaDA's chat template. chat="chatml": the BPE ids first and the
    ChatML specials after them (<|endoftext|>, <|im_start|>, <|im_end|>, the mask token), as in Qwen2's
    vocabulary, with a ChatML template. Digits are split one per token so arithmetic is learnable by a small
    model. Returns a transformers PreTrainedTokenizerFast (save it with `save_pretrained`).
    """
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if chat not in ("llada", "chatml"):
        raise ValueError(f"chat must be 'llada' or 'chatml', got {chat!r}")
    if chat == "chatml":
        return _make_chatml_tokenizer(texts, vocab_size, mask_token)
    specials = [EOS_TOKEN, BOS_TOKEN, mask_token, EOT_TOKEN, *HEADER_TOKENS]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                  pad_token=EOS_TOKEN, mask_token=mask_token,
                                  additional_special_tokens=[EOT_TOKEN, *HEADER_TOKENS])
    tok.chat_template = LLADA_CHAT_TEMPLATE
    return tok


def _make_chatml_tokenizer(texts: Iterable[str], vocab_size: int, mask_token: str):
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS_TOKEN, IM_START, IM_END, mask_token]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(texts, trainer=trainer)
    raw.add_special_tokens(specials)  # ids right after the BPE ones, in Qwen2's order
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                  mask_token=mask_token, additional_special_tokens=[IM_START, IM_END])
    tok.chat_template = CHATML_CHAT_TEMPLATE
    return tok


def save_qwen2_fast_tokenizer(src: str | Path, dst: str | Path) -> None:
    """Build a fast tokenizer (tokenizer.json) from Qwen2-style "slow" files and save it in `dst`.

    Dream's checkpoints ship vocab.json + merges.txt + tokenizer_config.json (added tokens, chat
    template) and a remote-code tokenizer class that is Qwen2's. transformers' own Qwen2 tokenizer
    reads the same files, so no remote code runs.
    """
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast.from_pretrained(str(src))
    tok.save_pretrained(str(dst))
    # The source's auto_map points at remote code that the converted checkpoint does not carry.
    config_path = Path(dst) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("auto_map", None)
    config_path.write_text(json.dumps(config, indent=2))


def added_token_id(tokenizer_json: Path, content: str) -> int | None:
    """The id of an added token (e.g. a mask token config.json does not name) in a tokenizer.json, or None."""
    try:
        added = json.loads(Path(tokenizer_json).read_text()).get("added_tokens", [])
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return next((t.get("id") for t in added if isinstance(t, dict) and t.get("content") == content), None)
