/* The template's fork loop: fork one contained child per call without touching the heap.
 *
 * A zygote that runs its bookkeeping in Python between forks writes to pages it shares with
 * every live child, and each such write is a copy-on-write fault (about 190 per call measured
 * on a nested-virtualisation VM, ~4 us each); a child that contains itself in Python faults
 * another ~200 times before the program starts. This module moves both out of Python:
 *
 *   serve(sock, config) runs in the *template* process (preloads imported, heap frozen) and
 *   never returns there. It reads SPAWN / KILL requests from a SOCK_SEQPACKET socket (the
 *   controller, see ``forkserver``), forks, reaps children (signalfd), and reports SPAWNED /
 *   EXITED. In each child it applies the whole containment (stdio, session, nice, parent-death
 *   signal, working directory, Landlock, fd cleanup, capabilities, rlimits, seccomp) in C and
 *   only then *returns* into Python with its call (id, kind, code or target, data), so the
 *   child's Python code starts already contained.
 *
 * Wire format (native endianness, both ends on one host):
 *   request  {u32 op; u32 kind; u64 id; f64 time_limit_s; u32 flags; u32 payload_len}
 *            SPAWN carries 6 fds (SCM_RIGHTS): stdin, stdout, stderr, status, payload, workdir
 *            (O_PATH). KILL carries none.
 *   reply    {u32 op; i32 value; u64 id}
 *            SPAWNED (only when fork failed): value = -errno.  EXITED: value = wait status.
 *
 * The template is single-threaded (checked) and forks with the GIL held, without CPython's
 * after-fork hooks: they exist for processes whose other threads held locks at fork time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define OP_SPAWN 1
#define OP_KILL 2
#define OP_SPAWNED 1
#define OP_EXITED 2

#define FLAG_SECCOMP 1u
#define FLAG_LANDLOCK 2u
#define KIND_EXEC 0u

#define NFDS 6
#define EXIT_SETUP_FAILED 250

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

struct request {
    uint32_t op;
    uint32_t kind;
    uint64_t id;
    double time_limit_s;
    uint32_t flags;
    uint32_t payload_len;
};

struct reply {
    uint32_t op;
    int32_t value;
    uint64_t id;
};

struct rule {  /* struct landlock_path_beneath_attr, packed as the kernel wants it */
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

struct reseed {
    uint32_t *key;
    size_t words;
    int *pos;
    int pos_value;
};

struct config {
    char *landlock_attr;
    size_t landlock_attr_size;
    struct rule *rules;
    size_t nrules;
    uint64_t workdir_access;
    struct sock_filter *prog;
    size_t prog_len;
    int *pid_slots;  /* pairs (instruction index, sign) */
    size_t nslots;
    rlim_t as_bytes;
    rlim_t nofile;
    int drop_caps;
    int nice_inc;
    struct reseed *reseed;  /* Mersenne-Twister states in the template's heap */
    size_t nreseed;
};

struct live {
    uint64_t id;
    pid_t pid;
    int may_fork;  /* a hosted function (no seccomp): it may have left a process group */
};

static struct live *g_live;
static size_t g_nlive, g_cap;

static int send_reply(int sock, uint32_t op, int32_t value, uint64_t id)
{
    struct reply r = {op, value, id};
    for (;;) {
        ssize_t n = send(sock, &r, sizeof r, MSG_NOSIGNAL);
        if (n == (ssize_t)sizeof r)
            return 0;
        if (n < 0 && errno == EINTR)
            continue;
        return -1;
    }
}

static int live_add(uint64_t id, pid_t pid, int may_fork)
{
    if (g_nlive == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 64;
        struct live *p = realloc(g_live, cap * sizeof *p);
        if (!p)
            return -1;
        g_live = p;
        g_cap = cap;
    }
    g_live[g_nlive].id = id;
    g_live[g_nlive].pid = pid;
    g_live[g_nlive].may_fork = may_fork;
    g_nlive++;
    return 0;
}

static void kill_child(pid_t pid)
{
    kill(-pid, SIGKILL);  /* its group (a hosted function may fork); the child is the leader */
    kill(pid, SIGKILL);   /* before its setsid() ran, the group is still ours */
}

