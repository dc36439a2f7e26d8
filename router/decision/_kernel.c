/* The scoring kernel of router/decision: every candidate's cost and the choice, in one pass over
 * compact inputs, with no Python object per candidate; and the candidates' JSON of /route written
 * from its record.
 *
 * One decision path: router/decision/policy.py's Policy.score (and Policy.choose, which the
 * simulators and the P/D planner call with Candidate objects) hands this kernel the candidates' matched
 * blocks, their blocks by medium, their load records and the policy's weights; it returns the
 * record (a bytes object of packed per-candidate columns, read by router/decision/record.py) and
 * the index chosen. The policy's random.Random draws the ties and the samples, with the calls
 * Python would make. What it computes is written down in Python once more, only in the tests
 * (tests/policy_reference.py), which compare the two over random fleets.
 *
 * Floating point follows Python's order of operations (compiled with -ffp-contract=off, so no fused
 * multiply-add changes a rounding); round(x, 3) and format(x, "g") use CPython's own correctly
 * rounded conversions; floats outside [1e-4, 1e16) and anything not a plain int or float are written
 * by the encoder passed in (msgspec's), whose layout differs from repr() there. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>
#include <structmember.h>

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static int grow(Buf *b, size_t need) {
    if (b->n + need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + need) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const char *s, size_t n) {
    if (grow(b, n)) return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

#define PUTS(b, lit) put((b), (lit), sizeof(lit) - 1)

static int put_ll(Buf *b, long long v) {
    char t[24];
    int n = sizeof t;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        t[--n] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) t[--n] = '-';
    return put(b, t + n, sizeof t - (size_t)n);
}

/* what encode(obj) returns (bytes), appended */
static int put_encoded(Buf *b, PyObject *encode, PyObject *obj) {
    PyObject *r = PyObject_CallOneArg(encode, obj);
    if (!r) return -1;
    if (!PyBytes_Check(r)) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "encode must return bytes");
        return -1;
    }
    int rc = put(b, PyBytes_AS_STRING(r), (size_t)PyBytes_GET_SIZE(r));
    Py_DECREF(r);
    return rc;
}

/* The decimal digits of a dyadic x = m / 2^k (k <= 4, |x| < 1e10), exactly: such a value has at
 * most 14 significant digits, so its exact expansion is also the shortest that reads back as x, which
 * is what repr() and format(x, "g") print. Most terms of a decision are such values (whole blocks,
 * quarters of the load weight, sixteenths of a block of tokens); the conversions of CPython that
 * handle every double cost ~0.1 us each, a few dozen per decision. Returns the length written to
 * t (no exponent, the fraction without trailing zeros, "" fraction when whole; sign included), or
 * -1 when x is not such a value. *frac_digits: digits after the point (0 when whole); *sig: its
 * significant digits. */
static int dyadic(double x, char *t, int *frac_digits, int *sig) {
    if (!(fabs(x) < 1e10)) return -1; /* (NaN too) */
    int k = 0;
    double y = x;
    while (y != floor(y)) {
        if (++k > 4) return -1;
        y = x * (double)(1 << k); /* exact: a power of two */
    }
    long long m = (long long)y;
    int neg = signbit(x) != 0;
    unsigned long long am = neg ? (unsigned long long)(-m) : (unsigned long long)m;
    unsigned long long ip = am >> k, f = am & ((1ULL << k) - 1);
    static const unsigned long long pow5[] = {1, 5, 25, 125, 625};
    unsigned long long fd = f * pow5[k]; /* the fraction's k decimal digits */
    int nd = k;
    while (nd > 0 && fd % 10 == 0) {
        fd /= 10;
        nd--;
    }
    char ib[24];
    int ni = 0;
    do {
        ib[ni++] = (char)('0' + ip % 10);
        ip /= 10;
    } while (ip);
    int n = 0;
    if (neg) t[n++] = '-';
    for (int i = ni - 1; i >= 0; i--) t[n++] = ib[i];
    int s = (ni == 1 && ib[0] == '0') ? 0 : ni;
    if (nd) {
        t[n++] = '.';
        char fb[8];
        for (int i = nd - 1; i >= 0; i--) {
            fb[i] = (char)('0' + fd % 10);
            fd /= 10;
        }
        int lead = 0; /* (leading zeros of a fraction below 1 are not significant) */
        if (!s)
            while (lead < nd && fb[lead] == '0') lead++;
        memcpy(t + n, fb, (size_t)nd);
        n += nd;
        s += nd - lead;
    }
    *frac_digits = nd;
    *sig = s;
    return n;
}

/* a float as msgspec writes it: repr()'s digits, which are its layout too in [1e-4, 1e16) */
static int put_double(Buf *b, double x, PyObject *encode) {
    double a = fabs(x);
    char t[48];
    int fd, sig, n;
    if ((x == 0.0 || a >= 1e-4) && (n = dyadic(x, t, &fd, &sig)) >= 0) {
        if (!fd) { /* repr() keeps a ".0" */
            t[n++] = '.';
            t[n++] = '0';
        }
        return put(b, t, (size_t)n);
    }
    if (x == 0.0 || (a >= 1e-4 && a < 1e16)) {
        char *s = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (!s) return -1;
        int rc = put(b, s, strlen(s));
        PyMem_Free(s);
        return rc;
    }
    PyObject *f = PyFloat_FromDouble(x);
    if (!f) return -1;
    int rc = put_encoded(b, encode, f);
    Py_DECREF(f);
    return rc;
}

/* a Python number as msgspec writes it */
static int put_number(Buf *b, PyObject *o, PyObject *encode) {
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (!overflow) return put_ll(b, v);
    } else if (PyFloat_CheckExact(o)) {
        return put_double(b, PyFloat_AS_DOUBLE(o), encode);
    }
    return put_encoded(b, encode, o);
}

