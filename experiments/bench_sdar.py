"""SDAR block diffusion: `ll.generate` (one compiled JAX loop, exact per-block KV cache) next to SDAR's own
loop in PyTorch with a real KV cache, same weights, prompts and rule, measured side by side in one run.

    nice -n 10 .venv/bin/python experiments/bench_sdar.py            # defaults: ~1-2 min on 2 CPU cores
    .venv/bin/python experiments/bench_sdar.py --hidden 512 --layers 8 --gen-length 128 --batch-sizes 1,4,16
    .venv/bin/python experiments/bench_sdar.py --strategies dynamic --torch-attn eager

The model is random (a "tiny-ish" Qwen3/SDAR checkpoint written to a temp dir with a BPE tokenizer from
`families.make_tokenizer("sdar", ...)`, converted by `localleap_jax.convert_hf`, loaded by `ll.load` in fp32; the torch twin is
`reference_sdar.sdar_torch_model`, transformers' Qwen3ForCausalLM with the same tensors). The head is sharpened
(--head-scale) so confidences spread over (0, 1) and dynamic's threshold branch fires.

The PyTorch side is SDAR's generate.py (`block_diffusion_generate`) with its KV cache as people run it: a
transformers `DynamicCache`; one prefill pass over the prompt's whole blocks under the block-causal 4D mask; then
for each block, denoising passes over the block's 4 tokens only, reading the cache (an all-zeros additive 4D mask
over keys [0, block end)), not storing (the cache is cropped back to the block start after each pass,
`cache.crop(-4)`), and one store pass once the block has no mask left. Greedy: argmax (the mask id and the
embedding rows past the tokenizer excluded, as the JAX loop does), confidence = softmax probability of the
argmax; SDAR's low_confidence_dynamic (threshold, strict >, compared with the step's quota) or
low_confidence_static, committing only masked positions. The batch has B prompts of equal length (SDAR's code has no padding) and advances block by block
together: a block runs until every row's block is full; a row with no mask left commits nothing. No early stop
on either side (SDAR stops on EOS after a block; `ll.generate`'s early_stop is off), so both decode the whole grid.

The JAX side is `ll.generate(..., DecodeConfig(strategy=ll.rule("dynamic", threshold=...) | ll.rule("low_confidence"),
gen_length=G, block_length=4))`, cache "auto" (= "block"): prefill once, each pass runs the current block, and a
finished block's K/V are stored by the next block's first pass, so it needs no store pass.

Measured (after a warm-up; JAX compile excluded and printed apart): seconds per generation (median of --repeats)
and generated tokens/s (B * G / s) on both sides, their ratio; NFE: SDAR's denoising + store + prefill passes of
the batch vs ours (`out.nfe`, denoising passes per row, mean; `out.forward_passes` for the batch), and the passes the
fold saves (one store pass per decoded block). Before timing, one prompt's tokens are asserted equal on both
sides (and the batch rows' equality is printed).

Threads (--threads, default 1): the same count on both sides, set before torch and jax are imported. 1 (the
default, for a shared machine): torch.set_num_threads(1) and XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1" (XLA's CPU client single-threaded). 0: all CPUs this process may use
(os.sched_getaffinity) for torch, which is what XLA's CPU client uses by default, with OMP_WAIT_POLICY=PASSIVE (on a
loaded machine torch's spinning OpenMP threads otherwise make its times swing 10x). Interop threads 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # helpers.py: the tiny SDAR checkpoint builders the tests use

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _threads_from_argv(argv) -> int:
    """--threads, read before torch and jax are imported (their thread pools are fixed at import)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    n = pre.parse_known_args(argv)[0].threads
    return CPUS if n <= 0 else n


N_THREADS = _threads_from_argv(sys.argv[1:])
if N_THREADS == 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
XLA_NOTE = ("XLA single-threaded" if N_THREADS == 1 else
            f"XLA default pool ({CPUS} CPUs){'' if N_THREADS == CPUS else ' (XLA cannot be set to ' + str(N_THREADS) + ')'}")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import localleap_jax as ll  # noqa: E402
from localleap_jax import cli  # noqa: E402
from oracles import sdar as reference_sdar  # noqa: E402

torch.set_num_threads(N_THREADS)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass

JAX_RULES = {"dynamic": "low_confidence_dynamic", "low_confidence": "low_confidence_static"}


# ------------------------------------------------------------------------------------------------ the model


