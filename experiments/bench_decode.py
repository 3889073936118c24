"""Whole-generation speed: `localleap_jax.generate` next to the PyTorch eager loop, same model/prompts/schedule.

    python experiments/bench_decode.py                       # CPU: the embedded trained model, real confidences
    python experiments/bench_decode.py --shape small --prompt-length 128 --gen-length 64 --block-length 16
    python experiments/bench_decode.py --cache none,prefix,dual
    python experiments/bench_decode.py --cache dual,dllm_cache,dkv,d2cache,vicinity --no-torch --fast-dllm ""
    python experiments/bench_decode.py --shape llada-8b --batch 1,8 --prompt-length 900 \\
        --gen-length 256 --block-length 32 --cache none,prefix,dual     # GPU, random bf16 weights
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench_decode.py --no-torch \\
        --batch 8 --mesh "data=8,model=1;data=4,model=2;data=2,model=4;data=1,model=8"   # meshes side by side

The PyTorch side is `oracles.bidirectional.eager_generate`: the published style (Python
per step, float64 softmax, transformers Llama run bidirectionally, no KV cache). The JAX side is
one compiled `lax.while_loop`, timed on a second call (compile time shown apart). Random weights
give flat confidences, so `--shape llada-8b` pins the schedule (`--tokens-per-step`, default 4,
as low_confidence with steps = gen_length / 4) on both sides.

Printed per row: mean NFE per row, forward passes of the batch (and how many ran the whole
canvas for some row: a cache's refreshes, per row, in lanes), ms per step, generated (non-EOS) tokens/s, the ratio to
PyTorch's tokens/s for the same strategy, and with the dual cache among --cache the ratio to its tokens/s (each policy
timed against Fast-dLLM's dual cache, same rule, batch and prompts); with --cache none also the forward-only time per step, so the
loop and selection overhead is visible; and the peak temporary memory of one decode step with
the LM head on the whole canvas vs on the current block only.

`--mesh` (';' between meshes) adds, per strategy and cache, one row per (data, model) mesh
(`generate(..., mesh=)`, localleap_jax.dist.mesh) and one for the pmap path over the same devices,
so their tokens/s stand side by side (on CPU's virtual devices, a sanity check only).

Side by side with Fast-dLLM (`--fast-dllm`, default none,prefix,dual; "" to skip): per cache mode, JAX
`ll.generate(cache=m)` next to Fast-dLLM's loop of the same mode (`oracles.fast_dllm`: their
`generate` / `generate_with_prefix_cache` / `generate_with_dual_cache` on the same transformers Llama), same
model, prompts and rule (threshold and low_confidence through their get_transfer_index, other rules through
reference_rules), greedy. Printed: whether the tokens agree (all rows, else how many), whether each row's NFE
agrees, passes of the batch on each side, ms per pass (step), generated tokens/s and JAX / Fast-dLLM tokens/s.
Both sides warm up once (JAX: the compile), then each takes the median of --reps timed runs. The embedded
model's prompts differ in length: the Fast-dLLM side masks the padding keys (an extension of theirs, which
takes no mask). Both tables, on a CPU:

    nice .venv/bin/python experiments/bench_decode.py --batch 1,8 --strategies threshold,localleap --cache none
    nice .venv/bin/python experiments/bench_decode.py --shape small --batch 1,8 --prompt-length 128 \
        --gen-length 64 --block-length 16 --cache none        # random weights: low_confidence, 4 tokens/step

Threads (--threads, default 1): the same count on both sides, set before torch and jax are imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from bench_threads import N_THREADS  # noqa: F401 (before jax and torch: it sets their threads)
from bench_common import median_seconds, on_gpu, random_model, torch_sync, torch_twin
from localleap_jax import cli

import jax
import jax.numpy as jnp
import numpy as np


def prompts_for(args, model, B: int):
    if args.shape == "embedded":
        import synthetic_math
        problems = synthetic_math.take("test", B, seed=1)
        return model.tokenizer.encode_batch([f"Question: {p['question']}\nAnswer:" for p in problems])
    rng = np.random.RandomState(B)
    ids = rng.randint(0, model.config.vocab_size - 1000, (B, args.prompt_length)).astype(np.int32)
    return ids, np.ones_like(ids, bool)


def generated_tokens(tokens: np.ndarray, prompt_length: int, stop_ids) -> int:
    """Generated tokens before each row's first EOS/EOT, summed over rows."""
    from localleap_jax.tokenizer import cut_at_stop
    return sum(len(cut_at_stop(row, stop_ids)) for row in tokens[:, prompt_length:])