/* round(x, digits) as CPython computes it: correctly rounded to a decimal string, read back */
static int round_to(double x, int digits, double *out) {
    char t[48];
    int fd, sig;
    if (!isfinite(x) || (dyadic(x, t, &fd, &sig) >= 0 && fd <= digits)) {
        *out = x; /* (already that short: unchanged) */
        return 0;
    }
    char *s = PyOS_double_to_string(x, 'f', digits, 0, NULL);
    if (!s) return -1;
    double r = PyOS_string_to_double(s, NULL, NULL);
    PyMem_Free(s);
    if (r == -1.0 && PyErr_Occurred()) return -1;
    *out = r;
    return 0;
}

/* Python's ``x % 1`` is non-zero (or NaN) */
static int fractional(double x) {
    return !isfinite(x) || x != floor(x); /* (fmod(x, 1.0) != 0, or NaN for inf and NaN: the same, faster) */
}

/* format(x, "g") */
static int put_g(Buf *b, double x) {
    char t[48];
    int fd, sig, n;
    /* (six significant digits or fewer, in %g's fixed-point range: the exact digits, as %g prints) */
    if ((x == 0.0 || fabs(x) >= 1e-4) && fabs(x) < 1e6 && (n = dyadic(x, t, &fd, &sig)) >= 0 && sig <= 6)
        return put(b, t, (size_t)n);
    char *s = PyOS_double_to_string(x, 'g', 6, 0, NULL);
    if (!s) return -1;
    int rc = put(b, s, strlen(s));
    PyMem_Free(s);
    return rc;
}

/* str(o) */
static int put_str(Buf *b, PyObject *o) {
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (!overflow) return put_ll(b, v);
    }
    PyObject *s = PyObject_Str(o);
    if (!s) return -1;
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    int rc = u ? put(b, u, (size_t)n) : -1;
    Py_DECREF(s);
    return rc;
}

/* a plain ASCII dict key, written quoted; anything needing an escape goes through encode */
static int put_key(Buf *b, PyObject *k, PyObject *encode) {
    if (PyUnicode_CheckExact(k) && PyUnicode_IS_ASCII(k)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(k);
        const char *s = (const char *)PyUnicode_1BYTE_DATA(k);
        int plain = 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (s[i] < 0x20 || s[i] == '"' || s[i] == '\\' || s[i] == 0x7f) {
                plain = 0;
                break;
            }
        if (plain) {
            if (PUTS(b, "\"") || put(b, s, (size_t)n) || PUTS(b, "\"")) return -1;
            return 0;
        }
    }
    return put_encoded(b, encode, k);
}

/* a number (int or float) of a load or a by-medium count, as a double the way Python mixes them */
static int as_double(PyObject *o, double *out) {
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 0;
    }
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *out = d;
    return 0;
}


/* ----------------------------------------------------------------------------------------------
 * The record: per-candidate columns of 8 bytes each, n entries per column, in this order. */
enum { C_CREDIT, C_PREFILL, C_QUEUED, C_SCORE, C_ASSUMED, C_WAITING, N_DOUBLE_COLS = C_WAITING + 1 };
enum { C_MATCHED = N_DOUBLE_COLS, C_ACTIVE, C_WFLAG, C_WIVAL, N_COLS };
enum { K_KV, K_ROUND_ROBIN, K_LEAST_LOADED, K_RANDOM };
enum { R_PREFIX, R_LOAD, R_THRESHOLD, R_BUSIER, R_TIED, R_COST, R_CHOSEN, R_NOT_CHOSEN };

static PyObject *S_GPU, *S_CPU, *S_STORAGE, *S_PREDICTED, *S_PENDING, *S_ACTIVE, *S_WAITING, *S_CHOICE, *S_CHOICES,
    *S_RANDRANGE, *S_WEIGHTS;

/* Where a load record's three fields live: msgspec Struct fields are member descriptors of
 * objects, read here as pointers at their offsets (an attribute lookup each cost more than the
 * scoring). Resolved once per type; a type without such descriptors is read by attribute. */
static PyTypeObject *load_type = NULL;
static Py_ssize_t off_active = -1, off_pending = -1, off_waiting = -1;

static Py_ssize_t member_offset(PyTypeObject *t, PyObject *name) {
    PyObject *d = PyObject_GetAttr((PyObject *)t, name);
    if (!d) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX || m->type == T_OBJECT) off = m->offset;
    }
    Py_DECREF(d);
    return off;
}

/* the three fields of a load record, as new references */
static int load_fields(PyObject *load, PyObject **active, PyObject **pending, PyObject **waiting) {
    PyTypeObject *t = Py_TYPE(load);
    if (t != load_type) {
        Py_ssize_t a = member_offset(t, S_ACTIVE), p = member_offset(t, S_PENDING), w = member_offset(t, S_WAITING);
        Py_XSETREF(load_type, (PyTypeObject *)Py_NewRef(t));
        off_active = a;
        off_pending = p;
        off_waiting = w;
    }
    if (off_active >= 0 && off_pending >= 0 && off_waiting >= 0) {
        *active = *(PyObject **)((char *)load + off_active);
        *pending = *(PyObject **)((char *)load + off_pending);
        *waiting = *(PyObject **)((char *)load + off_waiting);
        if (*active && *pending && *waiting) {
            Py_INCREF(*active);
            Py_INCREF(*pending);
            Py_INCREF(*waiting);
            return 0;
        }
    }
    *active = PyObject_GetAttr(load, S_ACTIVE);
    *pending = *active ? PyObject_GetAttr(load, S_PENDING) : NULL;
    *waiting = *pending ? PyObject_GetAttr(load, S_WAITING) : NULL;
    if (*waiting) return 0;
    Py_CLEAR(*active);
    Py_CLEAR(*pending);
    return -1;
}

/* pending / bs as Python divides: exact for an int a double holds exactly, else Python's own true
 * division (an int quotient is rounded once, not after the int's own rounding) */
