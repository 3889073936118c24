"""Peak RSS of `python -m convert` on a synthetic multi-shard bf16 checkpoint.

    python experiments/bench_convert_memory.py --layers 8 --d-model 1024 --shards 4

Writes a random LLaDA-layout checkpoint (safetensors shards + index + config + tokenizer), converts
it in a child process, and prints the child's peak resident memory next to the checkpoint size.
The converter holds the output tree (the model's size) plus one tensor at a time, so the ratio
tells what LLaDA-8B (16 GB of bf16) needs: ratio x 16 GB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from localleap_jax import cli

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(path: Path, layers: int, d: int, shards: int, vocab: int) -> int:
    import torch
    from safetensors.torch import save_file

    from localleap_jax.tokenizer import make_tokenizer

    tok = make_tokenizer(["0 1 2 3 4 5 6 7 8 9 the quick brown fox"] * 10, vocab_size=300)
    f = 3 * d
    cfg = {"d_model": d, "n_heads": d // 64, "n_kv_heads": d // 64, "n_layers": layers, "mlp_hidden_size": f,
           "vocab_size": vocab, "embedding_size": vocab, "max_sequence_length": 4096, "rope": True,
           "rope_theta": 500000.0, "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "activation_type": "silu",
           "block_type": "llama", "mask_token_id": tok.mask_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.eos_token_id}
    shapes = {"model.transformer.wte.weight": (vocab, d), "model.transformer.ln_f.weight": (d,),
              "model.transformer.ff_out.weight": (vocab, d)}
    for i in range(layers):
        b = f"model.transformer.blocks.{i}."
        shapes |= {b + "attn_norm.weight": (d,), b + "ff_norm.weight": (d,), b + "q_proj.weight": (d, d),
                   b + "k_proj.weight": (d, d), b + "v_proj.weight": (d, d), b + "attn_out.weight": (d, d),
                   b + "ff_proj.weight": (f, d), b + "up_proj.weight": (f, d), b + "ff_out.weight": (d, f)}
    names = list(shapes)
    path.mkdir(parents=True)
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for s in range(shards):  # layer order, as the hub shards LLaDA
        part = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {k: (torch.randn(*shapes[k], generator=g) * 0.02).to(torch.bfloat16) for k in part}
        total += sum(t.numel() * 2 for t in tensors.values())
        save_file(tensors, str(path / fname))
        weight_map |= {k: fname for k in part}
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(str(path))
    return total


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        size = write_checkpoint(src, args.layers, args.d_model, args.shards, args.vocab)
        r = subprocess.run([sys.executable, "-m", "convert", str(src), str(Path(tmp) / "out"), "--quiet"],
                           cwd=REPO, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # ru_maxrss is KiB on Linux
    gib = 2**30
    largest = 2 * args.layers * 3 * args.d_model * args.d_model  # a stacked MLP matrix, bf16
    fixed = peak - size - largest
    print(f"checkpoint: {args.shards} shards, {size / gib:.2f} GiB bf16 (largest stacked leaf {largest / gib:.2f} GiB); "
          f"converter peak RSS {peak / gib:.2f} GiB")
    print(f"model: peak = size + largest leaf + {fixed / gib:.2f} GiB (interpreter, imports, buffers). "
          f"LLaDA-8B (14.9 GiB, largest leaf 3.0 GiB) -> about {14.9 + 3.0 + fixed / gib:.1f} GiB")


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
