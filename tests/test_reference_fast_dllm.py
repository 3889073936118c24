"""Fast-dLLM's three LLaDA loops (oracles.fast_dllm, on transformers' Llama) against
`ll.generate(cache=none | prefix | dual)`, on the embedded trained model: same tokens, same NFE.

The case is chosen so that agreeing means something: on these prompts the caches change the tokens (rows 7 and
9 decode differently with prefix or dual than without a cache), threshold commits several tokens per pass, and
in the batch rows wait for each other (row 0 fills its blocks in fewer passes).
"""

import numpy as np
import pytest
import torch

import localleap_jax as ll
from localleap_jax.families import write_config
from oracles import fast_dllm as fd
from oracles import bidirectional as reference_torch
from oracles import rules as reference_rules

G, T = 64, 16
PROMPT_LENGTH = 49  # equal-length prompts: Fast-dLLM's loops take no attention mask
ROWS = [0, 6, 7, 9]  # of the first 16 such test problems; 7 (prefix, dual) and 9 (dual) change with a cache
ALONE = [7]

STRATEGIES = {  # name: (DecodeConfig fields, the Fast-dLLM loop's commit-rule arguments, batches to run)
    "threshold": (dict(strategy=ll.rule("threshold", kappa=0.9)), dict(threshold=0.9), (ALONE, ROWS)),
    "localleap": (dict(strategy=ll.rule("localleap", kappa=0.9, tau=0.75, radius=4)),
                  dict(rule=reference_rules.make("localleap", kappa=0.9, tau=0.75, radius=4)), (ALONE, ROWS)),
    # the schedule commits the same count in every row, so alone adds little (and each batch shape compiles anew)
    "low_confidence": (dict(strategy=ll.rule("low_confidence", steps=32)), dict(steps=32), (ROWS,)),
}


@pytest.fixture(scope="module")
def embedded():
    """(model, its torch twin, 16 test prompts of PROMPT_LENGTH tokens as int32 [16, P])."""
    from localleap_jax import synthetic_math
    from localleap_jax.families import hf_tensors

    model = ll.load(ll.checkpoint.EMBEDDED, dtype="float32")
    tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in hf_tensors(model.params, model.config).items()}
    twin = reference_torch.llama_from_llada(write_config(model.config), tensors)
    encoded = [model.tokenizer.encode(f"Question: {p['question']}\nAnswer:")
               for p in synthetic_math.take("test", 200, seed=3)]
    prompts = np.array([p for p in encoded if len(p) == PROMPT_LENGTH][:16], np.int32)
    assert len(prompts) == 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and much faster on a shared CPU
    yield model, twin, prompts
    torch.set_num_threads(threads)


def _fast(twin, model, ids, cache, **rule):
    if "rule" in rule:  # a fresh copy: the loop binds it
        rule = dict(rule=reference_rules.fresh(rule["rule"]))
    return fd.LOOPS[cache](twin, torch.tensor(ids, dtype=torch.long), gen_length=G, block_length=T,
                           mask_id=model.config.mask_token_id, **rule)


# every cache mode for the threshold rule (their get_transfer_index) and LocalLeap (the eager rule in their loops);
# their top-k schedule (low_confidence) with the dual cache, the mode whose window differs most (suite time)
CASES = [(s, c) for s in ("localleap", "threshold") for c in ("none", "prefix", "dual")] + [("low_confidence", "dual")]
assert {s for s, _ in CASES} == set(STRATEGIES)


