"""train_tiny: LLaDA's SFT objective, resumable Orbax state, and an export `ll.load` reads."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import localleap_jax as ll
import synthetic_math
import train_tiny
from localleap_jax.model import forward

TINY = ["--steps", "6", "--batch-size", "8", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--mlp-hidden-size", "64", "--warmup", "2", "--save-every", "3"]


def test_splits_are_deterministic_and_disjoint():
    a, b = synthetic_math.take("test", 300, seed=0), synthetic_math.take("test", 300, seed=0)
    assert a == b
    train = {p["question"] for p in synthetic_math.take("train", 3000, seed=0)}
    assert not train & {p["question"] for p in a}
    assert {p["kind"] for p in a} == {"copy", "add", "sub"}
    for p in a:
        n = int(p["answer"].split("#### ")[1])
        if p["kind"] == "add":
            x, y = map(int, p["answer"].split("<<")[1].split("=")[0].split("+"))
            assert n == x + y
        if p["kind"] == "sub":
            x, y = map(int, p["answer"].split("<<")[1].split("=")[0].split("-"))
            assert n == x - y >= 0


def test_sft_loss_is_cross_entropy_on_masked_answer_tokens_weighted_by_one_over_t():
    """Against a direct transcription of LLaDA's SFT loss with the same noise draw."""
    cfg = ll.ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64, vocab_size=50,
                         embedding_size=50, mask_token_id=49, eos_token_id=48, pad_token_id=48)
    params = ll.model.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 48, (4, 12)), jnp.int32)
    mask = jnp.ones((4, 12), bool)
    answer = jnp.asarray(np.arange(12)[None, :] >= 5).repeat(4, 0)
    key = jax.random.key(3)
    got = float(train_tiny.sft_loss(params, tokens, mask, answer, key, config=cfg))
    k_t, k_m = jax.random.split(key)
    t = (np.arange(4) + np.asarray(jax.random.uniform(k_t, (4,)))) / 4
    p = (1 - 1e-3) * t + 1e-3
    masked = np.asarray(answer) & (np.asarray(jax.random.uniform(k_m, (4, 12))) < p[:, None])
    logits = np.asarray(forward(params, jnp.where(masked, 49, tokens), mask, cfg), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    want = np.mean([(ce[b][masked[b]]).sum() / p[b] / 7 for b in range(4)])
    assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture
def compilations_shared_between_runs(tmp_path):
    """JAX's persistent compilation cache, in tmp_path and for one test: each train_tiny.main jits its train step
    (and the parameters' init) afresh, a new closure per run, so every run would compile the same programs
    again; with the cache the later runs read the first run's executables. JAX's settings are put back after."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from localleap_jax.compile_cache import enable_compilation_cache

    flags = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {k: getattr(jax.config, k) for k in flags}
    enable_compilation_cache(tmp_path / "xla")
    compilation_cache.reset_cache()  # read the settings again at the next compile
    yield tmp_path / "xla"
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_training_resumes_and_exports_a_loadable_checkpoint(tmp_path, monkeypatch, compilations_shared_between_runs):
    out = tmp_path / "run"
    real_batch = train_tiny.make_batch

    def interrupted(step, *a):
        if step == 4:
            raise KeyboardInterrupt  # Ctrl-C during step 4 (index 4: four steps are done)
        return real_batch(step, *a)
    monkeypatch.setattr(train_tiny, "make_batch", interrupted)
    with pytest.raises(SystemExit, match="interrupted after step 4; state saved"):
        train_tiny.main(["--out", str(out), *TINY])
    assert (out / "train_state" / "4").exists() and not (out / "checkpoint").exists()
    monkeypatch.setattr(train_tiny, "make_batch", real_batch)
    train_tiny.main(["--out", str(out), *TINY])  # resumes at 4, runs to 6, exports
    manifest = json.loads((out / "checkpoint" / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4 and manifest["training"]["exported_at_step"] == 6
    model = ll.load(out / "checkpoint", dtype="float32")
    assert model.config.d_model == 32 and model.tokenizer.eot_id is not None
    ids, mask = model.tokenizer.encode_batch(["Question: Mia has 3 pens. How many pens does Mia have?\nAnswer:"])
    out_gen = ll.generate(model, ids, mask, ll.DecodeConfig(gen_length=64, block_length=16))
    assert out_gen.tokens.shape == (1, ids.shape[1] + 64)
    with pytest.raises(SystemExit, match="different configuration"):
        train_tiny.main(["--out", str(out), *TINY, "--lr", "0.1"])
    # Resuming restored everything (parameters, optimizer moments, the schedule's step): the same six steps run
    # without a stop end in the same weights, bit for bit (a resume from fresh parameters or a fresh optimizer
    # state would not).
    # (the same tokenizer as the first run's: build_tokenizer keeps the one it finds, and training it again on
    # the same corpus would give the same one)
    shutil.copytree(out / "tokenizer", tmp_path / "straight" / "tokenizer")
    train_tiny.main(["--out", str(tmp_path / "straight"), *TINY])
    straight = ll.load(tmp_path / "straight" / "checkpoint", dtype="float32")
    assert json.loads((tmp_path / "straight" / "checkpoint" / "manifest.json").read_text())["training"][
        "resumed_from_step"] == 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(straight.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
