/* kvrouter's compiled core: the compact prefix store and the fused KV-event ingest.
 *
 * Built by the package's own build (setuptools ext_modules, the machine's C compiler at
 * `pip install`), so nothing is compiled when the router starts. See index/README.md.
 *
 * Store: open-addressing tables (power-of-two sizes, linear probing, Fibonacci hashing of the 64-bit
 * key, load at most 3/4, deletion by backward shift), owned by one C object:
 *   - key table kt: uint64[cap][2]: our key and its holders, the (source, medium) pairs holding it:
 *     up to 3 inline (21 bits each), or, with bit 63 set, a pointer to a sparse bitmap (one
 *     (64-source word, medium, mask) element per word and medium in use). A row lives while its
 *     holders word is non-zero. Its size does not depend on how many sources there are.
 *   - per source, an engine-hash table em: uint64[cap][3]: vLLM's hash, our key, state (0 empty,
 *     position in the source's insertion log + 2 when live); the log (engine hashes in insertion
 *     order) gives the eviction order.
 *   - refs table rt: uint64[cap][3]: key, tag ((source + 1) << 16 | medium; 0 empty, 1 tombstone),
 *     count: references above one (rare).
 * Large tables are mmap'ed and munmap'ed, so memory freed by shrinking or dropping a source goes back
 * to the OS at once.
 *
 * Threads: one writer (the subscriber thread), lookups from other threads. Every change to the key
 * table, the refs table or the column layout happens under `mu`, one event (or one slice of a clear
 * or drop) at a time, and lookups take `mu` for their probe loop: a lookup sees whole events only.
 * Writers run with the GIL released; nobody waits for the GIL while holding `mu`. Rebuilds fill new
 * tables outside `mu` (only the writer changes tables, so the old ones are stable) and swap them in
 * under `mu`. The engine-hash tables and logs are the writer's; `emu` guards their replacement
 * against the debugging readers (source_keys and the test views).
 *
 * Ingest: `Store.ingest` takes a list of (source, payload) items and, per payload, parses vLLM's
 * msgpack batch (map events of vLLM >= 0.24 and tagged arrays of <= 0.23; int or bin hashes; unknown
 * fields and trailing items tolerated), validates all of it first, then computes our chained keys
 * and applies every event. Anything it does not handle exactly as the Python reference path would
 * (LoRA, extra keys, a new medium or block size, bad shapes, malformed msgpack) stops it before that
 * item, changing nothing for it, and the Python path (index/ingest.py) takes that item. Every read of
 * the payload is bounds-checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#ifndef MAP_POPULATE
#define MAP_POPULATE 0 /* (not Linux: tables fault in lazily) */
#endif
#ifdef __GLIBC__
#include <malloc.h>
#endif

typedef uint64_t u64;
typedef int64_t i64;

#define FIB 0x9E3779B97F4A7C15ULL
#define TAGMUL 0xC2B2AE3D27D4EB4FULL
#define CHAIN_MUL 0x9E3779B97F4A7C15ULL
#define WIN_SLOTS 64 /* ingest.py WIN_SLOTS */
#define GHOST_SLOTS 64 /* ingest.py GHOST_SLOTS */
#define MIN_CAP 64
#define MAX_MEDIA 32 /* GPU, CPU, STORAGE and each KV cache group's ("GPU#1"...) */
#define TOUCH_CAP 65536 /* keys a watched source records between two take_touched calls */
#define MAX_GROUPS 16    /* KV cache groups of a source (index/ingest.py MAX_GROUPS) */
#define MAX_KIND 40      /* bytes of a group's kind the Python path keeps */
#define MAX_WORDS 64 /* 64-source words: at most 4,096 source slots (slots are reused) */
#define MAX_SOURCES (MAX_WORDS * 64)
#define MAX_BLOCK_SIZE 4096
#define SLICE 4096     /* em rows per locked step of a clear or drop */
#define AHEAD 16       /* rows a rebuild prefetches ahead */
#define LOOKAHEAD 8    /* prompt blocks a lookup prefetches ahead */
#define BIG 65536      /* allocations at least this large are mmap'ed */

enum { G_TOTAL, G_EVICTIONS, G_KT_LIVE, G_RT_USED, G_RT_LIVE, G_MAX, G_SIZE };
enum { S_EM_LIVE, S_HEAD, S_TAIL, S_REFS, S_UNKNOWN, S_EVICTED, S_SIZE };
/* ingest counters per source, taken (and zeroed) by take_stats */
enum { T_BATCHES, T_SE, T_SB, T_RE, T_RB, T_CLEARED, T_UNKNOWN_PARENTS, T_PLACEHOLDERS, T_LAST_TS, T_SIZE };

/* ---- memory ------------------------------------------------------------------------------------ */
static void *zalloc(size_t n) {
    if (n == 0) n = 8;
    if (n >= BIG) {
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    return calloc(1, n);
}

/* A hash table's memory: like zalloc, but a large one comes with its pages already written
 * (MAP_POPULATE). A fresh table is probed (read) before it is written, so lazily its empty rows were
 * first mapped to the shared zero page and then faulted again on the first write, each such
 * fault flushing the TLB of every core the process runs on: in a 64-source drain those faults were
 * ~15% of the process's samples. A hash table's rows are spread over all its pages
 * at once, so populating them early costs no RSS a few inserts would not. */
static void *zalloc_table(size_t n) {
    if (n < BIG) return zalloc(n);
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void zfree(void *p, size_t n) {
    if (!p) return;
    if (n == 0) n = 8;
    if (n >= BIG) munmap(p, n);
    else free(p);
}

static unsigned shift_of(size_t cap) {
    unsigned b = 0;
    while (((size_t)1 << b) < cap) b++;
    return b ? 64 - b : 63;
}

static inline size_t home(u64 key, unsigned shift) { return (size_t)((key * FIB) >> shift); }

static size_t cap_for(size_t rows) {
    size_t cap = MIN_CAP;
    while (rows * 8 > cap * 5) cap *= 2; /* load at most 5/8 after a rebuild */
    return cap;
}

static inline int full(i64 used, size_t cap) { return used * 4 > (i64)cap * 3; }

static inline u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

static u64 MULS[MAX_BLOCK_SIZE];

static void init_muls(void) {
    u64 x = 0x6B76726F75746572ULL;
    for (int i = 0; i < MAX_BLOCK_SIZE; i++) {
        x += 0x9E3779B97F4A7C15ULL;
        u64 z = x;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        MULS[i] = (z ^ (z >> 31)) | 1;
    }
}

static inline u64 block_content(const u64 *t, size_t bs) {
    u64 acc = 0;
    for (size_t k = 0; k < bs; k++) acc += t[k] * MULS[k];
    return fmix64(acc);
}

/* the root of a chain whose parent block was never seen: never a prompt's root (see keys.py) */
static inline u64 unknown_root(i64 sidx, u64 parent) {
    return fmix64(parent ^ fmix64((u64)sidx + 0x756E6B6E6F776E31ULL)) | 1;
}

/* ---- the store --------------------------------------------------------------------------------- */
typedef struct {
    u64 *em;
    size_t ecap;
    unsigned eshift;
    u64 *log;
    size_t logcap;
    i64 ss[S_SIZE];
    i64 cnt[MAX_MEDIA];
    i64 st[T_SIZE];
    i64 block_size; /* learned by the Python path; 0: none yet */
    double last_ts;
    /* keys stored or removed while watched (the index's predictions for this source yield to them) */
    int watch, touched_over;
    u64 *touched;
    size_t ntouched;
    /* KV cache groups the Python path learned (set_group): 0 not taught, 1 full attention, 2 a group
     * whose stores keep existing mappings (sliding window, Mamba); their kind, window (-1: none),
     * block size and GPU medium */
    signed char grule[MAX_GROUPS];
    i64 gwin[MAX_GROUPS];
    i64 gneed[MAX_GROUPS]; /* a sliding window's blocks before a hit (0: another kind) */
    /* a window-only model (sliding-window groups, no full attention): the last hash of each recent
     * event whose window's place was ambiguous, with the keys of its range's last two blocks, by
     * slot (WIN_SLOTS, see ingest.py SourceStats.wends and Group.rechain) */
    int wonly;
    u64 wend[WIN_SLOTS * 3];
    /* a window-only model: the hash and key of each recently removed block, by slot (GHOST_SLOTS,
     * see ingest.py SourceStats.ghosts): a window stored again after its blocks were evicted (a
     * preempted request recomputed) keeps the place its hashes had */
    u64 ghost[GHOST_SLOTS * 2];
    i64 gbs;
    int gmedium[MAX_GROUPS];
    char gkind[MAX_GROUPS][MAX_KIND];
    int gkind_len[MAX_GROUPS];
} Src;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_mutex_t emu;
    i64 g[G_SIZE];
    u64 *kt;
    size_t kcap;
    unsigned kshift;
    int nm;
    size_t ovf_bytes; /* held by the key table's overflow bitmaps */
    i64 novf;         /* rows whose holders overflowed */
    int oom;          /* an overflow bitmap could not be allocated (do_store reports it) */
    u64 *rt;
    size_t rcap;
    unsigned rshift;
    Src **src;
    int nsrc;
    u64 base_root;
    char media[MAX_MEDIA][32];
    int media_len[MAX_MEDIA];
    int family[MAX_MEDIA]; /* the medium a KV cache group's medium belongs to ("GPU#1": GPU's) */
    /* ingest scratch */
    u64 *scratch;
    size_t scratch_cap;
    i64 rows_applied; /* blocks applied, for tests */
} Store;

#define KW 2 /* key-table row: key, holders */
#define KT(s, i, c) ((s)->kt[(size_t)(i) * KW + (size_t)(c)])

static inline void lock(Store *s) { pthread_mutex_lock(&s->mu); }
static inline void unlock(Store *s) { pthread_mutex_unlock(&s->mu); }

/* --- key table ---
 * A row is [key, holders]. A key is typically held by a few sources of many (a fleet's engines cache
 * different prompts), so its holders are a list, not a bitmask as wide as the fleet: a row costs 16
 * bytes at any number of sources. holders:
 *   - 0: an empty row (every key value is storable);
 *   - bit 63 clear: up to INLINE_N entries of ENT_BITS bits, each (medium << 13 | source << 1 | 1),
 *     0 when unused;
 *   - bit 63 set: the rest is a pointer to an Ovf, a sparse bitmap of (64-source word, medium, mask)
 *     elements, one per word and medium in use: a key most of the fleet holds (a shared system
 *     prompt) costs 16 bytes per 64 sources and is matched a word at a time.
 * A row goes to the bitmap when a fourth holder comes and back inline when two are left (not three:
 * a key that gains and loses one holder around the threshold would allocate at every change). */
#define OVF_BIT (1ULL << 63)
#define INLINE_N 3
#define ENT_BITS 21
#define ENT_MASK ((1ULL << ENT_BITS) - 1)

typedef struct {
    u64 mask;
    uint32_t word;
    uint32_t medium;
} OvEl;

typedef struct {
    uint32_t n, cap;
    OvEl e[];
} Ovf;

static inline u64 ent_of(i64 sidx, i64 m) { return ((u64)m << 13) | ((u64)sidx << 1) | 1; }
static inline int ent_src(u64 e) { return (int)((e >> 1) & 0xFFF); }
static inline int ent_med(u64 e) { return (int)(e >> 13); }
static inline Ovf *ovf_of(u64 h) { return (Ovf *)(uintptr_t)(h & ~OVF_BIT); }
static inline size_t ovf_size(uint32_t cap) { return sizeof(Ovf) + (size_t)cap * sizeof(OvEl); }

static inline int kt_live_row(const u64 *kt, size_t i) { return kt[i * KW + 1] != 0; }

/* the row's holders as (word, medium, mask) elements: the bitmap's own, or up to INLINE_N in tmp */
static inline uint32_t row_els(u64 h, OvEl *tmp, const OvEl **els) {
    if (h & OVF_BIT) {
        Ovf *o = ovf_of(h);
        *els = o->e;
        return o->n;
    }
    uint32_t n = 0;
    for (int k = 0; k < INLINE_N; k++) {
        u64 e = (h >> (ENT_BITS * k)) & ENT_MASK;
        if (!e) continue;
        int src = ent_src(e);
        tmp[n].mask = 1ULL << (src & 63);
        tmp[n].word = (uint32_t)(src >> 6);
        tmp[n].medium = (uint32_t)ent_med(e);
        n++;
    }
    *els = tmp;
    return n;
}

/* the media (a bit each) on which source sidx holds the row's key */
static inline u64 kt_media(const u64 *row, i64 sidx) {
    u64 h = row[1], out = 0;
    if (!(h & OVF_BIT)) {
        for (int k = 0; k < INLINE_N; k++) {
            u64 e = (h >> (ENT_BITS * k)) & ENT_MASK;
            if (e && ent_src(e) == (int)sidx) out |= 1ULL << ent_med(e);
        }
        return out;
    }
    const Ovf *o = ovf_of(h);
    uint32_t w = (uint32_t)(sidx >> 6);
    u64 bit = 1ULL << (sidx & 63);
    for (uint32_t i = 0; i < o->n; i++)
        if (o->e[i].word == w && (o->e[i].mask & bit)) out |= 1ULL << o->e[i].medium;
    return out;
}

static inline int kt_has(const u64 *row, i64 sidx, i64 m) {
    u64 h = row[1];
    if (!(h & OVF_BIT)) {
        u64 e = ent_of(sidx, m);
        return (h & ENT_MASK) == e || ((h >> ENT_BITS) & ENT_MASK) == e || ((h >> (2 * ENT_BITS)) & ENT_MASK) == e;
    }
    const Ovf *o = ovf_of(h);
    uint32_t w = (uint32_t)(sidx >> 6);
    for (uint32_t i = 0; i < o->n; i++)
        if (o->e[i].word == w && o->e[i].medium == (uint32_t)m) return (o->e[i].mask >> (sidx & 63)) & 1;
    return 0;
}

/* one more (word, medium, bit) in a row's bitmap (grown when full); -1: no memory */
static int ovf_add(Store *s, u64 *row, uint32_t w, uint32_t m, u64 bit) {
    Ovf *o = ovf_of(row[1]);
    for (uint32_t i = 0; i < o->n; i++)
        if (o->e[i].word == w && o->e[i].medium == m) {
            o->e[i].mask |= bit;
            return 0;
        }
    if (o->n == o->cap) {
        uint32_t cap = o->cap * 2;
        Ovf *no = realloc(o, ovf_size(cap));
        if (!no || ((uintptr_t)no & OVF_BIT)) return -1; /* (realloc failing keeps o) */
        s->ovf_bytes += ovf_size(cap) - ovf_size(no->cap);
        no->cap = cap;
        o = no;
        row[1] = (u64)(uintptr_t)o | OVF_BIT;
    }
    o->e[o->n].word = w;
    o->e[o->n].medium = m;
    o->e[o->n].mask = bit;
    o->n++;
    return 0;
}

/* source sidx now holds the row's key on medium m (it did not); under mu. -1: no memory (nothing
 * changed) */
static int kt_set(Store *s, u64 *row, i64 sidx, i64 m) {
    u64 h = row[1];
    if (!(h & OVF_BIT)) {
        for (int k = 0; k < INLINE_N; k++)
            if (!((h >> (ENT_BITS * k)) & ENT_MASK)) {
                row[1] = h | (ent_of(sidx, m) << (ENT_BITS * k));
                return 0;
            }
        Ovf *o = malloc(ovf_size(INLINE_N + 1));
        if (!o || ((uintptr_t)o & OVF_BIT)) {
            free(o);
            return -1;
        }
        o->n = 0;
        o->cap = INLINE_N + 1;
        s->ovf_bytes += ovf_size(o->cap);
        s->novf++;
        row[1] = (u64)(uintptr_t)o | OVF_BIT;
        for (int k = 0; k < INLINE_N; k++) { /* (cap INLINE_N + 1: these never grow it) */
            u64 e = (h >> (ENT_BITS * k)) & ENT_MASK;
            int src = ent_src(e);
            ovf_add(s, row, (uint32_t)(src >> 6), (uint32_t)ent_med(e), 1ULL << (src & 63));
        }
    }
    return ovf_add(s, row, (uint32_t)(sidx >> 6), (uint32_t)m, 1ULL << (sidx & 63));
}

/* source sidx no longer holds the row's key on medium m (it did); under mu. The row may be empty
 * after it: the caller settles it. */
static void kt_unset(Store *s, u64 *row, i64 sidx, i64 m) {
    u64 h = row[1];
    if (!(h & OVF_BIT)) {
        u64 e = ent_of(sidx, m);
        for (int k = 0; k < INLINE_N; k++)
            if (((h >> (ENT_BITS * k)) & ENT_MASK) == e) {
                row[1] = h & ~(ENT_MASK << (ENT_BITS * k));
                return;
            }
        return;
    }
    Ovf *o = ovf_of(h);
    uint32_t w = (uint32_t)(sidx >> 6);
    for (uint32_t i = 0; i < o->n; i++)
        if (o->e[i].word == w && o->e[i].medium == (uint32_t)m) {
            o->e[i].mask &= ~(1ULL << (sidx & 63));
            if (!o->e[i].mask) o->e[i] = o->e[--o->n];
            break;
        }
    if (o->n > 2) return;
    int bits = 0;
    for (uint32_t i = 0; i < o->n; i++) bits += __builtin_popcountll(o->e[i].mask);
    if (bits > 2) return;
    u64 nh = 0;
    int k = 0;
    for (uint32_t i = 0; i < o->n; i++)
        for (u64 mk = o->e[i].mask; mk; mk &= mk - 1) {
            i64 src = (i64)o->e[i].word * 64 + __builtin_ctzll(mk);
            nh |= ent_of(src, o->e[i].medium) << (ENT_BITS * k++);
        }
    row[1] = nh;
    s->ovf_bytes -= ovf_size(o->cap);
    s->novf--;
    free(o);
}

static void kt_free_ovf(u64 *kt, size_t cap) {
    for (size_t i = 0; i < cap; i++)
        if (kt[i * KW + 1] & OVF_BIT) free(ovf_of(kt[i * KW + 1]));
}

static i64 kt_find(Store *s, u64 key) {
    size_t mask = s->kcap - 1;
    size_t i = home(key, s->kshift) & mask;
    while (kt_live_row(s->kt, i)) {
        if (KT(s, i, 0) == key) return (i64)i;
        i = (i + 1) & mask;
    }
    return -1;
}

static size_t kt_insert(Store *s, u64 key) {
    size_t mask = s->kcap - 1;
    size_t i = home(key, s->kshift) & mask;
    while (kt_live_row(s->kt, i)) {
        if (KT(s, i, 0) == key) return i;
        i = (i + 1) & mask;
    }
    s->g[G_KT_LIVE]++;
    KT(s, i, 0) = key;
    return i;
}

static inline int stays(size_t h, size_t hole, size_t j) {
    if (hole < j) return hole < h && h <= j;
    return h > hole || h <= j;
}

static void kt_settle(Store *s, size_t i) {
    if (kt_live_row(s->kt, i)) return;
    s->g[G_KT_LIVE]--;
    size_t mask = s->kcap - 1;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!kt_live_row(s->kt, j)) break;
        if (stays(home(KT(s, j, 0), s->kshift) & mask, i, j)) continue;
        KT(s, i, 0) = KT(s, j, 0);
        KT(s, i, 1) = KT(s, j, 1);
        KT(s, j, 1) = 0;
        i = j;
    }
    KT(s, i, 0) = 0;
}

