/* The fused ingest of index/_kvcore.c: vLLM KV event payloads parsed and applied in one C call.
 *
 * Included by _kvcore.c (shares its static functions). Every read is bounds-checked against the
 * payload's end; a payload is fully validated (pass 1) before anything is applied (pass 2), so a
 * payload handed back to Python ("punted") has changed nothing.
 */

#define SCRATCH_KEEP (1 << 20) /* scratch entries (8 bytes each) kept between calls, at most */

/* ---- bounded msgpack reading ---- */
typedef const uint8_t *P;

static inline u64 be(P p, int n) {
    u64 v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* a container header: returns the position after it, *n its count; NULL when not that container */
static P rd_array(P p, P end, u64 *n) {
    if (p >= end) return NULL;
    uint8_t b = *p;
    if (b >= 0x90 && b <= 0x9F) {
        *n = b & 0x0F;
        return p + 1;
    }
    if (b == 0xDC && end - p >= 3) {
        *n = be(p + 1, 2);
        return p + 3;
    }
    if (b == 0xDD && end - p >= 5) {
        *n = be(p + 1, 4);
        return p + 5;
    }
    return NULL;
}

static P rd_map(P p, P end, u64 *n) {
    if (p >= end) return NULL;
    uint8_t b = *p;
    if (b >= 0x80 && b <= 0x8F) {
        *n = b & 0x0F;
        return p + 1;
    }
    if (b == 0xDE && end - p >= 3) {
        *n = be(p + 1, 2);
        return p + 3;
    }
    if (b == 0xDF && end - p >= 5) {
        *n = be(p + 1, 4);
        return p + 5;
    }
    return NULL;
}

/* a string: *s and *len; NULL when not a string (or truncated) */
static P rd_str(P p, P end, P *s, u64 *len) {
    if (p >= end) return NULL;
    uint8_t b = *p;
    u64 n;
    int h;
    if (b >= 0xA0 && b <= 0xBF) {
        n = b & 0x1F;
        h = 1;
    } else if (b >= 0xD9 && b <= 0xDB) {
        int sz = 1 << (b - 0xD9);
        if (end - p < 1 + sz) return NULL;
        n = be(p + 1, sz);
        h = 1 + sz;
    } else
        return NULL;
    if ((u64)(end - p - h) < n) return NULL;
    *s = p + h;
    *len = n;
    return p + h + n;
}

/* binary data */
static P rd_bin(P p, P end, P *s, u64 *len) {
    if (p >= end) return NULL;
    uint8_t b = *p;
    if (b < 0xC4 || b > 0xC6) return NULL;
    int sz = 1 << (b - 0xC4);
    if (end - p < 1 + sz) return NULL;
    u64 n = be(p + 1, sz);
    if ((u64)(end - p - 1 - sz) < n) return NULL;
    *s = p + 1 + sz;
    *len = n;
    return p + 1 + sz + n;
}

/* an int: *v its value when not negative, *neg set when negative; NULL when not an int */
static P rd_int(P p, P end, u64 *v, int *neg) {
    if (p >= end) return NULL;
    uint8_t b = *p;
    *neg = 0;
    if (b <= 0x7F) {
        *v = b;
        return p + 1;
    }
    if (b >= 0xE0) {
        *neg = 1;
        *v = 0;
        return p + 1;
    }
    if (b >= 0xCC && b <= 0xCF) {
        int sz = 1 << (b - 0xCC);
        if (end - p < 1 + sz) return NULL;
        *v = be(p + 1, sz);
        return p + 1 + sz;
    }
    if (b >= 0xD0 && b <= 0xD3) {
        int sz = 1 << (b - 0xD0);
        if (end - p < 1 + sz) return NULL;
        u64 raw = be(p + 1, sz);
        if (raw >> (8 * sz - 1)) {
            *neg = 1;
            *v = 0;
        } else
            *v = raw;
        return p + 1 + sz;
    }
    return NULL;
}

static inline int is_ascii(P s, u64 len) {
    for (u64 i = 0; i < len; i++)
        if (s[i] & 0x80) return 0;
    return 1;
}

static inline int is_nil(P p, P end) { return p < end && *p == 0xC0; }

/* the position after the value at p (containers included); NULL when malformed */
static P rd_skip(P p, P end) {
    u64 need = 1;
    while (need) {
        if (p >= end) return NULL;
        need--;
        uint8_t b = *p;
        u64 n = 0;
        if (b <= 0x7F || b >= 0xE0 || b == 0xC0 || b == 0xC2 || b == 0xC3) {
            p += 1;
            continue;
        }
        if (b <= 0x8F) {
            n = 2 * (u64)(b & 0x0F);
            p += 1;
        } else if (b <= 0x9F) {
            n = b & 0x0F;
            p += 1;
        } else if (b <= 0xBF) {
            u64 len = b & 0x1F;
            if ((u64)(end - p - 1) < len) return NULL;
            p += 1 + len;
            continue;
        } else if (b == 0xC1) {
            return NULL;
        } else if (b <= 0xC6 || (b >= 0xD9 && b <= 0xDB)) { /* bin8-32, str8-32 */
            int sz = 1 << (b <= 0xC6 ? b - 0xC4 : b - 0xD9);
            if (end - p < 1 + sz) return NULL;
            u64 len = be(p + 1, sz);
            if ((u64)(end - p - 1 - sz) < len) return NULL;
            p += 1 + sz + len;
            continue;
        } else if (b <= 0xC9) { /* ext8-32: length, type, data */
            int sz = 1 << (b - 0xC7);
            if (end - p < 2 + sz) return NULL;
            u64 len = be(p + 1, sz);
            if ((u64)(end - p - 2 - sz) < len) return NULL;
            p += 2 + sz + len;
            continue;
        } else if (b == 0xCA || b == 0xCB) {
            int sz = b == 0xCA ? 4 : 8;
            if (end - p < 1 + sz) return NULL;
            p += 1 + sz;
            continue;
        } else if (b <= 0xD3) { /* uint8-64, int8-64 */
            int sz = 1 << ((b - 0xCC) & 3);
            if (end - p < 1 + sz) return NULL;
            p += 1 + sz;
            continue;
        } else if (b <= 0xD8) { /* fixext 1-16 */
            int sz = 1 << (b - 0xD4);
            if (end - p < 2 + sz) return NULL;
            p += 2 + sz;
            continue;
        } else { /* 0xDC-0xDF: array16/32, map16/32 */
            int sz = (b == 0xDC || b == 0xDE) ? 2 : 4;
            if (end - p < 1 + sz) return NULL;
            n = be(p + 1, sz);
            if (b >= 0xDE) n *= 2;
            p += 1 + sz;
        }
        if (n > (u64)(end - p)) return NULL; /* each value takes a byte at least */
        need += n;
        if (need > (u64)(end - p)) return NULL;
    }
    return p;
}

static inline int str_is(P s, u64 len, const char *lit) {
    size_t n = strlen(lit);
    return len == n && memcmp(s, lit, n) == 0;
}

/* ---- events ---- */
enum { EV_STORED, EV_REMOVED, EV_CLEARED, EV_PLACEHOLDER };

typedef struct {
    int kind;
    int medium;
    i64 bs;
    int has_parent;
    u64 parent;
    size_t h0, nh; /* hashes in scratch */
    size_t t0, nt; /* tokens in scratch */
    int group;     /* KV cache group, 0 when none is given */
    int grouped;   /* a group other than 0, or of another kind than full attention: a hybrid model's */
    P gkind;       /* its kind (NULL: none given) */
    u64 gkind_len;
    i64 gwin; /* its window, -1 when none is given */
} Ev;

typedef struct {
    u64 *buf;
    size_t used, cap;
    Ev *evs;
    size_t nev, evcap;
} Parse;

/* a hash (uint or non-empty bin: its last 8 bytes, big-endian); 0 ok, -1 punt */
static P rd_hash(P p, P end, u64 *v) {
    int neg;
    P q = rd_int(p, end, v, &neg);
    if (q) return neg ? NULL : q;
    P s;
    u64 len;
    q = rd_bin(p, end, &s, &len);
    if (!q || len == 0) return NULL;
    u64 k = len < 8 ? len : 8;
    *v = be(s + len - k, (int)k);
    return q;
}

static P rd_hashes(P p, P end, Parse *ps, size_t *h0, size_t *nh) {
    u64 n;
    p = rd_array(p, end, &n);
    if (!p || n > (u64)(end - p) || ps->used + n > ps->cap) return NULL;
    *h0 = ps->used;
    for (u64 i = 0; i < n; i++) {
        p = rd_hash(p, end, &ps->buf[ps->used]);
        if (!p) return NULL;
        ps->used++;
    }
    *nh = (size_t)n;
    return p;
}

/* a token id's msgpack form by its first byte: bytes taken (0: not an unsigned int) and the shift of
 * the 8 bytes after the tag that leaves its value (positive fixint: the tag is the value) */
static const uint8_t TOK_LEN[256] = {
    [0x00 ... 0x7F] = 1, [0xCC] = 2, [0xCD] = 3, [0xCE] = 5, [0xCF] = 9,
};
static const uint8_t TOK_SHIFT[256] = {[0xCC] = 56, [0xCD] = 48, [0xCE] = 32, [0xCF] = 0};

static P rd_tokens(P p, P end, Parse *ps, size_t *t0, size_t *nt) {
    u64 n;
    p = rd_array(p, end, &n);
    if (!p || n > (u64)(end - p) || ps->used + n > ps->cap) return NULL;
    *t0 = ps->used;
    u64 *out = ps->buf + ps->used;
    u64 i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* While 9 bytes remain, every unsigned form is read the same way: the 8 bytes after its tag,
     * big-endian, shifted by the tag's width. Ids below and above 65,536 alternate at random in
     * a prompt (vocabularies of 128k-152k), so a branch on the tag was mispredicted about every
     * other token: this loop has none but the one that leaves it (any other tag: the loop below). */
    while (i < n && end - p >= 9) {
        uint8_t b = *p;
        uint8_t len = TOK_LEN[b];
        if (!len) break;
        u64 w;
        memcpy(&w, p + 1, 8);
        w = __builtin_bswap64(w) >> TOK_SHIFT[b];
        out[i++] = b < 0x80 ? b : w;
        p += len;
    }
#endif
    for (; i < n; i++) {
        if (p >= end) return NULL;
        uint8_t b = *p;
        if (b <= 0x7F) { /* the usual small ids first */
            out[i] = b;
            p++;
            continue;
        }
        if (b == 0xCD && end - p >= 3) { /* uint16: most vocabularies */
            out[i] = ((u64)p[1] << 8) | p[2];
            p += 3;
            continue;
        }
        if (b == 0xCE && end - p >= 5) { /* uint32 */
            out[i] = ((u64)p[1] << 24) | ((u64)p[2] << 16) | ((u64)p[3] << 8) | p[4];
            p += 5;
            continue;
        }
        int neg;
        p = rd_int(p, end, &out[i], &neg);
        if (!p || neg) return NULL; /* negative ids: the Python path counts the event as bad */
    }
    ps->used += n;
    *nt = (size_t)n;
    return p;
}

/* a medium name: its index among the store's media; -1 when not registered (punt) */
static int medium_of(Store *s, P p, P end, P *after) {
    if (is_nil(p, end)) {
        *after = p + 1;
        return 0;
    }
    P str;
    u64 len;
    P q = rd_str(p, end, &str, &len);
    if (!q || !is_ascii(str, len)) return -1;
    *after = q;
    if (len == 0) return 0; /* `medium or "GPU"` */
    for (int m = 0; m < s->nm; m++)
        if ((u64)s->media_len[m] == len && memcmp(s->media[m], str, len) == 0) return m;
    return -1;
}

/* extra_keys: nil, or an array whose items are all nil or empty arrays (no salt); else punt */
static P rd_plain_extras(P p, P end) {
    if (is_nil(p, end)) return p + 1;
    u64 n;
    p = rd_array(p, end, &n);
    if (!p || n > (u64)(end - p)) return NULL;
    for (u64 i = 0; i < n; i++) {
        if (is_nil(p, end)) {
            p++;
            continue;
        }
        u64 k;
        P q = rd_array(p, end, &k);
        if (!q || k) return NULL;
        p = q;
    }
    return p;
}

enum { F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP, F_KIND, F_WINDOW, F_LOCALITY, F_N };

/* the fields of an event, by position (legacy arrays) or by name (maps): positions of the values */
/* `pre`: the hashes and tokens were parsed already (map events parse them while walking the keys) */
static int stored_from(Store *s, Parse *ps, P *f, P end, Ev *ev, int pre) {
    if (!f[F_HASHES] || !f[F_PARENT] || !f[F_TOKENS] || !f[F_BS]) return -1;
    if (!(pre & 1) && !rd_hashes(f[F_HASHES], end, ps, &ev->h0, &ev->nh)) return -1;
    P p = f[F_PARENT];
    if (is_nil(p, end)) ev->has_parent = 0;
    else {
        if (!rd_hash(p, end, &ev->parent)) return -1;
        ev->has_parent = 1;
    }
    if (!(pre & 2) && !rd_tokens(f[F_TOKENS], end, ps, &ev->t0, &ev->nt)) return -1;
    u64 bs;
    int neg;
    if (!rd_int(f[F_BS], end, &bs, &neg) || neg || bs > (1ULL << 40)) return -1;
    ev->bs = (i64)bs;
    if (f[F_LORA_ID] && !is_nil(f[F_LORA_ID], end)) return -1;
    if (f[F_LORA_NAME] && !is_nil(f[F_LORA_NAME], end)) return -1;
    if (f[F_EXTRA] && !rd_plain_extras(f[F_EXTRA], end)) return -1;
    ev->medium = 0;
    if (f[F_MEDIUM]) {
        P after;
        ev->medium = medium_of(s, f[F_MEDIUM], end, &after);
        if (ev->medium < 0) return -1;
    }
    if (ev->bs == 0 && ev->nt == 0) {
        ev->kind = EV_PLACEHOLDER;
        return 0;
    }
    if (ev->bs <= 0 || ev->bs > MAX_BLOCK_SIZE) return -1;
    if (ev->grouped) {
        /* a group keeps some of the blocks of its range (a sliding window its tail, Mamba its saved
         * state): the hashes are the range's last blocks; none at all is an event that stores nothing */
        if (ev->medium != 0 || ev->nt == 0 || ev->nt % (u64)ev->bs || ev->nt / (u64)ev->bs < ev->nh) return -1;
    } else if (ev->nh == 0 || (u64)ev->nt != (u64)ev->bs * ev->nh)
        return -1;
    ev->kind = EV_STORED;
    return 0;
}

static int removed_from(Store *s, Parse *ps, P *f, P end, Ev *ev, int pre) {
    if (!f[F_HASHES]) return -1;
    if (!(pre & 1) && !rd_hashes(f[F_HASHES], end, ps, &ev->h0, &ev->nh)) return -1;
    ev->medium = 0;
    if (f[F_MEDIUM]) {
        P after;
        ev->medium = medium_of(s, f[F_MEDIUM], end, &after);
        if (ev->medium < 0) return -1;
    }
    if (ev->group > 0 && ev->medium != 0) return -1; /* (a group's CPU tier: the Python path) */
    ev->kind = EV_REMOVED;
    return 0;
}

static int push_event(Parse *ps, Ev *ev) {
    if (ps->nev == ps->evcap) {
        size_t cap = ps->evcap ? ps->evcap * 2 : 64;
        Ev *evs = realloc(ps->evs, cap * sizeof(Ev));
        if (!evs) return -1;
        ps->evs = evs;
        ps->evcap = cap;
    }
    ps->evs[ps->nev++] = *ev;
    return 0;
}

/* the event kind of a tag string: 0 stored, 1 removed, 2 cleared; -1 unknown */
static int tag_kind(P t, u64 tl) {
    if (str_is(t, tl, "BlockStored")) return 0;
    if (str_is(t, tl, "BlockRemoved")) return 1;
    if (str_is(t, tl, "AllBlocksCleared")) return 2;
    return -1;
}

/* pass 1: parse and validate a whole payload into ps; 0 ok, -1 punt (nothing recorded is used).
 *
 * Accepted: exactly what msgspec's typed decoders of index/wire.py accept (maps of vLLM >= 0.24, or
 * all events as tagged arrays of <= 0.23) with values the Python path takes as they are (unsigned or
 * non-empty bin hashes, unsigned token ids, no LoRA, no extra keys beyond nil or empty entries, a
 * known medium, a float timestamp). Unknown fields and trailing items are skipped, as msgspec skips
 * them (without validating their contents). Anything else goes to the Python path, which decides
 * (its tolerant parse, a counted bad event or a decode error). */
static int parse_payload(Store *s, P p, P end, Parse *ps, double *ts) {
    ps->used = 0;
    ps->nev = 0;
    u64 ntop, nev;
    p = rd_array(p, end, &ntop);
    if (!p || ntop < 2) return -1;
    if (p >= end) return -1;
    uint8_t b = *p;
    if (b == 0xCB && end - p >= 9) {
        u64 raw = be(p + 1, 8);
        memcpy(ts, &raw, 8);
        p += 9;
    } else if (b == 0xCA && end - p >= 5) {
        uint32_t raw = (uint32_t)be(p + 1, 4);
        float f;
        memcpy(&f, &raw, 4);
        *ts = f;
        p += 5;
    } else
        return -1; /* an int ts: rare, the Python path takes it */
    if (!isfinite(*ts)) return -1; /* a decode error (index/wire.py) */
    p = rd_array(p, end, &nev);
    if (!p || nev > (u64)(end - p)) return -1;
    int shape = -1; /* 0 maps, 1 arrays: one shape per batch (a mix fails both typed decoders) */
    for (u64 e = 0; e < nev; e++) {
        P f[F_N] = {0};
        Ev ev;
        memset(&ev, 0, sizeof(ev));
        u64 n;
        P q = rd_map(p, end, &n);
        int kind = -1;
        int pre = 0; /* bit 0: hashes parsed, bit 1: tokens parsed */
        if (q) {
            if (shape == 1) return -1;
            shape = 0;
            if (n > (u64)(end - q)) return -1;
            for (u64 i = 0; i < n; i++) {
                P key;
                u64 klen;
                P v = rd_str(q, end, &key, &klen);
                if (!v || !is_ascii(key, klen)) return -1;
                int idx = -1;
                if (str_is(key, klen, "type")) {
                    P t;
                    u64 tl;
                    if (kind >= 0 || !rd_str(v, end, &t, &tl)) return -1;
                    kind = tag_kind(t, tl);
                    if (kind < 0) return -1;
                } else if (str_is(key, klen, "block_hashes")) idx = F_HASHES;
                else if (str_is(key, klen, "parent_block_hash")) idx = F_PARENT;
                else if (str_is(key, klen, "token_ids")) idx = F_TOKENS;
                else if (str_is(key, klen, "block_size")) idx = F_BS;
                else if (str_is(key, klen, "lora_id")) idx = F_LORA_ID;
                else if (str_is(key, klen, "medium")) idx = F_MEDIUM;
                else if (str_is(key, klen, "lora_name")) idx = F_LORA_NAME;
                else if (str_is(key, klen, "extra_keys")) idx = F_EXTRA;
                else if (str_is(key, klen, "group_idx")) idx = F_GROUP;
                else if (str_is(key, klen, "kv_cache_spec_kind")) idx = F_KIND;
                else if (str_is(key, klen, "locality")) idx = F_LOCALITY;
                else if (str_is(key, klen, "kv_cache_spec_sliding_window")) idx = F_WINDOW;
                if (idx >= 0) {
                    if (f[idx]) return -1; /* a field twice */
                    f[idx] = v;
                }
                if (idx == F_TOKENS) { /* parsed once, here (walking it twice cost ~10%) */
                    q = rd_tokens(v, end, ps, &ev.t0, &ev.nt);
                    pre |= 2;
                } else if (idx == F_HASHES) {
                    q = rd_hashes(v, end, ps, &ev.h0, &ev.nh);
                    pre |= 1;
                } else
                    q = rd_skip(v, end);
                if (!q) return -1;
            }
            if (kind < 0) return -1;
            if (kind != 0)
                f[F_PARENT] = f[F_TOKENS] = f[F_BS] = f[F_LORA_ID] = f[F_LORA_NAME] = f[F_EXTRA] = f[F_KIND] =
                    f[F_WINDOW] = NULL;
            if (kind == 2) f[F_HASHES] = f[F_MEDIUM] = f[F_GROUP] = f[F_LOCALITY] = NULL;
        } else {
            if (shape == 0) return -1;
            shape = 1;
            q = rd_array(p, end, &n);
            if (!q || n == 0 || n > (u64)(end - q)) return -1;
            P t;
            u64 tl;
            P cur = rd_str(q, end, &t, &tl);
            if (!cur) return -1;
            kind = tag_kind(t, tl);
            if (kind < 0) return -1;
            static const int stored_pos[] = {F_HASHES,    F_PARENT, F_TOKENS, F_BS,    F_LORA_ID, F_MEDIUM,
                                             F_LORA_NAME, F_EXTRA,  F_GROUP,  F_KIND, F_WINDOW};
            static const int removed_pos[] = {F_HASHES, F_MEDIUM, F_GROUP};
            for (u64 i = 1; i < n; i++) {
                if (kind == 0 && i - 1 < 11) f[stored_pos[i - 1]] = cur;
                else if (kind == 1 && i - 1 < 3) f[removed_pos[i - 1]] = cur;
                cur = rd_skip(cur, end);
                if (!cur) return -1;
            }
            q = cur;
        }
        /* a KV cache group other than the first, or a group of another kind than full attention (a
         * hybrid model): applied here once the Python path has learned the group (needs_python) */
        if (f[F_GROUP] && !is_nil(f[F_GROUP], end)) {
            u64 g;
            int neg;
            if (!rd_int(f[F_GROUP], end, &g, &neg) || neg || g >= MAX_GROUPS) return -1;
            ev.group = (int)g;
        }
        ev.gwin = -1;
        if (f[F_WINDOW] && !is_nil(f[F_WINDOW], end)) {
            u64 w;
            int neg;
            if (!rd_int(f[F_WINDOW], end, &w, &neg) || neg || w > (1ULL << 40)) return -1;
            ev.gwin = (i64)w;
        }
        /* a remote tier's residency is kept as STORAGE: the Python path */
        if (f[F_LOCALITY] && !is_nil(f[F_LOCALITY], end)) {
            P t;
            u64 tl;
            if (!rd_str(f[F_LOCALITY], end, &t, &tl) || !str_is(t, tl, "LOCAL")) return -1;
        }
        if (f[F_KIND] && !is_nil(f[F_KIND], end)) {
            if (!rd_str(f[F_KIND], end, &ev.gkind, &ev.gkind_len) || !is_ascii(ev.gkind, ev.gkind_len) ||
                ev.gkind_len > MAX_KIND)
                return -1;
        }
        ev.grouped = ev.group > 0 || (ev.gkind && !str_is(ev.gkind, ev.gkind_len, "full_attention"));
        if (kind == 0) {
            if (stored_from(s, ps, f, end, &ev, pre)) return -1;
        } else if (kind == 1) {
            if (removed_from(s, ps, f, end, &ev, pre)) return -1;
        } else {
            ev.kind = EV_CLEARED;
        }
        if (push_event(ps, &ev)) return -1;
        p = q;
    }
    for (u64 i = 2; i < ntop; i++) { /* data_parallel_rank, the seq slot, anything after them */
        if (i == 2 && !is_nil(p, end)) {
            u64 v;
            int neg;
            if (!rd_int(p, end, &v, &neg)) return -1;
        } else if (i == 3) {
            u64 v;
            int neg;
            if (!rd_int(p, end, &v, &neg)) return -1;
        }
        p = rd_skip(p, end);
        if (!p) return -1;
    }
    return p == end ? 0 : -1;
}

/* events that need the Python path even though they parsed: a block size not learned yet */
/* a hybrid model's KV cache groups: what the Python path has not learned yet, or would judge */
static int needs_python(Store *s, i64 sidx, Parse *ps) {
    Src *src = s->src[sidx];
    for (size_t e = 0; e < ps->nev; e++) {
        Ev *ev = &ps->evs[e];
        if (ev->kind == EV_REMOVED && ev->group > 0 && !src->grule[ev->group]) return 1;
        if (ev->kind != EV_STORED) continue;
        if (ev->bs != src->block_size) return 1;
        if (!ev->grouped) {
            if ((src->gbs && src->gbs != ev->bs) || src->grule[0] == 2) return 1;
            continue;
        }
        int g = ev->group;
        if (!src->grule[g] || src->gbs != ev->bs || src->gwin[g] != ev->gwin) return 1;
        P kind = ev->gkind ? ev->gkind : (P) "full_attention";
        u64 klen = ev->gkind ? ev->gkind_len : 14;
        if ((u64)src->gkind_len[g] != klen || memcmp(src->gkind[g], kind, klen)) return 1;
    }
    return 0;
}

/* the slot of an ambiguous window's last hash (ingest.py _win_slot) */
static inline size_t win_slot(u64 h) { return (size_t)((h * CHAIN_MUL) >> 56) % WIN_SLOTS; }

/* A window-only model's window of `nh` hashes over a range whose block keys are `keys`: the block
 * of its first hash (ingest.py _window_place). `placed` is where the event's shape puts it; an
 * offset up to `last` that the hashes' known keys (mapped, or removed lately: Src.ghost) all
 * agree on wins over it. */
static size_t window_place(const Src *src, const u64 *ehs, u64 nh, const u64 *keys, size_t last, size_t placed) {
    size_t at = placed;
    int votes = 0;
    for (u64 j = 0; j < nh; j++) {
        u64 h = ehs[j], known = 0;
        i64 i = em_find(src, h);
        const u64 *g = src->ghost + win_slot(h) % GHOST_SLOTS * 2;
        if (i >= 0) known = src->em[i * 3 + 1];
        else if (g[0] == h) known = g[1];
        if (!known || (votes && keys[at + j] == known)) continue;
        for (size_t o = 0; o <= last; o++)
            if (known == keys[o + j]) {
                if (votes) return placed; /* they disagree: the shape decides */
                at = o, votes = 1;
                break;
            }
    }
    return at;
}

/* pass 2: apply one parsed payload; 0 ok, -1 out of memory */
static int apply_payload(Store *s, i64 sidx, Parse *ps, double ts, u64 **keybuf, size_t *keycap) {
    Src *src = s->src[sidx];
    i64 se = 0, sb = 0, re = 0, rb = 0;
    for (size_t e = 0; e < ps->nev; e++) {
        Ev *ev = &ps->evs[e];
        if (ev->kind == EV_PLACEHOLDER) {
            src->st[T_PLACEHOLDERS]++;
        } else if (ev->kind == EV_STORED) {
            if (ev->grouped && ev->nh == 0) continue; /* a group that kept none of the range's blocks */
            size_t nblocks = ev->grouped ? ev->nt / (size_t)ev->bs : ev->nh;
            if (nblocks > *keycap) {
                size_t cap = nblocks * 2;
                u64 *kb = realloc(*keybuf, cap * sizeof(u64));
                if (!kb) return -1;
                *keybuf = kb;
                *keycap = cap;
            }
            u64 root;
            const u64 *tok = ps->buf + ev->t0;
            size_t bs = (size_t)ev->bs;
            if (!ev->has_parent) root = s->base_root;
            else {
                i64 i = em_find(src, ev->parent);
                if (i >= 0) {
                    root = src->em[i * 3 + 1];
                    if (src->wonly) { /* the parent ends a window placed at its range's end */
                        const u64 *w = src->wend + win_slot(ev->parent) * 3;
                        if (w[0] == ev->parent && w[2] == root && w[1] * CHAIN_MUL + block_content(tok, bs) == root)
                            root = w[1]; /* this range starts with that block again: it was one block earlier */
                    }
                } else {
                    src->st[T_UNKNOWN_PARENTS]++;
                    root = unknown_root(sidx, ev->parent);
                }
            }
            u64 *keys = *keybuf;
            u64 sm = root;
            size_t kmask = s->kcap - 1;
            for (size_t b = 0; b < nblocks; b++) {
                sm = sm * CHAIN_MUL + block_content(tok + b * bs, bs);
                keys[b] = sm;
                /* its key-table row, asked for as soon as the key is known: the hashing of the
                 * blocks after it runs while it comes (a hint: a table rebuilt meanwhile only wastes it) */
                __builtin_prefetch(&KT(s, home(sm, s->kshift) & kmask, 0), 1);
            }
            int medium = ev->medium, keep = 0;
            size_t first = nblocks - ev->nh; /* the block of the first hash: the range's last ones */
            if (ev->grouped) {
                medium = src->gmedium[ev->group];
                keep = src->grule[ev->group] == 2 || nblocks > ev->nh;
                /* a sliding window cut by the range's start (a range of at most `need` blocks): its
                 * hashes are the range's first blocks; a longer range is a prefill chunk's tail
                 * (ingest.py _window_drop says why, and what stays ambiguous) */
                size_t placed = first;
                if ((u64)src->gneed[ev->group] > ev->nh && (u64)src->gneed[ev->group] >= nblocks) placed = 0;
                if (src->gneed[ev->group] && src->wonly && first) {
                    first = window_place(src, ps->buf + ev->h0, ev->nh, keys, first, placed);
                    if (first == nblocks - ev->nh) { /* placed at the range's end: remembered */
                        u64 last = ps->buf[ev->h0 + ev->nh - 1], *w = src->wend + win_slot(last) * 3;
                        w[0] = last;
                        w[1] = keys[nblocks - 2];
                        w[2] = keys[nblocks - 1];
                    }
                } else first = placed;
            }
            if (do_store(s, sidx, medium, ps->buf + ev->h0, keys + first, (i64)ev->nh, keep)) return -1;
            se++;
            sb += (i64)ev->nh;
        } else if (ev->kind == EV_REMOVED) {
            int medium = ev->group > 0 ? src->gmedium[ev->group] : ev->medium;
            if (src->wonly) /* each block's key, for a window stored again (Src.ghost) */
                for (u64 j = 0; j < ev->nh; j++) {
                    u64 h = ps->buf[ev->h0 + j];
                    i64 i = em_find(src, h);
                    if (i < 0) continue;
                    u64 *g = src->ghost + win_slot(h) % GHOST_SLOTS * 2;
                    g[0] = h;
                    g[1] = src->em[i * 3 + 1];
                }
            do_remove(s, sidx, medium, ps->buf + ev->h0, (i64)ev->nh);
            re++;
            rb += (i64)ev->nh;
        } else if (ev->kind == EV_CLEARED) {
            for (int m = 0; m < s->nm; m++) /* GPU and every KV cache group's GPU medium */
                if (s->family[m] == 0 && (m == 0 || src->cnt[m]) && do_clear(s, sidx, m) < 0) return -1;
            src->st[T_CLEARED]++;
        }
    }
    src->st[T_BATCHES]++;
    src->st[T_SE] += se;
    src->st[T_SB] += sb;
    src->st[T_RE] += re;
    src->st[T_RB] += rb;
    src->last_ts = ts;
    s->rows_applied += sb + rb;
    return 0;
}

typedef struct {
    i64 sidx;
    PyObject *obj;
    P data;
    size_t len;
} Item;

/* ingest(items, start) -> (next, status): items is a list of (source index, payload bytes or None);
 * status 0: every item from `start` on applied (next == len(items)); 1: item `next` needs the Python
 * path (nothing of it applied); 2: item `next` is None (the caller drops that source). */
static PyObject *Store_ingest(Store *s, PyObject *args) {
    PyObject *items;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &items, &start)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_IndexError, "start out of range");
        return NULL;
    }
    /* gather the payloads up to the first None (held by references of our own while the GIL is released) */
    Py_ssize_t stop = start;
    size_t maxlen = 0;
    Item *its = malloc(sizeof(Item) * (size_t)(n - start + 1));
    if (!its) return PyErr_NoMemory();
    int status = 0;
    for (; stop < n; stop++) {
        PyObject *it = PyList_GET_ITEM(items, stop);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2) {
            for (Py_ssize_t k = start; k < stop; k++) Py_DECREF(its[k - start].obj);
            free(its);
            PyErr_SetString(PyExc_TypeError, "items are (source index, payload) tuples");
            return NULL;
        }
        PyObject *pl = PyTuple_GET_ITEM(it, 1);
        if (pl == Py_None) {
            status = 2;
            break;
        }
        if (!PyBytes_Check(pl)) {
            status = 1; /* e.g. an already decoded batch: the Python path */
            break;
        }
        PyObject *so = PyTuple_GET_ITEM(it, 0);
        /* an int proper: converting anything else could run Python code (__index__) that changes the
         * list under this loop */
        long long sidx = PyLong_Check(so) ? PyLong_AsLongLong(so) : -1;
        if (!PyLong_Check(so) || PyErr_Occurred() || check_sidx(s, sidx)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a source index is an int");
            for (Py_ssize_t k = start; k < stop; k++) Py_DECREF(its[k - start].obj);
            free(its);
            return NULL;
        }
        Item *x = &its[stop - start];
        x->sidx = sidx;
        x->obj = pl; /* a reference of our own while the GIL is released: the caller's list may change */
        Py_INCREF(pl);
        x->data = (P)PyBytes_AS_STRING(pl);
        x->len = (size_t)PyBytes_GET_SIZE(pl);
        if (x->len > maxlen) maxlen = x->len;
    }
    if (maxlen + 16 > s->scratch_cap) {
        size_t cap = maxlen + 16 > 4096 ? maxlen + 16 : 4096;
        u64 *buf = zalloc(cap * sizeof(u64));
        if (!buf) {
            for (Py_ssize_t k = start; k < stop; k++) Py_DECREF(its[k - start].obj);
            free(its);
            return PyErr_NoMemory();
        }
        zfree(s->scratch, s->scratch_cap * sizeof(u64));
        s->scratch = buf;
        s->scratch_cap = cap;
    }
    Parse ps = {s->scratch, 0, s->scratch_cap, NULL, 0, 0};
    u64 *keybuf = NULL;
    size_t keycap = 0;
    Py_ssize_t i = start;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < stop; i++) {
        Item *x = &its[i - start];
        double ts = 0;
        if (parse_payload(s, x->data, x->data + x->len, &ps, &ts) || needs_python(s, x->sidx, &ps)) {
            status = 1;
            break;
        }
        if (apply_payload(s, x->sidx, &ps, ts, &keybuf, &keycap)) {
            oom = 1;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t k = start; k < stop; k++) Py_DECREF(its[k - start].obj);
    free(its);
    free(ps.evs);
    free(keybuf);
    if (s->scratch_cap > SCRATCH_KEEP) { /* a rare huge payload: its scratch goes back at once */
        zfree(s->scratch, s->scratch_cap * sizeof(u64));
        s->scratch = NULL;
        s->scratch_cap = 0;
    }
    if (oom) return PyErr_NoMemory();
    if (i == n) status = 0;
    return Py_BuildValue("(ni)", i, status);
}
