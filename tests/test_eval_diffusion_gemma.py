"""DiffusionGemma through the evaluation: `experiments/eval_gsm8k.py` and the lm-eval adapter on a converted tiny
random checkpoint (transformers' DiffusionGemmaForBlockDiffusion -> save_pretrained -> python -m convert).

What is checked: the model's defaults (blocks of its canvas_length, gen_length rounded up to whole canvases, its
canvas rules as the strategies; the masked families' defaults unchanged); the command's answers and NFE on a few
real GSM8K problems equal `ll.generate` called directly (the chat-formatted prompts built here, the same batch
and the same rng: the key of --seed folded with the call's first request); the adapter's generate_until likewise;
and what does not apply refused in one line before any weight is read (a masked rule on this model, a canvas
rule on a masked one, another cache, block length or gen_length, a shared flag no canvas rule takes, early
stop, a task's sampling temperature) or, for log-likelihood requests, refused naming why. A random model's answers
are garbage: tokens and passes are compared, not accuracy.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
import torch

import localleap_jax as ll
from helpers import SHARED, TOKENIZER_CORPUS
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.commands import eval_gsm8k
from localleap_jax.errors import DecodeError
from localleap_jax.lm_eval import LocalLeapLM, ModelArgsError
from localleap_jax.likelihood import LikelihoodError

from test_diffusion_gemma import C, VOCAB, hf_config, randomized, released_form

pytestmark = pytest.mark.usefixtures("lm_eval_env_report_once")  # conftest: torch's environment report once

GSM8K = SHARED / "data" / "gsm8k" / "test.jsonl"
UNTIL = ["Question:", "</s>", "<|im_end|>"]  # lm-eval's gsm8k task's stop strings
# Rows end on id 0 (EOS and pad, as in test_diffusion_gemma) or on 46, an id this random model's argmax canvases
# hold often enough that rows end at different canvases (so their passes differ and the padding after an EOS shows).
EOS_IDS = [0, 46]
GEN = 3 * C  # three canvases
SEED = 3  # not 0: an rng that ignored --seed would draw other noise


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A converted tiny random DiffusionGemma (canvas_length 8), as a user converts the released one. Its
    self-conditioning MLP is damped as in test_diffusion_gemma's `damped`: on random weights its feedback multiplies
    fp32 noise by ~5 a pass, and two programs of the same batch (through slots, or not) part ways after a few
    passes; damped, they agree over every pass."""
    from convert import main
    from localleap_jax.families import make_tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    root = tmp_path_factory.mktemp("dg")
    config = hf_config(max_position_embeddings=2048, eos_token_id=EOS_IDS)
    config.image_token_id = 2  # the tiny tokenizer's unused <mask>: its ids 3..299 all occur in GSM8K text
    torch.manual_seed(0)
    hf = randomized(DiffusionGemmaForBlockDiffusion(config), seed=5)
    with torch.no_grad():
        hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.1)
    hf.save_pretrained(root / "hf")
    make_tokenizer("diffusion_gemma", TOKENIZER_CORPUS, vocab_size=VOCAB).save_pretrained(root / "hf")
    assert main([str(root / "hf"), str(root / "ck")]) == 0
    return root / "ck"


@pytest.fixture(scope="module")
def model(checkpoint):
    m = ll.load(checkpoint, dtype="float32")
    assert m.config.canvas_length == C and m.config.end_ids == tuple(EOS_IDS)
    return m


def longest_first(model, contexts: list[str]) -> list[str]:
    """The order the adapter decodes requests in: longest chat-formatted prompt first (distinct lengths here)."""
    lengths = [len(model.tokenizer.encode(c, chat=True)) for c in contexts]
    assert len(set(lengths)) == len(contexts)
    return [c for _, c in sorted(zip(lengths, contexts), key=lambda p: -p[0])]


def direct(model, order: list[str], rule: str, seed: int, first: int = 0, **generate):
    """`ll.generate` on the chat-formatted contexts as one left-padded batch in this order, with the key of `seed`
    folded with the call's first request (the adapter's rng of a call): {context: (answer cut at lm-eval's stop
    strings, NFE, generated ids)} (a context given twice: its first row)."""
    ids, mask = model.tokenizer.encode_batch(order, chat=True)
    cfg = ll.DecodeConfig(strategy=rule, gen_length=GEN, block_length=C)
    out = ll.generate(model, ids, mask, cfg, jax.random.fold_in(jax.random.key(seed), first), **generate)
    texts = model.tokenizer.decode_generated(out)
    gen = np.asarray(out.tokens)[:, out.prompt_length:]
    rows = {}
    for c, t, n, g in zip(order, texts, out.nfe, gen):
        rows.setdefault(c, (cut(t, UNTIL), int(n), g))
    return rows


