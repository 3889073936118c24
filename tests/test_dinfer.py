"""dInfer's decoders (credit, hierarchy, smooth: localleap_jax/rules/dinfer.py) and LLaDA2.2's insert/delete
(joint_threshold_indel: localleap_jax/rules/indel.py) in the one compiled loop, against the eager transcriptions of
their authors' loops (oracles/dinfer.py, oracles/joint_threshold.py): tokens and NFE (and inserts, deletes, edits)
row by row on tiny LLaDA, LLaDA-MoE and LLaDA2 checkpoints, blocks of 4 and 8, each a left-padded batch with
per-row settings (each row equal to the oracle's run of it alone). Each case asserts what it is about happened: a
fused argmax that is not the raw one (credit), a segment's commit (hierarchy), a token the soft input changed
(smooth), inserts, deletes and edits (indel). Then the caches each rule takes, continuous batching, the refusals.

The loop never writes ids past the tokenizer's vocabulary: the oracles leave them out of their argmaxes too
(`never_predict`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localleap_jax as ll
from helpers import TOKENIZER_CORPUS, write_hf_checkpoint
from localleap_jax.tokenizer import left_pad
from oracles import dinfer as D
from oracles import joint_threshold as JT

DELETE, SPLIT = 7, 8  # the tiny LLaDA2's edit tokens (config.json), ordinary ids of its tokenizer


class Family:
    """A loaded model, and the same weights eagerly: `logits_fn` (ids -> logits), `embeds_fn` (input embeddings ->
    logits, bidirectional), the embedding table, the oracle's layout."""

    def __init__(self, model, logits_fn, layout, embeds_fn=None, embedding=None, block_fn=None):
        self.model, self.logits_fn, self.layout = model, logits_fn, layout
        self.embeds_fn, self.embedding, self.block_fn = embeds_fn, embedding, block_fn
        sp = model.special
        self.never = list(range(sp.vocab_limit or model.config.embedding_size, model.config.embedding_size))

    def ours(self, prompts, rule, *, gen, block, **kw):
        ids, mask = left_pad([list(map(int, p)) for p in prompts], self.model.config.pad_token_id)
        cfg = ll.DecodeConfig(strategy=rule, gen_length=gen, block_length=block, **kw)
        return ll.generate(self.model, ids, mask, cfg)

    def dinfer(self, prompt, name, *, gen, block, **settings) -> tuple[D.DInferResult, object]:
        sp = self.model.special
        smoothing = None
        if name == "smooth":
            keys = ("cont_weight", "cont_weight_init", "cont_weight_growth", "threshold_decay")
            smoothing = D.Smoothing(self.embeds_fn, self.embedding,
                                    **{k: settings.pop(k) for k in keys if k in settings})
            name = "threshold"
        decoder = D.make_decoder(name, mask_id=sp.mask, **settings)
        fn = self.block_fn(block) if self.block_fn else self.logits_fn
        return D.generate(fn, prompt, decoder=decoder, mask_id=sp.mask, eos_id=sp.eos, gen_length=gen,
                          block_length=block, layout=self.layout, smoothing=smoothing,
                          never_predict=self.never), decoder


@pytest.fixture(scope="module")
def llada(sharp_checkpoint):
    """The 2-layer LLaDA checkpoint with its head scaled x20, and transformers' Llama holding the same weights."""
    from oracles.bidirectional import llama_from_llada

    path, cfg, tensors = sharp_checkpoint
    net = llama_from_llada(cfg, tensors)
    table = net.get_input_embeddings().weight.detach()

    @torch.no_grad()
    def embeds_fn(embeds):
        L = embeds.shape[1]
        return net(inputs_embeds=embeds, attention_mask=torch.ones(1, 1, L, L, dtype=torch.bool),
                   position_ids=torch.arange(L)[None]).logits

    return Family(ll.load(path, dtype="float32"), lambda ids: embeds_fn(table[torch.as_tensor(ids)]).numpy(),
                  "bidirectional", embeds_fn, table)


