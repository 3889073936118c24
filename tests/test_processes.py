"""Joining the processes of a run: settings from flags or the environment, every mistake named; signals held
around a step every process must take together."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO
from localleap_jax.processes import DistributedError, Processes, join_timeout, processes_from, signals_deferred


def test_a_signal_inside_a_lockstep_step_waits_for_its_end():
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.05)  # a handler runs between bytecodes: it has had its chance
            reached_the_end = True
    assert reached_the_end


@pytest.mark.parametrize("given, environ, message", [
    (dict(num_processes=2, process_id=1), {}, "--num-processes/--process-id need --coordinator HOST:PORT"),
    (dict(coordinator="localhost"), {}, "--coordinator 'localhost': expected HOST:PORT"),
    (dict(coordinator="localhost:99999", num_processes=2, process_id=0), {}, "expected HOST:PORT"),
    (dict(coordinator="localhost:1234"), {}, "--coordinator needs --num-processes N and --process-id I"),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=2), {}, r"--process-id 2: expected 0 to 1"),
    (dict(), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two': expected a whole number"),
])
def test_process_settings_mistakes_are_named(given, environ, message):
    with pytest.raises(DistributedError, match=message):
        processes_from(**given, environ=environ)


def test_process_settings_come_from_flags_or_the_environment():
    assert not processes_from(environ={}).joins
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert processes_from(environ=env) == Processes("10.0.0.1:8476", 4, 3)
    assert processes_from(process_id=1, environ=env).process_id == 1  # a flag wins
    assert processes_from("auto", environ={}).coordinator == "auto"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_process_whose_peers_never_come_ends_in_one_line_naming_them(tmp_path):
    """Issue #22: a leader whose followers never came was silent for minutes (JAX's 300 s), then died in a C++
    check failure; so did a follower without its leader. Both real command lines, 3 s to wait, at once."""
    env = {**os.environ, "LOCALLEAP_JOIN_TIMEOUT": "3", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    runs = {i: subprocess.Popen([sys.executable, "experiments/eval_gsm8k.py", "--coordinator", f"127.0.0.1:{_free_port()}",
                                 "--num-processes", "2", "--process-id", str(i), "--limit", "2",
                                 "--output", str(tmp_path / f"out{i}")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in (0, 1)}
    t0 = time.monotonic()
    ended = {i: p.communicate(timeout=120) for i, p in runs.items()}
    assert time.monotonic() - t0 < 60  # seconds, not JAX's five minutes
    want = {0: r"process 0 waited 3 s at 127\.0\.0\.1:\d+ for process 1, which never joined \(--num-processes 2\)",
            1: r"process 1 of --num-processes 2 waited 3 s to join through 127\.0\.0\.1:\d+: process 0 \(the "
               r"coordinator\) or another process never came"}
    for i, (_, err) in ended.items():
        assert runs[i].returncode == 2, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and "Check failure" not in err, err[-3000:]
        assert re.fullmatch(rf"error: {want[i]}; start every process with the same command and its own --process-id, "
                            r"reaching 127\.0\.0\.1:\d+; LOCALLEAP_JOIN_TIMEOUT=SECONDS waits longer", err.strip()), err
        assert not (tmp_path / f"out{i}").exists()


@pytest.mark.parametrize("text", ["soon", "0", "-5", "inf", "nan"])
def test_a_join_timeout_that_is_not_seconds_is_named(text):
    with pytest.raises(DistributedError, match=rf"^LOCALLEAP_JOIN_TIMEOUT='{text}': expected a number of seconds > 0$"):
        join_timeout({"LOCALLEAP_JOIN_TIMEOUT": text})
    assert join_timeout({}) == 300 and join_timeout({"LOCALLEAP_JOIN_TIMEOUT": "7.5"}) == 7.5
