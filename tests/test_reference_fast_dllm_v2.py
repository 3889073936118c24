"""The Fast-dLLM v2 oracle (oracles/fast_dllm_v2.py) checked on its own: the forward against transformers' Qwen2
run causally (block 1) and bidirectionally (one block) through independent code paths, the block-causal mask,
left padding, the sub-block cache (exact on one layer only), and batch_sample on a stub network whose passes,
commits, free tokens and NFE are worked out in the comments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracles import fast_dllm_v2 as F2
from oracles import rules as reference_rules
from oracles.sdar import eager_rule

V, MASK, STOP = 50, 49, 48


def tiny_config(layers: int = 2, **over) -> dict:
    cfg = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "vocab_size": V,
           "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "use_sliding_window": False, "rope_scaling": None, "bd_size": 4}
    cfg.update(over)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, F, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, d, s=1.0), "model.norm.weight": 1 + w(d, s=0.1), "lm_head.weight": w(V, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.q_proj.bias": w(q),
                p + "self_attn.k_proj.weight": w(kv, d), p + "self_attn.k_proj.bias": w(kv),
                p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.v_proj.bias": w(kv),
                p + "self_attn.o_proj.weight": w(d, q), p + "mlp.gate_proj.weight": w(F, d),
                p + "mlp.up_proj.weight": w(F, d), p + "mlp.down_proj.weight": w(d, F),
                p + "input_layernorm.weight": 1 + w(d, s=0.1), p + "post_attention_layernorm.weight": 1 + w(d, s=0.1)}
    return out


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return F2.fast_dllm_v2_torch_model(cfg, tiny_tensors(cfg))


def _ids(L, seed=1):
    return np.random.default_rng(seed).integers(0, MASK, (1, L))


# ---------------------------------------------------------------------------- the network


def test_forward_is_qwen2_shifted(model):
    ids = _ids(10)
    ones = np.ones(ids.shape, bool)
    # Block 1: block-causal is causal. transformers' own causal mask (no mask passed), shifted by hand.
    with torch.no_grad():
        causal = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    want = np.concatenate([causal[:, :1], causal[:, :-1]], axis=1)
    np.testing.assert_allclose(F2.block_causal_logits(model, ids, ones, 1), want, rtol=0, atol=2e-5)
    # One block covering the row: bidirectional; the project's other Qwen2 path (SDPA, boolean mask), shifted.
    from oracles.bidirectional import bidirectional_logits, qwen2_from_dream

    cfg = tiny_config()
    dream = qwen2_from_dream(cfg, {k: torch.from_numpy(v) for k, v in tiny_tensors(cfg).items()})
    bi = bidirectional_logits(dream, torch.from_numpy(ids)).numpy()
    want = np.concatenate([bi[:, :1], bi[:, :-1]], axis=1)
    np.testing.assert_allclose(F2.block_causal_logits(model, ids, ones, 16), want, rtol=0, atol=2e-5)
    # ... and blocks of 4 are neither: position 1 sees position 3 (same block), position 3 does not see 4.
    got = F2.block_causal_logits(model, ids, ones, 4)
    assert not np.allclose(got[0, 2], F2.block_causal_logits(model, ids, ones, 1)[0, 2], atol=1e-4)
    assert not np.allclose(got[0, 5], want[0, 5], atol=1e-4)


def test_block_causal_shift_and_left_padding(model):
    ids = _ids(12, seed=3)
    alone = F2.block_causal_logits(model, ids, np.ones(ids.shape, bool), 4)
    changed = ids.copy()
    changed[0, 8] = (changed[0, 8] + 5) % MASK  # block 2's first token
    got = F2.block_causal_logits(model, changed, np.ones(ids.shape, bool), 4)
    # Shifted: position i reads hidden i - 1, so positions 0..8 (hidden 0..7, blocks 0-1) are untouched.
    np.testing.assert_allclose(got[0, :9], alone[0, :9], rtol=0, atol=1e-6)
    assert not np.allclose(got[0, 9], alone[0, 9], atol=1e-4)
    for pad in (1, 3):
        row = np.concatenate([np.full((1, pad), 6), ids], axis=1)
        mask = np.concatenate([np.zeros((1, pad), bool), np.ones(ids.shape, bool)], axis=1)
        # Every position after the first real one equals the row alone (the first reads a padding row, unused).
        np.testing.assert_allclose(F2.block_causal_logits(model, row, mask, 4)[0, pad + 1:], alone[0, 1:], rtol=0,
                                   atol=2e-5)


@pytest.mark.parametrize("layers, exact", [(1, True), (2, False)])
def test_sub_block_cache_is_exact_on_one_layer_only(layers, exact):
    cfg = tiny_config(layers=layers)
    m = F2.fast_dllm_v2_torch_model(cfg, tiny_tensors(cfg))
    runner = F2.Qwen2Runner(m, 4)
    ids = _ids(12, seed=4)[0]
    np.testing.assert_array_equal(runner.full(ids), runner.exact(ids))
    # The current sub-block (8..9) changes after the full pass, as commits do; the rest of the block stays.
    ids[9] = (ids[9] + 7) % MASK
    got, want = runner.sub(ids, 8, 10), runner.exact(ids)[8:10]
    if exact:  # one layer: the kept K/V of positions 10, 11 do not depend on position 9
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    else:  # two layers: positions 10, 11's layer-1 K/V are stale (computed with the old token 9)
        assert not np.allclose(got, want, atol=1e-3)
    with pytest.raises(RuntimeError, match="full"):
        F2.Qwen2Runner(m, 4).sub(ids, 8, 10)


def test_refuses_and_tied_head():
    with pytest.raises(ValueError, match="rope_scaling"):
        F2.fast_dllm_v2_torch_model(tiny_config(rope_scaling={"type": "yarn"}), tiny_tensors(tiny_config()))
    cfg = tiny_config(tie_word_embeddings=True)
    t = tiny_tensors(cfg)
    del t["lm_head.weight"]
    m = F2.fast_dllm_v2_torch_model(cfg, t)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


# ---------------------------------------------------------------------------- batch_sample on a stub network


def _row(token: int, conf: float) -> np.ndarray:
    if conf >= 1.0:
        out = np.full(V, -np.inf)
        out[token] = 0.0
        return out
    out = np.full(V, np.log((1 - conf) / (V - 1)))
    out[token] = np.log(conf)
    return out


class StubRunner:
    """A BlockRunner whose prediction for position j (the shifted logits: raw row j - 1) is plan(j, ids)."""

    def __init__(self, plan):
        self.plan, self.calls = plan, []

    def _raw(self, ids, rows):
        return np.stack([_row(*self.plan(j + 1, ids)) for j in rows])

    def exact(self, ids):
        self.calls.append(("exact", len(ids)))
        return self._raw(ids, range(len(ids)))

    def full(self, ids):
        self.calls.append(("full", len(ids)))
        return self._raw(ids, range(len(ids)))

    def sub(self, ids, lo, hi):
        self.calls.append(("sub", lo, hi))
        return self._raw(ids, range(lo, hi))


# Prompt [1, 2, 3], blocks of 4, sub-blocks of 2. Authors' canvas for max_new_tokens=8: 8 // 4 + 3 // 4 = 2 blocks.
PLAN = {3: (10, 0.5), 4: (11, 0.2), 5: (12, 0.95), 6: (13, 0.95), 7: (14, 0.5), 8: (15, 0.9)}


def _plan(j, ids):
    return PLAN.get(j, (0, 0.6))


def _sample(runner, prompt=(1, 2, 3), **kw):
    settings = {"max_new_tokens": 8, "block_size": 4, "small_block_size": 2, "threshold": 0.9, "mask_id": MASK,
                "stop_token": STOP, **kw}
    return F2.batch_sample(runner, list(prompt), **settings)


def test_batch_sample_by_hand():
    # Block 0 (0..3): sub-block 0..1 is prompt (no pass); sub-block 2..3: position 3 (0.5, not > 0.9) commits as
    # the sub-block's most confident.  Store pass over [0, 4): the free token 11 at position 4.
    # Block 1 (4..7): sub-block 4..5: 5 (0.95).  Sub-block 6..7: 6 (0.95) and the argmax (6 again) -> 6; then 7.
    # The last block: no store pass.  Denoise 1 + 1 + 2 = 4, store 1: NFE 5.
    runner = StubRunner(_plan)
    out = _sample(runner)
    assert out.tokens.tolist() == [1, 2, 3, 10, 11, 12, 13, 14]
    assert (out.nfe, out.denoise, out.store, out.blocks, out.free_tokens) == (5, 4, 1, 2, [4])
    assert [e["committed"] for e in out.log] == [[3], [5], [6], [7]]
    assert runner.calls == [("exact", 4), ("exact", 4), ("exact", 8), ("exact", 8), ("exact", 8)]
    # SDAR's canvas: ceil(11 / 4) = 3 blocks: a store pass after block 1 (free token 15 at 8), then block 2.
    out = _sample(StubRunner(_plan), canvas="sdar")
    assert out.blocks == 3 and out.store == 2 and out.tokens[8] == 15 and out.free_tokens == [4, 8]


def test_sub_block_cache_passes_are_chosen_per_row():
    # use_block_cache: block 0's pass is full (its cache is empty). Block 1: sub-block 4..5's first pass is full (a
    # new block: empty cache) even though position 4 is not a mask; sub-block 6..7: position 6 is a mask -> full;
    # its second pass (6 decoded) -> only the sub-block runs.
    runner = StubRunner(_plan)
    out = _sample(runner, use_block_cache=True)
    assert [e["kind"] for e in out.log] == ["full", "full", "full", "sub"]
    assert (out.full_passes, out.sub_passes, out.nfe) == (3, 1, 5)
    assert ("sub", 6, 8) in runner.calls and out.tokens.tolist() == [1, 2, 3, 10, 11, 12, 13, 14]
    # One sub-block of 4 (4..7): its first pass is full (new block) and takes 5 and 6 (0.95); 7 is left and
    # position 4 (the free token) is not a mask, so the next pass runs the sub-block alone.
    out = _sample(StubRunner(_plan), use_block_cache=True, small_block_size=4)
    assert [e["kind"] for e in out.log] == ["full", "full", "sub"]


def test_prompt_on_the_grid_prefills_and_takes_a_free_token():
    # P = 4 = bs: their prefill needs P > bs and would never show the prompt to the first block; here it runs:
    # the prefill's last logits give position 4 its free token (11), not counted. Authors' canvas: 8 // 4 + 1 = 3
    # blocks: blocks 1 and 2 are decoded, one store pass between them.
    runner = StubRunner(_plan)
    out = _sample(runner, prompt=(1, 2, 3, 4))
    assert runner.calls[0] == ("exact", 4) and out.free_tokens == [4, 8] and out.tokens[4] == 11
    # Block 1: 5 (0.95); 6 (0.95), 7.  Store -> 8 = 15.  Block 2: 9 (0.6 < 0.9 but the argmax), 10, 11 one by one.
    assert (out.denoise, out.store, out.nfe) == (3 + 3, 1, 7)


def test_stop_token_finishes_the_block_and_skips_the_store_pass():
    plan = {**PLAN, 5: (STOP, 0.95)}
    out = _sample(StubRunner(lambda j, ids: plan.get(j, (0, 0.6))), canvas="sdar")
    # Block 1 commits STOP at 5, still decodes 6 and 7, then the row is finished: no store pass, no block 2.
    assert out.blocks == 2 and out.store == 1 and out.stop_index == 5 and out.tokens[6:8].tolist() == [13, 14]
    assert (out.tokens[8:] == MASK).all()
    # A free token that is the stop token does not finish the row (theirs), unless asked.
    plan = {**PLAN, 4: (STOP, 0.2)}
    out = _sample(StubRunner(lambda j, ids: plan.get(j, (0, 0.6))), canvas="sdar")
    assert out.blocks == 3 and out.stop_index == 4
    out = _sample(StubRunner(lambda j, ids: plan.get(j, (0, 0.6))), canvas="sdar", stop_on_free_token=True)
    assert out.blocks == 1 and out.store == 1


def test_strict_threshold_at_one():
    # Positions 5..7 at confidence exactly 1.0 (every other logit -inf); sub-block 4 wide (4..7).
    plan = {**PLAN, 5: (12, 1.0), 6: (13, 1.0), 7: (14, 1.0)}
    run = lambda thr: _sample(StubRunner(lambda j, ids: plan.get(j, (0, 0.6))), small_block_size=4, threshold=thr)
    assert [len(e["committed"]) for e in run(1.0).log] == [1, 1, 1, 1]  # "> 1.0" never: the argmax alone
    assert [len(e["committed"]) for e in run(0.999).log] == [1, 3]


def test_localleap_runs_inside_sub_blocks():
    # Sub-block 4..7 (small_block_size=4) with 5: 0.95, 6: 0.8, 7: 0.5. The authors' threshold 0.9 takes 5, then
    # 6 (top-1), then 7: 3 passes. LocalLeap (kappa 0.9, tau 0.75, radius 4): anchor 5 plus 6 (0.8 >= 0.75 within
    # 4 of it) in one pass, then 7: 2 passes. (Block 0, one sub-block 0..3, first takes position 3 either way.)
    plan = {**PLAN, 6: (13, 0.8)}
    stub = lambda: StubRunner(lambda j, ids: plan.get(j, (0, 0.6)))
    theirs = _sample(stub(), small_block_size=4)
    leap = _sample(stub(), small_block_size=4, rule=eager_rule(reference_rules.make("localleap")))
    assert [e["committed"] for e in theirs.log] == [[3], [5], [6], [7]]
    assert [e["committed"] for e in leap.log] == [[3], [5, 6], [7]]
    assert leap.tokens.tolist() == theirs.tokens.tolist()


def test_on_the_tiny_network_both_cache_modes(model):
    # A one-layer network: the sub-block cache is exact, so both modes give the same tokens; two layers: it runs.
    cfg = tiny_config(layers=1)
    one = F2.fast_dllm_v2_torch_model(cfg, tiny_tensors(cfg, seed=5))
    prompt = _ids(6, seed=7)[0]
    kw = {"max_new_tokens": 12, "block_size": 4, "small_block_size": 2, "threshold": 0.3, "mask_id": MASK,
          "stop_token": STOP, "never_predict": (MASK, STOP)}
    exact = F2.batch_sample(F2.Qwen2Runner(one, 4), prompt, **kw)
    cached = F2.batch_sample(F2.Qwen2Runner(one, 4), prompt, use_block_cache=True, **kw)
    assert cached.sub_passes > 0 and exact.tokens.tolist() == cached.tokens.tolist()
    for m in (one, model):
        for use in (False, True):
            out = F2.batch_sample(F2.Qwen2Runner(m, 4), prompt, use_block_cache=use, **kw)
            # 12 // 4 + 6 // 4 = 4 blocks from block 1: 12 positions, 2 of them prompt, 2 free tokens: 8 masks.
            assert out.blocks == 3 and out.store == 2 and out.nfe == out.denoise + 2 and out.denoise <= 8
            assert not (out.tokens == MASK).any() and out.tokens[:6].tolist() == prompt.tolist()
