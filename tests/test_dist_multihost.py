"""Multi-process runs: the leader/follower protocol in one process (messages, a DecodeConfig crossing
exactly, the follower loop on a stand-in transport, releasing the followers however the leader ends),
the command lines' mistakes in one line, and (slow) two real processes on this machine running
eval_gsm8k.py: the same samples as one process, nothing written by the follower, and a run whose
leader is killed midway resumes generating only the rest."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

import localleap_jax as ll
from helpers import REPO
from localleap_jax import synthetic_math
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.dist.messages import HEADER_WORDS, Message, pack, payload_template, unpack
from localleap_jax.dist import multihost as dist_multihost
from localleap_jax.dist.multihost import Follower, Leader, follow
from localleap_jax.partition import make_mesh
from localleap_jax.processes import LostProcessError
from localleap_jax.rules import DecodeError


class QueueTransport:
    """broadcast_one_to_all's contract, in one process: each receive names exactly the structure, shapes
    and dtypes of the matching send (the real broadcast needs them equal on every process)."""

    def __init__(self):
        self.sent: list = []

    def send(self, tree):
        self.sent.append(jax.tree.map(np.array, tree))

    def receive(self, template):
        tree = self.sent.pop(0)
        assert jax.tree.structure(tree) == jax.tree.structure(template)
        for a, t in zip(jax.tree.leaves(tree), jax.tree.leaves(template)):
            assert a.shape == t.shape and a.dtype == t.dtype, (a.shape, a.dtype, t.shape, t.dtype)
        return tree


# Float32 values that six significant digits (what a rule spec string holds) do not pin down.
KAPPAS = np.array([0.123456789, 0.9, 0.87654321], np.float32)


def per_row_config(**kw):
    rule = ll.rule("localleap", kappa=KAPPAS * np.float32(0.5) + np.float32(0.5), tau=KAPPAS * np.float32(0.5),
                   radius=np.array([1, 4, 7]))
    return ll.DecodeConfig(strategy=rule, gen_length=16, block_length=8, **kw)


def crossed(cfg):
    """What a follower rebuilds from the message's JSON text."""
    return ll.DecodeConfig.from_json(json.loads(json.dumps(cfg.to_json())))


def rows_of(rule, batch=3):
    return [np.asarray(a) for a in jax.tree.leaves(rule.with_rows(batch))]


def test_a_decode_config_crosses_exactly_with_per_row_settings():
    cfg = per_row_config(temperature=0.3, cache="dual", early_stop=True, logits_eos_inf=True)
    back = crossed(cfg)
    assert type(back.rule) is type(cfg.rule)
    for f in ("gen_length", "block_length", "temperature", "early_stop", "logits_eos_inf", "confidence_eos_eot_inf",
              "cache", "prompt_bucket"):
        assert getattr(back, f) == getattr(cfg, f), f
    want, got = rows_of(cfg.rule), rows_of(back.rule)
    assert all(w.dtype == g.dtype and np.array_equal(w, g) for w, g in zip(want, got))
    assert back.fingerprint() == cfg.fingerprint()
    # Why not the spec string: it rounds these settings (so the follower would decode other tokens).
    from_spec = rows_of(ll.rule(cfg.rule.spec()))
    assert not all(np.array_equal(w, s) for w, s in zip(want, from_spec))


def test_combined_rules_and_the_shared_flags_rule_cross_too():
    combined = ll.any_of(ll.rule("eb", gamma=np.float32([0.0123456789, 0.5])), ll.rule("threshold", kappa=0.8))
    back = crossed(ll.DecodeConfig(strategy=ll.all_of(combined, ll.rule("stable", k=3)), gen_length=16, block_length=8))
    assert type(back.rule).__name__ == "AllOf" and type(back.rule.rules[0]).__name__ == "AnyOf"
    assert np.array_equal(back.rule.rules[0].rules[0].gamma, np.float32([0.0123456789, 0.5]))
    assert back.rule.rules[1].k == 3
    flags = crossed(ll.DecodeConfig(strategy=ll.rules.with_shared_settings("localleap", kappa=0.8, tau=0.7),
                                    gen_length=16, block_length=8))
    assert (flags.rule.kappa, flags.rule.tau, flags.rule.radius) == (0.8, 0.7, 4)


def test_a_rule_that_exists_only_in_this_process_is_refused():
    only_here = ll.stateless(lambda s: s.conf > 0.5, "only_here")
    with pytest.raises(DecodeError, match="rule 'only_here' cannot be sent to the other processes"):
        ll.DecodeConfig(strategy=only_here).to_json()


