/* The live receive loop of the subscriber thread, in C (included by _kvcore.c).
 *
 * Why: receiving a message through pyzmq costs three Python calls, three frame objects and the
 * per-message sequence checks in Python, about 6 us a message against the ~5 us the C ingest needs to
 * apply it (BENCHMARKS.md, issue 11). vLLM publishes a batch per engine step, so at fleet scale
 * messages are many and small, and every router replica receives all of them.
 *
 * How: libzmq is not linked. index/zrecv.py finds the libzmq that pyzmq itself loaded (the same
 * instance, so pyzmq's socket handle is valid here), hands its entry points to `recv_bind`, and
 * checks them on a socket pair before the subscriber uses them. `recv_live` then takes, from one
 * SUB socket and without blocking, every message of the common shape: three frames [topic, 8-byte
 * big-endian seq, payload], the topic the one followed (when one is), seq the previous one plus one,
 * and a payload whose batch timestamp can be read in place (vLLM's layout: an array whose first item
 * is a finite float64). Each goes to the chunk as (source, payload bytes), exactly what the Python
 * path (index/subscriber.py `_accept`) would have appended. Any other message stops the loop and is
 * returned whole (its frames), so the Python path decides about it with all of its rules: gaps and
 * replays, restarts and duplicates, foreign topics, malformed frames.
 *
 * Cost per message: three zmq_msg_recv calls, one bytes object and one tuple.
 */
#include <errno.h>

typedef int (*zmq_msg_init_fn)(void *msg);
typedef int (*zmq_msg_recv_fn)(void *msg, void *socket, int flags);
typedef void *(*zmq_msg_data_fn)(void *msg);
typedef size_t (*zmq_msg_size_fn)(const void *msg);
typedef int (*zmq_msg_more_fn)(const void *msg);
typedef int (*zmq_msg_close_fn)(void *msg);
typedef int (*zmq_errno_fn)(void);

static struct {
    zmq_msg_init_fn init;
    zmq_msg_recv_fn recv;
    zmq_msg_data_fn data;
    zmq_msg_size_fn size;
    zmq_msg_more_fn more;
    zmq_msg_close_fn close;
    zmq_errno_fn err;
} ZMQ;

#define ZMQ_DONTWAIT_ 1
#define MAX_FRAMES 64 /* an odd message's frames beyond this are received and dropped */

/* zmq_msg_t: 64 opaque bytes, pointer-aligned, in every libzmq since 4.1 */
typedef union {
    unsigned char bytes[64];
    void *p;
    double d;
    int64_t i;
} ZMsg;

/* recv_bind((init, recv, data, size, more, close, errno)): libzmq's entry points, as addresses */
static PyObject *mod_recv_bind(PyObject *self, PyObject *args) {
    unsigned long long a[7];
    if (!PyArg_ParseTuple(args, "(KKKKKKK)", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6])) return NULL;
    for (int i = 0; i < 7; i++)
        if (!a[i]) {
            PyErr_SetString(PyExc_ValueError, "a libzmq entry point is NULL");
            return NULL;
        }
    ZMQ.init = (zmq_msg_init_fn)(uintptr_t)a[0];
    ZMQ.recv = (zmq_msg_recv_fn)(uintptr_t)a[1];
    ZMQ.data = (zmq_msg_data_fn)(uintptr_t)a[2];
    ZMQ.size = (zmq_msg_size_fn)(uintptr_t)a[3];
    ZMQ.more = (zmq_msg_more_fn)(uintptr_t)a[4];
    ZMQ.close = (zmq_msg_close_fn)(uintptr_t)a[5];
    ZMQ.err = (zmq_errno_fn)(uintptr_t)a[6];
    Py_RETURN_NONE;
}

/* The rest of a message whose first frame is `first` (already received): every frame as bytes. */
static PyObject *odd_message(void *sock, ZMsg *first) {
    PyObject *frames = PyList_New(0);
    if (!frames) return NULL;
    ZMsg m;
    int more = ZMQ.more(first);
    PyObject *b = PyBytes_FromStringAndSize((const char *)ZMQ.data(first), (Py_ssize_t)ZMQ.size(first));
    ZMQ.close(first);
    if (!b || PyList_Append(frames, b) < 0) {
        Py_XDECREF(b);
        goto fail;
    }
    Py_DECREF(b);
    while (more) {
        ZMQ.init(&m);
        if (ZMQ.recv(&m, sock, ZMQ_DONTWAIT_) < 0) { /* a message is delivered whole: not expected */
            ZMQ.close(&m);
            break;
        }
        more = ZMQ.more(&m);
        if (PyList_GET_SIZE(frames) < MAX_FRAMES) {
            b = PyBytes_FromStringAndSize((const char *)ZMQ.data(&m), (Py_ssize_t)ZMQ.size(&m));
            if (!b || PyList_Append(frames, b) < 0) {
                Py_XDECREF(b);
                ZMQ.close(&m);
                goto fail;
            }
            Py_DECREF(b);
        }
        ZMQ.close(&m);
    }
    return frames;
fail:
    /* the message's remaining frames must not be mistaken for the next message's */
    while (more) {
        ZMQ.init(&m);
        if (ZMQ.recv(&m, sock, ZMQ_DONTWAIT_) < 0) {
            ZMQ.close(&m);
            break;
        }
        more = ZMQ.more(&m);
        ZMQ.close(&m);
    }
    Py_DECREF(frames);
    return NULL;
}

/* recv_live(socket address, chunk list, source index, last seq, topic, max messages)
 *   -> (messages taken, last seq, last ts (0.0 when none taken), frames of the message that stopped it, or None
 *       when the socket had nothing more or max was reached, or an int: libzmq's errno) */
