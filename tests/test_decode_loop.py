"""The decode loop's bookkeeping on a weightless stub denoiser (tests/stubs.py): milliseconds, no torch.

Each test scripts predictions and confidences so that the case it names must happen, asserts that it
did (from the trace or the tokens), and would fail on the bug it is about.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

import localleap_jax as ll
from localleap_jax import decode
from localleap_jax.compile_cache import compiled_programs
from stubs import EOS, MASK, WORD, config, prompts, scripted

G, T = 12, 4  # 3 blocks


def _words(batch, seed=0):
    return np.random.RandomState(seed).randint(WORD, MASK, (batch, G))


def test_blocks_decode_left_to_right_and_only_inside_the_current_block():
    # Confidence rises to the right, so a rule free to choose would commit the last block first.
    conf = np.linspace(0.3, 0.7, G)[None].repeat(2, 0)
    model = scripted(_words(2), conf)
    out = ll.generate(model, *prompts(2), ll.DecodeConfig(strategy="low_confidence", gen_length=G, block_length=T),
                      trace=True)
    cp = out.trace.commit_pass
    for b in range(G // T - 1):
        assert cp[:, b * T:(b + 1) * T].max() < cp[:, (b + 1) * T:(b + 2) * T].min()
    # one token per pass, most confident first: inside each block right to left
    np.testing.assert_array_equal(cp[0], [3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8])
    assert (out.nfe == G).all() and out.forward_passes == G


def test_nfe_counts_passes_until_each_row_is_done():
    # Row 0: every confidence over kappa, one pass per block. Row 1: all under, one token per pass.
    conf = np.stack([np.full(G, 0.95), np.full(G, 0.5)])
    model = scripted(_words(2), conf)
    out = ll.generate(model, *prompts(2), ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T))
    np.testing.assert_array_equal(out.nfe, [G // T, G])
    assert out.forward_passes == G  # the batch runs until its slowest row is done


def test_sampling_draws_fresh_noise_at_every_pass():
    """With temperature > 0, each pass samples with its own key: a position of the block still masked at two
    passes is predicted from independent draws (a flat distribution over the 7 predictable ids: they differ with
    probability 6/7); the same key at every pass would repeat every prediction."""
    model = scripted(_words(4), np.full((4, G), 1.0 / 8))  # every id equally likely: one commit per pass
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T, temperature=1.0)
    trace = ll.generate(model, *prompts(4), cfg, rng=jax.random.key(3), trace=True).trace
    pred, committed = trace.pred, trace.committed
    masked = (np.cumsum(committed, axis=1) - committed) == 0  # masked when pass s began
    valid = (np.arange(pred.shape[1])[None, :] < trace.passes[:, None])[:, :, None]  # passes the row ran
    block = np.argmax(committed, axis=2) // T  # the block each pass worked on (every pass commits in it)
    in_block = (np.arange(G) // T)[None, None, :] == block[:, :, None]  # sampled there; greedy elsewhere
    ok = masked & valid & in_block
    pairs = ok[:, 1:] & ok[:, :-1]  # masked and sampled at passes s and s + 1
    assert pairs.sum() == 4 * (G // T) * (T - 1) * T // 2  # the case: one commit per pass, 3+2+1 pairs a block
    differ = (pred[:, 1:] != pred[:, :-1])[pairs]
    assert differ.mean() > 0.6, (differ.mean(), differ.size)


@pytest.mark.parametrize("shift", [0, 1])
def test_the_trace_records_each_positions_own_prediction_with_or_without_the_shift(shift):
    """The stub predicts target[b, j] at generated position j whatever the canvas holds (for a Dream-like
    model, from the hidden state at j - 1): every traced prediction, inside the block and outside it, must
    be target[b, j] at position j."""
    words = _words(2)
    words[:, ::3] = WORD + 5  # neighbours differ: reading position j + 1's or j - 1's scores shows
    model = scripted(words, np.full((2, G), 0.6), shift=shift)
    out = ll.generate(model, *prompts(2), ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T),
                      trace=True)
    valid = np.arange(G)[None, :] < out.trace.passes[:, None]  # S = G here
    assert valid.sum() == 2 * G  # the case: one commit per pass, so G passes per row
    for b in range(2):
        np.testing.assert_array_equal(out.trace.pred[b][valid[b]], np.broadcast_to(words[b], (G, G)))


def test_early_stop_fills_eos_and_rows_stop_at_different_blocks():
    words = _words(3)
    words[0, 1] = EOS  # row 0 emits EOS in block 0
    words[1, T + 2] = EOS  # row 1 in block 1; row 2 never
    model = scripted(words, np.full((3, G), 0.95))
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T, early_stop=True)
    out = ll.generate(model, *prompts(3), cfg)
    gen = out.tokens[:, out.prompt_length:]
    np.testing.assert_array_equal(out.nfe, [1, 2, 3])  # one pass per block, stopped after blocks 0, 1, 2
    assert (gen[0, T:] == EOS).all() and (gen[1, 2 * T:] == EOS).all()
    np.testing.assert_array_equal(gen[0, :T], words[0, :T])
    np.testing.assert_array_equal(gen[2], words[2])
    without = ll.generate(model, *prompts(3), dataclasses.replace(cfg, early_stop=False))
    np.testing.assert_array_equal(without.tokens[:, out.prompt_length:], words)  # the stop changed something
    assert (without.nfe == 3).all()


def test_early_stop_fills_only_after_the_block_is_full():
    """An EOS committed while its block still has masks must not fill the canvas after the block yet: the
    passes that finish the block see masks there. The stub predicts WORD + 1 while the canvas's last position
    is masked and WORD + 2 once it is not, so an early fill changes the block's remaining tokens."""
    import jax.numpy as jnp

    from localleap_jax.denoiser import FunctionDenoiser
    from stubs import StubModel, V, config, log_probs

    first = jnp.asarray(log_probs(EOS, 0.99))  # block position 0: EOS, commits first
    rest = [jnp.asarray(log_probs(WORD + k, 0.5)) for k in (1, 2)]

    def logits_fn(x):
        B, L = x.shape
        other = jnp.where((x[:, -1] == MASK)[:, None], rest[0], rest[1])  # [B, V]
        lp = jnp.broadcast_to(other[:, None, :], (B, L, V)).at[:, L - G].set(first)
        return lp

    model = StubModel(config(), FunctionDenoiser(logits_fn, V))
    cfg = ll.DecodeConfig(strategy=ll.rule("low_confidence", steps=G), gen_length=G, block_length=T, early_stop=True)
    out = ll.generate(model, *prompts(1), cfg, trace=True)
    gen = out.tokens[0, out.prompt_length:]
    assert np.argmax(out.trace.committed[0, :, 0]) == 0 and out.nfe[0] == T  # the case: EOS first, 3 passes after
    np.testing.assert_array_equal(gen, [EOS] + [WORD + 1] * (T - 1) + [EOS] * (G - T))