/* ---------------------------------------------------------------- child side */

static void child_fail(const char *what)
{
    char buf[160];
    int n = snprintf(buf, sizeof buf, "sandbox child setup failed: %s: %s\n", what,
                     strerror(errno));
    if (n > 0)
        (void)!write(2, buf, (size_t)n);
    _exit(EXIT_SETUP_FAILED);
}

static void drop_capabilities(void)
{
    struct { uint32_t version; int pid; } hdr = {0x20080522, 0};
    struct { uint32_t eff, perm, inh; } data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) != 0)
        child_fail("capset");
}

static void apply_landlock(const struct config *c, int workdir_fd)
{
    int rs = (int)syscall(SYS_landlock_create_ruleset, c->landlock_attr,
                          c->landlock_attr_size, 0);
    if (rs < 0)
        child_fail("landlock_create_ruleset");
    for (size_t i = 0; i < c->nrules; i++)
        if (syscall(SYS_landlock_add_rule, rs, 1, &c->rules[i], 0) != 0)
            child_fail("landlock_add_rule");
    struct rule wd = {c->workdir_access, workdir_fd};
    if (syscall(SYS_landlock_add_rule, rs, 1, &wd, 0) != 0)
        child_fail("landlock_add_rule(workdir)");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        child_fail("prctl(NO_NEW_PRIVS)");
    if (syscall(SYS_landlock_restrict_self, rs, 0) != 0)
        child_fail("landlock_restrict_self");
    close(rs);
}

static void apply_seccomp(const struct config *c)
{
    /* the filter lets the child signal only itself: patch its pid into the prepared slots.
     * The program lives in the template's heap; writing it here copies one or two pages. */
    uint32_t pid = (uint32_t)getpid();
    for (size_t i = 0; i < c->nslots; i++) {
        int index = c->pid_slots[2 * i], sign = c->pid_slots[2 * i + 1];
        c->prog[index].k = sign > 0 ? pid : (uint32_t)(-(int64_t)pid);
    }
    struct sock_fprog fprog = {(unsigned short)c->prog_len, c->prog};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        child_fail("prctl(NO_NEW_PRIVS)");
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &fprog) != 0)
        child_fail("seccomp(SET_MODE_FILTER)");
}

static void contain(const struct config *c, const struct request *rq, const int *fds,
                    pid_t template_pid)
{
    sigset_t none;
    sigemptyset(&none);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* every received fd is >= 10 (the template keeps 3..9 occupied): no dup2 collides */
    for (int target = 0; target < 5; target++)
        if (dup2(fds[target], target) < 0)
            child_fail("dup2");
    if (setsid() < 0)
        child_fail("setsid");
    errno = 0;
    if (nice(c->nice_inc) == -1 && errno != 0)
        child_fail("nice");
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        child_fail("prctl(PDEATHSIG)");
    if (getppid() != template_pid)  /* the template died before PDEATHSIG was armed */
        _exit(EXIT_SETUP_FAILED);
    if (fchdir(fds[5]) != 0)
        child_fail("fchdir(workdir)");
    if (rq->flags & FLAG_LANDLOCK)
        apply_landlock(c, fds[5]);  /* needs the template's O_PATH fds: before close_range */
    if (syscall(SYS_close_range, 5u, ~0u, 0u) != 0)
        child_fail("close_range");
    if (c->drop_caps)
        drop_capabilities();
    double limit = rq->time_limit_s;  /* the pool validated it; clamp anyway: the cast of a
                                       * NaN, negative or huge double is undefined */
    if (!(limit >= 0.0))
        limit = 0.0;
    if (limit > 1e9)
        limit = 1e9;
    rlim_t cpu = (rlim_t)limit + 2;
    struct rlimit rl = {cpu, cpu + 1};
    if (setrlimit(RLIMIT_CPU, &rl) != 0)
        child_fail("setrlimit(CPU)");
    rl.rlim_cur = rl.rlim_max = c->as_bytes;
    if (setrlimit(RLIMIT_AS, &rl) != 0)
        child_fail("setrlimit(AS)");
    rl.rlim_cur = rl.rlim_max = c->nofile;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        child_fail("setrlimit(NOFILE)");
    if (rq->flags & FLAG_SECCOMP)
        apply_seccomp(c);
    /* A fresh program gets fresh randomness: refill the generators' whole state from the
     * kernel (one page written each, where reseeding through Python touched ~100). */
    for (size_t i = 0; i < c->nreseed; i++) {
        size_t want = c->reseed[i].words * sizeof(uint32_t), got = 0;
        while (got < want) {
            ssize_t n = getrandom((char *)c->reseed[i].key + got, want - got, 0);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                child_fail("getrandom");
            }
            got += (size_t)n;
        }
        *c->reseed[i].pos = c->reseed[i].pos_value;
    }
}

