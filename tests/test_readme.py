"""README.md and the pages of docs/ as written: every Python snippet runs on the shipped models and prints something
meaningful, every relative link points to a file (and heading) that exists, and every command line of the evaluation
commands quoted there is accepted by that command's own parser.

The snippets are read from the pages themselves, so the pages cannot drift from the code; each runs in a fresh
namespace in this process (one JAX runtime: the snippets share compiled programs where their shapes agree).
"""

import contextlib
import io
import re
import shlex

import pytest

from helpers import REPO, USER_CACHE

PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


def text_of(page: str) -> str:
    return (REPO / page).read_text()


def snippets_of(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text_of(page), flags=re.S | re.M)


# What each page's snippets must print, in order of appearance: a pattern that only a working run matches. The pages
# are listed in the order their snippets run (the first snippets compile the programs the later ones share).
EXPECTED = {
    "README.md": [
        r"\['.*#### 11'\] NFE \[\d+\]",                                  # a first generation: the answer, its NFE
    ],
    "docs/rules.md": [
        r"^\['top1', 'relaxed', '-', '-', 'relaxed', '-'\]$",              # one rule step by hand
        r"^\[\(0\.5, \d+\), \(0\.5, \d+\), \(0\.7, \d+\), .*\(0\.95, \d+\)\]$",  # per-row kappas
        r"confident NFE \[\d+\] \['.*#### 11'\]\nsteady NFE \[\d+\] \['.*#### 11'\]",  # a user's rules, by name
        r"^threshold NFE \[\d+\] edits \[0\] \['.*#### 11'\]\nrecheck NFE \[\d+\] edits \[[1-9]\d*\] \[.*\]$",  # edits
    ],
    "docs/caches.md": [
        r"^dllm_cache:\S+ NFE \[\d+\] \['.*#### 11'\]\ndkv:reload_every=8 NFE \[\d+\] \['.*#### 11'\]\n"
        r"vicinity:\S+ NFE \[\d+\] \['.*#### 11'\]$",                      # the field's caches
    ],
    "docs/likelihood.md": [
        r"^\[-\d+\.\d -\d+\.\d -\d+\.\d\] best: 7$",                     # log-likelihood of three choices
    ],
    "docs/models.md": [
        r"^sdar 4 NFE \[\d+\] \['.*#### 4.*'\]$",                           # the block-diffusion twin
    ],
    "docs/distribution.md": [
        r"\{'data': 1, 'model': 1\} \['.*#### 11'\]",                       # a mesh (one device here)
    ],
    "docs/development.md": [],
    "docs/evaluation.md": [],
    "docs/performance.md": [],
}
CASES = [(page, index) for page, patterns in EXPECTED.items() for index in range(len(patterns))]


def test_every_page_and_snippet_has_an_expectation():
    assert sorted(EXPECTED) == sorted(PAGES)
    for page in PAGES:
        assert len(snippets_of(page)) == len(EXPECTED[page]), (page, [s.splitlines()[0] for s in snippets_of(page)])


@pytest.mark.parametrize("page, index", CASES, ids=[f"{page}:{index + 1}" for page, index in CASES])
def test_the_snippet_runs_and_prints_what_it_says(page, index):
    from localleap_jax.rules import RULES

    out, registered = io.StringIO(), dict(RULES)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(snippets_of(page)[index], f"{page} python snippet {index + 1}", "exec"),
                 {"__name__": "__readme__"})
    finally:  # the rules a snippet registers are its own: the next test sees the registry as it was
        RULES.clear()
        RULES.update(registered)
    printed = out.getvalue().strip()
    print(printed)
    assert re.search(EXPECTED[page][index], printed, flags=re.S | re.M), printed
    assert "['']" not in printed  # an empty answer is not a meaningful one


def test_readme_opens_with_two_self_contained_commands():
    """A venv line, then the main job and the test command, each installing what it needs (.ci/run runs the second)."""
    first = re.search(r"^```bash\n(.*?)^```", text_of("README.md"), flags=re.S | re.M).group(1)
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 3 and lines[0].startswith("python3 -m venv .venv"), lines
    for line, role, runs in ((lines[1], "# the main job", "python experiments/eval_gsm8k.py"),
                             (lines[2], "# the test command", "python -m pytest")):
        command = line.split("#")[0].strip()
        assert line.rstrip().endswith(role) and command.startswith("pip install") and runs in command, line
        assert " && " in command  # set-up and run chained: a failed install stops the line
    assert "# the test command" in (REPO / ".ci" / "run").read_text()
    assert len(text_of("README.md").splitlines()) <= 250  # a front page; the rest lives in docs/


