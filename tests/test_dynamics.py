"""The decoding-dynamics statistics on hand-made traces whose answers are known by construction.

Every expected number below is worked out by hand in the comments beside its trace, and each trace
holds a case that a plausible wrong definition gets wrong (named in the test), so the assertion
is the one that tells the two apart.
"""

import numpy as np
import pytest

from localleap_jax import dynamics as dyn
from localleap_jax.trace import Trace, load_trace, save_trace

NAN = np.nan
GARBAGE_PRED, GARBAGE_CONF = 99, 0.99  # what we write past a row's passes: confident and wrong, so counting it shows


def make_trace(rows: list[dict], S: int) -> Trace:
    """Rows of {"pred": [passes][G], "conf": [passes][G], "commit_pass": [G], "token": [G]} -> Trace.

    `committed` and `clause` follow from commit_pass; entries past a row's passes hold garbage."""
    B, G = len(rows), len(rows[0]["token"])
    pred = np.full((B, S, G), GARBAGE_PRED, np.int32)
    conf = np.full((B, S, G), GARBAGE_CONF, np.float32)
    for b, r in enumerate(rows):
        n = len(r["pred"])
        pred[b, :n] = r["pred"]
        conf[b, :n] = r["conf"]
    commit_pass = np.array([r["commit_pass"] for r in rows], np.int32)
    committed = np.arange(S)[None, :, None] == commit_pass[:, None, :]
    return Trace(pred=pred, conf=conf, committed=committed, clause=committed.astype(np.int32),
                 clause_names=("commit",), token=np.array([r["token"] for r in rows], np.int32),
                 commit_pass=commit_pass, passes=np.array([len(r["pred"]) for r in rows], np.int32))


# ---------------------------------------------------------------- Figure 1b trace
# Row A, 8 passes (pass 8 is past its passes: garbage). Position by position:
#   0: final 7, committed at 6, preds 7 3 3 7 7 7 7 | 0     -> flips back at pass 3: stable 3, 4/8
#   1: final 5, committed at pass 0, later preds 1 (after commit: ignored) -> stable 0, 1/8
#   2: final 9, committed at 3, preds 9 9 9 9 | 4 4 4 4      -> stable 0, 1/8
#   3: final 8, committed at 5, preds 1 1 8 8 8 8 | 2 2      -> stable 2, 3/8 (step/passes would say 2/8)
#   4: early-stop fill (commit_pass -1), preds all its final 2 -> left out
#   5: final 6, committed at 4, preds - 6 - 6 6 | 3 3 3 ('-': not computed) -> stable 1, 2/8
# Row B, 1 pass: all six committed at pass 0 -> stable 0, fraction 1/1 = 1.0 (not within 25%).
# Within 25%: A1, A2, A5 -> 3 of 11 decided positions.
ROW_A = {"pred": [[7, 5, 9, 1, 2, -1], [3, 1, 9, 1, 2, 6], [3, 1, 9, 8, 2, -1], [7, 1, 9, 8, 2, 6],
                  [7, 1, 4, 8, 2, 6], [7, 1, 4, 8, 2, 3], [7, 1, 4, 2, 2, 3], [0, 1, 4, 2, 2, 3]],
         "conf": [[0.5, 0.5, 0.5, 0.5, 0.5, NAN], [0.5] * 6, [0.5, 0.5, 0.5, 0.5, 0.5, NAN]] + [[0.5] * 6] * 5,
         "commit_pass": [6, 0, 3, 5, -1, 4], "token": [7, 5, 9, 8, 2, 6]}
ROW_B = {"pred": [[1, 2, 3, 4, 5, 6]], "conf": [[0.9] * 6], "commit_pass": [0] * 6, "token": [1, 2, 3, 4, 5, 6]}


@pytest.fixture
def stable_trace() -> Trace:
    return make_trace([ROW_A, ROW_B], S=9)


