"""The HLO byte counter (localleap_jax.hlo_bytes) on small programs whose bytes are computed here by hand.

Each program is compiled on CPU and its optimized HLO counted; the expected figure is written from the shapes (f32:
4 bytes an element). A hand-written HLO module covers what only a TPU compile produces (buffers in on-chip memory,
a dynamic-slice nested in a matmul's fusion, a counted loop XLA did not annotate, /*index=*/ markers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from localleap_jax import hlo_bytes as hb

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def counted(f, *args, donate=()):
    module = hb.parse(jax.jit(f, donate_argnums=donate).lower(*args).compile().as_text())
    return module, module.cost()


def test_plain_ops_read_their_operands_and_write_their_outputs():
    _, cost = counted(lambda x: x * 2 + 1, S((256, 128), F32))
    assert cost.total() == 2 * 256 * 128 * 4  # one fused pass: x in, the result out
    _, cost = counted(lambda x, w: x @ w, S((8, 64), F32), S((64, 32), F32))
    assert cost.total() == (8 * 64 + 64 * 32 + 8 * 32) * 4


def test_a_gather_reads_only_the_rows_it_takes_and_an_update_is_written_in_place():
    _, cost = counted(lambda table, i: table[i], S((1000, 64), F32), S((8,), jnp.int32))
    assert cost.total() == 8 * 64 * 4 * 2 + 8 * 4  # 8 rows in and out, and the indices; not the 256 KB table
    _, cost = counted(lambda cache, u, i: jax.lax.dynamic_update_slice_in_dim(cache, u, i, 0),
                      S((128, 64), F32), S((8, 64), F32), S((), jnp.int32), donate=(0,))
    assert cost.total() == 8 * 64 * 4 * 2 + 4  # the update in and out (and the index); not the 32 KB buffer


def test_loops_count_their_body_per_trip_and_conditionals_each_branch():
    _, cost = counted(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: x * 2, x), S((1024,), F32))
    (loop,) = cost.loops
    assert loop.trips == 5  # XLA's known trip count
    doubling = [(op, n) for op, n in cost.flat_ops() if op.read == op.written == 4096 and op.opcode == "fusion"]
    assert [n for _, n in doubling] == [5]  # the body's one 4 KB pass, five times

    def data_dependent(x, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0]
    _, cost = counted(data_dependent, S((1024,), F32), S((), jnp.int32))
    (loop,) = cost.loops
    assert loop.trips is None
    with pytest.raises(hb.UnknownTripCount):
        cost.total()
    assert cost.total(trips={loop.name: 7}) - cost.total(trips={loop.name: 6}) == loop.body.total() + \
        loop.condition.total()
    assert loop.body.total() >= 2 * 4096  # the doubled buffer, read and written

    def either(p, x, w):
        return jax.lax.cond(p, lambda: x * 2, lambda: x @ w)
    _, cost = counted(either, S((), bool), S((64, 64), F32), S((64, 64), F32))
    (cond,) = cost.branches
    assert sorted(b.total() for b in cond.branches) == [2 * 64 * 64 * 4, 3 * 64 * 64 * 4]
    assert cost.total(hb.DEAREST) - cost.total(hb.CHEAPEST) == 64 * 64 * 4
    here = cond.stack[0].file  # the conditional is written in this file: dearest_from(it) picks its dearest branch
    assert here.endswith("test_hlo_bytes.py")
    assert cost.total(hb.dearest_from((here,))) == cost.total(hb.DEAREST)
    assert cost.total(hb.dearest_from(("elsewhere.py",))) == cost.total(hb.CHEAPEST)


def test_it_flags_layers_cut_out_of_a_stack_against_per_layer_weights():
    """Today's model: a scan over stacked [L, D, D] weights copies each layer out (read + write) before the matmul
    reads it: 3x the weights. Per-layer arrays read each weight once."""
    weights = 4 * 256 * 256 * 4

    def scanned(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    def per_layer(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x
    _, stacked = counted(scanned, S((4, 256, 256), F32), S((1, 256), F32))
    _, split = counted(per_layer, [S((256, 256), F32)] * 4, S((1, 256), F32))
    assert split.total() / weights < 1.05
    assert stacked.total() / weights > 2.9
    copies = [op for op, n in stacked.flat_ops() if op.written == 256 * 256 * 4]
    assert copies and all(op.read >= 256 * 256 * 4 for op in copies)  # each layer's copy: read and written


# What a TPU compile looks like (trimmed from a v6e compile of the generation program): a layer loop with no
# known_trip_count, a dynamic-slice fused into a matmul's fusion, buffers in on-chip memory (S(1)), async copies.
TPU_LIKE = """HloModule tpu_like, is_scheduled=true