def parse_meshes(text: str):
    """'data=4,model=2;data=1,model=8' -> [(label, Mesh), ...] over the local devices."""
    from localleap_jax.partition import make_mesh, parse_mesh

    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        sizes = parse_mesh(item)
        mesh = make_mesh(sizes.get("data"), sizes.get("model", 1))
        out.append((f"mesh {mesh.shape['data']}x{mesh.shape['model']}", mesh))
    return out


def timed_row(label: str, run, B: int, strategy: str, stop_ids, torch_tps) -> dict:
    """Generate twice (the first compiles) and describe the second run as a row."""
    first = run()
    out = run()
    tps = generated_tokens(out.tokens, out.prompt_length, stop_ids) / out.seconds
    return {"batch": B, "strategy": strategy, "impl": label, "nfe": float(out.nfe.mean()),
            "ms_per_step": out.seconds / out.forward_passes * 1e3, "tokens_per_s": tps,
            "vs_torch": tps / torch_tps if torch_tps else None, "compile_s": first.compile_seconds,
            "passes": out.forward_passes, "full_passes": out.full_passes}


def step_functions(model, P: int, cfg):
    """One decode step's model call and prediction: LM head on the whole canvas, or on the block only."""
    from localleap_jax.decode import predict
    from localleap_jax.model import forward, head, positions_from_mask, trunk

    special = model.special
    scoring = cfg.loop_settings().scoring

    def full_head(params, ids, mask):  # what the published code does: logits for every position
        return predict(forward(params, ids, mask, model.config), scoring, special, None)[:2]

    def block_head(params, ids, mask):  # what generate does
        h, _ = trunk(params, ids, positions_from_mask(mask), mask, model.config)
        return predict(head(params, h[:, P:P + cfg.block_length], model.config), scoring, special, None)[:2]

    return jax.jit(full_head), jax.jit(block_head)


def fast_dllm_rule(strategy: str, steps: int | None) -> dict:
    """The Fast-dLLM loop's rule arguments for a strategy name with its default settings: threshold and
    low_confidence as their get_transfer_index has them, any other rule eagerly (reference_rules)."""
    from oracles import rules as reference_rules

    if strategy == "threshold":
        return {"threshold": reference_rules.Threshold.defaults["kappa"]}
    if strategy == "low_confidence":
        return {"steps": steps}
    rule = reference_rules.make(strategy, **({"steps": steps} if steps and "steps" in
                                             reference_rules.RULES[strategy].defaults else {}))
    return {"rule": rule}


def timed_fast_dllm(loop, twin, ids, mask, *, G: int, T: int, mask_id: int, rule: dict, reps: int = 1):
    """Fast-dLLM's loop, warmed up once, then run `reps` times: (FastResult, median seconds)."""
    import torch

    from oracles import rules as reference_rules

    tmodel, device = twin
    t_ids, t_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)

    def run():
        fresh = {k: reference_rules.fresh(v) if k == "rule" else v for k, v in rule.items()}
        return loop(tmodel, t_ids, t_mask, gen_length=G, block_length=T, mask_id=mask_id, **fresh)

    out = run()
    torch_sync()
    secs = median_seconds(lambda: (run(), torch_sync()), reps=reps, warmup=0)
    return out, secs