def cut(text: str, until: list[str]) -> str:
    """lm-eval's rule, stated independently: the text before the earliest occurrence of any stop string."""
    found = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(found)] if found else text


# ---------------------------------------------------------------- the model's defaults


def test_the_model_fixes_blocks_and_gen_length_and_its_canvas_rules_are_the_default_strategies():
    """model_defaults (eval_gsm8k) and fit_to_model (the adapter) read the same thing off the ModelConfig: blocks of
    canvas_length (12 here, which does not divide 256), gen_length 256 rounded up to whole canvases (264, as
    transformers' generate rounds max_new_tokens), entropy_bound and localleap_uniform as the strategies; a given
    gen_length is kept; a masked model's defaults are unchanged."""
    from localleap_jax.families import read_config
    from localleap_jax.gsm8k import EvalSettings, default_strategies, model_defaults, read_model_config
    from localleap_jax.lm_eval.args import fit_to_model, parse_model_args
    from localleap_jax.rules import split_specs

    config = read_config({**released_form(), "canvas_length": 12})
    assert model_defaults({}, config) == {"gen_length": 264, "block_length": 12, "num_fewshot": 5}
    assert split_specs(default_strategies(config)) == ["entropy_bound", "localleap_uniform"]
    settings = EvalSettings.for_model({}, model=config, gen_length=48, batch_size=4)
    assert (settings.gen_length, settings.block_length) == (48, 12)
    for strategy in split_specs(default_strategies(config)):
        assert settings.check(strategy).cache_mode(config) == "encoder"

    def adapter(**given):
        return fit_to_model(parse_model_args(given)[1], config, given)

    cfg = adapter()  # nothing given: the family's first strategy, its canvas
    assert (type(cfg.rule), cfg.gen_length, cfg.block_length) == (ll.rules.EntropyBound, 264, 12)
    cfg = adapter(gen_length=24, strategy="localleap_uniform", radius=2)
    assert (cfg.gen_length, cfg.block_length, cfg.rule.radius) == (24, 12, 2)
    assert type(adapter(radius=2).rule) is ll.rules.EntropyBound  # a shared setting beside no strategy
    # a masked model: the adapter's localleap and blocks of 32, eval_gsm8k's manifest canvas, as before
    masked = read_model_config(EMBEDDED)
    cfg = fit_to_model(parse_model_args({})[1], masked, {})
    assert (type(cfg.rule), cfg.gen_length, cfg.block_length) == (ll.rules.LocalLeap, 256, 32)
    manifest = json.loads((EMBEDDED / "manifest.json").read_text())
    assert model_defaults(manifest, masked) == {"num_fewshot": 0, **{k: manifest["eval_defaults"][k]
                                                                    for k in ("gen_length", "block_length")}}


# ---------------------------------------------------------------- eval_gsm8k


@pytest.fixture(scope="module")
def evaluated(checkpoint, tmp_path_factory):
    """`python experiments/eval_gsm8k.py --checkpoint CK --data 5-problems.jsonl --num-fewshot 0 --gen-length 24
    --batch-size 4 --seed 3` with the default strategies (in this process: its compiled programs are reused)."""
    if not GSM8K.is_file():
        pytest.skip(f"needs the GSM8K test file at {GSM8K} (../shared beside the repo)")
    root = tmp_path_factory.mktemp("eval")
    data = root / "test.jsonl"
    data.write_text("".join(GSM8K.read_text().splitlines(True)[:5]))
    out = root / "out"
    assert eval_gsm8k.main(["--checkpoint", str(checkpoint), "--data", str(data), "--num-fewshot", "0",
                            "--gen-length", str(GEN), "--batch-size", "4", "--seed", str(SEED), "--output", str(out),
                            "--no-compile-cache"]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text())