/* copy live rows of (old, ocap) into a fresh table (new, ncap); a row's bitmap goes with it */
static void kt_copy(const u64 *old, size_t ocap, u64 *new, size_t ncap) {
    unsigned shift = shift_of(ncap);
    size_t mask = ncap - 1;
    for (size_t r = 0; r < ocap; r++) {
        if (r + AHEAD < ocap) /* the new home of a row further on: its cache miss overlaps */
            __builtin_prefetch(new + (home(old[(r + AHEAD) * KW], shift) & mask) * KW, 1);
        if (!kt_live_row(old, r)) continue;
        u64 key = old[r * KW];
        size_t i = home(key, shift) & mask;
        while (kt_live_row(new, i)) i = (i + 1) & mask;
        new[i * KW] = key;
        new[i * KW + 1] = old[r * KW + 1];
    }
}

/* a new key table of `cap` rows, swapped in under mu */
static int kt_rebuild(Store *s, size_t cap) {
    u64 *new = zalloc_table(cap * KW * sizeof(u64));
    if (!new) return -1;
    kt_copy(s->kt, s->kcap, new, cap);
    lock(s);
    u64 *old = s->kt;
    size_t oldn = s->kcap * KW * sizeof(u64);
    s->kt = new;
    s->kcap = cap;
    s->kshift = shift_of(cap);
    unlock(s);
    zfree(old, oldn);
    return 0;
}

/* --- engine-hash tables --- */
static i64 em_find(const Src *src, u64 eh) {
    size_t mask = src->ecap - 1;
    size_t i = home(eh, src->eshift) & mask;
    while (src->em[i * 3 + 2]) {
        if (src->em[i * 3] == eh) return (i64)i;
        i = (i + 1) & mask;
    }
    return -1;
}

static void em_delete(Src *src, size_t i) {
    src->ss[S_EM_LIVE]--;
    size_t mask = src->ecap - 1;
    size_t j = i;
    u64 *em = src->em;
    for (;;) {
        j = (j + 1) & mask;
        if (!em[j * 3 + 2]) break;
        if (stays(home(em[j * 3], src->eshift) & mask, i, j)) continue;
        em[i * 3] = em[j * 3];
        em[i * 3 + 1] = em[j * 3 + 1];
        em[i * 3 + 2] = em[j * 3 + 2];
        i = j;
    }
    em[i * 3 + 2] = 0;
}

static int em_rebuild(Store *s, Src *src, size_t cap) {
    u64 *new = zalloc_table(cap * 3 * sizeof(u64));
    if (!new) return -1;
    unsigned shift = shift_of(cap);
    size_t mask = cap - 1;
    for (size_t r = 0; r < src->ecap; r++) {
        u64 *row = src->em + r * 3;
        if (r + AHEAD < src->ecap) __builtin_prefetch(new + (home(row[AHEAD * 3], shift) & mask) * 3, 1);
        if (row[2] < 2) continue;
        size_t i = home(row[0], shift) & mask;
        while (new[i * 3 + 2]) i = (i + 1) & mask;
        new[i * 3] = row[0];
        new[i * 3 + 1] = row[1];
        new[i * 3 + 2] = row[2];
    }
    pthread_mutex_lock(&s->emu);
    u64 *old = src->em;
    size_t oldn = src->ecap * 3 * sizeof(u64);
    src->em = new;
    src->ecap = cap;
    src->eshift = shift;
    pthread_mutex_unlock(&s->emu);
    zfree(old, oldn);
    return 0;
}

/* copy the current log entries into a new log of `size` and renumber their rows */
static int log_compact(Store *s, Src *src, size_t size) {
    u64 *new = zalloc(size * sizeof(u64));
    if (!new) return -1;
    size_t mask = src->ecap - 1;
    i64 q = 0, head = src->ss[S_HEAD], tail = src->ss[S_TAIL];
    pthread_mutex_lock(&s->emu);
    if (tail - head == src->ss[S_EM_LIVE]) {
        /* every entry is current (each live mapping has exactly one): a copy, and when the head
         * moved, one linear pass renumbering the rows; no probing */
        memcpy(new, src->log + head, (size_t)(tail - head) * sizeof(u64));
        if (head)
            for (size_t i = 0; i < src->ecap; i++)
                if (src->em[i * 3 + 2] >= 2) src->em[i * 3 + 2] -= (u64)head;
        q = tail - head;
        tail = head; /* (skip the loop below) */
    }
    for (i64 base = head; base < tail; base += 64) {
        i64 stop = base + 64 < tail ? base + 64 : tail;
        for (i64 p = base; p < stop; p++)
            __builtin_prefetch(src->em + (home(src->log[p], src->eshift) & mask) * 3);
        for (i64 p = base; p < stop; p++) {
            i64 i = em_find(src, src->log[p]);
            if (i >= 0 && src->em[i * 3 + 2] == (u64)(p + 2)) {
                new[q] = src->log[p];
                src->em[i * 3 + 2] = (u64)(q + 2);
                q++;
            }
        }
    }
    u64 *old = src->log;
    size_t oldn = src->logcap * sizeof(u64);
    src->log = new;
    src->logcap = size;
    src->ss[S_HEAD] = 0;
    src->ss[S_TAIL] = q;
    pthread_mutex_unlock(&s->emu);
    zfree(old, oldn);
    return 0;
}

/* --- refs table --- */
static inline u64 tag_of(i64 sidx, i64 m) { return ((u64)(sidx + 1) << 16) | (u64)m; }

static i64 rt_find(Store *s, u64 key, u64 tag) {
    size_t mask = s->rcap - 1;
    size_t i = home(key ^ (tag * TAGMUL), s->rshift) & mask;
    for (;;) {
        u64 t = s->rt[i * 3 + 1];
        if (t == 0) return -1;
        if (t == tag && s->rt[i * 3] == key) return (i64)i;
        i = (i + 1) & mask;
    }
}

static void rt_add(Store *s, u64 key, u64 tag, u64 n) {
    size_t mask = s->rcap - 1;
    size_t i = home(key ^ (tag * TAGMUL), s->rshift) & mask;
    i64 tomb = -1;
    for (;;) {
        u64 t = s->rt[i * 3 + 1];
        if (t == 0) break;
        if (t == 1) {
            if (tomb < 0) tomb = (i64)i;
        } else if (t == tag && s->rt[i * 3] == key) {
            s->rt[i * 3 + 2] += n;
            return;
        }
        i = (i + 1) & mask;
    }
    if (tomb >= 0) i = (size_t)tomb;
    else s->g[G_RT_USED]++;
    s->g[G_RT_LIVE]++;
    s->rt[i * 3] = key;
    s->rt[i * 3 + 1] = tag;
    s->rt[i * 3 + 2] = n;
}