def side_by_side_row(model, twin, ids, mask, strategy: str, steps: int | None, G: int, T: int, cache: str,
                     jax_run, stop_ids, reps: int = 1) -> dict:
    """JAX `generate(cache=cache)` (jax_run: compiled already, returns a Generation) next to Fast-dLLM's loop of
    that mode; each side's median time over `reps` runs."""
    import statistics

    from oracles import fast_dllm as reference_fast_dllm

    fast, secs = timed_fast_dllm(reference_fast_dllm.LOOPS[cache], twin, ids, mask, G=G, T=T,
                                 mask_id=model.config.mask_token_id, rule=fast_dllm_rule(strategy, steps), reps=reps)
    runs = [jax_run() for _ in range(reps)]
    jax_out = dataclasses.replace(runs[0], seconds=statistics.median(r.seconds for r in runs))
    P = ids.shape[1]
    x = fast.x.cpu().numpy()
    jax_tps = generated_tokens(jax_out.tokens, P, stop_ids) / jax_out.seconds
    fast_tps = generated_tokens(x, P, stop_ids) / secs
    return {"batch": ids.shape[0], "strategy": strategy, "cache": cache,
            "tokens_agree": bool(np.array_equal(jax_out.tokens[:, P:], x[:, P:])),
            "rows_agree": int((jax_out.tokens[:, P:] == x[:, P:]).all(axis=1).sum()),
            "nfe_agree": jax_out.nfe.tolist() == fast.row_nfe,
            "jax_passes": jax_out.forward_passes, "fast_dllm_passes": fast.nfe,
            "jax_ms_per_step": jax_out.seconds / jax_out.forward_passes * 1e3,
            "fast_dllm_ms_per_step": secs / fast.nfe * 1e3,
            "jax_tokens_per_s": jax_tps, "fast_dllm_tokens_per_s": fast_tps, "jax_over_fast_dllm": jax_tps / fast_tps}


def print_side_by_side(rows: list[dict]) -> None:
    print("\nside by side: JAX generate(cache=m) vs Fast-dLLM's loop of mode m (reference_fast_dllm), same rule")
    print(f"{'B':>3} {'strategy':<15}{'cache':<8}{'tokens':>8}{'NFE':>5}{'passes jax/fd':>15}"
          f"{'jax ms/step':>13}{'fd ms/step':>12}{'jax tok/s':>11}{'fd tok/s':>10}{'jax/fd':>8}")
    for r in rows:
        tokens = "same" if r["tokens_agree"] else f"{r['rows_agree']}/{r['batch']}"
        print(f"{r['batch']:>3} {r['strategy']:<15}{r['cache']:<8}{tokens:>8}{'=' if r['nfe_agree'] else '!=':>5}"
              f"{str(r['jax_passes']) + '/' + str(r['fast_dllm_passes']):>15}{r['jax_ms_per_step']:>13.2f}"
              f"{r['fast_dllm_ms_per_step']:>12.2f}{r['jax_tokens_per_s']:>11.1f}{r['fast_dllm_tokens_per_s']:>10.1f}"
              f"{r['jax_over_fast_dllm']:>7.2f}x")


