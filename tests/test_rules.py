"""The JAX rules one step at a time, against plain readings of their definitions (per row, in Python).

Random steps come from hypothesis (derandomised: the same examples every run, see conftest.py), and the
boundaries come as fixed @examples, so that a property is decided on every run, not when a draw is lucky.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, strategies as st
from hypothesis.extra.numpy import arrays

import localleap_jax as ll
from localleap_jax import rules as R

B, T, V = 3, 12, 6


def signals(conf=None, cand=None, *, logits=None, step=0, gen_length=48):
    """Signals for one step. With `logits`, pred/conf come from them (as the loop computes them)."""
    if logits is not None:
        logits = jnp.asarray(logits, jnp.float32)
        pred = jnp.argmax(logits, -1).astype(jnp.int32)
        p = jax.nn.softmax(logits, -1)
        conf = jnp.take_along_axis(p, pred[..., None], -1)[..., 0]
    else:
        conf = jnp.asarray(conf, jnp.float32)
        pred = jnp.zeros(conf.shape, jnp.int32)
        logits = jnp.zeros(conf.shape + (V,), jnp.float32)
    cand = jnp.ones(conf.shape, bool) if cand is None else jnp.asarray(cand)
    return R.Signals(logits=logits, pred=pred, conf=conf, candidates=cand,
                     step=jnp.full((conf.shape[0],), step, jnp.int32), gen_length=gen_length, block_length=conf.shape[1])


def commits(rule, s, state=None):
    state = rule.init(s.conf.shape[0], s.conf.shape[1], V) if state is None else state
    code, _ = rule.update(s, state)
    return np.asarray(code) > 0


def top1(conf, cand):
    """The most confident candidate of a row (lowest index on ties), or None."""
    idx = [i for i in range(len(conf)) if cand[i]]
    return max(idx, key=lambda i: (conf[i], -i)) if idx else None


confs = arrays(np.float32, (B, T), elements=st.floats(0, 1, width=32, allow_subnormal=False))
cands = arrays(np.bool_, (B, T))
kappas = st.floats(0.0625, 1.0, width=32)
# Boundaries every run: values exactly at kappa and tau, an anchor exactly `radius` away on each side.
EDGE_CONF = np.array([[0.5, 0.75, 0.9, 0.75, 0.5, 0.5, 0.75, 0.75, 0.2, 0.9, 0.5, 0.75]] * B, np.float32)
EDGE_CAND = np.ones((B, T), bool)


@given(confs, cands, kappas, st.floats(0.015625, 1.0, width=32), st.integers(0, 14))
@example(EDGE_CONF, EDGE_CAND, 0.9, 0.75, 2)
@example(EDGE_CONF, EDGE_CAND, 0.9, 0.75, 1)
@example(EDGE_CONF, EDGE_CAND, 0.9, 0.75, 0)
@example(EDGE_CONF, EDGE_CAND, 0.75, 0.75, 3)
def test_localleap_is_the_rule_as_written(conf, cand, kappa, tau, radius):
    tau = min(tau, kappa)
    got = commits(ll.rule("localleap", kappa=kappa, tau=tau, radius=radius), signals(conf, cand))
    kappa32, tau32 = np.float32(kappa), np.float32(tau)  # settings enter the program as float32
    for r in range(B):
        idx = [i for i in range(T) if cand[r, i]]
        anchors = [j for j in idx if conf[r, j] >= kappa32]
        want = {i for i in idx if conf[r, i] >= tau32 and any(abs(i - j) <= radius for j in anchors)}
        want |= set(anchors) | ({top1(conf[r], cand[r])} - {None})
        assert set(np.flatnonzero(got[r])) == want, r


def test_the_edge_example_hits_every_boundary():
    """The fixed example above really sits on the boundaries (so the @examples decide them)."""
    r = EDGE_CONF[0]
    leap = np.flatnonzero(commits(ll.rule("localleap", kappa=0.9, tau=0.75, radius=2), signals(EDGE_CONF))[0])
    assert r[2] == 0.9 and 2 in leap  # conf == kappa is an anchor
    assert r[3] == 0.75 and 3 in leap  # conf == tau next to an anchor
    assert 0 not in leap and 4 not in leap  # 0.5 < tau beside it
    assert r[7] == 0.75 and abs(7 - 9) == 2 and 7 in leap  # exactly `radius` to the left of the anchor at 9
    assert r[11] == 0.75 and abs(11 - 9) == 2 and 11 in leap  # exactly `radius` to the right
    assert r[6] == 0.75 and abs(6 - 9) == 3 and 6 not in leap  # radius + 1
    one = np.flatnonzero(commits(ll.rule("localleap", kappa=0.9, tau=0.75, radius=1), signals(EDGE_CONF))[0])
    assert 7 not in one and 11 not in one and 3 in one


@given(confs, cands, kappas, st.floats(0.015625, 1.0, width=32), st.integers(0, 5))
@example(EDGE_CONF, EDGE_CAND, 0.9, 0.75, 2)
def test_top1_within_threshold_within_localleap(conf, cand, kappa, tau, radius):
    tau = min(tau, kappa)
    s = signals(conf, cand)
    top = np.asarray(R.most_confident(s.conf, s.candidates))
    thr = commits(ll.rule("threshold", kappa=kappa), s)
    leap = commits(ll.rule("localleap", kappa=kappa, tau=tau, radius=radius), s)
    assert not (top & ~thr).any() and not (thr & ~leap).any()
    assert not (leap & ~cand).any()
    assert (thr.any(1) == cand.any(1)).all()
    zero = commits(ll.rule("localleap", kappa=kappa, tau=tau, radius=0), s)
    np.testing.assert_array_equal(zero, thr)  # W = 0: no neighbourhood, plain threshold decoding


@given(arrays(np.bool_, (B, T)), arrays(np.int32, (B,), elements=st.integers(0, 2 * T)))
@example(np.eye(B, T, 5, dtype=bool), np.array([0, 1, 30], np.int32))
def test_near_any_is_the_distance_to_the_nearest_mark(marks, radius):
    got = np.asarray(R.near_any(jnp.asarray(marks), jnp.asarray(radius)))
    for r in range(B):
        at = np.flatnonzero(marks[r])
        want = [bool(len(at)) and int(np.min(np.abs(at - i))) <= radius[r] for i in range(T)]
        assert got[r].tolist() == want


@given(confs, cands, arrays(np.int32, (B,), elements=st.sampled_from([1, 2, 3, 4, 6, 12])), st.integers(0, 11))
def test_low_confidence_commits_its_quota_of_the_most_confident(conf, cand, per_block_steps, step):
    steps = per_block_steps * 4  # gen 48 = 4 blocks of 12
    s = signals(conf, cand, step=step)
    got = commits(ll.rule("low_confidence", steps=steps), s)
    for r in range(B):
        spb = int(per_block_steps[r])
        quota = T // spb + (step < T % spb)  # LLaDA's get_num_transfer_tokens
        ranked = sorted(np.flatnonzero(cand[r]), key=lambda i: (-conf[r, i], i))
        assert set(np.flatnonzero(got[r])) == set(ranked[:quota]), r


def test_schedule_quota_spreads_the_block_with_the_remainder_first():
    s = signals(np.zeros((1, 12)), gen_length=48)  # 4 blocks of 12
    quotas = [int(signals(np.zeros((1, 12)), step=k).quota(20)[0]) for k in range(5)]  # 5 steps per block
    assert quotas == [3, 3, 2, 2, 2] and sum(quotas) == 12
    assert int(s.quota(None)[0]) == 1


def get_transfer_index_dynamic(conf_row, cand_row, factor):
    """NVlabs/Fast-dLLM llada/generate.py's loop for one row, as written (thresholds in float32, as ours)."""
    sorted_conf = sorted((conf_row[i] for i in np.flatnonzero(cand_row)), reverse=True)
    ns = list(range(1, len(sorted_conf) + 1))
    threshs = [np.float32(1) - np.float32(factor) / np.float32(n + 1) for n in ns]
    threshs[0] = -1
    for top_i in range(len(threshs)):
        if sorted_conf[top_i] < threshs[top_i]:
            break
    if top_i == 0 or top_i == len(threshs) - 1:
        top_i += 1
    return top_i