def test_eval_gsm8k_runs_the_canvas_rules_and_answers_as_ll_generate(evaluated, model):
    """Each default strategy's answers and NFE per problem equal ll.generate's on the same chat-formatted prompts
    (lm-eval's 0-shot gsm8k context "Question: ...\\nAnswer:"), batch (all 5 prompts in one call: the command's
    queue of 4 x --batch-size through 4 slots; here one fixed batch) and rng; the summary holds accuracy and mean NFE, blocks of the
    canvas_length, the encoder's cache."""
    rows, summary = evaluated
    assert summary["config"]["block_length"] == C and summary["config"]["gen_length"] == GEN
    assert summary["config"]["cache"] == "auto" and summary["config"]["seed"] == SEED
    assert list(summary["strategies"]) == ["entropy_bound", "localleap_uniform"]
    for name, s in summary["strategies"].items():
        mine = [r for r in rows if r["strategy"] == name]
        assert s["n"] == len(mine) == 5 and "accuracy_strict" in s and "accuracy_flexible" in s
        assert s["mean_nfe"] == pytest.approx(np.mean([r["nfe"] for r in mine]))
        contexts = {f"Question: {r['question']}\nAnswer:": r for r in mine}
        want = direct(model, longest_first(model, list(contexts)), name, SEED)
        for context, r in contexts.items():
            text, nfe, gen = want[context]
            assert (r["generated"], r["nfe"]) == (text, nfe), (name, r["id"])
            assert r["prompt_tokens"] == len(model.tokenizer.encode(context, chat=True))
            # counted up to the first id that ends a row: EOS 46 too, not only the tokenizer's EOS and EOT
            stops = [*EOS_IDS, model.tokenizer.eot_id]
            assert r["generated_tokens"] == len(ll.tokenizer.cut_at_stop(gen, stops))
        nfes = [r["nfe"] for r in mine]
        # the case: rows ended at different canvases (up to 48 passes each), one before its last
        assert len(set(nfes)) >= 2 and min(nfes) < 3 * 48 and max(nfes) <= 3 * 48, nfes
        assert any(np.isin(want[c][2][:-C], EOS_IDS).any() for c in contexts)  # an EOS before the last canvas
        # the rule that ran (on this random model's high entropies localleap_uniform finds no anchor: its tokens
        # are entropy_bound's)
        assert s["spec"].startswith(f"{name}:"), s["spec"]


EVAL_MISTAKES = [
    (["--strategies", "entropy_bound,threshold"], r"^--strategies threshold: this model decodes uniform-noise "
                                                  r"canvases \(no mask token\): use a canvas rule"),
    (["--cache", "none"], r"^--strategies entropy_bound: cache='none': a canvas rule keeps its model's encoder K/V"),
    (["--cache", "auto,dual"], r"^--strategies entropy_bound with --cache dual: cache='dual': a canvas rule keeps"),
    (["--block-length", "16"], r"canvases of 8 tokens \(config.json canvas_length\): block_length must be 8, got 16"),
    (["--gen-length", "12"], r"^--gen-length 12 is not a multiple of --block-length 8 \(the model decodes whole "
                             r"canvases of its canvas_length\)$"),
    (["--kappa", "0.8"], r"^--kappa 0.8: none of the strategies \(entropy_bound, localleap_uniform\) takes kappa"),
    (["--steps", "16", "--strategies", "localleap_uniform"], r"^--steps 16: none of the strategies"),
    (["--early-stop"], r"early_stop, logits_eos_inf and confidence_eos_eot_inf are the masked loop's switches"),
    (["--masked-model", "--strategies", "entropy_bound"], r"^--strategies entropy_bound: entropy_bound is a canvas "
                                                          r"rule, for a uniform-noise canvas model"),
]