static i64 rt_pop(Store *s, u64 key, u64 tag) {
    i64 i = rt_find(s, key, tag);
    if (i < 0) return 0;
    s->rt[i * 3 + 1] = 1;
    s->g[G_RT_LIVE]--;
    return (i64)s->rt[i * 3 + 2];
}

/* remove a source's refs on medium m (every medium when m < 0); under mu */
static void drop_refs(Store *s, Src *src, i64 sidx, i64 m) {
    if (!src->ss[S_REFS]) return;
    u64 lo = (u64)(sidx + 1) << 16, hi = (u64)(sidx + 2) << 16;
    i64 out = 0;
    for (size_t i = 0; i < s->rcap; i++) {
        u64 t = s->rt[i * 3 + 1];
        if (t >= lo && t < hi && (m < 0 || t == lo + (u64)m)) {
            out += (i64)s->rt[i * 3 + 2];
            s->rt[i * 3 + 1] = 1;
            s->g[G_RT_LIVE]--;
        }
    }
    src->ss[S_REFS] -= out;
}

static int rt_rebuild(Store *s, size_t cap) {
    u64 *new = zalloc_table(cap * 3 * sizeof(u64));
    if (!new) return -1;
    unsigned shift = shift_of(cap);
    size_t mask = cap - 1;
    for (size_t r = 0; r < s->rcap; r++) {
        u64 *row = s->rt + r * 3;
        if (row[1] < 2) continue;
        size_t i = home(row[0] ^ (row[1] * TAGMUL), shift) & mask;
        while (new[i * 3 + 1]) i = (i + 1) & mask;
        new[i * 3] = row[0];
        new[i * 3 + 1] = row[1];
        new[i * 3 + 2] = row[2];
    }
    lock(s);
    u64 *old = s->rt;
    size_t oldn = s->rcap * 3 * sizeof(u64);
    s->rt = new;
    s->rcap = cap;
    s->rshift = shift;
    s->g[G_RT_USED] = s->g[G_RT_LIVE];
    unlock(s);
    zfree(old, oldn);
    return 0;
}

/* --- room: free rows for a store of n blocks of source sidx on medium m --- */
static int room(Store *s, i64 sidx, i64 m, i64 n) {
    Src *src = s->src[sidx];
    if (full(s->g[G_KT_LIVE] + n, s->kcap)) {
        if (kt_rebuild(s, cap_for((size_t)(s->g[G_KT_LIVE] + n)))) return -1;
    }
    if (full(s->g[G_RT_USED] + n, s->rcap)) {
        if (rt_rebuild(s, cap_for((size_t)(s->g[G_RT_LIVE] + n)))) return -1;
    }
    if (full(src->ss[S_EM_LIVE] + n, src->ecap)) {
        if (em_rebuild(s, src, cap_for((size_t)(src->ss[S_EM_LIVE] + n)))) return -1;
    }
    if (src->ss[S_TAIL] + n > (i64)src->logcap) {
        i64 need = src->ss[S_EM_LIVE] + n;
        size_t size = (double)need <= (double)src->logcap * 0.75 ? src->logcap : (size_t)(need + need / 2 + 256);
        if (log_compact(s, src, size)) return -1;
    }
    return 0;
}

static inline int has_room(Store *s, Src *src, i64 sidx, i64 m, i64 n) {
    return !full(s->g[G_KT_LIVE] + n, s->kcap) &&
           !full(src->ss[S_EM_LIVE] + n, src->ecap) && !full(s->g[G_RT_USED] + n, s->rcap) &&
           src->ss[S_TAIL] + n <= (i64)src->logcap;
}

/* shrink the key table when it is mostly empty (after drops, clears, evictions) */
static int maybe_shrink(Store *s) {
    if (s->kcap > MIN_CAP && (size_t)s->g[G_KT_LIVE] * 8 < s->kcap && cap_for((size_t)s->g[G_KT_LIVE]) < s->kcap)
        return kt_rebuild(s, cap_for((size_t)s->g[G_KT_LIVE]));
    return 0;
}

/* --- operations (under mu) --- */
static inline int held_elsewhere(Store *s, size_t r, i64 sidx, i64 skip) {
    return (kt_media(&KT(s, r, 0), sidx) & ~(1ULL << skip)) != 0;
}

static void forget(Store *s, Src *src, i64 sidx, u64 key) {
    i64 r = kt_find(s, key);
    u64 held = r >= 0 ? kt_media(&KT(s, r, 0), sidx) : 0;
    for (int mm = 0; mm < s->nm; mm++) {
        if ((held >> mm) & 1) {
            kt_unset(s, &KT(s, r, 0), sidx, mm);
            src->cnt[mm]--;
            s->g[G_TOTAL]--;
        }
        if (src->ss[S_REFS]) src->ss[S_REFS] -= rt_pop(s, key, tag_of(sidx, mm));
    }
    if (r >= 0) kt_settle(s, (size_t)r);
}

static inline void touch(Src *src, u64 key) {
    if (!src->watch || !src->touched) return;
    if (src->ntouched < TOUCH_CAP) src->touched[src->ntouched++] = key;
    else src->touched_over = 1;
}

/* An engine hash now resolves to another key (its true parent became known): the source's
 * residencies of the old key, on every medium and with their counts, become the new key's. They
 * are the same engine blocks (a hash names a block's content); dropping them instead lost the
 * references of blocks the engine still held, and a later removal ended a residency it still had. */
static void move_refs(Store *s, Src *src, i64 sidx, u64 from, u64 to) {
    i64 r = kt_find(s, from);
    if (r < 0) return;
    i64 count[MAX_MEDIA];
    int any = 0;
    u64 held = kt_media(&KT(s, r, 0), sidx);
    for (int mm = 0; mm < s->nm; mm++) {
        count[mm] = 0;
        if ((held >> mm) & 1) {
            count[mm] = 1;
            kt_unset(s, &KT(s, r, 0), sidx, mm);
            src->cnt[mm]--;
            s->g[G_TOTAL]--;
            any = 1;
        }
        if (src->ss[S_REFS]) {
            i64 extra = rt_pop(s, from, tag_of(sidx, mm));
            src->ss[S_REFS] -= extra;
            if (count[mm]) count[mm] += extra;
        }
    }
    kt_settle(s, (size_t)r);
    if (!any) return;
    size_t r2 = kt_insert(s, to);
    for (int mm = 0; mm < s->nm; mm++) {
        i64 n = count[mm];
        if (!n) continue;
        if (!kt_has(&KT(s, r2, 0), sidx, mm)) {
            if (kt_set(s, &KT(s, r2, 0), sidx, mm)) { /* (no memory: the residency is lost) */
                s->oom = 1;
                continue;
            }
            src->cnt[mm]++;
            s->g[G_TOTAL]++;
            n--;
        }
        /* (a refs table all but full keeps the count it has: rt_add needs a free slot) */
        if (n && (size_t)(s->g[G_RT_USED] + 2) < s->rcap) {
            rt_add(s, to, tag_of(sidx, mm), (u64)n);
            src->ss[S_REFS] += n;
        }
    }
    kt_settle(s, r2); /* (a row left empty by a failed allocation) */
}

/* One BlockStored (room already made): returns 1 when the total went over the cap. `keep`: a KV
 * cache group whose chain may be uncertain (sliding-window and Mamba groups announce only the blocks
 * they keep, and a null block before them leaves no parent): a hash already mapped keeps its key,
 * the event's own key is taken only for a hash not seen before. */
static int store_event(Store *s, i64 sidx, i64 m, const u64 *ehs, const u64 *keys, i64 n, unsigned char *fresh,
                       int keep) {
    Src *src = s->src[sidx];
    size_t emask = src->ecap - 1;
    if (n > 1) { /* every block's home slots first: their cache misses overlap */
        size_t kmask = s->kcap - 1;
        for (i64 j = 0; j < n; j++) __builtin_prefetch(src->em + (home(ehs[j], src->eshift) & emask) * 3, 1);
        for (i64 j = 0; j < n; j++) __builtin_prefetch(&KT(s, home(keys[j], s->kshift) & kmask, 0), 1);
    }
    i64 tail = src->ss[S_TAIL];
    i64 nfresh = 0;
    u64 *em = src->em;
    for (i64 j = 0; j < n; j++) {
        u64 eh = ehs[j];
        size_t i = home(eh, src->eshift) & emask;
        int found = 0;
        while (em[i * 3 + 2]) {
            if (em[i * 3] == eh) {
                found = 1;
                break;
            }
            i = (i + 1) & emask;
        }
        fresh[j] = !found;
        if (found) continue;
        src->ss[S_EM_LIVE]++;
        em[i * 3] = eh;
        em[i * 3 + 1] = keys[j];
        em[i * 3 + 2] = (u64)(tail + 2);
        src->log[tail] = eh;
        tail++;
        nfresh++;
    }
    src->ss[S_TAIL] = tail;
    int remapped = 0, kept = 0;
    if (nfresh != n) {
        for (i64 j = 0; j < n; j++) {
            if (fresh[j]) continue;
            i64 i = em_find(src, ehs[j]);
            u64 cur = em[i * 3 + 1];
            if (cur != keys[j]) {
                if (keep) {
                    kept = 1;
                    continue;
                }
                move_refs(s, src, sidx, cur, keys[j]);
                em[i * 3 + 1] = keys[j];
                remapped = 1;
            }
        }
    }
    u64 tag = tag_of(sidx, m);
    i64 added = 0;
    for (i64 j = 0; j < n; j++) {
        u64 key = keys[j];
        if (kept) /* every listing adds to the key its hash resolves to */
            key = em[em_find(src, ehs[j]) * 3 + 1];
        /* a hash listed twice in the event with different keys: its last listing decides, and a
         * listing with another key adds nothing (else that key would be held with no engine hash
         * leading to it: no removal, clear or drop could end it) */
        else if (remapped) {
            i64 i = em_find(src, ehs[j]);
            if (i >= 0 && em[i * 3 + 1] != key) continue;
        }
        touch(src, key);
        size_t r = kt_insert(s, key);
        if (kt_has(&KT(s, r, 0), sidx, m)) {
            rt_add(s, key, tag, 1);
            src->ss[S_REFS]++;
        } else if (kt_set(s, &KT(s, r, 0), sidx, m)) { /* no memory: not recorded (do_store says so) */
            s->oom = 1;
            kt_settle(s, r);
        } else {
            added++;
        }
    }
    src->cnt[m] += added;
    s->g[G_TOTAL] += added;
    return s->g[G_TOTAL] > s->g[G_MAX];
}

static i64 remove_event(Store *s, i64 sidx, i64 m, const u64 *ehs, i64 n) {
    Src *src = s->src[sidx];
    u64 tag = tag_of(sidx, m);
    i64 ended = 0;
    for (i64 j = 0; j < n; j++) {
        i64 i = em_find(src, ehs[j]);
        i64 r = -1;
        if (i >= 0 && m < s->nm) r = kt_find(s, src->em[i * 3 + 1]);
        if (r < 0 || !kt_has(&KT(s, r, 0), sidx, m)) {
            src->ss[S_UNKNOWN]++;
            continue;
        }
        touch(src, src->em[i * 3 + 1]);
        if (src->ss[S_REFS]) {
            i64 q = rt_find(s, src->em[i * 3 + 1], tag);
            if (q >= 0) {
                src->ss[S_REFS]--;
                if (s->rt[q * 3 + 2] > 1) s->rt[q * 3 + 2]--;
                else {
                    s->rt[q * 3 + 1] = 1;
                    s->g[G_RT_LIVE]--;
                }
                continue;
            }
        }
        kt_unset(s, &KT(s, r, 0), sidx, m);
        ended++;
        if (!held_elsewhere(s, (size_t)r, sidx, m)) em_delete(src, (size_t)i);
        kt_settle(s, (size_t)r);
    }
    src->cnt[m] -= ended;
    s->g[G_TOTAL] -= ended;
    return ended;
}

/* drop the source's n oldest mappings (log order); returns residencies ended; under mu */
static i64 evict_oldest(Store *s, i64 sidx, i64 n) {
    Src *src = s->src[sidx];
    i64 before = s->g[G_TOTAL];
    i64 done = 0, p = src->ss[S_HEAD], tail = src->ss[S_TAIL];
    while (p < tail && done < n) {
        i64 i = em_find(src, src->log[p]);
        if (i >= 0 && src->em[i * 3 + 2] == (u64)(p + 2)) {
            u64 key = src->em[i * 3 + 1];
            em_delete(src, (size_t)i);
            forget(s, src, sidx, key);
            done++;
        }
        p++;
    }
    src->ss[S_HEAD] = p;
    return before - s->g[G_TOTAL];
}

/* over the cap: the oldest 1% (at least the excess) of the largest source's blocks go */
static void evict(Store *s) {
    i64 best = -1, live = -1;
    for (int i = 0; i < s->nsrc; i++) {
        if (s->src[i]->ss[S_EM_LIVE] > live) {
            live = s->src[i]->ss[S_EM_LIVE];
            best = i;
        }
    }
    if (best < 0) return;
    i64 n = live / 100;
    if (n < 1) n = 1;
    if (s->g[G_TOTAL] - s->g[G_MAX] > n) n = s->g[G_TOTAL] - s->g[G_MAX];
    lock(s);
    i64 gone = evict_oldest(s, best, n);
    s->g[G_EVICTIONS] += gone;
    s->src[best]->ss[S_EVICTED] += gone;
    unlock(s);
}