def test_stable_step_by_construction(stable_trace):
    # Wrong variants this separates: counting passes after the commit (A0..A3, A5 never stable -> -1),
    # unobserved passes as inconsistent (A5 -> 3), unobserved passes as consistent (A5 -> 0), fills included (A4 -> 0).
    np.testing.assert_array_equal(dyn.stable_step(stable_trace), [[3, 0, 0, 2, -1, 1], [0] * 6])


def test_stable_fraction_counts_passes_up_to_and_including_the_stable_one(stable_trace):
    # step / passes would give A [3/8, 0, 0, 2/8, ., 1/8] and B [0] * 6.
    np.testing.assert_array_equal(dyn.stable_fraction(stable_trace),
                                  [[4 / 8, 1 / 8, 1 / 8, 3 / 8, NAN, 2 / 8], [1.0] * 6])


def test_stable_within_25pct_by_construction(stable_trace):
    # 3/11. Variants: step/passes 10/11 (A1 A2 A3 A5 + all of B), fills counted 4/12, post-commit passes counted
    # 0/11, unobserved-as-inconsistent 2/11.
    assert dyn.stable_within(stable_trace, 0.25) == pytest.approx(3 / 11, abs=1e-12)
    assert dyn.stable_within(stable_trace, 1.0) == 1.0  # every decided position has a stable step


def test_stable_histogram_is_right_closed_and_agrees_with_the_share(stable_trace):
    counts = dyn.stable_histogram(stable_trace)
    expected = np.zeros(20, int)
    expected[[2, 4, 7, 9, 19]] = [2, 1, 1, 1, 6]  # 1/8 twice in (0.10, 0.15], 2/8 in (0.20, 0.25], 3/8, 4/8, 1.0 x 6
    np.testing.assert_array_equal(counts, expected)
    assert counts[:5].sum() / 11 == pytest.approx(dyn.stable_within(stable_trace, 0.25))


def test_a_row_with_one_pass_is_at_100pct_and_a_commit_at_pass_0_is_stable_at_0():
    t = make_trace([ROW_B], S=3)
    np.testing.assert_array_equal(dyn.stable_step(t), [[0] * 6])
    assert dyn.stable_within(t, 0.25) == 0.0 and dyn.stable_within(t, 1.0) == 1.0


def test_a_trace_that_decided_nothing_has_no_shares():
    fill = {"pred": [[2, 2]], "conf": [[0.95, 0.95]], "commit_pass": [-1, -1], "token": [2, 2]}
    t = make_trace([fill], S=2)
    assert np.isnan(dyn.stable_within(t)) and np.isnan(dyn.consistent_given_confidence_above(t))
    assert dyn.stable_histogram(t).sum() == 0


# ---------------------------------------------------------------- Figure 1c trace
# One row, 3 passes (pass 3: garbage). Scored = still masked, computed, decided:
#   0: final 5, committed at 2: 5 @0.90 (consistent), 6 @0.85 (not), 5 @0.95 (consistent, the commit pass)
#   1: final 7, committed at 0: 7 @0.80 (consistent, but not > 0.8); then 3 @0.99 twice after the commit (ignored)
#   2: early-stop fill: 2 @0.97 three times (ignored)
#   3: final 4, committed at 1: not computed at 0, 4 @0.30 (consistent); 4 @0.99 after the commit (ignored)
# conf > 0.8: 0.90 c, 0.85 i, 0.95 c -> 2/3.
CONF_ROW = {"pred": [[5, 7, 2, -1], [6, 3, 2, 4], [5, 3, 2, 4]],
            "conf": [[0.9, 0.8, 0.97, NAN], [0.85, 0.99, 0.97, 0.3], [0.95, 0.99, 0.97, 0.99]],
            "commit_pass": [2, 0, -1, 1], "token": [5, 7, 2, 4]}


@pytest.fixture
def conf_trace() -> Trace:
    return make_trace([CONF_ROW], S=4)