def test_rule_state_resets_when_a_row_enters_a_new_block():
    """`stable` (k=2) needs the same prediction twice: with its state reset at each block, every block
    takes exactly two passes. Predictions repeat per block offset, so a state carried over from the
    previous block would let blocks after the first finish in one pass."""
    words = np.tile(_words(1)[:, :T], (1, G // T))
    model = scripted(words, np.full((1, G), 0.6))
    cfg = ll.DecodeConfig(strategy=ll.rule("stable", k=2, c_min=0.5), gen_length=G, block_length=T)
    out = ll.generate(model, *prompts(1), cfg, trace=True)
    assert out.nfe[0] == 2 * (G // T)
    names = out.trace.clause_names
    per_pass = [sorted({names[c - 1] for c in out.trace.clause[0, s] if c}) for s in range(out.nfe[0])]
    assert per_pass == [["top1"], ["stable", "top1"]] * (G // T)  # clause order: top1 names the best one


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_refreshes_once_per_block_even_after_a_row_has_finished(cache):
    words = _words(2)
    words[0, 0] = EOS  # row 0 finishes after block 0 (early stop); row 1 goes on through all 3 blocks
    conf = np.full((2, G), 0.6)
    cfg = ll.DecodeConfig(strategy="low_confidence", gen_length=G, block_length=T, cache=cache, early_stop=True)
    out = ll.generate(scripted(words, conf), *prompts(2), cfg)
    np.testing.assert_array_equal(out.nfe, [T, G])
    assert out.full_passes == G // T  # a refresh at every block start, for the rows still working
    # The stub's "cache" is the canvas at the last refresh: a stale one would show in the tokens.
    np.testing.assert_array_equal(out.tokens[1, out.prompt_length:], words[1])


def test_with_a_cache_a_rows_trace_does_not_depend_on_its_batch():
    """With a cache each row refreshes at its own block starts, so a row that needs fewer passes finishes first and
    the batch runs on for the other. Its trace is indexed by its own passes (its NFE), not the batch's: the same as
    run alone."""
    conf = np.stack([np.full(G, 0.95), np.full(G, 0.6)])  # row 0: a pass per block; row 1: one token per pass
    words = _words(2)
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T, cache="prefix")
    batch = ll.generate(scripted(words, conf), *prompts(2), cfg, trace=True)
    assert batch.forward_passes > batch.nfe[0]  # the case: the batch ran passes in which row 0 did not work
    for r in range(2):
        alone = ll.generate(scripted(words[r:r + 1], conf[r:r + 1]), *prompts(1), cfg, trace=True).trace
        n = int(alone.passes[0])
        assert batch.trace.passes[r] == n
        np.testing.assert_array_equal(batch.trace.committed[r, :n], alone.committed[0, :n])
        np.testing.assert_array_equal(batch.trace.pred[r, :n], alone.pred[0, :n])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_cached_pass_sees_its_block_fresh_and_the_rest_as_of_the_refresh(cache):
    """Confidence grows with committed neighbours, so each pass depends on what it sees of the canvas.
    The stub's scores inside a block depend only on the block and its two outer neighbours, which are
    final (the previous block) or still masked (the next one) since the refresh: cached decoding must
    then equal uncached decoding pass for pass. A window that is off by one position, or a cache that
    missed this pass's commits inside the block, changes the commit passes."""
    words = _words(1)
    cfg = ll.DecodeConfig(strategy="threshold:kappa=0.75", gen_length=G, block_length=T)
    model = scripted(words, np.random.RandomState(5).uniform(0.5, 0.8, (1, G)), neighbour_bonus=0.12)
    want = ll.generate(model, *prompts(1), cfg, trace=True)
    got = ll.generate(model, *prompts(1), dataclasses.replace(cfg, cache=cache), trace=True)
    np.testing.assert_array_equal(got.trace.commit_pass, want.trace.commit_pass)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert want.nfe[0] < G  # neighbours did lift confidences over kappa (more than one commit in some pass)


def test_the_loop_enforces_the_rule_contract():
    """A rule that commits nothing, or commits non-candidates, still makes progress: only candidates
    commit, and a working row that got nothing commits its most confident candidate."""
    words = _words(1)
    conf = np.linspace(0.5, 0.6, G)[None]
    lazy = ll.stateless(lambda s: ~s.candidates, name="lazy")  # everything except the candidates
    out = ll.generate(scripted(words, conf), *prompts(1),
                      ll.DecodeConfig(strategy=lazy, gen_length=G, block_length=T), trace=True)
    np.testing.assert_array_equal(out.tokens[0, out.prompt_length:], words[0])
    assert out.nfe[0] == G  # exactly one (forced) commit per pass
    assert out.trace.clause_names == ("commit", "forced") and set(np.unique(out.trace.clause[0])) == {0, 2}


def test_trace_clause_names_are_distinct_and_the_forced_commit_is_the_loops():
    """LocalLeap names its own most-confident commit "top1"; the loop's forced commit (a row whose rule chose
    nothing) is "forced", so a clause count never merges the two (issue #22)."""
    words = _words(1)
    out = ll.generate(scripted(words, np.full((1, G), 0.6)), *prompts(1),
                      ll.DecodeConfig(strategy="localleap", gen_length=G, block_length=T), trace=True)
    assert out.trace.clause_names == ("top1", "anchor", "relaxed", "forced")
    names = out.trace.clause_names
    assert {names[c - 1] for c in out.trace.clause[0][out.trace.committed[0]]} == {"top1"}  # LocalLeap's own
    for name in ll.rules.RULES:
        rule = ll.rule(name)
        assert len(set(rule.clause_names + ("forced",))) == len(rule.clause_names) + 1, name


@pytest.mark.parametrize("ids, mask, message", [
    ([[5, 6, 7], [8, 9]], None, r"^ids is ragged \(row 0 has 3 ids, row 1 has 2\): left-pad the rows and pass "
                                r"their mask \(localleap_jax.tokenizer.left_pad\(rows, pad_id\), or ids, mask = "),
    (None, None, r"^ids is None; expected token ids \[batch, prompt_length\] \(encode prompts first"),
    (b"2 + 2", None, r"^ids is bytes, not token ids \[batch, prompt_length\]"),
    (["2 + 2"], None, r"^ids\[0\] is str, not a row of token ids"),
    ([[5, 6], [7, 8]], [[True, True], [True]], r"^mask is ragged \(row 0 has 2 values, row 1 has 1\)"),
])
def test_inputs_that_are_not_left_padded_ids_are_named(ids, mask, message):
    """One line naming what was given (numpy's "inhomogeneous shape" or a shape of () before, issue #22)."""
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T)
    with pytest.raises(ll.DecodeError, match=message):
        ll.generate(scripted(_words(1), np.full((1, G), 0.6)), ids, mask, cfg)


@pytest.mark.parametrize("change, message", [
    (dict(cfg=None), r"^cfg is None: pass ll.DecodeConfig\(strategy=..., gen_length=..., block_length=...\), or leave "
                     "it out for the defaults$"),
    (dict(cfg="threshold"), r"^cfg is str 'threshold', not a DecodeConfig: pass ll.DecodeConfig\(strategy='threshold'\)$"),
    (dict(rng=0), r"^rng is int 0, not a JAX random key: pass rng=jax.random.key\(seed\)"),
    (dict(rng=np.zeros(3, np.uint32)), r"^rng is ndarray uint32\[3\], not a JAX random key"),
    (dict(ids=np.array([[WORD, MASK, WORD], [WORD, WORD, WORD]])),
     rf"^prompt rows \[0\] hold the mask id {MASK}, which the model reads as a position to generate"),
    (dict(trace="yes"), r"^trace='yes' must be True or False$"),
    (dict(devices=3), r"^devices must be a non-empty list of local JAX devices"),
])
def test_a_config_key_or_prompt_generate_cannot_take_is_one_line_before_compiling(change, message):
    """Issue #47: cfg=None and rng=0 ended in AttributeError inside generate; a prompt holding the mask id decoded
    it as a position to fill (the answer then follows a corrupted prompt). A legacy key (jax.random.PRNGKey) and a
    mask id in the left padding are fine."""
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T, temperature=0.5)
    model = scripted(_words(2), np.full((2, G), 0.6))
    ids, mask = prompts(2)
    args = {**dict(ids=ids, mask=mask, cfg=cfg, rng=jax.random.key(0)), **change}
    keywords = {k: args[k] for k in ("trace", "devices") if k in args}
    n = len(compiled_programs())
    with pytest.raises(ll.DecodeError, match=message) as e:
        ll.generate(model, args["ids"], args["mask"], args["cfg"], args["rng"], **keywords)
    assert "\n" not in str(e.value) and len(compiled_programs()) == n  # refused before anything compiled


def test_a_legacy_key_and_a_mask_id_in_the_padding_are_taken():
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T, temperature=0.5)
    ids, mask = prompts(2)
    ids[0, 0], mask[0, 0] = MASK, False  # padding may hold any id: it is never read
    out = ll.generate(scripted(_words(2), np.full((2, G), 0.6)), ids, mask, cfg, jax.random.PRNGKey(0))
    assert not (out.tokens[:, out.prompt_length:] == MASK).any()


