"""The records of a replay's results folder (``records/<run>.csv``), read once for every view.

The replay report's sections (:mod:`analysis.lost_hits`, :mod:`analysis.fairness`) each look at
every run's records; a folder of many long runs is most of the report's time in reading, so the
report reads the folder once here and hands the frames to each view. The empty string stays a
string in text columns (an ``error`` of ``""`` is no error, a session named ``NA`` stays named);
only the time columns take ``""`` as missing.
"""

from __future__ import annotations

import pathlib
from typing import Any

from gpuhit.errors import ConfigError

#: the columns whose empty value means "not reached" (NaN): the others keep ``""``
TIME_COLUMNS = ("arrival", "first_token", "finish")


def read_folder(folder: str | pathlib.Path) -> list[tuple[str, Any]]:
    """``(run, frame)`` for each ``records/*.csv`` of ``folder``, by run name; a folder without
    records is a :class:`ConfigError` naming it."""
    import pandas as pd

    folder = pathlib.Path(folder)
    recs = sorted((folder / "records").glob("*.csv"))
    if not recs:
        raise ConfigError(f"{folder}: no records/*.csv (is it a gpuhit replay results folder?)")
    na = {c: [""] for c in TIME_COLUMNS}
    return [(p.stem, pd.read_csv(p, keep_default_na=False, na_values=na)) for p in recs]


__all__ = ["TIME_COLUMNS", "read_folder"]
