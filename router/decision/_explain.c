/* The explained KV decision of a /route, scored and written as JSON in one compiled pass.
 *
 * What it computes is router/decision/policy.py's kv policy (Policy.choose with temperature 0,
 * then explain()) and the JSON is what msgspec writes for router/decision/service.py's RouteView,
 * byte for byte: tests/test_explain_kernel.py compares the two over many random fleets. The
 * Python policy stays the reference and serves every other case (RouterService.explain_json_now
 * in router/decision/service.py says which); this exists because the per-candidate Python objects
 * of an explained decision were most of a /route's cost in the running service.
 *
 * Floating point follows Python's order of operations (compiled with -ffp-contract=off, so no
 * fused multiply-add changes a rounding); round(x, 3) and format(x, "g") use CPython's own
 * correctly rounded conversions; floats outside [1e-4, 1e16) and anything not a plain int or float
 * are written by the encoder passed in (msgspec's), whose layout differs from repr() there. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>
#include <time.h>

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

/* round(x, digits) written as repr() writes it (the timings): for one digit and 0 <= x < 1e9, k / 10
 * for the nearest k, computed directly when x * 10 is far from a tie (its rounding error, below
 * 1e-6 there, cannot change k; the double nearest k / 10 reads as exactly those digits); CPython's
 * conversions otherwise (-0.0 keeps its sign there) */
static int put_rounded(Buf *b, double x, int digits, PyObject *encode) {
    static const double p10[] = {1, 10, 100, 1000};
    if (digits == 1 && !signbit(x) && x < 1e9) {
        double y = x * p10[digits], f = y - floor(y);
        if (fabs(f - 0.5) > 1e-6) {
            long long k = (long long)floor(y + 0.5), ip = k / (long long)p10[digits];
            int fr = (int)(k % (long long)p10[digits]), nd = digits;
            while (nd > 1 && fr % 10 == 0) {
                fr /= 10;
                nd--;
            }
            char t[8];
            for (int i = nd - 1; i >= 0; i--) {
                t[i] = (char)('0' + fr % 10);
                fr /= 10;
            }
            return put_ll(b, ip) || PUTS(b, ".") || put(b, t, (size_t)nd);
        }
    }
    double r;
    return round_to(x, digits, &r) || put_double(b, r, encode);
}