LAST_FAILS = (np.array([[0.9, 0.8, 0.75, 0.5] + [0.0] * 8] * B, np.float32), np.array([[True] * 4 + [False] * 8] * B))


@given(confs, cands, st.floats(0.0625, 4.0, width=32))
@example(*LAST_FAILS, 1.0)  # ranks 2, 3 pass (0.75 == 1 - 1/4), the last (0.5 < 0.8) fails: the authors commit all 4
@example(np.array([[0.9, 0.1] + [0.0] * 10] * B, np.float32), np.array([[True] * 2 + [False] * 10] * B), 1.0)
def test_factor_is_fast_dllms_get_transfer_index_dynamic(conf, cand, f):
    """Default: the authors' code (a failing last candidate commits); textbook=1: the longest passing prefix."""
    got = commits(ll.rule("factor", f=f), signals(conf, cand))
    textbook = commits(ll.rule("factor", f=f, textbook=1), signals(conf, cand))
    f32 = np.float32(f)
    for r in range(B):
        ranked = sorted(np.flatnonzero(cand[r]), key=lambda i: (-conf[r, i], i))
        if not ranked:
            assert not got[r].any() and not textbook[r].any()
            continue
        assert set(np.flatnonzero(got[r])) == set(ranked[:get_transfer_index_dynamic(conf[r], cand[r], f)]), r
        n = 0
        for i, pos in enumerate(ranked, start=1):  # 1-indexed rank
            if i > 1 and conf[r, pos] < np.float32(1) - f32 / np.float32(i + 1):
                break
            n = i
        assert set(np.flatnonzero(textbook[r])) == set(ranked[:n]), r


