"""How a measured value, its interval and what it rests on read in every table and page."""

from __future__ import annotations

import pandas as pd

from kvpool.stats import ONE_WINDOW, change_claim


def fmt_value(value, unit: str) -> str:
    """A measured value as the tables show it: a fraction as a percentage, a count whole, anything else
    to three significant digits with its unit."""
    if value is None or pd.isna(value):
        return "n/a"
    if unit == "fraction":
        return f"{100 * value:.0f}%"
    if unit == "count":
        return f"{int(value)}"
    return f"{value:.3g}" + (f" {unit}" if unit else "")


def fmt_interval(low, high, unit: str = "") -> str:
    """An interval as the tables show it after its value (a fraction's in percent), or nothing where it
    was not measured."""
    if pd.isna(low) or pd.isna(high):
        return ""
    if unit == "fraction":
        return f" [{100 * low:.0f}, {100 * high:.0f}%]"
    return f" [{low:.3g}, {high:.3g}]"


def fmt_supported(value, unit: str, basis, n, low, high) -> str:
    """A value as Table 1 shows it: a maximum named "max of n", otherwise the value, its interval and n."""
    if isinstance(basis, str) and basis.startswith("max of"):
        return f"{basis}: {fmt_value(value, unit)}"
    shown = fmt_value(value, unit) + fmt_interval(low, high, unit)
    return shown + (f" (n={int(n)})" if pd.notna(n) and basis not in (ONE_WINDOW, "count") else "")


def table1_arm(row, arm: str) -> str:
    """One arm's figure in a row of Table 1's long form, as :func:`fmt_supported` shows it."""
    return fmt_supported(row[arm], row["unit"], row.get(f"{arm}_basis"), row.get(f"{arm}_n"), row[f"{arm}_ci_low"],
                         row[f"{arm}_ci_high"])


def table1_ratio(row) -> str:
    """A row's isolated-over-shared ratio with its interval, "(of maxima)" where an arm gives its largest sample."""
    if pd.isna(row["ratio"]):
        return "n/a"
    maxima = any(str(row.get(f"{arm}_basis", "")).startswith("max of") for arm in ("isolated", "shared"))
    interval = f" [{row['ratio_ci_low']:.1f}, {row['ratio_ci_high']:.1f}]" if pd.notna(row.get("ratio_ci_low")) else ""
    return f"{row['ratio']:.1f}x{interval}" + (" (of maxima)" if maxima else "")


def pct(value) -> str:
    return "n/a" if pd.isna(value) else fmt_value(value, "") + "%"


def change_cells(row) -> tuple[str, str]:
    """A row's mean paired change and its interval as the page shows them, the interval with what it lets
    the page say (a direction, or no difference shown; kvpool.stats.change_claim)."""
    interval = fmt_interval(row.change_ci_low_pct, row.change_ci_high_pct).strip()
    claim = change_claim(row.change_ci_low_pct, row.change_ci_high_pct)
    return pct(row.mean_paired_change_pct), f"{interval}: {claim}" if interval else claim


def markdown_table(header: list[str], rows) -> list[str]:
    """A Markdown table's lines: the header, its rule and one line per row (a sequence of cells)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]
