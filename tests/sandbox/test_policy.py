"""Pure parts, no processes and no event loop: level selection, config validation, the seccomp
program (run through a small BPF interpreter), output capture, metrics, wire codecs."""

from __future__ import annotations

import errno
import signal
import struct

import pytest

from sandbox import ExecRequest, ExecResult, PoolConfig, isolation
from sandbox._runtime import seccomp
from sandbox._runtime.child import EXIT_MEMORY
from sandbox._runtime.outcome import Stream, call_outcome, exec_outcome
from sandbox.config import IsolationLevel
from sandbox.errors import IsolationUnavailable, SandboxConfigError
from sandbox.metrics import Histogram, PoolMetrics, render
from sandbox.wire import JSON, MSGPACK, ExecBatch, ExecBatchResult, codec_for


# ----------------------------------------------------------------------------- isolation
def test_an_explicit_level_that_cannot_be_had_is_an_error(monkeypatch):
    monkeypatch.setattr(isolation, "probe_jail", lambda kind: (None, f"{kind} missing"))
    monkeypatch.setattr(isolation, "probe_host", lambda: ({"seccomp": ""}, ""))
    with pytest.raises(IsolationUnavailable, match="nsjail missing"):
        isolation.plan(PoolConfig(isolation="jail+seccomp"))
    auto = isolation.plan(PoolConfig(isolation="auto"))
    assert auto.level is IsolationLevel.SECCOMP and any("missing" in n for n in auto.notes)

    monkeypatch.setattr(isolation, "probe_host", lambda: ({"seccomp": "EINVAL"}, ""))
    with pytest.raises(IsolationUnavailable, match="seccomp"):
        isolation.plan(PoolConfig(isolation="seccomp"))
    assert isolation.plan(PoolConfig(isolation="auto")).level is IsolationLevel.NONE
    assert isolation.plan(PoolConfig(isolation="none")).level is IsolationLevel.NONE


def test_a_jail_whose_seccomp_fails_is_not_used(monkeypatch):
    monkeypatch.setattr(isolation, "probe_jail", lambda kind: ({"seccomp": "EINVAL"}, ""))
    monkeypatch.setattr(isolation, "probe_host", lambda: ({"seccomp": ""}, ""))
    with pytest.raises(IsolationUnavailable):
        isolation.plan(PoolConfig(isolation="jail+seccomp"))
    assert isolation.plan(PoolConfig()).level is IsolationLevel.SECCOMP


def test_jail_shows_only_the_python_install_libraries_and_runtime():
    spec = isolation.jail_spec(PoolConfig())
    dests = [d for _, d in spec.ro_binds]
    assert "/opt/sandbox/_sandbox_runtime" in dests
    assert not any(d in ("/", "/etc", "/home", "/work", "/root", "/tmp") for d in dests)
    assert not any(d.startswith("/work") for d in dests)  # the project is not in the jail
    argv = isolation.jail_command("nsjail", "nsjail", spec, {"A": "1"}, ["python"])
    assert "--time_limit" in argv and argv[argv.index("--time_limit") + 1] == "0"
    assert "--keep_env" not in argv and "-E" in argv


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(SandboxConfigError, match=r"sandbox\.workers"):
        PoolConfig(workers=0)
    with pytest.raises(SandboxConfigError, match=r"sandbox\.isolation"):
        PoolConfig(isolation="chroot")
    with pytest.raises(SandboxConfigError, match=r"sandbox\.time_limit_s"):
        PoolConfig(time_limit_s=100, max_time_limit_s=10)
    assert PoolConfig(isolation="auto").isolation is IsolationLevel.AUTO


# ----------------------------------------------------------------------------- seccomp program
ALLOW, KILL = 0x7FFF0000, 0x80000000
ARCH_X86_64, ARCH_I386 = 0xC000003E, 0x40000003


def _run_bpf(prog: bytes, nr: int, args=(0,) * 6, arch: int = ARCH_X86_64) -> int:
    """Interpret the classic-BPF subset the filter uses over a seccomp_data record."""
    args = (tuple(args) + (0,) * 6)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & (2 ** 64 - 1) for a in args])
    ins = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    for _ in range(10000):
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        elif code == 0x05:
            pc += k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1
    raise AssertionError("no return")