def test_factor_boundary_example_commits_all_four_as_the_authors_and_three_textbook():
    conf = np.array([[0.9, 0.8, 0.75, 0.5]], np.float32)
    assert commits(ll.rule("factor", f=1.0), signals(conf))[0].tolist() == [True, True, True, True]
    assert commits(ll.rule("factor:f=1,textbook=1"), signals(conf))[0].tolist() == [True, True, True, False]
    assert commits(ll.rule("factor", f=0.99), signals(conf))[0].tolist() == [True, True, False, False]


logit_rows = arrays(np.float32, (B, T, V), elements=st.floats(-4, 4, width=32))


@given(logit_rows, cands, st.sampled_from([12, 24, 48]), st.integers(0, 3))
def test_margin_and_entropy_rank_by_their_own_signal(logits, cand, steps, step):
    s = signals(logits=logits, cand=cand, step=step)
    p = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1), np.float64)
    top2 = np.sort(p, -1)[..., ::-1][..., :2]
    margin = top2[..., 0] - top2[..., 1]
    entropy = -(p * np.log(p)).sum(-1)
    quota = int(s.quota(steps)[0])
    for name, score in (("margin", margin), ("entropy", -entropy)):
        got = commits(ll.rule(name, steps=steps), s)
        for r in range(B):
            ranked = sorted(np.flatnonzero(cand[r]), key=lambda i: (-score[r, i], i))
            want = set(ranked[:quota])
            if set(np.flatnonzero(got[r])) != want:  # float32 vs float64 ties: only a near-tie may differ
                diff = set(np.flatnonzero(got[r])) ^ want
                gap = max(abs(score[r, i] - score[r, ranked[quota - 1]]) for i in diff)
                assert gap < 1e-5, (name, r)


@given(logit_rows, cands, st.floats(0.0, 3.0, width=32))
def test_eb_commits_the_lowest_entropy_prefix_within_gamma(logits, cand, gamma):
    s = signals(logits=logits, cand=cand)
    ent = np.asarray(s.entropy, np.float64)
    got = commits(ll.rule("eb", gamma=gamma), s)
    for r in range(B):
        ranked = sorted(np.flatnonzero(cand[r]), key=lambda i: (ent[r, i], i))
        before = np.concatenate([[0.0], np.cumsum([ent[r, i] for i in ranked])[:-1]])  # sum minus the max
        want = {pos for pos, b in zip(ranked, before) if b <= gamma}
        for pos in set(np.flatnonzero(got[r])) ^ want:  # float32 sums may differ only at the budget itself
            assert abs(before[ranked.index(pos)] - gamma) < 1e-5, r


