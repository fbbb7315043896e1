/*
 * stretch._native: the few shared-memory primitives Python cannot provide safely.
 *
 * A Region pins a writable buffer (an mmap of a shared-memory segment) and offers
 * bounds- and alignment-checked atomics on words inside it, a futex wait/wake on
 * 32-bit words (so idle readers and blocked writers sleep instead of spinning),
 * and a robust inter-process mutex whose lock word holds the owner's pid, so a
 * lock held by a process that died (even by SIGKILL) can be taken over.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
} Region;

static int region_check(Region *self, Py_ssize_t off, Py_ssize_t width) {
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is released");
        return -1;
    }
    if (off < 0 || off > self->view.len - width) {
        PyErr_Format(PyExc_IndexError, "offset %zd out of range for a %zd-byte word in a region of %zd bytes",
                     off, width, self->view.len);
        return -1;
    }
    if (((uintptr_t)self->view.buf + (uintptr_t)off) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not aligned to %zd bytes", off, width);
        return -1;
    }
    return 0;
}

#define WORD64(self, off) ((int64_t *)((char *)(self)->view.buf + (off)))
#define WORD32(self, off) ((uint32_t *)((char *)(self)->view.buf + (off)))

static int futex_call(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return (int)syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static int Region_init(Region *self, PyObject *args, PyObject *kwds) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->has_view = 1;
    return 0;
}

static void Region_dealloc(Region *self) {
    if (self->has_view) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Region_release(Region *self, PyObject *unused) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Region_load64(Region *self, PyObject *arg) {
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred()) return NULL;
    if (region_check(self, off, 8) < 0) return NULL;
    return PyLong_FromLongLong(__atomic_load_n(WORD64(self, off), __ATOMIC_SEQ_CST));
}

static PyObject *Region_store64(Region *self, PyObject *args) {
    Py_ssize_t off;
    long long v;
    if (!PyArg_ParseTuple(args, "nL", &off, &v)) return NULL;
    if (region_check(self, off, 8) < 0) return NULL;
    __atomic_store_n(WORD64(self, off), (int64_t)v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *Region_fetch_add64(Region *self, PyObject *args) {
    Py_ssize_t off;
    long long v;
    if (!PyArg_ParseTuple(args, "nL", &off, &v)) return NULL;
    if (region_check(self, off, 8) < 0) return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add(WORD64(self, off), (int64_t)v, __ATOMIC_SEQ_CST));
}

static PyObject *Region_cas64(Region *self, PyObject *args) {
    Py_ssize_t off;
    long long expected, desired;
    if (!PyArg_ParseTuple(args, "nLL", &off, &expected, &desired)) return NULL;
    if (region_check(self, off, 8) < 0) return NULL;
    int64_t e = (int64_t)expected;
    int ok = __atomic_compare_exchange_n(WORD64(self, off), &e, (int64_t)desired, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

static PyObject *Region_max64(Region *self, PyObject *args) {
    /* Raise the word to at least v; returns the value after. */
    Py_ssize_t off;
    long long v;
    if (!PyArg_ParseTuple(args, "nL", &off, &v)) return NULL;
    if (region_check(self, off, 8) < 0) return NULL;
    int64_t cur = __atomic_load_n(WORD64(self, off), __ATOMIC_SEQ_CST);
    while (cur < (int64_t)v &&
           !__atomic_compare_exchange_n(WORD64(self, off), &cur, (int64_t)v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return PyLong_FromLongLong(cur < (int64_t)v ? (int64_t)v : cur);
}

static PyObject *Region_load32(Region *self, PyObject *arg) {
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred()) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(WORD32(self, off), __ATOMIC_SEQ_CST));
}