/* a store with room made first, and eviction after: what PrefixStore.store does */
static int do_store(Store *s, i64 sidx, i64 m, const u64 *ehs, const u64 *keys, i64 n, int keep) {
    Src *src = s->src[sidx];
    if (!has_room(s, src, sidx, m, n) && room(s, sidx, m, n)) return -1;
    unsigned char small[256];
    unsigned char *fresh = n <= 256 ? small : malloc((size_t)n);
    if (!fresh) return -1;
    lock(s);
    int over = store_event(s, sidx, m, ehs, keys, n, fresh, keep);
    int oom = s->oom;
    s->oom = 0;
    unlock(s);
    if (fresh != small) free(fresh);
    if (over) evict(s);
    return oom ? -1 : 0;
}

static i64 do_remove(Store *s, i64 sidx, i64 m, const u64 *ehs, i64 n) {
    lock(s);
    i64 ended = remove_event(s, sidx, m, ehs, n);
    unlock(s);
    return ended;
}

/* AllBlocksCleared on one medium, in locked slices */
static i64 do_clear(Store *s, i64 sidx, i64 m) {
    Src *src = s->src[sidx];
    i64 ended = 0;
    size_t i = 0;
    while (i < src->ecap) {
        size_t stop = i + SLICE < src->ecap ? i + SLICE : src->ecap;
        i64 part = 0;
        lock(s);
        while (i < stop) {
            u64 *row = src->em + i * 3;
            if (row[2] < 2) {
                i++;
                continue;
            }
            i64 r = kt_find(s, row[1]);
            if (r >= 0 && m < s->nm && kt_has(&KT(s, r, 0), sidx, m)) {
                kt_unset(s, &KT(s, r, 0), sidx, m);
                part++;
            }
            int gone = r < 0 || !held_elsewhere(s, (size_t)r, sidx, m);
            if (r >= 0) kt_settle(s, (size_t)r);
            if (gone) em_delete(src, i);
            else i++;
        }
        s->g[G_TOTAL] -= part;
        unlock(s);
        ended += part;
    }
    lock(s);
    drop_refs(s, src, sidx, m);
    src->cnt[m] = 0;
    unlock(s);
    return ended;
}

static int src_reset_map(Store *s, Src *src) {
    u64 *em = zalloc(MIN_CAP * 3 * sizeof(u64));
    u64 *lg = zalloc(256 * sizeof(u64));
    if (!em || !lg) {
        zfree(em, MIN_CAP * 3 * sizeof(u64));
        zfree(lg, 256 * sizeof(u64));
        return -1;
    }
    pthread_mutex_lock(&s->emu);
    u64 *oem = src->em, *olog = src->log;
    size_t oemn = src->ecap * 3 * sizeof(u64), ologn = src->logcap * sizeof(u64);
    src->em = em;
    src->ecap = MIN_CAP;
    src->eshift = shift_of(MIN_CAP);
    src->log = lg;
    src->logcap = 256;
    src->ss[S_EM_LIVE] = src->ss[S_HEAD] = src->ss[S_TAIL] = 0;
    pthread_mutex_unlock(&s->emu);
    zfree(oem, oemn);
    zfree(olog, ologn);
    return 0;
}

/* a restart or removal: every residency of the source goes, in locked slices; tables freed */
static i64 do_drop(Store *s, i64 sidx) {
    Src *src = s->src[sidx];
    i64 ended = 0;
    for (size_t i = 0; i < src->ecap; i += SLICE) {
        size_t stop = i + SLICE < src->ecap ? i + SLICE : src->ecap;
        i64 part = 0;
        lock(s);
        for (size_t k = i; k < stop; k++) {
            u64 *row = src->em + k * 3;
            if (row[2] < 2) continue;
            i64 r = kt_find(s, row[1]);
            if (r < 0) continue;
            u64 held = kt_media(&KT(s, r, 0), sidx);
            for (int mm = 0; held; mm++, held >>= 1)
                if (held & 1) {
                    kt_unset(s, &KT(s, r, 0), sidx, mm);
                    part++;
                }
            kt_settle(s, (size_t)r);
        }
        s->g[G_TOTAL] -= part;
        unlock(s);
        ended += part;
    }
    lock(s);
    drop_refs(s, src, sidx, -1);
    memset(src->cnt, 0, sizeof(src->cnt));
    src->ntouched = 0;
    src->touched_over = 0;
    memset(src->grule, 0, sizeof(src->grule)); /* (a restarted engine announces its groups again) */
    src->gbs = 0;
    src->wonly = 0;
    memset(src->wend, 0, sizeof(src->wend));
    memset(src->ghost, 0, sizeof(src->ghost));
    unlock(s);
    if (src_reset_map(s, src)) return -1;
    if (maybe_shrink(s)) return -1;
    return ended;
}

/* ---- Python object ------------------------------------------------------------------------------ */
static void Store_dealloc(Store *s) {
    if (s->kt) kt_free_ovf(s->kt, s->kcap);
    zfree(s->kt, s->kcap * KW * sizeof(u64));
    zfree(s->rt, s->rcap * 3 * sizeof(u64));
    for (int i = 0; i < s->nsrc; i++) {
        Src *src = s->src[i];
        zfree(src->em, src->ecap * 3 * sizeof(u64));
        zfree(src->log, src->logcap * sizeof(u64));
        free(src->touched);
        free(src);
    }
    free(s->src);
    zfree(s->scratch, s->scratch_cap * sizeof(u64));
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->emu);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int Store_init(Store *s, PyObject *args, PyObject *kw) {
    long long cap;
    unsigned long long base_root;
    if (!PyArg_ParseTuple(args, "LK", &cap, &base_root)) return -1;
    if (s->kt) {
        PyErr_SetString(PyExc_RuntimeError, "Store is initialised once");
        return -1;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->emu, NULL);
    s->g[G_MAX] = cap;
    s->base_root = base_root;
    s->nm = 3;
    s->src = calloc(MAX_SOURCES, sizeof(Src *)); /* never moved: an ingest may run meanwhile */
    s->kt = zalloc(MIN_CAP * KW * sizeof(u64));
    s->rt = zalloc(MIN_CAP * 3 * sizeof(u64));
    if (!s->src || !s->kt || !s->rt) {
        PyErr_NoMemory();
        return -1;
    }
    s->kcap = MIN_CAP;
    s->kshift = shift_of(MIN_CAP);
    s->rcap = MIN_CAP;
    s->rshift = shift_of(MIN_CAP);
    const char *names[3] = {"GPU", "CPU", "STORAGE"};
    for (int i = 0; i < 3; i++) {
        s->media_len[i] = (int)strlen(names[i]);
        memcpy(s->media[i], names[i], (size_t)s->media_len[i]);
        s->family[i] = i;
    }
    return 0;
}

static int check_sidx(Store *s, long long sidx) {
    if (sidx < 0 || sidx >= s->nsrc) {
        PyErr_Format(PyExc_IndexError, "no source slot %lld", sidx);
        return -1;
    }
    return 0;
}

static int check_medium(Store *s, long long m) {
    if (m < 0 || m >= s->nm) {
        PyErr_Format(PyExc_IndexError, "no medium %lld", m);
        return -1;
    }
    return 0;
}

/* new_slot(): a new source slot (the Python side reuses freed ones by index). The slot array never
 * moves and the key table does not depend on the number of slots, so this is safe while an ingest
 * runs in another thread. */
static PyObject *Store_new_slot(Store *s, PyObject *noarg) {
    if (s->nsrc >= MAX_SOURCES) {
        PyErr_Format(PyExc_ValueError, "at most %d event sources at once", MAX_SOURCES);
        return NULL;
    }
    Src *src = calloc(1, sizeof(Src));
    if (!src) return PyErr_NoMemory();
    if (src_reset_map(s, src)) {
        free(src);
        return PyErr_NoMemory();
    }
    int idx = s->nsrc;
    s->src[idx] = src;
    s->nsrc = idx + 1;
    return PyLong_FromLong(idx);
}

static PyObject *Store_reset_counters(Store *s, PyObject *arg) {
    long long sidx = PyLong_AsLongLong(arg);
    if (PyErr_Occurred() || check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    src->ss[S_UNKNOWN] = src->ss[S_EVICTED] = 0;
    memset(src->st, 0, sizeof(src->st));
    src->block_size = 0;
    Py_RETURN_NONE;
}

/* add_medium(name, family=-1): family, the medium a KV cache group's medium belongs to (an
 * AllBlocksCleared of GPU clears every GPU group); -1: its own */
static PyObject *Store_add_medium(Store *s, PyObject *args) {
    char *name;
    Py_ssize_t len;
    int family = -1;
    if (!PyArg_ParseTuple(args, "y#|i", &name, &len, &family)) return NULL;
    if (s->nm >= MAX_MEDIA || len > 31) {
        PyErr_SetString(PyExc_ValueError, "too many media, or a medium name over 31 bytes");
        return NULL;
    }
    if (family >= s->nm) {
        PyErr_SetString(PyExc_ValueError, "no such family medium");
        return NULL;
    }
    memcpy(s->media[s->nm], name, (size_t)len);
    s->media_len[s->nm] = (int)len;
    s->family[s->nm] = family < 0 ? s->nm : family;
    s->nm++; /* (cnt arrays are MAX_MEDIA long) */
    return PyLong_FromLong(s->nm - 1);
}

/* a uint64 sequence argument: a buffer of 8-byte items, or a sequence of ints */
typedef struct {
    Py_buffer view;
    int has_view;
    u64 *data;
    Py_ssize_t n;
    u64 *owned;
} U64Arg;

static int u64arg(PyObject *obj, U64Arg *a) {
    memset(a, 0, sizeof(*a));
    if (PyObject_CheckBuffer(obj) && !PyList_Check(obj)) {
        if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
            a->has_view = 1;
            if (a->view.itemsize != 8 && !(a->view.itemsize == 1 && a->view.len % 8 == 0)) {
                PyBuffer_Release(&a->view);
                PyErr_SetString(PyExc_TypeError, "expected 8-byte unsigned items");
                return -1;
            }
            a->data = (u64 *)a->view.buf;
            a->n = a->view.len / 8;
            return 0;
        }
        PyErr_Clear();
    }
    PyObject *seq = PySequence_Fast(obj, "expected a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    a->owned = malloc(sizeof(u64) * (size_t)(n ? n : 1));
    if (!a->owned) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_SetString(PyExc_TypeError, "expected ints");
            free(a->owned);
            a->owned = NULL;
            Py_DECREF(seq);
            return -1;
        }
        u64 v = PyLong_AsUnsignedLongLong(items[i]);
        if (v == (u64)-1 && PyErr_Occurred()) {
            free(a->owned);
            a->owned = NULL;
            Py_DECREF(seq);
            return -1;
        }
        a->owned[i] = v;
    }
    Py_DECREF(seq);
    a->data = a->owned;
    a->n = n;
    return 0;
}

static void u64arg_free(U64Arg *a) {
    if (a->has_view) PyBuffer_Release(&a->view);
    free(a->owned);
}

