"""Remove a directory tree a submission may have shaped: without recursion, without following links.

``shutil.rmtree`` recurses once per directory level, so a submission that leaves 3,000 nested
directories in its working directory makes it raise ``RecursionError`` (which its
``ignore_errors`` does not catch) and stops the grader. Paths that deep are also longer than
``PATH_MAX``, so a walk by path names fails too. ``remove_tree`` therefore walks with directory
descriptors (``dir_fd``), holding one open at a time: it goes down into the first
sub-directory it finds, and back up through ``..`` once a directory is empty. It never follows
a symlink (a link is unlinked, not entered: directories are opened with ``O_NOFOLLOW``), and it
gives a directory ``rwx`` for its owner before emptying it (a sandbox may have left ``chmod
000`` directories behind; without root that would stop the removal).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(root: Path | str) -> list[str]:
    """Delete ``root`` and everything under it; returns what could not be removed (never raises).

    A directory that cannot be emptied or removed (a mount point, a file root may not delete)
    is remembered and not entered again, so the walk always ends; the errors are returned, not
    raised: cleanup must not stop the batch.
    """
    root = os.fspath(root)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            os.unlink(root)
            return []
        _make_enterable(root, None)
        fd = os.open(root, _OPEN_DIR)
    except FileNotFoundError:
        return []
    except OSError as error:
        return [f"{root}: {error.strerror}"]
    failed: list[str] = []
    stuck: set[tuple[int, int]] = set()  # (st_dev, st_ino) of directories that would not go
    names: list[str] = []  # the path from root down to the directory open as fd
    try:
        while True:
            child = _empty_files(fd, stuck, failed, os.path.join(root, *names))
            if child is not None:  # go down
                try:
                    _make_enterable(child, fd)
                    down = os.open(child, _OPEN_DIR, dir_fd=fd)
                except OSError as error:
                    failed.append(f"{os.path.join(root, *names, child)}: {error.strerror}")
                    info = os.stat(child, dir_fd=fd, follow_symlinks=False)  # scandir saw it: it is there
                    stuck.add((info.st_dev, info.st_ino))
                    continue
                os.close(fd)
                fd, names = down, [*names, child]
                continue
            if not names:  # root itself is as empty as it gets
                break
            up = os.open("..", _OPEN_DIR & ~os.O_NOFOLLOW, dir_fd=fd)
            info = os.fstat(fd)
            os.close(fd)
            fd, name = up, names.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as error:
                failed.append(f"{os.path.join(root, *names, name)}: {error.strerror}")
                stuck.add((info.st_dev, info.st_ino))
    except OSError as error:
        failed.append(f"{os.path.join(root, *names)}: {error.strerror}")
    finally:
        os.close(fd)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError as error:
        failed.append(f"{root}: {error.strerror}")
    return list(dict.fromkeys(failed))  # a directory is scanned again on the way up: no repeats


def _empty_files(fd: int, stuck: set, failed: list[str], where: str) -> str | None:
    """Unlink every non-directory in ``fd``; return one sub-directory to enter (None: none left)."""
    child = None
    with os.scandir(fd) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                if child is None and (info.st_dev, info.st_ino) not in stuck:
                    child = entry.name
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as error:
                failed.append(f"{os.path.join(where, entry.name)}: {error.strerror}")
    return child


def _make_enterable(name: str, dir_fd: int | None) -> None:
    """Give the owner rwx on a directory (not following links), so it can be listed and emptied."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode) and (mode & 0o700) != 0o700:
            os.chmod(name, stat.S_IMODE(mode) | 0o700, dir_fd=dir_fd)  # a directory: no link to follow
    except OSError:
        pass