/* Python's ``x % 1`` is non-zero (or NaN) */
static int fractional(double x) {
    double r = fmod(x, 1.0);
    return r != 0.0 || isnan(r);
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

static double now_s(clockid_t clock) { /* (the timestamp: time.time()'s clock) */
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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

static PyObject *S_GPU, *S_CPU, *S_STORAGE, *S_PREDICTED, *S_PENDING, *S_ACTIVE, *S_WAITING, *S_CHOICE;

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

typedef struct {
    double credit, prefill, queued, waiting, score;
    PyObject *active; /* borrowed from the load, kept alive by the loads list */
    PyObject *waiting_obj;
} Score;

/* explain_kv(head, names, ranks, matched, media, loads, params, rng, encode, clock, t0, t1, t2) -> bytes
 *
 * head: the JSON of '{"model":...,"endpoint":...,' (the caller encodes the request's strings);
 * names[i]: the JSON string of target i's backend; ranks, matched: its DP rank and matched blocks;
 * media[i]: its blocks by medium (a dict, {} when the index holds no match entry for it; None for
 * {"GPU": matched[i]});
 * loads[i]: its TargetLoad; params: (prompt_tokens, prompt_blocks, block_size, gpu_credit,
 * cpu_credit, storage_credit, predicted_credit, min_match_blocks, min_match_ratio, load_weight,
 * decode_weight, waiting_weight); rng: the policy's random.Random (its choice() breaks ties, as
 * Policy._pick calls it); clock: time.perf_counter; t0, t1, t2: its readings at the decision's
 * start, after tokenizing, after matching. */
static PyObject *explain_kv(PyObject *self, PyObject *args) {
    PyObject *head, *lists[5], *rng, *encode, *clock;
    long long prompt_tokens, prompt_blocks, block_size, min_blocks_cfg;
    double gpu, cpu, storage, predicted, min_ratio_cfg, load_weight, decode_weight, waiting_weight;
    double t0, t1, t2;
    if (!PyArg_ParseTuple(args, "SO!O!O!O!O!(LLLddddLdddd)OOOddd", &head, &PyList_Type, &lists[0], &PyList_Type,
                          &lists[1], &PyList_Type, &lists[2], &PyList_Type, &lists[3], &PyList_Type, &lists[4],
                          &prompt_tokens, &prompt_blocks, &block_size, &gpu, &cpu, &storage, &predicted,
                          &min_blocks_cfg, &min_ratio_cfg, &load_weight, &decode_weight, &waiting_weight, &rng,
                          &encode, &clock, &t0, &t1, &t2))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(lists[0]);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no candidates");
        return NULL;
    }
    for (int l = 1; l < 5; l++)
        if (PyList_GET_SIZE(lists[l]) != n) {
            PyErr_SetString(PyExc_ValueError, "every per-target list must have one entry per target");
            return NULL;
        }
    /* tuples of the lists: rng.choice and encode are Python calls, which could change a list */
    PyObject *names = PyList_AsTuple(lists[0]), *ranks = PyList_AsTuple(lists[1]);
    PyObject *matchedl = PyList_AsTuple(lists[2]), *media = PyList_AsTuple(lists[3]);
    PyObject *loads = PyList_AsTuple(lists[4]);
    Score *sc = PyMem_Calloc((size_t)n, sizeof(Score));
    Buf b = {0};
    PyObject *loadrefs = PyList_New(0); /* the load attributes read, kept alive until written */
    PyObject *out = NULL, *ties = NULL, *pick = NULL, *bsobj = NULL;
    if (!names || !ranks || !matchedl || !media || !loads || !loadrefs) goto done;
    if (!sc) {
        PyErr_NoMemory();
        goto done;
    }
    double bs = block_size > 1 ? (double)block_size : 1.0;
    long long min_blocks = min_blocks_cfg > 1 ? min_blocks_cfg : 1;
    double min_ratio = prompt_blocks ? min_ratio_cfg * (double)prompt_blocks : 0.0;
    /* --- Policy.choose: every candidate's terms and cost */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *by = PyTuple_GET_ITEM(media, i);
        PyObject *load = PyTuple_GET_ITEM(loads, i);
        int all_gpu = by == Py_None;
        if (!all_gpu && !PyDict_Check(by)) {
            PyErr_SetString(PyExc_TypeError, "media entries must be dicts or None");
            goto done;
        }
        long long matched = PyLong_AsLongLong(PyTuple_GET_ITEM(matchedl, i));
        if (matched == -1 && PyErr_Occurred()) goto done;
        Score *s = &sc[i];
        double credit = 0.0, g = (double)matched, c = 0.0, st = 0.0, pr = 0.0;
        if (!all_gpu && medium(by, S_PREDICTED, &pr)) goto done;
        if (matched >= min_blocks && (double)matched >= min_ratio) {
            if (!all_gpu && (medium(by, S_GPU, &g) || medium(by, S_CPU, &c) || medium(by, S_STORAGE, &st)))
                goto done;
            credit = gpu * g + cpu * c + storage * st + predicted * pr;
        }
        double prefill = (double)prompt_blocks > credit ? (double)prompt_blocks - credit : 0.0;
        PyObject *pending_o = PyObject_GetAttr(load, S_PENDING);
        PyObject *active_o = pending_o ? PyObject_GetAttr(load, S_ACTIVE) : NULL;
        PyObject *waiting_o = active_o ? PyObject_GetAttr(load, S_WAITING) : NULL;
        int bad = !waiting_o || PyList_Append(loadrefs, pending_o) || PyList_Append(loadrefs, active_o) ||
                  PyList_Append(loadrefs, waiting_o);
        Py_XDECREF(pending_o);
        Py_XDECREF(active_o);
        Py_XDECREF(waiting_o);
        if (bad) goto done;
        double active, waiting, queued = 0.0;
        if (as_double(active_o, &active) || as_double(waiting_o, &waiting)) goto done;
        if (PyFloat_CheckExact(pending_o)) {
            double pending = PyFloat_AS_DOUBLE(pending_o);
            if (pending != 0.0) queued = pending / bs;
        } else {
            /* pending / bs: exact for an int that a double holds exactly, else Python's own true
             * division (an int quotient is rounded once, not after the int's own rounding) */
            int overflow = 0, is_int = PyLong_CheckExact(pending_o);
            long long p = is_int ? PyLong_AsLongLongAndOverflow(pending_o, &overflow) : 0;
            if (p == -1 && PyErr_Occurred()) goto done;
            if (is_int && !overflow && p >= -(1LL << 53) && p <= (1LL << 53)) {
                if (p) queued = (double)p / bs;
            } else {
                int truth = PyObject_IsTrue(pending_o);
                if (truth < 0) goto done;
                if (truth) {
                    if (!bsobj && !(bsobj = PyLong_FromLongLong(block_size > 1 ? block_size : 1))) goto done;
                    PyObject *q = PyNumber_TrueDivide(pending_o, bsobj);
                    if (!q) goto done;
                    int bad_q = as_double(q, &queued);
                    Py_DECREF(q);
                    if (bad_q) goto done;
                }
            }
        }
        if (credit != 0.0) {
            double q = queued - pr;
            queued = 0.0 > q ? 0.0 : q;
        }
        double assumed = 0.0;
        double cost = prefill + load_weight * (queued + decode_weight * active + waiting_weight * waiting + assumed);
        double score = cost;
        if (fractional(cost) && round_to(cost, 3, &score)) goto done;
        s->credit = credit;
        s->prefill = prefill;
        s->queued = queued;
        s->waiting = waiting;
        s->score = score;
        s->active = active_o;
        s->waiting_obj = waiting_o;
    }
    /* --- Policy._pick: the lowest cost, ties broken by rng.choice over their indices */
    double lo = sc[0].score;
    for (Py_ssize_t i = 1; i < n; i++)
        if (sc[i].score < lo) lo = sc[i].score;
    ties = PyList_New(0);
    if (!ties) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (sc[i].score == lo) {
            PyObject *k = PyLong_FromSsize_t(i);
            if (!k || PyList_Append(ties, k)) {
                Py_XDECREF(k);
                goto done;
            }
            Py_DECREF(k);
        }
    pick = PyObject_CallMethodOneArg(rng, S_CHOICE, ties);
    if (!pick) goto done;
    Py_ssize_t best = PyLong_AsSsize_t(pick);
    if (best == -1 && PyErr_Occurred()) goto done;
    if (best < 0 || best >= n) {
        PyErr_SetString(PyExc_ValueError, "rng.choice returned no candidate");
        goto done;
    }
    double min_credit = sc[0].credit;
    for (Py_ssize_t i = 1; i < n; i++)
        if (sc[i].credit < min_credit) min_credit = sc[i].credit;
    int prefix = sc[best].credit > 0 && sc[best].credit > min_credit;
    PyObject *t3o = PyObject_CallNoArgs(clock); /* time.perf_counter(), the clock of t0..t2 */
    double t3 = t3o ? PyFloat_AsDouble(t3o) : -1.0;
    Py_XDECREF(t3o);
    if (t3 == -1.0 && PyErr_Occurred()) goto done;
    /* --- explain(): the shown terms rounded, then the reasons from them */
    for (Py_ssize_t i = 0; i < n; i++) {
        Score *s = &sc[i];
        if (fractional(s->credit) && round_to(s->credit, 3, &s->credit)) goto done;
        if (fractional(s->prefill) && round_to(s->prefill, 3, &s->prefill)) goto done;
        if (fractional(s->queued) && round_to(s->queued, 3, &s->queued)) goto done;
    }
    /* --- RouteView as msgspec encodes it */
    long long best_matched = PyLong_AsLongLong(PyTuple_GET_ITEM(matchedl, best));
    if (best_matched == -1 && PyErr_Occurred()) goto done;
    if (put(&b, PyBytes_AS_STRING(head), (size_t)PyBytes_GET_SIZE(head)) || PUTS(&b, "\"backend\":")) goto done;
    PyObject *bname = PyTuple_GET_ITEM(names, best);
    if (!PyBytes_Check(bname)) {
        PyErr_SetString(PyExc_TypeError, "names must be bytes");
        goto done;
    }
    if (put(&b, PyBytes_AS_STRING(bname), (size_t)PyBytes_GET_SIZE(bname)) || PUTS(&b, ",\"dp_rank\":") ||
        put_number(&b, PyTuple_GET_ITEM(ranks, best), encode) || PUTS(&b, ",\"outcome\":") ||
        (prefix ? PUTS(&b, "\"prefix\"") : PUTS(&b, "\"load\"")) || PUTS(&b, ",\"prompt_tokens\":") ||
        put_ll(&b, prompt_tokens) || PUTS(&b, ",\"prompt_blocks\":") || put_ll(&b, prompt_blocks) ||
        PUTS(&b, ",\"block_size\":") || put_ll(&b, block_size) || PUTS(&b, ",\"matched_blocks\":") ||
        put_ll(&b, best_matched) || PUTS(&b, ",\"candidates\":["))
        goto done;
    Score *bs_ = &sc[best];
    for (Py_ssize_t i = 0; i < n; i++) {
        Score *s = &sc[i];
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *by = PyTuple_GET_ITEM(media, i);
        PyObject *mo = PyTuple_GET_ITEM(matchedl, i);
        if (!PyBytes_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "names must be bytes");
            goto done;
        }
        if ((i && PUTS(&b, ",")) || PUTS(&b, "{\"backend\":") ||
            put(&b, PyBytes_AS_STRING(name), (size_t)PyBytes_GET_SIZE(name)) || PUTS(&b, ",\"dp_rank\":") ||
            put_number(&b, PyTuple_GET_ITEM(ranks, i), encode) || PUTS(&b, ",\"matched_blocks\":") ||
            put_number(&b, mo, encode) || PUTS(&b, ",\"blocks_by_medium\":{"))
            goto done;
        if (by == Py_None) {
            if (PUTS(&b, "\"GPU\":") || put_number(&b, mo, encode)) goto done;
        } else {
            Py_ssize_t pos = 0, k = 0;
            PyObject *key, *val;
            while (PyDict_Next(by, &pos, &key, &val)) {
                Py_INCREF(key); /* (encode may run Python code that changes the dict) */
                Py_INCREF(val);
                int bad = (k++ && PUTS(&b, ",")) || put_key(&b, key, encode) || PUTS(&b, ":") ||
                          put_number(&b, val, encode);
                Py_DECREF(key);
                Py_DECREF(val);
                if (bad) goto done;
            }
        }
        if (PUTS(&b, "},\"credit_blocks\":") || put_double(&b, s->credit, encode) ||
            PUTS(&b, ",\"prefill_blocks\":") || put_double(&b, s->prefill, encode) ||
            PUTS(&b, ",\"queued_blocks\":") || put_double(&b, s->queued, encode) || PUTS(&b, ",\"inflight\":") ||
            put_number(&b, s->active, encode) || PUTS(&b, ",\"engine_waiting\":") ||
            put_number(&b, s->waiting_obj, encode) || PUTS(&b, ",\"score\":") || put_double(&b, s->score, encode) ||
            (i == best ? PUTS(&b, ",\"chosen\":true,\"reason\":\"") : PUTS(&b, ",\"chosen\":false,\"reason\":\"")))
            goto done;
        long long matched = PyLong_AsLongLong(mo);
        if (matched == -1 && PyErr_Occurred()) goto done;
        int rc;
        if (i == best) {
            if (prefix)
                rc = PUTS(&b, "lowest cost; cached prefix saves ") || put_g(&b, s->credit) ||
                     PUTS(&b, " of the prompt's blocks");
            else
                rc = PUTS(&b, "lowest cost; placed by load");
        } else if (matched && s->credit == 0) {
            rc = PUTS(&b, "its ") || put_ll(&b, matched) || PUTS(&b, "-block match is below the minimum-match threshold");
        } else if (s->credit >= bs_->credit && s->score > bs_->score) {
            rc = PUTS(&b, "more cached (") || put_g(&b, s->credit) || PUTS(&b, " blocks) but busier (queued ") ||
                 put_g(&b, s->queued) || PUTS(&b, " blocks, ") || put_str(&b, s->active) || PUTS(&b, " in flight)");
        } else if (s->score == bs_->score) {
            rc = PUTS(&b, "tied on cost; lost the random tie-break");
        } else {
            rc = PUTS(&b, "cost ") || put_g(&b, s->score) || PUTS(&b, " vs ") || put_g(&b, bs_->score);
        }
        if (rc || PUTS(&b, "\",\"assumed_blocks\":0.0}")) goto done;
    }
    if (PUTS(&b, "],\"tokenize_error\":null,\"timings_us\":{\"tokenize\":") ||
        put_rounded(&b, (t1 - t0) * 1e6, 1, encode) || PUTS(&b, ",\"match\":") ||
        put_rounded(&b, (t2 - t1) * 1e6, 1, encode) || PUTS(&b, ",\"policy\":") ||
        put_rounded(&b, (t3 - t2) * 1e6, 1, encode) || PUTS(&b, ",\"total\":") ||
        put_rounded(&b, (t3 - t0) * 1e6, 1, encode) ||
        PUTS(&b, ",\"held\":0.0},\"time\":") || put_double(&b, now_s(CLOCK_REALTIME), encode) ||
        PUTS(&b, ",\"policy\":\"kv\",\"affinity\":\"\",\"pd\":null,\"kv_groups\":null}"))
        goto done;
    out = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.n);
done:
    PyMem_Free(sc);
    PyMem_Free(b.p);
    Py_XDECREF(names);
    Py_XDECREF(ranks);
    Py_XDECREF(matchedl);
    Py_XDECREF(media);
    Py_XDECREF(loads);
    Py_XDECREF(bsobj);
    Py_XDECREF(loadrefs);
    Py_XDECREF(ties);
    Py_XDECREF(pick);
    return out;
}

static PyMethodDef methods[] = {
    {"explain_kv", explain_kv, METH_VARARGS, "the explained kv decision of a /route, as JSON bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_explain", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__explain(void) {
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
#undef INTERN
    return PyModule_Create(&module);
}
