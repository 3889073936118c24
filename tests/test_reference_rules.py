"""The eager rule oracle against hand-computed boundary cases, and eager_generate running every rule.

The cases (tests/rule_cases.py) are literals worked out by hand from the rules spec, not output of
the code; the JAX rules run the same table.
"""

import math

import numpy as np
import pytest

from oracles import rules as R
from rule_cases import CASES, EVERY_RULE, Case, expected_mask, signals


def _softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _run_case(case: Case):
    """Feed the case's steps to one fresh rule; yields (step, its signals, the rule's commits, step_in_block)."""
    rule = R.make(case.rule, **case.settings).bind(gen_length=case.gen_length,
                                                   block_length=case.block_length or case.T)
    rule.reset()
    for step, s in zip(case.steps, case.step_indices()):
        if step.new_block:
            rule.reset()
        sig = signals(step)
        probs = None if sig["logits"] is None else _softmax64(sig["logits"])
        got = rule.select(s, sig["candidates"], probs, sig["pred"], sig["conf"], margin=sig["margin"],
                          entropy=sig["entropy"])
        yield rule, step, sig, got, s


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_boundary_case(case):
    for i, (rule, step, sig, got, s) in enumerate(_run_case(case)):
        if step.quota is not None:
            assert rule.quota(s) == step.quota, f"step {i}: LLaDA's quota at step_in_block {s}"
        assert got == step.expect, f"step {i}: {case.note}"
        mask = np.zeros(case.T, bool)
        mask[list(got)] = True
        np.testing.assert_array_equal(mask, expected_mask(step))
        assert not (mask & ~sig["candidates"]).any()


def test_the_table_reaches_every_clause_of_every_rule():
    """A boundary table that never exercises a clause cannot catch a bug in it."""
    seen = {name: set() for name in R.RULES}
    for case in CASES:
        for step in case.steps:
            seen[case.rule] |= set(step.expect.values())
    for name, cls in R.RULES.items():
        assert seen[name] == set(cls.clauses), name


def test_the_table_is_exact_in_float32():
    """Dyadic values: casting the signals to float32 changes none of them (so a float32 rule sees the
    same boundaries), except the logits KLASS uses only through differences of identical rows or ln 2."""
    for case in CASES:
        for step in case.steps:
            for key in ("conf", "margin", "entropy"):
                v = getattr(step, key)
                if v is not None:
                    a = np.asarray(v, np.float64)
                    np.testing.assert_array_equal(a.astype(np.float32).astype(np.float64), a, err_msg=case.id)
        for key in ("kappa", "tau", "f", "gamma", "tau_c", "c_min"):
            if key in case.settings:
                v = float(case.settings[key])
                assert float(np.float32(v)) == v, (case.id, key)


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("name, settings, message", [
    ("low_confidence", {"steps": 0}, r"steps=0 must be a positive integer"),
    ("low_confidence", {"steps": 2.0}, r"steps=2.0 must be a positive integer"),
    ("threshold", {"kappa": 0.0}, r"kappa=0.0 must lie in \(0, 1\]"),
    ("threshold", {"kappa": 1.5}, r"kappa=1.5 must lie in \(0, 1\]"),
    ("threshold", {"kappa": math.nan}, r"kappa=nan must lie in \(0, 1\]"),
    ("localleap", {"tau": 0.95, "kappa": 0.9}, r"tau=0.95 > kappa=0.9"),
    ("localleap", {"radius": -1}, r"radius=-1 must be an integer >= 0"),
    ("localleap", {"radius": 1.5}, r"radius=1.5 must be an integer >= 0"),
    ("localleap", {"radius": True}, r"radius=True must be an integer >= 0"),
    ("factor", {"f": 0.0}, r"f=0.0 must be > 0"),
    ("factor", {"f": math.inf}, r"f=inf must be > 0"),
    ("eb", {"gamma": -0.001}, r"gamma=-0.001 must be >= 0"),
    ("margin", {"steps": -4}, r"steps=-4 must be a positive integer"),
    ("entropy", {"steps": "8"}, r"steps='8' must be a positive integer"),
    ("klass", {"tau_c": 1.0}, r"tau_c=1.0 must lie in \[0, 1\)"),
    ("klass", {"tau_kl": 0.0}, r"tau_kl=0.0 must be > 0"),
    ("klass", {"history": 0}, r"history=0 must be an integer >= 1"),
    ("stable", {"k": 0}, r"k=0 must be an integer >= 1"),
    ("stable", {"c_min": 1.25}, r"c_min=1.25 must lie in \[0, 1\]"),
    ("stable", {"kappa": 0.9}, r"stable has no setting kappa; its settings are k, c_min"),
    ("greedy", {}, r"unknown rule 'greedy'; choose from dynamic, eb, entropy, factor, klass"),
])
def test_bad_settings_are_refused(name, settings, message):
    with pytest.raises(ValueError, match=message):
        R.make(name, **settings)