def _filter(pid: int) -> bytes:
    prog, slots = seccomp.build_template()
    for index, sign in slots:
        struct.pack_into("<I", prog, index * 8 + 4, (sign * pid) & 0xFFFFFFFF)
    return bytes(prog)


EPERM = 0x00050000 | errno.EPERM


@pytest.mark.parametrize("name,args,want", [
    ("socket", (2, 1, 0), EPERM), ("socketpair", (1, 1, 0, 0), EPERM),
    ("execve", (), EPERM), ("execveat", (), EPERM), ("fork", (), EPERM), ("vfork", (), EPERM),
    ("ptrace", (16, 1), EPERM), ("mount", (), EPERM), ("unshare", (0x10000000,), EPERM),
    ("setns", (), EPERM), ("process_vm_readv", (), EPERM), ("bpf", (), EPERM),
    ("io_uring_setup", (), EPERM), ("open_by_handle_at", (), EPERM), ("setsid", (), EPERM),
    ("tkill", (5, 9), EPERM), ("pidfd_open", (1, 0), EPERM), ("keyctl", (), EPERM),
    ("clone3", (), 0x00050000 | errno.ENOSYS),
])
def test_filter_denies(name, args, want):
    assert _run_bpf(_filter(4242), seccomp._NR[name], args) == want


def _strictest(a: int, b: int) -> int:
    """The action the kernel takes for two stacked filters' results (the ones used here)."""
    rank = {0x80000000: 0, 0x00050000: 1, ALLOW: 2}  # kill process, errno, allow
    ra, rb = rank[a & 0xFFFF0000], rank[b & 0xFFFF0000]
    return a if ra < rb else b  # b when the class is the same: the later filter's data


def _part(part: str, pid: int) -> bytes:
    prog, slots = seccomp.build_template(part)
    for index, sign in slots:
        struct.pack_into("<I", prog, index * 8 + 4, (sign * pid) & 0xFFFFFFFF)
    return bytes(prog)


def test_the_split_filter_stacked_acts_like_the_whole_one():
    pid = 4242
    whole, template, child = _filter(pid), _part("template", pid), _part("child", pid)
    assert len(child) * 4 < len(whole)  # what each child compiles is the small half
    for nr in range(0, 460):
        for args in ((0,), (pid, 9), (-pid, 9), (1, 9), (17,), (0x3D0F00,),
                     (0x3D0F00 | 0x10000000,)):
            want = _run_bpf(whole, nr, args)
            got = _strictest(_run_bpf(template, nr, args), _run_bpf(child, nr, args))
            assert got == want, (nr, args, hex(got), hex(want))
    # and the template's half leaves what a forking, containing process needs
    for name in ("clone", "kill", "setsid", "capset"):
        assert _run_bpf(template, seccomp._NR[name], (17, 9)) == ALLOW, name


def test_filter_allows_threads_but_not_processes():
    clone = seccomp._NR["clone"]
    thread_flags = 0x3D0F00  # glibc pthread_create: VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|...
    assert _run_bpf(_filter(7), clone, (thread_flags,)) == ALLOW
    assert _run_bpf(_filter(7), clone, (17,)) == EPERM  # fork() = clone(SIGCHLD)
    assert _run_bpf(_filter(7), clone, (thread_flags | 0x10000000,)) == EPERM  # + NEWUSER


def test_filter_lets_a_process_signal_only_itself():
    f = _filter(4242)
    kill, tgkill = seccomp._NR["kill"], seccomp._NR["tgkill"]
    assert _run_bpf(f, kill, (4242, 9)) == ALLOW
    assert _run_bpf(f, kill, (0, 9)) == ALLOW  # own process group
    assert _run_bpf(f, kill, (-4242, 9)) == ALLOW
    for other in (1, 4241, -1, -4241):
        assert _run_bpf(f, kill, (other, 9)) == EPERM
    assert _run_bpf(f, tgkill, (4242, 4243, 2)) == ALLOW
    assert _run_bpf(f, tgkill, (1, 1, 9)) == EPERM


