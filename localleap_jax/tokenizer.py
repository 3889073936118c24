"""The tokenizer of a checkpoint: chat template, left padding, and decoding up to EOS/EOT.

Wraps the Hugging Face fast tokenizer stored beside the weights (tokenizer.json +
tokenizer_config.json, which holds the chat template). No remote code is ever run.
`make_tokenizer` builds a small byte-level BPE tokenizer with LLaDA's special tokens and chat
format, for the embedded model and for tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

MASK_TOKEN = "<|mdm_mask|>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftext|>"
EOT_TOKEN = "<|eot_id|>"
HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>")

# LLaDA-8B-Instruct's chat template (Llama-3 style headers, BOS first, EOT after each turn).
LLADA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used with its model."""


class Tokenizer:
    """Chat formatting, left-padded batches and generated-text decoding for one model."""

    def __init__(self, hf_tokenizer, *, mask_id: int, eos_id: int, pad_id: int | None = None):
        self.hf = hf_tokenizer
        self.mask_id = int(mask_id)
        self.eos_id = int(eos_id)
        self.pad_id = int(eos_id if pad_id is None else pad_id)
        eot = hf_tokenizer.convert_tokens_to_ids(EOT_TOKEN) if EOT_TOKEN in hf_tokenizer.get_vocab() else None
        self.eot_id = None if eot is None else int(eot)
        if self.pad_id == self.mask_id:
            raise TokenizerError(f"pad id {self.pad_id} equals the mask id: padding would be read as "
                                 "positions to generate")

    @classmethod
    def from_dir(cls, path: str | Path, *, mask_id: int, eos_id: int, pad_id: int | None = None) -> "Tokenizer":
        from transformers import PreTrainedTokenizerFast

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
        hf = PreTrainedTokenizerFast.from_pretrained(str(path))
        return cls(hf, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,) if self.eot_id is None else (self.eos_id, self.eot_id)

    def chat(self, prompt: str) -> str:
        """The prompt as one user turn followed by the assistant header."""
        if not self.hf.chat_template:
            raise TokenizerError("this tokenizer has no chat template; pass chat=False")
        return self.hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        text = self.chat(prompt) if chat else prompt
        # The chat template already holds BOS; never let the tokenizer add its own specials.
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, prompts: Sequence[str], chat: bool = True, pad_to_multiple_of: int = 1
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded ids [B, Lp] int32 and a mask [B, Lp] bool that is True on real tokens."""
        if isinstance(prompts, str):
            raise TypeError("encode_batch takes a list of prompts, not one string")
        encoded = [self.encode(p, chat) for p in prompts]
        return left_pad(encoded, self.pad_id, pad_to_multiple_of)

    def decode_generated(self, out) -> list[str]:
        """Text of each row's generated part, cut at the first EOS/EOT.

        `out` is a `Generation` (its `tokens` and `prompt_length`) or a [B, G] array of generated ids.
        """
        gen = np.asarray(out.tokens)[:, out.prompt_length:] if hasattr(out, "tokens") else np.asarray(out)
        return [self.hf.decode(cut_at_stop(row, self.stop_ids), skip_special_tokens=True) for row in gen]

    def save(self, path: str | Path) -> None:
        self.hf.save_pretrained(str(path))


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


def make_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE tokenizer with LLaDA's special tokens and chat template.

    Digits are split one per token so arithmetic is learnable by a small model.
    Returns a transformers PreTrainedTokenizerFast (save it with `save_pretrained`).
    """
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS_TOKEN, BOS_TOKEN, MASK_TOKEN, EOT_TOKEN, *HEADER_TOKENS]
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
                                  pad_token=EOS_TOKEN, mask_token=MASK_TOKEN,
                                  additional_special_tokens=[EOT_TOKEN, *HEADER_TOKENS])
    tok.chat_template = LLADA_CHAT_TEMPLATE
    return tok