@pytest.fixture(scope="module")
def dream(dream_hf_checkpoint, dream_converted):
    """The tiny Dream checkpoint (its logits lag one position) and transformers' Qwen2 with the same weights; the
    oracle's logits at position i are those that predict i (Dream's shift applied), so smoothing's soft input at a
    masked position comes from the distribution over what it holds, as here."""
    from oracles.bidirectional import qwen2_from_dream

    _, cfg, tensors = dream_hf_checkpoint
    net = qwen2_from_dream(cfg, tensors)
    table = net.get_input_embeddings().weight.detach()

    @torch.no_grad()
    def embeds_fn(embeds):
        L = embeds.shape[1]
        raw = net(inputs_embeds=embeds, attention_mask=torch.ones(1, 1, L, L, dtype=torch.bool),
                  position_ids=torch.arange(L)[None]).logits
        return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)

    return Family(ll.load(dream_converted, dtype="float32"),
                  lambda ids: embeds_fn(table[torch.as_tensor(ids)]).numpy(), "bidirectional", embeds_fn, table)


def _convert(tmp_path_factory, name, cfg, tensors, tok):
    from localleap_jax.convert_hf import convert

    src = write_hf_checkpoint(tmp_path_factory.mktemp(name) / "hf", cfg,
                              {k: torch.from_numpy(v) for k, v in tensors.items()}, tok)
    out = tmp_path_factory.mktemp(name) / "ck"
    convert(str(src), str(out), progress=False)
    return ll.load(out, dtype="float32")


@pytest.fixture(scope="module")
def ling_tokenizer():
    from localleap_jax.families import make_tokenizer

    return make_tokenizer("llada2", TOKENIZER_CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, ling_tokenizer):
    """A tiny LLaDA-MoE (test_moe_families' configuration) and the eager network (oracles/llada_moe.py)."""
    from oracles import llada_moe as LM
    from test_reference_llada_moe import tiny_config, tiny_tensors

    cfg = tiny_config(vocab_size=len(ling_tokenizer), moe_router_enable_expert_bias=True,
                      shared_expert_intermediate_size=12)
    tensors = tiny_tensors(cfg)
    net = LM.LLaDAMoENetwork(cfg, tensors)

    def embeds_fn(embeds):
        allowed, positions = LM.bidirectional_mask(np.ones(embeds.shape[:2], bool))
        return torch.from_numpy(net(np.zeros(embeds.shape[:2], np.int64), allowed, positions, embeds=embeds))

    return Family(_convert(tmp_path_factory, "moe", cfg, tensors, ling_tokenizer), LM.llada_moe_logits_fn(net),
                  "bidirectional", embeds_fn, net.embed)


@pytest.fixture(scope="module")
def llada2(tmp_path_factory, ling_tokenizer):
    """A tiny 2-layer LLaDA2 (a dense layer, then MoE) whose config.json names DELETE and SPLIT ids, its head
    sharpened (x4, the edit tokens' rows x12, so that they win often enough), and the eager network."""
    from oracles import llada2 as L2
    from test_reference_llada2 import tiny_config, tiny_tensors

    vocab = ling_tokenizer.get_vocab()
    cfg = tiny_config(vocab_size=len(ling_tokenizer), num_hidden_layers=2, delete_token_id=DELETE,
                      split_token_id=SPLIT)
    tensors = tiny_tensors(cfg)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 4.0
    tensors["lm_head.weight"][[DELETE, SPLIT]] *= 3.0
    net = L2.LLaDA2Network({**cfg, "mask_token_id": vocab["<|mask|>"], "eos_token_id": vocab["<|endoftext|>"]},
                           tensors)
    return Family(_convert(tmp_path_factory, "llada2", cfg, tensors, ling_tokenizer), None, "block_diffusion",
                  block_fn=lambda block: L2.llada2_logits_fn(net, block))


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 290, n) for n in lengths]


# ---------------------------------------------------------------- dInfer's decoders, equal to its loop

