"""Train the small LLaDA-architecture model on synthetic GSM8K-format problems.

LLaDA's SFT objective: the prompt is kept; the answer canvas (answer, EOT, then EOS up to
`--gen-length`) is masked with ratio t ~ U(0, 1) per sample, and the loss is the
cross-entropy on masked positions weighted by 1/t, averaged over the canvas length. The t of
a batch are stratified (one per 1/B slice of [0, 1]) to cut the variance; each t is still
marginally uniform.

Same `model.py` as inference; optax AdamW with warm-up and cosine decay; Orbax checkpoints
every `--save-every` steps that a rerun resumes from; the output is a checkpoint directory
in the format `convert` writes, so `localleap_jax.load` reads both.

    python experiments/train_tiny.py --out runs/tiny --steps 5000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import synthetic_math  # noqa: E402

from localleap_jax import checkpoint  # noqa: E402
from localleap_jax.config import ModelConfig  # noqa: E402
from localleap_jax.model import forward, init_params  # noqa: E402
from localleap_jax.tokenizer import Tokenizer, left_pad, make_tokenizer  # noqa: E402

PROMPT = "Question: {question}\nAnswer:"  # lm-eval's gsm8k doc_to_text, 0-shot


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 5000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    gen_length: int = 64  # answer canvas: answer + EOT + EOS padding
    prompt_length: int = 72  # prompts are left-padded to this many tokens
    vocab_size: int = 384
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 512


def build_tokenizer(cfg: TrainConfig, out_dir: Path) -> Tokenizer:
    if not (out_dir / "tokenizer.json").exists():
        corpus = [PROMPT.format(question=p["question"]) + " " + p["answer"]
                  for p in synthetic_math.take("train", 20000, seed=cfg.seed, unique=False)]
        make_tokenizer(corpus, cfg.vocab_size).save_pretrained(str(out_dir))
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    return Tokenizer(hf, mask_id=hf.mask_token_id, eos_id=hf.eos_token_id)


def model_config(cfg: TrainConfig, tok: Tokenizer) -> ModelConfig:
    return ModelConfig(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, n_layers=cfg.n_layers,
                       mlp_hidden_size=cfg.mlp_hidden_size, vocab_size=len(tok.hf), embedding_size=len(tok.hf),
                       rope_theta=10000.0, max_sequence_length=512, mask_token_id=tok.mask_id,
                       eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def make_batch(step: int, cfg: TrainConfig, tok: Tokenizer):
    """Tokens [B, P+G], real-token mask [B, P+G], answer-canvas mask [B, P+G]; deterministic in (seed, step)."""
    stream = synthetic_math.problems("train", seed=f"{cfg.seed}-{step}")
    probs = [next(stream) for _ in range(cfg.batch_size)]
    prompts = [tok.encode(PROMPT.format(question=p["question"])) for p in probs]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_id)
    if prompt_ids.shape[1] > cfg.prompt_length:
        raise ValueError(f"a prompt has {prompt_ids.shape[1]} tokens > --prompt-length {cfg.prompt_length}")
    pad = cfg.prompt_length - prompt_ids.shape[1]
    prompt_ids = np.pad(prompt_ids, ((0, 0), (pad, 0)), constant_values=tok.pad_id)
    prompt_mask = np.pad(prompt_mask, ((0, 0), (pad, 0)))
    canvas = np.full((cfg.batch_size, cfg.gen_length), tok.eos_id, np.int32)
    for i, p in enumerate(probs):
        ans = tok.hf(p["answer"], add_special_tokens=False)["input_ids"] + [tok.eot_id]
        if len(ans) > cfg.gen_length:
            raise ValueError(f"an answer has {len(ans)} tokens > --gen-length {cfg.gen_length}")
        canvas[i, :len(ans)] = ans
    tokens = np.concatenate([prompt_ids, canvas], axis=1)
    mask = np.concatenate([prompt_mask, np.ones_like(canvas, bool)], axis=1)
    answer = np.concatenate([np.zeros_like(prompt_mask), np.ones_like(canvas, bool)], axis=1)
    return tokens, mask, answer


def sft_loss(params, tokens, mask, answer, rng, *, config: ModelConfig):
    B, L = tokens.shape
    k_t, k_m = jax.random.split(rng)
    t = (jnp.arange(B) + jax.random.uniform(k_t, (B,))) / B  # stratified, marginally U(0, 1)
    p_mask = (1 - 1e-3) * t + 1e-3  # LLaDA's floor keeps 1/t bounded
    masked = answer & (jax.random.uniform(k_m, (B, L)) < p_mask[:, None])
    noisy = jnp.where(masked, config.mask_token_id, tokens)
    logits = forward(params, noisy, mask, config)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    per_row = jnp.sum(jnp.where(masked, ce, 0.0), axis=1) / p_mask / answer.sum(axis=1)
    return per_row.mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory (Orbax training state lives in OUT/train_state)")
    ap.add_argument("--export", help="final checkpoint directory (default OUT/checkpoint)")
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--export-only", action="store_true",
                    help="export the latest saved training state as a checkpoint directory, without training")
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    saved_cfg = out / "train_config.json"
    if saved_cfg.exists() and json.loads(saved_cfg.read_text()) != dataclasses.asdict(cfg):
        sys.exit(f"error: {out} holds a run with a different configuration ({saved_cfg}); use a new --out")
    saved_cfg.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    tok = build_tokenizer(cfg, out / "tokenizer")
    config = model_config(cfg, tok)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay))
    params = init_params(config, jax.random.key(cfg.seed))
    state = {"params": params, "opt": optimizer.init(params)}

    manager = ocp.CheckpointManager(out / "train_state", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
        print(f"resumed from step {start}")

    @jax.jit
    def train_step(state, tokens, mask, answer, rng):
        loss, grads = jax.value_and_grad(sft_loss)(state["params"], tokens, mask, answer, rng, config=config)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    print(f"model: {config.num_params / 1e6:.2f}M parameters, {config}")
    t0, ema = time.time(), None
    steps = range(start, start if args.export_only else cfg.steps)
    bar = tqdm(steps, initial=start, total=cfg.steps, desc="train", dynamic_ncols=True, disable=args.export_only)
    completed = start
    try:
        for step in bar:
            batch = make_batch(step, cfg, tok)
            state, loss = train_step(state, *batch, jax.random.fold_in(jax.random.key(cfg.seed + 1), step))
            completed = step + 1
            if step % 10 == 0:
                loss = float(loss)
                ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                bar.set_postfix(loss=f"{ema:.3f}", lr=f"{float(schedule(step)):.1e}")
            if completed % args.save_every == 0 or completed == cfg.steps:
                manager.save(completed, args=ocp.args.StandardSave(state))
    except KeyboardInterrupt:
        # Keep every finished step: save the state now, then let the same command resume from it.
        if completed != manager.latest_step():
            manager.save(completed, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
        bar.close()
        sys.exit(f"interrupted after step {completed}; state saved in {out / 'train_state'}; "
                 "rerun the same command to resume")
    manager.wait_until_finished()
    seconds = time.time() - t0

    export = Path(args.export or out / "checkpoint").resolve()
    if export.exists():
        print(f"{export} exists; not overwriting it")
        return
    log = {"train_config": dataclasses.asdict(cfg), "train_seconds_this_run": round(seconds, 1),
           "resumed_from_step": start, "exported_at_step": start + len(steps), "hardware": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.default_backend()}",
           "final_loss_ema": ema}
    checkpoint.save(export, config, state["params"], out / "tokenizer",
                    manifest={"source": "experiments/train_tiny.py", "training": log,
                              # what experiments/eval_gsm8k.py runs on this model when given no flags
                              "eval_data": "synthetic_math", "eval_data_spec": {"n": 500, "seed": cfg.seed},
                              "eval_defaults": {"gen_length": cfg.gen_length, "block_length": 16,
                                                "num_fewshot": 0}},
                    readme=f"# Small LLaDA-architecture model trained by experiments/train_tiny.py\n\n"
                           f"```\n{json.dumps(log, indent=2)}\n```\n")
    print(f"wrote {export}")


if __name__ == "__main__":
    main()
