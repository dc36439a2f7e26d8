/* The live receive loop of the subscriber thread, in C (included by _kvcore.c).
 *
 * Why: receiving a message through pyzmq costs three Python calls, three frame objects and the
 * per-message sequence checks in Python, about 6 us a message against the ~5 us the C ingest needs to
 * apply it. vLLM publishes a batch per engine step, so at fleet scale
 * messages are many and small, and every router replica receives all of them.
 *
 * How: libzmq is not linked. index/zsock.py binds a libzmq (`zmq_load`, _kvzmq.h: the copy pyzmq
 * loaded when it did, so pyzmq's socket handles are valid here too) and checks this loop on a
 * socket pair before the subscriber uses it. `recv_live` then takes, from one
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
#include <dlfcn.h>
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

/* An odd message, whole: its first `n` frames already received (`got`), the rest still queued.
 * Every frame is received and closed (so none is mistaken for the next message's); each of the
 * first `keep` becomes a bytes object in the returned list. NULL with an exception set when
 * memory ran out (the message is consumed all the same). */
static PyObject *odd_message(void *sock, ZMsg *got, int n, Py_ssize_t keep) {
    PyObject *frames = PyList_New(0);
    ZMsg m;
    int more = 1;
    for (int i = 0; more; i++) {
        ZMsg *f = &m;
        if (i < n) f = &got[i];
        else {
            ZMQ.init(f);
            if (ZMQ.recv(f, sock, ZMQ_DONTWAIT_) < 0) { /* a message is delivered whole: not expected */
                ZMQ.close(f);
                break;
            }
        }
        more = ZMQ.more(f);
        if (frames && PyList_GET_SIZE(frames) < keep) {
            PyObject *b = PyBytes_FromStringAndSize((const char *)ZMQ.data(f), (Py_ssize_t)ZMQ.size(f));
            if (!b || PyList_Append(frames, b) < 0) Py_CLEAR(frames);
            Py_XDECREF(b);
        }
        ZMQ.close(f);
    }
    return frames;
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
        PyErr_SetString(PyExc_RuntimeError, "zmq_load was not called");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)addr;
    Py_ssize_t taken = 0;
    double last_ts = 0.0;
    PyObject *stop = NULL; /* new reference, the 4th item */
    ZMsg f[3];
    while (taken < max) {
        ZMQ.init(&f[0]);
        if (ZMQ.recv(&f[0], sock, ZMQ_DONTWAIT_) < 0) {
            int e = ZMQ.err();
            ZMQ.close(&f[0]);
            if (e != EAGAIN) stop = PyLong_FromLong(e);
            break;
        }
        /* frame by frame, while the message keeps the common shape; `got` frames are open */
        int got = 1;
        long long seq = -1;
        double ts = 0.0;
        /* the topic frame: the one followed, with more frames behind it */
        size_t tn = ZMQ.size(&f[0]);
        int ok = ZMQ.more(&f[0]) &&
                 (topic.len == 0 || ((size_t)topic.len == tn && memcmp(ZMQ.data(&f[0]), topic.buf, tn) == 0));
        if (ok) {
            ZMQ.init(&f[1]);
            ok = ZMQ.recv(&f[1], sock, ZMQ_DONTWAIT_) >= 0; /* (cannot fail: delivered whole) */
            if (!ok) ZMQ.close(&f[1]);
            else got = 2;
        }
        if (ok && ZMQ.size(&f[1]) == 8 && ZMQ.more(&f[1])) {
            const uint8_t *sb = (const uint8_t *)ZMQ.data(&f[1]);
            u64 v = 0;
            for (int i = 0; i < 8; i++) v = (v << 8) | sb[i];
            if (v <= (u64)INT64_MAX) seq = (long long)v;
        }
        /* a gap, a restart, a duplicate or a bad seq frame: the Python path decides */
        ok = ok && seq >= 0 && seq == last_seq + 1;
        if (ok) {
            ZMQ.init(&f[2]);
            ok = ZMQ.recv(&f[2], sock, ZMQ_DONTWAIT_) >= 0;
            if (!ok) ZMQ.close(&f[2]);
            else got = 3;
        }
        const uint8_t *p = ok ? (const uint8_t *)ZMQ.data(&f[2]) : NULL;
        size_t pn = ok ? ZMQ.size(&f[2]) : 0;
        /* vLLM's layout, a timestamp that is a finite float64, and nothing after the payload */
        ok = ok && !ZMQ.more(&f[2]) && pn >= 10 && p[0] >= 0x92 && p[0] <= 0x9F && p[1] == 0xCB;
        if (ok) {
            u64 v = 0;
            for (int i = 0; i < 8; i++) v = (v << 8) | p[2 + i];
            memcpy(&ts, &v, 8);
            ok = isfinite(ts);
        }
        if (!ok) {
            stop = odd_message(sock, f, got, MAX_FRAMES); /* whole, to the Python path */
            if (!stop) goto error;
            break;
        }
        PyObject *payload = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)pn);
        for (int i = 0; i < 3; i++) ZMQ.close(&f[i]);
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