# (family, rule, block, gen, prompts' seed, per-row settings): three rows each, prompts of 5, 9 and 3 tokens
CASES = {
    "llada-credit-4": ("llada", "credit", 4, 16, 4, dict(threshold=[0.9, 0.99, 0.999], credit_alpha=[0.7, 0.7, 3.0],
                                                         boost_gamma=[0.2, 1.0, 1.0])),
    "llada-hierarchy-8": ("llada", "hierarchy", 8, 16, 8, dict(threshold=[0.5, 0.9, 0.3],
                                                               low_threshold=[0.1, 0.05, 0.2])),
    "llada-smooth-4": ("llada", "smooth", 4, 16, 4, dict(threshold=[0.3, 0.5, 0.2], cont_weight=[0.3, 1.0, 0.6],
                                                         cont_weight_init=[0.15, 0.5, 0.3])),
    "moe-smooth-8": ("moe", "smooth", 8, 16, 8, dict(threshold=[0.3, 0.5, 0.2], cont_weight=[0.3, 2.0, 1.0],
                                                     cont_weight_init=[0.15, 1.0, 0.6])),
    "dream-smooth-4": ("dream", "smooth", 4, 8, 4, dict(threshold=[0.3, 0.5, 0.2], cont_weight=[0.3, 2.0, 1.0],
                                                        cont_weight_init=[0.15, 1.0, 0.6])),
    "llada2-credit-8": ("llada2", "credit", 8, 12, 0, dict(threshold=[0.99, 0.999, 0.9], credit_alpha=[0.7, 1.5, 0.7],
                                                           boost_gamma=[1.0, 0.5, 0.2])),
    "llada2-hierarchy-4": ("llada2", "hierarchy", 4, 12, 4, dict(threshold=[0.5, 0.9, 0.3],
                                                                 low_threshold=[0.1, 0.05, 0.2])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_nfe_equal_dinfers_loop(case, request):
    which, name, T, G, seed, per_row = CASES[case]
    fam = request.getfixturevalue(which)
    prompts = _prompts([5, 9, 3], seed=seed)
    rule = ll.rule(name, **{k: np.asarray(v) for k, v in per_row.items()})
    out = fam.ours(prompts, rule, gen=G, block=T, early_stop=True)
    fused_differs = segments = 0
    for b, prompt in enumerate(prompts):
        ref, decoder = fam.dinfer(prompt, name, gen=G, block=T, **{k: v[b] for k, v in per_row.items()})
        ours = out.tokens[b, out.prompt_length:]
        np.testing.assert_array_equal(ours, ref.tokens[len(prompt):len(prompt) + G], err_msg=f"row {b}")
        assert int(out.nfe[b]) == ref.passes, (b, int(out.nfe[b]), ref.passes)
        fused_differs += getattr(decoder, "fused_differs", 0)
        segments += getattr(decoder, "segment_only", 0)
    assert not out.edits.any() and not out.inserts.any() and not out.deletes.any()
    if name == "credit":  # the loop wrote a fused argmax that is not the raw one (the oracle counted it)
        assert fused_differs > 0
    if name == "hierarchy":  # some commit came from a segment's maximum alone (neither > threshold nor the best)
        assert segments > 0
    if name == "smooth":  # the soft input changed a token: the same rule without it (weights 0) decodes otherwise
        plain = fam.ours(prompts, ll.rule(name, **{**{k: np.asarray(v) for k, v in per_row.items()},
                                                  "cont_weight": 0.0, "cont_weight_init": 0.0}),
                         gen=G, block=T, early_stop=True)
        assert plain.compile_seconds == 0.0  # the same program: settings are its inputs
        assert (plain.tokens != out.tokens).any()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_credit_and_hierarchy_under_fast_dllms_caches(cache):
    """The rules under Fast-dLLM's caches (each row refreshes at its own block start, windowed passes between), on
    the stub whose "K/V" is the canvas as the block's refresh saw it: there both caches are exact (what precedes the
    block is final at its start, what follows is masks), so tokens and NFE equal dInfer's uncached loop, with one
    full pass a block for each row (rows that start a block together share the pass)."""
    from stubs import EOS, MASK, seeded

    model = seeded(12)
    prompts = np.random.default_rng(5).integers(1, 7, (3, 4))  # one length: no padding (the stub reads positions)
    fn = lambda ids: np.asarray(model.denoiser.logits_fn(ids))  # noqa: E731
    for name, settings in (("credit", dict(threshold=0.8, credit_alpha=3.0)),
                           ("hierarchy", dict(threshold=0.9, low_threshold=0.5))):
        cfg = ll.DecodeConfig(strategy=ll.rule(name, **settings), gen_length=12, block_length=4, cache=cache,
                              prompt_bucket=1)
        out = ll.generate(model, prompts, None, cfg)
        assert 3 <= out.full_passes <= 3 * len(prompts) and out.forward_passes > out.full_passes
        for b, prompt in enumerate(prompts):
            ref = D.generate(fn, prompt, decoder=D.make_decoder(name, mask_id=MASK, **settings), mask_id=MASK,
                             eos_id=EOS, gen_length=12, block_length=4, early_stop=False)
            np.testing.assert_array_equal(out.tokens[b, 4:], ref.tokens[4:], err_msg=f"{name} row {b}")
            assert int(out.nfe[b]) == ref.passes


# ---------------------------------------------------------------- LLaDA2.2's insert / delete


@pytest.mark.parametrize("block", [4, 8])
def test_indel_equals_sglangs_loop_on_llada2(llada2, block):
    """The exact block cache (what "auto" picks), ids from config.json, three rows with their own settings: tokens,
    NFE, inserts, deletes and edits equal SGLang's loop transcribed (per row, alone); inserts, deletes and edits
    happened."""
    G = 12
    per_row = dict(threshold=[0.5, 0.7, 0.3], edit_threshold=[0.0, 0.5, 0.1], max_post_edit_steps=[3, 0, 6])
    prompts = _prompts([5, 9, 3], seed=0)
    out = llada2.ours(prompts, ll.rule("joint_threshold_indel", **{k: np.asarray(v) for k, v in per_row.items()}),
                      gen=G, block=block)
    mask_id = llada2.model.special.mask
    loops = 0
    for b, prompt in enumerate(prompts):
        ref = JT.joint_threshold_indel_generate(llada2.block_fn(block), prompt, mask_id=mask_id, delete_id=DELETE,
                                                split_id=SPLIT, gen_length=G, block_length=block,
                                                **{k: v[b] for k, v in per_row.items()})
        np.testing.assert_array_equal(out.tokens[b, out.prompt_length:], ref.tokens[len(prompt):len(prompt) + G])
        got = tuple(int(a[b]) for a in (out.nfe, out.inserts, out.deletes, out.edits))
        assert got == (ref.nfe, ref.extra["splits"], ref.extra["deletes"], ref.edits), (b, got)
        loops += ref.extra["antiloop"]
    assert out.inserts.sum() > 0 and out.deletes.sum() > 0 and out.edits.sum() > 0
    if block == 4:
        assert loops > 0  # the anti-loop rule changed a prediction (in the oracle, and so here)


def test_indel_with_ids_given_on_a_bidirectional_model_and_its_refusals(llada):
    """LLaDA has no edit tokens in its config: the rule takes them as settings (cache "none", blocks of the
    generated region) and equals SGLang's loop there; without them, one line."""
    sp = llada.model.special
    ids = dict(delete_token_id=147, split_token_id=168)  # two ids the sharp model predicts often
    prompts = _prompts([6, 4], seed=3)
    rule = ll.rule("joint_threshold_indel", max_post_edit_steps=2, **ids)
    out = llada.ours(prompts, rule, gen=8, block=4)
    for b, prompt in enumerate(prompts):
        ref = JT.joint_threshold_indel_generate(llada.logits_fn, prompt, mask_id=sp.mask, delete_id=147, split_id=168,
                                                gen_length=8, block_length=4, layout="bidirectional",
                                                max_post_edit_steps=2)
        np.testing.assert_array_equal(out.tokens[b, out.prompt_length:], ref.tokens[len(prompt):])
        assert (int(out.nfe[b]), int(out.inserts[b]), int(out.deletes[b]), int(out.edits[b])) == (
            ref.nfe, ref.extra["splits"], ref.extra["deletes"], ref.edits)
    assert out.inserts.sum() + out.deletes.sum() > 0
    with pytest.raises(ll.DecodeError, match=r"config.json has no delete_token_id; pass delete_token_id=\.\.\."):
        llada.ours(prompts, ll.rule("joint_threshold_indel"), gen=8, block=4)


# ---------------------------------------------------------------- slots, traces, refusals


def test_slots_equal_a_fixed_batch_and_traces_name_the_clauses(tmp_path):
    """Continuous batching (a slot's next prompt starts with a fresh credit, a fresh soft input, a fresh insert/delete
    history) gives each prompt the fixed batch's tokens, NFE and counts; traces name each rule's clauses."""
    from stubs import ragged_prompts, seeded

    model = seeded(8)
    ids, mask = ragged_prompts(5, seed=2)
    for rule, clauses in ((ll.rule("smooth", threshold=0.6), ("threshold", "best")),
                          (ll.rule("joint_threshold_indel", delete_token_id=5, split_token_id=6, max_post_edit_steps=2),
                           ("threshold", "top_k", "introduced", "cleanup"))):
        cfg = ll.DecodeConfig(strategy=rule, gen_length=8, block_length=4)
        fixed = ll.generate(model, ids, mask, cfg, trace=True)
        slotted = ll.generate(model, ids, mask, cfg, slots=2)
        for field in ("tokens", "nfe", "edits", "inserts", "deletes"):
            np.testing.assert_array_equal(getattr(slotted, field), getattr(fixed, field),
                                          err_msg=f"{rule.name} {field}")
        assert slotted.forward_passes > fixed.forward_passes // 2  # two rows at a time really took turns
        assert fixed.trace.clause_names == clauses + ("forced",)
        used = {fixed.trace.clause_names[k - 1] for k in np.unique(fixed.trace.clause) if k > 0}
        if rule.name == "joint_threshold_indel":
            assert fixed.inserts.sum() > 0 and fixed.deletes.sum() > 0 and {"introduced", "cleanup"} <= used
            assert fixed.trace.edit_names == ("changed",) and fixed.trace.edited.sum() == fixed.edits.sum() > 0
            # where each pass dropped and inserted positions, as many as counted
            assert (fixed.trace.inserted.sum(axis=(1, 2)).tolist(), fixed.trace.deleted.sum(axis=(1, 2)).tolist()) \
                == (fixed.inserts.tolist(), fixed.deletes.tolist())
            back, _, _ = ll.load_trace(ll.save_trace(tmp_path / "indel.npz", fixed.trace))
            assert back.inserted.sum() == fixed.inserts.sum() and back.deleted.sum() == fixed.deletes.sum()
        else:
            assert used == {"threshold", "best"}


def test_refusals_in_one_line(llada, llada2):
    def refused(match, **fields):
        model = fields.pop("model", llada.model)
        with pytest.raises(ll.DecodeError, match=match) as e:
            ll.DecodeConfig(**{"gen_length": 16, "block_length": 4, **fields}).validate(model.config)
        assert "\n" not in str(e.value)

    refused(r"^smooth feeds each pass .* this model is block-causal", strategy="smooth", model=llada2.model)
    refused(r"^smooth feeds each pass an input embedding .* use cache 'none'", strategy="smooth", cache="dual")
    refused(r"^joint_threshold_indel: delete_token_id and split_token_id must differ",
            strategy="joint_threshold_indel:delete_token_id=5,split_token_id=5")
    refused(r"^hierarchy: low_threshold=1.5 must lie in \[0, 1\]", strategy="hierarchy:low_threshold=1.5")
    with pytest.raises(ll.DecodeError, match=r"^credit rewrites its block: it cannot be combined with any_of"):
        ll.DecodeConfig(strategy=ll.any_of(ll.rule("threshold"), ll.rule("credit"))).validate()
    # what fits: credit and hierarchy on each cache of each kind of model, indel on the block cache
    for strategy, cache, model in (("credit", "dual", llada), ("hierarchy", "prefix", llada),
                                   ("credit", "block", llada2), ("hierarchy", "auto", llada2),
                                   ("joint_threshold_indel", "auto", llada2), ("smooth", "auto", llada),
                                   ("joint_threshold_indel", "prefix", llada)):  # (rows advance on their own)
        cfg = ll.DecodeConfig(strategy=strategy, gen_length=16, block_length=4, cache=cache)
        cfg.validate(model.model.config)
        assert cfg.cache_mode(model.model.config) == {"auto": "block" if model is llada2 else "none"}.get(cache, cache)


TABLE_V, TABLE_MASK = 20, 19


def _table_stub(table):
    """A stub model (vocabulary 20, mask 19, EOS 0) whose canvas position j predicts table[j] whatever the canvas
    holds: {token: p}, the rest spread evenly; "tie": 10 and 11 at exactly 0.5."""
    import jax.numpy as jnp

    from localleap_jax.config import ModelConfig
    from localleap_jax.denoiser import FunctionDenoiser
    from stubs import StubModel

    V = TABLE_V
    rows = []
    for j in range(6):
        dist = table.get(j, {5: 0.3})
        if dist == "tie":
            row = np.full(V, -np.inf)
            row[[10, 11]] = 0.0
        else:
            rest = (1.0 - sum(dist.values())) / (V - len(dist))
            row = np.full(V, np.log(rest))
            for t, p in dist.items():
                row[t] = np.log(p)
        rows.append(row)
    logits = jnp.asarray(np.stack(rows), jnp.float32)
    config = ModelConfig(d_model=8, n_heads=1, n_kv_heads=1, n_layers=1, mlp_hidden_size=8, vocab_size=V,
                         embedding_size=V, mask_token_id=TABLE_MASK, eos_token_id=0, pad_token_id=0)
    return StubModel(config, FunctionDenoiser(lambda x: jnp.broadcast_to(logits, x.shape + (V,)), V))


def test_indel_falls_back_from_the_mask_at_an_original_mask_by_hand():
    """Block 2..5 (prompt [1, 2]), threshold 0.5, max_post_edit_steps 1; position 2's argmax is the mask id (0.9; 10 at
    0.05), 3..5 predict 11, 12, 13 at 0.8, 0.7, 0.6:
      pass 1: 2 is an original mask predicting the mask: its best other token, 10 at 0.05; quota 1; 3, 4, 5 > 0.5
      pass 2: 2 alone (top-1: 10)
      pass 3: no original mask left: post-edit 1 >= 1: the cleanup; 2 disagrees (the mask id, 0.9 > 0): an edit,
              scrubbed to 10, the token it holds: no change, no edit; the block ends.  NFE 3, tokens 10 11 12 13.
    (Without the fallback pass 1 writes the mask id back at 2, still an original mask: 4 passes.)"""
    table = {2: {TABLE_MASK: 0.9, 10: 0.05}, 3: {11: 0.8}, 4: {12: 0.7}, 5: {13: 0.6}}
    model = _table_stub(table)
    rule = ll.rule("joint_threshold_indel", max_post_edit_steps=1, delete_token_id=17, split_token_id=18)
    out = ll.generate(model, np.array([[1, 2]], np.int32), None,
                      ll.DecodeConfig(strategy=rule, gen_length=4, block_length=4, prompt_bucket=1))
    assert out.tokens[0, 2:].tolist() == [10, 11, 12, 13] and int(out.nfe[0]) == 3 and int(out.edits[0]) == 0
    ref = JT.joint_threshold_indel_generate(lambda ids: np.asarray(model.denoiser.logits_fn(ids)), [1, 2],
                                            mask_id=TABLE_MASK, delete_id=17, split_id=18, gen_length=4,
                                            block_length=4, layout="bidirectional", max_post_edit_steps=1)
    assert ref.tokens[2:].tolist() == [10, 11, 12, 13] and ref.nfe == 3


def test_dinfers_threshold_rule_in_the_loop_by_hand():
    """dInfer's threshold rule as the loop runs it (credit with credit_alpha 0 decides on the raw logits; smooth with
    its weights 0 and threshold_decay 0 is the plain rule), on a stub whose block 2..5 (prompt [1, 2]) predicts
    10 (0.9), 11 (0.899995), 12 (0.8) and, at 5, the mask id (0.96; 13 at 0.03 the runner-up), threshold 0.95:
      pass 1: candidates 2, 3, 4 (5's argmax is the mask: not one); bound = 0.9 - 1e-5: 2 and 3 ("best", the band)
      pass 2: 4 ("best")
      pass 3: no candidate (dInfer would loop forever): the loop commits its most confident mask, 5, with its
              prediction without the mask id, 13 ("forced")
    hierarchy (low 0.4, threshold 0.95) on the same canvas: pass 1: one segment 2..5 whose maximum is 5 (0.96, the
    mask id: a no-op), the block's best is 5 too: nothing changes, the loop forces 2 (0.9); pass 2: segments 3..5,
    same; it forces 3; then 4; then 5 (13): 4 passes."""
    stub, MASK = _table_stub, TABLE_MASK
    ids = np.array([[1, 2]], np.int32)
    # non-strict: position 3 at exactly 0.5 (a tie of 10 and 11: the lower id) commits beside the best, 2 (0.9),
    # at threshold 0.5; 4 and 5 (0.3) wait: pass 1 {2, 3}, pass 2 the band {4, 5}
    out = ll.generate(stub({2: {10: 0.9}, 3: "tie"}), ids, None, ll.DecodeConfig(
        strategy=ll.rule("credit", threshold=0.5, credit_alpha=0.0), gen_length=4, block_length=4, prompt_bucket=1),
        trace=True)
    assert out.tokens[0, 2:].tolist() == [10, 10, 5, 5] and int(out.nfe[0]) == 2
    assert out.trace.commit_pass[0].tolist() == [0, 0, 1, 1]
    model = stub({2: {10: 0.9}, 3: {11: 0.899995}, 4: {12: 0.8}, 5: {MASK: 0.96, 13: 0.03}})
    for rule, nfe, clauses in (
            (ll.rule("credit", threshold=0.95, credit_alpha=0.0), 3, [["best", "best"], ["best"], ["forced"]]),
            (ll.rule("smooth", threshold=0.95, cont_weight=0.0, cont_weight_init=0.0, threshold_decay=0.0), 3,
             [["best", "best"], ["best"], ["forced"]]),
            (ll.rule("hierarchy", threshold=0.95, low_threshold=0.4), 4, [["forced"]] * 4)):
        out = ll.generate(model, ids, None, ll.DecodeConfig(strategy=rule, gen_length=4, block_length=4,
                                                            prompt_bucket=1), trace=True)
        assert out.tokens[0, 2:].tolist() == [10, 11, 12, 13] and int(out.nfe[0]) == nfe, rule.name
        t = out.trace
        assert [[t.clause_names[k - 1] for k in t.clause[0, s] if k > 0] for s in range(nfe)] == clauses, rule.name


@pytest.mark.parametrize("settings, conf, candidates, expect", [
    # one segment 0..5: its max 3 (0.75 > 0.375) -> segment; the block's best is 3 too
    (dict(low_threshold=0.375), (0.5, 0.25, 0.125, 0.75, 0.375, 0.0625), (0, 1, 2, 3, 4, 5), {3: "segment"}),
    # segments 0..2 (max 0: 0.5) and 4..5 (max 0.375, not > 0.375)
    (dict(low_threshold=0.375), (0.5, 0.25, 0.125, 0.75, 0.375, 0.0625), (0, 1, 2, 4, 5), {0: "segment"}),
    # segments 1..2 (0.25) and 4..5 (0.375): none above: the block's best, 4
    (dict(low_threshold=0.375), (0.5, 0.25, 0.125, 0.75, 0.375, 0.0625), (1, 2, 4, 5), {4: "top1"}),
    # strict threshold: 0.625 and 0.75 > 0.5, 0.5 is not; the one segment's max (0.75) is below low 0.875
    (dict(threshold=0.5, low_threshold=0.875), (0.625, 0.5, 0.75, 0.25), (0, 1, 2, 3),
     {0: "threshold", 2: "threshold"}),
    # ties: segment 0..1's two maxima both commit, segment 3's alone too
    (dict(low_threshold=0.25), (0.5, 0.5, 0.25, 0.5), (0, 1, 3), {0: "segment", 1: "segment", 3: "segment"}),
    # low_threshold None: no floor, each segment's max commits
    (dict(low_threshold=None), (0.125, 0.0625, 0.25, 0.03125), (0, 1, 3), {0: "segment", 3: "segment"}),
])
def test_hierarchys_clauses_by_hand(settings, conf, candidates, expect):
    """The rule on hand-made signals (dyadic confidences, exact in fp32; no position's argmax is the mask id)."""
    import jax.numpy as jnp

    T = len(conf)
    cand = np.zeros((1, T), bool)
    cand[0, list(candidates)] = True
    s = ll.rules.Signals(logits=jnp.zeros((1, T, 4)).at[..., 1].set(1.0), pred=jnp.ones((1, T), jnp.int32),
                         conf=jnp.asarray([conf], jnp.float32), candidates=jnp.asarray(cand),
                         step=jnp.zeros((1,), jnp.int32), gen_length=T, block_length=T, mask_id=3)
    rule = ll.rule("hierarchy", **settings)
    code, _ = rule.update(s, ())
    got = {i: rule.clause_names[c - 1] for i, c in enumerate(np.asarray(code)[0].tolist()) if c}
    assert got == expect