@pytest.mark.parametrize("name", ["low_confidence", "dynamic", "margin", "entropy", "klass"])
def test_steps_must_fit_the_decode_shape(name):
    with pytest.raises(ValueError, match=r"steps=6 is not a multiple of the number of blocks \(4\)"):
        R.make(name, steps=6).bind(gen_length=32, block_length=8)
    with pytest.raises(ValueError, match=r"steps=64 > gen_length=32"):
        R.make(name, steps=64).bind(gen_length=32, block_length=8)
    with pytest.raises(ValueError, match="call bind"):
        R.make(name).quota(0)


@pytest.mark.parametrize("name", sorted(R.RULES))
def test_defaults_are_valid_and_the_documented_ones(name):
    want = {"low_confidence": {"steps": None}, "threshold": {"kappa": 0.9},
            "localleap": {"kappa": 0.9, "tau": 0.75, "radius": 4}, "factor": {"f": 1.0, "textbook": 0}, "eb": {"gamma": 0.01},
            "dynamic": {"threshold": 0.85, "steps": None},
            "margin": {"steps": None}, "entropy": {"steps": None},
            "klass": {"tau_c": 0.9, "tau_kl": 0.01, "history": 2, "steps": None}, "stable": {"k": 2, "c_min": 0.5}}
    assert R.make(name).settings == want[name]


def test_schedule_quota_matches_llada_by_hand():
    # get_num_transfer_tokens(block of 32, 5 steps): 32 = 5 * 6 + 2 -> 7, 7, 6, 6, 6
    q = [R.schedule_quota(s, steps=10, gen_length=64, block_length=32) for s in range(5)]
    assert q == [7, 7, 6, 6, 6]
    assert R.schedule_quota(0, steps=None, gen_length=64, block_length=32) == 1
    assert R.schedule_quota(9, steps=10, gen_length=64, block_length=32) == 6  # past the schedule: base