def test_messages_round_trip_and_a_stranger_is_refused():
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]], bool)
    key = np.array([7, 4294967295], np.uint32)
    for msg in (Message("stop", status=130), Message("load", {"path": "/x", "mesh": [2, 2]}),
                Message("generate", {"config": {"a": 1.5}}, ids=ids, mask=mask, key=key)):
        header, payload = pack(msg)
        assert header.shape == (HEADER_WORDS,) and header.dtype == np.int32
        template = payload_template(header)  # what a follower allocates from the header alone
        assert {k: (v.shape, v.dtype) for k, v in template.items()} == {k: (v.shape, v.dtype) for k, v in payload.items()}
        back = unpack(header, payload)
        assert (back.kind, back.meta, back.status) == (msg.kind, msg.meta, msg.status)
        for name in ("ids", "mask", "key"):
            a, b = getattr(msg, name), getattr(back, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), name
    header[0] = 12345
    with pytest.raises(LostProcessError, match="same version"):
        unpack(header, payload)


class RecordingFollower(Follower):
    """A follower that keeps what each message's call returned (the test's view; the protocol drops it)."""

    def __init__(self):
        super().__init__()
        self.returned = []

    def handle(self, msg):
        self.returned.append((msg.kind, super().handle(msg)))
        return self.returned[-1][1]


@pytest.fixture(scope="module")
def embedded32():
    return ll.load(EMBEDDED, dtype="float32")