@pytest.mark.parametrize("strategy, cache", CASES)
def test_the_fast_dllm_loop_of_each_cache_mode_decodes_as_generate(embedded, strategy, cache):
    """Alone (threshold, localleap) and in a batch of 4: tokens and per-row NFE equal. Alone, also the passes and one
    full pass per block with a cache. In a batch Fast-dLLM's rows advance through blocks together (a block ends when
    no row has a mask left in it); `ll.generate`'s advance on their own (each row refreshes when its block starts),
    so its batch runs no more passes than Fast-dLLM's loop and as many as its slowest row."""
    model, twin, prompts = embedded
    fields, rule, batches = STRATEGIES[strategy]
    cfg = ll.DecodeConfig(gen_length=G, block_length=T, cache=cache, **fields)
    for rows in batches:
        ids = prompts[rows]
        out = ll.generate(model, ids, None, cfg)
        want = _fast(twin, model, ids, cache, **rule)
        np.testing.assert_array_equal(out.tokens, want.x.numpy(), err_msg=f"rows {rows}")
        assert out.nfe.tolist() == want.row_nfe, rows
        assert want.nfe >= out.forward_passes == max(out.nfe)
        if cache == "none":
            assert want.full_passes == want.nfe and out.forward_passes == out.full_passes
        else:
            assert want.full_passes == G // T <= out.full_passes <= len(rows) * G // T
        if len(rows) == 1:
            assert want.nfe == out.forward_passes == out.nfe[0]


def test_the_case_decides(embedded):
    """On these prompts a cache changes the tokens (so agreeing with generate is a claim about each cache
    mode), threshold commits several tokens per pass, and in the batch rows wait for each other."""
    model, twin, prompts = embedded
    ids = prompts[ROWS]
    runs = {c: _fast(twin, model, ids, c, threshold=0.9) for c in ("none", "prefix", "dual")}
    gen = {c: r.x[:, PROMPT_LENGTH:].numpy() for c, r in runs.items()}
    changed = {c: [ROWS[i] for i in np.flatnonzero((gen[c] != gen["none"]).any(1))] for c in ("prefix", "dual")}
    assert {7} <= set(changed["prefix"]) and {7, 9} <= set(changed["dual"]), changed  # measured: [7], [6, 7, 9]
    assert G / np.mean(runs["none"].row_nfe) >= 8  # tokens per pass: measured 64 / 6.5
    assert runs["dual"].nfe > min(runs["dual"].row_nfe)  # some row waited


def test_the_eager_threshold_rule_in_the_loop_commits_as_fast_dllm_get_transfer_index(embedded):
    """The pluggable rule path (EagerRule over reference_rules) and Fast-dLLM's own get_transfer_index agree,
    for the rule both have, in the loop that uses them most (dual: every cached pass calls the rule)."""
    model, twin, prompts = embedded
    ids = prompts[:8]
    for kappa in (0.9, 0.999):
        theirs = _fast(twin, model, ids, "dual", threshold=kappa)
        ours = _fast(twin, model, ids, "dual", rule=reference_rules.make("threshold", kappa=kappa))
        assert torch.equal(theirs.x, ours.x) and theirs[1:] == ours[1:], kappa


def test_left_padding_keys_are_masked(embedded):
    """An extension (Fast-dLLM takes no mask): prompts of different lengths, left-padded, decode as
    `ll.generate` does with the dual cache; a padded row decodes as it does alone."""
    from localleap_jax.tokenizer import left_pad

    model, twin, prompts = embedded
    short = prompts[3, 6:].tolist()  # 43 tokens
    ids, mask = left_pad([prompts[7].tolist(), short], model.config.pad_token_id)
    cfg = ll.DecodeConfig(strategy=ll.rule("threshold", kappa=0.9), gen_length=G, block_length=T, cache="dual")
    out = ll.generate(model, ids, mask, cfg)
    want = fd.generate_with_dual_cache(twin, torch.tensor(ids, dtype=torch.long), torch.tensor(mask), gen_length=G,
                                       block_length=T, mask_id=model.config.mask_token_id, threshold=0.9)
    np.testing.assert_array_equal(out.tokens, want.x.numpy())
    alone = _fast(twin, model, np.array([short], np.int32), "dual", threshold=0.9)
    np.testing.assert_array_equal(want.x[1, ids.shape[1]:].numpy(), alone.x[0, len(short):].numpy())
