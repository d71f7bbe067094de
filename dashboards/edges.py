"""Bucket edges of any layout picked out by their `le` text: a regular expression that
matches every spelling of a number at or below a bound.

Why: Prometheus (2.42, Debian's) compares `le` as text only, and an engine the daemon
scrapes (vLLM, SGLang) keeps its own edges, which the rules cannot list. Buckets are
cumulative, so among the buckets whose `le` this matches, the largest count is the count
at the nearest edge at or below the bound, whatever the layout.

Spellings covered: prometheus_client's (`floatToGoString`: `0.1`, `2560.0`, `1e-05`,
`1.5e+06`) and Go clients' (`1`, `0.25`). A bound must lie in [1e-4, 1e6): below it every
`e-` spelling is under the bound, above it none of the `e+` ones is.
"""
from __future__ import annotations

from decimal import Decimal

LOWEST, HIGHEST = 1e-4, 1e6


def _below_digits(digit: str, least: int = 0) -> str:
    """A character class of the digits from `least` up to under `digit` ('' if none)."""
    d = int(digit)
    if d <= least:
        return ""
    return str(least) if d == least + 1 else f"[{least}-{d - 1}]"


def _integers_below(n: str) -> list[str]:
    """Alternatives matching the integers (no leading zeros) under the integer `n`."""
    if n == "0":
        return []
    out = ["0"] if len(n) == 1 else ["0", f"[1-9][0-9]{{0,{len(n) - 2}}}"]
    for i, digit in enumerate(n):
        # A first digit is never 0 (the shorter integers are matched above).
        lower = _below_digits(digit, 1 if i == 0 else 0)
        if lower:
            rest = len(n) - i - 1
            out.append(n[:i] + lower + (f"[0-9]{{{rest}}}" if rest else ""))
    return out


def _fractions_at_or_below(g: str) -> str:
    """A regex of the fraction digits f with 0.f <= 0.g (g without trailing zeros)."""
    out = [g + "0*"] if g else ["0*"]
    for i, digit in enumerate(g):
        lower = _below_digits(digit)
        out.append(g[:i] + (f"({lower}[0-9]*)?" if lower else ""))
    return "|".join(dict.fromkeys(out))


def le_at_or_below(bound: float) -> str:
    """A regular expression (anchored, as PromQL's =~ is) of the `le` texts whose number
    is at or below `bound`."""
    if not LOWEST <= bound < HIGHEST:
        raise ValueError(f"{bound}: a bound for an le pattern lies in [{LOWEST}, {HIGHEST})")
    text = format(Decimal(repr(float(bound))), "f")
    integer, _, fraction = text.partition(".")
    fraction = fraction.rstrip("0")
    below = _integers_below(integer)
    plain = f"{integer}(\\.({_fractions_at_or_below(fraction)}))?"
    if below:
        plain = f"({plain}|({'|'.join(below)})(\\.[0-9]*)?)"
    return f"{plain}|[0-9.]+e-[0-9]+"