def build(args, workdir: Path):
    from helpers import random_sdar_tensors, tiny_sdar_config, write_hf_checkpoint

    from localleap_jax.convert_hf import convert
    from localleap_jax.synthetic_math import take
    from localleap_jax.families import make_tokenizer

    problems = take("train", 3000, seed=0)
    corpus = [f"Question: {p['question']}\nAnswer: {p['answer']}" for p in problems]
    rng = np.random.default_rng(args.seed)  # pseudo-words, so the BPE trainer finds enough merges for --vocab
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(4 * args.vocab)]
    corpus += [" ".join(rng.choice(words, 12)) for _ in range(3 * args.vocab)]
    tok = make_tokenizer("sdar", corpus, vocab_size=args.vocab)
    rows = -(-len(tok) // 64) * 64  # more embedding rows than tokenizer ids, as SDAR's 151936 vs its tokenizer
    cfg = tiny_sdar_config(rows, tok.eos_token_id, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                           intermediate_size=args.intermediate, max_window_layers=args.layers, block_size=args.block)
    tensors = random_sdar_tensors(cfg, seed=args.seed, head_scale=args.head_scale)
    src = write_hf_checkpoint(workdir / "hf", cfg, tensors, tok)
    out = workdir / "converted"
    convert(str(src), str(out), progress=False)
    model = ll.load(out, dtype="float32")
    state = {k: v.numpy() for k, v in tensors.items()}
    torch_model = reference_sdar.sdar_torch_model(json.loads((out / "config.json").read_text()), state)
    if args.torch_attn != "eager":
        torch_model.set_attn_implementation(args.torch_attn)
    return model, torch_model, tok, corpus


def make_prompts(tok, corpus, B: int, P: int, offset: int = 0) -> np.ndarray:
    """B real-text prompts of exactly P tokens (the first P tokens of problems long enough)."""
    rows = []
    for text in corpus[offset:]:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= P:
            rows.append(ids[:P])
        if len(rows) == B:
            return np.asarray(rows, np.int64)
    raise SystemExit(f"not enough problems with {P} tokens for a batch of {B}")


# ------------------------------------------------------------------------------------------------ SDAR's loop in torch


def quota_of(block: int, steps: int) -> list[int]:
    return [int(q) for q in reference_sdar.get_num_transfer_tokens(block, steps)]


class TorchSDAR:
    """SDAR's block_diffusion_generate with its KV cache, batched over equal-length prompts, greedy."""

    def __init__(self, model, *, mask_id: int, block: int, never_predict: list[int]):
        self.model, self.mask_id, self.T = model, mask_id, block
        never = torch.zeros(model.config.vocab_size, dtype=torch.bool)
        never[never_predict] = True
        self.never = never

    def _pass(self, tokens, lo: int, cache):
        """Logits [B, T, V] of the block at [lo, lo + T) reading `cache` (which holds [0, lo)); appends to it."""
        B, n = tokens.shape
        mask = torch.zeros(B, 1, n, lo + n)  # every query sees the prefix and its whole block
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=torch.arange(lo, lo + n).expand(B, n),
                         cache=cache, use_cache=True)
        return out.logits

    @torch.inference_mode()
    def generate(self, prompt: np.ndarray, gen_length: int, strategy: str, steps_per_block: int,
                 threshold: float) -> tuple[np.ndarray, dict]:
        from transformers import DynamicCache

        x0 = torch.from_numpy(np.asarray(prompt, np.int64))
        B, P = x0.shape
        T = self.T
        num_blocks = -(-(P + gen_length) // T)
        x = torch.full((B, num_blocks * T), self.mask_id, dtype=torch.long)
        x[:, :P] = x0
        prefill_blocks = P // T
        quota = quota_of(T, steps_per_block)
        cache = DynamicCache(config=self.model.config)
        counts = {"prefill": 0, "denoise": 0, "store": 0, "row_denoise": np.zeros(B, np.int64)}
        if prefill_blocks:
            n = prefill_blocks * T
            allowed, pos = reference_sdar.block_causal_mask(np.ones((B, n), bool), T)
            additive = torch.from_numpy(np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32))[:, None]
            self.model(input_ids=x[:, :n], attention_mask=additive, position_ids=torch.from_numpy(pos),
                       cache=cache, use_cache=True)
            counts["prefill"] = 1
        for nb in range(prefill_blocks, num_blocks):
            lo, hi = nb * T, (nb + 1) * T
            cur = x[:, lo:hi]  # a view: commits write into x
            for step in range(steps_per_block + 1):
                masked = cur == self.mask_id
                if not masked.any():
                    self._pass(cur, lo, cache)  # the store pass: the finished block's K/V stay in the cache
                    counts["store"] += 1
                    break
                if step == steps_per_block:
                    raise RuntimeError(f"block {nb} still has masks after {steps_per_block} steps")
                logits = self._pass(cur, lo, cache).float()
                cache.crop(-T)  # a denoising pass reads the cache but does not store (5.x: crop(-n) drops n)
                if cache.get_seq_length() != lo:
                    raise RuntimeError(f"cache holds {cache.get_seq_length()} positions, expected {lo}")
                counts["denoise"] += 1
                counts["row_denoise"] += masked.any(dim=1).numpy()
                pred = logits.masked_fill(self.never, float("-inf")).argmax(dim=-1)
                conf = torch.softmax(logits, dim=-1).gather(-1, pred[..., None])[..., 0]
                confidence = torch.where(masked, conf, torch.tensor(float("-inf")))
                k = quota[step]
                left = masked.sum(dim=1)
                # topk over the block, but only masked positions commit (commit_only_masked)
                order = torch.argsort(confidence, dim=1, descending=True, stable=True)
                rank = torch.empty_like(order)
                rank.scatter_(1, order, torch.arange(T).expand(B, T).contiguous())
                top = masked & (rank < torch.clamp(left, max=k)[:, None])
                if strategy == "low_confidence_dynamic":
                    high = confidence > threshold  # strict, as in SDAR
                    enough = (high.sum(dim=1) >= k)[:, None]
                    take = torch.where(enough, high, top)
                else:
                    take = top
                cur[take] = pred[take]
        counts["nfe"] = counts["prefill"] + counts["denoise"] + counts["store"]
        counts["blocks"] = num_blocks - prefill_blocks
        return x.numpy(), counts