def test_consistent_given_confidence_above_by_construction(conf_trace):
    # Variants: >= 0.8 (or comparing float32 0.8 in float64, where it is above 0.8) 3/4; fills counted 5/6;
    # predictions after the commit counted 3/6.
    assert dyn.consistent_given_confidence_above(conf_trace, 0.8) == pytest.approx(2 / 3, abs=1e-12)


def test_consistency_by_confidence_bins(conf_trace):
    binned = dyn.consistency_by_confidence(conf_trace)
    total, hits = np.zeros(10, int), np.zeros(10, int)
    total[[3, 8, 9]] = [1, 2, 2]  # 0.30 | 0.85, 0.80 | 0.90, 0.95 (float32 0.9 is in [0.9, 1.0), as a rule's conf >= 0.9)
    hits[[3, 8, 9]] = [1, 1, 2]
    np.testing.assert_array_equal(binned.total, total)
    np.testing.assert_array_equal(binned.consistent, hits)
    np.testing.assert_array_equal(binned.rate[[3, 8, 9]], [1.0, 0.5, 1.0])
    assert np.isnan(binned.rate[0])


def test_confidence_bin_edges():
    conf = np.array([0.0, 0.1, 0.899, 0.9, 1.0, NAN], np.float32)
    np.testing.assert_array_equal(dyn.confidence_bin(conf, dyn.CONFIDENCE_EDGES), [0, 1, 8, 9, 9, -1])


# ---------------------------------------------------------------- Figure 2 trace
# One row, 6 positions, 4 passes (pass 4: garbage); finals 10 11 12 13 14 2; commit passes 0 2 1 1 3 -1
# (5 is an early-stop fill). Predictions (x: not the final token):
#   pass 0: 10@.60  11@.85  x@.85   13@.30  14@.30  2@.95      anchor 0 (.60, low)
#   pass 1: 10@.99  11@.85  12@.95  13@.50  x@.85   2@.95      anchors 2 (.95, high) and 3 (.50, low)
#   pass 2: 10@.99  11@.90  12@.99  13@.99  14@.45  2@.95      anchor 1 (.90, high)
#   pass 3: 10@.99  11@.99  12@.99  13@.99  14@.70  2@.95      anchor 4 (.70, low): no neighbour still masked
# Pairs (neighbour still masked after the pass, not a fill):
#   high: pass 1, 2->1 (d1, .85, c), 2->4 (d2, .85, x); pass 2, 1->4 (d3, .45, c)
#   low:  pass 0, 0->1 (d1, .85, c), 0->2 (d2, .85, x), 0->3 (d3, .30, c), 0->4 (d4, .30, c);
#         pass 1, 3->4 (d1, .85, x), 3->1 (d2, .85, c)
NEIGHBOUR_ROW = {"pred": [[10, 11, 99, 13, 14, 2], [10, 11, 12, 13, 99, 2], [10, 11, 12, 13, 14, 2],
                          [10, 11, 12, 13, 14, 2]],
                 "conf": [[0.6, 0.85, 0.85, 0.3, 0.3, 0.95], [0.99, 0.85, 0.95, 0.5, 0.85, 0.95],
                          [0.99, 0.9, 0.99, 0.99, 0.45, 0.95], [0.99, 0.99, 0.99, 0.99, 0.7, 0.95]],
                 "commit_pass": [0, 2, 1, 1, 3, -1], "token": [10, 11, 12, 13, 14, 2]}


@pytest.fixture
def neighbour_trace() -> Trace:
    return make_trace([NEIGHBOUR_ROW], S=5)


def expected_neighbours() -> tuple[np.ndarray, np.ndarray]:
    total, hits = np.zeros((2, 8, 10), int), np.zeros((2, 8, 10), int)
    for panel, d, k, consistent in [(0, 1, 8, 1), (0, 2, 8, 0), (0, 3, 4, 1),
                                    (1, 1, 8, 1), (1, 2, 8, 0), (1, 3, 3, 1), (1, 4, 3, 1),
                                    (1, 1, 8, 0), (1, 2, 8, 1)]:
        total[panel, d - 1, k] += 1
        hits[panel, d - 1, k] += consistent
    return total, hits


