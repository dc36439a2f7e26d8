/* ZeroMQ sockets for the subscriber, on libzmq directly (included by _kvcore.c after _kvrecv.h).
 *
 * Why: `import zmq` (pyzmq's Python layer: its enums, sugar classes, pickle, json) costs 12-24 ms of
 * every start, a tenth or more of `kvrouter serve`'s time from exec to serving, for the dozen calls
 * the subscriber makes. pyzmq stays the dependency that ships libzmq (its wheel's bundled copy); this file
 * calls that library itself, as the receive loop (_kvrecv.h) already did.
 *
 * How: `zmq_load` dlopens a libzmq (index/zsock.py picks the copy pyzmq already loaded, else pyzmq's
 * bundled file, else the system's) and binds every entry point used here and by `recv_live`. Sockets
 * and contexts are raw addresses (ints) that index/zsock.py wraps in pyzmq's names. A call that may
 * block (poll, a blocking receive or send, terminating a context) releases the GIL. Errors raise
 * index/zsock.py's ZMQError (Again for EAGAIN) with libzmq's errno and message.
 */

typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} ZPollItem;

static struct {
    void *(*ctx_new)(void);
    int (*ctx_term)(void *);
    int (*ctx_set)(void *, int, int);
    int (*ctx_get)(void *, int);
    void *(*socket)(void *, int);
    int (*close)(void *);
    int (*setsockopt)(void *, int, const void *, size_t);
    int (*getsockopt)(void *, int, void *, size_t *);
    int (*bind)(void *, const char *);
    int (*connect)(void *, const char *);
    int (*monitor)(void *, const char *, int);
    int (*poll)(ZPollItem *, int, long);
    int (*send)(void *, const void *, size_t, int);
    const char *(*strerror)(int);
} ZS;

static PyObject *ZErrType, *ZAgainType; /* index/zsock.py's ZMQError and Again */

#define ZMQ_SNDMORE_ 2
#define ZMQ_POLLIN_ 1

/* raise ZMQError (Again for EAGAIN) for libzmq's errno `e`; NULL */
static PyObject *zs_error_of(int e) {
    PyObject *v = Py_BuildValue("(is)", e, ZS.strerror(e));
    if (v) {
        PyErr_SetObject(e == EAGAIN ? ZAgainType : ZErrType, v);
        Py_DECREF(v);
    }
    return NULL;
}

/* the same for libzmq's current errno (read before any other call could change it) */
static PyObject *zs_error(void) { return zs_error_of(ZMQ.err()); }

static int zs_ready(void) {
    if (ZS.socket) return 1;
    PyErr_SetString(PyExc_RuntimeError, "zmq_load was not called");
    return 0;
}

/* zmq_load(path, (ZMQError, Again)) -> bool: dlopen a libzmq and bind every entry point (those of
 * recv_live too); False, and nothing changed, when the library or one of them is missing */