# ------------------------------------------------------------------------------------------------ the benchmark


def jax_config(name: str, args, P: int):
    T = args.block
    blocks = -(-(P + args.gen_length) // T) - P // T  # blocks each row decodes
    kw = {"threshold": args.threshold} if name == "dynamic" else {}
    rule = ll.rule(name, steps=blocks * args.steps_per_block, **kw)
    return ll.DecodeConfig(strategy=rule, gen_length=args.gen_length, block_length=T)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--prompt-length", type=int, default=29)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="dynamic,low_confidence", help="JAX rule names: dynamic, low_confidence")
    ap.add_argument("--threshold", type=float, default=0.9, help="dynamic's confidence threshold (strict >)")
    ap.add_argument("--steps-per-block", type=int, default=4, help="SDAR's denoising_steps (quota per step)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=2000, help="tokenizer size asked of the BPE trainer")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--head-scale", type=float, default=12.0, help="sharpens the random LM head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="threads on both sides; 0: all CPUs (see the docstring)")
    ap.add_argument("--torch-attn", default="sdpa", choices=("sdpa", "eager"),
                    help="transformers attention (SDAR's modeling uses SDPA / flash attention)")
    args = ap.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in JAX_RULES:
            raise SystemExit(f"--strategies: {s!r} is not one of {', '.join(JAX_RULES)}")
    G, P = args.gen_length, args.prompt_length

    import jax
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, torch_model, tok, corpus = build(args, Path(tmp))
    c = model.config
    print(f"model: hidden {c.d_model}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv, head_dim "
          f"{c.head_dim}, mlp {c.mlp_hidden_size}, rows {c.embedding_size} (tokenizer {model.special.vocab_limit}), "
          f"block {c.block_size}; fp32 on {jax.default_backend()}; torch {torch.__version__} attn "
          f"{args.torch_attn}, torch threads {torch.get_num_threads()}, {XLA_NOTE}; {CPUS} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    never = [model.special.mask, *range(model.special.vocab_limit or c.embedding_size, c.embedding_size)]
    sdar = TorchSDAR(torch_model, mask_id=model.special.mask, block=c.block_size, never_predict=never)
    print(f"G={G} P={P} steps/block={args.steps_per_block} threshold={args.threshold}; "
          f"blocks decoded {-(-(P + G) // c.block_size) - P // c.block_size}, prefill {P // c.block_size} blocks")

    results = []
    compiled = {}  # (rule, B) -> compile seconds of the first call of that shape
    for name in strategies:
        strategy = JAX_RULES[name]
        # correctness first: one prompt, tokens equal
        one = make_prompts(tok, corpus, 1, P, offset=500)
        cfg = jax_config(name, args, P)
        out = ll.generate(model, one.astype(np.int32), None, cfg)
        compiled[(name, 1)] = out.compile_seconds
        ref, counts = sdar.generate(one, G, strategy, args.steps_per_block, args.threshold)
        ours = out.tokens[0, out.prompt_length:out.prompt_length + G]
        same = np.array_equal(ours, ref[0, P:P + G])
        print(f"[{name}] check, 1 prompt: tokens equal = {same}; NFE ours {int(out.nfe[0])} vs SDAR "
              f"{counts['nfe']} = {counts['prefill']} prefill + {counts['denoise']} denoise + {counts['store']} store")
        assert same, f"tokens differ:\n ours {ours.tolist()}\n sdar {ref[0, P:P + G].tolist()}"
        assert int(out.nfe[0]) == counts["denoise"], (out.nfe, counts)

        for B in batch_sizes:
            prompts = make_prompts(tok, corpus, B, P)
            cfg = jax_config(name, args, P)
            first = ll.generate(model, prompts.astype(np.int32), None, cfg)  # compiles
            compile_s = compiled.setdefault((name, B), first.compile_seconds)
            jax_s, torch_s = [], []
            ref, counts = sdar.generate(prompts, G, strategy, args.steps_per_block, args.threshold)  # torch warm-up
            for _ in range(args.repeats):
                out = ll.generate(model, prompts.astype(np.int32), None, cfg)
                jax_s.append(out.seconds)
                t0 = time.perf_counter()
                ref, counts = sdar.generate(prompts, G, strategy, args.steps_per_block, args.threshold)
                torch_s.append(time.perf_counter() - t0)
            rows_equal = int(sum(np.array_equal(out.tokens[i, out.prompt_length:out.prompt_length + G],
                                                ref[i, P:P + G]) for i in range(B)))
            nfe_equal = bool(np.array_equal(out.nfe, counts["row_denoise"]))
            r = {"name": name, "B": B, "torch_s": median(torch_s), "jax_s": median(jax_s), "compile_s": compile_s,
                 "torch_nfe": counts["nfe"], "prefill": counts["prefill"], "denoise": counts["denoise"],
                 "store": counts["store"], "torch_row_nfe": float(counts["row_denoise"].mean()),
                 "jax_nfe": float(out.nfe.mean()), "jax_passes": out.forward_passes,
                 "jax_full": out.full_passes, "rows_equal": rows_equal, "nfe_equal": nfe_equal}
            r["torch_tps"], r["jax_tps"] = B * G / r["torch_s"], B * G / r["jax_s"]
            results.append(r)
            print(f"[{name}] B={B}: torch {r['torch_s'] * 1e3:.1f} ms ({', '.join(f'{t * 1e3:.0f}' for t in torch_s)}), "
                  f"JAX {r['jax_s'] * 1e3:.1f} ms ({', '.join(f'{t * 1e3:.0f}' for t in jax_s)}), compile "
                  f"{compile_s:.1f} s; rows with equal tokens {rows_equal}/{B}, per-row NFE equal {nfe_equal}")

    print(f"\nSDAR side by side (G={G}, P={P}, block {c.block_size}, steps/block {args.steps_per_block}, fp32 CPU, "
          f"{N_THREADS} thread(s) each, median of {args.repeats}; tok/s = B*G/s)")
    head = (f"{'rule':<15}{'B':>3} {'torch s':>8} {'JAX s':>8} {'torch tok/s':>12} {'JAX tok/s':>10} {'JAX/torch':>9} "
            f"{'compile s':>9}  {'SDAR NFE = pre+den+store':>25} {'ours NFE(row) / passes (2-blk)':>31} {'saved':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        sdar_nfe = f"{r['torch_nfe']} = {r['prefill']}+{r['denoise']}+{r['store']}"
        ours = f"{r['jax_nfe']:.2f} / {r['jax_passes']} ({r['jax_full']})"
        print(f"{r['name']:<15}{r['B']:>3} {r['torch_s']:>8.3f} {r['jax_s']:>8.3f} {r['torch_tps']:>12.0f} "
              f"{r['jax_tps']:>10.0f} {r['jax_s'] and r['torch_s'] / r['jax_s']:>8.2f}x {r['compile_s']:>9.1f}  "
              f"{sdar_nfe:>25} {ours:>31} {r['store']:>5}")
    print("SDAR NFE: the batch's passes (prefill + denoising + one store per block; the batch runs each block until\n"
          "its slowest row is full). Ours: out.nfe mean (denoising passes per row) / out.forward_passes (the batch's\n"
          "passes; rows advance on their own), in parentheses out.full_passes (passes that ran the two-block window\n"
          "storing a finished block). saved = SDAR's store passes, folded into the next block's first pass.\n"
          f"Total {time.perf_counter() - t_start:.0f} s.")


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
