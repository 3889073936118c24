"""localleap_jax.attention: the fused paths against XLA's reference path, on left-padded rows with grouped heads.

The TPU kernel (Pallas splash attention) runs here in Pallas's interpreter; the cuDNN path's own step (keys reversed
so that left padding becomes the right padding cuDNN's lengths describe) runs on XLA's implementation of the same
call. In a subprocess with libtpu (the [tpu-aot] extra), a model-sized call compiles for a TPU v6e chip and is the
splash kernel there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO
from localleap_jax import attention as A

B, T, N, K, H = 2, 128, 2, 1, 64  # two query heads over one key/value head
# bf16 inputs against the fp32 computation of the same bf16 values, on real (unpadded) query rows: XLA's own bf16
# path differs by up to 3.4e-3 (mean 2.7e-4), splash by 1.9e-3 (mean 1.6e-4); tolerance 2x XLA's own.
BF16_TOL = 7e-3


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, K, H), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H), jnp.float32).astype(jnp.bfloat16)
    lengths = jnp.array([T, 100])  # row 0 whole, row 1 with 28 positions of left padding
    mask = jnp.arange(T)[None, :] >= (T - lengths)[:, None]
    exact = A.xla_attention(*(a.astype(jnp.float32) for a in (q, k, v)), mask[:, None, :])
    return q, k, v, lengths, np.asarray(mask), np.asarray(exact)


def error(out, exact, real) -> float:
    return float(np.abs(np.asarray(out, np.float32) - exact)[real].max())


def test_the_tpu_kernel_equals_xla_on_padded_rows(qkv):
    q, k, v, lengths, real, exact = qkv
    splash = A.splash_attention(q, k, v, lengths, interpret=True)
    assert error(splash, exact, real) < BF16_TOL
    assert error(A.attention(q, k, v, mask=jnp.asarray(real), implementation="xla"), exact, real) < BF16_TOL
    # the padding is honoured: attending over the padded keys too moves row 1 by far more than the tolerance
    unpadded = A.splash_attention(q, k, v, jnp.array([T, T]), interpret=True)
    assert error(unpadded, exact, real) > 10 * BF16_TOL


def test_the_cudnn_call_sees_left_padding_as_right_padding(qkv):
    q, k, v, lengths, real, exact = qkv
    flipped = A._cudnn(q, k, v, lengths, implementation="xla")  # the cuDNN call, on XLA's implementation
    assert error(flipped, exact, real) < BF16_TOL
    unflipped = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    assert error(unflipped, exact, real) > 10 * BF16_TOL  # lengths alone read row 1's padding, not its tokens


def test_each_platform_takes_its_kernel_only_where_the_mask_allows(monkeypatch):
    monkeypatch.delenv("LOCALLEAP_ATTENTION", raising=False)
    bf16 = jnp.bfloat16
    with A.lowering_platform("tpu"):
        assert A.implementation_for(bf16, 128, 32, 8, 1152, 1152, padding_only=True) == "splash"
        assert A.implementation_for(bf16, 128, 32, 8, 1152, 1152, padding_only=False) == "xla"  # block-causal, probe
        assert A.implementation_for(bf16, 128, 32, 8, 32, 1152, padding_only=True) == "xla"  # a 32-query window
    with A.lowering_platform("gpu"):  # no GPU here: the probe fails, says why, and XLA's path is taken
        assert A.implementation_for(bf16, 128, 32, 8, 1152, 1152, padding_only=True) == "xla"
        assert A.PROBE_FAILURES[("bfloat16", 128, 32, 8)]
    assert A.implementation_for(bf16, 128, 32, 8, 1152, 1152, padding_only=True) == "xla"  # this CPU
    monkeypatch.setenv("LOCALLEAP_ATTENTION", "splash")
    assert A.implementation_for(bf16, 128, 32, 8, 1152, 1152, padding_only=False) == "splash"


def test_the_models_attention_takes_the_kernel_on_left_padding_and_xla_on_any_other_mask(qkv, monkeypatch):
    """model.attention (every layer's) on a platform with a fused kernel: a left-padded key mask runs the kernel with
    the rows' lengths (here splash in the interpreter); a key mask of another form (a hole inside a row) runs XLA's
    path, decided on the device. A kernel that returns zeros shows which branch ran."""
    from localleap_jax import model as M

    q, k, v, lengths, real, exact = qkv
    holey = real.copy()
    holey[0, 40:50] = False  # row 0 misses keys in its middle: not left padding
    exact_holey = np.asarray(A.xla_attention(*(a.astype(jnp.float32) for a in (q, k, v)), jnp.asarray(holey)[:, None]))
    monkeypatch.setattr(A, "implementation_for", lambda *a, **kw: "splash")
    kernel = lambda q, k, v, kv_lengths, implementation: A.splash_attention(q, k, v, kv_lengths, interpret=True)  # noqa: E731
    monkeypatch.setattr(A, "attention", kernel)
    assert error(M.attention(q, k, v, jnp.asarray(real)), exact, real) < BF16_TOL
    assert error(M.attention(q, k, v, jnp.asarray(holey)), exact_holey, real) < BF16_TOL
    # the broken kernel: the left-padded call changes (the kernel ran), the other one does not (XLA's path ran)
    monkeypatch.setattr(A, "attention", lambda q, *a, **kw: jnp.zeros_like(q))
    assert error(M.attention(q, k, v, jnp.asarray(real)), exact, real) > 10 * BF16_TOL
    assert error(M.attention(q, k, v, jnp.asarray(holey)), exact_holey, real) < BF16_TOL


TPU_SCRIPT = r"""
import jax, jax.numpy as jnp
from localleap_jax import attention as A
from localleap_jax.dist import aot
from localleap_jax import hlo_bytes as hb
device = aot.topology_devices("v6e:2x2")[0]
on = jax.sharding.SingleDeviceSharding(device)
B, L, N, K, H = 1, 512, 8, 2, 128
shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=on)
args = (shape(B, L, N, H), shape(B, L, K, H), shape(B, L, K, H), shape(B, dtype=jnp.int32))
out = {}
for impl in ("splash", "xla"):
    with A.lowering_platform("tpu"):
        f = jax.jit(lambda q, k, v, n: A.attention(q, k, v, kv_lengths=n, implementation=None if impl == "splash" else impl))
        text = f.lower(*args).compile().as_text()
    out[impl] = dict(kernel=text.count("tpu_custom_call"), bytes=hb.parse(text).cost().total())
print("RESULT", out)
"""


def test_the_splash_kernel_compiles_for_a_tpu_chip():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the [tpu-aot] extra)")
    r = subprocess.run([sys.executable, "-c", TPU_SCRIPT], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = eval(lines[-1][len("RESULT "):])  # a dict of ints, printed by the script above
    assert out["splash"]["kernel"] >= 1 and out["xla"]["kernel"] == 0
    # q, k, v and the output are 1.5 MB; the kernel never writes a [N, L, L] score array (8 MB in fp32) to HBM.
    # (At this size XLA's path keeps its scores on chip too; at LLaDA-8B's, L=1152 and 32 heads, one layer's
    # attention moves 377 MB on XLA's path and 44 MB in the kernel.)
    assert out["splash"]["bytes"] < 8 * 512 * 512 * 4