/* The call's payload (fd 4: u64 text length, UTF-8 text, data) as (id, kind, text, data).
 * Read here rather than in Python: every Python-level step of a fresh child costs faults. */
static PyObject *child_payload(const struct request *rq)
{
    size_t total = rq->payload_len, got = 0;
    char *buf = PyMem_RawMalloc(total ? total : 1);
    if (!buf)
        child_fail("payload buffer");
    while (got < total) {
        ssize_t n = pread(4, buf + got, total - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            child_fail("read(payload)");
        got += (size_t)n;
    }
    close(4);
    uint64_t tlen = 0;
    if (total < 8 || (memcpy(&tlen, buf, 8), tlen > total - 8)) {
        errno = EINVAL;
        child_fail("payload header");
    }
    PyObject *text = PyUnicode_DecodeUTF8(buf + 8, (Py_ssize_t)tlen, "surrogatepass");
    PyObject *data = PyBytes_FromStringAndSize(buf + 8 + tlen, (Py_ssize_t)(total - 8 - tlen));
    PyMem_RawFree(buf);
    if (!text || !data) {
        errno = EINVAL;
        child_fail("payload decode");
    }
    /* Set-up done: from here on, a failure is the call's own. */
    if (write(3, "R", 1) != 1)
        child_fail("write(status)");
    if (rq->kind == KIND_EXEC)
        close(3);  /* a program cannot forge the status pipe; hosted functions answer on it */
    return Py_BuildValue("KINN", (unsigned long long)rq->id, rq->kind, text, data);
}

/* ---------------------------------------------------------------- template side */

static void shutdown_children(void)
{
    for (size_t i = 0; i < g_nlive; i++)
        kill_child(g_live[i].pid);
    while (g_nlive) {
        pid_t pid = waitpid(-1, NULL, 0);
        if (pid < 0 && errno != EINTR)
            break;
        for (size_t i = 0; i < g_nlive; i++)
            if (g_live[i].pid == pid) {
                g_live[i] = g_live[--g_nlive];
                break;
            }
    }
}

static void reap(int sock)
{
    for (;;) {
        int status;
        siginfo_t si;
        si.si_pid = 0;
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) != 0 || si.si_pid == 0)
            return;
        /* Until it is reaped the zombie holds its pid (and so its group id): whatever is left
         * of its group (a hosted function may fork) dies now, and never a reused pid. A
         * program under seccomp cannot have made processes. */
        for (size_t i = 0; i < g_nlive; i++)
            if (g_live[i].pid == si.si_pid && g_live[i].may_fork)
                kill(-si.si_pid, SIGKILL);
        pid_t pid = waitpid(si.si_pid, &status, 0);
        if (pid <= 0)
            return;
        for (size_t i = 0; i < g_nlive; i++)
            if (g_live[i].pid == pid) {
                uint64_t id = g_live[i].id;
                g_live[i] = g_live[--g_nlive];
                send_reply(sock, OP_EXITED, status, id);
                break;
            }
    }
}

