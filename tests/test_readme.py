"""Every Python snippet of README.md runs as written on the shipped models and prints something meaningful.

The snippets are read from README.md itself, so README cannot drift from the code; each runs in a fresh namespace
in this process (one JAX runtime: the snippets share compiled programs where their shapes agree).
"""

import contextlib
import io
import re

import pytest

from helpers import REPO

SNIPPETS = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)

# What each snippet must print, in order of appearance: a pattern that only a working run matches.
EXPECTED = [
    r"\['.*#### 11'\] NFE \[\d+\]",                                  # Using it: the answer, and its NFE
    r"^\['top1', 'relaxed', '-', '-', 'relaxed', '-'\]$",              # one rule step by hand
    r"^\[\(0\.5, \d+\), \(0\.5, \d+\), \(0\.7, \d+\), .*\(0\.95, \d+\)\]$",  # per-row kappas
    r"confident NFE \[\d+\] \['.*#### 11'\]\nsteady NFE \[\d+\] \['.*#### 11'\]",  # a user's rules, by name
    r"^threshold NFE \[\d+\] edits \[0\] \['.*#### 11'\]\nrecheck NFE \[\d+\] edits \[[1-9]\d*\] \[.*\]$",  # edits
    r"^dllm_cache:\S+ NFE \[\d+\] \['.*#### 11'\]\ndkv:reload_every=8 NFE \[\d+\] \['.*#### 11'\]\n"
    r"vicinity:\S+ NFE \[\d+\] \['.*#### 11'\]$",                          # the field's caches
    r"^\[-\d+\.\d -\d+\.\d -\d+\.\d\] best: 7$",                     # log-likelihood of three choices
    r"^sdar 4 NFE \[\d+\] \['.*#### 4.*'\]$",                           # the block-diffusion twin
    r"\{'data': 1, 'model': 1\} \['.*#### 11'\]",                       # a mesh (one device here)
]


def test_every_snippet_has_an_expectation():
    assert len(SNIPPETS) == len(EXPECTED), [s.splitlines()[0] for s in SNIPPETS]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_the_readme_snippet_runs_and_prints_what_it_says(index):
    from localleap_jax.rules import RULES

    out, registered = io.StringIO(), dict(RULES)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(SNIPPETS[index], f"README.md python snippet {index + 1}", "exec"), {"__name__": "__readme__"})
    finally:  # the rules a snippet registers are its own: the next test sees the registry as it was
        RULES.clear()
        RULES.update(registered)
    printed = out.getvalue().strip()
    print(printed)
    assert re.search(EXPECTED[index], printed, flags=re.S | re.M), printed
    assert "['']" not in printed  # an empty answer is not a meaningful one


def test_readme_opens_with_two_self_contained_commands():
    """A venv line, then the main job and the test command, each installing what it needs (.ci/run runs the second)."""
    first = re.search(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M).group(1)
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 3 and lines[0].startswith("python3 -m venv .venv"), lines
    for line, role, runs in ((lines[1], "# the main job", "python experiments/eval_gsm8k.py"),
                             (lines[2], "# the test command", "python -m pytest")):
        command = line.split("#")[0].strip()
        assert line.rstrip().endswith(role) and command.startswith("pip install") and runs in command, line
        assert " && " in command  # set-up and run chained: a failed install stops the line
    assert "# the test command" in (REPO / ".ci" / "run").read_text()
