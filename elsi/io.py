"""Project-wide I/O: JSON and safetensors files that check themselves, and one writer at a time.

Integrity: every safetensors file elsi writes (Gram tensor, shards, draft-training
checkpoints) carries in its header a SHA-256 of its tensors (names, dtypes, shapes and
bytes) and of its JSON metadata (``tensors_digest``); reading it back recomputes the
digest, so a flipped byte anywhere in the file is an error naming the file, never a
silently different answer. A JSON file written with ``rebuild`` carries its own checksum too
(``write_json`` / ``read_json``).

One writer at a time: every directory or cache entry elsi writes and later reads back or resumes (a run
directory, a draft's output, a study directory, a feature cache, a converted model, cached answers, a
benchmark's progress file) is written under ``lock``: an advisory lock file ``<path>.lock`` beside it,
holding the owner's pid, host, start time and command, created atomically before the first write and
removed on the way out (an error, Ctrl-C or SIGTERM included). A second writer is refused at once
(``BusyError``), or, where that is the useful behaviour (a cache another process is building), waits for
it and then reads what it built. Readers of a finished artefact take no lock. A lock left by a process
that no longer runs on this host (SIGKILL, a power cut) is taken over with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DIGEST = "elsi_sha256"  # safetensors metadata key of the file's own checksum


class RunError(ValueError):
    """An output directory or file (a run directory, a draft, a study, a cache) that cannot be used as asked."""


INTEGRITY = "integrity"  # JSON key of a file's own checksum: {"sha256", "rebuild"}


def json_digest(obj: dict) -> str:
    """SHA-256 of ``obj`` less its ``integrity`` entry, in a canonical form (sorted keys, no spaces)."""
    body = {k: v for k, v in obj.items() if k != INTEGRITY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: dict, rebuild: str | None = None) -> None:
    """Write JSON atomically (a temporary file of this process's own, then rename: two processes writing one file
    at once leave one of theirs whole, never a mix). With ``rebuild`` (what remakes the file, for the error
    message) the file carries its own checksum, which ``read_json`` checks."""
    if rebuild is not None:
        obj = {**{k: v for k, v in obj.items() if k != INTEGRITY},
               INTEGRITY: {"sha256": json_digest(obj), "rebuild": rebuild}}
    write_text(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` atomically (a temporary file of this process's own, then rename)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path, fix: str = "remove it or use another --out") -> dict:
    """A JSON object from ``path``, checked against its own checksum when it has one; RunError naming the
    file and ``fix`` (or the remedy the file records) when it is damaged."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunError(f"{path} is corrupt ({err.msg} at char {err.pos}); {fix}") from err
    except UnicodeDecodeError as err:
        raise RunError(f"{path} is corrupt (not UTF-8 text); {fix}") from err
    if not isinstance(obj, dict):
        raise RunError(f"{path} is corrupt (a JSON {type(obj).__name__}, not an object); {fix}")
    seal = obj.get(INTEGRITY)
    if isinstance(seal, dict) and "sha256" in seal and seal["sha256"] != json_digest(obj):
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it; "
                       f"{seal.get('rebuild') or fix}")
    return obj


# ---------------------------------------------------------------------------------------------
# One writer at a time: advisory lock files

LOCK_SUFFIX = ".lock"
UNREADABLE_S = 5.0  # a lock file unreadable for this long is damaged (or, without hard links, left half-written)
_held: dict[Path, str] = {}  # lock file -> token: the locks this process holds (taking one again nests)


class ProgressFile:
    """The finished parts of one long job (a benchmark's questions or configurations), in a JSON file written whole
    after each part (``{"key": {...}, "done": {PART: VALUE}}``), so that an interrupted job goes on from there. The
    file is taken up only when its key (what the results depend on, by name) equals this run's; otherwise, or when
    it is damaged, a warning says why (``names``: a key's name in words) and the job starts over. ``path`` None
    keeps nothing. One writer: the process holding the lock of the output the job writes (``lock``)."""

    def __init__(self, path: str | Path | None, key: dict, names: dict[str, str] | None = None) -> None:
        self.path = Path(path) if path else None
        self.key = json.loads(json.dumps(key))  # as JSON reads it back
        self.done: dict = {}
        if self.path is None or not self.path.is_file():
            return
        try:
            rec = json.loads(self.path.read_text())
        except (OSError, ValueError):
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("done"), dict):
            warnings.warn(f"{self.path} is damaged: starting over")
        elif rec.get("key") != self.key:
            theirs = rec["key"] if isinstance(rec.get("key"), dict) else {}
            diff = [(names or {}).get(k, k) for k in dict.fromkeys([*self.key, *theirs])
                    if theirs.get(k) != self.key.get(k)]
            warnings.warn(f"{self.path} holds the progress of other {' and '.join(diff)}: starting over")
        else:
            self.done = rec["done"]

    def get(self, part: str):
        """A finished part's value, or None."""
        return self.done.get(part)

    def put(self, part: str, value) -> None:
        """Record a finished part (JSON-serialisable ``value``) and write the file whole."""
        if self.path is None:
            return
        self.done[part] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"key": self.key, "done": self.done})


