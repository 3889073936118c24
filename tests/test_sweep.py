"""experiments/sweep.py: frontiers on hand-made points, grids, and tiny sweeps of the embedded model.

The frontier tests hold points whose frontier and comparison are worked out by hand in the comments.
The end-to-end tests run one tiny sweep (4 problems, 7 points over 3 rules) and check it against what
it must equal: the samples it wrote, eval_gsm8k's own run of the same specs, and the compile counts
of traced settings.
"""

import dataclasses
import json
import re
import shutil

import pytest

from localleap_jax.commands import eval_gsm8k, sweep
from localleap_jax.commands.sweep import Point, best_within, compare_frontiers, frontier
from localleap_jax.compile_cache import compiled_programs, forget_compiled
from localleap_jax.gsm8k import UserError

pytestmark = pytest.mark.usefixtures("lm_eval_env_report_once")  # conftest: torch's environment report once

# ---------------------------------------------------------------- frontiers (known by construction)

# cost = mean NFE. By hand, cheapest first:
#   a (4, .50): nothing cheaper                          -> on the frontier
#   b (4, .40): as cheap as a, less accurate             -> dominated by a
#   c (5, .50): dearer than a, no more accurate          -> dominated by a (a ">=" test would keep it)
#   d (6, .70): more accurate than everything cheaper    -> on
#   e (8, .60): less accurate than d, dearer             -> dominated by d
#   f (9, .80): on
#   g (9, .75): same cost as f, less accurate            -> dominated by f
POINTS = [Point("e", 0.60, 8), Point("a", 0.50, 4), Point("g", 0.75, 9), Point("c", 0.50, 5), Point("d", 0.70, 6),
          Point("b", 0.40, 4), Point("f", 0.80, 9)]


def test_frontier_of_hand_made_points():
    assert [p.spec for p in frontier(POINTS)] == ["a", "d", "f"]


def test_frontier_as_a_step_function():
    # best accuracy at cost <= c: undefined below the cheapest point, then a step at each frontier point
    assert [best_within(POINTS, c) for c in (4, 4.5, 5.9, 6, 8.5, 9, 100)] == [0.5, 0.5, 0.5, 0.7, 0.7, 0.8, 0.8]
    assert best_within(POINTS, 3.9) != best_within(POINTS, 3.9)  # nan: no point that cheap


def pts(*pairs):
    return [Point(f"p{i}", acc, cost) for i, (cost, acc) in enumerate(pairs)]


def test_compare_frontiers_above_with_the_mean_difference_by_hand():
    # A: (2, .6) (4, .8) (10, .9); B: (3, .6) (6, .7) (8, .85).
    # Range both cover: [max(2, 3), min(10, 8)] = [3, 8]. Steps at 3, 4, 6, 8:
    #   [3, 4): A .6, B .6 -> 0     [4, 6): A .8, B .6 -> +.2     [6, 8): A .8, B .7 -> +.1     at 8: A .8, B .85 -> -.05
    # So A is not above everywhere: crossing. Mean over [3, 8]: (0*1 + .2*2 + .1*2) / 5 = .12.
    c = compare_frontiers(pts((2, .6), (4, .8), (10, .9)), pts((3, .6), (6, .7), (8, .85)), n=100)
    assert c["verdict"] == "crossing" and c["range"] == [3, 8] and c["overlap"]
    assert c["mean_diff"] == pytest.approx(0.12)
    assert c["max_diff"] == pytest.approx(0.2) and c["min_diff"] == pytest.approx(-0.05)
    assert [t[0] for t in c["at"]] == [3, 4, 6, 8]
    # Without B's last point the range is [3, 6]: differences 0, +.2, +.1 -> above, mean (0 + .4) / 3.
    c = compare_frontiers(pts((2, .6), (4, .8), (10, .9)), pts((3, .6), (6, .7)), n=100)
    assert c["verdict"] == "above" and c["range"] == [3, 6]
    assert c["mean_diff"] == pytest.approx(0.4 / 3)


def test_compare_frontiers_below_equal_and_noise():
    below = compare_frontiers(pts((3, .6), (6, .7)), pts((2, .6), (4, .8), (10, .9)), n=100)
    assert below["verdict"] == "below"
    equal = compare_frontiers(pts((1, .5), (5, .5)), pts((2, .5), (3, .4)), n=100)
    assert equal["verdict"] == "equal" and equal["range"] == [2, 3]
    # two_se = 2 sqrt(2 p (1 - p) / n) at the frontiers' mean accuracy: frontiers (1, .5) and (2, .5) -> p = .5
    assert equal["two_se"] == pytest.approx(2 * (2 * 0.25 / 100) ** 0.5)
    small_gap = compare_frontiers(pts((1, .52)), pts((1, .5)), n=100)
    assert small_gap["verdict"] == "above" and small_gap["within_noise"]
    big_gap = compare_frontiers(pts((1, .9)), pts((1, .5)), n=100)
    assert not big_gap["within_noise"]