static int divide(PyObject *pending, long long bs, double *out) {
    *out = 0.0;
    if (PyFloat_CheckExact(pending)) {
        *out = PyFloat_AS_DOUBLE(pending) / (double)bs;
        return 0;
    }
    int overflow = 0, is_int = PyLong_CheckExact(pending);
    long long p = is_int ? PyLong_AsLongLongAndOverflow(pending, &overflow) : 0;
    if (p == -1 && PyErr_Occurred()) return -1;
    if (is_int && !overflow && p >= -(1LL << 53) && p <= (1LL << 53)) {
        *out = (double)p / (double)bs;
        return 0;
    }
    PyObject *bso = PyLong_FromLongLong(bs);
    if (!bso) return -1;
    PyObject *q = PyNumber_TrueDivide(pending, bso);
    Py_DECREF(bso);
    if (!q) return -1;
    int rc = as_double(q, out);
    Py_DECREF(q);
    return rc;
}

/* by.get(name, 0) as a double */
static int medium(PyObject *by, PyObject *name, double *out) {
    PyObject *v = PyDict_GetItemWithError(by, name);
    if (!v) {
        if (PyErr_Occurred()) return -1;
        *out = 0.0;
        return 0;
    }
    return as_double(v, out);
}

/* rng.choice(ties) where ties are the i with tie[i] set, in order (count of them): the same call
 * and draw as with a list, but the sequence is a memoryview over the indices (len and [] give
 * Python ints as a list's would), so a wide fleet's ties build no Python int each. The index
 * chosen, or -1 with an exception set. */
static Py_ssize_t choose_tie(PyObject *rng, const unsigned char *tie, Py_ssize_t n, Py_ssize_t count) {
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(Py_ssize_t) * count);
    if (!bytes) return -1;
    Py_ssize_t *idx = (Py_ssize_t *)PyBytes_AS_STRING(bytes), k = 0;
    for (Py_ssize_t i = 0; i < n && k < count; i++)
        if (tie[i]) idx[k++] = i;
    PyObject *raw = PyMemoryView_FromObject(bytes);
    Py_DECREF(bytes);
    if (!raw) return -1;
    PyObject *seq = PyObject_CallMethod(raw, "cast", "s", "n");
    Py_DECREF(raw);
    if (!seq) return -1;
    PyObject *got = PyObject_CallMethodOneArg(rng, S_CHOICE, seq);
    Py_DECREF(seq);
    if (!got) return -1;
    Py_ssize_t best = PyLong_AsSsize_t(got);
    Py_DECREF(got);
    if (best == -1 && PyErr_Occurred()) return -1;
    if (best < 0 || best >= n) {
        PyErr_SetString(PyExc_ValueError, "the random generator returned no candidate");
        return -1;
    }
    return best;
}

/* by.get(PREDICTED / GPU / CPU / STORAGE, 0) as doubles. The index's dicts hold one to three of
 * these names, as the very string objects interned here, with plain int counts: one walk over the
 * items matches them by identity. Any other key (another medium, an equal string made elsewhere)
 * or value (whose conversion could run Python code during the walk) falls back to the four
 * lookups, which decide by equality. */
static int media4(PyObject *by, double *pr, double *g, double *c, double *st) {
    *pr = *g = *c = *st = 0.0;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(by, &pos, &k, &v)) {
        double *out = k == S_PREDICTED ? pr : k == S_GPU ? g : k == S_CPU ? c : k == S_STORAGE ? st : NULL;
        if (!out || !(PyLong_CheckExact(v) || PyFloat_CheckExact(v)))
            return medium(by, S_PREDICTED, pr) || medium(by, S_GPU, g) || medium(by, S_CPU, c) ||
                   medium(by, S_STORAGE, st);
        if (as_double(v, out)) return -1;
    }
    return 0;
}

static int get_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

#define COL_D(buf, n, c) ((double *)(buf) + (size_t)(c) * (size_t)(n))
#define COL_L(buf, n, c) ((long long *)(buf) + (size_t)(c) * (size_t)(n))

/* score(params, matched, media, offs, roles, loads, assumed, spread, rng, order, turn)
 *   -> (record, best, prefix, inflight)
 *
 * params: (prompt_blocks, block_size, kind, gpu_credit, cpu_credit, storage_credit,
 * predicted_credit, min_match_blocks, min_match_ratio, load_weight, decode_weight, waiting_weight,
 * temperature); kind: 0 kv, 1 round_robin, 2 least_loaded, 3 random.
 * matched[i]: candidate i's matched blocks; media: None, or per candidate None or its blocks by
 * medium (a dict); offs: None, or per candidate None or the index's per-medium counts of its
 * blocks off GPU (a list; GPU holds the rest), with roles[k] saying what medium k is (1 GPU, 2 CPU,
 * 3 STORAGE, 0 another); a candidate with neither holds all on GPU. loads[i]: its load record
 * (active, pending_prefill_tokens, engine_waiting); assumed: None or per candidate the load
 * assumed on it; spread: None or (count, per): place count assumed requests of per blocks each on
 * the least loaded candidates first (router/cluster/unseen.py); order: round_robin's candidate
 * order, turn its turn. The record is bytes: the columns of the enum above. */
