"""The ids each released checkpoint stops, masks and pads with, as this package reads them from the release's files.

tests/data/released-configs.json (a copy of ../shared/reference/configs/released-configs.json): nine released
config.json files of the checkpoints the README claims, each with its tokenizer's special tokens (by file where the
files disagree) and the ids the release uses (`ids`: mask, eos, pad, and `stop`, what generation ends at). For each
claimed checkpoint, a source directory is laid out as the release lays it out, with the tokenizer files reduced to
their special tokens (no weights, no vocabulary), and read as the converter reads it (`convert_hf.read_source_config`:
the family, its config completed from the tokenizer files, the ModelConfig); the checkpoint's tokenizer is built as
`ll.load` builds it (`checkpoint.reading`), over a stand-in holding the special tokens. A release whose tokenizer
ships as slow files too is also read from the slow files alone (a copy without tokenizer.json: SDAR's spell the mask
`<MASK>` there, `<|MASK|>` in tokenizer_config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RELEASED = json.loads((Path(__file__).parent / "data" / "released-configs.json").read_text())["checkpoints"]
CLAIMED = [c for c in RELEASED if c["claimed"]]


class SpecialTokensOnly:
    """A tokenizer stand-in: the release's special tokens at their ids, in a vocabulary of `size` ids."""

    chat_template = None

    def __init__(self, tokens: dict[str, int], size: int):
        self.tokens, self.size = dict(tokens), size

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tokens)

    def __len__(self) -> int:
        return self.size


def lay_out(entry: dict, src: Path, *, slow_only: bool = False) -> Path:
    """The release's config.json and its tokenizer files (special tokens only): tokenizer.json's added tokens,
    tokenizer_config.json's added_tokens_decoder and roles, added_tokens.json and special_tokens_map.json where the
    release has them (with their own spellings), generation_config.json where config.json carries one."""
    tok = entry["tokenizer"]
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(entry["config"]))
    added, roles = tok["added_tokens"], {f"{k}_token": v for k, v in tok["roles"].items()}
    if not slow_only and tok["fast_file"] == "present":
        (src / "tokenizer.json").write_text(json.dumps(
            {"added_tokens": [{"id": i, "content": t, "special": True} for t, i in added.items()]}))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in added.items()}, **roles}))
    if "added_tokens.json" in tok["files"]:
        (src / "added_tokens.json").write_text(json.dumps(tok.get("added_tokens_json", added)))
    if "special_tokens_map.json" in tok["files"]:
        respelled = {i: t for t, i in tok.get("added_tokens_json", added).items()}  # the slow files' spelling
        (src / "special_tokens_map.json").write_text(json.dumps(
            {role: respelled.get(added.get(t), t) for role, t in roles.items()}))
    if isinstance(entry["config"].get("generation_config"), dict):
        (src / "generation_config.json").write_text(json.dumps(entry["config"]["generation_config"]))
    return src


def layouts(entry: dict) -> list[bool]:
    """slow_only values to read a release with: its files as released, and its slow files alone when it has them."""
    return [False] + ([True] if "vocab.json" in entry["tokenizer"]["files"] else [])


def test_the_data_covers_every_family_the_readme_claims():
    from localleap_jax.families import FAMILIES

    assert len(CLAIMED) == 9 and {c["family"] for c in CLAIMED} == set(FAMILIES) - {"llada_moe"}
    assert {c["family"] for c in RELEASED if not c["claimed"]} <= set(FAMILIES)


@pytest.mark.parametrize("entry", CLAIMED, ids=[c["id"].split(" ")[0] for c in CLAIMED])
def test_each_release_reads_as_the_ids_it_uses(tmp_path, monkeypatch, entry):
    """Mask, EOS and pad as the release uses them; the ids a loaded checkpoint's text ends at hold the release's stop
    ids (and besides them only the tokenizer's end of turn); a canvas model's rows end at exactly the stop ids."""
    import transformers

    from localleap_jax.checkpoint.reading import _tokenizer_of
    from localleap_jax.convert_hf import read_source_config

    ids = entry["ids"]
    for slow_only in layouts(entry):
        src = lay_out(entry, tmp_path / f"slow-{slow_only}", slow_only=slow_only)
        _, config = read_source_config(src)
        where = f"{entry['id']} ({'slow files alone' if slow_only else 'as released'})"
        assert config.family == entry["family"], where
        for name in ("mask", "eos", "pad"):
            if name in ids:
                assert getattr(config, f"{name}_token_id") == ids[name]["value"], f"{where}: {name}"
        stand_in = SpecialTokensOnly(entry["tokenizer"]["added_tokens"], config.vocab_size)
        monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", lambda *a, **k: stand_in)
        (src / "tokenizer.json").touch()  # a converted checkpoint always has one (its content is the stand-in's)
        tokenizer = _tokenizer_of(src, config)  # what ll.load builds
        stop = set(ids["stop"]["value"])
        assert stop <= set(tokenizer.stop_ids) <= stop | {tokenizer.eot_id}, f"{where}: {tokenizer.stop_ids}"
        assert (tokenizer.mask_id, tokenizer.pad_id) == (config.mask_token_id, config.pad_token_id)
        if config.canvas_length:  # DiffusionGemma: the loop ends a row at any of these (decode/stop.py EndAtEos)
            assert set(config.end_ids) == stop and config.end_ids[0] == ids["eos"]["value"], where
