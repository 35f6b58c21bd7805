"""The times flaloop writes: one expression per format, so every record and name agrees.

Two forms of one UTC instant, to the second:

    now_iso()    2026-12-03T16:33:53+00:00   the times inside records (created, started, added)
    now_stamp()  20261203T163353Z            run, sweep, trace and gate-log names (sorted = oldest first)

`name_safe(iso)` is an ISO time without colons (`2026-12-03T163353+0000`), for the names of
copies set aside; `stamp_of(iso)` is the stamp of a time already taken, so a gate's log is named
by the second its record says it started. `local_stamp()` is the user's local time, for backups
of files the user owns (SKILL.md). `parse_iso` and `parse_stamp` read both forms back.
"""

from __future__ import annotations

import datetime as _dt
import time

STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
LOCAL_STAMP_FORMAT = "%Y%m%dT%H%M%S"


def now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def iso(t: _dt.datetime) -> str:
    return t.isoformat(timespec="seconds")


def now_iso() -> str:
    return iso(now())


def stamp(t: _dt.datetime) -> str:
    return t.astimezone(_dt.timezone.utc).strftime(STAMP_FORMAT)


def now_stamp() -> str:
    return stamp(now())


def today() -> str:
    """The UTC date, `2026-12-03`."""
    return now_iso()[:10]


def name_safe(iso_time: str) -> str:
    return iso_time.replace(":", "")


def stamp_of(iso_time: str) -> str:
    """The stamp of a UTC ISO time as `now_iso` writes it."""
    return iso_time.replace(":", "").replace("-", "").replace("+0000", "Z")


def parse_iso(text: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(text)


def parse_stamp(text: str) -> _dt.datetime:
    return _dt.datetime.strptime(text, STAMP_FORMAT).replace(tzinfo=_dt.timezone.utc)


def local_stamp() -> str:
    return time.strftime(LOCAL_STAMP_FORMAT)