class BusyError(RunError):
    """A directory or cache entry that another elsi process is writing."""


def lock_path(path: str | Path) -> Path:
    """The lock file of ``path`` (a directory or a file): ``<path>.lock`` beside it, out of the way of what is
    written inside and of a directory replaced whole; two spellings of one path (relative, a symlink) share it."""
    p = Path(path).expanduser().resolve()
    if not p.name:
        raise ValueError(f"cannot lock {path}: elsi writes below a directory, not to the file-system root")
    return p.with_name(p.name + LOCK_SUFFIX)


def _this_command() -> str:
    argv = list(sys.argv) or ["python"]
    argv[0] = "elsi" if argv[0].endswith("__main__.py") else Path(argv[0]).name  # python -m elsi: elsi
    return shlex.join(argv)


def _describe(owner: dict) -> str:
    command = str(owner.get("command", "?"))
    command = command if len(command) <= 200 else command[:199] + "…"
    return f"pid {owner.get('pid')} on host {owner.get('host')}, since {owner.get('started')}: `{command}`"


def _proc_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in seconds since the epoch) of process ``pid`` from Linux's /proc; None without it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": fields 3 (state) to 52
        return fields[0], btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _gone(owner: dict) -> str | None:
    """Why the process that wrote the lock record ``owner`` cannot hold it any more, or None when it may (it runs,
    or it runs on another host, where elsi cannot tell)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return f"recorded no process id ({pid!r})"
    if pid == os.getpid():  # not one of this process's own locks (``lock`` looked): an earlier process's
        return "is no longer running (this process now has its pid)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "is no longer running"
    except PermissionError:
        pass  # another user's process: it runs
    stat = _proc_stat(pid)
    if stat is not None:
        state, start = stat
        if state in ("Z", "X"):
            return "is no longer running (it exited; its parent has not collected it)"
        try:
            since = datetime.fromisoformat(str(owner.get("started"))).timestamp()
        except ValueError:
            return None
        if start > since + 2.0:  # started after the lock was taken: the pid was reused
            return "is no longer running (its pid now belongs to a later process)"
    return None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read_lock(lock_file: Path) -> tuple[str | None, dict | None]:
    """(the lock file's text, its record) -> (None, None) when there is no lock file; (text, None) when it is
    unreadable (being written, or damaged)."""
    try:
        text = lock_file.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None, None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    return text, owner if isinstance(owner, dict) and "pid" in owner else None


def _create(lock_file: Path, record: dict) -> bool:
    """Create ``lock_file`` holding ``record`` if it does not exist; False if it does. Atomic, contents included:
    the record is written to a file of its own, then hard-linked to the lock file's name (which fails if that
    exists), so that no process ever reads a lock file half-written, even one whose writer was stopped or killed
    in between. On a file system without hard links: created with O_CREAT | O_EXCL, then written."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record) + "\n"
    tmp = lock_file.with_name(f"{lock_file.name}.{record['token']}")
    tmp.write_text(text)
    try:
        os.link(tmp, lock_file)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here
        pass
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def _take_over(lock_file: Path, text: str, why: str) -> None:
    """Remove the stale ``lock_file`` if it still holds ``text`` (not a lock taken since by another process).
    Contenders take turns through a guard file, so that two of them never both remove a stale lock and the
    fresh one the first of them made."""
    guard = lock_file.with_name(lock_file.name + ".takeover")
    try:
        os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:  # another process is taking it over (or was killed doing so: a second's work)
        if _age(guard) > UNREADABLE_S:
            guard.unlink(missing_ok=True)
        time.sleep(0.05)
        return
    try:
        if _read_lock(lock_file)[0] == text:
            lock_file.unlink()
            warnings.warn(f"{lock_file}: the elsi process that held it {why}; taking its lock over", stacklevel=2)
    finally:
        guard.unlink(missing_ok=True)


def _acquire(path: Path, lock_file: Path, what: str, wait: bool, poll_s: float) -> str:
    """Create ``lock_file`` for this process (taking over a stale one; waiting for or refusing a live one) ->
    the token that identifies this hold."""
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.now().astimezone().isoformat(timespec="seconds"), "command": _this_command(),
          "token": uuid.uuid4().hex}
    waiting = False
    while True:
        if _create(lock_file, me):
            return me["token"]
        text, owner = _read_lock(lock_file)
        if text is None:
            continue  # released meanwhile
        if owner is None:  # damaged, or (without hard links) being written or left half-written
            if _age(lock_file) < UNREADABLE_S:
                time.sleep(0.05)
                continue
            why = f"left it unreadable ({text[:80]!r})"
        else:
            why = _gone(owner)
        if why:
            _take_over(lock_file, text, f"({_describe(owner)}) {why}" if owner else why)
            continue
        elsewhere = owner.get("host") != socket.gethostname()
        hint = (f" (elsi cannot tell from this host whether it still runs: if it does not, delete {lock_file})"
                if elsewhere else "")
        if not wait:
            raise BusyError(f"{what} {path} is in use: another elsi process is writing it ({_describe(owner)})"
                            f"{hint}; wait for it to finish, or use another --out")
        if not waiting:
            warnings.warn(f"{what} {path} is being written by another elsi process ({_describe(owner)}){hint}; "
                          "waiting for it to finish", stacklevel=2)
            waiting = True
        time.sleep(poll_s)