@pytest.mark.parametrize("args, message", EVAL_MISTAKES, ids=[" ".join(a) for a, _ in EVAL_MISTAKES])
def test_what_does_not_apply_is_refused_in_one_line_before_any_weight_is_read(checkpoint, tmp_path, capfd,
                                                                              monkeypatch, args, message):
    def no_weights(*a, **k):
        raise AssertionError("the weights were loaded before the mistake was refused")

    monkeypatch.setattr(eval_gsm8k, "load_model", no_weights)
    masked = "--masked-model" in args
    args = [a for a in args if a != "--masked-model"]
    capfd.readouterr()
    try:
        code = eval_gsm8k.main(["--checkpoint", "embedded" if masked else str(checkpoint), *args,
                                "--output", str(tmp_path / "out"), "--no-compile-cache"])
    except SystemExit as e:
        code = e.code
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-2000:]
    assert re.search(message, lines[0][len("error: "):]), lines[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the lm-eval adapter


def _requests(contexts, **gen_kwargs):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", {}, (c, {"until": UNTIL, **gen_kwargs}), i) for i, c in enumerate(contexts)]


CONTEXTS = [f"Question: {q}\nAnswer:" for q in (
    "Mia has 3 apples. She buys 4 more. How many apples does Mia have?",
    "Tom has 9 pens and gives 2 of them away. How many pens are left?",
    "The quick brown fox jumps over 5 lazy dogs and 2 cats. How many animals?",
    "Sam has 4 cards.",
)]


def test_the_adapter_answers_as_ll_generate_with_the_models_defaults(model):
    """LocalLeapLM with no decoding settings decodes with entropy_bound in canvases of 8, gen_length 256 (whole
    canvases); given gen_length and a canvas rule (its setting beside it) in fixed batches of 3, its generate_until
    answers and per-request NFE equal ll.generate on the same prompts, each call's batch (3, then 1) and rng (the
    key of `seed` folded with the call's first request)."""
    defaults = LocalLeapLM(model=model, compile_cache=False, progress=False)
    assert (type(defaults.cfg.rule), defaults.cfg.block_length, defaults.cfg.gen_length) == (
        ll.rules.EntropyBound, C, 256)
    lm = LocalLeapLM(model=model, compile_cache=False, progress=False, seed=SEED, batch_size=3, queue=3,
                     gen_length=GEN, strategy="localleap_uniform", radius=2)
    assert lm.cfg.rule.radius == 2
    answers = lm.generate_until(_requests(CONTEXTS))
    assert lm.model_calls == 2
    order = longest_first(model, CONTEXTS)
    # a short last call is filled up with copies of its last request (the program of the full calls)
    want = {**direct(model, order[:3], "localleap_uniform:radius=2", SEED),
            **direct(model, order[3:] * 3, "localleap_uniform:radius=2", SEED, first=3)}
    from localleap_jax.lm_eval import prompt_key

    for context, answer in zip(CONTEXTS, answers):
        text, nfe, _ = want[context]
        assert answer == text and lm.stats[prompt_key(context)]["nfe"] == nfe, context
    # the seed matters: another seed, other noise, other answers
    other = LocalLeapLM(model=model, compile_cache=False, progress=False, seed=SEED + 1, batch_size=3, queue=3,
                        gen_length=GEN, strategy="localleap_uniform", radius=2)
    assert other.generate_until(_requests(CONTEXTS[:3])) != answers[:3]


def test_the_adapter_refuses_what_does_not_apply_in_one_line(model, checkpoint, monkeypatch, capfd, tmp_path):
    """Before any weight is read: a masked rule on this model, a canvas rule on a masked one, another block length,
    a gen_length of part of a canvas (by LocalLeapLM and by the command line's preflight); after loading: a task
    that asks to sample at a temperature (before generating anything), log-likelihood requests (naming why)."""
    from localleap_jax.lm_eval import main
    from test_cli_errors import in_process  # main in this process, its global state put back afterwards

    class NoWeights:
        def load(self, *a, **k):
            raise AssertionError("the weights were loaded before the mistake was refused")

    monkeypatch.setattr("localleap_jax.lm_eval.model.leader", lambda: NoWeights())
    for given, message in [
        (dict(strategy="threshold"), "this model decodes uniform-noise canvases (no mask token): use a canvas rule"),
        (dict(block_length=16), "block_length must be 8, got 16"),
        (dict(gen_length=12), "gen_length=12 is not a multiple of block_length=8 (the canvases)"),
        (dict(checkpoint="embedded", strategy="entropy_bound"), "entropy_bound is a canvas rule, for a uniform-noise"),
    ]:
        with pytest.raises(ModelArgsError) as e:
            LocalLeapLM(**{"checkpoint": str(checkpoint), **given}, compile_cache=False, progress=False)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    ran = in_process(main, ["--model", "localleap", "--model_args", f"checkpoint={checkpoint},strategy=threshold",
                            "--tasks", "gsm8k"], capfd, tmp_path / "xla")
    err = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), ran.stderr[-2000:]
    assert "use a canvas rule (entropy_bound, localleap_uniform), not threshold" in err[0]

    lm = LocalLeapLM(model=model, compile_cache=False, progress=False, gen_length=GEN)
    with pytest.raises(DecodeError) as e:
        lm.generate_until(_requests(CONTEXTS, do_sample=True, temperature=0.7))
    assert str(e.value).startswith("the task's generation settings (do_sample, temperature=0.7): ")
    assert "samples at its own schedule" in str(e.value)
    assert "\n" not in str(e.value) and lm.model_calls == 0
    from lm_eval.api.instance import Instance

    for kind, args in [("loglikelihood", (CONTEXTS[0], " 7")), ("loglikelihood_rolling", (CONTEXTS[0],))]:
        with pytest.raises(LikelihoodError) as e:
            getattr(lm, kind)([Instance(kind, {}, args, 0)])
        text = str(e.value)
        assert f"1 {kind} requests" in text and "DiffusionGemma" in text and "no masked-token estimator" in text
        assert "\n" not in text and lm.model_calls == 0