# ---------------------------------------------------------------- links


def prose_of(text: str) -> str:
    """The text without fenced code blocks and inline code (a `[B](x)` there is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def anchors_of(text: str) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken, checked = [], 0
    for page in PAGES:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose_of(text_of(page))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (REPO / page).parent / path if path else REPO / page
            checked += 1
            if not file.resolve().is_file() or REPO not in file.resolve().parents:
                broken.append(f"{page}: {target} (no file {file.resolve()})")
            elif anchor and anchor not in anchors_of(file.read_text()):
                broken.append(f"{page}: {target} (no heading #{anchor} in {path or page})")
    assert not broken, "\n".join(broken)
    assert checked > 50  # the pages link to each other: a pattern that found nothing would pass any page


# ---------------------------------------------------------------- command lines

COMMANDS = ("eval_gsm8k", "sweep", "analyze_dynamics", "eval_likelihood")  # the commands whose parse_args is apart


def command_lines(text: str) -> list[list[str]]:
    """Every `python experiments/<command>.py ...` of a page, as its words: the lines of its bash blocks (continuations
    joined, comments dropped, `&&` chains split) and the inline code of its prose; those with a `...` placeholder left
    out."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while "&&" in words:
                found.append(words[:words.index("&&")])
                words = words[words.index("&&") + 1:]
            found.append(words)
    found += [shlex.split(span) for span in re.findall(r"`(python experiments/[^`]+)`",
                                                       re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))]
    return [w for w in found if len(w) > 1 and w[0] == "python" and "..." not in " ".join(w)
            and re.fullmatch(rf"experiments/({'|'.join(COMMANDS)})\.py", w[1])]


def test_every_quoted_command_line_is_accepted_by_its_parser(tmp_path, monkeypatch, capsys):
    """The flags of every evaluation command the pages quote exist and take the values given, and what a command
    requires (sweep's and analyze_dynamics' --output) is there: a command as written passes its own parser."""
    import importlib

    from localleap_jax.rules import RULES

    # The pages' `--rules myrules.py` is the rules page's Steady class in a file (the page says so).
    steady = next(s for s in snippets_of("docs/rules.md") if "class Steady" in s)
    (tmp_path / "myrules.py").write_text(steady.split("\nmodel = ll.load")[0] + "\n")
    monkeypatch.chdir(tmp_path)
    refused, registered, seen = [], dict(RULES), 0
    try:
        for page in PAGES:
            for words in command_lines(text_of(page)):
                name = words[1].removeprefix("experiments/").removesuffix(".py")
                seen += 1
                try:
                    importlib.import_module(f"localleap_jax.commands.{name}").parse_args(words[2:])
                except SystemExit:
                    refused.append(f"{page}: {shlex.join(words)}\n    {capsys.readouterr().err.strip()}")
    finally:
        RULES.clear()
        RULES.update(registered)
    assert not refused, "\n".join(refused)
    assert seen > 25


def test_the_pages_user_cache_is_the_one_the_tests_decode_with():
    """The caches page shows a user's policy file without running it; tests/test_field_caches.py runs that file."""
    assert f"```\n{USER_CACHE.strip()}\n```" in text_of("docs/caches.md")


def test_the_real_gsm8k_example_fits_and_a_longer_run_is_told_what_fits(tmp_path, capsys):
    """The pages' run on the real GSM8K file (`--data ../shared/data/gsm8k/test.jsonl --limit N`): tiny-chain's window
    holds the first N questions, and a run past them is refused with flags that lead to a run (issue #47: the advice
    was --truncate-fewshot, at 0-shot, which only led to a second refusal)."""
    from localleap_jax.commands import eval_gsm8k

    words = next(w for page in PAGES for w in command_lines(text_of(page)) if "--data" in w and "--limit" in w
                 and w[w.index("--data") + 1].endswith("gsm8k/test.jsonl"))
    data, limit = REPO / words[words.index("--data") + 1], int(words[words.index("--limit") + 1])
    if not data.is_file():
        pytest.skip(f"{data} is not beside this checkout")
    out = tmp_path / "out"
    assert eval_gsm8k.main(["--data", str(data), "--limit", "50", "--output", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: 1 of 50 prompts are longer than the 432 tokens .*; 0-shot: there is no few-shot example "
                        r"to drop, and its question alone is too long: --limit (\d+) evaluates the problems before "
                        r"the first of them \(problem \1\); or --gen-length 16 leaves room .*", error), error
    assert "--truncate-fewshot" not in error and limit <= int(re.search(r"--limit (\d+)", error).group(1))
    assert not out.exists()  # refused before anything was written
