"""The seeds' experiments replayed on the calibrated profile (virtual time, a few seconds)."""

from engines.emulated.experiments import format_knee, format_tiers, run_knee, run_tiers


def test_tier_table_within_10_percent_of_every_cell():
    res = run_tiers("qwen3-coder-30b-a3b@h20")
    print(format_tiers(res))
    cells = [(row["L"], t, row[t]) for row in res["rows"] for t in res["tiers"]]
    assert len(cells) == 16
    bad = [(L, t, c) for L, t, c in cells if abs(c["diff"]) > 0.10]
    assert not bad, bad
    # the tier order holds at every length
    for row in res["rows"]:
        assert row["gpu"]["ours"] < row["cpu"]["ours"] < row["remote"]["ours"] < row["miss"]["ours"]


def test_capacity_knee_shape():
    res = run_knee("qwen3-coder-30b-a3b@h20")
    print(format_knee(res))
    assert abs(res["working_set_gb_per_session"] - 0.91) < 0.01
    rows = {r["capacity_gb"]: r for r in res["rows"]}
    apc = {c: r["apc"] for c, r in rows.items()}
    p90 = {c: r["ttft_p90"] for c, r in rows.items()}
    # APC rises through the knee and saturates at ~ 4 x 0.91 GB
    assert apc[1.2] < apc[2.4] < apc[3.6]
    assert apc[1.2] < 0.15 and 0.25 < apc[2.4] < 0.5 and apc[3.6] > 0.75
    # TTFT p90 collapses at the knee
    assert p90[3.6] < 0.1 * p90[1.2] and p90[3.6] < 0.25 * p90[2.4]
    # and nothing changes beyond it
    for c in (4.8, 7.2, 9.7, 14.5):
        assert abs(apc[c] - apc[3.6]) < 0.02
        assert abs(p90[c] - p90[3.6]) < 0.25 * p90[3.6]