def _release(lock_file: Path, token: str) -> None:
    """Remove ``lock_file`` if it is still this hold's (not one another process took over after deleting it)."""
    _, owner = _read_lock(lock_file)
    if owner is not None and owner.get("token") == token:
        lock_file.unlink(missing_ok=True)


@contextmanager
def lock(path: str | Path, what: str = "", wait: bool = False, poll_s: float = 0.5) -> Iterator[Path]:
    """Hold the lock of ``path`` (a directory or file elsi writes; ``lock_path``) while the block runs -> the
    lock file.

    The lock file records this process's pid, host, start time and command; it is created before
    the block's first write and removed when the block ends, by an error, Ctrl-C or SIGTERM too (the CLI
    turns SIGTERM into KeyboardInterrupt). Another live holder: BusyError (a ValueError) naming ``path``
    (``what`` says what it is, e.g. "the run directory") and that process, or, with ``wait``, a warning, then
    a wait (polled every ``poll_s`` seconds) until it lets go; the block then starts (and should see whether
    that process made what it needs). A lock whose process no longer runs on this host is taken over with a
    warning; one from another host is never taken (delete it by hand if its process is gone). Taking a lock
    this process already holds nests (the outer block releases it). Readers of a finished artefact need none.
    """
    lock_file = lock_path(path)
    if lock_file in _held:  # held by an outer block of this process, which releases it
        yield lock_file
        return
    token = _acquire(Path(path), lock_file, what or "the output", wait, poll_s)
    _held[lock_file] = token
    try:
        yield lock_file
    finally:
        del _held[lock_file]
        _release(lock_file, token)


# ---------------------------------------------------------------------------------------------
# safetensors files that carry their own checksum

def tensors_digest(tensors: dict[str, torch.Tensor], meta_text: str) -> str:
    """SHA-256 of ``meta_text`` and of every tensor's name, dtype, shape and bytes (sorted by name)."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"\n{name}:{t.dtype}:{list(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> str:
    """safetensors write, atomic, with the checksum of its contents in the header; returns the checksum."""
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"elsi": json.dumps(metadata)} if metadata is not None else {}
    digest = tensors_digest(tensors, meta.get("elsi", ""))
    save_file(tensors, str(tmp), metadata={**meta, DIGEST: digest})
    os.replace(tmp, path)
    return digest


def _check_digest(path: Path, tensors: dict[str, torch.Tensor], meta: dict, fix: str) -> None:
    """RunError naming ``path`` when its contents do not match the checksum in its header."""
    want = meta.get(DIGEST)
    if want is None:
        warnings.warn(f"{path} has no checksum (written by an older elsi): its contents are not verified", stacklevel=3)
        return
    got = tensors_digest(tensors, meta.get("elsi", ""))
    if got != want:
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it "
                       f"(sha256 {want[:12]}… recorded, {got[:12]}… now); {fix}")


def load_tensors(path: Path, fix: str = "delete it to recompute that part") -> tuple[dict[str, torch.Tensor], dict | None]:
    """safetensors read, checked against the checksum in its header; RunError naming the file and ``fix``."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises several types on damaged files
        raise RunError(f"{path} is corrupt or truncated ({err}); {fix}") from err
    _check_digest(path, tensors, meta, fix)
    try:
        extra = json.loads(meta["elsi"]) if "elsi" in meta else None
    except json.JSONDecodeError as err:
        raise RunError(f"{path} is corrupt (its metadata is not JSON); {fix}") from err
    return tensors, extra


def verify_tensors(path: Path, fix: str = "delete it to recompute that part") -> str | None:
    """Check a safetensors file against its checksum without keeping it in memory (one tensor at a
    time); return the checksum (None for an older file without one). RunError naming the file otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            want = meta.get(DIGEST)
            if want is None:
                return None
            h = hashlib.sha256(meta.get("elsi", "").encode())
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"\n{name}:{t.dtype}:{list(t.shape)}\n".encode())
                if t.numel():
                    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                del t
    except Exception as err:  # safetensors raises several types on damaged files
        raise RunError(f"{path} is corrupt or truncated ({err}); {fix}") from err
    if h.hexdigest() != want:
        raise RunError(f"{path} is corrupt: its contents do not match the checksum written with it "
                       f"(sha256 {want[:12]}… recorded, {h.hexdigest()[:12]}… now); {fix}")
    return want


def tensors_checksum(path: Path) -> str | None:
    """The checksum recorded in a safetensors file's header (not verified; None without one)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(DIGEST)
    except Exception:  # noqa: BLE001 - a damaged header: no checksum to report
        return None