static PyObject *Store_store(Store *s, PyObject *args) {
    long long sidx, m;
    PyObject *eo, *ko;
    int keep = 0;
    if (!PyArg_ParseTuple(args, "LLOO|p", &sidx, &m, &eo, &ko, &keep)) return NULL;
    if (check_sidx(s, sidx) || check_medium(s, m)) return NULL;
    U64Arg e, k;
    if (u64arg(eo, &e)) return NULL;
    if (u64arg(ko, &k)) {
        u64arg_free(&e);
        return NULL;
    }
    if (e.n != k.n) {
        u64arg_free(&e);
        u64arg_free(&k);
        PyErr_SetString(PyExc_ValueError, "one key per engine hash");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = do_store(s, sidx, m, e.data, k.data, e.n, keep);
    Py_END_ALLOW_THREADS
    u64arg_free(&e);
    u64arg_free(&k);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Store_remove(Store *s, PyObject *args) {
    long long sidx, m;
    PyObject *eo;
    if (!PyArg_ParseTuple(args, "LLO", &sidx, &m, &eo)) return NULL;
    if (check_sidx(s, sidx) || check_medium(s, m)) return NULL;
    U64Arg e;
    if (u64arg(eo, &e)) return NULL;
    i64 ended;
    Py_BEGIN_ALLOW_THREADS
    ended = do_remove(s, sidx, m, e.data, e.n);
    Py_END_ALLOW_THREADS
    u64arg_free(&e);
    return PyLong_FromLongLong(ended);
}

/* apply_ops(sidx, ops(int64 rows of `width`: kind, medium, first, count, ...), width, ehs, keys, rems);
 * kind 0 store, 1 remove, 2 store keeping existing mappings (store_event's `keep`) */
static PyObject *Store_apply_ops(Store *s, PyObject *args) {
    long long sidx, width;
    PyObject *oo, *eo, *ko, *ro;
    if (!PyArg_ParseTuple(args, "LOLOOO", &sidx, &oo, &width, &eo, &ko, &ro)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    if (width < 4) {
        PyErr_SetString(PyExc_ValueError, "op rows have at least 4 columns");
        return NULL;
    }
    U64Arg o, e, k, r;
    if (u64arg(oo, &o)) return NULL;
    if (u64arg(eo, &e)) goto fail_o;
    if (u64arg(ko, &k)) goto fail_e;
    if (u64arg(ro, &r)) goto fail_k;
    i64 nops = o.n / width;
    const i64 *ops = (const i64 *)o.data;
    for (i64 j = 0; j < nops; j++) { /* validate everything before changing anything */
        const i64 *row = ops + j * width;
        i64 lim = row[0] != 1 ? (e.n < k.n ? e.n : k.n) : r.n;
        /* (first and count each within lim before their sum: no overflow) */
        if ((row[0] < 0 || row[0] > 2) || row[1] < 0 || row[1] >= s->nm || row[2] < 0 || row[3] < 0 ||
            row[2] > lim || row[3] > lim - row[2]) {
            PyErr_Format(PyExc_ValueError, "bad op row %lld", (long long)j);
            goto fail_r;
        }
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (i64 j = 0; j < nops && !rc; j++) {
        const i64 *row = ops + j * width;
        if (row[0] == 1) do_remove(s, sidx, row[1], r.data + row[2], row[3]);
        else rc = do_store(s, sidx, row[1], e.data + row[2], k.data + row[2], row[3], row[0] == 2);
    }
    Py_END_ALLOW_THREADS
    u64arg_free(&o);
    u64arg_free(&e);
    u64arg_free(&k);
    u64arg_free(&r);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail_r:
    u64arg_free(&r);
fail_k:
    u64arg_free(&k);
fail_e:
    u64arg_free(&e);
fail_o:
    u64arg_free(&o);
    return NULL;
}

static PyObject *Store_clear(Store *s, PyObject *args) {
    long long sidx, m;
    if (!PyArg_ParseTuple(args, "LL", &sidx, &m)) return NULL;
    if (check_sidx(s, sidx) || check_medium(s, m)) return NULL;
    i64 ended;
    Py_BEGIN_ALLOW_THREADS
    ended = do_clear(s, sidx, m);
    if (ended >= 0 && maybe_shrink(s)) ended = -1;
    Py_END_ALLOW_THREADS
    if (ended < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(ended);
}

static PyObject *Store_drop(Store *s, PyObject *arg) {
    long long sidx = PyLong_AsLongLong(arg);
    if (PyErr_Occurred() || check_sidx(s, sidx)) return NULL;
    i64 ended;
    Py_BEGIN_ALLOW_THREADS
    ended = do_drop(s, sidx);
    Py_END_ALLOW_THREADS
    if (ended < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(ended);
}

static PyObject *Store_key_of(Store *s, PyObject *args) {
    long long sidx;
    unsigned long long eh;
    if (!PyArg_ParseTuple(args, "LK", &sidx, &eh)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    pthread_mutex_lock(&s->emu);
    i64 i = em_find(src, eh);
    u64 key = i >= 0 ? src->em[i * 3 + 1] : 0;
    pthread_mutex_unlock(&s->emu);
    if (i < 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(key);
}

/* lookup(keys, candidates) -> (blocks per candidate, off-GPU counts per candidate or None)
 *
 * The prompt's blocks in turn, while a candidate is left: a row's holders (up to INLINE_N entries or
 * its bitmap's elements) are ANDed word by word with the candidates still alive, so a block costs
 * its probe plus its holders, not the width of the fleet; the words of the alive set are visited
 * only at a block where some candidate drops out (at most one such block per candidate). */
static PyObject *Store_lookup(Store *s, PyObject *args) {
    PyObject *ko, *co;
    if (!PyArg_ParseTuple(args, "OO", &ko, &co)) return NULL;
    U64Arg k;
    if (u64arg(ko, &k)) return NULL;
    PyObject *cseq = PySequence_Fast(co, "candidates must be a sequence");
    if (!cseq) {
        u64arg_free(&k);
        return NULL;
    }
    Py_ssize_t nc = PySequence_Fast_GET_SIZE(cseq);
    i64 *cands = malloc(sizeof(i64) * (size_t)(nc ? nc : 1));
    i64 *blocks = calloc((size_t)(nc ? nc : 1), sizeof(i64));
    PyObject *out = NULL;
    i64 *ooff = NULL; /* per slot and medium, allocated at the first off-GPU hit */
    int oom = 0;
    if (!cands || !blocks) {
        PyErr_NoMemory();
        goto done;
    }
    int maxw = 0;
    for (Py_ssize_t i = 0; i < nc; i++) {
        cands[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(cseq, i));
        if (cands[i] == -1 && PyErr_Occurred()) goto done;
        if (cands[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "negative source index");
            goto done;
        }
        if ((int)(cands[i] >> 6) + 1 > maxw) maxw = (int)(cands[i] >> 6) + 1;
    }
    {
        /* alive, held this block, held on GPU this block: one word per 64 slots */
        u64 small[3 * 4];
        u64 *alive = maxw <= 4 ? small : calloc((size_t)maxw * 3, sizeof(u64));
        i64 *depth = calloc((size_t)(maxw ? maxw : 1) * 64, sizeof(i64));
        if (!alive || !depth) {
            if (alive != small) free(alive);
            free(depth);
            PyErr_NoMemory();
            goto done;
        }
        memset(alive, 0, sizeof(u64) * 3 * (size_t)maxw);
        u64 *held = alive + maxw, *gpu = held + maxw;
        for (Py_ssize_t i = 0; i < nc; i++) alive[cands[i] >> 6] |= 1ULL << (cands[i] & 63);
        i64 nalive = 0;
        for (int w = 0; w < maxw; w++) nalive += __builtin_popcountll(alive[w]);
        const u64 *keys = k.data;
        i64 n = k.n, j = 0;
        int nm = 0;
        Py_BEGIN_ALLOW_THREADS
        lock(s);
        size_t mask = s->kcap - 1;
        const u64 *kt = s->kt;
        unsigned kshift = s->kshift; /* (locals: the stores below may alias the store's fields) */
        uint32_t uw = (uint32_t)maxw;
        uint32_t tw[64]; /* words touched at this block */
        for (i64 p = 0; p < LOOKAHEAD && p < n; p++) __builtin_prefetch(&kt[(home(keys[p], kshift) & mask) * KW]);
        while (j < n && nalive) {
            u64 key = keys[j];
            /* a row further on asked for now: the probes' cache misses overlap (the loop's body is
             * too long for the CPU to run ahead into the next block by itself) */
            if (j + LOOKAHEAD < n) __builtin_prefetch(&kt[(home(keys[j + LOOKAHEAD], kshift) & mask) * KW]);
            size_t i = home(key, kshift) & mask;
            u64 h = 0;
            for (;;) {
                u64 hh = kt[i * KW + 1];
                if (!hh) break;
                if (kt[i * KW] == key) {
                    h = hh;
                    break;
                }
                i = (i + 1) & mask;
            }
            /* the usual block: every candidate still alive holds it on GPU (a source has one GPU
             * entry per key at most, so the count of alive GPU holders says so); nothing changes */
            i64 ngpu = 0;
            if (!(h & OVF_BIT)) {
                for (u64 hh = h; hh; hh >>= ENT_BITS) {
                    u64 e = hh & ENT_MASK;
                    if (!e || ent_med(e)) continue;
                    uint32_t src = (uint32_t)ent_src(e), w = src >> 6;
                    ngpu += w < uw && ((alive[w] >> (src & 63)) & 1);
                }
            } else {
                const Ovf *o = ovf_of(h);
                for (uint32_t e = 0; e < o->n; e++)
                    if (o->e[e].medium == 0 && o->e[e].word < uw)
                        ngpu += __builtin_popcountll(o->e[e].mask & alive[o->e[e].word]);
            }
            if (ngpu == nalive) {
                j++;
                continue;
            }
            int nt = 0;
            i64 nheld = 0;
            if (!(h & OVF_BIT)) { /* inline holders (or none): one entry at a time */
                for (u64 hh = h; hh; hh >>= ENT_BITS) {
                    u64 e = hh & ENT_MASK;
                    if (!e) continue;
                    uint32_t src = (uint32_t)ent_src(e), w = src >> 6;
                    u64 bit = 1ULL << (src & 63);
                    if (w >= uw || !(alive[w] & bit)) continue;
                    if (!held[w]) tw[nt++] = w;
                    if (!(held[w] & bit)) {
                        held[w] |= bit;
                        nheld++;
                    }
                    if (!ent_med(e)) gpu[w] |= bit;
                }
            } else {
                const Ovf *o = ovf_of(h);
                for (uint32_t e = 0; e < o->n; e++) {
                    uint32_t w = o->e[e].word;
                    if (w >= uw) continue;
                    u64 m = o->e[e].mask & alive[w];
                    if (!m) continue;
                    if (!held[w]) tw[nt++] = w;
                    held[w] |= m;
                    if (o->e[e].medium == 0) gpu[w] |= m;
                }
                for (int t = 0; t < nt; t++) nheld += __builtin_popcountll(held[tw[t]]);
            }
            if (nheld != nalive) { /* someone drops out at block j */
                for (int w = 0; w < maxw; w++) {
                    u64 lost = alive[w] & ~held[w];
                    while (lost) {
                        depth[w * 64 + __builtin_ctzll(lost)] = j;
                        lost &= lost - 1;
                    }
                    alive[w] = held[w];
                }
                nalive = nheld;
            }
            for (int t = 0; t < nt; t++) {
                uint32_t w = tw[t];
                u64 ob = held[w] & ~gpu[w]; /* held, not on GPU: counted on its first other medium */
                held[w] = gpu[w] = 0;
                if (!ob) continue;
                OvEl tmp[INLINE_N];
                const OvEl *els;
                uint32_t ne = row_els(h, tmp, &els);
                while (ob) {
                    int b = __builtin_ctzll(ob);
                    uint32_t best = MAX_MEDIA;
                    for (uint32_t e = 0; e < ne; e++)
                        if (els[e].word == w && ((els[e].mask >> b) & 1) && els[e].medium < best)
                            best = els[e].medium;
                    if (!ooff && !oom) {
                        ooff = calloc((size_t)maxw * 64 * MAX_MEDIA, sizeof(i64));
                        oom = !ooff;
                    }
                    if (ooff) ooff[(size_t)(w * 64 + b) * MAX_MEDIA + best]++;
                    ob &= ob - 1;
                }
            }
            if (nalive) j++;
        }
        nm = s->nm;
        unlock(s);
        Py_END_ALLOW_THREADS
        for (int w = 0; w < maxw; w++) {
            u64 a = alive[w];
            while (a) {
                depth[w * 64 + __builtin_ctzll(a)] = n;
                a &= a - 1;
            }
        }
        for (Py_ssize_t i = 0; i < nc; i++) blocks[i] = depth[cands[i]];
        if (alive != small) free(alive);
        free(depth);
        if (oom) {
            PyErr_NoMemory();
            goto done;
        }
        PyObject *bl = PyList_New(nc);
        if (!bl) goto done;
        for (Py_ssize_t i = 0; i < nc; i++) PyList_SET_ITEM(bl, i, PyLong_FromLongLong(blocks[i]));
        PyObject *ol;
        if (ooff) {
            ol = PyList_New(nc);
            if (!ol) {
                Py_DECREF(bl);
                goto done;
            }
            for (Py_ssize_t i = 0; i < nc; i++) {
                PyObject *row = PyList_New(nm);
                for (int mm = 0; mm < nm; mm++)
                    PyList_SET_ITEM(row, mm, PyLong_FromLongLong(ooff[(size_t)cands[i] * MAX_MEDIA + mm]));
                PyList_SET_ITEM(ol, i, row);
            }
        } else {
            ol = Py_None;
            Py_INCREF(ol);
        }
        out = Py_BuildValue("(NN)", bl, ol);
    }
done:
    free(cands);
    free(blocks);
    free(ooff);
    Py_DECREF(cseq);
    u64arg_free(&k);
    return out;
}

/* holders(key) -> [(medium, source), ...], by medium, then source */
static int cmp_u64(const void *a, const void *b) {
    u64 x = *(const u64 *)a, y = *(const u64 *)b;
    return x < y ? -1 : x > y;
}

/* the (medium << 12 | source) pairs of a row, sorted; *n of them (malloc'ed; NULL: no memory) */
static u64 *row_pairs(u64 h, size_t *n) {
    OvEl tmp[INLINE_N];
    const OvEl *els;
    uint32_t ne = h ? row_els(h, tmp, &els) : 0;
    size_t cnt = 0;
    for (uint32_t e = 0; e < ne; e++) cnt += (size_t)__builtin_popcountll(els[e].mask);
    u64 *out = malloc(sizeof(u64) * (cnt ? cnt : 1));
    if (!out) return NULL;
    cnt = 0;
    for (uint32_t e = 0; e < ne; e++)
        for (u64 mk = els[e].mask; mk; mk &= mk - 1)
            out[cnt++] = ((u64)els[e].medium << 12) | ((u64)els[e].word * 64 + (u64)__builtin_ctzll(mk));
    qsort(out, cnt, sizeof(u64), cmp_u64);
    *n = cnt;
    return out;
}

static PyObject *Store_holders(Store *s, PyObject *arg) {
    u64 key = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    size_t n = 0;
    lock(s);
    i64 r = kt_find(s, key);
    u64 *pairs = row_pairs(r >= 0 ? KT(s, r, 1) : 0, &n);
    unlock(s);
    if (!pairs) return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(ii)", (int)(pairs[i] >> 12), (int)(pairs[i] & 0xFFF));
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    free(pairs);
    return out;
}

static PyObject *Store_refcount(Store *s, PyObject *args) {
    long long sidx, m;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "LKL", &sidx, &key, &m)) return NULL;
    if (check_medium(s, m)) return NULL;
    if (sidx < 0) {
        PyErr_Format(PyExc_IndexError, "no source slot %lld", sidx);
        return NULL;
    }
    lock(s);
    i64 out = 0;
    i64 r = kt_find(s, key);
    if (r >= 0 && sidx < MAX_SOURCES && kt_has(&KT(s, r, 0), sidx, m)) {
        i64 q = rt_find(s, key, tag_of(sidx, m));
        out = 1 + (q >= 0 ? (i64)s->rt[q * 3 + 2] : 0);
    }
    unlock(s);
    return PyLong_FromLongLong(out);
}

/* source_info(sidx) -> (cnt per medium, unknown removes, evicted, engine-hash rows live) */
static PyObject *Store_source_info(Store *s, PyObject *arg) {
    long long sidx = PyLong_AsLongLong(arg);
    if (PyErr_Occurred() || check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    PyObject *cnt = PyList_New(s->nm);
    if (!cnt) return NULL;
    for (int m = 0; m < s->nm; m++) PyList_SET_ITEM(cnt, m, PyLong_FromLongLong(src->cnt[m]));
    return Py_BuildValue("(NLLL)", cnt, (long long)src->ss[S_UNKNOWN], (long long)src->ss[S_EVICTED],
                         (long long)src->ss[S_EM_LIVE]);
}

/* source_keys(sidx) -> {medium: [keys]}: every residency of a source (O(its blocks)) */
static PyObject *Store_source_keys(Store *s, PyObject *arg) {
    long long sidx = PyLong_AsLongLong(arg);
    if (PyErr_Occurred() || check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    pthread_mutex_lock(&s->emu);
    size_t n = 0, cap = (size_t)src->ss[S_EM_LIVE] + 1;
    u64 *keys = malloc(cap * sizeof(u64));
    if (keys)
        for (size_t i = 0; i < src->ecap && n < cap; i++)
            if (src->em[i * 3 + 2] >= 2) keys[n++] = src->em[i * 3 + 1];
    pthread_mutex_unlock(&s->emu);
    if (!keys) return PyErr_NoMemory();
    u64 *held = calloc(n ? n : 1, sizeof(u64)); /* media bits per key */
    if (!held) {
        free(keys);
        return PyErr_NoMemory();
    }
    lock(s);
    for (size_t i = 0; i < n; i++) {
        i64 r = kt_find(s, keys[i]);
        if (r >= 0) held[i] = kt_media(&KT(s, r, 0), sidx);
    }
    int nm = s->nm;
    unlock(s);
    PyObject *out = PyDict_New();
    for (int m = 0; out && m < nm; m++) {
        PyObject *lst = PyList_New(0);
        for (size_t i = 0; lst && i < n; i++)
            if ((held[i] >> m) & 1) {
                PyObject *v = PyLong_FromUnsignedLongLong(keys[i]);
                if (!v || PyList_Append(lst, v)) Py_CLEAR(lst);
                Py_XDECREF(v);
            }
        PyObject *km = PyLong_FromLong(m);
        if (!lst || !km || PyDict_SetItem(out, km, lst)) Py_CLEAR(out);
        Py_XDECREF(lst);
        Py_XDECREF(km);
    }
    free(keys);
    free(held);
    return out;
}

/* views for tests: every residency of the key table, one source's engine-hash table and log, refs */
static PyObject *Store_kt_view(Store *s, PyObject *noarg) {
    /* kt_view() -> bytes of (key, medium << 12 | source) uint64 pairs, one per residency */
    lock(s);
    size_t n = 0;
    for (size_t i = 0; i < s->kcap; i++) {
        u64 h = KT(s, i, 1);
        if (!h) continue;
        OvEl tmp[INLINE_N];
        const OvEl *els;
        uint32_t ne = row_els(h, tmp, &els);
        for (uint32_t e = 0; e < ne; e++) n += (size_t)__builtin_popcountll(els[e].mask);
    }
    PyObject *raw = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 16));
    if (raw) {
        u64 *o = (u64 *)PyBytes_AS_STRING(raw);
        for (size_t i = 0; i < s->kcap; i++) {
            u64 h = KT(s, i, 1);
            if (!h) continue;
            size_t np = 0;
            u64 *pairs = row_pairs(h, &np);
            if (!pairs) {
                Py_CLEAR(raw);
                break;
            }
            for (size_t q = 0; q < np; q++) {
                *o++ = KT(s, i, 0);
                *o++ = pairs[q];
            }
            free(pairs);
        }
    }
    unlock(s);
    if (!raw) return PyErr_NoMemory();
    return raw;
}

static PyObject *Store_em_view(Store *s, PyObject *arg) {
    long long sidx = PyLong_AsLongLong(arg);
    if (PyErr_Occurred() || check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    pthread_mutex_lock(&s->emu);
    PyObject *em = PyBytes_FromStringAndSize((const char *)src->em, (Py_ssize_t)(src->ecap * 24));
    PyObject *lg = PyBytes_FromStringAndSize((const char *)src->log, (Py_ssize_t)(src->logcap * 8));
    long long head = src->ss[S_HEAD], tail = src->ss[S_TAIL];
    pthread_mutex_unlock(&s->emu);
    return Py_BuildValue("(NNLL)", em, lg, head, tail);
}

static PyObject *Store_rt_view(Store *s, PyObject *noarg) {
    lock(s);
    PyObject *raw = PyBytes_FromStringAndSize((const char *)s->rt, (Py_ssize_t)(s->rcap * 24));
    unlock(s);
    return raw;
}

static PyObject *Store_nbytes(Store *s, PyObject *noarg) {
    size_t n = s->kcap * KW * 8 + s->ovf_bytes + s->rcap * 24;
    for (int i = 0; i < s->nsrc; i++) n += s->src[i]->ecap * 24 + s->src[i]->logcap * 8;
    return PyLong_FromSize_t(n);
}

static PyObject *Store_get_total(Store *s, void *c) { return PyLong_FromLongLong(s->g[G_TOTAL]); }
static PyObject *Store_get_evictions(Store *s, void *c) { return PyLong_FromLongLong(s->g[G_EVICTIONS]); }
static PyObject *Store_get_max(Store *s, void *c) { return PyLong_FromLongLong(s->g[G_MAX]); }
static int Store_set_max(Store *s, PyObject *v, void *c) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    s->g[G_MAX] = x;
    return 0;
}

/* set_group(sidx, group, keep, window (-1: none), block_size, gpu medium, kind bytes, need=0): a KV
 * cache group the Python path learned, so the C ingest applies its events (need: a sliding window's
 * blocks before a hit, 0 for another kind); group -1 forgets them all */
static PyObject *Store_set_group(Store *s, PyObject *args) {
    long long sidx, g, keep, win, bs, m, need = 0;
    const char *kind;
    Py_ssize_t klen;
    if (!PyArg_ParseTuple(args, "LLLLLLy#|L", &sidx, &g, &keep, &win, &bs, &m, &kind, &klen, &need)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    if (g < 0) {
        memset(src->grule, 0, sizeof(src->grule));
        src->gbs = 0;
        src->wonly = 0;
        memset(src->wend, 0, sizeof(src->wend));
        memset(src->ghost, 0, sizeof(src->ghost));
        Py_RETURN_NONE;
    }
    if (g >= MAX_GROUPS || klen > MAX_KIND || bs <= 0 || need < 0 || check_medium(s, m)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad group");
        return NULL;
    }
    src->grule[g] = keep ? 2 : 1;
    src->gwin[g] = win;
    src->gneed[g] = need;
    src->gbs = bs;
    src->gmedium[g] = (int)m;
    memcpy(src->gkind[g], kind, (size_t)klen);
    src->gkind_len[g] = (int)klen;
    src->wonly = src->grule[0] == 2 && src->gneed[0] > 0;
    for (int i = 0; i < MAX_GROUPS; i++)
        if (src->grule[i] == 1) src->wonly = 0;
    Py_RETURN_NONE;
}

static PyObject *Store_set_block_size(Store *s, PyObject *args) {
    long long sidx, bs;
    if (!PyArg_ParseTuple(args, "LL", &sidx, &bs)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    s->src[sidx]->block_size = bs;
    Py_RETURN_NONE;
}

/* take_stats() -> [(sidx, batches, stored events, stored blocks, removed events, removed blocks, clears,
 * unknown parents, placeholders, last ts)] for the sources the ingest touched since the last call */
static PyObject *Store_take_stats(Store *s, PyObject *noarg) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < s->nsrc; i++) {
        Src *src = s->src[i];
        if (!src->st[T_BATCHES]) continue;
        PyObject *t = Py_BuildValue("(iLLLLLLLLd)", i, (long long)src->st[T_BATCHES], (long long)src->st[T_SE],
                                    (long long)src->st[T_SB], (long long)src->st[T_RE], (long long)src->st[T_RB],
                                    (long long)src->st[T_CLEARED], (long long)src->st[T_UNKNOWN_PARENTS],
                                    (long long)src->st[T_PLACEHOLDERS], src->last_ts);
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
        memset(src->st, 0, sizeof(src->st));
    }
    return out;
}

/* watch(sidx, on): while on, the keys the source stores or removes are recorded (at most TOUCH_CAP
 * between two take_touched calls; beyond, it is marked overflowed) */
static PyObject *Store_watch(Store *s, PyObject *args) {
    long long sidx;
    int on;
    if (!PyArg_ParseTuple(args, "Lp", &sidx, &on)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    Src *src = s->src[sidx];
    u64 *buf = NULL;
    if (on && !src->touched && !(buf = malloc(TOUCH_CAP * sizeof(u64)))) return PyErr_NoMemory();
    lock(s);
    if (buf) src->touched = buf;
    src->watch = on;
    if (!on) {
        src->ntouched = 0;
        src->touched_over = 0;
    }
    unlock(s);
    Py_RETURN_NONE;
}

/* take_touched() -> [(sidx, uint64 keys as bytes, overflowed)] for the watched sources that stored
 * or removed blocks since the last call */
static PyObject *Store_take_touched(Store *s, PyObject *noarg) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < s->nsrc; i++) {
        Src *src = s->src[i];
        if (!src->ntouched && !src->touched_over) continue;
        lock(s);
        PyObject *keys = PyBytes_FromStringAndSize((const char *)src->touched, (Py_ssize_t)(src->ntouched * 8));
        int over = src->touched_over;
        src->ntouched = 0;
        src->touched_over = 0;
        unlock(s);
        PyObject *t = keys ? Py_BuildValue("(iNO)", i, keys, over ? Py_True : Py_False) : NULL;
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    return out;
}

/* group_bits(keys, sidx, media, need, limit) -> [bits per block]: for the prompt's blocks from the
 * first on, a bitmask of which of `media` (a KV cache group's medium each, at most 64) the source
 * holds the block on; stops after `limit` blocks, or at the first block lacking one of the media in
 * the mask `need` (the full-attention groups: no hit can reach past it). */
static PyObject *Store_group_bits(Store *s, PyObject *args) {
    PyObject *ko, *mo;
    long long sidx, limit;
    unsigned long long need;
    if (!PyArg_ParseTuple(args, "OLOKL", &ko, &sidx, &mo, &need, &limit)) return NULL;
    if (check_sidx(s, sidx)) return NULL;
    PyObject *mseq = PySequence_Fast(mo, "media must be a sequence");
    if (!mseq) return NULL;
    Py_ssize_t ng = PySequence_Fast_GET_SIZE(mseq);
    if (ng > 64) {
        Py_DECREF(mseq);
        PyErr_SetString(PyExc_ValueError, "at most 64 groups");
        return NULL;
    }
    int media[64];
    for (Py_ssize_t g = 0; g < ng; g++) {
        long m = PyLong_AsLong(PySequence_Fast_GET_ITEM(mseq, g));
        if ((m == -1 && PyErr_Occurred()) || check_medium(s, m)) {
            Py_DECREF(mseq);
            return NULL;
        }
        media[g] = (int)m;
    }
    Py_DECREF(mseq);
    U64Arg k;
    if (u64arg(ko, &k)) return NULL;
    i64 n = k.n < limit ? k.n : (limit > 0 ? limit : 0);
    u64 *bits = malloc(sizeof(u64) * (size_t)(n ? n : 1));
    if (!bits) {
        u64arg_free(&k);
        return PyErr_NoMemory();
    }
    i64 j = 0;
    Py_BEGIN_ALLOW_THREADS
    lock(s);
    for (; j < n; j++) {
        i64 r = kt_find(s, k.data[j]);
        u64 b = 0, held = r >= 0 ? kt_media(&KT(s, r, 0), sidx) : 0;
        for (Py_ssize_t g = 0; held && g < ng; g++)
            if ((held >> media[g]) & 1) b |= 1ULL << g;
        if ((b & need) != need) break;
        bits[j] = b;
    }
    unlock(s);
    Py_END_ALLOW_THREADS
    u64arg_free(&k);
    PyObject *out = PyList_New(j);
    for (i64 i = 0; out && i < j; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(bits[i]);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    free(bits);
    return out;
}

#include "_kvingest.h"
#include "_kvrecv.h"
#include "_kvzmq.h"

static PyMethodDef Store_methods[] = {
    {"new_slot", (PyCFunction)Store_new_slot, METH_NOARGS, "Add a source slot; returns its index."},
    {"reset_counters", (PyCFunction)Store_reset_counters, METH_O, "Zero a slot's housekeeping counters."},
    {"add_medium", (PyCFunction)Store_add_medium, METH_VARARGS, "add_medium(name, family=-1) -> its index"},
    {"watch", (PyCFunction)Store_watch, METH_VARARGS, "watch(sidx, on): record the keys it stores and removes"},
    {"take_touched", (PyCFunction)Store_take_touched, METH_NOARGS, "[(sidx, keys, overflowed)] since the last call"},
    {"group_bits", (PyCFunction)Store_group_bits, METH_VARARGS, "group_bits(keys, sidx, media, need, limit)"},
    {"store", (PyCFunction)Store_store, METH_VARARGS, "store(sidx, medium, engine_hashes, keys)"},
    {"remove", (PyCFunction)Store_remove, METH_VARARGS, "remove(sidx, medium, engine_hashes) -> ended"},
    {"apply_ops", (PyCFunction)Store_apply_ops, METH_VARARGS, "apply_ops(sidx, ops, width, ehs, keys, rems)"},
    {"clear", (PyCFunction)Store_clear, METH_VARARGS, "clear(sidx, medium) -> ended"},
    {"drop", (PyCFunction)Store_drop, METH_O, "drop(sidx) -> ended"},
    {"key_of", (PyCFunction)Store_key_of, METH_VARARGS, "key_of(sidx, engine_hash) -> key or None"},
    {"lookup", (PyCFunction)Store_lookup, METH_VARARGS, "lookup(keys, candidates) -> (blocks, offs)"},
    {"holders", (PyCFunction)Store_holders, METH_O, "holders(key) -> [(medium, sidx)]"},
    {"refcount", (PyCFunction)Store_refcount, METH_VARARGS, "refcount(sidx, key, medium)"},
    {"source_info", (PyCFunction)Store_source_info, METH_O, "(counts, unknown removes, evicted, live)"},
    {"source_keys", (PyCFunction)Store_source_keys, METH_O, "{medium: [keys]} of one source"},
    {"kt_view", (PyCFunction)Store_kt_view, METH_NOARGS, "(key, medium << 12 | source) per residency, bytes"},
    {"em_view", (PyCFunction)Store_em_view, METH_O, "(raw engine-hash table, raw log, head, tail)"},
    {"rt_view", (PyCFunction)Store_rt_view, METH_NOARGS, "raw refs table"},
    {"nbytes", (PyCFunction)Store_nbytes, METH_NOARGS, "bytes held by the tables"},
    {"set_block_size", (PyCFunction)Store_set_block_size, METH_VARARGS, "set_block_size(sidx, size)"},
    {"set_group", (PyCFunction)Store_set_group, METH_VARARGS, "set_group(sidx, g, keep, win, bs, m, kind, need=0)"},
    {"take_stats", (PyCFunction)Store_take_stats, METH_NOARGS, "ingest counters since the last call"},
    {"ingest", (PyCFunction)Store_ingest, METH_VARARGS, "ingest(items, start) -> (next item, status)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Store_getset[] = {
    {"total", (getter)Store_get_total, NULL, "residencies held", NULL},
    {"evictions", (getter)Store_get_evictions, NULL, "residencies evicted by the cap", NULL},
    {"max_residencies", (getter)Store_get_max, (setter)Store_set_max, "the cap", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "index._kvcore.Store",
    .tp_basicsize = sizeof(Store),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Store_init,
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_methods = Store_methods,
    .tp_getset = Store_getset,
    .tp_doc = "The compact prefix store (see index/store.py).",
};

/* ---- module functions: keys --------------------------------------------------------------------- */
/* prompt_keys(tokens, block_size, root, extras) -> bytes of uint64 keys (native order); extras: a
 * sequence of (block, xor) or None */
static PyObject *mod_prompt_keys(PyObject *self, PyObject *args) {
    PyObject *to, *xo;
    long long bs;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "OLKO", &to, &bs, &root, &xo)) return NULL;
    if (bs <= 0 || bs > MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError, "block_size %lld outside 1..%d", bs, MAX_BLOCK_SIZE);
        return NULL;
    }
    if (PyBytes_Check(to)) { /* ids as native uint64 (a TokenBuffer's bytes): no Python ints */
        Py_ssize_t nb = PyBytes_GET_SIZE(to) / 8 / bs;
        const u64 *t = (const u64 *)PyBytes_AS_STRING(to);
        PyObject *out = PyBytes_FromStringAndSize(NULL, nb * 8);
        if (!out) return NULL;
        u64 *keys = (u64 *)PyBytes_AS_STRING(out);
        for (Py_ssize_t b = 0; b < nb; b++) keys[b] = block_content(t + b * bs, (size_t)bs);
        if (xo != Py_None) {
            PyObject *xs = PySequence_Fast(xo, "extras must be a sequence");
            if (!xs) {
                Py_DECREF(out);
                return NULL;
            }
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(xs); i++) {
                long long xb;
                unsigned long long x;
                if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(xs, i), "LK", &xb, &x)) {
                    Py_DECREF(xs);
                    Py_DECREF(out);
                    return NULL;
                }
                if (xb >= 0 && xb < nb) keys[xb] ^= x;
            }
            Py_DECREF(xs);
        }
        u64 sm = root;
        for (Py_ssize_t b = 0; b < nb; b++) {
            sm = sm * CHAIN_MUL + keys[b];
            keys[b] = sm;
        }
        return out;
    }
    PyObject *seq = PySequence_Fast(to, "tokens must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t nt = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t nb = nt / bs;
    PyObject *out = PyBytes_FromStringAndSize(NULL, nb * 8);
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    u64 *keys = (u64 *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 sm = root;
    for (Py_ssize_t b = 0; b < nb; b++) {
        u64 acc = 0;
        PyObject **blk = items + b * bs;
        for (Py_ssize_t k = 0; k < bs; k++) {
            PyObject *it = blk[k];
            if (!PyLong_Check(it)) goto bad;
            u64 v = PyLong_AsUnsignedLongLong(it);
            if (v == (u64)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                goto bad;
            }
            acc += v * MULS[k];
        }
        keys[b] = fmix64(acc);
    }
    Py_DECREF(seq);
    if (xo != Py_None) {
        PyObject *xs = PySequence_Fast(xo, "extras must be a sequence");
        if (!xs) {
            Py_DECREF(out);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(xs); i++) {
            long long b;
            unsigned long long x;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(xs, i), "LK", &b, &x)) {
                Py_DECREF(xs);
                Py_DECREF(out);
                return NULL;
            }
            if (b >= 0 && b < nb) keys[b] ^= x;
        }
        Py_DECREF(xs);
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        sm = sm * CHAIN_MUL + keys[b];
        keys[b] = sm;
    }
    return out;
bad:
    Py_DECREF(seq);
    Py_DECREF(out);
    PyErr_SetString(PyExc_ValueError, "token ids must be integers in 0..2^64-1");
    return NULL;
}

/* block_contents(uint64 buffer, block_size) -> bytes of m_i per full block */
static PyObject *mod_block_contents(PyObject *self, PyObject *args) {
    PyObject *to;
    long long bs;
    if (!PyArg_ParseTuple(args, "OL", &to, &bs)) return NULL;
    if (bs <= 0 || bs > MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError, "block_size %lld outside 1..%d", bs, MAX_BLOCK_SIZE);
        return NULL;
    }
    U64Arg t;
    if (u64arg(to, &t)) return NULL;
    Py_ssize_t nb = t.n / bs;
    PyObject *out = PyBytes_FromStringAndSize(NULL, nb * 8);
    if (out) {
        u64 *m = (u64 *)PyBytes_AS_STRING(out);
        for (Py_ssize_t b = 0; b < nb; b++) m[b] = block_content(t.data + b * bs, (size_t)bs);
    }
    u64arg_free(&t);
    return out;
}

static PyObject *mod_unknown_root(PyObject *self, PyObject *args) {
    long long sidx;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "LK", &sidx, &parent)) return NULL;
    return PyLong_FromUnsignedLongLong(unknown_root(sidx, parent));
}