static PyObject *mod_zmq_load(PyObject *self, PyObject *args) {
    const char *path;
    PyObject *err, *again;
    if (!PyArg_ParseTuple(args, "s(OO)", &path, &err, &again)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) Py_RETURN_FALSE;
    static const char *names[] = {
        "zmq_ctx_new", "zmq_ctx_term", "zmq_socket", "zmq_close", "zmq_setsockopt", "zmq_getsockopt",
        "zmq_bind", "zmq_connect", "zmq_socket_monitor", "zmq_poll", "zmq_send", "zmq_strerror",
        "zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more", "zmq_msg_close",
        "zmq_errno",   "zmq_ctx_set",    "zmq_ctx_get",
    };
    enum { N = sizeof(names) / sizeof(names[0]) };
    void *a[N];
    for (int i = 0; i < N; i++) {
        a[i] = dlsym(lib, names[i]);
        if (!a[i]) {
            dlclose(lib);
            Py_RETURN_FALSE;
        }
    }
    /* (a data pointer to a function pointer through memcpy: what dlsym's contract allows) */
    memcpy(&ZS.ctx_new, &a[0], sizeof(void *));
    memcpy(&ZS.ctx_term, &a[1], sizeof(void *));
    memcpy(&ZS.socket, &a[2], sizeof(void *));
    memcpy(&ZS.close, &a[3], sizeof(void *));
    memcpy(&ZS.setsockopt, &a[4], sizeof(void *));
    memcpy(&ZS.getsockopt, &a[5], sizeof(void *));
    memcpy(&ZS.bind, &a[6], sizeof(void *));
    memcpy(&ZS.connect, &a[7], sizeof(void *));
    memcpy(&ZS.monitor, &a[8], sizeof(void *));
    memcpy(&ZS.poll, &a[9], sizeof(void *));
    memcpy(&ZS.send, &a[10], sizeof(void *));
    memcpy(&ZS.strerror, &a[11], sizeof(void *));
    memcpy(&ZMQ.init, &a[12], sizeof(void *));
    memcpy(&ZMQ.recv, &a[13], sizeof(void *));
    memcpy(&ZMQ.data, &a[14], sizeof(void *));
    memcpy(&ZMQ.size, &a[15], sizeof(void *));
    memcpy(&ZMQ.more, &a[16], sizeof(void *));
    memcpy(&ZMQ.close, &a[17], sizeof(void *));
    memcpy(&ZMQ.err, &a[18], sizeof(void *));
    memcpy(&ZS.ctx_set, &a[19], sizeof(void *));
    memcpy(&ZS.ctx_get, &a[20], sizeof(void *));
    Py_XINCREF(err);
    Py_XSETREF(ZErrType, err);
    Py_XINCREF(again);
    Py_XSETREF(ZAgainType, again);
    Py_RETURN_TRUE; /* (the library stays loaded for the process's life) */
}

#define ZMQ_IO_THREADS_ 1

/* z_ctx_new(io_threads) -> a new libzmq context (address) with that many I/O threads */
static PyObject *mod_z_ctx_new(PyObject *self, PyObject *arg) {
    long io = PyLong_AsLong(arg);
    if ((io == -1 && PyErr_Occurred()) || !zs_ready()) return NULL;
    if (io < 1 || io > 64) {
        PyErr_SetString(PyExc_ValueError, "io_threads must be 1 to 64");
        return NULL;
    }
    void *ctx = ZS.ctx_new();
    if (!ctx) return zs_error();
    if (io != 1 && ZS.ctx_set(ctx, ZMQ_IO_THREADS_, (int)io) < 0) { /* (before any socket: it holds) */
        int e = ZMQ.err();
        ZS.ctx_term(ctx);
        return zs_error_of(e);
    }
    return PyLong_FromVoidPtr(ctx);
}

static PyObject *mod_z_ctx_term(PyObject *self, PyObject *arg) {
    void *ctx = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred() || !zs_ready()) return NULL;
    int r;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        r = ZS.ctx_term(ctx);
        Py_END_ALLOW_THREADS
        if (r == 0 || ZMQ.err() != EINTR) break;
        if (PyErr_CheckSignals() < 0) return NULL; /* (Ctrl-C out of a term waiting for a socket) */
    }
    if (r < 0) return zs_error();
    Py_RETURN_NONE;
}

/* z_ctx_option(context, option, value or -1) -> the option's value: zmq_ctx_set first when value
 * >= 0 (ZMQ_MAX_SOCKETS holds only when set before the context's first socket) */
static PyObject *mod_z_ctx_option(PyObject *self, PyObject *args) {
    unsigned long long ctx;
    int opt, value;
    if (!PyArg_ParseTuple(args, "Kii", &ctx, &opt, &value) || !zs_ready()) return NULL;
    if (value >= 0 && ZS.ctx_set((void *)(uintptr_t)ctx, opt, value) < 0) return zs_error();
    int r = ZS.ctx_get((void *)(uintptr_t)ctx, opt);
    if (r < 0) return zs_error();
    return PyLong_FromLong(r);
}

