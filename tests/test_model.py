"""The Flax model against transformers' Llama run bidirectionally on the same LLaDA weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import localleap_jax as ll
from localleap_jax import reference_torch
from localleap_jax.model import forward, head, trunk, positions_from_mask


def _torch_logits(hf_checkpoint, ids, mask=None):
    _, cfg, tensors = hf_checkpoint
    ref = reference_torch.llama_from_llada(cfg, tensors)
    m = None if mask is None else torch.tensor(mask)
    return reference_torch.bidirectional_logits(ref, torch.tensor(ids), m).numpy()


def _ids(cfg, shape, seed=0):
    return np.random.RandomState(seed).randint(0, cfg["vocab_size"], shape).astype(np.int32)


def test_fp32_logits_match_transformers_llama(hf_checkpoint, converted):
    model = ll.load(converted, dtype="float32")
    ids = _ids(hf_checkpoint[1], (2, 37))
    ours = np.asarray(forward(model.params, ids, None, model.config))
    ref = _torch_logits(hf_checkpoint, ids)
    err = np.abs(ours - ref).max()
    print(f"fp32 max |diff| = {err:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert err <= 1e-4
    assert ours.shape == (2, 37, hf_checkpoint[1]["embedding_size"])


def test_bf16_logits_close_to_fp32_reference(hf_checkpoint, converted):
    model = ll.load(converted)  # bf16 by default
    assert model.dtype == jnp.bfloat16
    ids = _ids(hf_checkpoint[1], (4, 33), seed=1)
    ours = np.asarray(forward(model.params, ids, None, model.config))
    ref = _torch_logits(hf_checkpoint, ids)
    agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"bf16: max relative diff {rel:.3f}, argmax agreement {agree:.3f}")
    assert ours.dtype == np.float32  # logits leave the model in fp32
    assert rel < 0.1 and agree > 0.9


def test_left_padded_rows_equal_unpadded_rows(converted):
    model = ll.load(converted, dtype="float32")
    lengths = [9, 4, 13]
    rng = np.random.RandomState(2)
    rows = [rng.randint(0, model.config.vocab_size, n) for n in lengths]
    width = max(lengths)
    ids = np.full((3, width), model.config.pad_token_id, np.int32)
    mask = np.zeros((3, width), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, True
    batch = np.asarray(forward(model.params, ids, mask, model.config))
    for i, r in enumerate(rows):
        alone = np.asarray(forward(model.params, r[None].astype(np.int32), None, model.config))[0]
        np.testing.assert_allclose(batch[i, width - len(r):], alone, atol=1e-5, rtol=0)


def test_padding_matches_reference_with_key_mask(hf_checkpoint, converted):
    model = ll.load(converted, dtype="float32")
    ids = _ids(hf_checkpoint[1], (2, 20), seed=3)
    mask = np.ones_like(ids, bool)
    mask[0, :7] = False
    ours = np.asarray(forward(model.params, ids, mask, model.config))
    ref = _torch_logits(hf_checkpoint, ids, mask)
    assert np.abs(ours - ref)[mask].max() <= 1e-4


def test_head_on_gathered_positions_equals_full_logits(converted):
    model = ll.load(converted, dtype="float32")
    ids = _ids({"vocab_size": model.config.vocab_size}, (2, 16), seed=4)
    mask = np.ones_like(ids, bool)
    h, _ = trunk(model.params, ids, positions_from_mask(mask), mask, model.config)
    some = np.asarray(head(model.params, h[:, 5:9], model.config))
    full = np.asarray(forward(model.params, ids, mask, model.config))
    np.testing.assert_allclose(some, full[:, 5:9], atol=1e-5, rtol=0)


def test_grouped_query_attention_matches_reference(tmp_path, tiny_tokenizer):
    from conftest import random_llada_tensors, tiny_hf_config, write_hf_checkpoint
    from convert.llada import convert

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_kv_heads=2, n_layers=2)
    tensors = random_llada_tensors(cfg, seed=5)
    src = write_hf_checkpoint(tmp_path / "gqa", cfg, tensors, tok, n_shards=1, index=False)
    convert(str(src), str(tmp_path / "out"), progress=False)
    model = ll.load(tmp_path / "out", dtype="float32")
    ids = _ids(cfg, (1, 21), seed=6)
    ours = np.asarray(forward(model.params, ids, None, model.config))
    ref = _torch_logits((src, cfg, tensors), ids)
    assert np.abs(ours - ref).max() <= 1e-4


def test_layers_are_scanned_so_the_program_does_not_grow_with_depth(converted):
    model = ll.load(converted, dtype="float32")
    ids = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: forward(p, ids, None, model.config))(model.params)
    text = str(jaxpr)
    assert "scan" in text
    # one copy of the block: a single q projection dot per layer body, not n_layers of them
    assert text.count("dot_general") < 12


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_forward_equals_full_forward_right_after_a_refresh(converted, mode):
    """With the cache just filled from this canvas, a window's hidden states are the full forward's."""
    from localleap_jax.model import CacheWrite, trunk_cached

    model = ll.load(converted, dtype="float32")
    P, G, T = 6, 24, 8
    rng = np.random.RandomState(7)
    ids = rng.randint(0, model.config.vocab_size, (3, P + G)).astype(np.int32)
    ids[:, P + 10:] = model.config.mask_token_id  # a canvas mid-generation
    mask = np.ones_like(ids, bool)
    mask[1, :2] = False  # one left-padded row
    pos = positions_from_mask(mask)
    full, cache = trunk(model.params, ids, pos, mask, model.config)
    starts = np.array([P, P + 8, P + 16])  # each row in a different block
    if mode == "dual":
        idx = starts[:, None] + np.arange(T)
        write = CacheWrite(jnp.asarray(starts), jnp.ones((3, T), bool))
    else:
        idx = np.broadcast_to(P + np.arange(G), (3, G))
        write = CacheWrite(jnp.full((3,), P), jnp.asarray(idx >= starts[:, None]))
    take = lambda a: np.take_along_axis(np.asarray(a), idx.reshape(idx.shape + (1,) * (np.ndim(a) - 2)), 1)  # noqa: E731
    h = trunk_cached(model.params, take(ids), take(pos), mask, cache, write, model.config)
    err = np.abs(np.asarray(h) - take(full))
    if mode == "prefix":  # only positions from the block on are the model's output; earlier ones are discarded
        err = err[idx >= starts[:, None]]
    assert err.max() <= 1e-5
