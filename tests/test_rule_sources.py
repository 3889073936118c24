"""localleap_jax/rules/sources.py: a user's rules from a file, a module or an installed package's entry point, loaded
again after an edit without a crash, each rule's code identity; and every command's --rules mistakes in one line.

(The rules running by name through each command, and an edit rerunning what it changed: test_eval_gsm8k.py,
test_sweep.py, test_dynamics.py, test_lm_eval.py, test_dist_multihost.py.)"""

from __future__ import annotations

import re
import textwrap

import pytest

import localleap_jax as ll
from helpers import command_line_state_put_back, rules_put_back, write_user_rules
from localleap_jax.rules import RULES, sources
from localleap_jax.rules.sources import RulesError, code_identity, load_rules


@pytest.fixture(autouse=True)
def own_rules():
    with rules_put_back():  # what a test registers is gone after it
        yield


def registered(name: str) -> bool:
    return dict.__contains__(RULES, name)  # without the entry-point lookup of `name in RULES`


def test_a_file_loaded_again_runs_again_only_when_edited_and_its_rules_are_replaced(tmp_path):
    path = write_user_rules(tmp_path / "myrules.py")
    assert load_rules(str(path)) == ["steady", "confident"]
    steady, code = RULES["steady"], code_identity(ll.rule("steady"))
    assert code["defined_in"] == [f"{path.resolve()}:Steady"] and code["library"] == sources.library_version()
    assert load_rules(f"{path},{path}") == ["steady", "confident"] and RULES["steady"] is steady  # not run again
    builtin = code_identity(ll.rule("threshold"))["code"]
    confident = code_identity(ll.rule("confident"))["code"]

    write_user_rules(path, edited=True)
    assert load_rules(str(path)) == ["steady", "confident"]  # registering the same names again: no crash
    assert RULES["steady"] is not steady and code_identity(ll.rule("steady"))["code"] != code["code"]
    assert code_identity(ll.rule("confident"))["code"] != confident  # the module changed: its every rule
    assert code_identity(ll.rule("threshold"))["code"] == builtin  # nothing else

    path.write_text(path.read_text().replace('"steady"', '"steadier"'))  # a renamed rule: the old name goes
    assert load_rules(str(path)) == ["steadier", "confident"] and not registered("steady")
    steadier = RULES["steadier"]
    path.write_text(path.read_text() + "\n1 / 0\n")  # a failing edit keeps what the file registered before
    with pytest.raises(RulesError, match=r"importing it failed \(line \d+\): ZeroDivisionError: division by zero$"):
        load_rules(str(path))
    assert RULES["steadier"] is steadier and ll.rule("confident").name == "confident"


def test_a_name_another_source_registered_is_refused_and_nothing_of_that_source_stays(tmp_path):
    load_rules(str(write_user_rules(tmp_path / "a.py")))
    other = tmp_path / "b.py"
    other.write_text("import localleap_jax as ll\n\n@ll.register('other_fn')\ndef f(s):\n    return s.candidates\n\n"
                     "@ll.register('confident')\ndef g(s):\n    return s.candidates\n")
    with pytest.raises(RulesError, match=r"b.py: importing it failed \(line 7\): ValueError: rule 'confident' is "
                                         r"already registered \(by confident in localleap_jax_user_rules_a_\w+\); "
                                         r"choose another"):
        load_rules(str(other))
    assert not registered("other_fn")
    other.write_text("import localleap_jax as ll\n\n@ll.register('threshold')\ndef f(s):\n    return s.candidates\n")
    with pytest.raises(RulesError, match=r"rule 'threshold' is already registered \(by Threshold in "
                                         r"localleap_jax.rules.confidence\)"):
        load_rules(str(other))