def test_the_follower_carries_out_what_the_leader_did(embedded32):
    transport = QueueTransport()
    lead = Leader(transport)
    mesh = make_mesh(1, 1)
    model = lead.load(EMBEDDED, "float32", mesh)
    ids, mask = model.tokenizer.encode_batch([p["question"] for p in synthetic_math.take("test", 3, seed=1)])
    greedy = lead.generate(model, ids, mask, per_row_config(), mesh=mesh)
    sampled = lead.generate(model, ids, mask, per_row_config(temperature=1.0), jax.random.key(11), mesh=mesh)
    contexts, continuations = [[5, 17, 42], [77]], [[9, 9, 3], [12]]  # ragged: they travel left-padded
    lcfg = ll.LikelihoodConfig(mc_num=8, batch_size=4, cfg_scale=0.5)
    scored = lead.loglikelihood(model, contexts, continuations, lcfg, mesh=mesh)
    lead.stop(3)
    follower = RecordingFollower()
    assert follow(transport, follower) == 3 and not transport.sent
    generated = [out for kind, out in follower.returned if kind == "generate"]
    assert len(generated) == 2 and follower.mesh.shape == mesh.shape
    assert np.array_equal(generated[0].tokens, greedy.tokens) and np.array_equal(generated[0].nfe, greedy.nfe)
    assert np.array_equal(generated[1].tokens, sampled.tokens) and np.array_equal(generated[1].nfe, sampled.nfe)
    (follower_scores,) = [out for kind, out in follower.returned if kind == "loglikelihood"]
    assert np.array_equal(follower_scores, scored)  # the same requests and settings crossed, exactly
    assert np.allclose(scored, ll.loglikelihood(embedded32, contexts, continuations, lcfg), rtol=0, atol=1e-5)
    # The leader's own outputs against the model loaded without the protocol.
    plain = ll.generate(embedded32, ids, mask, per_row_config())
    assert np.array_equal(greedy.tokens, plain.tokens) and np.array_equal(greedy.nfe, plain.nfe)
    assert not np.array_equal(sampled.tokens, greedy.tokens)  # the sampled call really sampled
    for a, b in zip(jax.tree.leaves(follower.model.params), jax.tree.leaves(embedded32.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_inputs_the_leader_refuses_never_reach_the_followers(embedded32):
    transport = QueueTransport()
    lead = Leader(transport)
    ids = np.array([[5, 6], [7, 8]], np.int32)
    mask = np.array([[True, True], [False, False]])  # row 1 has no prompt
    with pytest.raises(DecodeError, match=r"rows \[1\] have an empty prompt"):
        lead.generate(embedded32, ids, mask, per_row_config(), mesh=make_mesh(1, 1))
    with pytest.raises(DecodeError, match="cannot be sent"):
        lead.generate(embedded32, ids[:1], mask[:1], ll.DecodeConfig(strategy=ll.stateless(lambda s: s.conf > 0.5)),
                      mesh=make_mesh(1, 1))
    with pytest.raises(DecodeError, match=r"ids is ragged \(row 0 has 2 ids, row 1 has 1\)"):
        lead.generate(embedded32, [[5, 6], [7]], None, per_row_config(), mesh=make_mesh(1, 1))
    with pytest.raises(ll.LikelihoodError, match="request 1: the continuation is empty"):
        lead.loglikelihood(embedded32, [[5], [6]], [[7], []], ll.LikelihoodConfig(), mesh=make_mesh(1, 1))
    assert transport.sent == []


@pytest.mark.parametrize("ending, status", [("normal", 0), ("error", 2), ("ctrl-c", 130), ("own status", 5)])
def test_leading_releases_the_followers_however_the_block_ends(monkeypatch, ending, status):
    transport = QueueTransport()
    monkeypatch.setattr(dist_multihost, "_LEADER", Leader(transport))
    raised = {"error": ValueError, "ctrl-c": KeyboardInterrupt}.get(ending)
    try:
        with dist_multihost.leading() as lead:
            if ending == "own status":
                lead.stop(5)
            if raised:
                raise raised()
    except (ValueError, KeyboardInterrupt) as e:
        assert type(e) is raised
    assert len(transport.sent) == 1  # one stop, however many times stop was asked for
    assert follow(transport, Follower()) == status


MISTAKES = [  # (eval_gsm8k.py flags, the one error line); run with 4 devices in one process
    (["--mesh", "data=3"], r"error: --mesh 'data=3': data=3 does not divide the 4 devices"),
    (["--mesh", "data=2,model=4"], r"error: --mesh 'data=2,model=4': data x model = 8 devices, but there are 4 "),
    (["--mesh", "2x2"], r"error: argument --mesh '2x2': expected data=D,model=M"),
    (["--num-processes", "2", "--process-id", "1"], r"error: --num-processes/--process-id need --coordinator"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
     r"error: --process-id 2: expected 0 to 1 \(--num-processes 2\)"),
    (["--coordinator", "localhost:1234", "--num-processes", "2"], r"error: --coordinator needs --num-processes N"),
]
ADAPTER_MISTAKES = [
    ("mesh=data=3;model=1", r"error: model_args mesh 'data=3;model=1': data x model = 3 devices, but there are 4"),
    ("process_id=1", r"error: model_args num_processes/model_args process_id need model_args coordinator"),
]

MISTAKES_SCRIPT = r"""
import contextlib, io, json, sys
from localleap_jax.commands import eval_gsm8k
from localleap_jax import lm_eval
out = []
for flags in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = eval_gsm8k.main(flags)
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
for model_args in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = lm_eval.main(["--model", "localleap", "--model_args", "checkpoint=embedded," + model_args,
                                     "--tasks", "gsm8k", "--limit", "1"])
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def test_command_line_mistakes_end_in_one_line_and_leave_nothing(tmp_path):
    out = tmp_path / "out"
    flags = [[*f, "--output", str(out), "--limit", "2"] for f, _ in MISTAKES]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {os.environ.get('XLA_FLAGS', '')}",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", MISTAKES_SCRIPT, json.dumps(flags),
                        json.dumps([a for a, _ in ADAPTER_MISTAKES])], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for (code, err), (_, pattern) in zip(results, MISTAKES + ADAPTER_MISTAKES):
        lines = [line for line in err.strip().splitlines() if line.startswith("error:") or "Traceback" in line]
        assert code == 2 and len(lines) == 1 and re.match(pattern, lines[0]), (pattern, code, err[-2000:])
    assert not out.exists() and not any(tmp_path.iterdir())


# ---------------------------------------------------------------- two real processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def rows_by_id(out: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


def batches_generated(stdout: str) -> int:
    return int(re.search(r"\((\d+) batches generated", stdout).group(1))


def cached_answers(out: Path) -> int:
    from sqlitedict import SqliteDict

    (db,) = out.glob("cache/*.db")
    with SqliteDict(str(db)) as d:
        return sum(isinstance(v, str) for v in d.values())


def answers_in_cache(out: Path) -> int:
    """Answers the response cache holds now, read without writing to it (0 while it does not exist yet)."""
    import sqlite3
    from contextlib import closing

    for db in out.glob("cache/*.db"):
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1)) as con:
                return con.execute("SELECT COUNT(*) FROM unnamed").fetchone()[0] - 1  # less the owner record
        except sqlite3.Error:  # not created yet, or being written
            return 0
    return 0


GLOO_NOTE = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def only_gloo_notes(text: str) -> bool:
    """Whether `text` is nothing but copies of GLOO_NOTE, however their characters interleave: its characters,
    digits and whitespace aside, are those of as many notes as it holds '[' (one per note)."""
    def letters(s):
        return Counter(c for c in s if not c.isdigit() and not c.isspace())
    note = letters(GLOO_NOTE)
    return letters(text) == Counter({c: k * text.count("[") for c, k in note.items()})


def test_the_gloo_note_check_takes_interleaved_notes_and_nothing_else():
    seen = ("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
            "[Gloo] Rank [Gloo] Rank 10 is connected to  is connected to 11 peer ranks.  peer ranks. Expected number "
            "of connected peer ranks is : 1Expected number of connected peer ranks is : \n1\n")  # a follower's stdout
    assert only_gloo_notes(seen) and only_gloo_notes("")
    assert not only_gloo_notes(seen + "loaded\n") and not only_gloo_notes(seen.replace("peer", "pear", 1))


WRITES = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|^\d+\s+(mkdir|rename|unlink|rmdir|link|symlink|truncate|creat)")


def follower_writes(trace: Path) -> list[str]:
    """File writes the traced follower made: opens for writing, and calls that change a directory.
    (Not /proc: naming its own threads; not /dev/null: silencing stderr at a lost leader; not failed calls.)"""
    found = []
    for line in trace.read_text().splitlines():
        if WRITES.search(line) and not re.search(r'"/proc/(self|thread-self)/|"/dev/null"|= -1 E', line):
            found.append(line)
    return found


class Run:
    """Both processes of one eval_gsm8k.py run; the follower under strace when there is one."""

    def __init__(self, tmp: Path, name: str, flags: list[str], port: int):
        self.logs = tmp / name
        self.logs.mkdir()
        base = {**os.environ, "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('XLA_FLAGS', '')}",
                "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "LOCALLEAP_COMPILE_CACHE": str(tmp / "xla-cache"), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, str(REPO / "experiments" / "eval_gsm8k.py"), *flags, "--coordinator",
               f"localhost:{port}", "--num-processes", "2", "--process-id"]
        self.trace = self.logs / "follower.strace" if shutil.which("strace") else None
        # The follower gets a home, temporary and working directory of its own, empty, to be looked at after.
        self.own = self.logs / "follower-home"
        self.own.mkdir()
        tracer = (["strace", "-f", "--seccomp-bpf", "-o", str(self.trace), "-e",
                   "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,rmdir,link,"
                   "linkat,symlink,symlinkat,truncate"] if self.trace else [])
        self.procs = []
        for i in (0, 1):
            env = {**base, "HOME": str(self.own), "TMPDIR": str(self.own)} if i else base
            self.procs.append(subprocess.Popen(
                [*(tracer if i else []), *cmd, str(i)], cwd=self.own if i else REPO, env=env,
                stdout=open(self.logs / f"p{i}.out", "w"), stderr=open(self.logs / f"p{i}.err", "w")))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.time())) for p in self.procs]

    def out(self, i: int) -> str:
        return (self.logs / f"p{i}.out").read_text()

    def err(self, i: int) -> str:
        return (self.logs / f"p{i}.err").read_text()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_two_processes_match_one_write_only_from_process_0_and_resume(tmp_path):
    from localleap_jax.commands import eval_gsm8k

    n = 24  # problems: 12 batches of 2, so the leader dies with most of them still to do
    flags = ["--checkpoint", "embedded", "--limit", str(n), "--batch-size", "2", "--strategies", "localleap"]
    reference = tmp_path / "one-process"
    assert eval_gsm8k.main([*flags, "--output", str(reference), "--no-compile-cache"]) == 0
    want = rows_by_id(reference)
    out = tmp_path / "two-processes"
    (tmp_path / "xla-cache").mkdir()
    two = [*flags, "--mesh", "data=2,model=2", "--output", str(out)]
    runs = []
    try:
        # 1. Kill the leader once a few batches are in the cache: the follower must end by itself.
        first = Run(tmp_path, "first", two, free_port())
        runs.append(first)
        deadline = time.time() + 240
        while answers_in_cache(out) < 4:
            assert all(p.poll() is None for p in first.procs) and time.time() < deadline, first.err(0)[-3000:]
            time.sleep(0.05)
        first.procs[0].send_signal(signal.SIGKILL)
        t_killed = time.time()
        follower_status = first.procs[1].wait(timeout=60)  # would raise if it hung
        follower_seconds = time.time() - t_killed
        last = first.err(1).strip().splitlines()[-1]
        assert follower_status != 0, first.err(1)[-2000:]
        assert re.match(r"error: process 1: lost contact with the other processes", last) or \
            "Terminating process because the JAX distributed service detected fatal errors" in first.err(1), last
        cached = cached_answers(out)
        assert 4 <= cached < n and not (out / "summary.json").exists()

        # 2. The same command again: resumes, generating only what the cache lacks.
        t0 = time.time()
        second = Run(tmp_path, "second", two, free_port())
        runs.append(second)
        assert second.wait(timeout=400) == [0, 0], (second.err(0)[-3000:], second.err(1)[-3000:])
        second_seconds = time.time() - t0
        # calls of --queue's default 4 x --slots (= --batch-size 2) prompts, through the slots on the mesh
        assert batches_generated(second.out(0)) == -(-(n - cached) // 8)
        assert "took over" in second.err(0)  # the lock the killed leader left, taken over with a note
        got = rows_by_id(out)
        assert got.keys() == want.keys() and len(got) == n
        for k in want:
            assert (got[k]["generated"], got[k]["nfe"]) == (want[k]["generated"], want[k]["nfe"]), k
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["mesh"] == {"data": 2, "model": 2} and summary["config"]["processes"] == 2

        # 3. The follower wrote nothing: no file opened for writing, no directory changed, anywhere; and it
        # printed only gloo's connection notes, which gloo's threads print unsynchronised (seen interleaved down
        # to single characters): its stdout, digits and spaces aside, is exactly some number of those notes.
        assert only_gloo_notes(second.out(1)), second.out(1)
        for run in runs:
            assert not any(run.own.iterdir()), list(run.own.iterdir())
            if run.trace is not None:
                assert run.trace.stat().st_size > 0
                assert follower_writes(run.trace) == []
        assert any((tmp_path / "xla-cache").iterdir())  # process 0 did write its compiled programs
        print(f"follower ended {follower_seconds:.1f}s after its leader was killed: {last!r}; {cached} answers "
              f"cached before the kill; the resumed run took {second_seconds:.0f}s for the other {n - cached}; "
              f"strace: {first.trace is not None}")
    finally:
        for run in runs:
            run.kill()
    if first.trace is None:
        pytest.skip("strace is not installed: the follower's writes were not traced (everything else was checked)")


def test_a_follower_loads_the_leaders_rule_file_and_refuses_other_bytes(embedded32, tmp_path, capsys):
    """Issue #22: a generate message names the rule files the rule's code comes from, with their bytes' digest; a
    follower that has not loaded them loads them, and one whose copy differs refuses in one line (and the leader with
    it, before the collective generation)."""
    from helpers import rules_put_back, write_user_rules
    from localleap_jax.rules import RULES, registry, sources

    def as_a_fresh_follower(path):  # this process, as another one that never loaded the file
        for name in ("steady", "confident"):
            registry.unregister(name)
        loaded = sources._LOADED.pop(str(path.resolve()))
        sources._BY_MODULE.pop(loaded.module)

    rules = write_user_rules(tmp_path / "myrules.py")
    with rules_put_back():
        ll.rules.load_rules(str(rules))
        transport, mesh = QueueTransport(), make_mesh(1, 1)
        lead = Leader(transport)
        model = lead.load(EMBEDDED, "float32", mesh)
        ids, mask = model.tokenizer.encode_batch([p["question"] for p in synthetic_math.take("test", 2, seed=1)])
        cfg = ll.DecodeConfig(strategy="steady:k=3", gen_length=16, block_length=16)  # by name: the class of now
        out = lead.generate(model, ids, mask, cfg, mesh=mesh)
        lead.stop(0)
        as_a_fresh_follower(rules)
        follower = RecordingFollower()
        assert follow(transport, follower) == 0
        (theirs,) = [o for kind, o in follower.returned if kind == "generate"]
        assert np.array_equal(theirs.tokens, out.tokens) and dict.__contains__(RULES, "steady")

        lead = Leader(transport)
        # a config resolves its rule once, at construction: the follower above loaded the file again (a new class)
        cfg = ll.DecodeConfig(strategy="steady:k=3", gen_length=16, block_length=16)
        lead.generate(model, ids, mask, cfg, mesh=mesh)
        lead.stop(0)
        as_a_fresh_follower(rules)
        write_user_rules(rules, edited=True)  # the follower's host holds another version of the file
        capsys.readouterr()
        follower, model_and_mesh = RecordingFollower(), (follower.model, follower.mesh)
        follower.model, follower.mesh = model_and_mesh  # loaded before (the first run's load message)
        assert follow(transport, follower) == 0
        assert [o for kind, o in follower.returned if kind == "generate"] == [None]
        assert re.fullmatch(r"error: process 0: the rules in \S+myrules.py differ from process 0's \(sha256 \w{12} "
                            r"here, \w{12} there\): every host needs the same file\n", capsys.readouterr().err)