def test_eb_budget_boundary():
    # A uniform distribution over k ids has entropy log k: entropies log 1, 2, 2, 4, exactly placed.
    logits = np.full((1, 4, V), -1e9, np.float32)
    for t, k in enumerate([1, 2, 2, 4]):
        logits[0, t, :k] = 0.0
    s = signals(logits=logits)
    ent = np.asarray(s.entropy)[0]
    assert ent[0] == 0.0 and ent[1] == ent[2]
    np.testing.assert_allclose(ent, np.log([1, 2, 2, 4]), rtol=1e-6)
    # Before-sums in entropy order: 0, 0, log 2, 2 log 2. A budget of exactly log 2 takes three.
    assert commits(ll.rule("eb", gamma=float(ent[1])), s)[0].tolist() == [True, True, True, False]
    assert commits(ll.rule("eb", gamma=float(np.nextafter(ent[1], 0))), s)[0].tolist() == [True, True, False, False]


def test_stable_commits_after_k_equal_predictions_at_c_min():
    rule = ll.rule("stable", k=2, c_min=0.5)
    state = rule.init(1, 4, V)
    logits = np.zeros((1, 4, V), np.float32)
    logits[0, :, 1] = [3.0, 3.0, 3.0, 0.5]  # position 3's prediction is a near-tie
    s = signals(logits=logits)
    code, state = rule.update(s, state)
    assert (np.asarray(code) > 0).tolist() == [[True, False, False, False]]  # first step: only the top one
    code, state = rule.update(s, state)
    conf = np.asarray(s.conf)[0]
    want = [True, True, True, bool(conf[3] >= 0.5)]
    assert (np.asarray(code) > 0)[0].tolist() == want
    assert np.asarray(state.run)[0].tolist() == [2, 2, 2, 2]


def test_per_row_settings_equal_scalar_settings_row_by_row():
    conf = np.random.RandomState(0).uniform(0, 1, (B, T)).astype(np.float32)
    s = signals(conf)
    rows = ll.rule("localleap", kappa=[0.6, 0.8, 0.95], tau=[0.5, 0.6, 0.7], radius=[0, 2, 5]).with_rows(B)
    got = commits(rows, s)
    for r, (k, t, w) in enumerate([(0.6, 0.5, 0), (0.8, 0.6, 2), (0.95, 0.7, 5)]):
        one = commits(ll.rule("localleap", kappa=k, tau=t, radius=w), signals(conf[r:r + 1]))
        np.testing.assert_array_equal(got[r], one[0])


def test_combinators_thread_their_sub_states():
    both = ll.any_of(ll.rule("threshold", kappa=0.95), ll.rule("stable", k=2, c_min=0.0))
    state = both.init(1, 4, V)
    assert isinstance(state, tuple) and len(state) == 2 and state[0] == ()
    s = signals(np.array([[0.96, 0.5, 0.5, 0.5]], np.float32))
    code, state = both.update(s, state)
    assert (np.asarray(code)[0] > 0).tolist() == [True, False, False, False]
    code, state = both.update(s, state)  # second step: stable's runs reach 2
    assert (np.asarray(code)[0] > 0).tolist() == [True, True, True, True]
    names = [both.clause_names[c - 1] for c in np.asarray(code)[0]]
    assert names == ["threshold.top1", "stable.stable", "stable.stable", "stable.stable"]
    every = ll.all_of(ll.rule("threshold", kappa=0.95), ll.rule("stable", k=1, c_min=0.0))
    assert (commits(every, s)[0]).tolist() == [True, False, False, False]
    # The first sub-rule commits all four, the second only its top one: all_of keeps the one both commit.
    lax_first = ll.all_of(ll.rule("threshold", kappa=0.4), ll.rule("stable", k=1, c_min=0.9))
    assert (commits(lax_first, s)[0]).tolist() == [True, False, False, False]


@pytest.mark.parametrize("spec, message", [
    ("localleap:kappa=1.5", r"kappa=1.5 must lie in \(0, 1\]"),
    ("localleap:radius=2.5", "radius=2.5 must be a whole number"),
    ("localleap:radius=-1", r"radius=-1 must lie in \[0, inf\)"),
    ("localleap:tau=0.95", "tau=0.95 > kappa=0.9"),
    ("threshold:kapa=0.8", "threshold has no setting kapa; its settings: kappa"),
    ("greedy", "unknown strategy 'greedy'"),
    ("eb:gamma", "has no '='"),
    ("eb:gamma=lots", "'lots' is not a number"),
    ("stable:k=0", r"k=0 must lie in \[1, inf\)"),
    ("factor:f=0", r"f=0 must lie in \(0, inf\)"),
    ("factor:textbook=2", r"textbook=2 must lie in \[0, 1\]"),
])
def test_bad_rule_settings_are_named(spec, message):
    with pytest.raises(ll.DecodeError, match=message):
        ll.rule(spec).validate(48, 12)