def test_a_cell_run_twice_registers_its_rule_again():
    cell = textwrap.dedent("""
        import flax, localleap_jax as ll
        @ll.register("cell_rule")
        @flax.struct.dataclass
        class CellRule(ll.rules.RuleBase):
            def update(self, s, state):
                return s.candidates, state
    """)
    for _ in range(2):  # a notebook cell run again (the same module, the same class name)
        namespace = {"__name__": "notebook_cell"}
        exec(compile(cell, "<cell>", "exec"), namespace)
    assert RULES["cell_rule"] is namespace["CellRule"]


def test_a_module_by_name_and_again_after_an_edit(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_user_rules(tmp_path / "my_rules_module.py")
    assert load_rules("my_rules_module") == ["steady", "confident"]
    code = code_identity(ll.rule("steady"))
    assert code["defined_in"] == ["my_rules_module:Steady"]
    write_user_rules(tmp_path / "my_rules_module.py", edited=True)
    load_rules("my_rules_module")  # its file changed: imported again
    assert code_identity(ll.rule("steady"))["code"] != code["code"]


def test_code_identity_covers_sub_rules_functions_and_the_library_version(tmp_path, monkeypatch):
    path = write_user_rules(tmp_path / "myrules.py")
    load_rules(str(path))
    both = ll.any_of(ll.rule("steady"), ll.rule("threshold"))
    ident = code_identity(both)
    assert ident["defined_in"] == ["localleap_jax.rules.combinators:AnyOf", f"{path.resolve()}:Steady",
                                   "localleap_jax.rules.confidence:Threshold"]
    fn = ll.stateless(lambda s: s.candidates & (s.conf > 0.5), name="here")
    assert code_identity(fn)["defined_in"] == [f"{__name__}:test_code_identity_covers_sub_rules_functions_and_the_"
                                               "library_version.<locals>.<lambda>"]
    from localleap_jax.lm_eval import decode_settings  # what every answers key holds

    assert decode_settings(ll.DecodeConfig(strategy=both))["rule_code"] == ident["code"]
    monkeypatch.setattr(sources, "library_version", lambda: "another version")
    assert code_identity(both)["code"] != ident["code"]
    monkeypatch.undo()
    write_user_rules(path, edited=True)
    load_rules(str(path))
    assert code_identity(ll.any_of(ll.rule("steady"), ll.rule("threshold")))["code"] != ident["code"]


def test_a_helper_module_of_the_user_s_own_is_part_of_the_rule_s_code(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rule_helpers.py").write_text("THRESHOLD = 0.8\n")
    path = tmp_path / "helped.py"
    path.write_text("import localleap_jax as ll\nfrom my_rule_helpers import THRESHOLD\nimport my_rule_helpers\n\n"
                    "@ll.register('helped')\ndef helped(s):\n"
                    "    return s.candidates & (s.conf >= my_rule_helpers.THRESHOLD)\n")
    load_rules(str(path))
    code = code_identity(ll.rule("helped"))["code"]
    (tmp_path / "my_rule_helpers.py").write_text("THRESHOLD = 0.9\n")  # what the next process imports
    assert code_identity(ll.rule("helped"))["code"] != code


def test_an_installed_package_s_entry_points_are_loaded_when_a_name_is_not_found(tmp_path, monkeypatch):
    from localleap_jax.commands import sweep

    site = tmp_path / "site"
    (site / "ep_rules_pkg").mkdir(parents=True)
    write_user_rules(site / "ep_rules_pkg" / "registered.py")
    (site / "ep_rules_pkg" / "__init__.py").write_text("")
    (site / "ep_rules_pkg" / "plain.py").write_text(
        "def wide(s):\n    return s.candidates & (s.conf > 0.1)\n")  # a function the package does not register itself
    info = site / "ep_rules_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rules-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[localleap_jax.rules]\nsteady = ep_rules_pkg.registered\n"
                                           "wide = ep_rules_pkg.plain:wide\nbroken = ep_rules_pkg.missing\n")
    monkeypatch.syspath_prepend(str(site))
    assert not registered("steady")
    assert ll.rule("steady", k=3).k == 3 and registered("confident")  # the module registers both
    assert ll.rule("wide").name == "wide"  # registered under the entry point's name
    assert [s.text for s in sources.loaded_sources()] == ["steady", "wide"]
    with pytest.raises(ll.DecodeError, match=r"^entry point broken = ep_rules_pkg.missing \(group localleap_jax.rules, "
                                             r"package ep-rules-pkg\): importing it failed: ModuleNotFoundError"):
        ll.rule("broken")
    # and in a command line: names and settings like the built-in ones
    args = sweep.parse_args(["--strategies", "steady,wide", "--grid", "steady:k=1;2", "--output", str(tmp_path / "o")])
    assert args.strategies == ["steady", "wide"] and args.grid == {"steady": {"k": [1, 2]}}


# ---------------------------------------------------------------- --rules mistakes, through every command

BROKEN = "import localleap_jax as ll\nx = 1 / 0\n"
SYNTAX = "def oops(:\n"
NOTHING = "import localleap_jax as ll\nRATE = 0.5\n"
TAKEN = "import localleap_jax as ll\n\n@ll.register('threshold')\ndef mine(s):\n    return s.candidates\n"


def _eval(argv):
    from localleap_jax.commands import eval_gsm8k

    return eval_gsm8k.main(argv)


def _sweep(argv):
    from localleap_jax.commands import sweep

    return sweep.main(argv)


def _dynamics(argv):
    from localleap_jax.commands import analyze_dynamics

    return analyze_dynamics.main(argv)


def _adapter(argv):
    from localleap_jax.lm_eval import main

    assert argv[0] == "--rules"  # --rules X --output OUT -> model_args rules=X (the adapter writes no output there)
    return main(["--model", "localleap", "--model_args", f"checkpoint=embedded,rules={argv[1]}", "--tasks", "gsm8k"])


MISTAKES = [  # (command, --rules value, what the one line says after "error: ")
    (_eval, "{tmp}/nope.py", r"--rules \S+/nope.py: no such file$"),
    (_eval, "{tmp}", r"--rules \S+ is a directory: give a .py file, or a module name \(mypkg.rules\)$"),
    (_eval, "no_such_rules_module", r"--rules no_such_rules_module: no module named 'no_such_rules_module'; give a "),
    (_eval, "not a module!", r"--rules 'not a module!' is neither a Python file .* nor a module name"),
    (_eval, "{tmp}/broken.py", r"--rules \S+/broken.py: importing it failed \(line 2\): ZeroDivisionError: division by "
                               r"zero$"),
    (_eval, "{tmp}/syntax.py", r"--rules \S+/syntax.py: importing it failed \(line 1\): SyntaxError: "),
    (_eval, "{tmp}/nothing.py", r"--rules \S+/nothing.py registers no rule: decorate a rule class or function with "
                                r"@ll.register\(\"name\"\)$"),
    (_eval, "{tmp}/taken.py", r"--rules \S+/taken.py: importing it failed \(line 3\): ValueError: rule 'threshold' is "
                              r"already registered \(by Threshold in localleap_jax.rules.confidence\)"),
    (_eval, ",", r"--rules no file or module named"),
    (_sweep, "{tmp}/broken.py", r"--rules \S+/broken.py: importing it failed \(line 2\): ZeroDivisionError"),
    (_dynamics, "{tmp}/nothing.py", r"--rules \S+/nothing.py registers no rule"),
    (_adapter, "{tmp}/nope.py", r"model_args rules \S+/nope.py: no such file$"),
    (_adapter, "{tmp}/broken.py", r"model_args rules \S+/broken.py: importing it failed \(line 2\): ZeroDivisionError"),
]


@pytest.mark.parametrize("command, given, message", MISTAKES,
                         ids=[f"{c.__name__[1:]}-{g.split('/')[-1] or g}" for c, g, _ in MISTAKES])
def test_a_bad_rules_source_ends_every_command_in_one_line(tmp_path, capfd, command, given, message):
    for name, text in (("broken", BROKEN), ("syntax", SYNTAX), ("nothing", NOTHING), ("taken", TAKEN)):
        (tmp_path / f"{name}.py").write_text(text)
    out = tmp_path / "out"
    capfd.readouterr()
    with command_line_state_put_back():
        try:
            code = command(["--rules", given.format(tmp=tmp_path), "--output", str(out)])
        except SystemExit as e:
            code = e.code
    err = capfd.readouterr().err
    lines = [line for line in err.strip().splitlines() if "INFO" not in line]  # lm-eval's own logging, if any
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert re.match(message, lines[0][len("error: "):]), lines[0]
    assert not out.exists()


@pytest.mark.parametrize("command, argv, message", [
    (_eval, ["--strategies", "steadyy"], r"--strategies steadyy: unknown strategy 'steadyy'; choose from .*; a rule of "
                                         r"your own: --rules path/to/myrules.py$"),
    (_sweep, ["--strategies", "steadyy"], r"argument --strategies: unknown rule 'steadyy'; .*\(a rule of your own: "
                                          r"--rules path/to/myrules.py\)$"),
    (_dynamics, ["--strategy", "steadyy"], r"--strategy steadyy: unknown strategy 'steadyy'; .*; a rule of your own: "
                                           r"--rules path/to/myrules.py$"),
])
def test_an_unknown_name_says_how_to_bring_a_rule_of_your_own(tmp_path, capfd, command, argv, message):
    capfd.readouterr()
    try:
        code = command([*argv, "--output", str(tmp_path / "out")])
    except SystemExit as e:
        code = e.code
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and re.match(message, lines[0][len("error: "):]), lines


# ---------------------------------------------------------------- a user's rule that fails while traced (issue #40)
# Each failing line is marked "# <- name": the one line must name the file and that line (or, for the arity and the
# returned value, the line of the update's def).

FAILING_RULES = '''
import flax
import jax.numpy as jnp
import numpy as np
import localleap_jax as ll


@ll.register("raises")
def raises(s):
    raise ValueError("my rule needs a kappa per row")  # <- raises


@ll.register("branches")
def branches(s):
    if s.conf.max() > 0.9:  # <- branches
        return s.candidates
    return s.candidates & (s.conf > 0.5)


@ll.register("numpy")
def numpy_rule(s):
    return s.candidates & np.asarray(s.conf > 0.5)  # <- numpy


@ll.register("arity")
@flax.struct.dataclass
class Arity(ll.rules.RuleBase):
    def update(self, s):  # <- arity
        return s.candidates, ()


@ll.register("bare")
@flax.struct.dataclass
class Bare(ll.rules.RuleBase):
    def update(self, s, state):  # <- bare
        return s.candidates


@ll.register("drifts")
@flax.struct.dataclass
class Drifts(ll.rules.RuleBase):
    def init(self, batch, block, vocab):
        return jnp.zeros((batch,), jnp.int32)

    def update(self, s, state):  # <- drifts
        return s.candidates, state + 0.5
'''

TRACED_FAILURES = {  # failure class -> (rule, what the line says after "<file>:<line>")
    "exception": ("raises", r" raised ValueError in update: my rule needs a kappa per row$"),
    "traced-branch": ("branches", r" branches in Python on a traced value \(if, while, and, or, bool\(\) on a signal "
                                  r"or setting\): use jnp.where\(condition, a, b\); "),
    "numpy-on-a-tracer": ("numpy", r" calls NumPy on a traced value: use jax.numpy \(jnp\) in update, not numpy; "),
    "wrong-arity": ("arity", r": update\(s\) cannot take the loop's call update\(signals, state\)$"),
    "returns-no-pair": ("bare", r" returned an array \(\d+, \d+\) from update; expected a pair \(commit, state\): "),
    "returns-another-state": ("drifts", r" returned a state whose array 0 is float32\[\d+\], not int32\[\d+\]: return "
                                        r"the state as init builds it"),
}


@pytest.fixture(scope="module")
def failing_rules(tmp_path_factory):
    """(the rules file, a local GSM8K task directory for the adapter)."""
    from localleap_jax.gsm8k import local_task

    tmp = tmp_path_factory.mktemp("failing")
    path = tmp / "bad_rules.py"
    path.write_text(FAILING_RULES)
    data = tmp / "good.jsonl"
    data.write_text("".join('{"question": "Mia has %d apples and buys 2 more. How many apples?", '
                            '"answer": "#### %d"}\n' % (n, n + 2) for n in (3, 5, 7)))
    _, tasks = local_task(tmp / "task", data, data)
    return path, tasks


def _expected(path, failure: str) -> str:
    """The one line's pattern: the rule, the file and the marked line, what happened and what to do."""
    name, what = TRACED_FAILURES[failure]
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.endswith(f"# <- {name}"))
    return rf"rule '{name}' at {re.escape(str(path))}:{line}{what}"