static PyObject *score(PyObject *self, PyObject *args) {
    PyObject *matchedl, *medial, *offsl, *roles, *loadsl, *assumedl, *spread, *rng, *order, *extrao = Py_None;
    long long prompt_blocks, block_size, min_blocks_cfg, turn;
    int kind;
    double gpu, cpu, storage, predicted, min_ratio_cfg, load_weight, decode_weight, waiting_weight, temperature;
    if (!PyArg_ParseTuple(args, "(LLiddddLddddd)O!OOOO!OOOOL|O", &prompt_blocks, &block_size, &kind, &gpu, &cpu,
                          &storage, &predicted, &min_blocks_cfg, &min_ratio_cfg, &load_weight, &decode_weight,
                          &waiting_weight, &temperature, &PyList_Type, &matchedl, &medial, &offsl, &roles,
                          &PyList_Type, &loadsl, &assumedl, &spread, &rng, &order, &turn, &extrao))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(matchedl);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no candidates");
        return NULL;
    }
    /* extra: None, or per candidate (active, prefilling, pending) int64 triples added to its load
     * record's figures (other routers' load, gathered by gather()) */
    Py_buffer extra = {0};
    const long long *ex = NULL;
    if (extrao != Py_None) {
        if (PyObject_GetBuffer(extrao, &extra, PyBUF_SIMPLE)) return NULL;
        if (extra.len != (Py_ssize_t)((size_t)n * 3 * 8)) {
            PyBuffer_Release(&extra);
            PyErr_SetString(PyExc_ValueError, "extra must hold three int64 per candidate");
            return NULL;
        }
        ex = (const long long *)extra.buf;
    }
    if (PyList_GET_SIZE(loadsl) != n || (medial != Py_None && (!PyList_Check(medial) || PyList_GET_SIZE(medial) != n)) ||
        (offsl != Py_None && (!PyList_Check(offsl) || PyList_GET_SIZE(offsl) != n)) ||
        (assumedl != Py_None && (!PyList_Check(assumedl) || PyList_GET_SIZE(assumedl) != n))) {
        PyErr_SetString(PyExc_ValueError, "every per-candidate list must have one entry per candidate");
        if (ex) PyBuffer_Release(&extra);
        return NULL;
    }
    if (offsl != Py_None && !PyBytes_Check(roles)) {
        PyErr_SetString(PyExc_TypeError, "roles must be bytes");
        if (ex) PyBuffer_Release(&extra);
        return NULL;
    }
    PyObject *rec = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((size_t)n * N_COLS * 8));
    if (!rec) {
        if (ex) PyBuffer_Release(&extra);
        return NULL;
    }
    char *buf = PyBytes_AS_STRING(rec);
    double *credit_c = COL_D(buf, n, C_CREDIT), *prefill_c = COL_D(buf, n, C_PREFILL), *queued_c = COL_D(buf, n, C_QUEUED);
    double *score_c = COL_D(buf, n, C_SCORE), *assumed_c = COL_D(buf, n, C_ASSUMED), *waiting_c = COL_D(buf, n, C_WAITING);
    long long *matched_c = COL_L(buf, n, C_MATCHED), *active_c = COL_L(buf, n, C_ACTIVE);
    long long *wflag_c = COL_L(buf, n, C_WFLAG), *wival_c = COL_L(buf, n, C_WIVAL);
    double *raw = PyMem_Malloc(sizeof(double) * (size_t)n * 2); /* pending / bs, and the spread's terms */
    PyObject **pend = kind == K_LEAST_LOADED ? PyMem_Calloc((size_t)n, sizeof(PyObject *)) : NULL;
    PyObject *out = NULL, *pick = NULL;
    unsigned char *tie_c = NULL;
    long long inflight = 0;
    if (!raw || (kind == K_LEAST_LOADED && !pend)) {
        PyErr_NoMemory();
        goto done;
    }
    const char *rolev = offsl != Py_None ? PyBytes_AS_STRING(roles) : NULL;
    Py_ssize_t nroles = offsl != Py_None ? PyBytes_GET_SIZE(roles) : 0;
    long long bs = block_size > 1 ? block_size : 1;
    long long min_blocks = min_blocks_cfg > 1 ? min_blocks_cfg : 1;
    double min_ratio = prompt_blocks ? min_ratio_cfg * (double)prompt_blocks : 0.0;
    int kv = kind == K_KV;
    /* --- the inputs, read before any Python code runs (rng's calls could change the lists) */
    for (Py_ssize_t i = 0; i < n; i++) {
        long long matched;
        if (get_ll(PyList_GET_ITEM(matchedl, i), &matched)) goto done;
        matched_c[i] = matched;
        PyObject *by = medial != Py_None ? PyList_GET_ITEM(medial, i) : Py_None;
        PyObject *row = offsl != Py_None ? PyList_GET_ITEM(offsl, i) : Py_None;
        double g = (double)matched, c = 0.0, st = 0.0, pr = 0.0;
        if (by != Py_None) {
            if (!PyDict_Check(by)) {
                PyErr_SetString(PyExc_TypeError, "media entries must be dicts or None");
                goto done;
            }
            if (media4(by, &pr, &g, &c, &st)) goto done;
        } else if (row != Py_None) {
            if (!PyList_Check(row)) {
                PyErr_SetString(PyExc_TypeError, "offs entries must be lists or None");
                goto done;
            }
            long long off = 0;
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(row); k++) {
                long long v;
                if (get_ll(PyList_GET_ITEM(row, k), &v)) goto done;
                off += v;
                int role = k < nroles ? rolev[k] : 0;
                if (role == 2) c = (double)v;
                else if (role == 3) st = (double)v;
            }
            g = (double)(matched - off);
        }
        double credit = 0.0;
        if (kv && matched >= min_blocks && (double)matched >= min_ratio) credit = gpu * g + cpu * c + storage * st + predicted * pr;
        double prefill = (double)prompt_blocks > credit ? (double)prompt_blocks - credit : 0.0;
        PyObject *active_o, *pending_o, *waiting_o;
        if (load_fields(PyList_GET_ITEM(loadsl, i), &active_o, &pending_o, &waiting_o)) goto done;
        if (ex && (ex[i * 3] || ex[i * 3 + 2])) { /* the record's figures plus the others' (as Python adds) */
            PyObject *a = PyLong_FromLongLong(ex[i * 3]), *p = PyLong_FromLongLong(ex[i * 3 + 2]);
            PyObject *sa = a ? PyNumber_Add(active_o, a) : NULL, *sp = p ? PyNumber_Add(pending_o, p) : NULL;
            Py_XDECREF(a);
            Py_XDECREF(p);
            Py_DECREF(active_o);
            Py_DECREF(pending_o);
            if (!sa || !sp) {
                Py_XDECREF(sa);
                Py_XDECREF(sp);
                Py_DECREF(waiting_o);
                goto done;
            }
            active_o = sa;
            pending_o = sp;
        }
        long long active = 0;
        double waiting = 0.0, q = 0.0;
        int bad = get_ll(active_o, &active) || as_double(waiting_o, &waiting);
        if (!bad) {
            int truth = PyObject_IsTrue(pending_o);
            bad = truth < 0 || divide(pending_o, bs, &q);
            if (!bad && !truth) q = 0.0;
        }
        if (!bad && PyLong_CheckExact(waiting_o)) {
            wflag_c[i] = 1;
            bad = get_ll(waiting_o, &wival_c[i]);
        } else {
            wflag_c[i] = 0;
            wival_c[i] = 0;
        }
        if (!bad && pend) pend[i] = Py_NewRef(pending_o);
        Py_DECREF(active_o);
        Py_DECREF(pending_o);
        Py_DECREF(waiting_o);
        if (bad) goto done;
        raw[i] = q;
        double queued = q;
        if (credit != 0.0) {
            double d = queued - pr;
            queued = 0.0 > d ? 0.0 : d;
        }
        double assumed = 0.0;
        if (assumedl != Py_None && as_double(PyList_GET_ITEM(assumedl, i), &assumed)) goto done;
        credit_c[i] = credit;
        prefill_c[i] = prefill;
        queued_c[i] = queued;
        assumed_c[i] = assumed;
        waiting_c[i] = waiting;
        active_c[i] = active;
        inflight += active;
    }
    /* --- other replicas' unseen decisions, placed one at a time on the least loaded */
    if (spread != Py_None) {
        double count, per;
        if (!PyArg_ParseTuple(spread, "dd", &count, &per)) goto done;
        if (count > 0 && n >= 2) {
            double *terms = raw + n;
            for (Py_ssize_t i = 0; i < n; i++)
                terms[i] = raw[i] + decode_weight * (double)active_c[i] + waiting_weight * waiting_c[i] + assumed_c[i];
            double left = count;
            while (left > 1e-9) {
                double w = 1.0 < left ? 1.0 : left;
                Py_ssize_t at = 0;
                for (Py_ssize_t i = 1; i < n; i++)
                    if (terms[i] < terms[at]) at = i;
                terms[at] += per * w;
                assumed_c[at] += per * w;
                left -= w;
            }
        }
    }
    /* --- every candidate's cost */
    for (Py_ssize_t i = 0; i < n; i++) {
        double cost = prefill_c[i] + load_weight * (queued_c[i] + decode_weight * (double)active_c[i] +
                                                    waiting_weight * waiting_c[i] + assumed_c[i]);
        double s = cost;
        if (fractional(cost) && round_to(cost, 3, &s)) goto done;
        score_c[i] = s;
    }
    /* --- the choice */
    Py_ssize_t best = -1;
    if (kind == K_ROUND_ROBIN) {
        if (!PyList_Check(order) || PyList_GET_SIZE(order) != n) {
            PyErr_SetString(PyExc_ValueError, "round_robin needs the candidates' order");
            goto done;
        }
        best = PyLong_AsSsize_t(PyList_GET_ITEM(order, (Py_ssize_t)(turn % (long long)n)));
    } else if (kind == K_RANDOM) {
        PyObject *no = PyLong_FromSsize_t(n);
        if (!no) goto done;
        pick = PyObject_CallMethodOneArg(rng, S_RANDRANGE, no);
        Py_DECREF(no);
        if (!pick) goto done;
        best = PyLong_AsSsize_t(pick);
    } else {
        if (!(tie_c = PyMem_Malloc((size_t)n))) {
            PyErr_NoMemory();
            goto done;
        }
        if (kind == K_LEAST_LOADED) {
            Py_ssize_t low = 0;
            for (Py_ssize_t i = 1; i < n; i++) {
                if (active_c[i] > active_c[low]) continue;
                int lt = active_c[i] < active_c[low];
                if (!lt && (lt = PyObject_RichCompareBool(pend[i], pend[low], Py_LT)) < 0) goto done;
                if (lt) low = i;
            }
            /* the ties, marked in tie_c */
            Py_ssize_t count = 0;
            for (Py_ssize_t i = 0; i < n; i++) {
                tie_c[i] = 0;
                if (active_c[i] != active_c[low]) continue;
                int eq = PyObject_RichCompareBool(pend[i], pend[low], Py_EQ);
                if (eq < 0) goto done;
                if (eq) {
                    tie_c[i] = 1;
                    count++;
                }
            }
            if ((best = choose_tie(rng, tie_c, n, count)) < 0) goto done;
        } else {
            double lo = score_c[0], hi = score_c[0];
            for (Py_ssize_t i = 1; i < n; i++) {
                if (score_c[i] < lo) lo = score_c[i];
                if (score_c[i] > hi) hi = score_c[i];
            }
            if (temperature > 0 && hi > lo) {
                PyObject *weights = PyList_New(n), *range = NULL, *kw = NULL, *cargs = NULL, *meth = NULL, *got = NULL;
                int bad = !weights;
                for (Py_ssize_t i = 0; !bad && i < n; i++) {
                    PyObject *f = PyFloat_FromDouble(exp(-(score_c[i] - lo) / ((hi - lo) * temperature)));
                    if (!f) bad = 1;
                    else PyList_SET_ITEM(weights, i, f);
                }
                if (!bad) bad = !(range = PyObject_CallFunction((PyObject *)&PyRange_Type, "n", n));
                if (!bad) bad = !(kw = PyDict_New()) || PyDict_SetItem(kw, S_WEIGHTS, weights);
                if (!bad) bad = !(cargs = PyTuple_Pack(1, range));
                if (!bad) bad = !(meth = PyObject_GetAttr(rng, S_CHOICES));
                if (!bad) bad = !(got = PyObject_Call(meth, cargs, kw));
                if (!bad) {
                    if (!PyList_Check(got) || PyList_GET_SIZE(got) < 1) {
                        PyErr_SetString(PyExc_ValueError, "rng.choices returned no candidate");
                        bad = 1;
                    } else {
                        pick = Py_NewRef(PyList_GET_ITEM(got, 0));
                    }
                }
                Py_XDECREF(weights);
                Py_XDECREF(range);
                Py_XDECREF(kw);
                Py_XDECREF(cargs);
                Py_XDECREF(meth);
                Py_XDECREF(got);
                if (bad) goto done;
            } else {
                Py_ssize_t count = 0;
                for (Py_ssize_t i = 0; i < n; i++) {
                    tie_c[i] = score_c[i] == lo;
                    count += tie_c[i];
                }
                if ((best = choose_tie(rng, tie_c, n, count)) < 0) goto done;
            }
        }
        if (pick) best = PyLong_AsSsize_t(pick);
    }
    if (best == -1 && PyErr_Occurred()) goto done;
    if (best < 0 || best >= n) {
        PyErr_SetString(PyExc_ValueError, "the random generator returned no candidate");
        goto done;
    }
    double min_credit = credit_c[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (credit_c[i] < min_credit) min_credit = credit_c[i];
    int prefix = kv && credit_c[best] > 0 && credit_c[best] > min_credit;
    out = Py_BuildValue("OnNL", rec, best, PyBool_FromLong(prefix), inflight);
done:
    if (pend) {
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(pend[i]);
        PyMem_Free(pend);
    }
    PyMem_Free(raw);
    PyMem_Free(tie_c);
    Py_XDECREF(pick);
    Py_DECREF(rec);
    if (ex) PyBuffer_Release(&extra);
    return out;
}