static void close_fds(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* Returns 1 in a forked child (fills *out), 0 to keep serving, -1 when the controller left. */
static int handle_request(int sock, const struct config *c, pid_t template_pid,
                          struct request *out)
{
    struct request rq;
    union {
        char buf[CMSG_SPACE(NFDS * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {&rq, sizeof rq};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0)
        return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    if (n == 0)
        return -1;
    int fds[NFDS] = {-1, -1, -1, -1, -1, -1};
    int nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *src = (int *)CMSG_DATA(cm);
            for (int i = 0; i < k; i++) {
                if (nfds < NFDS)
                    fds[nfds++] = src[i];
                else
                    close(src[i]);
            }
        }
    }
    if (n != (ssize_t)sizeof rq || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        close_fds(fds, nfds);
        return -1;  /* a controller that speaks another protocol: stop */
    }
    if (rq.op == OP_KILL) {
        close_fds(fds, nfds);
        for (size_t i = 0; i < g_nlive; i++)
            if (g_live[i].id == rq.id) {
                kill_child(g_live[i].pid);
                break;
            }
        return 0;
    }
    if (rq.op != OP_SPAWN || nfds != NFDS) {
        close_fds(fds, nfds);
        return -1;
    }
    if (live_add(rq.id, 0, !(rq.flags & FLAG_SECCOMP)) != 0) {
        close_fds(fds, nfds);
        send_reply(sock, OP_SPAWNED, -ENOMEM, rq.id);
        return 0;
    }
    pid_t pid = fork();
    if (pid == 0) {
        contain(c, &rq, fds, template_pid);
        *out = rq;
        return 1;
    }
    close_fds(fds, nfds);
    if (pid < 0) {
        int e = errno;
        g_nlive--;
        send_reply(sock, OP_SPAWNED, -e, rq.id);
        return 0;
    }
    g_live[g_nlive - 1].pid = pid;  /* no SPAWNED reply: the controller needs only EXITED */
    return 0;
}

/* ---------------------------------------------------------------- config parsing */

static int parse_config(PyObject *d, struct config *c)
{
    memset(c, 0, sizeof *c);
    PyObject *v;
#define GET(name) (v = PyDict_GetItemString(d, name))
    if (GET("landlock_attr") && v != Py_None) {
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(v, &p, &len) < 0)
            return -1;
        c->landlock_attr = PyMem_RawMalloc((size_t)len);
        if (!c->landlock_attr)
            return PyErr_NoMemory(), -1;
        memcpy(c->landlock_attr, p, (size_t)len);
        c->landlock_attr_size = (size_t)len;
        PyObject *rules = PyDict_GetItemString(d, "landlock_rules");
        if (!rules || !PyList_Check(rules)) {
            PyErr_SetString(PyExc_ValueError, "landlock_rules: list of (access, fd)");
            return -1;
        }
        c->nrules = (size_t)PyList_GET_SIZE(rules);
        c->rules = PyMem_RawCalloc(c->nrules + 1, sizeof *c->rules);
        if (!c->rules)
            return PyErr_NoMemory(), -1;
        for (size_t i = 0; i < c->nrules; i++) {
            unsigned long long acc;
            int fd;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(rules, i), "Ki", &acc, &fd))
                return -1;
            c->rules[i].allowed_access = acc;
            c->rules[i].parent_fd = fd;
        }
        if (!GET("landlock_workdir_access"))
            return PyErr_SetString(PyExc_ValueError, "landlock_workdir_access missing"), -1;
        c->workdir_access = PyLong_AsUnsignedLongLong(v);
    }
    if (GET("seccomp_prog") && v != Py_None) {
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(v, &p, &len) < 0)
            return -1;
        if (len % 8 || len == 0 || len / 8 > 4096)
            return PyErr_SetString(PyExc_ValueError, "seccomp_prog: bad length"), -1;
        c->prog = PyMem_RawMalloc((size_t)len);
        if (!c->prog)
            return PyErr_NoMemory(), -1;
        memcpy(c->prog, p, (size_t)len);
        c->prog_len = (size_t)len / 8;
        PyObject *slots = PyDict_GetItemString(d, "seccomp_slots");
        if (!slots || !PyList_Check(slots))
            return PyErr_SetString(PyExc_ValueError, "seccomp_slots: list of pairs"), -1;
        c->nslots = (size_t)PyList_GET_SIZE(slots);
        c->pid_slots = PyMem_RawCalloc(2 * c->nslots + 2, sizeof(int));
        if (!c->pid_slots)
            return PyErr_NoMemory(), -1;
        for (size_t i = 0; i < c->nslots; i++) {
            if (!PyArg_ParseTuple(PyList_GET_ITEM(slots, i), "ii", &c->pid_slots[2 * i],
                                  &c->pid_slots[2 * i + 1]))
                return -1;
            if (c->pid_slots[2 * i] < 0 || (size_t)c->pid_slots[2 * i] >= c->prog_len)
                return PyErr_SetString(PyExc_ValueError, "seccomp_slots: out of range"), -1;
        }
    }
    if (!GET("as_bytes"))
        return PyErr_SetString(PyExc_ValueError, "as_bytes missing"), -1;
    c->as_bytes = (rlim_t)PyLong_AsUnsignedLongLong(v);
    if (!GET("nofile"))
        return PyErr_SetString(PyExc_ValueError, "nofile missing"), -1;
    c->nofile = (rlim_t)PyLong_AsUnsignedLongLong(v);
    if (GET("reseed") && v != Py_None) {
        if (!PyList_Check(v))
            return PyErr_SetString(PyExc_ValueError, "reseed: list of 4-tuples"), -1;
        c->nreseed = (size_t)PyList_GET_SIZE(v);
        c->reseed = PyMem_RawCalloc(c->nreseed + 1, sizeof *c->reseed);
        if (!c->reseed)
            return PyErr_NoMemory(), -1;
        for (size_t i = 0; i < c->nreseed; i++) {
            unsigned long long key, pos;
            Py_ssize_t words;
            int value;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(v, i), "KnKi", &key, &words, &pos, &value))
                return -1;
            c->reseed[i].key = (uint32_t *)(uintptr_t)key;
            c->reseed[i].words = (size_t)words;
            c->reseed[i].pos = (int *)(uintptr_t)pos;
            c->reseed[i].pos_value = value;
        }
    }
    c->drop_caps = GET("drop_caps") ? PyObject_IsTrue(v) : 0;
    c->nice_inc = GET("nice") ? (int)PyLong_AsLong(v) : 10;
