"""md.launch: results, start methods, and every way a worker can fail."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import minidist as md
import workers
from conftest import wait_until

REPO = str(Path(__file__).resolve().parents[3])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    outs = md.launch(workers.identity, world_size, timeout=30)
    assert [o[:4] for o in outs] == [(r, world_size, r, "cpu") for r in range(world_size)]
    assert len({o[4] for o in outs}) == world_size  # one process per rank
    assert os.getpid() not in {o[4] for o in outs}


def test_args_and_kwargs_reach_every_rank():
    outs = md.launch(workers.add_args, 3, args=(10,), kwargs={"b": 5, "scale": 2}, timeout=30)
    assert outs == [30, 32, 34]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
@pytest.mark.parametrize("transport", ["pipe", "shm", "torch"])
def test_every_start_method_with_every_transport(start_method, transport):
    outs = md.launch(
        workers.ring_pass, 2, args=(100,), transport=transport, start_method=start_method, timeout=60
    )
    assert torch.equal(outs[0][0], torch.full((100,), 1.0))
    assert torch.equal(outs[1][0], torch.full((100,), 0.0))


def test_exception_in_one_rank_names_it_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.raise_in_rank, 3, args=(2,), timeout=60)
    assert time.monotonic() - start < 15  # the others slept 60 s: they were killed
    error = info.value
    assert error.rank == 2 and error.exc_type == "ValueError"
    assert "deliberate failure in rank 2" in str(error)
    assert "raise_in_rank" in error.remote_traceback  # the remote traceback shows the student's line
    assert "rank 2 failed" in str(error)


def test_os_exit_is_reported_with_its_code():
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.os_exit_in_rank, 2, args=(7,), timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == 7
    assert "exited with code 7" in str(info.value)


def test_sys_exit_is_reported_as_such():
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.sys_exit_in_rank, 2, timeout=60)
    assert info.value.rank == 0 and info.value.exc_type == "SystemExit"


@pytest.mark.parametrize("sig, name", [(signal.SIGKILL, "SIGKILL"), (signal.SIGSEGV, "SIGSEGV")])
def test_a_rank_killed_by_a_signal(sig, name):
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.signal_in_rank, 2, args=(int(sig),), timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == -sig
    assert f"killed by {name}" in str(info.value)


@pytest.mark.parametrize("transport", ["pipe", "shm", "torch"])
def test_deadlock_times_out_with_every_rank_stack(transport):
    start = time.monotonic()
    with pytest.raises(md.LaunchTimeout) as info:
        md.launch(workers.deadlock, 2, transport=transport, timeout=3)
    assert time.monotonic() - start < 15
    error = info.value
    assert error.ranks == [0, 1]
    for rank in (0, 1):
        assert "deadlock" in error.stacks[rank]  # the worker function's frame
        assert "recv" in error.stacks[rank]  # ... and that it was stuck receiving
    assert "--- rank 1 ---" in str(error)


def test_busy_loop_times_out_showing_the_line():
    with pytest.raises(md.LaunchTimeout) as info:
        md.launch(workers.busy_loop_forever, 1, timeout=2)
    assert "busy_loop_forever" in info.value.stacks[0]


def test_children_of_workers_are_killed(tmp_path):
    pids = md.launch(workers.leave_a_child, 2, args=(str(tmp_path),), timeout=30)
    assert wait_until(lambda: all(gone(pid) for pid in pids))


def test_worker_output_is_forwarded_with_the_rank(capfd):
    md.launch(workers.print_something, 2, timeout=30)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank}" in out
        assert f"[rank {rank}] a warning from rank {rank}" in err


def test_unpicklable_return_value_is_explained():
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.return_unpicklable, 1, timeout=30)
    assert "cannot be pickled" in str(info.value)


def test_bad_arguments_are_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="world_size"):
        md.launch(workers.identity, 0)
    with pytest.raises(ValueError, match="transport"):
        md.launch(workers.identity, 2, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="start_method"):
        md.launch(workers.identity, 2, start_method="teleport")
    with pytest.raises(ValueError, match="timeout"):
        md.launch(workers.identity, 2, timeout=-1)
    with pytest.raises(TypeError, match="function"):
        md.launch("identity", 2)
    with pytest.raises(ValueError, match="lambda"):
        md.launch(lambda comm: None, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        md.launch(workers.identity, 2, device="cuda")


def test_many_launches_leak_no_file_descriptors():
    md.launch(workers.identity, 2, timeout=30)  # warm up the fork server
    before = len(os.listdir("/proc/self/fd"))
    for transport in ["pipe", "shm", "torch"] * 3:
        md.launch(workers.identity, 2, transport=transport, timeout=30)
    assert len(os.listdir("/proc/self/fd")) <= before + 2


PYTHONPATH = {
    "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.path.join(REPO, "lib")])
}


def _run_python(code: str, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **PYTHONPATH},
    )


def _start_launcher(world_size: int, pid_dir) -> subprocess.Popen:
    """A separate Python process (like a notebook kernel) launching sleeping workers."""
    # A Jupyter kernel installs its own SIGINT handler; so does this launcher, because a
    # process started from a background job (`cmd &` in a script, as some CI runners do)
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import minidist as md, workers\n"
        f"md.launch(workers.sleep_and_record_pid, {world_size}, args=({str(pid_dir)!r},), timeout=120)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", code],
        env={**os.environ, **PYTHONPATH},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_function_from_a_notebook_gets_a_clear_error():
    """In `python -c` (like a notebook) __main__ has no file a worker could import."""
    result = _run_python(
        """
        import minidist as md
        def my_worker(comm):
            return comm.rank
        try:
            md.launch(my_worker, 2)
        except ValueError as error:
            print("ERROR:", error)
        print("fork:", md.launch(my_worker, 2, start_method="fork"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ERROR: 'my_worker' is defined in this notebook" in result.stdout
    assert "%%writefile" in result.stdout
    assert "fork: [0, 1]" in result.stdout


def test_keyboard_interrupt_kills_every_worker(tmp_path):
    """What "interrupt kernel" does in Jupyter: SIGINT to the launching process."""
    proc = _start_launcher(3, tmp_path)
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 3, timeout=60), proc.stderr.read()
        time.sleep(0.2)
        pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Say what was still alive, and where the launcher was (faulthandler prints every
            # thread's stack on SIGABRT).
            alive = [pid for pid in pids if not gone(pid)]
            launcher_alive = proc.poll() is None
            proc.send_signal(signal.SIGABRT)
            _, stderr = proc.communicate(timeout=30)
            pytest.fail(
                f"no exit 30 s after SIGINT: launcher alive: {launcher_alive}, "
                f"workers/grandchildren alive: {alive}\nlauncher stderr:\n{stderr}"
            )
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in stderr
    assert wait_until(lambda: all(gone(pid) for pid in pids)), [p for p in pids if not gone(p)]


def test_killing_the_launcher_kills_the_workers(tmp_path):
    """Even SIGKILL of the launching process (no cleanup code runs) leaves no worker behind."""
    proc = _start_launcher(2, tmp_path)
    pids = []
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("*.pid"))) == 2, timeout=60)
        time.sleep(0.2)
        pids = [[int(p) for p in f.read_text().split()] for f in tmp_path.glob("*.pid")]
        proc.kill()
        proc.communicate(timeout=10)
        assert wait_until(lambda: all(gone(worker) for worker, _ in pids), timeout=10)
    finally:
        proc.kill()
        # The workers' own children are orphaned when the launcher gets SIGKILL (no code of
        # ours runs then); they are not what this test is about, so clean them up here.
        for _, grandchild in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)


