"""Analysis: per-run summaries, A/B comparisons with bootstrap CIs, plots and reports."""
