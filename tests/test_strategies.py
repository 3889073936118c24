"""Properties of the commit rules on random steps (hypothesis), and the rule against its plain reading."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from localleap_jax import strategies as S

B, T = 3, 12


@st.composite
def steps(draw):
    conf = draw(arrays(np.float32, (B, T), elements=st.floats(0, 1, width=32, allow_subnormal=False)))  # XLA flushes subnormals
    cand = draw(arrays(np.bool_, (B, T)))
    kappa = draw(st.floats(0.05, 1.0))
    tau = draw(st.floats(0.01, 1.0).filter(lambda t: t <= kappa) | st.just(kappa))
    radius = draw(st.integers(0, 5))
    quota = draw(arrays(np.int32, (B,), elements=st.integers(1, T)))
    return conf, cand, S.RuleParams(kappa, min(tau, kappa), radius, jnp.asarray(quota))


def _commit(name, conf, cand, p):
    return np.asarray(S.get(name)(jnp.asarray(conf), jnp.asarray(cand), p))


@settings(max_examples=150, deadline=None)
@given(steps())
def test_commits_are_candidates_and_every_row_with_candidates_commits(step):
    conf, cand, p = step
    for name in S.STRATEGIES:
        commit = _commit(name, conf, cand, p)
        assert not (commit & ~cand).any(), name
        assert (commit.any(axis=1) == cand.any(axis=1)).all(), name


@settings(max_examples=150, deadline=None)
@given(steps())
def test_localleap_commits_a_superset_of_threshold_which_commits_a_superset_of_top1(step):
    conf, cand, p = step
    top1 = np.asarray(S.most_confident(jnp.asarray(conf), jnp.asarray(cand)))
    thr = _commit("threshold", conf, cand, p)
    leap = _commit("localleap", conf, cand, p)
    assert not (top1 & ~thr).any() and not (thr & ~leap).any()
    assert top1.sum(axis=1).max(initial=0) <= 1


@settings(max_examples=100, deadline=None)
@given(steps())
def test_radius_zero_makes_localleap_threshold(step):
    conf, cand, p = step
    p = p._replace(radius=0)
    np.testing.assert_array_equal(_commit("localleap", conf, cand, p), _commit("threshold", conf, cand, p))


@settings(max_examples=100, deadline=None)
@given(steps())
def test_low_confidence_commits_exactly_its_quota_of_the_most_confident(step):
    conf, cand, p = step
    commit = _commit("low_confidence", conf, cand, p)
    quota = np.asarray(p.quota)
    for r in range(B):
        k = min(int(quota[r]), int(cand[r].sum()))
        assert commit[r].sum() == k
        if 0 < k < cand[r].sum():
            assert conf[r][commit[r]].min() >= conf[r][cand[r] & ~commit[r]].max()


@settings(max_examples=150, deadline=None)
@given(steps())
def test_localleap_matches_the_rule_as_written(step):
    conf, cand, p = step
    commit = _commit("localleap", conf, cand, p)
    for r in range(B):
        idx = [i for i in range(T) if cand[r, i]]
        want = set()
        if idx:
            want.add(max(idx, key=lambda i: (conf[r, i], -i)))
        anchors = [j for j in idx if conf[r, j] >= p.kappa]
        want |= set(anchors)
        want |= {i for i in idx if conf[r, i] >= p.tau and any(abs(i - j) <= p.radius for j in anchors)}
        assert set(np.flatnonzero(commit[r])) == want


def test_registering_a_new_rule_is_one_function():
    @S.register("_test_everything")
    def everything(conf, candidates, p):
        return candidates
    try:
        conf = jnp.full((1, 4), 0.1)
        cand = jnp.array([[True, False, True, True]])
        assert np.asarray(S.get("_test_everything")(conf, cand, None)).tolist() == [[True, False, True, True]]
    finally:
        del S.STRATEGIES["_test_everything"]