def test_script_without_main_guard_is_explained(tmp_path):
    """A script that calls launch() at import time: the workers re-import it and fail."""
    script = tmp_path / "unguarded.py"
    script.write_text("import minidist as md, workers\nmd.launch(workers.identity, 2, timeout=30)\n")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **PYTHONPATH},
    )
    assert result.returncode != 0
    assert "while starting" in result.stderr and "__name__ == '__main__'" in result.stderr


def test_lock_from_the_wrong_context_is_explained():
    import multiprocessing

    lock = multiprocessing.get_context("fork").Lock()
    with pytest.raises(ValueError, match=r"get_context\('forkserver'\)"):
        md.launch(workers.add_args, 2, args=(lock,), timeout=30)


def test_a_timeout_stack_drops_idle_queue_threads_and_keeps_a_busy_one():
    """The stack a LaunchTimeout shows: a transport's idle per-peer thread (parked in its queue's
    ``_run``) is noise and goes; one stuck moving a message (``_do_recv``) and the main thread stay.
    Built from the real file names, so moving the queue code without the filter fails here."""
    from minidist import _stacks
    from minidist.transport import base, queues

    def frame(path, line, name):
        return f'  File "{path}", line {line} in {name}'

    idle = ["Thread 0x0001 (most recent call first):", frame(queues.__file__, 38, "_run")]
    busy = [
        "Thread 0x0002 (most recent call first):",
        frame(base.__file__, 160, "_do_recv"),
        frame(queues.__file__, 40, "_run"),
    ]
    main = ["Current thread 0x0003 (most recent call first):", frame("/work/student.py", 7, "ring")]
    tidy = _stacks._tidy_stack("\n".join(idle + busy + main))
    assert "Thread 0x0001" not in tidy
    assert "Thread 0x0002" in tidy and "_do_recv" in tidy
    assert "student.py" in tidy