/* the terms as explain() shows them: round(x, 3) when fractional */
static int shown(double x, double *out) {
    *out = x;
    return fractional(x) ? round_to(x, 3, out) : 0;
}

static int check_record(PyObject *rec, Py_ssize_t n, Py_ssize_t best) {
    if (!PyBytes_Check(rec) || n <= 0 || PyBytes_GET_SIZE(rec) != (Py_ssize_t)((size_t)n * N_COLS * 8)) {
        PyErr_SetString(PyExc_ValueError, "not a record of that many candidates");
        return -1;
    }
    if (best < 0 || best >= n) {
        PyErr_SetString(PyExc_ValueError, "the chosen candidate is not in the record");
        return -1;
    }
    return 0;
}

/* reasons(record, n, best, prefix, kv) -> bytes: each candidate's reason code (why it won or lost),
 * from the terms as shown; prefix: the decision's outcome is "prefix" */
static PyObject *reasons(PyObject *self, PyObject *args) {
    PyObject *rec;
    Py_ssize_t n, best;
    int prefix, kv;
    if (!PyArg_ParseTuple(args, "Onnpp", &rec, &n, &best, &prefix, &kv) || check_record(rec, n, best)) return NULL;
    const char *buf = PyBytes_AS_STRING(rec);
    const double *credit = COL_D(buf, n, C_CREDIT), *score_c = COL_D(buf, n, C_SCORE);
    const long long *matched = COL_L(buf, n, C_MATCHED);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) return NULL;
    char *codes = PyBytes_AS_STRING(out);
    double bc;
    if (shown(credit[best], &bc)) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        double c;
        if (!kv) {
            codes[i] = i == best ? R_CHOSEN : R_NOT_CHOSEN;
            continue;
        }
        if (i == best) {
            codes[i] = prefix ? R_PREFIX : R_LOAD;
            continue;
        }
        if (shown(credit[i], &c)) goto fail;
        if (matched[i] && c == 0) codes[i] = R_THRESHOLD;
        else if (c >= bc && score_c[i] > score_c[best]) codes[i] = R_BUSIER;
        else if (score_c[i] == score_c[best]) codes[i] = R_TIED;
        else codes[i] = R_COST;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* render(record, n, best, codes, names, ranks, media, offs, medium_names, policy, encode) -> bytes:
 * the candidates' JSON list as msgspec writes router/decision/policy.py's CandidateScore list
 * (names: each backend's JSON string; the rest as score() took them, and the medium names of offs'
 * columns; policy: the policy's name, for the reasons of the other policies) */
static PyObject *render(PyObject *self, PyObject *args) {
    PyObject *rec, *codes, *names, *ranks, *medial, *offsl, *mnames, *policy, *encode;
    Py_ssize_t n, best;
    if (!PyArg_ParseTuple(args, "OnnSO!O!OOO!SO", &rec, &n, &best, &codes, &PyList_Type, &names, &PyList_Type, &ranks,
                          &medial, &offsl, &PyTuple_Type, &mnames, &policy, &encode) ||
        check_record(rec, n, best))
        return NULL;
    if (PyBytes_GET_SIZE(codes) != n || PyList_GET_SIZE(names) != n || PyList_GET_SIZE(ranks) != n ||
        (medial != Py_None && (!PyList_Check(medial) || PyList_GET_SIZE(medial) != n)) ||
        (offsl != Py_None && (!PyList_Check(offsl) || PyList_GET_SIZE(offsl) != n))) {
        PyErr_SetString(PyExc_ValueError, "every per-candidate list must have one entry per candidate");
        return NULL;
    }
    /* (tuples: encode is a Python call, which could change a list) */
    PyObject *namest = PyList_AsTuple(names), *rankst = PyList_AsTuple(ranks);
    PyObject *mediat = medial != Py_None ? PyList_AsTuple(medial) : NULL;
    PyObject *offst = offsl != Py_None ? PyList_AsTuple(offsl) : NULL;
    PyObject *out = NULL;
    Buf b = {0};
    if (!namest || !rankst || (medial != Py_None && !mediat) || (offsl != Py_None && !offst)) goto done;
    const char *buf = PyBytes_AS_STRING(rec);
    const char *code = PyBytes_AS_STRING(codes);
    const double *credit = COL_D(buf, n, C_CREDIT), *prefill = COL_D(buf, n, C_PREFILL), *queued = COL_D(buf, n, C_QUEUED);
    const double *score_c = COL_D(buf, n, C_SCORE), *assumed = COL_D(buf, n, C_ASSUMED), *waiting = COL_D(buf, n, C_WAITING);
    const long long *matched = COL_L(buf, n, C_MATCHED), *active = COL_L(buf, n, C_ACTIVE);
    const long long *wflag = COL_L(buf, n, C_WFLAG), *wival = COL_L(buf, n, C_WIVAL);
    if (PUTS(&b, "[")) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(namest, i);
        if (!PyBytes_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "names must be bytes");
            goto done;
        }
        if ((i && PUTS(&b, ",")) || PUTS(&b, "{\"backend\":") ||
            put(&b, PyBytes_AS_STRING(name), (size_t)PyBytes_GET_SIZE(name)) || PUTS(&b, ",\"dp_rank\":") ||
            put_number(&b, PyTuple_GET_ITEM(rankst, i), encode) || PUTS(&b, ",\"matched_blocks\":") ||
            put_ll(&b, matched[i]) || PUTS(&b, ",\"blocks_by_medium\":{"))
            goto done;
        PyObject *by = mediat ? PyTuple_GET_ITEM(mediat, i) : Py_None;
        PyObject *row = offst ? PyTuple_GET_ITEM(offst, i) : Py_None;
        if (by != Py_None) {
            if (!PyDict_Check(by)) {
                PyErr_SetString(PyExc_TypeError, "media entries must be dicts or None");
                goto done;
            }
            Py_INCREF(by); /* (encode may run Python code that changes the dict) */
            Py_ssize_t pos = 0, k = 0;
            PyObject *key, *val;
            int bad = 0;
            while (!bad && PyDict_Next(by, &pos, &key, &val)) {
                Py_INCREF(key);
                Py_INCREF(val);
                bad = (k++ && PUTS(&b, ",")) || put_key(&b, key, encode) || PUTS(&b, ":") || put_number(&b, val, encode);
                Py_DECREF(key);
                Py_DECREF(val);
            }
            Py_DECREF(by);
            if (bad) goto done;
        } else if (row != Py_None && PyList_Check(row)) {
            Py_ssize_t nr = PyList_GET_SIZE(row);
            long long off = 0;
            for (Py_ssize_t k = 0; k < nr; k++) {
                long long v;
                if (get_ll(PyList_GET_ITEM(row, k), &v)) goto done;
                off += v;
            }
            if (PUTS(&b, "\"GPU\":") || put_ll(&b, matched[i] - off)) goto done;
            for (Py_ssize_t k = 0; k < nr; k++) {
                long long v;
                if (get_ll(PyList_GET_ITEM(row, k), &v)) goto done;
                if (!v) continue;
                if (k >= PyTuple_GET_SIZE(mnames)) {
                    PyErr_SetString(PyExc_ValueError, "a medium without a name");
                    goto done;
                }
                if (PUTS(&b, ",") || put_key(&b, PyTuple_GET_ITEM(mnames, k), encode) || PUTS(&b, ":") || put_ll(&b, v))
                    goto done;
            }
        } else if (PUTS(&b, "\"GPU\":") || put_ll(&b, matched[i])) {
            goto done;
        }
        double c, p, q, a;
        if (shown(credit[i], &c) || shown(prefill[i], &p) || shown(queued[i], &q) || shown(assumed[i], &a)) goto done;
        if (PUTS(&b, "},\"credit_blocks\":") || put_double(&b, c, encode) || PUTS(&b, ",\"prefill_blocks\":") ||
            put_double(&b, p, encode) || PUTS(&b, ",\"queued_blocks\":") || put_double(&b, q, encode) ||
            PUTS(&b, ",\"inflight\":") || put_ll(&b, active[i]) || PUTS(&b, ",\"engine_waiting\":") ||
            (wflag[i] ? put_ll(&b, wival[i]) : put_double(&b, waiting[i], encode)) || PUTS(&b, ",\"score\":") ||
            put_double(&b, score_c[i], encode) ||
            (i == best ? PUTS(&b, ",\"chosen\":true,\"reason\":\"") : PUTS(&b, ",\"chosen\":false,\"reason\":\"")))
            goto done;
        int rc;
        double bc;
        switch (code[i]) {
        case R_PREFIX:
            rc = PUTS(&b, "lowest cost; cached prefix saves ") || put_g(&b, c) || PUTS(&b, " of the prompt's blocks");
            break;
        case R_LOAD:
            rc = PUTS(&b, "lowest cost; placed by load");
            break;
        case R_THRESHOLD:
            rc = PUTS(&b, "its ") || put_ll(&b, matched[i]) || PUTS(&b, "-block match is below the minimum-match threshold");
            break;
        case R_BUSIER:
            rc = PUTS(&b, "more cached (") || put_g(&b, c) || PUTS(&b, " blocks) but busier (queued ") || put_g(&b, q) ||
                 PUTS(&b, " blocks, ") || put_ll(&b, active[i]) || PUTS(&b, " in flight)");
            break;
        case R_TIED:
            rc = PUTS(&b, "tied on cost; lost the random tie-break");
            break;
        case R_COST:
            bc = score_c[best];
            rc = PUTS(&b, "cost ") || put_g(&b, score_c[i]) || PUTS(&b, " vs ") || put_g(&b, bc);
            break;
        case R_CHOSEN:
            rc = put(&b, PyBytes_AS_STRING(policy), (size_t)PyBytes_GET_SIZE(policy)) || PUTS(&b, ": chosen");
            break;
        default:
            rc = put(&b, PyBytes_AS_STRING(policy), (size_t)PyBytes_GET_SIZE(policy)) || PUTS(&b, ": not chosen");
        }
        if (rc || PUTS(&b, "\",\"assumed_blocks\":") || put_double(&b, a, encode) || PUTS(&b, "}")) goto done;
    }
    if (PUTS(&b, "]")) goto done;
    out = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.n);