def test_neighbour_consistency_by_construction(neighbour_trace):
    # Variants: co-committed neighbours counted (masked when the pass ran) add 2->3 (high, d1, .50) and 3->2 (low,
    # d1, .95); already-committed ones add e.g. 2->0 (high, d2, .99); fills add 0->5 (low, d5, .95); comparing the
    # float32 .90 anchor split in float64 moves 1->4 to the low panel; one side only drops 3->1.
    nb = dyn.neighbour_consistency(neighbour_trace)
    total, hits = expected_neighbours()
    np.testing.assert_array_equal(nb.total, total)
    np.testing.assert_array_equal(nb.consistent, hits)
    assert nb.rate[0, 0, 8] == 1.0 and nb.rate[1, 0, 8] == 0.5 and np.isnan(nb.rate[0, 0, 5])


def test_neighbour_distance_bound(neighbour_trace):
    nb = dyn.neighbour_consistency(neighbour_trace, max_distance=2)
    total, _ = expected_neighbours()
    np.testing.assert_array_equal(nb.total, total[:, :2])
    assert dyn.neighbour_consistency(neighbour_trace, max_distance=20).total.sum() == total.sum()  # beyond G: none


# ---------------------------------------------------------------- Figure 1a, concatenation, summary


def test_decode_picture_of_one_row(neighbour_trace):
    pic = dyn.decode_picture(neighbour_trace, 0)
    assert pic.conf.shape == (4, 6)  # cut to the row's passes: the garbage pass is gone
    np.testing.assert_array_equal(pic.consistent[0], [True, True, False, True, True, True])
    np.testing.assert_array_equal(pic.masked[1], [False, True, True, True, True, True])  # 0 committed at pass 0
    np.testing.assert_array_equal(pic.masked[:, 5], [True] * 4)  # the fill is masked until the row ends
    np.testing.assert_array_equal(pic.commit_pass, [0, 2, 1, 1, 3, -1])
    with pytest.raises(IndexError):
        dyn.decode_picture(neighbour_trace, 1)


def test_concat_pads_passes_and_pools_the_counts(stable_trace, neighbour_trace):
    both = dyn.concat_traces([stable_trace, neighbour_trace])
    assert both.pred.shape == (3, 9, 6) and both.pred[2, 5:].tolist() == [[-1] * 6] * 4
    assert np.isnan(both.conf[2, 5:]).all() and not both.committed[2, 5:].any()
    # The Figure 2 trace's stable steps: 0 0 1 0 2 (fill left out) over 4 passes -> 0, 1 and 3 within 25%: 3/5.
    np.testing.assert_array_equal(dyn.stable_step(neighbour_trace), [[0, 0, 1, 0, 2, -1]])
    assert dyn.stable_within(both) == pytest.approx((3 + 3) / (11 + 5), abs=1e-12)
    # conf > 0.8: row B's six at 0.9 (consistent); the Figure 2 row: 1@.85 .85 .90 c, 2@.85 x .95 c, 4@.85 x -> 4/6.
    assert dyn.consistent_given_confidence_above(both) == pytest.approx((6 + 4) / (6 + 6), abs=1e-12)
    with pytest.raises(ValueError, match="different gen lengths"):
        dyn.concat_traces([stable_trace, make_trace([CONF_ROW], S=4)])


def test_summary_holds_the_headline_numbers(stable_trace):
    s = dyn.summary(stable_trace)
    assert s["stable_within_25pct"] == dyn.stable_within(stable_trace)
    assert s["consistent_given_conf_gt_0.8"] == 1.0  # row B's six 0.9 predictions; row A is all 0.5
    assert s["decided_positions"] == 11 and s["early_stop_filled_positions"] == 1
    assert s["predictions_conf_gt_0.8"] == 6 and s["rows"] == 2