def test_compare_frontiers_without_a_common_range():
    # A covers [1, 2], B [5, 6]: compared at 5, where A's best (.7) meets B's cheapest (.6).
    c = compare_frontiers(pts((1, .5), (2, .7)), pts((5, .6), (6, .9)), n=100)
    assert not c["overlap"] and c["range"] == [5, 5] and c["verdict"] == "above"
    assert c["at"] == [[5, 0.7, 0.6]]


def test_the_answer_reads_tokens_per_second_as_higher_is_better():
    # Same NFE and accuracy per rule, so only the tokens/s axis separates them: localleap's .8 point is the
    # fast one (300 tok/s), threshold's .8 point the slow one (100 tok/s). On tokens/s, at any speed in the
    # common range [100, 200] localleap's best is .8 and threshold's (at 200 only its .6 point) is .6 ->
    # above, not below (a sign slip reads it the other way).
    results = {"localleap:a": {"accuracy_strict": .8, "mean_nfe": 5, "tokens_per_second": 300},
               "localleap:b": {"accuracy_strict": .6, "mean_nfe": 5, "tokens_per_second": 150},
               "threshold:a": {"accuracy_strict": .8, "mean_nfe": 5, "tokens_per_second": 100},
               "threshold:b": {"accuracy_strict": .6, "mean_nfe": 5, "tokens_per_second": 200}}
    pareto = {"localleap": ["localleap:a", "localleap:b"], "threshold": ["threshold:a", "threshold:b"]}
    out = sweep.answer(results, pareto, n=100)
    tps = out["tokens_per_second"]
    assert tps["range"] == [150, 200] and tps["verdict"] == "above"
    assert [t[0] for t in tps["at"]] == [200, 150]  # back in tokens/s
    assert out["mean_nfe"]["verdict"] == "equal" and out["answer"].startswith("level")
    record = sweep.pareto_record(results, pareto)
    assert record["threshold"]["frontier_tokens_per_second"] == ["threshold:b", "threshold:a"]
    assert record["threshold"]["frontier_mean_nfe"] == ["threshold:a"]
    assert "not asked" in sweep.answer(results, {"localleap": pareto["localleap"]}, n=100)["answer"]


# ---------------------------------------------------------------- grids


def test_grid_flags_parse():
    assert sweep.parse_grid("localleap:kappa=0.8;0.9,tau=0.7,radius=2;4") == \
        ("localleap", {"kappa": [0.8, 0.9], "tau": [0.7], "radius": [2, 4]})
    assert sweep.parse_grid("low_confidence:steps=16;none") == ("low_confidence", {"steps": [16, None]})
    assert sweep.parse_ablation("radius=0;4;8") == ("radius", [0, 4, 8])


EMBEDDED_DEFAULTS = {"eval_defaults": {"gen_length": 64, "block_length": 16, "num_fewshot": 0}}  # its manifest's


def sweep_args(**flags):
    return sweep.parse_args(["--output", "unused", *[x for k, v in flags.items() for x in (f"--{k}", v)]])


def eval_settings(**flags):
    return sweep.eval_settings_of(sweep_args(**flags), EMBEDDED_DEFAULTS)


def test_every_point_is_scored_with_the_flags_and_no_rule_setting():
    settings = eval_settings(limit="7", cache="prefix")
    assert (settings.gen_length, settings.block_length, settings.num_fewshot) == (64, 16, 0)  # the model's
    assert (settings.limit, settings.cache, settings.batch_size, settings.mesh) == (7, "prefix", 50, None)
    assert (settings.kappa, settings.tau, settings.radius, settings.steps) == (None, None, None, None)


def test_grid_points_leave_out_refused_combinations_in_product_order(capsys):
    settings = eval_settings()
    specs = sweep.grid_points("localleap", {"kappa": [0.7, 0.9], "tau": [0.5, 0.8], "radius": [4]}, settings)
    assert specs == ["localleap:kappa=0.7,radius=4,tau=0.5", "localleap:kappa=0.9,radius=4,tau=0.5",
                     "localleap:kappa=0.9,radius=4,tau=0.8"]  # (0.7, 0.8) has tau > kappa
    assert "left out 1 of 4 combinations" in capsys.readouterr().err
    # None is a value of its own (one token per step), never read back as the default
    assert sweep.grid_points("low_confidence", {"steps": [8, None]}, settings) == ["low_confidence:steps=8",
                                                                                     "low_confidence"]
    with pytest.raises(UserError, match="threshold:kappa=None"):
        sweep.grid_points("threshold", {"kappa": [0.5, None]}, settings)