/* check_ids(list, max_id or None) -> index of the first id that is not an exact int in 0..max (-1: none) */
static PyObject *mod_check_ids(PyObject *self, PyObject *args) {
    PyObject *lo, *mo;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &lo, &mo)) return NULL;
    u64 max = (u64)-1;
    if (mo != Py_None) {
        long long m = PyLong_AsLongLong(mo);
        if (m == -1 && PyErr_Occurred()) return NULL;
        max = m < 0 ? 0 : (u64)m;
        if (m < 0) return PyLong_FromLong(PyList_GET_SIZE(lo) ? 0 : -1);
    }
    Py_ssize_t n = PyList_GET_SIZE(lo);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(lo, i);
        if (!PyLong_CheckExact(it)) return PyLong_FromSsize_t(i);
        u64 v = PyLong_AsUnsignedLongLong(it);
        if (v == (u64)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or beyond 64 bits */
            if (_PyLong_Sign(it) < 0 || mo != Py_None) return PyLong_FromSsize_t(i);
            continue; /* a huge id with no vocabulary bound: as valid as before */
        }
        if (v > max) return PyLong_FromSsize_t(i);
    }
    return PyLong_FromLong(-1);
}

/* parse a JSON array of non-negative integers in 0..2^64-1 at p (no sign, fraction, exponent or
 * leading zero; whitespace allowed), as msgspec would decode it to a list of ints: the position
 * after it and the ids (malloc'ed, *n of them), or NULL when it is anything else */