static PyObject *mod_z_socket(PyObject *self, PyObject *args) {
    unsigned long long ctx;
    int kind;
    if (!PyArg_ParseTuple(args, "Ki", &ctx, &kind) || !zs_ready()) return NULL;
    void *s = ZS.socket((void *)(uintptr_t)ctx, kind);
    if (!s) return zs_error();
    return PyLong_FromVoidPtr(s);
}

static PyObject *mod_z_close(PyObject *self, PyObject *arg) {
    void *s = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred() || !zs_ready()) return NULL;
    if (ZS.close(s) < 0) return zs_error();
    Py_RETURN_NONE;
}

/* z_setsockopt(socket, option, int or bytes) */
static PyObject *mod_z_setsockopt(PyObject *self, PyObject *args) {
    unsigned long long s;
    int opt;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "KiO", &s, &opt, &value) || !zs_ready()) return NULL;
    int r;
    if (PyLong_Check(value)) {
        long lv = PyLong_AsLong(value);
        if (lv == -1 && PyErr_Occurred()) return NULL;
        if (lv < INT_MIN || lv > INT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "an int option's value is a C int");
            return NULL;
        }
        int v = (int)lv;
        r = ZS.setsockopt((void *)(uintptr_t)s, opt, &v, sizeof(v));
    } else {
        Py_buffer b;
        if (PyObject_GetBuffer(value, &b, PyBUF_SIMPLE) < 0) return NULL;
        r = ZS.setsockopt((void *)(uintptr_t)s, opt, b.buf, (size_t)b.len);
        PyBuffer_Release(&b);
    }
    if (r < 0) return zs_error();
    Py_RETURN_NONE;
}

/* z_getsockopt_bytes(socket, option) -> bytes (a string option: its text without the NUL) */
static PyObject *mod_z_getsockopt_bytes(PyObject *self, PyObject *args) {
    unsigned long long s;
    int opt;
    if (!PyArg_ParseTuple(args, "Ki", &s, &opt) || !zs_ready()) return NULL;
    char buf[1024];
    size_t n = sizeof(buf);
    if (ZS.getsockopt((void *)(uintptr_t)s, opt, buf, &n) < 0) return zs_error();
    if (n > 0 && buf[n - 1] == 0) n--;
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)n);
}

/* z_getsockopt_int(socket, option) -> int (ZMQ_FD, ZMQ_EVENTS: options whose value is a C int) */
static PyObject *mod_z_getsockopt_int(PyObject *self, PyObject *args) {
    unsigned long long s;
    int opt;
    if (!PyArg_ParseTuple(args, "Ki", &s, &opt) || !zs_ready()) return NULL;
    int v = 0;
    size_t n = sizeof(v);
    if (ZS.getsockopt((void *)(uintptr_t)s, opt, &v, &n) < 0) return zs_error();
    return PyLong_FromLong(v);
}

/* z_bind(socket, endpoint, connect: bool) */
static PyObject *mod_z_endpoint(PyObject *self, PyObject *args) {
    unsigned long long s;
    const char *ep;
    int connect;
    if (!PyArg_ParseTuple(args, "Ksp", &s, &ep, &connect) || !zs_ready()) return NULL;
    int r = (connect ? ZS.connect : ZS.bind)((void *)(uintptr_t)s, ep);
    if (r < 0) return zs_error();
    Py_RETURN_NONE;
}

/* z_monitor(socket, inproc address or None, events): zmq_socket_monitor (None stops it) */
static PyObject *mod_z_monitor(PyObject *self, PyObject *args) {
    unsigned long long s;
    const char *addr;
    int events;
    if (!PyArg_ParseTuple(args, "Kzi", &s, &addr, &events) || !zs_ready()) return NULL;
    if (ZS.monitor((void *)(uintptr_t)s, addr, events) < 0) return zs_error();
    Py_RETURN_NONE;
}