def test_specs_round_trip_and_split():
    r = ll.rule("localleap:kappa=0.8,tau=0.7")
    assert r.spec() == "localleap:kappa=0.8,radius=4,tau=0.7" and ll.rule(r.spec()) == r
    assert R.split_specs("localleap:kappa=0.8,tau=0.7,threshold,eb:gamma=0.1") == [
        "localleap:kappa=0.8,tau=0.7", "threshold", "eb:gamma=0.1"]
    assert ll.rule("threshold:kappa=[0.8;0.9]").kappa == [0.8, 0.9]


# ---------------------------------------------------------------- the hand-computed boundary table

from rule_cases import CASES, expected_mask, signals as case_signals  # noqa: E402


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_rule_on_the_hand_computed_boundary_cases(case):
    """tests/rule_cases.py: every boundary of every rule, computed by hand, pass by pass (state included)."""
    rule = ll.rule(case.rule, **case.settings).validate(case.gen_length, case.block_length or case.T)
    state = None
    for step, s_in_block in zip(case.steps, case.step_indices()):
        given = case_signals(step)
        V_case = 2 if given["logits"] is None else given["logits"].shape[-1]
        if state is None or step.new_block:
            state = rule.init(1, case.T, V_case)
        logits = np.zeros((case.T, V_case)) if given["logits"] is None else given["logits"]
        s = R.Signals(logits=jnp.asarray(logits[None], jnp.float32), pred=jnp.asarray(given["pred"][None], jnp.int32),
                      conf=jnp.asarray(given["conf"][None], jnp.float32),
                      candidates=jnp.asarray(given["candidates"][None]),
                      step=jnp.asarray([s_in_block], jnp.int32), gen_length=case.gen_length,
                      block_length=case.block_length or case.T)
        for name in ("margin", "entropy"):  # given exactly, as the table says, instead of from logits
            if given[name] is not None:
                setattr(s, name, jnp.asarray(given[name][None], jnp.float32))
        if step.quota is not None:
            assert int(s.quota(case.settings.get("steps"))[0]) == step.quota, "the schedule quota"
        code, state = rule.update(s, state)
        code = np.asarray(code)[0]
        np.testing.assert_array_equal(code > 0, expected_mask(step), err_msg=f"{case.id}: {case.note}")
        assert {i: rule.clause_names[code[i] - 1] for i in np.flatnonzero(code)} == step.expect, case.id


DINFER = ("credit", "hierarchy", "smooth")


def test_the_table_reaches_every_clause_of_every_rule():
    reached = {(c.rule, clause) for c in CASES for st in c.steps for clause in st.expect.values()}
    for name in R.RULES:
        if ll.rule(name).remask_names:  # rules that take commits back: test_revoking.py, against their authors' loops
            continue
        if ll.rule(name).edit_names:  # rules that edit: test_joint_threshold.py, against SGLang's loop
            continue
        if ll.rule(name).canvas:  # canvas rules (no masks): test_diffusion_gemma.py, against transformers' sampler
            continue
        if name in DINFER:  # dInfer's decoders: their boundaries by hand in test_dinfer.py, and against dInfer's loop
            continue
        for clause in ll.rule(name).clause_names:
            assert (name, clause) in reached, (name, clause)


def test_a_per_row_kappa_below_the_default_tau_names_the_offending_rows():
    import numpy as np

    with pytest.raises(ll.DecodeError, match=r"\(row 0: tau 0.75 > kappa 0.7\); pass tau per row too"):
        ll.DecodeConfig(strategy=ll.rule("localleap", kappa=np.array([0.7, 0.8, 0.9, 0.95]))).validate()
    kappa = np.array([0.7, 0.8, 0.9, 0.95])  # what the message suggests runs
    ll.DecodeConfig(strategy=ll.rule("localleap", kappa=kappa, tau=np.minimum(0.75, kappa))).validate()