static const uint8_t *parse_ids(const uint8_t *p, const uint8_t *end, u64 **out, size_t *nout) {
    u64 *ids = NULL;
    size_t n = 0, cap = 0;
#define WS() while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++
    WS();
    if (p >= end || *p != '[') return NULL;
    p++;
    WS();
    if (p < end && *p == ']') return NULL; /* empty: the generic path words the error */
    size_t guess = (size_t)(end - p) / 4 + 16;
    for (;;) {
        if (p >= end || *p < '0' || *p > '9') goto none;
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') goto none; /* leading zero */
        u64 x = 0;
        int nd = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (end - p >= 8) {
            /* up to 7 digits (every token id of a real vocabulary) in a few word operations, no
             * branch per digit: the digit bytes are those whose high nibble is 3 before and after
             * adding 6; the first other byte ends the number (little-endian: the lowest byte is
             * the first character) */
            u64 w;
            memcpy(&w, p, 8);
            u64 hi = 0xF0F0F0F0F0F0F0F0ULL, threes = 0x3030303030303030ULL;
            u64 other = ((w & hi) ^ threes) | (((w + 0x0606060606060606ULL) & hi) ^ threes);
            nd = other ? __builtin_ctzll(other) >> 3 : 8;
            if (nd < 8) { /* (8 or more digits: the loop below) */
                u64 v = (w & 0x0F0F0F0F0F0F0F0FULL) << (8 * (8 - nd)); /* zero digits in front */
                v = (v * 2561) >> 8;
                v = ((v & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
                x = ((v & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
                p += nd;
            }
        }
#endif /* (elsewhere every id takes the loop below) */
        if (nd == 0 || nd == 8) {
            const uint8_t *first = p;
            while (p < end && (unsigned)(*p - '0') < 10 && p - first < 19) x = x * 10 + (u64)(*p++ - '0');
            if (p < end && (unsigned)(*p - '0') < 10) { /* a 20th digit: may overflow */
                u64 d = (u64)(*p++ - '0');
                if (__builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, d, &x)) goto none;
                if (p < end && (unsigned)(*p - '0') < 10) goto none;
            }
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) goto none;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : guess;
            u64 *ni = realloc(ids, nc * sizeof(u64));
            if (!ni) goto none;
            ids = ni;
            cap = nc;
        }
        ids[n++] = x;
        if (p < end && *p == ',') { /* the usual separator first */
            p++;
            WS();
            continue;
        }
        WS();
        if (p < end && *p == ',') {
            p++;
            WS();
            continue;
        }
        if (p < end && *p == ']') {
            p++;
            break;
        }
        goto none;
    }
#undef WS
    *out = ids;
    *nout = n;
    return p;
none:
    free(ids);
    return NULL;
}

/* json_ids(raw) -> bytes of uint64 ids, or None: `raw` is exactly such an array (see parse_ids) */
static PyObject *mod_json_ids(PyObject *self, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE)) return NULL;
    const uint8_t *p = v.buf, *end = p + v.len;
    u64 *ids = NULL;
    size_t n = 0;
    p = parse_ids(p, end, &ids, &n);
    while (p && p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    PyObject *out = NULL;
    if (p == end && ids) out = PyBytes_FromStringAndSize((const char *)ids, (Py_ssize_t)(n * sizeof(u64)));
    else {
        out = Py_None;
        Py_INCREF(out);
    }
    free(ids);
    PyBuffer_Release(&v);
    return out;
}

/* the end of the JSON value at p (lenient: msgspec validates what is not the prompt), NULL if cut */
static const uint8_t *json_skip(const uint8_t *p, const uint8_t *end) {
    int depth = 0;
    while (p < end) {
        uint8_t c = *p;
        if (c == '"') {
            p++;
            while (p < end && *p != '"') p += (*p == '\\' && end - p > 1) ? 2 : 1;
            if (p >= end) return NULL;
            p++;
        } else if (c == '[' || c == '{') {
            depth++;
            p++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) return p; /* the end of the enclosing container */
            depth--;
            p++;
        } else if (c == ',' && depth == 0) {
            return p;
        } else {
            p++;
        }
        if (depth == 0 && (c == '"' || c == ']' || c == '}')) return p;
    }
    return depth == 0 ? p : NULL;
}