/* z_poll([(socket address or 0, fd)], timeout ms) -> indices of the items ready to read (POLLIN);
 * [] when a signal interrupted the wait */
static PyObject *mod_z_poll(PyObject *self, PyObject *args) {
    PyObject *items;
    long timeout;
    if (!PyArg_ParseTuple(args, "O!l", &PyList_Type, &items, &timeout) || !zs_ready()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    ZPollItem *pi = calloc((size_t)(n ? n : 1), sizeof(ZPollItem));
    if (!pi) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long sock;
        int fd;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(items, i), "Ki", &sock, &fd)) {
            free(pi);
            return NULL;
        }
        pi[i].socket = (void *)(uintptr_t)sock;
        pi[i].fd = fd;
        pi[i].events = ZMQ_POLLIN_;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = ZS.poll(pi, (int)n, timeout);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        int e = ZMQ.err();
        free(pi);
        if (e == EINTR) return PyList_New(0);
        return zs_error_of(e);
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < n && r > 0; i++) {
        if (!(pi[i].revents & ZMQ_POLLIN_)) continue;
        r--;
        PyObject *k = PyLong_FromSsize_t(i);
        if (!k || PyList_Append(out, k) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
    }
    free(pi);
    return out;
}

/* z_recv_multipart(socket, flags) -> [bytes]: one whole message (Again when none is queued and
 * flags has DONTWAIT); a blocking receive releases the GIL while it waits for the first frame */
static PyObject *mod_z_recv_multipart(PyObject *self, PyObject *args) {
    unsigned long long s;
    int flags;
    if (!PyArg_ParseTuple(args, "Ki", &s, &flags) || !zs_ready()) return NULL;
    void *sock = (void *)(uintptr_t)s;
    ZMsg m;
    ZMQ.init(&m);
    int r;
    if (flags & ZMQ_DONTWAIT_) r = ZMQ.recv(&m, sock, flags);
    else
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            r = ZMQ.recv(&m, sock, flags);
            Py_END_ALLOW_THREADS
            if (r >= 0 || ZMQ.err() != EINTR) break;
            if (PyErr_CheckSignals() < 0) {
                ZMQ.close(&m);
                return NULL;
            }
        }
    if (r < 0) {
        int e = ZMQ.err();
        ZMQ.close(&m);
        return zs_error_of(e);
    }
    /* the rest of it (delivered whole, so never waits), every frame */
    return odd_message(sock, &m, 1, PY_SSIZE_T_MAX);
}

/* z_send_multipart(socket, [bytes-like]): every frame's buffer taken before the first is sent, so a
 * bad frame never leaves half a message queued (the next send would be glued to it) */
static PyObject *mod_z_send_multipart(PyObject *self, PyObject *args) {
    unsigned long long s;
    PyObject *frames;
    if (!PyArg_ParseTuple(args, "KO!", &s, &PyList_Type, &frames) || !zs_ready()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(frames), got = 0;
    Py_buffer *b = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (!b) return PyErr_NoMemory();
    int r = 0, e = 0, interrupted = 0;
    for (; got < n; got++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, got), &b[got], PyBUF_SIMPLE) < 0) break;
    for (Py_ssize_t i = 0; got == n && i < n && r >= 0; i++) {
        int more = i + 1 < n ? ZMQ_SNDMORE_ : 0;
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            r = ZS.send((void *)(uintptr_t)s, b[i].buf, (size_t)b[i].len, more);
            if (r < 0) e = ZMQ.err();
            Py_END_ALLOW_THREADS
            if (r >= 0 || e != EINTR) break;
            if (PyErr_CheckSignals() < 0) {
                interrupted = 1;
                break;
            }
        }
        if (interrupted) break;
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    PyMem_Free(b);
    if (got < n || interrupted) return NULL;
    if (r < 0) return zs_error_of(e);
    Py_RETURN_NONE;
}