def peak_step_memory_mb(fn, params, ids, mask) -> float:
    """Temporary + output bytes XLA allocates for one call (parameters and inputs excluded)."""
    mem = fn.lower(params, ids, mask).compile().memory_analysis()
    return (mem.temp_size_in_bytes + mem.output_size_in_bytes) / 2**20


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="embedded", choices=("embedded", "small", "llada-8b"),
                    help="embedded: the shipped trained model (default); small / llada-8b: random weights at "
                         "that shape, with a pinned schedule")
    ap.add_argument("--strategies", default=None, help="default: low_confidence,threshold,localleap (embedded); "
                                                       "low_confidence with the pinned schedule (random shapes)")
    ap.add_argument("--cache", default="none", help="comma-separated cache policies for the JAX side (a policy's "
                                                    "settings: dkv:reload_every=4,vicinity)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--gen-length", type=int, default=None, help="default 64 (embedded), 256 (random shapes)")
    ap.add_argument("--block-length", type=int, default=None, help="default 16 (embedded), 32 (random shapes)")
    ap.add_argument("--prompt-length", type=int, default=900, help="random shapes: prompt tokens")
    ap.add_argument("--tokens-per-step", type=int, default=None,
                    help="pin low_confidence to this many tokens per step (default: 1 embedded, 4 random)")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--mesh", help="(data, model) meshes to compare, e.g. 'data=4,model=2;data=1,model=8' "
                                   "(an axis left out takes the rest of the devices)")
    ap.add_argument("--fast-dllm", default="none,prefix,dual",
                    help="cache modes to run side by side with Fast-dLLM's loops ('' to skip; needs torch)")
    ap.add_argument("--reps", type=int, default=3, help="side by side: median of this many timed runs per side")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads on both sides (read by bench_threads)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    meshes = parse_meshes(args.mesh) if args.mesh else []

    import localleap_jax as ll
    from oracles import bidirectional as reference_torch

    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu() else "float32"))
    small = args.shape == "embedded"
    G = args.gen_length or (64 if small else 256)
    T = args.block_length or (16 if small else 32)
    per_step = args.tokens_per_step or (1 if small else 4)
    strategies = (args.strategies or ("low_confidence,threshold,localleap" if small else "low_confidence")).split(",")
    caches = ll.rules.split_specs(args.cache)
    caches = sorted(caches, key=lambda c: c != "dual")  # the dual cache first: the others' tokens/s against it
    model = ll.load(ll.checkpoint.EMBEDDED, dtype=dtype) if small else random_model(args.shape, dtype)
    stop_ids = [model.config.eos_token_id] + ([model.tokenizer.eot_id] if model.tokenizer else [])
    twin = None if args.no_torch else torch_twin(model)
    if twin is not None:
        import torch
        torch.set_num_threads(N_THREADS)
    fast_modes = [m for m in args.fast_dllm.split(",") if m] if twin is not None else []
    side_rows = []

    print(f"{jax.devices()[0].device_kind}: {args.shape} ({model.config.num_params / 1e6:.1f}M params, {dtype.name}), "
          f"gen {G}, block {T}" + (f", low_confidence pinned at {per_step} token(s)/step" if per_step > 1 else ""))
    header = (f"{'B':>3} {'strategy':<15}{'impl':<15}{'NFE':>7}{'passes':>8}{'full':>6}{'ms/step':>9}{'tok/s':>10}"
              f"{'vs torch':>10}{'compile s':>10}{'fwd ms':>8}{'vs dual':>9}")
    print(header)
    rows = []
    for B in map(int, args.batch.split(",")):
        ids, mask = prompts_for(args, model, B)
        P = ids.shape[1]
        ids_d, mask_d = jax.device_put(ids), jax.device_put(mask)
        canvas = jax.device_put(np.concatenate([ids, np.full((B, G), model.config.mask_token_id, np.int32)], 1))
        cmask = jax.device_put(np.concatenate([mask, np.ones((B, G), bool)], 1))
        full_step, block_step = step_functions(model, P, ll.DecodeConfig(gen_length=G, block_length=T))
        # the floor of a no-cache step: the model call and prediction alone, no loop or selection
        forward_ms = median_seconds(lambda: jax.block_until_ready(block_step(model.params, canvas, cmask)),
                                    reps=5, warmup=2) * 1e3
        for strategy in strategies:
            steps = G // per_step if strategy == "low_confidence" else None
            rule = ll.rule(strategy, steps=steps) if steps else strategy
            cfg = ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T)
            torch_tps = None
            if twin is not None:
                import torch
                tmodel, device = twin
                t_ids, t_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
                t0 = time.perf_counter()
                eager_stats = {}
                x, nfe = reference_torch.eager_generate(
                    tmodel, t_ids, t_mask, strategy=strategy, gen_length=G, block_length=T, steps=steps,
                    mask_id=model.config.mask_token_id, eos_id=model.config.eos_token_id,
                    eot_id=model.tokenizer.eot_id if model.tokenizer else None, stats=eager_stats)
                torch_sync()
                secs = time.perf_counter() - t0
                passes = eager_stats["passes"]
                n_tok = generated_tokens(x.cpu().numpy(), P, stop_ids)
                torch_tps = n_tok / secs
                row = {"batch": B, "strategy": strategy, "impl": "torch-eager", "nfe": float(np.mean(nfe)), "passes": passes,
                       "ms_per_step": secs / passes * 1e3, "tokens_per_s": torch_tps}
                rows.append(row)
                print(f"{B:>3} {strategy:<15}{'torch-eager':<15}{row['nfe']:>7.1f}{passes:>8}{passes:>6}"
                      f"{row['ms_per_step']:>9.2f}{torch_tps:>10.1f}{'1.00x':>10}")
            timed = set()  # cache modes compiled already (side by side with Fast-dLLM reuses them)
            dual_tps = None
            for cache in caches:
                c = dataclasses.replace(cfg, cache=cache)
                first = ll.generate(model, ids_d, mask_d, c)
                out = ll.generate(model, ids_d, mask_d, c)
                timed.add(cache)
                n_tok = generated_tokens(out.tokens, out.prompt_length, stop_ids)
                tps = n_tok / out.seconds
                dual_tps = tps if cache == "dual" else dual_tps
                row = {"batch": B, "strategy": strategy, "impl": f"jax-{cache}", "nfe": float(out.nfe.mean()),
                       "ms_per_step": out.seconds / out.forward_passes * 1e3, "tokens_per_s": tps,
                       "vs_torch": tps / torch_tps if torch_tps else None, "compile_s": first.compile_seconds,
                       "passes": out.forward_passes, "full_passes": out.full_passes, "forward_ms": forward_ms if cache == "none" else None,
                       "vs_dual": tps / dual_tps if dual_tps else None}
                rows.append(row)
                vs = f"{row['vs_torch']:.2f}x" if torch_tps else "-"
                fw = f"{forward_ms:>8.2f}" if cache == "none" else f"{'':>8}"
                vd = f"{row['vs_dual']:>8.2f}x" if dual_tps else ""
                print(f"{B:>3} {strategy:<15}{'jax-' + cache:<15}{row['nfe']:>7.1f}{out.forward_passes:>8}"
                      f"{out.full_passes:>6}{row['ms_per_step']:>9.2f}{tps:>10.1f}{vs:>10}"
                      f"{first.compile_seconds:>10.1f}{fw}{vd}")
                sharded = [(f"{label} {cache}", lambda m=mesh: ll.generate(model, ids, mask, c, mesh=m))
                           for label, mesh in meshes]
                if meshes and jax.local_device_count() > 1:
                    sharded.append((f"pmap x{jax.local_device_count()} {cache}",
                                    lambda: ll.generate(model, ids, mask, c, devices=jax.local_devices())))
                for label, run in sharded:
                    row = timed_row(label, run, B, strategy, stop_ids, torch_tps)
                    rows.append(row)
                    vs = f"{row['vs_torch']:.2f}x" if torch_tps else "-"
                    print(f"{B:>3} {strategy:<15}{label:<15}{row['nfe']:>7.1f}{row['passes']:>8}{row['full_passes']:>6}"
                          f"{row['ms_per_step']:>9.2f}{row['tokens_per_s']:>10.1f}{vs:>10}{row['compile_s']:>10.1f}")
            for cache in fast_modes:
                c = dataclasses.replace(cfg, cache=cache)
                if cache not in timed:
                    ll.generate(model, ids_d, mask_d, c)  # compile
                side_rows.append(side_by_side_row(model, twin, ids, mask, strategy, steps, G, T, cache,
                                                  lambda c=c: ll.generate(model, ids_d, mask_d, c), stop_ids,
                                                  reps=args.reps))
        full_mb = peak_step_memory_mb(full_step, model.params, canvas, cmask)
        block_mb = peak_step_memory_mb(block_step, model.params, canvas, cmask)
        print(f"    one step's XLA memory at B={B} (params excluded): LM head on the canvas {full_mb:.1f} MB, "
              f"on the block only {block_mb:.1f} MB")
        rows.append({"batch": B, "step_temp_mb_full_head": full_mb, "step_temp_mb_block_head": block_mb})
    if side_rows:
        print_side_by_side(side_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "shape": args.shape, "rows": rows,
                       "fast_dllm": side_rows}, f, indent=2)


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
