"""Joining the processes of a run: settings from flags or the environment, every mistake named; signals held
around a step every process must take together."""

import signal
import time

import pytest

from localleap_jax.processes import DistributedError, Processes, processes_from, signals_deferred


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