def test_per_row_settings_equal_each_row_run_alone():
    words = _words(4, seed=3)
    conf = np.random.RandomState(4).uniform(0.55, 0.99, (4, G))
    kappas = np.array([0.6, 0.7, 0.8, 0.95], np.float32)
    cfg = ll.DecodeConfig(strategy=ll.rule("localleap", kappa=kappas, tau=0.55, radius=[0, 1, 2, 3]),
                          gen_length=G, block_length=T)
    both = ll.generate(scripted(words, conf), *prompts(4), cfg)
    for r in range(4):
        alone = ll.generate(scripted(words[r:r + 1], conf[r:r + 1]), *prompts(1), ll.DecodeConfig(
            strategy=ll.rule("localleap", kappa=float(kappas[r]), tau=0.55, radius=r), gen_length=G, block_length=T))
        np.testing.assert_array_equal(both.tokens[r], alone.tokens[0])
        assert both.nfe[r] == alone.nfe[0]
    assert len(set(both.nfe.tolist())) > 1  # the settings made a difference


def test_new_settings_do_not_recompile():
    model = scripted(_words(2), np.full((2, G), 0.8))
    ids, mask = prompts(2)
    ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("localleap", kappa=0.9), gen_length=G,
                                                  block_length=T))
    n = len(compiled_programs())
    for kappa, tau, radius in [(0.85, 0.7, 2), (0.7, 0.6, 0), (1.0, 0.2, 9)]:
        out = ll.generate(model, ids, mask, ll.DecodeConfig(
            strategy=ll.rule("localleap", kappa=kappa, tau=tau, radius=radius), gen_length=G, block_length=T))
        assert out.compile_seconds == 0.0
    assert len(compiled_programs()) == n


