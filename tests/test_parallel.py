"""pmap generation on 4 (virtual CPU) devices equals single-device generation, for a batch of 5."""

import json
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import json, sys
import jax, numpy as np
import localleap_jax as ll
from localleap_jax.parallel import generate_parallel
from localleap_jax.tokenizer import left_pad
assert jax.local_device_count() == 4, jax.devices()
model = ll.load(sys.argv[1], dtype="float32")
prompts = [[5, 17, 42], [120, 3, 3, 250, 11], [77], [8, 9, 10, 11], [200, 201]]
ids, mask = left_pad(prompts, model.config.pad_token_id)
res = {}
for strategy in ("low_confidence", "localleap"):
    cfg = ll.DecodeConfig(strategy=strategy, gen_length=16, block_length=8, kappa=0.5, tau=0.3)
    one = ll.generate(model, ids, mask, cfg)
    par = generate_parallel(model, ids, mask, cfg)
    again = generate_parallel(model, ids[::-1], mask[::-1], cfg)  # same shapes: no recompilation
    res[strategy] = dict(tokens=bool((one.tokens == par.tokens).all()), nfe=bool((one.nfe == par.nfe).all()),
                         shape=list(par.tokens.shape), reversed=bool((again.tokens == par.tokens[::-1]).all()),
                         recompiled=again.compile_seconds > 0)
print(json.dumps(res))
"""


def test_pmap_over_four_devices_equals_one_device(converted):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(converted)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for strategy, got in res.items():
        assert got == dict(tokens=True, nfe=True, shape=[5, got["shape"][1]], reversed=True, recompiled=False), strategy
