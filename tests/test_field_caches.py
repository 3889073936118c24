"""The field's caches as cache policies (ll.cache("dllm_cache" | "dkv" | "d2cache" | "vicinity")) against the eager
transcriptions of the authors' loops (oracles.field_caches), on a tiny random 3-layer LLaDA (fp32, G 32, blocks 8
and 16), with Fast-dLLM's threshold rule and LLaDA's low-confidence schedule, at the reference's check settings.

Every compiled run is one left-padded batch of prompts x settings (each row its own settings: traced per row), and
every row is compared with the oracle run on its prompt alone: tokens and NFE (so a batch equals each row alone).
Each case decides something: the cache changed the tokens of some row against no cache, and the passes the
policies are defined by happened (the oracle's log: dKV's cached passes, vicinity's double refresh, dLLM-Cache's
picks, d2Cache's partial passes). Degenerate settings equal the caches they reduce to; refusals are one line."""

from __future__ import annotations

import numpy as np
import pytest

import localleap_jax as ll
from helpers import random_llada_tensors, tiny_hf_config, write_hf_checkpoint
from localleap_jax.tokenizer import left_pad

torch = pytest.importorskip("torch")
try:
    from oracles import field_caches as fc
except ImportError:  # (the transcriptions come from another branch)
    fc = None
needs_oracle = pytest.mark.skipif(fc is None, reason="oracles.field_caches is not here")