def test_filter_allows_ordinary_syscalls_and_kills_other_abis():
    f = _filter(99)
    for nr in (0, 1, 2, 3, 9, 12, 60, 202, 231, 257, 318):  # read write open ... getrandom
        assert _run_bpf(f, nr) == ALLOW
    assert _run_bpf(f, 0, arch=ARCH_I386) == KILL
    assert _run_bpf(f, 0x40000000 | 41) == KILL  # x32 ABI


def test_every_denied_syscall_is_denied():
    f = _filter(1000)
    for name in seccomp._DENY_EPERM:
        assert _run_bpf(f, seccomp._NR[name], (0,) * 6) == EPERM, name


# ----------------------------------------------------------------------------- output capture
def test_stream_keeps_head_and_tail_within_the_cap():
    s = Stream(-1, 100)
    s.feed(b"H" * 10)
    for _ in range(1000):
        s.feed(b"m" * 97)
    s.feed(b"T" * 10)
    out = s.data()
    assert s.truncated and out.startswith(b"H" * 10) and out.endswith(b"T" * 10)
    assert len(out) < 100 + 80 and b"omitted" in out
    small = Stream(-1, 100)
    small.feed(b"a" * 60)
    small.feed(b"b" * 40)
    assert not small.truncated and small.data() == b"a" * 60 + b"b" * 40


# ----------------------------------------------------------------------------- metrics, wire
def test_histogram_and_prometheus_text():
    h = Histogram((0.01, 0.1))
    for v in (0.005, 0.05, 0.5):
        h.observe(v)
    assert h.cumulative() == [("0.01", 1), ("0.1", 2), ("+Inf", 3)]
    m = PoolMetrics()
    m.record("exec", "ok", 0.003)
    m.record("exec", "timeout", 4.0)
    text = render(m, {"sandbox_queue_depth": 3}, {})
    assert 'sandbox_calls_total{kind="exec",status="ok"} 1' in text
    assert "sandbox_queue_depth 3" in text and "sandbox_call_latency_seconds_count 2" in text


@pytest.mark.parametrize("ctype", [MSGPACK, JSON, "application/json; charset=utf-8", None])
def test_wire_round_trip(ctype):
    codec = codec_for(ctype)
    batch = ExecBatch([ExecRequest("print(1)", "in", 2.0), ExecRequest("x")])
    assert codec.batch.decode(codec.encode(batch)) == batch
    res = ExecBatchResult([ExecResult("ok", "1\n", "", 0, 0.01, False)])
    assert codec.result.decode(codec.encode(res)) == res


# ----------------------------------------------------------------------------- status rules
def _exec(code, **kw):
    base = dict(setup_ok=True, timed_out=False, cancelled=False, limit_s=4.0, note="",
                stderr="")
    base.update(kw)
    return exec_outcome(code, **base)


def test_exec_status_rules():
    assert _exec(0) == ("ok", 0, "")
    assert _exec(3)[:2] == ("error", 3)
    assert _exec(-signal.SIGSEGV) == ("error", -signal.SIGSEGV, "terminated by signal SIGSEGV")
    assert _exec(-signal.SIGKILL, timed_out=True)[0] == "timeout"
    assert _exec(-signal.SIGXCPU)[0] == "timeout"
    assert _exec(EXIT_MEMORY)[:2] == ("killed", 1)
    assert _exec(-signal.SIGXFSZ)[0] == "killed"
    assert _exec(-signal.SIGKILL)[0] == "killed"  # not ours: out of memory
    status, _, detail = _exec(-signal.SIGKILL, setup_ok=False, stderr="boom")
    assert status == "sandbox_failure" and "SIGKILL" in detail and "boom" in detail
    assert _exec(0, cancelled=True)[0] == "sandbox_failure"
    assert _exec(0, note="time limit capped")[2] == "time limit capped"


def test_call_status_rules():
    ok = call_outcome(0, b"R" + b"payload", timed_out=False, cancelled=False, limit_s=1,
                      log="")
    assert ok == ("ok", b"payload", "")
    assert call_outcome(-9, b"R", timed_out=True, cancelled=False, limit_s=1, log="")[0] == \
        "timeout"
    assert call_outcome(1, b"R", timed_out=False, cancelled=False, limit_s=1,
                        log="Traceback")[0] == "error"
    assert call_outcome(250, b"", timed_out=False, cancelled=False, limit_s=1,
                        log="x")[0] == "sandbox_failure"