/* where the top-level "prompt" member of the JSON object in base[0:len] is (its only occurrence,
 * spelled without escapes) when it is an array of token ids (see parse_ids): 1 and its span and
 * ids (malloc'd), else 0. Touches no Python object. */
static int find_prompt(const uint8_t *base, Py_ssize_t len, Py_ssize_t *start, Py_ssize_t *stop, u64 **out,
                       size_t *nout) {
    const uint8_t *p = base, *end = base + len;
    int found = 0;
    u64 *ids = NULL;
    size_t nids = 0;
#define WS() while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++
    WS();
    if (p >= end || *p != '{') goto none;
    p++;
    for (;;) {
        WS();
        if (p < end && *p == '}') break;
        if (p >= end || *p != '"') goto none;
        const uint8_t *key = ++p;
        while (p < end && *p != '"') {
            if (*p == '\\') goto none; /* an escaped key: the generic path */
            p++;
        }
        if (p >= end) goto none;
        int is_prompt = (p - key == 6 && memcmp(key, "prompt", 6) == 0);
        p++;
        WS();
        if (p >= end || *p != ':') goto none;
        p++;
        WS();
        const uint8_t *value = p;
        if (is_prompt) {
            if (found) goto none; /* twice: the generic path */
            found = 1;
            p = parse_ids(p, end, &ids, &nids);
            if (!p) goto none;
            *start = value - base;
            *stop = p - base;
        } else {
            p = json_skip(p, end);
            if (!p || p == value) goto none;
        }
        WS();
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') break;
        goto none;
    }
#undef WS
    if (!found) goto none;
    *out = ids;
    *nout = nids;
    return 1;
none:
    free(ids);
    return 0;
}

/* json_prompt(raw) -> (start, end, ids) when the top-level "prompt" member of a JSON object (its
 * only occurrence, spelled without escapes) is an array of token ids (see parse_ids), else None;
 * a large body is scanned without the GIL */
static PyObject *mod_json_prompt(PyObject *self, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE)) return NULL;
    Py_ssize_t start = -1, stop = -1;
    u64 *ids = NULL;
    size_t nids = 0;
    int found;
    if (v.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        found = find_prompt(v.buf, v.len, &start, &stop, &ids, &nids);
        Py_END_ALLOW_THREADS
    } else {
        found = find_prompt(v.buf, v.len, &start, &stop, &ids, &nids);
    }
    PyBuffer_Release(&v);
    if (!found) Py_RETURN_NONE;
    PyObject *raw = PyBytes_FromStringAndSize((const char *)ids, (Py_ssize_t)(nids * sizeof(u64)));
    free(ids);
    if (!raw) return NULL;
    return Py_BuildValue("(nnN)", start, stop, raw);
}

/* the members of the JSON array or object at raw[start:stop] (whitespace around it allowed), in
 * groups of consecutive members: out[] gets (s, e, v) per group, raw[s:e] holding whole members with
 * the commas between them, at most `piece` bytes unless it is one member alone, v where that lone
 * member's value starts (-1 for a group of several). Lenient inside a member (whoever decodes a
 * group validates it), strict between members; 0 when the text is not such a container (or memory
 * ran out). Touches no Python object: runs without the GIL. */
static int split_members(const uint8_t *base, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t piece, int *kind,
                         Py_ssize_t **out, size_t *nout) {
    const uint8_t *p = base + start, *end = base + stop;
    Py_ssize_t *o = NULL;
    size_t n = 0, cap = 0;
#define WS() while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++
    WS();
    if (p >= end || (*p != '[' && *p != '{')) return 0;
    *kind = *p == '{';
    uint8_t close = *kind ? '}' : ']';
    p++;
    WS();
    const uint8_t *gs = NULL, *ge = NULL, *gv = NULL; /* the open group: start, end, lone value */
    size_t members = 0;
    if (p < end && *p == close) {
        p++;
    } else {
        for (;;) {
            const uint8_t *ms = p;
            if (*kind) {
                if (p >= end || *p != '"') goto fail;
                p++;
                while (p < end && *p != '"') p += (*p == '\\' && end - p > 1) ? 2 : 1;
                if (p >= end) goto fail;
                p++;
                WS();
                if (p >= end || *p != ':') goto fail;
                p++;
                WS();
            }
            const uint8_t *value = p, *me = json_skip(p, end);
            if (!me || me == value) goto fail;
            p = me;
            while (me > value && (me[-1] == ' ' || me[-1] == '\t' || me[-1] == '\n' || me[-1] == '\r')) me--;
            if (gs && me - gs > piece) { /* this member would make the group too large: close it */
                if (n + 3 > cap) {
                    size_t nc = cap ? cap * 2 : 48;
                    Py_ssize_t *no = realloc(o, nc * sizeof(Py_ssize_t));
                    if (!no) goto fail;
                    o = no;
                    cap = nc;
                }
                o[n++] = gs - base;
                o[n++] = ge - base;
                o[n++] = members == 1 ? gv - base : -1;
                gs = NULL;
            }
            if (!gs) {
                gs = ms;
                members = 0;
            }
            ge = me;
            gv = value;
            members++;
            WS();
            if (p < end && *p == ',') {
                p++;
                WS();
                continue;
            }
            if (p < end && *p == close) {
                p++;
                break;
            }
            goto fail;
        }
        if (n + 3 > cap) {
            size_t nc = cap + 3;
            Py_ssize_t *no = realloc(o, nc * sizeof(Py_ssize_t));
            if (!no) goto fail;
            o = no;
        }
        o[n++] = gs - base;
        o[n++] = ge - base;
        o[n++] = members == 1 ? gv - base : -1;
    }
    WS();
#undef WS
    if (p != end) goto fail;
    *out = o;
    *nout = n;
    return 1;
fail:
    free(o);
    return 0;
}

/* json_split(raw, start, stop, piece) -> [kind, s, e, v, ...] (kind 0: array, 1: object; see
 * split_members) or None */
static PyObject *mod_json_split(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t start, stop, piece;
    if (!PyArg_ParseTuple(args, "y*nnn", &v, &start, &stop, &piece)) return NULL;
    if (start < 0 || stop > v.len || start > stop || piece < 1) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "json_split: need 0 <= start <= stop <= len(raw) and piece >= 1");
        return NULL;
    }
    Py_ssize_t *o = NULL;
    size_t n = 0;
    int kind = 0, ok;
    Py_BEGIN_ALLOW_THREADS
    ok = split_members(v.buf, start, stop, piece, &kind, &o, &n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    if (!ok) Py_RETURN_NONE;
    PyObject *list = PyList_New((Py_ssize_t)n + 1);
    if (list) {
        PyList_SET_ITEM(list, 0, PyLong_FromLong(kind));
        for (size_t i = 0; i < n; i++) PyList_SET_ITEM(list, (Py_ssize_t)i + 1, PyLong_FromSsize_t(o[i]));
        for (size_t i = 0; i <= n; i++)
            if (!PyList_GET_ITEM(list, (Py_ssize_t)i)) {
                Py_CLEAR(list);
                break;
            }
    }
    free(o);
    return list;
}

/* first_above(uint64 buffer, max) -> index of the first id above max, -1 when none */
static PyObject *mod_first_above(PyObject *self, PyObject *args) {
    PyObject *bo;
    unsigned long long max;
    if (!PyArg_ParseTuple(args, "OK", &bo, &max)) return NULL;
    U64Arg b;
    if (u64arg(bo, &b)) return NULL;
    Py_ssize_t at = -1;
    for (Py_ssize_t i = 0; i < b.n; i++)
        if (b.data[i] > max) {
            at = i;
            break;
        }
    u64arg_free(&b);
    return PyLong_FromSsize_t(at);
}

/* trim(): give the heap's free memory back to the OS (glibc keeps it after bursts of messages) */
static PyObject *mod_trim(PyObject *self, PyObject *noarg) {
    int freed = 0;
#ifdef __GLIBC__
    Py_BEGIN_ALLOW_THREADS
    freed = malloc_trim(0);
    Py_END_ALLOW_THREADS
#endif
    return PyBool_FromLong(freed);
}

static PyObject *mod_muls(PyObject *self, PyObject *noarg) {
    return PyBytes_FromStringAndSize((const char *)MULS, sizeof(MULS));
}

static PyMethodDef mod_methods[] = {
    {"prompt_keys", mod_prompt_keys, METH_VARARGS, "prompt_keys(tokens, block_size, root, extras) -> bytes"},
    {"block_contents", mod_block_contents, METH_VARARGS, "block_contents(u64 tokens, block_size) -> bytes"},
    {"unknown_root", mod_unknown_root, METH_VARARGS, "unknown_root(sidx, parent_hash) -> root"},
    {"position_muls", mod_muls, METH_NOARGS, "the per-position multipliers R as bytes"},
    {"json_prompt", mod_json_prompt, METH_O, "(start, end, uint64 ids) of a body's token-id prompt, or None"},
    {"json_ids", mod_json_ids, METH_O, "json_ids(raw JSON array) -> uint64 bytes or None"},
    {"json_split", mod_json_split, METH_VARARGS, "json_split(raw, start, stop, piece) -> [kind, s, e, v, ...] or None"},
    {"first_above", mod_first_above, METH_VARARGS, "first_above(u64 buffer, max) -> index or -1"},
    {"trim", mod_trim, METH_NOARGS, "trim() -> whether the heap gave memory back to the OS"},
    {"check_ids", mod_check_ids, METH_VARARGS, "check_ids(ids, max_id) -> first bad index or -1"},
    {"zmq_load", mod_zmq_load, METH_VARARGS, "zmq_load(path, (ZMQError, Again)) -> bool: bind a libzmq"},
    {"z_ctx_new", mod_z_ctx_new, METH_O, "z_ctx_new(io_threads) -> a new libzmq context (address)"},
    {"z_ctx_term", mod_z_ctx_term, METH_O, "terminate a context (waits for its sockets to close)"},
    {"z_ctx_option", mod_z_ctx_option, METH_VARARGS, "z_ctx_option(context, option, value or -1) -> value"},
    {"z_getsockopt_int", mod_z_getsockopt_int, METH_VARARGS, "z_getsockopt_int(socket, option) -> int"},
    {"z_socket", mod_z_socket, METH_VARARGS, "z_socket(context, type) -> address"},
    {"z_close", mod_z_close, METH_O, "close a socket"},
    {"z_setsockopt", mod_z_setsockopt, METH_VARARGS, "z_setsockopt(socket, option, int or bytes)"},
    {"z_getsockopt_bytes", mod_z_getsockopt_bytes, METH_VARARGS, "z_getsockopt_bytes(socket, option) -> bytes"},
    {"z_endpoint", mod_z_endpoint, METH_VARARGS, "z_endpoint(socket, endpoint, connect): bind or connect"},
    {"z_monitor", mod_z_monitor, METH_VARARGS, "z_monitor(socket, address or None, events)"},
    {"z_poll", mod_z_poll, METH_VARARGS, "z_poll([(socket, fd)], timeout ms) -> indices ready to read"},
    {"z_recv_multipart", mod_z_recv_multipart, METH_VARARGS, "z_recv_multipart(socket, flags) -> [bytes]"},
    {"z_send_multipart", mod_z_send_multipart, METH_VARARGS, "z_send_multipart(socket, frames)"},
    {"recv_live", mod_recv_live, METH_VARARGS, "recv_live(socket, chunk, sidx, last_seq, topic, max)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_kvcore", "kvrouter's compiled index core.", -1,
                                    mod_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kvcore(void) {
    init_muls();
    if (PyType_Ready(&StoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&StoreType);
    if (PyModule_AddObject(m, "Store", (PyObject *)&StoreType) < 0) {
        Py_DECREF(&StoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "MAX_MEDIA", MAX_MEDIA);
    PyModule_AddIntConstant(m, "MAX_BLOCK_SIZE", MAX_BLOCK_SIZE);
    return m;
}