done:
    PyMem_Free(b.p);
    Py_XDECREF(namest);
    Py_XDECREF(rankst);
    Py_XDECREF(mediat);
    Py_XDECREF(offst);
    return out;
}

/* top(record, n, best, k) -> list: the chosen candidate, then up to k - 1 others from the lowest
 * score (ties: the first in order), what a kept decision shows of its candidates */
static PyObject *top(PyObject *self, PyObject *args) {
    PyObject *rec;
    Py_ssize_t n, best, k;
    if (!PyArg_ParseTuple(args, "Onnn", &rec, &n, &best, &k) || check_record(rec, n, best)) return NULL;
    if (k < 1) k = 1;
    if (k > n) k = n;
    const double *score_c = COL_D(PyBytes_AS_STRING(rec), n, C_SCORE);
    Py_ssize_t *pick = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)k);
    if (!pick) return PyErr_NoMemory();
    Py_ssize_t m = 0;
    pick[m++] = best;
    for (Py_ssize_t i = 0; i < n; i++) { /* insertion into the k - 1 best so far: O(n k) */
        if (i == best) continue;
        Py_ssize_t at = m;
        while (at > 1 && score_c[pick[at - 1]] > score_c[i]) at--;
        if (at >= k) continue;
        if (m < k) m++;
        for (Py_ssize_t j = m - 1; j > at; j--) pick[j] = pick[j - 1];
        pick[at] = i;
    }
    PyObject *out = PyList_New(m);
    for (Py_ssize_t j = 0; out && j < m; j++) {
        PyObject *v = PyLong_FromSsize_t(pick[j]);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, j, v);
    }
    PyMem_Free(pick);
    return out;
}