# ---------------------------------------------------------------- the trace file


def test_a_trace_file_that_cannot_be_written_or_read_is_one_line(tmp_path, stable_trace):
    """Issue #47: save_trace to an unwritable path and load_trace of a missing or foreign file ended in OSError,
    KeyError or numpy's advice to unpickle; each is one ll.LocalLeapError line naming the file."""
    import localleap_jax as ll

    (tmp_path / "file").write_text("")
    cases = [
        (lambda: ll.save_trace(tmp_path / "file" / "t.npz", stable_trace),
         rf"^cannot write the trace to {tmp_path}/file/t.npz: "),
        (lambda: ll.save_trace(tmp_path / "t.npz", None), r"^save_trace takes a Trace .* got NoneType \(generate ran "
                                                          r"without trace=True\)$"),
        (lambda: ll.save_trace(stable_trace, tmp_path / "t.npz"), r"^save_trace\(path, trace, ...\): the path comes "
                                                                  r"first"),
        (lambda: ll.load_trace(tmp_path / "missing.npz"), rf"^no trace file at {tmp_path}/missing.npz$"),
        (lambda: ll.load_trace(tmp_path / "file"), rf"^{tmp_path}/file is not a trace file written by save_trace "
                                                   r"\(not a NumPy .npz archive\)$"),
        (lambda: np.savez(tmp_path / "other.npz", x=np.zeros(2)) or ll.load_trace(tmp_path / "other.npz"),
         rf"^{tmp_path}/other.npz is not a trace file written by save_trace \(it lacks pred, conf"),
    ]
    for call, message in cases:
        with pytest.raises(ll.LocalLeapError, match=message) as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "t.npz").exists()


def test_save_load_round_trip(tmp_path, stable_trace):
    path = save_trace(tmp_path / "t.trace", stable_trace, texts=["a", "b"], meta={"strategy": "low_confidence"})
    assert path == tmp_path / "t.trace" and path.is_file()  # no .npz appended to another suffix
    loaded, texts, meta = load_trace(path)
    assert texts == ["a", "b"] and meta == {"strategy": "low_confidence"}
    assert loaded.pred.shape == (2, 8, 6)  # cut to the longest row's passes: the garbage pass 8 is not kept
    for name in ("pred", "conf", "committed", "clause"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(stable_trace, name)[:, :8])
    for name in ("token", "commit_pass", "passes"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(stable_trace, name))
    assert loaded.clause_names == ("commit",)
    np.testing.assert_array_equal(loaded.masked, stable_trace.masked[:, :8])
    np.testing.assert_array_equal(dyn.stable_step(loaded), dyn.stable_step(stable_trace))


def test_masked_property_by_construction(stable_trace):
    m = stable_trace.masked
    np.testing.assert_array_equal(m[0, :, 1], [True] + [False] * 8)  # committed at pass 0: masked only then
    np.testing.assert_array_equal(m[0, :, 0], [True] * 7 + [False] * 2)  # committed at 6
    np.testing.assert_array_equal(m[0, :, 4], [True] * 8 + [False])  # fill: every pass of the row, none past it
    np.testing.assert_array_equal(m[1, :, 0], [True] + [False] * 8)


# ---------------------------------------------------------------- plots (localleap_jax/commands/plots.py)


