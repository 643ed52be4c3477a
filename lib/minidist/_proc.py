"""Resident memory of this process, read from Linux's ``/proc/self`` (a foundation: imports nothing).

``minidist.memory`` (the calculator, a tool) re-exports these as ``rss_bytes``,
``peak_rss_bytes`` and ``reset_peak_rss``; ``minidist.parallel.offload`` uses them to
check its budget. One copy here, below both.
"""

from __future__ import annotations

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss"]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _status_bytes(field: str, what: str) -> int:
    kib = _status_kib(field)
    if kib is None:
        raise RuntimeError(f"{what} needs Linux's /proc/self/status ({field}); not available here")
    return kib * 1024


def rss_bytes() -> int:
    """Resident set size now (VmRSS in /proc/self/status), in bytes. Raises on a system without /proc."""
    return _status_bytes("VmRSS", "rss_bytes")


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM, the 'high water mark') since start or the last ``reset_peak_rss``."""
    return _status_bytes("VmHWM", "peak_rss_bytes")


def reset_peak_rss() -> bool:
    """Reset the peak to the current RSS (write "5" to /proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