def test_figure4_points_vary_one_setting_around_the_centre():
    args = sweep_args(ablation="kappa=0.8;0.95")
    series = sweep.figure4_points(args, sweep.eval_settings_of(args, EMBEDDED_DEFAULTS))
    assert series["kappa"] == [(0.8, "localleap:kappa=0.8,radius=4,tau=0.75"),
                               (0.95, "localleap:kappa=0.95,radius=4,tau=0.75")]
    assert [v for v, _ in series["radius"]] == sweep.ABLATIONS["small"]["radius"]
    assert all(spec.startswith("localleap:kappa=0.9,") for _, spec in series["radius"] + series["tau"])
    groups = sweep.run_order({"localleap": ["localleap:kappa=0.8,radius=4,tau=0.75"]}, series)
    assert groups["localleap"].count("localleap:kappa=0.8,radius=4,tau=0.75") == 1  # scored once
    assert groups["low_confidence"] == ["low_confidence"]  # the baseline, even when not among --strategies


# ---------------------------------------------------------------- mistakes


@pytest.mark.parametrize("flags, message", [
    (["--grid", "threshold"], "is not NAME:setting=v1;v2"),
    (["--grid", "greedy:kappa=0.5"], "unknown rule 'greedy'"),
    (["--grid", "threshold:gamma=0.5"], "threshold has no setting gamma"),
    (["--grid", "threshold:kappa=0.5;abc"], "'abc' is not a number"),
    (["--grid", "threshold:kappa=0.5;0.5"], "names a value twice"),
    (["--grid", "threshold:kappa=0.5;;0.7"], "has an empty value"),
    (["--grid", "threshold:kappa=1.5"], r"--grid threshold:kappa=1.5: threshold: kappa=1.5 must lie in \(0, 1\]"),
    (["--grid", "low_confidence:steps=6"], "steps=6 is not a positive multiple of the number of blocks"),  # 5 blocks
    (["--grid", "localleap:kappa=0.5,tau=0.75"], "tau=0.75 > kappa=0.5"),
    (["--strategies", "threshold", "--grid", "eb:gamma=0.1"], "eb is not among --strategies"),
    (["--strategies", "threshold:kappa=0.8"], "give rule names here"),
    (["--strategies", "greedy"], "unknown rule 'greedy'"),
    (["--strategies", "threshold,threshold"], "threshold given twice"),
    (["--ablation", "gamma=0.1"], "Figure 4 ablates kappa, radius or tau"),
    (["--ablation", "kappa=0.5"], r"--ablation kappa=0.5: localleap: tau=0.75 > kappa=0.5"),
    (["--center", "kappa=0.9;0.8"], "one value per setting"),
    (["--limit", "0"], "expected a positive integer"),
    (["--gen-length", "60"], "^error: gen_length=60 is not a multiple of block_length=16"),  # not one grid's value
    (["--checkpoint", "{tmp}/nope"], "no checkpoint at"),
    (["--output", "{tmp}/file"], "is a file, not a directory"),
])
def test_mistakes_end_with_one_clear_line(tmp_path, capsys, flags, message):
    (tmp_path / "file").write_text("")
    flags = [f.format(tmp=tmp_path) for f in flags]
    output = [] if "--output" in flags else ["--output", str(tmp_path / "out")]
    assert exit_code([*flags, *output]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err
    assert not (tmp_path / "out").exists()  # a refused sweep leaves nothing behind


def exit_code(argv) -> int:
    """main's exit status, whether the argument parser exits or main returns."""
    try:
        return sweep.main(argv)
    except SystemExit as e:
        return e.code


def test_a_missing_output_is_one_line(capsys):
    assert exit_code([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--output" in err[0]


# ---------------------------------------------------------------- a tiny sweep of the embedded model

TINY = ["--checkpoint", "embedded", "--limit", "4", "--batch-size", "4", "--strategies", "threshold,localleap",
        "--no-compile-cache", "--grid", "threshold:kappa=0.5;0.9",
        "--grid", "localleap:kappa=0.9,tau=0.5;0.75,radius=4",
        "--ablation", "kappa=0.8;0.9", "--ablation", "radius=0;4", "--ablation", "tau=0.75"]
# Points, each scored once: threshold 0.5, 0.9; localleap (0.9, 4, 0.5), (0.9, 4, 0.75) = the centre,
# (0.8, 4, 0.75), (0.9, 0, 0.75); the baseline low_confidence.
LOCALLEAP = ["localleap:kappa=0.9,radius=4,tau=0.5", "localleap:kappa=0.9,radius=4,tau=0.75",
             "localleap:kappa=0.8,radius=4,tau=0.75", "localleap:kappa=0.9,radius=0,tau=0.75"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "out"
    # The process's compiled programs dropped, so this sweep compiles its own: tests that ran before
    # (eval_gsm8k's, on the same batch shape) would otherwise have compiled its programs already.
    forget_compiled()
    seen = len(compiled_programs())
    assert sweep.main([*TINY, "--output", str(out)]) == 0
    new_programs = [p for p in compiled_programs()[seen:] if p.kind.startswith("decode/")]
    return out, json.loads((out / "sweep.json").read_text()), new_programs


def _samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_sweep_scores_every_point_once(tiny):
    out, record, _ = tiny
    assert list(record["points"]) == ["threshold:kappa=0.5", "threshold:kappa=0.9", *LOCALLEAP, "low_confidence"]
    assert record["pareto"]["localleap"]["points"] == LOCALLEAP[:2]
    assert {name: len(c["per_point"]) for name, c in record["compiles"].items()} == \
        {"threshold": 2, "localleap": 4, "low_confidence": 1}
    rows = _samples(out)
    assert len(rows) == 7 * 4 and all(r["nfe"] == 64 for r in rows if r["strategy"] == "low_confidence")


@pytest.mark.slow
def test_each_grid_compiles_once_per_batch_shape(tiny):
    _, record, new_programs = tiny
    # 4 problems in one batch of 4: one program per rule, made by its first point; the other points run on it
    # (compile-time settings would add a program per point).
    for name, c in record["compiles"].items():
        assert c["programs"] == 1 and c["per_point"] == [1] + [0] * (len(c["per_point"]) - 1), (name, c)
        assert c["shapes"] == [[4, 64]]
    assert len(new_programs) == 3  # compile_cache.compiled_programs(), counted from outside the script
    assert [list(p.shapes[0]) for p in new_programs] == [[4, 64]] * 3


@pytest.mark.slow
def test_the_json_numbers_are_those_of_the_samples(tiny):
    out, record, _ = tiny
    rows = _samples(out)
    for spec, point in record["points"].items():
        mine = [r for r in rows if r["strategy"] == spec]
        n = len(mine)
        assert point["n"] == n == 4
        assert point["accuracy_strict"] == pytest.approx(sum(r["correct_strict"] for r in mine) / n)
        assert point["accuracy_flexible"] == pytest.approx(sum(r["correct_flexible"] for r in mine) / n)
        assert point["mean_nfe"] == pytest.approx(sum(r["nfe"] for r in mine) / n)
        assert point["tokens_per_second"] == pytest.approx(sum(r["generated_tokens"] for r in mine) /
                                                           sum(r["seconds"] for r in mine))
    f4 = record["figure4"]
    assert [s["value"] for s in f4["ablations"]["kappa"]] == [0.8, 0.9]
    for series in f4["ablations"].values():
        for s in series:
            assert s["mean_nfe"] == record["points"][s["spec"]]["mean_nfe"]
            assert s["accuracy_strict"] == record["points"][s["spec"]]["accuracy_strict"]
    assert f4["baseline"]["mean_nfe"] == 64.0
    frontier_specs = record["pareto"]["threshold"]["frontier_mean_nfe"]
    expected = frontier([Point(s, record["points"][s]["accuracy_strict"], record["points"][s]["mean_nfe"])
                         for s in record["pareto"]["threshold"]["points"]])
    assert frontier_specs == [p.spec for p in expected]
    assert record["comparison"]["mean_nfe"]["verdict"] in ("above", "below", "equal", "crossing")


@pytest.mark.slow
def test_the_plots_are_written(tiny):
    out, _, _ = tiny
    for name in ("pareto.png", "figure4.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_a_point_answers_as_eval_gsm8k_does(tiny, tmp_path):
    out, record, _ = tiny
    specs = ["threshold:kappa=0.5", "threshold:kappa=0.9", "localleap:kappa=0.9,radius=4,tau=0.5"]
    assert eval_gsm8k.main(["--checkpoint", "embedded", "--limit", "4", "--batch-size", "4", "--no-compile-cache",
                            "--strategies", ",".join(specs), "--output", str(tmp_path / "eval")]) == 0
    theirs = _samples(tmp_path / "eval")
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())["strategies"]
    ours = _samples(out)
    keys = ("id", "generated", "correct_strict", "correct_flexible", "nfe", "generated_tokens")
    for spec in specs:
        mine = [{k: r[k] for k in keys} for r in ours if r["strategy"] == spec]
        assert mine == [{k: r[k] for k in keys} for r in theirs if r["strategy"] == spec] and len(mine) == 4
        for k in ("accuracy_strict", "accuracy_flexible", "mean_nfe", "n"):
            assert record["points"][spec][k] == summary[spec][k]
    # The comparison tells settings apart: the two threshold points decode differently.
    nfe = {spec: [r["nfe"] for r in ours if r["strategy"] == spec] for spec in specs[:2]}
    assert nfe[specs[0]] != nfe[specs[1]]


@pytest.mark.slow
def test_a_rerun_generates_nothing_and_a_larger_grid_only_its_new_point(tiny, tmp_path, capsys):
    out, record, _ = tiny
    again = tmp_path / "again"
    shutil.copytree(out, again)
    capsys.readouterr()
    assert sweep.main([*TINY, "--output", str(again)]) == 0
    printed = capsys.readouterr().out
    rerun = json.loads((again / "sweep.json").read_text())
    assert rerun["batches_generated"] == 0 and printed.count("(0 batches generated") == 7
    for spec, point in record["points"].items():
        for k in ("accuracy_strict", "mean_nfe", "tokens_per_second"):
            assert rerun["points"][spec][k] == point[k]
    # As an interrupted sweep would: the points already scored are read back, only the new one generates.
    bigger = [f.replace("threshold:kappa=0.5;0.9", "threshold:kappa=0.5;0.7;0.9") for f in TINY]
    assert sweep.main([*bigger, "--output", str(again)]) == 0
    grown = json.loads((again / "sweep.json").read_text())
    assert grown["batches_generated"] == 1
    assert [s for s, p in grown["points"].items() if p["batches_generated"]] == ["threshold:kappa=0.7"]


def test_preset_schedules_fit_the_canvas():
    # steps = gen_length / tokens per step, None for one token per step
    settings = dataclasses.replace(eval_settings(), gen_length=256, block_length=32)
    grid = sweep.preset_grid("low_confidence", "large", settings)  # tokens per step 16, 8, 4, 2, 1
    assert sweep.grid_points("low_confidence", grid, settings) == \
        ["low_confidence:steps=16", "low_confidence:steps=32", "low_confidence:steps=64", "low_confidence:steps=128",
         "low_confidence"]
    settings = dataclasses.replace(settings, gen_length=48, block_length=24)  # a block of 24 cannot take 16 per step
    assert sweep.preset_grid("low_confidence", "large", settings) == {"steps": [6, 12, 24, None]}


def test_a_users_rule_sweeps_by_name_with_its_grid(tmp_path):
    """Issue #22: --rules FILE; its rule by name in --strategies and --grid (a rule with no preset grid runs at its
    defaults), each point's full spec and code digest in sweep.json."""
    from helpers import rules_put_back, write_user_rules

    rules, out = write_user_rules(tmp_path / "myrules.py"), tmp_path / "out"
    with rules_put_back():
        assert sweep.main(["--rules", str(rules), "--strategies", "steady,confident", "--grid", "steady:k=1;3",
                           "--skip-figure4", "--limit", "2", "--batch-size", "2", "--gen-length", "16",
                           "--block-length", "16", "--no-compile-cache", "--output", str(out)]) == 0
        record = json.loads((out / "sweep.json").read_text())
        assert list(record["points"]) == ["steady:k=1", "steady:k=3", "confident"]
        assert record["pareto"]["steady"]["points"] == ["steady:k=1", "steady:k=3"]
        for spec, point in record["points"].items():
            name = spec.split(":")[0]
            assert point["spec"] == spec and point["rule"] == name and point["n"] == 2
            assert point["rule_defined_in"] == [f"{rules.resolve()}:{name.capitalize() if name == 'steady' else name}"]
        assert record["points"]["steady:k=1"]["rule_code"] == record["points"]["steady:k=3"]["rule_code"]
        assert record["points"]["steady:k=3"]["mean_nfe"] > record["points"]["steady:k=1"]["mean_nfe"]
        assert [s["names"] for s in record["config"]["rule_sources"]] == [["steady", "confident"]]
        assert {r["strategy"] for r in _samples(out)} == set(record["points"])
