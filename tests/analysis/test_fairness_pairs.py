"""analysis.fairness_pairs: request-by-request differences between two policies on the same seeds."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.fairness_pairs import compare, load, tail
from engines.emulated.profile import DEFAULT_PROFILE, load_profile
from gpuhit.errors import ConfigError


def _records(policy, waits):
    rows = []
    for k, (inp, wait) in enumerate(zip((1_000, 40_000), waits, strict=True)):
        rows.append({"policy": policy, "seed": 0, "session": f"s{k}", "turn": 0, "arrival": 10.0 * k,
                     "first_token": 10.0 * k + wait + 1.0, "finish": 10.0 * k + wait + 2.0, "input_tokens": inp,
                     "realized_hit_tokens": 0, "reason": f"{policy}: pending {int(wait * 1000)} + new {inp}",
                     "error": ""})
    return pd.DataFrame(rows)


def test_pairs_split_by_length_and_the_tail_wait(tmp_path):
    (tmp_path / "records").mkdir()
    _records("a", (0.0, 3.0)).to_csv(tmp_path / "records" / "a-seed0.csv", index=False)
    _records("b", (0.5, 1.0)).to_csv(tmp_path / "records" / "b-seed0.csv", index=False)
    prof = load_profile(DEFAULT_PROFILE)
    d = load(tmp_path, "a", prof)
    assert d["own_prefill"].tolist() == [prof.prefill_cost(1_000, 0), prof.prefill_cost(40_000, 0)]
    assert d["wait"].tolist() == pytest.approx([1.0 - prof.prefill_cost(1_000, 0), 4.0 - prof.prefill_cost(40_000, 0)])
    assert tail(d)["session"].tolist() == ["s1"]  # the 40k prompt is the TTFT tail
    md = compare(tmp_path, "a", "b")
    assert "| (32000, 1000000000] | 1 | 4.00 | 2.00 | +2.00 | +2.00 |" in md
    assert "| (0, 2000] | 1 | 1.00 | 1.50 | -0.50 | -0.50 |" in md
    assert "| a | 1 | 100 | 40,000 |" in md and "| 3,000 |" in md
    with pytest.raises(ConfigError, match="no records of policy 'c'"):
        compare(tmp_path, "a", "c")