def test_entropy_and_margin_of_dyadic_distributions():
    p = np.array([[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    np.testing.assert_array_equal(R.margin_of(p), [0.25, 1.0, 0.0])
    np.testing.assert_allclose(R.entropy_of(p), [1.5 * math.log(2), 0.0, 2 * math.log(2)], rtol=1e-15)


def test_klass_kl_direction_is_current_given_previous():
    """KL(current || previous): ln 2 from (1/2, 1/2) to (1, 0), +inf the other way (a zero where the
    current distribution has mass)."""
    p, q = np.array([[1.0, 0.0]]), np.array([[0.5, 0.5]])
    with np.errstate(divide="ignore"):
        lp, lq = np.log(p), np.log(q)
    assert R.Klass.kl(p, lp, lq)[0] == math.log(2)
    assert R.Klass.kl(q, lq, lp)[0] == math.inf


def test_rules_keep_the_loop_contract_on_random_steps():
    """Every rule, every step: commits are candidates, at least one commits (the most confident, as top1,
    in the rules that rank by confidence),
    and a stateful rule's state stays per object (fresh copies do not share it)."""
    rng = np.random.default_rng(0)
    T, V = 8, 5
    rules = {name: R.make(name, **({"steps": 16} if name in ("low_confidence", "margin", "entropy", "klass") else {}))
             .bind(gen_length=32, block_length=T) for name in R.RULES}
    copies = {name: R.fresh(rule) for name, rule in rules.items()}
    for trial in range(200):
        if trial % 7 == 0:
            for rule in rules.values():
                rule.reset()
        logits = rng.normal(size=(T, V)) * rng.choice([0.5, 3.0, 10.0])
        probs = _softmax64(logits)
        pred, conf = probs.argmax(-1), probs.max(-1)
        cand = rng.random(T) < 0.6
        if not cand.any():
            continue
        top1 = max(np.flatnonzero(cand), key=lambda i: (conf[i], -i))
        for name, rule in rules.items():
            got = rule.select(trial % 7, cand, probs, pred, conf)
            assert set(got) <= set(np.flatnonzero(cand)) and got, name
            if rule.commits_top1:
                assert got[top1] == "top1", name
            assert set(got.values()) <= set(rule.clauses) | {R.FORCED}, name
    for name in ("klass", "stable"):
        assert copies[name].run is None  # never touched by the original's passes


# ------------------------------------------------------------------------------------------------ eager_generate

PROMPTS = [[5, 17, 42, 99, 7], [120, 3, 3, 250, 11, 64, 8, 31, 200], [77, 12, 150]]



@pytest.fixture(scope="module")
def sharp_torch(tiny_tokenizer):
    """The sharp random model of test_decode.py (same seed and head scale), as the torch oracle only."""
    from helpers import random_llada_tensors, tiny_hf_config
    from oracles import bidirectional as reference_torch

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id, n_layers=2)
    model = reference_torch.llama_from_llada(cfg, random_llada_tensors(cfg, seed=11, head_scale=20.0))
    return model, cfg, tok


def _generate(sharp, prompt, **kw):
    import torch
    from oracles import bidirectional as reference_torch

    model, cfg, tok = sharp
    return reference_torch.eager_generate(model, torch.tensor([prompt]), mask_id=cfg["mask_token_id"],
                                          eos_id=cfg["eos_token_id"], eot_id=None, **kw)


@pytest.mark.parametrize("name", sorted(EVERY_RULE))
def test_eager_generate_runs_every_rule_and_counts_every_clause(sharp_torch, name):
    G, T = 32, 8
    stats = {}
    rule = R.make(name, **EVERY_RULE[name])
    for prompt in PROMPTS:
        trace = {}
        x, nfe = _generate(sharp_torch, prompt, rule=rule, gen_length=G, block_length=T, stats=stats, trace=trace)
        gen = x[0, len(prompt):].numpy()
        assert (gen != sharp_torch[1]["mask_token_id"]).all()
        passes = len(trace["pred"][0])
        assert passes == nfe[0] and len(trace["commits"][0]) == passes
        # The trace replays the decode: each pass's commits were masked, include that pass's most
        # confident masked position of the block, and hold the pass's prediction in the final tokens.
        masked = np.ones(G, bool)
        for s in range(passes):
            commits, conf, pred = trace["commits"][0][s], trace["conf"][0][s], trace["pred"][0][s]
            b = trace["block"][0][s]
            blk = np.zeros(G, bool)
            blk[b * T:(b + 1) * T] = True
            cand = np.flatnonzero(masked & blk)
            top1 = max(cand, key=lambda i: (conf[i], -i))
            assert commits and set(commits) <= set(cand)
            if rule.commits_top1:
                assert commits[top1] == "top1"
            for i in commits:
                assert gen[i] == pred[i]
            masked[list(commits)] = False
        assert not masked.any()
    print(name, stats)
    clause_counts = {c: stats.get(c, 0) for c in rule.clauses}
    assert all(n > 0 for n in clause_counts.values()), clause_counts
    assert sum(stats.get(c, 0) for c in {*rule.clauses, R.FORCED}) == G * len(PROMPTS)  # each position once


def test_old_strategy_names_and_rule_objects_decode_the_same(sharp_torch):
    for strategy, settings in [("low_confidence", dict(steps=16)), ("threshold", dict(kappa=0.7)),
                               ("localleap", dict(kappa=0.85, tau=0.6, radius=2))]:
        for prompt in PROMPTS:
            a, na = _generate(sharp_torch, prompt, strategy=strategy, gen_length=32, block_length=8, **settings)
            b, nb = _generate(sharp_torch, prompt, rule=R.make(strategy, **settings), gen_length=32, block_length=8)
            assert (a == b).all() and na == nb


def test_dream_shift_scores_position_i_with_hidden_i_minus_1(sharp_torch):
    """shift=1: the first pass predicts generated position i from the canvas logits at P + i - 1."""
    import torch
    from oracles import bidirectional as reference_torch

    model, cfg, _ = sharp_torch
    prompt = PROMPTS[1]
    P, G = len(prompt), 16
    canvas = torch.tensor([prompt + [cfg["mask_token_id"]] * G])
    want = reference_torch.bidirectional_logits(model, canvas)[0].double().argmax(-1).numpy()
    for shift, offset in ((0, 0), (1, -1)):
        trace = {}
        _generate(sharp_torch, prompt, strategy="threshold", gen_length=G, block_length=8, shift=shift, trace=trace)
        np.testing.assert_array_equal(trace["pred"][0][0], want[P + offset:P + offset + G])
    assert (want[P - 1:P - 1 + G] != want[P:P + G]).any()  # the shift really changes the predictions


def test_vocab_limit_is_never_predicted(sharp_torch):
    model, cfg, tok = sharp_torch
    free = _generate(sharp_torch, PROMPTS[0], strategy="threshold", gen_length=32, block_length=8)[0][0, 5:]
    limit = int(np.median(free.numpy()))  # half the tokens the unrestricted decode chose lie at or above it
    assert (free.numpy() >= limit).any()
    cut = _generate(sharp_torch, PROMPTS[0], strategy="threshold", gen_length=32, block_length=8,
                    vocab_limit=limit)[0][0, 5:]
    assert (cut.numpy() < limit).all()