G = 32
PROMPT_LENGTHS = (12, 9, 15)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    """(ll.Model, EagerLLaDA, exclude_ids): a 3-layer random LLaDA with a sharp head (confidences spread over (0, 1)),
    converted for ours and read from its HF tensors by the oracle's network."""
    from localleap_jax.convert_hf import convert

    tok = tiny_tokenizer
    cfg = tiny_hf_config(len(tok), tok.mask_token_id, tok.eos_token_id)
    tensors = random_llada_tensors(cfg, seed=0, head_scale=20.0)
    d = tmp_path_factory.mktemp("field-caches")
    convert(str(write_hf_checkpoint(d / "hf", cfg, tensors, tok)), str(d / "ck"), progress=False)
    model = ll.load(d / "ck", dtype="float32")
    # ids our loop never predicts: the mask, and those the tokenizer cannot decode
    exclude = tuple(sorted({model.special.mask, *range(model.special.vocab_limit, model.config.embedding_size)}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, None if fc is None else fc.EagerLLaDA(cfg, tensors), exclude
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dream(dream_converted):
    """The tiny Dream (3 layers, q/k/v biases, a logit shift), fp32."""
    return ll.load(dream_converted, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(3)
    return [rs.randint(3, 250, size=n).tolist() for n in PROMPT_LENGTHS]


RULES = {  # ours, the oracle's
    "threshold": (ll.rule("threshold", kappa=0.9), lambda: fc.Threshold(0.9)),
    "low_confidence": (ll.rule("low_confidence", steps=16), lambda: fc.LowConfidence(16)),

}

# (policy, block length, rule, [settings: one per row group]); settings a static field fixes share a program only
# when equal. The reference's check settings.
CASES = [
    ("dllm_cache", 8, "low_confidence", [dict(prompt_interval=5, gen_interval=3, transfer_ratio=0.25)]),
    ("dllm_cache", 16, "low_confidence", [dict(prompt_interval=7, gen_interval=4, transfer_ratio=0.5)]),
    ("dllm_cache", 8, "threshold", [dict(prompt_interval=50, gen_interval=2, transfer_ratio=0.25)]),
    ("dllm_cache", 16, "threshold", [dict(prompt_interval=4, gen_interval=2, transfer_ratio=0.0)]),
    ("dkv", 8, "threshold", [dict(reload_every=4), dict(reload_every=3), dict(reload_every=8)]),
    ("dkv", 16, "low_confidence", [dict(reload_every=2)]),
    ("vicinity", 8, "threshold", [dict(prefix_look=16, after_look=16, warmup=4, refresh_every=None)]),
    ("vicinity", 16, "threshold", [dict(prefix_look=4, after_look=4, warmup=2, refresh_every=3)]),
    ("vicinity", 8, "threshold", [dict(prefix_look=0, after_look=8, warmup=10, refresh_every=None)]),
    ("vicinity", 16, "threshold", [dict(prefix_look=8, after_look=0, warmup=0, refresh_every=5)]),
    ("d2cache", 8, "threshold", [dict(rollout_p=0.1, current_k=8, sigma=10.0, inflate_w=4),
                                 dict(rollout_p=0.1, current_k=32, sigma=10.0, inflate_w=0),
                                 dict(rollout_p=0.2, current_k=4, sigma=5.0, inflate_w=4),
                                 dict(rollout_p=0.05, current_k=16, sigma=20.0, inflate_w=2)]),
]


def per_row_policy(name: str, groups: list[dict], rows_each: int):
    """One policy whose traced settings hold each group's values for its rows_each rows (static ones are shared)."""
    merged = {}
    for key in groups[0]:
        values = [g[key] for g in groups]
        same = all(v == values[0] for v in values)
        merged[key] = values[0] if same else np.repeat(values, rows_each)
    return ll.cache(name, **merged)


def run_case(tiny, prompts, name, T, rule_name, groups):
    """Ours on the batch (prompts x settings groups, left-padded), the oracle on each row alone, and the oracle's loop
    without a cache on each row: (ours, [oracle results], [no-cache results])."""
    model, net, exclude = tiny
    rule, oracle_rule = RULES[rule_name]
    rows = [p for _ in groups for p in prompts]
    ids, mask = left_pad(rows, model.config.pad_token_id)
    cfg = ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T, prompt_bucket=16,
                          cache=per_row_policy(name, groups, len(prompts)))
    ours = ll.generate(model, ids, mask, cfg)
    common = dict(gen_length=G, block_length=T, mask_id=model.special.mask, rule=oracle_rule(), exclude_ids=exclude)
    want = [getattr(fc, name)(net, torch.tensor(p), **common, **g) for g in groups for p in prompts]
    none = [fc.no_cache(net, torch.tensor(p), **common) for p in prompts]
    return ours, want, none


def happened(name: str, logs) -> str:
    """What makes the policy itself in the oracle's logs (the case must show it)."""
    kinds = {p.kind for log in logs for p in log}
    if name == "dkv":
        assert "cached" in kinds and ("reload" in kinds or "store" in kinds), kinds
        return "cached passes"
    if name == "vicinity":
        assert "window" in kinds and "refresh" in kinds, kinds
        return "refresh and window passes"
    if name == "d2cache":
        assert "partial" in kinds, kinds
        return "partial passes"
    picked = [p for log in logs for p in log if any(p.detail.get("picked", ()))]
    assert "cached" in kinds or "prompt" in kinds or "response" in kinds, kinds
    return f"{len(picked)} passes with picks"


@needs_oracle
@pytest.mark.parametrize("name, T, rule_name, groups", CASES,
                         ids=[f"{c[0]}-T{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_each_cache_decodes_as_its_authors_loop(tiny, prompts, name, T, rule_name, groups):
    ours, want, none = run_case(tiny, prompts, name, T, rule_name, groups)
    P = ours.prompt_length
    changed = 0
    for r, w in enumerate(want):
        p = len(prompts[r % len(prompts)])
        np.testing.assert_array_equal(ours.tokens[r, P:], w.x[p:].numpy(), err_msg=f"row {r}")
        # NFE: every pass we run; vicinity's window pass after a refresh that filled its block is not run (the
        # authors count it: nfe; without it: busy_nfe)
        assert int(ours.nfe[r]) == (w.busy_nfe if name == "vicinity" else w.nfe), r
        changed += not torch.equal(w.x, none[r % len(prompts)].x)
    happened(name, [w.log for w in want])
    assert changed, "the cache changed no row's tokens: the case decides nothing"


# ------------------------------------------------------------------------------------------------ degenerate settings


def _gen(model, rows, cfg, T, **fields):
    ids, mask = left_pad(rows, model.config.pad_token_id)
    return ll.generate(model, ids, mask, ll.DecodeConfig(gen_length=G, block_length=T, prompt_bucket=16, **fields,
                                                         **cfg))


THRESHOLD = dict(strategy=ll.rule("threshold", kappa=0.9))


def test_vicinity_without_a_halo_is_the_dual_cache_and_a_users_policy_runs_in_the_loop(tiny, prompts, tmp_path):
    """dInfer's class defaults (no look, no warmup) are Fast-dLLM's dual cache: tokens, NFE and passes equal, and the
    dual cache changes some row against none (so the equality decides). A file registering a policy in a few lines
    (the dual cache refreshed every `every` passes of a block), loaded as rules are: every=1 refreshes every pass
    (the tokens of no cache), a large every is the dual cache, in one batch (the setting traced per row)."""
    from helpers import write_user_cache
    from localleap_jax.decode.cache import CACHES

    model = tiny[0]
    none, dual = (_gen(model, prompts, THRESHOLD, 8, cache=c) for c in ("none", "dual"))
    P = none.prompt_length
    assert (dual.tokens[:, P:] != none.tokens[:, P:]).any()
    halo = _gen(model, prompts, THRESHOLD, 8, cache="vicinity:prefix_look=0,after_look=0,warmup=0")
    for got, want in ((halo, dual),):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.nfe, want.nfe)
        assert got.forward_passes == want.forward_passes
    try:
        assert ll.rules.load_rules(str(write_user_cache(tmp_path / "mine.py"))) == ["cache dual_every"]
        mine = _gen(model, prompts, THRESHOLD, 8, cache=ll.cache("dual_every", every=np.array([1, 99, 1])))
        for r, want in enumerate((none, dual, none)):
            np.testing.assert_array_equal(mine.tokens[r], want.tokens[r])
            assert mine.nfe[r] == want.nfe[r]
        assert ll.DecodeConfig(cache="dual_every:every=2").cache_spec == "dual_every:every=2"
    finally:
        CACHES.pop("dual_every", None)


def test_on_dream_degenerate_settings_equal_the_caches_they_reduce_to_and_rows_are_their_own(dream, prompts):
    """Dream's logits lag a position (each policy's shifted windows and subsets). Its tiny model has no oracle: the
    caches' degenerate settings equal what they reduce to (tokens, NFE, passes), and d2Cache's rows decode as
    themselves wherever they sit in a batch (the prompts, then the same prompts in another order)."""
    kw = dict(strategy=ll.rule("threshold", kappa=0.5))
    runs = {c: _gen(dream, prompts, kw, 8, cache=c) for c in ("none", "dual")}
    for spec, same in (("vicinity:prefix_look=0,after_look=0,warmup=0", "dual"),
                       ("dllm_cache:prompt_interval=1,gen_interval=1,transfer_ratio=0", "none"),
                       ("dkv:reload_every=1", "none")):
        got, want = _gen(dream, prompts, kw, 8, cache=spec), runs[same]
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=spec)
        np.testing.assert_array_equal(got.nfe, want.nfe, err_msg=spec)
        assert got.forward_passes == want.forward_passes, spec
    order = [2, 0, 1]
    both = _gen(dream, prompts + [prompts[i] for i in order], kw, 8, cache="d2cache:current_k=4")
    P, n = both.prompt_length, len(prompts)
    for j, i in enumerate(order):
        np.testing.assert_array_equal(both.tokens[n + j, P:], both.tokens[i, P:])
        assert both.nfe[n + j] == both.nfe[i]
    P0 = runs["none"].prompt_length
    assert (both.tokens[:n, P:] != runs["none"].tokens[:, P0:]).any()  # d2Cache changed something


# ------------------------------------------------------------------------------------------------ the program


def test_attention_probabilities_are_only_in_a_program_whose_policy_needs_them(tiny):
    """d2Cache declares `attention_weights`; its own layer loop computes them. The dual cache's program (and every
    other policy's) has none: lowered, not compiled."""
    from localleap_jax.decode import decode_loop
    from localleap_jax.decode.loop import PerRow

    model = tiny[0]
    ids, mask = left_pad([[5, 6, 7]], model.config.pad_token_id)

    def lowered(cache):
        cfg = ll.DecodeConfig(strategy="threshold", gen_length=16, block_length=8, cache=cache)
        policy = cfg.loop_policy(model.config)
        rows = PerRow(cfg.rule.with_rows(1), policy.with_rows(1))
        loop = cfg.loop_settings(False, model.config)
        fn = lambda d, i, m, r: decode_loop(d, i, m, None, r, loop=loop, special=model.special)  # noqa: E731
        import jax
        return jax.jit(fn).lower(model.denoiser, ids, mask, rows).as_text(debug_info=True)

    flags = {c: "attention-weights" in lowered(c) for c in ("d2cache", "dual", "dkv", "dllm_cache")}
    assert flags == {"d2cache": True, "dual": False, "dkv": False, "dllm_cache": False}, flags
    assert [n for n, c in ll.decode.CACHE_POLICIES.items() if c.attention_weights] == ["d2cache"]


# ------------------------------------------------------------------------------------------------ refusals


def test_where_a_policy_cannot_apply_it_is_refused_in_one_line(tiny, sdar_converted):
    from localleap_jax.gsm8k.loading import read_model_config

    sdar = read_model_config(sdar_converted)
    cases = [
        (dict(cache="dkv", block_length=4), sdar, r"cache='dkv:reload_every=8' approximates a bidirectional model's K/V"),
        (dict(strategy="wino", cache="vicinity"), None, r"wino scores the block with each position hidden"),
        (dict(strategy="saber", cache="dkv"), None, r"saber takes commits back, reading the block's decoded"),
        (dict(strategy="saber", cache="vicinity"), None, r"saber sees the whole generated region: use cache"),
        (dict(strategy="joint_threshold", cache="d2cache"), None, r"joint_threshold edits tokens"),
        (dict(cache="dkv:reload_every=0"), None, r"^cache dkv: reload_every=0 must lie in \[1, inf\)$"),
        (dict(cache="d2cache:window=3"), None, r"^cache d2cache has no setting window; its settings: current_k, "),
        (dict(cache=ll.cache("vicinity", prefix_look=np.array([1, 2]))), None, r"prefix_look fixes a shape"),
        (dict(cache="mystery"), None, r"^unknown cache 'mystery'; choose from auto, none, prefix, dual"),
    ]
    for fields, model, pattern in cases:
        with pytest.raises(ll.LocalLeapError, match=pattern) as info:
            ll.DecodeConfig(**{"gen_length": 32, "block_length": 8, **fields}).validate(model)
        assert "\n" not in str(info.value)
    ll.DecodeConfig(strategy="saber", cache="dllm_cache", gen_length=32, block_length=8).validate()  # covers the region