static PyObject *mod_recv_live(PyObject *self, PyObject *args) {
    unsigned long long addr;
    PyObject *chunk, *sidx_obj;
    long long last_seq;
    Py_buffer topic;
    Py_ssize_t max;
    if (!PyArg_ParseTuple(args, "KO!OLy*n", &addr, &PyList_Type, &chunk, &sidx_obj, &last_seq, &topic, &max))
        return NULL;
    if (!ZMQ.recv) {
        PyBuffer_Release(&topic);
        PyErr_SetString(PyExc_RuntimeError, "recv_bind was not called");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)addr;
    Py_ssize_t taken = 0;
    double last_ts = 0.0;
    PyObject *stop = NULL; /* new reference, the 4th item */
    ZMsg f1, f2, f3;
    while (taken < max) {
        ZMQ.init(&f1);
        if (ZMQ.recv(&f1, sock, ZMQ_DONTWAIT_) < 0) {
            int e = ZMQ.err();
            ZMQ.close(&f1);
            if (e != EAGAIN) stop = PyLong_FromLong(e);
            break;
        }
        /* the topic frame: the one followed, with more frames behind it */
        size_t tn = ZMQ.size(&f1);
        int ok = ZMQ.more(&f1) && (topic.len == 0 || ((size_t)topic.len == tn &&
                                                       memcmp(ZMQ.data(&f1), topic.buf, tn) == 0));
        if (!ok) {
            stop = odd_message(sock, &f1);
            if (!stop) goto error;
            break;
        }
        ZMQ.init(&f2);
        if (ZMQ.recv(&f2, sock, ZMQ_DONTWAIT_) < 0) { /* cannot happen: delivered whole */
            ZMQ.close(&f2);
            ZMQ.close(&f1);
            continue;
        }
        long long seq = -1;
        if (ZMQ.size(&f2) == 8 && ZMQ.more(&f2)) {
            const uint8_t *s = (const uint8_t *)ZMQ.data(&f2);
            u64 v = 0;
            for (int i = 0; i < 8; i++) v = (v << 8) | s[i];
            if (v <= (u64)INT64_MAX) seq = (long long)v;
        }
        if (seq < 0 || seq != last_seq + 1) {
            /* a gap, a restart, a duplicate or a bad seq frame: the Python path decides */
            PyObject *rest = NULL;
            PyObject *t = PyBytes_FromStringAndSize((const char *)ZMQ.data(&f1), (Py_ssize_t)tn);
            ZMQ.close(&f1);
            if (t) rest = odd_message(sock, &f2);
            else {
                /* drain it still */
                PyObject *dropped = odd_message(sock, &f2);
                Py_XDECREF(dropped);
            }
            if (!t || !rest) {
                Py_XDECREF(t);
                Py_XDECREF(rest);
                goto error;
            }
            if (PyList_Insert(rest, 0, t) < 0) {
                Py_DECREF(t);
                Py_DECREF(rest);
                goto error;
            }
            Py_DECREF(t);
            stop = rest;
            break;
        }
        ZMQ.init(&f3);
        if (ZMQ.recv(&f3, sock, ZMQ_DONTWAIT_) < 0) {
            ZMQ.close(&f3);
            ZMQ.close(&f2);
            ZMQ.close(&f1);
            continue;
        }
        const uint8_t *p = (const uint8_t *)ZMQ.data(&f3);
        size_t pn = ZMQ.size(&f3);
        double ts = 0.0;
        ok = !ZMQ.more(&f3) && pn >= 10 && p[0] >= 0x92 && p[0] <= 0x9F && p[1] == 0xCB;
        if (ok) {
            u64 v = 0;
            for (int i = 0; i < 8; i++) v = (v << 8) | p[2 + i];
            memcpy(&ts, &v, 8);
            ok = isfinite(ts);
        }
        if (!ok) {
            /* not vLLM's layout, non-finite, or more frames: whole, to the Python path */
            PyObject *t = PyBytes_FromStringAndSize((const char *)ZMQ.data(&f1), (Py_ssize_t)tn);
            PyObject *s = PyBytes_FromStringAndSize((const char *)ZMQ.data(&f2), 8);
            ZMQ.close(&f1);
            ZMQ.close(&f2);
            PyObject *rest = odd_message(sock, &f3);
            if (!t || !s || !rest || PyList_Insert(rest, 0, s) < 0 || PyList_Insert(rest, 0, t) < 0) {
                Py_XDECREF(t);
                Py_XDECREF(s);
                Py_XDECREF(rest);
                goto error;
            }
            Py_DECREF(t);
            Py_DECREF(s);
            stop = rest;
            break;
        }
        PyObject *payload = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)pn);
        ZMQ.close(&f3);
        ZMQ.close(&f2);
        ZMQ.close(&f1);
        if (!payload) goto error;
        PyObject *item = PyTuple_New(2);
        if (!item) {
            Py_DECREF(payload);
            goto error;
        }
        Py_INCREF(sidx_obj);
        PyTuple_SET_ITEM(item, 0, sidx_obj);
        PyTuple_SET_ITEM(item, 1, payload);
        int r = PyList_Append(chunk, item);
        Py_DECREF(item);
        if (r < 0) goto error;
        last_seq = seq;
        last_ts = ts;
        taken++;
    }
    PyBuffer_Release(&topic);
    if (!stop) {
        Py_INCREF(Py_None);
        stop = Py_None;
    }
    return Py_BuildValue("(nLdN)", taken, last_seq, last_ts, stop);
error:
    PyBuffer_Release(&topic);
    return NULL;
}
