"""What every chart's data shares: bytes in a MiB, and DataFrames with fixed column dtypes (`typed_frame`)."""

from __future__ import annotations

import pandas as pd

MIB = 1024 * 1024


def typed_frame(rows: list[tuple], dtypes: dict[str, str]) -> pd.DataFrame:
    """A DataFrame with fixed column dtypes, also when empty (Gradio's plots take each axis's type,
    quantitative or nominal, from the dtype, and an empty frame would otherwise be `object`: nominal).

    Args:
        rows: one tuple per row, its values in the order of `dtypes`.
        dtypes: column name -> pandas dtype name ("int64", "float64", "string").

    Built column by column, each column in its dtype at once (half the time of a frame of objects converted by
    `astype`; the charts rebuild their frames at every decode step)."""
    columns = list(zip(*rows)) if rows else [()] * len(dtypes)
    return pd.DataFrame(
        {name: pd.Series(column, dtype=dtype) for (name, dtype), column in zip(dtypes.items(), columns)}
    )