def _one_error_line(r, out) -> str:
    """The checks every command's ending shares; returns the error line's text after "error: "."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # One line starts with "error:", the last; what comes before it (lm-eval's logging and progress bars, once lm-eval
    # runs) reports no other failure.
    assert [line for line in lines if "error:" in line] == lines[-1:], r.stderr[-3000:]
    assert not [line for line in lines[:-1] if re.search(r"Error|Exception", line)], r.stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))  # nothing written, nothing half-written
    return lines[-1][len("error: "):]


def _python(*args):
    import subprocess
    import sys

    from helpers import REPO

    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("failure", TRACED_FAILURES)
def test_a_rule_that_fails_while_traced_ends_eval_gsm8k_in_one_line(failing_rules, tmp_path, failure):
    path, _ = failing_rules
    out = tmp_path / "out"
    r = _python("experiments/eval_gsm8k.py", "--rules", path, "--strategies", TRACED_FAILURES[failure][0],
                "--limit", 2, "--output", out)
    error = _one_error_line(r, out)
    assert re.search(_expected(path, failure), error), error
    assert sorted(p.name for p in path.parent.iterdir()) == ["bad_rules.py", "good.jsonl", "task"]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["traced-branch", "wrong-arity"])  # while generating; before loading anything
def test_a_rule_that_fails_while_traced_ends_the_lm_eval_adapter_in_one_line(failing_rules, tmp_path, failure):
    path, tasks = failing_rules
    out = tmp_path / "out"
    r = _python("-m", "localleap_jax.lm_eval", "--model", "localleap", "--model_args",
                f"checkpoint=embedded,rules={path},strategy={TRACED_FAILURES[failure][0]},stats_path={out}/stats.jsonl",
                "--tasks", "gsm8k_local", "--include_path", tasks, "--limit", 2, "--num_fewshot", 1)
    error = _one_error_line(r, out)
    assert re.search(_expected(path, failure), error), error


@pytest.mark.parametrize("command, argv", [(_sweep, ["--strategies", "raises"]), (_dynamics, ["--strategy", "raises"])],
                         ids=["sweep", "dynamics"])
def test_a_rule_that_fails_while_traced_ends_sweep_and_dynamics_in_one_line(failing_rules, tmp_path, capfd, command,
                                                                            argv):
    from typing import NamedTuple

    class Ran(NamedTuple):
        returncode: int
        stderr: str

    path, _ = failing_rules
    out = tmp_path / "out"
    capfd.readouterr()
    with command_line_state_put_back():
        code = command(["--rules", str(path), *argv, "--limit", "2", "--output", str(out)])
    error = _one_error_line(Ran(code, capfd.readouterr().err), out)
    assert re.search(_expected(path, "exception"), error), error