/* gather(out, table, base, stride, rows, skip, slots): other routers' figures per candidate, added
 * into ``out`` (a writable buffer of three int64 per candidate: active, prefilling, pending).
 * ``table`` is int64 cells: candidate i's figures are the ``rows`` triples at
 * ``base + slots[i] * stride + r * 3`` (r != skip), ``slots`` int64 per candidate (-1: none).
 * One pass in C over what the peers' shares already keep per target: a decision reads the fleet's
 * peer load without a Python object per candidate. */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *outo, *tableo, *slotso;
    Py_ssize_t base, stride, rows, skip;
    if (!PyArg_ParseTuple(args, "OOnnnnO", &outo, &tableo, &base, &stride, &rows, &skip, &slotso)) return NULL;
    Py_buffer out, table, slots;
    if (PyObject_GetBuffer(outo, &out, PyBUF_WRITABLE)) return NULL;
    if (PyObject_GetBuffer(tableo, &table, PyBUF_SIMPLE)) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (PyObject_GetBuffer(slotso, &slots, PyBUF_SIMPLE)) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&table);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = slots.len / 8, cells = table.len / 8;
    if (slots.len % 8 || out.len != n * 24 || base < 0 || stride < 0 || rows < 0 || rows * 3 > stride) {
        PyErr_SetString(PyExc_ValueError, "gather: out must hold three int64 per slot entry; rows within stride");
        goto done;
    }
    long long *o = (long long *)out.buf;
    const long long *t = (const long long *)table.buf, *sl = (const long long *)slots.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s = sl[i];
        if (s < 0) continue;
        Py_ssize_t room = cells - base - rows * 3; /* (the last slot's rows must end within the table) */
        if (room < 0 || (stride ? s > room / stride : 0)) {
            PyErr_SetString(PyExc_IndexError, "gather: slot past the table");
            goto done;
        }
        const long long *row = t + base + s * stride;
        long long a = 0, b = 0, c = 0;
        for (Py_ssize_t r = 0; r < rows; r++) {
            if (r == skip) continue;
            a += row[r * 3];
            b += row[r * 3 + 1];
            c += row[r * 3 + 2];
        }
        o[i * 3] += a;
        o[i * 3 + 1] += b;
        o[i * 3 + 2] += c;
    }
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&table);
    PyBuffer_Release(&slots);
    return ret;
}