#undef GET
    return PyErr_Occurred() ? -1 : 0;
}

static int single_threaded(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int threads = -1;
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &threads) == 1)
            break;
    fclose(f);
    return threads == 1;
}

static PyObject *serve(PyObject *self, PyObject *args)
{
    (void)self;
    int sock;
    PyObject *cfgdict;
    if (!PyArg_ParseTuple(args, "iO!", &sock, &PyDict_Type, &cfgdict))
        return NULL;
    static struct config cfg;  /* lives for the template's lifetime */
    if (parse_config(cfgdict, &cfg) < 0)
        return NULL;
    if (!single_threaded()) {
        PyErr_SetString(PyExc_RuntimeError, "the template must be single-threaded to fork");
        return NULL;
    }
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pid_t me = getpid();
    struct pollfd pfd[2] = {{sock, POLLIN, 0}, {sfd, POLLIN, 0}};
    for (;;) {
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
            }
            reap(sock);
        }
        if (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            /* several requests per wake-up: fork them back to back */
            for (int burst = 0; burst < 64; burst++) {
                struct request rq;
                int r = handle_request(sock, &cfg, me, &rq);
                if (r == 1) {
                    close(sfd);
                    return child_payload(&rq);
                }
                if (r < 0) {
                    shutdown_children();
                    _exit(0);
                }
                struct pollfd more = {sock, POLLIN, 0};
                if (poll(&more, 1, 0) <= 0)
                    break;
            }
        }
    }
    shutdown_children();
    _exit(1);
}

static PyObject *seqpacket_pair(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("ii", sv[0], sv[1]);
}

static PyMethodDef methods[] = {
    {"seqpacket_pair", seqpacket_pair, METH_NOARGS,
     "seqpacket_pair() -> (fd, fd): a connected AF_UNIX SOCK_SEQPACKET pair (close-on-exec), "
     "without importing the socket module into the template."},
    {"serve", serve, METH_VARARGS,
     "serve(sock, config) -> (id, kind, text, data): fork contained children on request; "
     "returns only in a child, with its call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_forkserver",
    "The template's fork loop (see the C source's header comment).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__forkserver(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "REQUEST_SIZE", sizeof(struct request)) < 0
        || PyModule_AddIntConstant(m, "REPLY_SIZE", sizeof(struct reply)) < 0)
        return NULL;
    return m;
}