def test_plots_write_pngs_with_the_numbers_of_the_statistics(tmp_path, stable_trace, neighbour_trace):
    import json

    from localleap_jax.commands import plots

    both = dyn.concat_traces([stable_trace, neighbour_trace])
    returned = plots.all_figures(both, tmp_path, row=2, texts=["a", "b", "c"])
    saved = {}
    for name in ("figure1a", "figure1b", "figure1c", "figure2"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000, name
        saved[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert saved[name] == returned[name]
    f1b, f1c, f2, f1a = saved["figure1b"], saved["figure1c"], saved["figure2"], saved["figure1a"]
    assert f1b["stable_within_25pct"] == dyn.stable_within(both) == pytest.approx(6 / 16)
    assert f1b["counts"] == dyn.stable_histogram(both).tolist() and f1b["positions"] == 16
    assert f1b["cumulative"][4] == pytest.approx(6 / 16)  # the right edge 0.25
    binned = dyn.consistency_by_confidence(both)
    assert f1c["total"] == binned.total.tolist() and f1c["consistent"] == binned.consistent.tolist()
    assert f1c["consistent_given_conf_gt_0.8"] == dyn.consistent_given_confidence_above(both) == pytest.approx(10 / 12)
    assert f1c["rate"][0] is None  # an empty bin: null, not NaN (strict JSON)
    nb = dyn.neighbour_consistency(both)
    assert f2["panels"]["conf_ge_split"]["total"] == nb.total[0].tolist()
    assert f2["panels"]["conf_lt_split"]["consistent"] == nb.consistent[1].tolist()
    pic = dyn.decode_picture(both, 2)
    assert f1a["consistent"] == pic.consistent.tolist() and f1a["commit_pass"] == [0, 2, 1, 1, 3, -1]
    assert f1a["text"] == "c" and f1a["passes"] == 4


def test_picture_colours():
    from localleap_jax.commands import plots

    pic = dyn.decode_picture(make_trace([ROW_A], S=8), 0)
    rgb = plots.picture_rgb(pic)
    np.testing.assert_allclose(rgb[1, 0], 1 - 0.5 * (1 - plots.INCONSISTENT_RGB))  # 3 vs final 7 at confidence 0.5
    np.testing.assert_allclose(rgb[0, 0], 1 - 0.5 * (1 - plots.CONSISTENT_RGB))
    np.testing.assert_allclose(rgb[1, 1], plots.DECIDED_RGB)  # committed at pass 0
    np.testing.assert_allclose(rgb[0, 5], plots.UNOBSERVED_RGB)  # not computed


# ---------------------------------------------------------------- analyze_dynamics (localleap_jax/commands)


def _write_runs(directory, meta=None):
    meta = meta if meta is not None else {"checkpoint": "ck", "decode": {"strategy": "low_confidence"}}
    save_trace(directory / "batch-00000.npz", make_trace([ROW_A, ROW_B], S=9), ["first", "second"], meta)
    save_trace(directory / "batch-00001.npz", make_trace([NEIGHBOUR_ROW], S=5), ["third"], meta)


def test_script_analyses_saved_traces(tmp_path, capsys):
    import json

    from localleap_jax.commands import analyze_dynamics

    (tmp_path / "traces").mkdir()
    _write_runs(tmp_path / "traces")
    assert analyze_dynamics.main(["--from-traces", str(tmp_path / "traces"), "--row", "1",
                                  "--output", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "dynamics.json").read_text())
    assert result["stable_within_25pct"] == pytest.approx(6 / 16)  # 3/11 and 3/5 pooled
    assert result["consistent_given_conf_gt_0.8"] == pytest.approx(10 / 12)
    assert result["decided_positions"] == 16 and result["rows"] == 3
    assert result["settings"]["checkpoint"] == "ck" and len(result["trace_files"]) == 2
    assert json.loads((tmp_path / "out" / "figure1a.json").read_text())["text"] == "second"
    printed = capsys.readouterr().out
    assert "37.5%" in printed and "63.7%" in printed and "83.3%" in printed and "97.8%" in printed


@pytest.mark.parametrize("cache, comparable", [("none", True), ("dual", False), ("block", False)])
def test_the_stable_share_says_what_it_means_under_each_cache(tmp_path, capsys, cache, comparable):
    """Issue #22: under --cache dual a position is predicted only once its block opens, and its "stable within 25%"
    stood next to the paper's no-cache figure without a caveat."""
    import json

    from localleap_jax.commands import analyze_dynamics

    (tmp_path / "traces").mkdir()
    _write_runs(tmp_path / "traces", {"checkpoint": "ck", "decode": {"strategy": "low_confidence", "cache": "auto"},
                                      "cache_mode": cache})
    assert analyze_dynamics.main(["--from-traces", str(tmp_path / "traces"), "--output", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "dynamics.json").read_text())
    assert result["cache"] == cache and result["comparable_to_paper"] is comparable
    assert result["stable_within_25pct_means"] == dyn.STABLE_MEANING[cache]
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: stable share")]
    if comparable:
        assert notes == []
    else:
        (note,) = notes
        assert note.startswith(f"note: stable share with --cache {cache}: a pass predicts only its own block")
        assert "not comparable to the paper's no-cache figure" in note
    figure = json.loads((tmp_path / "out" / "figure1b.json").read_text())
    assert figure["cache"] == cache and figure["means"] == dyn.STABLE_MEANING[cache]


def test_the_observed_share_counts_the_masked_predictions_a_pass_computed(stable_trace):
    # Row A: decided positions 0, 1, 2, 3, 5 masked through their commit passes 6, 0, 3, 5, 4: 7+1+4+6+5 = 23
    # entries, of which position 5's passes 0 and 2 were not computed; row B: 6 entries, all computed.
    assert dyn.observed_share(stable_trace) == pytest.approx(27 / 29)


@pytest.mark.parametrize("make_args, message", [
    (lambda t: ["--from-traces", str(t / "nope.npz")], "no such file or directory"),
    (lambda t: ["--from-traces", str(t / "empty")], "holds no .npz trace files"),
    (lambda t: ["--from-traces", str(t / "junk.npz")], "is not a trace file"),
    (lambda t: ["--from-traces", str(t / "mixed")], "come from 2 different runs"),
    (lambda t: ["--from-traces", str(t / "traces"), "--strategy", "threshold"], "--strategy only apply when generating"),
    (lambda t: ["--from-traces", str(t / "traces"), "--row", "3"], "--row 3: the traces hold 3 rows"),
    (lambda t: ["--strategy", "greedy"], "--strategy greedy"),
    (lambda t: ["--gen-length", "60"], "gen_length=60 is not a multiple of block_length=16"),
    (lambda t: ["--data", str(t / "missing.jsonl")], "no such file"),
    (lambda t: ["--limit", "0"], "argument --limit: expected a positive integer, got 0"),  # at parse time
    (lambda t: ["--checkpoint", str(t / "nope")], "no checkpoint at"),
    (lambda t: ["--limit", "2", "--row", "2"], "--row 2: there are 2 problems"),
])
def test_script_mistakes_end_with_one_clear_line(tmp_path, capsys, make_args, message):
    from localleap_jax.commands import analyze_dynamics

    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.npz").write_text("not a trace")
    for d in ("traces", "mixed"):
        (tmp_path / d).mkdir()
        _write_runs(tmp_path / d)
    save_trace(tmp_path / "mixed" / "other.npz", make_trace([ROW_B], S=1), None,
               {"checkpoint": "ck", "decode": {"strategy": "threshold"}})
    capsys.readouterr()
    try:
        code = analyze_dynamics.main([*make_args(tmp_path), "--output", str(tmp_path / "out")])
    except SystemExit as e:  # a flag refused while parsing: what the interpreter would exit with
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_script_end_to_end_on_the_embedded_model(tmp_path, capsys):
    import json

    from localleap_jax.commands import analyze_dynamics
    import localleap_jax as ll
    from localleap_jax.tokenizer import cut_at_stop

    out = tmp_path / "run"
    assert analyze_dynamics.main(["--checkpoint", "embedded", "--limit", "4", "--batch-size", "2", "--no-compile-cache",
                                  "--output", str(out)]) == 0
    files = sorted((out / "traces").glob("*.npz"))
    assert [f.name for f in files] == ["batch-00000.npz", "batch-00001.npz"]
    traces = [load_trace(f) for f in files]
    trace = dyn.concat_traces([t for t, _, _ in traces])
    texts = [x for _, t, _ in traces for x in t]
    # The paper's setting on the embedded model (gen 64, block 16): one token per pass, 64 passes, all committed.
    assert trace.passes.tolist() == [64] * 4 and (trace.commit_pass >= 0).all()
    assert (trace.committed.sum(axis=2) == 1).all()
    tok = ll.load(ll.checkpoint.EMBEDDED).tokenizer
    assert texts == [tok.hf.decode(cut_at_stop(row, tok.stop_ids), skip_special_tokens=True) for row in trace.token]
    result = json.loads((out / "dynamics.json").read_text())
    expected = dyn.summary(trace)
    assert result["stable_within_25pct"] == pytest.approx(expected["stable_within_25pct"])
    assert result["consistent_given_conf_gt_0.8"] == pytest.approx(expected["consistent_given_conf_gt_0.8"])
    assert all((out / f"{name}.png").stat().st_size > 2000 for name in ("figure1a", "figure1b", "figure1c", "figure2"))
    # A rerun with the same settings reuses the saved batches (same files, untouched).
    stamps = [f.stat().st_mtime_ns for f in files]
    assert analyze_dynamics.main(["--checkpoint", "embedded", "--limit", "4", "--batch-size", "2", "--no-compile-cache",
                                  "--output", str(out)]) == 0
    assert [f.stat().st_mtime_ns for f in files] == stamps
    again = tmp_path / "again"
    assert analyze_dynamics.main(["--from-traces", str(out / "traces"), "--output", str(again)]) == 0
    assert json.loads((again / "dynamics.json").read_text())["stable_within_25pct"] == result["stable_within_25pct"]
    # Fewer problems: the extra batch file goes, so --from-traces DIR stays one run.
    assert analyze_dynamics.main(["--checkpoint", "embedded", "--limit", "2", "--batch-size", "2", "--no-compile-cache",
                                  "--output", str(out)]) == 0
    assert [f.name for f in (out / "traces").glob("*.npz")] == ["batch-00000.npz"]
    assert json.loads((out / "dynamics.json").read_text())["rows"] == 2


def test_script_traces_a_users_rule_by_name_and_traces_again_after_an_edit(tmp_path):
    """Issue #22: --rules FILE and its rule by name; the saved batches are keyed on the rule's code too."""
    import json

    from localleap_jax.commands import analyze_dynamics
    from helpers import rules_put_back, write_user_rules

    rules, out = write_user_rules(tmp_path / "myrules.py"), tmp_path / "run"
    args = ["--checkpoint", "embedded", "--rules", str(rules), "--strategy", "steady", "--limit", "2", "--batch-size",
            "2", "--gen-length", "16", "--block-length", "16", "--no-compile-cache", "--output", str(out)]
    with rules_put_back():
        assert analyze_dynamics.main(args) == 0
        settings = json.loads((out / "dynamics.json").read_text())["settings"]
        assert settings["spec"] == "steady:k=2" and settings["rule_defined_in"] == [f"{rules.resolve()}:Steady"]
        first = load_trace(out / "traces" / "batch-00000.npz")
        write_user_rules(rules, edited=True)  # Steady waits one pass longer: the old traces are not this code's
        assert analyze_dynamics.main(args) == 0
        again = load_trace(out / "traces" / "batch-00000.npz")
        assert again[2]["rule_code"] != first[2]["rule_code"]
        assert json.loads((out / "dynamics.json").read_text())["settings"]["rule_code"] == again[2]["rule_code"]
        assert not np.array_equal(again[0].passes, first[0].passes)  # traced again with the edited rule


def test_the_plots_module_run_as_a_program_says_which_command_draws_the_figures(capsys):
    """Issue #47: `python -m localleap_jax.commands.plots` printed nothing."""
    from localleap_jax.commands import plots

    assert plots.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python experiments/analyze_dynamics.py --output DIR") and "--from-traces" in err
