"""What every chart's data shares: bytes in a MiB, and DataFrames with fixed column dtypes (`typed_frame`)."""

from __future__ import annotations

import pandas as pd

MIB = 1024 * 1024


def typed_frame(rows: list[tuple], dtypes: dict[str, str]) -> pd.DataFrame:
    """A DataFrame with fixed column dtypes, also when empty (Gradio's plots take each axis's type,
    quantitative or nominal, from the dtype, and an empty frame would otherwise be `object`: nominal)."""
    return pd.DataFrame(rows, columns=list(dtypes)).astype(dtypes)