%slice_weight (p0: bf16[4,128,128], p1: s32[]) -> bf16[128,128] {
  %p0 = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[]{:T(128)S(6)} parameter(1)
  %c0 = s32[]{:T(128)} constant(0)
  %ds = bf16[1,128,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,128,128}
  ROOT %b = bf16[128,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%matmul (q0: bf16[8,128], q1: bf16[4,128,128], q2: s32[]) -> bf16[8,128] {
  %q0 = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %q1 = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  %q2 = s32[]{:T(128)S(6)} parameter(2)
  %w = bf16[128,128]{1,0:T(8,128)(2,1)} fusion(%q1, %q2), kind=kLoop, calls=%slice_weight
  ROOT %y = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} convolution(%q0, %w), dim_labels=bf_io->bf
}

%to_vmem (r0: bf16[4,128,128], r1: s32[]) -> bf16[1,128,128] {
  %r0 = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %r1 = s32[]{:T(128)S(6)} parameter(1)
  %c1 = s32[]{:T(128)} constant(0)
  ROOT %ds2 = bf16[1,128,128]{2,1,0:T(8,128)(2,1)S(1)} dynamic-slice(%r0, %r1, %c1, %c1), dynamic_slice_sizes={1,128,128}
}

%body (state: (s32[], bf16[8,128], bf16[4,128,128], bf16[4,128,128])) -> (s32[], bf16[8,128], bf16[4,128,128], bf16[4,128,128]) {
  %state = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %one = s32[]{:T(128)} constant(1)
  %i = s32[]{:T(128)} get-tuple-element(%state), index=0
  %i.copy = s32[]{:T(128)S(6)} copy(%i)
  %x = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%state), index=1
  %ws = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%state), index=2
  %vs = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%state), index=3
  %v = bf16[1,128,128]{2,1,0:T(8,128)(2,1)S(1)} fusion(%vs, %i.copy), kind=kLoop, calls=%to_vmem
  %y = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} fusion(%x, %ws, %i.copy), kind=kOutput, calls=%matmul
  %next = s32[]{:T(128)} add(%i.copy, %one)
  ROOT %out = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}) tuple(%next, %y, /*index=2*/%ws, %vs)
}

%cond (s: (s32[], bf16[8,128], bf16[4,128,128], bf16[4,128,128])) -> pred[] {
  %s = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}) parameter(0)
  %n = s32[]{:T(128)} constant(4)
  %k = s32[]{:T(128)} get-tuple-element(%s), index=0
  ROOT %lt = pred[]{:T(512)} compare(%k, %n), direction=LT
}

ENTRY %main (x0: bf16[8,128], w0: bf16[4,128,128], v0: bf16[4,128,128]) -> bf16[8,128] {
  %x0 = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
  %w0 = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  %v0 = bf16[4,128,128]{2,1,0:T(8,128)(2,1)} parameter(2)
  %zero = s32[]{:T(128)} constant(0)
  %start = (bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[8,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x0)
  %x1 = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%start)
  %init = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}) tuple(%zero, %x1, %w0, /*index=3*/%v0)
  %loop = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}, bf16[4,128,128]{2,1,0:T(8,128)(2,1)}) while(%init), condition=%cond, body=%body
  %res = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%loop), index=1
  ROOT %home = bf16[8,128]{1,0:T(8,128)(2,1)} copy(%res)
}
"""


def test_tpu_programs_count_main_memory_only_and_loops_without_annotations():
    module = hb.parse(TPU_LIKE)
    cost = module.cost()
    (loop,) = cost.loops
    assert loop.trips == 4  # from the condition (i < 4), the start (0) and the step (+1)
    layer = 128 * 128 * 2
    body = {op.name: op for op in loop.body.ops}
    assert body["y"].read == layer  # the weight's layer, sliced inside the matmul's fusion; x is on chip
    assert body["v"].read == layer and body["v"].written == 0  # a layer copied to on-chip memory: read once
    x = 8 * 128 * 2
    counter = 4 + 8  # the count copied to scalar memory (read 4), incremented (a constant read, 4 written)
    test = 9  # the condition: two s32 read, a pred written; once per trip and once more
    assert cost.total() == x + 4 * (2 * layer + counter) + 5 * test + x  # x in, 4 layers of 2 matrices, x home