/* take(record, n, picked) -> bytes: the record of the candidates at ``picked`` (a list of
 * positions), in that order: the kept record of a decision without a slice per cell */
static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *rec, *picked;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO!", &rec, &n, &PyList_Type, &picked) || check_record(rec, n, 0)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(picked);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((size_t)k * N_COLS * 8));
    if (!out) return NULL;
    const long long *src = (const long long *)PyBytes_AS_STRING(rec);
    long long *dst = (long long *)PyBytes_AS_STRING(out);
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(picked, j));
        if (i == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (i < 0 || i >= n) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_IndexError, "take: position past the record");
            return NULL;
        }
        for (int c = 0; c < N_COLS; c++) dst[(size_t)c * (size_t)k + (size_t)j] = src[(size_t)c * (size_t)n + (size_t)i];
    }
    return out;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, "add other routers' figures per candidate into a buffer"},
    {"take", take, METH_VARARGS, "the record of some candidates"},
    {"score", score, METH_VARARGS, "every candidate's cost and the choice: (record, best, prefix, inflight)"},
    {"reasons", reasons, METH_VARARGS, "each candidate's reason code"},
    {"render", render, METH_VARARGS, "the candidates' JSON list"},
    {"top", top, METH_VARARGS, "the chosen candidate, then the lowest scores"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernel", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernel(void) {
#define INTERN(var, s)                                 \
    if (!(var = PyUnicode_InternFromString(s))) return NULL
    INTERN(S_GPU, "GPU");
    INTERN(S_CPU, "CPU");
    INTERN(S_STORAGE, "STORAGE");
    INTERN(S_PREDICTED, "PREDICTED");
    INTERN(S_PENDING, "pending_prefill_tokens");
    INTERN(S_ACTIVE, "active");
    INTERN(S_WAITING, "engine_waiting");
    INTERN(S_CHOICE, "choice");
    INTERN(S_CHOICES, "choices");
    INTERN(S_RANDRANGE, "randrange");
    INTERN(S_WEIGHTS, "weights");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "COLUMNS", N_COLS)) return NULL;
    return m;
}