static PyObject *Region_store32(Region *self, PyObject *args) {
    Py_ssize_t off;
    unsigned int v;
    if (!PyArg_ParseTuple(args, "nI", &off, &v)) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    __atomic_store_n(WORD32(self, off), (uint32_t)v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *Region_fetch_add32(Region *self, PyObject *args) {
    Py_ssize_t off;
    unsigned int v;
    if (!PyArg_ParseTuple(args, "nI", &off, &v)) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    return PyLong_FromUnsignedLong(__atomic_fetch_add(WORD32(self, off), (uint32_t)v, __ATOMIC_SEQ_CST));
}

static int to_timespec(PyObject *timeout, struct timespec *ts) {
    if (timeout == Py_None) return 0;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    if (t < 0) t = 0;
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    return 1;
}

static PyObject *Region_wait32(Region *self, PyObject *args) {
    /* Sleep while the word equals `expected`, up to `timeout` seconds (None: no limit).
       Returns False on timeout, True otherwise (woken, value changed, or signal). */
    Py_ssize_t off;
    unsigned int expected;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "nI|O", &off, &expected, &timeout)) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    struct timespec ts;
    int has_ts = to_timespec(timeout, &ts);
    if (has_ts < 0) return NULL;
    int rc, err;
    uint32_t *addr = WORD32(self, off);
    Py_BEGIN_ALLOW_THREADS
    rc = futex_call(addr, FUTEX_WAIT, (uint32_t)expected, has_ts ? &ts : NULL);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == -1 && err == ETIMEDOUT) Py_RETURN_FALSE;
    if (rc == -1 && err == EINTR && PyErr_CheckSignals() < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *Region_wake32(Region *self, PyObject *args) {
    Py_ssize_t off;
    int n = INT_MAX;
    if (!PyArg_ParseTuple(args, "n|i", &off, &n)) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    int rc = futex_call(WORD32(self, off), FUTEX_WAKE, (uint32_t)n, NULL);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

/* Robust mutex: the 32-bit lock word holds 0 (free) or the owner's pid, with the top bit set
   while others wait. A waiter that times out checks whether the owner is still alive and takes
   the lock over if it is not.

   A waiter that slept takes the lock with the waiters bit set (as in Drepper's "Futexes Are
   Tricky", mutex 3): unlock wakes only one sleeper and clears the bit, so the woken one cannot
   know whether others still sleep, and must assume they do. Taking it as a bare pid would let its
   own unlock skip the wake, and the next sleeper would lie until its 50 ms slice ran out. */
#define WAITERS 0x80000000u

static int pid_alive(uint32_t pid) {
    /* A process that exited is dead even while it waits to be reaped (a zombie). */
    if (pid == 0) return 0;
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *end = strrchr(buf, ')');
    if (!end || end[1] == 0 || end[2] == 0) return 1;
    return end[2] != 'Z' && end[2] != 'X';
}

static PyObject *Region_lock(Region *self, PyObject *args) {
    Py_ssize_t off;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "n|O", &off, &timeout)) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    double limit = -1;
    if (timeout != Py_None) {
        limit = PyFloat_AsDouble(timeout);
        if (limit == -1.0 && PyErr_Occurred()) return NULL;
    }
    uint32_t *addr = WORD32(self, off);
    uint32_t me = (uint32_t)getpid();
    uint32_t want = me; /* me | WAITERS once this caller has slept (see above) */
    struct timespec start, now, slice = {0, 50 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        uint32_t cur = 0;
        if (__atomic_compare_exchange_n(addr, &cur, want, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) Py_RETURN_TRUE;
        uint32_t owner = cur & ~WAITERS;
        if (owner == me) {
            PyErr_SetString(PyExc_RuntimeError, "mutex already held by this process");
            return NULL;
        }
        if (!(cur & WAITERS)) {
            if (!__atomic_compare_exchange_n(addr, &cur, cur | WAITERS, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                continue;
            cur |= WAITERS;
        }
        int rc, err;
        Py_BEGIN_ALLOW_THREADS
        rc = futex_call(addr, FUTEX_WAIT, cur, &slice);
        err = errno;
        Py_END_ALLOW_THREADS
        want = me | WAITERS;
        if (rc == -1 && err == EINTR && PyErr_CheckSignals() < 0) return NULL;
        if (rc == -1 && err == ETIMEDOUT && !pid_alive(owner)) {
            /* The owner died holding the lock: take it over (waiters bit kept so unlock wakes others). */
            uint32_t seen = __atomic_load_n(addr, __ATOMIC_RELAXED);
            if ((seen & ~WAITERS) == owner &&
                __atomic_compare_exchange_n(addr, &seen, me | WAITERS, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
                Py_RETURN_TRUE;
        }
        if (limit >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            double waited = (double)(now.tv_sec - start.tv_sec) + (double)(now.tv_nsec - start.tv_nsec) * 1e-9;
            if (waited >= limit) Py_RETURN_FALSE;
        }
    }
}

static PyObject *Region_unlock(Region *self, PyObject *arg) {
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred()) return NULL;
    if (region_check(self, off, 4) < 0) return NULL;
    uint32_t *addr = WORD32(self, off);
    if ((__atomic_load_n(addr, __ATOMIC_RELAXED) & ~WAITERS) != (uint32_t)getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "mutex is not held by this process");
        return NULL;
    }
    /* Only the owner gets here, and only the owner changes the pid bits, so the swap is ours. */
    uint32_t prev = __atomic_exchange_n(addr, 0u, __ATOMIC_RELEASE);
    if (prev & WAITERS) futex_call(addr, FUTEX_WAKE, 1, NULL);
    Py_RETURN_NONE;
}

static PyObject *Region_get_address(Region *self, void *closure) {
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is released");
        return NULL;
    }
    return PyLong_FromVoidPtr(self->view.buf);
}

static PyObject *Region_get_size(Region *self, void *closure) { return PyLong_FromSsize_t(self->has_view ? self->view.len : 0); }

static PyMethodDef Region_methods[] = {
    {"load64", (PyCFunction)Region_load64, METH_O, "Atomically load the int64 at offset."},
    {"store64", (PyCFunction)Region_store64, METH_VARARGS, "Atomically store an int64 at offset."},
    {"fetch_add64", (PyCFunction)Region_fetch_add64, METH_VARARGS, "Atomically add to the int64 at offset; return the old value."},
    {"cas64", (PyCFunction)Region_cas64, METH_VARARGS, "Compare-and-swap the int64 at offset; return True on success."},
    {"max64", (PyCFunction)Region_max64, METH_VARARGS, "Atomically raise the int64 at offset to at least v; return the result."},
    {"load32", (PyCFunction)Region_load32, METH_O, "Atomically load the uint32 at offset."},
    {"store32", (PyCFunction)Region_store32, METH_VARARGS, "Atomically store a uint32 at offset."},
    {"fetch_add32", (PyCFunction)Region_fetch_add32, METH_VARARGS, "Atomically add to the uint32 at offset; return the old value."},
    {"wait32", (PyCFunction)Region_wait32, METH_VARARGS, "Futex-wait while the uint32 at offset equals expected."},
    {"wake32", (PyCFunction)Region_wake32, METH_VARARGS, "Futex-wake up to n waiters on the uint32 at offset."},
    {"lock", (PyCFunction)Region_lock, METH_VARARGS, "Take the robust mutex at offset; False on timeout."},
    {"unlock", (PyCFunction)Region_unlock, METH_O, "Release the robust mutex at offset."},
    {"release", (PyCFunction)Region_release, METH_NOARGS, "Release the pinned buffer."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Region_getset[] = {
    {"address", (getter)Region_get_address, NULL, "Base address of the pinned buffer.", NULL},
    {"size", (getter)Region_get_size, NULL, "Size in bytes of the pinned buffer.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stretch._native.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Atomics, futexes and a robust mutex over a pinned writable buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Region_init,
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_methods = Region_methods,
    .tp_getset = Region_getset,
};

static PyObject *set_parent_death_signal(PyObject *module, PyObject *arg) {
    int sig = (int)PyLong_AsLong(arg);
    if (sig == -1 && PyErr_Occurred()) return NULL;
    if (prctl(PR_SET_PDEATHSIG, sig) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_parent_death_signal", set_parent_death_signal, METH_O,
     "Ask the kernel to send this signal when the parent thread exits (Linux PR_SET_PDEATHSIG)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "stretch._native", "Shared-memory atomics and futexes for stretch.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RegionType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(m, "Region", (PyObject *)&RegionType) < 0) {
        Py_DECREF(&RegionType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