def test_tracing_off_leaves_the_program_without_trace_buffers():
    model = scripted(_words(2), np.full((2, G), 0.8))
    ids, mask = prompts(2)
    cfg = ll.DecodeConfig(gen_length=G, block_length=T)
    rule = cfg.rule.with_rows(2)

    def carry_shapes(trace):
        jaxpr = jax.make_jaxpr(lambda d, i, m, r: decode.decode_loop(
            d, i, m, None, r, loop=cfg.loop_settings(trace), special=model.special))(
            model.denoiser, ids, mask, rule)
        loop = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while")
        return [tuple(v.aval.shape) for v in loop.outvars], len(str(loop.params["body_jaxpr"]))

    off, off_size = carry_shapes(False)
    on, on_size = carry_shapes(True)
    assert (2, G, G) not in off and (2, G, G) in on  # the [B, S, G] buffers exist only when tracing
    assert set(off) <= set(on) and off_size < on_size


def test_a_user_rule_is_a_few_lines_stateless_or_stateful():
    """README's examples: a stateless rule from a function, a stateful one as a dataclass with a traced
    setting; both run through the unchanged loop, and the stateful one sees its state reset per block."""
    import flax
    import jax.numpy as jnp

    confident = ll.stateless(lambda s: s.candidates & (s.conf >= 0.8), name="confident")

    @flax.struct.dataclass
    class Steady(ll.rules.RuleBase):
        k: int = ll.rules.setting(2, int, low=1)
        name = "steady"

        def init(self, batch, block, vocab):
            return jnp.zeros((batch, block), jnp.int32), jnp.full((batch, block), -1, jnp.int32)

        def update(self, s, state):
            run, last = state
            run = jnp.where(s.pred == last, run + 1, 1)
            return s.candidates & (run >= ll.rules.per_row(self.k)), (run, s.pred)

    model = scripted(_words(2), np.full((2, G), 0.85))
    cfg = lambda rule: ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T)  # noqa: E731
    assert (ll.generate(model, *prompts(2), cfg(confident)).nfe == G // T).all()  # one pass per block
    # k passes per block: the first k - 1 commit only the loop's fallback (one token), the k-th the rest.
    for k in (2, 3):
        assert (ll.generate(model, *prompts(2), cfg(Steady(k))).nfe == k * (G // T)).all()
    with pytest.raises(ll.DecodeError, match="k=0 must lie in"):
        ll.generate(model, *prompts(2), cfg(Steady(0)))


def test_the_mask_token_is_never_predicted():
    """A model whose best guess at some positions is the mask token itself: writing it would leave a hole
    that stays masked. The loop takes the best other id instead, and every row completes."""
    words = _words(1)
    words[0, 2:5] = MASK
    out = ll.generate(scripted(words, np.full((1, G), 0.95)), *prompts(1),
                      ll.DecodeConfig(strategy="threshold", gen_length=G, block_length=T))
    gen = out.tokens[0, out.prompt_length:]
    assert not (gen == MASK).any() and out.nfe[0] < G
    np.testing.assert_array_equal(np.delete(gen, [2, 3, 4]), np.delete(words[0], [2, 3, 4]))


def test_a_model_without_the_loops_seam_is_refused_by_name():
    """The loop is given a model's config, denoiser and special ids explicitly: an object lacking them is named."""
    class Params:  # what a user might pass by mistake: the parameters, not the loaded model
        config = config()
    with pytest.raises(ll.DecodeError, match=r"Params has no denoiser, special"):
        ll.generate(Params(), *prompts(1), ll.DecodeConfig(gen_length=G, block_length=T))


def test_one_way_to_say_a_rule_resolved_once_and_the_old_fields_refused():
    """strategy= takes a rule or a spec, resolved at construction (cfg.strategy is the rule object from then on);
    the settings DecodeConfig once took beside a name are refused in one line that says where they went."""
    cfg = ll.DecodeConfig(strategy="localleap:kappa=0.8,tau=0.7", gen_length=G, block_length=T)
    assert cfg.strategy == ll.rule("localleap", kappa=0.8, tau=0.7) and cfg.rule is cfg.strategy
    assert dataclasses.replace(cfg, gen_length=2 * G).rule is cfg.rule  # not parsed again
    for old in ("kappa", "tau", "radius", "steps"):
        with pytest.raises(ll.DecodeError, match=rf"^DecodeConfig takes no {old}: they are the rule's settings, "
                                                 rf"DecodeConfig\(strategy=ll.rule\('threshold', {old}=\.\.\.\)\)"):
            ll.DecodeConfig(strategy="threshold", **{old: 1})
    with pytest.raises(ll.DecodeError, match=r"^unknown strategy 'greedy'; choose from "):
        ll.DecodeConfig(strategy="greedy")
    with pytest.raises(ll.DecodeError, match=r"^strategy must be a rule .*got the class Threshold \(pass an instance"):
        ll.DecodeConfig(strategy=ll.rules.Threshold)


@pytest.mark.parametrize("spec, flags, want", [
    ("threshold", dict(kappa=0.8, tau=0.7, radius=2, steps=6), ll.rule("threshold", kappa=0.8)),  # only what it has
    ("localleap:kappa=0.95", dict(kappa=0.8, tau=0.7), ll.rule("localleap", kappa=0.95, tau=0.7)),  # the spec wins
    ("low_confidence", dict(kappa=0.8, steps=6), ll.rule("low_confidence", steps=6)),
    ("eb:gamma=0.1", dict(kappa=0.8, steps=6), ll.rule("eb", gamma=0.1)),  # a rule with none of them
    ("localleap", dict(), ll.rule("localleap")),
])
def test_the_shared_flags_map_onto_the_rules_that_have_them_and_never_over_the_spec(spec, flags, want):
    got = ll.rules.with_shared_settings(spec, **flags)
    assert type(got) is type(want) and got.spec() == want.spec()


@pytest.mark.parametrize("spec, flags, message", [
    ("low_confidence", dict(kappa=1.5), r"^shared setting: kappa=1.5 must lie in \(0, 1\]$"),  # ignored, still checked
    ("threshold", dict(radius=-1), r"^shared setting: radius=-1 must lie in \[0, inf\)$"),
    ("greedy", dict(kappa=0.8), r"^unknown strategy 'greedy'"),
    (ll.rule("threshold"), dict(kappa=0.8), r"^kappa given beside a rule object: set them on the rule, e\.g\. "
                                            r"ll\.rule\('threshold', kappa=\.\.\.\)$"),
])
def test_a_bad_shared_flag_is_one_line(spec, flags, message):
    with pytest.raises(ll.DecodeError, match=message):
        ll.rules.with_shared_settings(spec, **flags)


def test_a_rule_whose_state_spans_blocks_keeps_it_while_its_row_waits_for_the_batch():
    """Saber's state crosses blocks (resets_state False). With the prefix cache the rows advance together, so a row
    whose block is full waits, running passes it would not run alone: its state must not change in them (it did:
    4 of these 6 rows decoded otherwise than alone). Slots hold the same rows: they must too."""
    from stubs import ragged_prompts, seeded

    model = seeded(32)
    ids, mask = ragged_prompts(6, 1)
    cfg = ll.DecodeConfig(strategy="saber", gen_length=32, block_length=8, cache="prefix", prompt_bucket=8)
    batch, slotted = ll.generate(model, ids, mask, cfg), ll.generate(model, ids, mask, cfg, slots=2)
    alone = [ll.generate(model, ids[i:i + 1], mask[i:i + 1], cfg) for i in range(len(ids))]
    assert len(set(int(a.nfe[0]) for a in alone)) > 1  # rows need different passes: some wait in the batch
    for i, a in enumerate(alone):
        for out in (batch, slotted):
            np.testing.assert_array_equal(out.tokens[i, out.prompt_length:], a.tokens[0, a.prompt_length:])
            assert out.nfe[i] == a.nfe[0] and out.remasks[i] == a.remasks[0]


def test_the_loop_never_probes_a_rule():
    """decode/ reads a rule's traits from the loop's settings (rules.traits_of, once), never from the rule: no
    getattr or hasattr on anything that holds a rule or a strategy, in any module of the package (read with ast)."""
    import ast
    from pathlib import Path

    probes = []
    for path in sorted((Path(decode.__file__).parent).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args and re.search(r"rule|strategy", ast.unparse(node.args[0]))):
                probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, probes
    calls = sum(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
                for p in Path(decode.__file__).parent.glob("*.py") for n in ast.walk(ast.parse(p.read_text())))
    assert calls > 0  # the walk did see the getattr calls that are left (on canvases and the config's own fields)


def test_a_rule_object_that_fails_while_traced_is_one_line_naming_its_own_line():
    """ll.generate with a rule of the caller's own that branches in Python on a traced value: one DecodeError line
    naming the line that branched (here, inside any_of: the sub-rule's line, not the combinator's), before anything
    compiled."""
    def picky(s):
        return s.candidates if s.conf[0, 0] > 0.5 else s.candidates & False  # the traced branch

    line = picky.__code__.co_firstlineno + 1
    n = len(compiled_programs())
    for rule in (ll.stateless(picky, name="picky"), ll.any_of(ll.rule("threshold"), ll.stateless(picky, name="picky"))):
        with pytest.raises(ll.DecodeError) as e:
            ll.generate(scripted(_words(1), np.full((1, G), 0.8)), *prompts(1),
                        ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T))
        assert re.match(rf"rule '(picky|any_of)' at \S*test_decode_loop.py:{line} branches in Python on a traced "
                        r"value .*: use jnp.where", str(e.value)), str(e.value)
        assert "\n" not in str(e.value)
    assert len(compiled_programs()) == n


def test_a_rule_objects_init_and_a_functions_arity_are_named_at_their_own_lines():
    import flax

    @flax.struct.dataclass
    class Sized(ll.rules.RuleBase):
        name = "sized"

        def init(self, batch, block, vocab):
            raise ValueError(f"needs a vocabulary of 2 ** k, got {vocab}")  # the failing line

        def update(self, s, state):
            return s.candidates, state

    def two(s, state):
        return s.candidates

    init_line, def_line = Sized.init.__code__.co_firstlineno + 1, two.__code__.co_firstlineno
    with pytest.raises(ll.DecodeError) as e:
        ll.generate(scripted(_words(1), np.full((1, G), 0.8)), *prompts(1),
                    ll.DecodeConfig(strategy=Sized(), gen_length=G, block_length=T))
    assert re.match(rf"rule 'sized' at \S*test_decode_loop.py:{init_line} raised ValueError in init: needs a "
                    r"vocabulary of 2 \*\* k, got \d+$", str(e.value)), str(e.value)
    with pytest.raises(ll.DecodeError, match=rf"^rule 'two' at \S*test_decode_loop.py:{def_line}: a stateless rule's "
                                             r"function takes the step's signals alone, fn\(s\) -> commit"):
        ll.DecodeConfig(strategy=ll.stateless(two, name="two"))
