"""The opening lines of a comparison: the winner only with its paired evidence, ties named, one line each."""

from __future__ import annotations

from analysis.headline import headline, winner

META = {"trace": "weka_cc", "root_sessions": 20, "subagent_sessions": 19, "requests_per_run": 2357,
        "instances": 8, "profile": "p", "block_size": 16, "wall_s": 47.6}


def _runs(values: dict[str, list[float]], ttft_scale: float = 0.1) -> list[dict]:
    return [{"policy": p, "seed": s, "latency_p90": v, "ttft_p90": v * ttft_scale}
            for p, vs in values.items() for s, v in enumerate(vs)]


def test_winner_is_the_lowest_mean_with_its_paired_margin_to_the_runner_up():
    w = winner(_runs({"a": [10.0, 11.0, 12.0], "b": [12.0, 13.5, 14.0], "c": [20.0, 20.0, 20.0]}), "latency_p90")
    assert (w["winner"], w["runner_up"]) == ("a", "b")
    assert w["diff"]["n"] == 3 and w["diff"]["significant"] and w["diff"]["mean"] < 0


def test_three_lines_say_what_who_and_where():
    lines = headline(_runs({"a": [10.0, 11.0, 12.0], "b": [12.0, 13.5, 14.0]}), META, "results/x")
    assert len(lines) == 3
    assert lines[0].startswith("Replayed weka_cc: 20 sessions (+19 sub-agent sessions), 2,357 requests")
    assert "latency p90: a 11.0 s, ahead of b 13.2 s by 2.17 s (16%; 95% CI" in lines[1]
    assert "n=3 paired seeds" in lines[1] and "TTFT p90: a" in lines[1]
    assert lines[2] == "Report: results/x/report.html (plots beside it, *.png); full table: results/x/comparison.txt."


def test_no_clear_winner_when_the_interval_holds_zero_and_ties_are_named():
    noisy = headline(_runs({"a": [10.0, 14.0, 8.0], "b": [11.0, 10.0, 12.0]}), META, "o")[1]
    assert "no clear winner over" in noisy and "includes 0" in noisy
    tie = headline(_runs({"a": [10.0, 11.0], "b": [10.0, 11.0], "c": [15.0, 16.0]}), META, "o")[1]
    assert tie.startswith("latency p90: a, b (equal) 10.5 s, ahead of c 15.5 s")
    same = headline(_runs({"a": [10.0, 11.0], "b": [10.0, 11.0]}), META, "o")[1]
    assert "no difference between the policies" in same
