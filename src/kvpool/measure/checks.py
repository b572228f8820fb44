"""One check of a gate and what a verdict rests on.

A check has a status: ``passed`` or ``failed`` where it tested something, ``not_applicable`` where it
cannot fail on this unit (a cold device read on a memory tier, a byte check of a pool held in a server's
memory), ``not_verified`` where it could not be made (an external fleet's pool, answers under batch
composition that changes the numerics). Only a failed check fails a verdict; a verdict with no passed
check is not valid either. ``ok`` is True, False, or None for the last two.
"""

from __future__ import annotations

PASSED, FAILED, NOT_APPLICABLE, NOT_VERIFIED = "passed", "failed", "not_applicable", "not_verified"
STATUSES = (PASSED, FAILED, NOT_APPLICABLE, NOT_VERIFIED)


def check(ok: bool, value, threshold, **extra) -> dict:
    """A check that tested something: whether it passed, the measured value and what it needed."""
    return {"ok": bool(ok), "status": PASSED if ok else FAILED, "value": value, "threshold": threshold, **extra}


def not_applicable(reason: str, value=None, **extra) -> dict:
    """A check that cannot fail on this unit, and why."""
    return {"ok": None, "status": NOT_APPLICABLE, "value": value, "threshold": None, "reason": reason, **extra}


def not_verified(reason: str, value=None, **extra) -> dict:
    """A check that could not be made here, and why."""
    return {"ok": None, "status": NOT_VERIFIED, "value": value, "threshold": None, "reason": reason, **extra}


def status(found: dict) -> str:
    """A check's status; records written before statuses existed have only ``ok``."""
    return found.get("status") or (PASSED if found["ok"] else FAILED)


def verdict(checks: dict) -> bool:
    """Valid: no check failed, and at least one passed."""
    statuses = [status(c) for c in checks.values()]
    return FAILED not in statuses and PASSED in statuses


def tally(checks: dict) -> dict[str, int]:
    """How many checks of each status a verdict rests on."""
    statuses = [status(c) for c in checks.values()]
    return {name: statuses.count(name) for name in STATUSES}


def failures(result: dict) -> list[str]:
    """Human-readable reasons a unit is invalid (``result``: its ``checks``)."""
    return [f"{name}: value {c['value']!r}, threshold {c['threshold']!r}"
            + (f"; e.g. {c['examples'][0]}" if c.get("examples") else "")
            for name, c in result["checks"].items() if status(c) == FAILED]


def skipped(result: dict) -> list[str]:
    """The checks of ``result`` that were not applicable or not verified, each with its reason."""
    return [f"{name} ({status(c).replace('_', ' ')}): {c.get('reason', '')}"
            for name, c in result["checks"].items() if status(c) in (NOT_APPLICABLE, NOT_VERIFIED)]
