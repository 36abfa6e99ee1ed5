/* gpuhit._speedups.kv_batch: a vLLM KV-event batch (msgpack) -> its records (part of the C
 * speedups, built with _speedups.c into one extension; engines/kv_event_codec.py BatchDecoder
 * calls it).
 *
 * Why: a new 2k-token prompt brings a BlockStored of 128 hashes and 2,048 token ids, a 100k-token
 * one 6,250 hashes and 100k ids; routing reads the hashes and never the ids. The reference
 * (msgspec's typed decoder) keeps the ids as raw msgpack but still walks them element by element
 * and then builds each record in a Python loop; here the ids are skipped by a table of int sizes
 * and the records (engines/kv_events.py) are built in C with their fields in order.
 *
 * The subset read is vLLM's current wire shape: [ts, [event maps], rank?] (what vLLM 0.32 sends)
 * or {"ts", "events", "data_parallel_rank"?}, each event a map with a "type" of BlockStored /
 * BlockRemoved / AllBlocksCleared and each key at most once, plain non-negative int block hashes,
 * int token ids, extra_keys nil (or one nil per block), the fields vLLM adds that routing ignores
 * only as scalars. Anything else (older array events, digest-bytes hashes, extra keys, a corrupt
 * payload) answers None and the caller hands the payload to the reference, which decodes it or
 * raises its error: tests/engines/test_kv_batch_c.py holds the two to equal batches on vLLM's own
 * batches and on generated ones. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Every reader returns OK, FALLBACK (outside the subset, or malformed: the reference decides) or
 * FAIL (a Python exception is set). */
enum { OK = 0, FALLBACK = 1, FAIL = -1 };

typedef struct {
    const unsigned char *p, *end;
} Rd;

static inline int need(const Rd *r, Py_ssize_t k) { return r->end - r->p >= k; }

static inline uint64_t be(const unsigned char *p, int k) {
    uint64_t v = 0;
    for (int i = 0; i < k; i++) v = (v << 8) | p[i];
    return v;
}

/* A msgpack integer: *neg = 1 with the value in *s when negative, else *u. */
static int rd_int(Rd *r, int *neg, uint64_t *u, int64_t *s) {
    if (!need(r, 1)) return FALLBACK;
    unsigned b = *r->p;
    *neg = 0;
    if (b <= 0x7f) {
        *u = b;
        r->p += 1;
        return OK;
    }
    if (b >= 0xe0) {
        *neg = 1;
        *s = (int64_t)(int8_t)b;
        r->p += 1;
        return OK;
    }
    int k, is_signed;
    if (b >= 0xcc && b <= 0xcf) {
        k = 1 << (b - 0xcc);
        is_signed = 0;
    } else if (b >= 0xd0 && b <= 0xd3) {
        k = 1 << (b - 0xd0);
        is_signed = 1;
    } else {
        return FALLBACK;
    }
    if (!need(r, 1 + k)) return FALLBACK;
    uint64_t raw = be(r->p + 1, k);
    r->p += 1 + k;
    if (!is_signed) {
        *u = raw;
        return OK;
    }
    int shift = 64 - 8 * k; /* sign-extend the k-byte two's complement value */
    int64_t v = (int64_t)(raw << shift) >> shift;
    if (v < 0) {
        *neg = 1;
        *s = v;
    } else {
        *u = (uint64_t)v;
    }
    return OK;
}

static inline int rd_nil(Rd *r) {
    if (need(r, 1) && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An array (want_map = 0) or map header's element count. */
static int rd_header(Rd *r, int want_map, Py_ssize_t *count) {
    if (!need(r, 1)) return FALLBACK;
    unsigned b = *r->p;
    unsigned fix = want_map ? 0x80 : 0x90, b16 = want_map ? 0xde : 0xdc, b32 = want_map ? 0xdf : 0xdd;
    if (b >= fix && b <= fix + 15) {
        *count = b - fix;
        r->p += 1;
        return OK;
    }
    int k = b == b16 ? 2 : b == b32 ? 4 : 0;
    if (k == 0 || !need(r, 1 + k)) return FALLBACK;
    *count = (Py_ssize_t)be(r->p + 1, k);
    r->p += 1 + k;
    return OK;
}

static int rd_str(Rd *r, const char **s, Py_ssize_t *len) {
    if (!need(r, 1)) return FALLBACK;
    unsigned b = *r->p;
    int k;
    if (b >= 0xa0 && b <= 0xbf) {
        *len = b - 0xa0;
        k = 0;
    } else if (b >= 0xd9 && b <= 0xdb) {
        k = 1 << (b - 0xd9);
        if (!need(r, 1 + k)) return FALLBACK;
        *len = (Py_ssize_t)be(r->p + 1, k);
    } else {
        return FALLBACK;
    }
    r->p += 1 + k;
    if (!need(r, *len)) return FALLBACK;
    *s = (const char *)r->p;
    r->p += *len;
    return OK;
}

/* nil (when allow_nil) -> None; an int -> a Python int (non-negative only when nonneg, positive
 * only when positive). */
static int rd_opt_int(Rd *r, PyObject **out, int allow_nil, int nonneg, int positive) {
    if (rd_nil(r)) {
        if (!allow_nil) return FALLBACK;
        *out = Py_NewRef(Py_None);
        return OK;
    }
    int neg;
    uint64_t u = 0;
    int64_t s = 0;
    if (rd_int(r, &neg, &u, &s) != OK) return FALLBACK;
    if (neg) {
        if (nonneg || positive) return FALLBACK;
        *out = PyLong_FromLongLong(s);
    } else {
        if (positive && u == 0) return FALLBACK;
        *out = PyLong_FromUnsignedLongLong(u);
    }
    return *out == NULL ? FAIL : OK;
}

/* nil -> None; a UTF-8 string -> str (not UTF-8: FALLBACK, the reference says what is wrong). */
static int rd_opt_str(Rd *r, PyObject **out) {
    if (rd_nil(r)) {
        *out = Py_NewRef(Py_None);
        return OK;
    }
    const char *s;
    Py_ssize_t len;
    if (rd_str(r, &s, &len) != OK) return FALLBACK;
    if ((*out = PyUnicode_DecodeUTF8(s, len, NULL)) == NULL) {
        PyErr_Clear();
        return FALLBACK;
    }
    return OK;
}

/* An array of non-negative ints as a tuple of Python ints (vLLM's block hashes). */
static int rd_hashes(Rd *r, PyObject **out) {
    Py_ssize_t k;
    if (rd_header(r, 0, &k) != OK || r->end - r->p < k) return FALLBACK; /* >= 1 byte an element */
    PyObject *t = PyTuple_New(k);
    if (t == NULL) return FAIL;
    for (Py_ssize_t i = 0; i < k; i++) {
        int neg;
        uint64_t u = 0;
        int64_t s = 0;
        if (rd_int(r, &neg, &u, &s) != OK || neg) {
            Py_DECREF(t);
            return FALLBACK;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(u);
        if (v == NULL) {
            Py_DECREF(t);
            return FAIL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    *out = t;
    return OK;
}

/* The encoded size of a msgpack int by its first byte; 0: not an int (kv_batch_init fills it). */
static unsigned char INT_SIZE[256];

/* Skip an array of ints (BlockStored.token_ids): the offsets of its header and past its end. */
static int skip_int_array(Rd *r, const unsigned char *base, Py_ssize_t *from, Py_ssize_t *to) {
    *from = r->p - base;
    Py_ssize_t k;
    if (rd_header(r, 0, &k) != OK) return FALLBACK;
    const unsigned char *p = r->p, *end = r->end;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (p >= end) return FALLBACK;
        unsigned size = INT_SIZE[*p]; /* a table, not a switch: ids of mixed widths mispredict less */
        if (size == 0 || end - p < (Py_ssize_t)size) return FALLBACK;
        p += size;
    }
    r->p = p;
    *to = p - base;
    return OK;
}

/* extra_keys that hold none: nil, or one nil per block (what vLLM 0.32 sends without LoRA,
 * multimodal inputs or a cache salt). Any key at all: FALLBACK. */
static int rd_no_extra_keys(Rd *r) {
    if (rd_nil(r)) return OK;
    Py_ssize_t k;
    if (rd_header(r, 0, &k) != OK) return FALLBACK;
    for (Py_ssize_t i = 0; i < k; i++)
        if (!rd_nil(r)) return FALLBACK;
    return OK;
}

/* Skip nil, an int or a string. */
static int skip_scalar(Rd *r) {
    if (rd_nil(r)) return OK;
    const char *s;
    Py_ssize_t len;
    int neg;
    uint64_t u;
    int64_t v;
    return rd_int(r, &neg, &u, &v) == OK || rd_str(r, &s, &len) == OK ? OK : FALLBACK;
}

static inline int key_is(const char *s, Py_ssize_t len, const char *name) {
    return (size_t)len == strlen(name) && memcmp(s, name, (size_t)len) == 0;
}

/* The event fields read here, and which each event type may carry (vLLM 0.32's structs,
 * vllm/distributed/kv_events.py). The last five the reference ignores (msgspec ignores fields its
 * structs lack); here they are skipped when their value is a scalar. */
enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX,
    F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, NF
};
static const char *const FIELD_NAMES[NF] = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                            "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                                            "ownership", "session_id"};
static Py_ssize_t FIELD_LENS[NF];

/* A key's field, or -1: its length first (one compare rules out most names), then its bytes. */
static int field_of(const char *k, Py_ssize_t klen) {
    for (int j = 0; j < NF; j++)
        if (FIELD_LENS[j] == klen && memcmp(k, FIELD_NAMES[j], (size_t)klen) == 0) return j;
    return -1;
}

#define BIT(f) (1u << (f))
static const unsigned STORED_ALLOWED = (1u << NF) - 1;
static const unsigned STORED_REQUIRED = BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_PARENT) | BIT(F_TOKENS) | BIT(F_BLOCK_SIZE);
static const unsigned REMOVED_ALLOWED =
    BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP_IDX) | BIT(F_LOCALITY) | BIT(F_OWNERSHIP);
static const unsigned REMOVED_REQUIRED = BIT(F_TYPE) | BIT(F_HASHES);
static const unsigned CLEARED_ALLOWED = BIT(F_TYPE) | BIT(F_MEDIUM);

enum { T_NONE, T_STORED, T_REMOVED, T_CLEARED };

/* The classes the records are built from (engines/kv_events.py, and the decoder's RawTokenIds),
 * passed by the caller, and a memoryview of the payload (token ids are RawTokenIds over a slice). */
enum { C_BATCH, C_STORED, C_REMOVED, C_CLEARED, C_RAW_IDS, N_CLASSES };
typedef struct {
    PyObject *cls[N_CLASSES];
    PyObject *view;
} Build;

static PyObject *raw_token_ids(const Build *b, Py_ssize_t from, Py_ssize_t to) {
    PyObject *slice = NULL, *lo = PyLong_FromSsize_t(from), *hi = PyLong_FromSsize_t(to);
    if (lo != NULL && hi != NULL) slice = PySlice_New(lo, hi, NULL);
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    if (slice == NULL) return NULL;
    PyObject *part = PyObject_GetItem(b->view, slice);
    Py_DECREF(slice);
    if (part == NULL) return NULL;
    PyObject *ids = PyObject_CallOneArg(b->cls[C_RAW_IDS], part);
    Py_DECREF(part);
    return ids;
}

/* A BlockRemoved's fields, handed back unbuilt when rd_events merges runs of removals. */
typedef struct {
    PyObject *hashes, *medium, *group;
} Removed;

/* One event map -> its record (fields in their declared order; absent optional ones None, as the
 * reference passes them), or with rem a BlockRemoved's fields unbuilt (*out then NULL). */
static int rd_event(Rd *r, const unsigned char *base, const Build *b, PyObject **out, Removed *rem) {
    Py_ssize_t nkeys;
    if (rd_header(r, 1, &nkeys) != OK) return FALLBACK;
    PyObject *v[NF] = {NULL};
    unsigned seen = 0;
    int kind = T_NONE, rc = FALLBACK;
    Py_ssize_t tok_from = 0, tok_to = 0;
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        const char *k;
        Py_ssize_t klen;
        if (rd_str(r, &k, &klen) != OK) goto done;
        int f = field_of(k, klen);
        if (f < 0 || (seen & BIT(f))) goto done; /* an unknown or repeated key */
        seen |= BIT(f);
        int got;
        switch (f) {
        case F_TYPE: {
            const char *s;
            Py_ssize_t len;
            got = rd_str(r, &s, &len);
            if (got == OK) {
                kind = key_is(s, len, "BlockStored") ? T_STORED
                       : key_is(s, len, "BlockRemoved") ? T_REMOVED
                       : key_is(s, len, "AllBlocksCleared") ? T_CLEARED
                                                             : T_NONE;
                if (kind == T_NONE) got = FALLBACK;
            }
            break;
        }
        case F_HASHES: got = rd_hashes(r, &v[f]); break;
        case F_PARENT: got = rd_opt_int(r, &v[f], 1, 1, 0); break;
        case F_TOKENS: got = skip_int_array(r, base, &tok_from, &tok_to); break;
        case F_BLOCK_SIZE: got = rd_opt_int(r, &v[f], 0, 1, 1); break;
        case F_LORA_ID: case F_GROUP_IDX: got = rd_opt_int(r, &v[f], 1, 0, 0); break;
        case F_MEDIUM: case F_LORA_NAME: got = rd_opt_str(r, &v[f]); break;
        case F_EXTRA_KEYS: got = rd_no_extra_keys(r); break;
        default: got = skip_scalar(r); break;
        }
        if (got != OK) {
            rc = got;
            goto done;
        }
    }
    unsigned allowed = kind == T_STORED ? STORED_ALLOWED : kind == T_REMOVED ? REMOVED_ALLOWED : CLEARED_ALLOWED;
    unsigned required = kind == T_STORED ? STORED_REQUIRED : kind == T_REMOVED ? REMOVED_REQUIRED : BIT(F_TYPE);
    if (kind == T_NONE || (seen & ~allowed) || (seen & required) != required) goto done;
    for (int j = 0; j < NF; j++)
        if (v[j] == NULL) v[j] = Py_NewRef(Py_None);
    if (rem != NULL && kind == T_REMOVED) {
        rem->hashes = Py_NewRef(v[F_HASHES]);
        rem->medium = Py_NewRef(v[F_MEDIUM]);
        rem->group = Py_NewRef(v[F_GROUP_IDX]);
        *out = NULL;
        rc = OK;
        goto done;
    }
    if (kind == T_STORED) {
        PyObject *ids = raw_token_ids(b, tok_from, tok_to);
        if (ids == NULL) {
            rc = FAIL;
            goto done;
        }
        PyObject *args[8] = {v[F_HASHES], v[F_PARENT], ids, v[F_BLOCK_SIZE], v[F_LORA_ID], v[F_MEDIUM],
                             v[F_LORA_NAME], v[F_GROUP_IDX]};
        *out = PyObject_Vectorcall(b->cls[C_STORED], args, 8, NULL);
        Py_DECREF(ids);
    } else if (kind == T_REMOVED) {
        PyObject *args[3] = {v[F_HASHES], v[F_MEDIUM], v[F_GROUP_IDX]};
        *out = PyObject_Vectorcall(b->cls[C_REMOVED], args, 3, NULL);
    } else {
        *out = PyObject_Vectorcall(b->cls[C_CLEARED], &v[F_MEDIUM], 1, NULL);
    }
    rc = *out == NULL ? FAIL : OK;
done:
    for (int j = 0; j < NF; j++) Py_XDECREF(v[j]);
    return rc;
}

/* The batch's ts: a float (64 or 32 bits) or an int, as msgspec reads a float field. */
static int rd_ts(Rd *r, double *ts) {
    if (!need(r, 1)) return FALLBACK;
    unsigned b = *r->p;
    if (b == 0xcb || b == 0xca) {
        int k = b == 0xcb ? 8 : 4;
        if (!need(r, 1 + k)) return FALLBACK;
        uint64_t raw = be(r->p + 1, k);
        if (k == 8) {
            memcpy(ts, &raw, 8);
        } else {
            uint32_t w = (uint32_t)raw;
            float f;
            memcpy(&f, &w, 4);
            *ts = f;
        }
        r->p += 1 + k;
        return OK;
    }
    int neg;
    uint64_t u = 0;
    int64_t s = 0;
    if (rd_int(r, &neg, &u, &s) != OK) return FALLBACK;
    *ts = neg ? (double)s : (double)u;
    return OK;
}

/* The run of removals merged so far as one BlockRemoved appended to events; the run is emptied. */
static int flush_removed(const Build *b, PyObject *events, PyObject **run, PyObject **medium, PyObject **group) {
    if (*run == NULL) return OK;
    PyObject *hashes = PyList_AsTuple(*run), *ev = NULL;
    if (hashes != NULL) {
        PyObject *args[3] = {hashes, *medium, *group};
        ev = PyObject_Vectorcall(b->cls[C_REMOVED], args, 3, NULL);
        Py_DECREF(hashes);
    }
    Py_CLEAR(*run);
    Py_CLEAR(*medium);
    Py_CLEAR(*group);
    if (ev == NULL) return FAIL;
    int rc = PyList_Append(events, ev) < 0 ? FAIL : OK;
    Py_DECREF(ev);
    return rc;
}

/* Events as a tuple of records. With merge: each run of consecutive BlockRemoved events of one
 * medium and group as one record, their hashes in order (engines/kv_event_codec.py merge_removed:
 * vLLM sends one removal per evicted block). */
static int rd_events(Rd *r, const unsigned char *base, const Build *b, int merge, PyObject **out) {
    Py_ssize_t k;
    if (rd_header(r, 0, &k) != OK || r->end - r->p < k) return FALLBACK;
    if (!merge) {
        PyObject *t = PyTuple_New(k);
        if (t == NULL) return FAIL;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *e = NULL;
            int rc = rd_event(r, base, b, &e, NULL);
            if (rc != OK) {
                Py_DECREF(t);
                return rc;
            }
            PyTuple_SET_ITEM(t, i, e);
        }
        *out = t;
        return OK;
    }
    PyObject *events = PyList_New(0), *run = NULL, *medium = NULL, *group = NULL;
    if (events == NULL) return FAIL;
    int rc = OK;
    for (Py_ssize_t i = 0; i < k && rc == OK; i++) {
        PyObject *e = NULL;
        Removed rem = {NULL, NULL, NULL};
        if ((rc = rd_event(r, base, b, &e, &rem)) != OK) break;
        if (e != NULL) { /* not a removal: the run so far, then it */
            if ((rc = flush_removed(b, events, &run, &medium, &group)) == OK && PyList_Append(events, e) < 0) rc = FAIL;
            Py_DECREF(e);
            continue;
        }
        int same = 0;
        if (run != NULL) {
            int m = PyObject_RichCompareBool(rem.medium, medium, Py_EQ);
            int g = m == 1 ? PyObject_RichCompareBool(rem.group, group, Py_EQ) : m;
            if (m < 0 || g < 0) rc = FAIL;
            same = m == 1 && g == 1;
        }
        if (rc == OK && !same && (rc = flush_removed(b, events, &run, &medium, &group)) == OK) {
            if ((run = PyList_New(0)) == NULL) {
                rc = FAIL;
            } else {
                medium = Py_NewRef(rem.medium);
                group = Py_NewRef(rem.group);
            }
        }
        if (rc == OK && PyList_SetSlice(run, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, rem.hashes) < 0) rc = FAIL;
        Py_DECREF(rem.hashes);
        Py_DECREF(rem.medium);
        Py_DECREF(rem.group);
    }
    if (rc == OK) rc = flush_removed(b, events, &run, &medium, &group);
    Py_XDECREF(run);
    Py_XDECREF(medium);
    Py_XDECREF(group);
    if (rc == OK && (*out = PyList_AsTuple(events)) == NULL) rc = FAIL;
    Py_DECREF(events);
    return rc;
}

/* kv_batch(payload, classes, merge) -> KVEventBatch | None
 *
 * classes: (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, RawTokenIds). The records
 * of payload when it is in the subset above, else None. */
PyObject *kv_batch(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "kv_batch(payload, classes, merge)");
        return NULL;
    }
    int merge = PyObject_IsTrue(args[2]);
    if (merge < 0) return NULL;
    if (!PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != N_CLASSES) {
        PyErr_SetString(PyExc_TypeError,
                        "kv_batch's classes: (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, RawTokenIds)");
        return NULL;
    }
    Build build;
    for (int i = 0; i < N_CLASSES; i++) build.cls[i] = PyTuple_GET_ITEM(args[1], i);
    if ((build.view = PyMemoryView_FromObject(args[0])) == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(build.view);
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)view.buf;
    Rd r = {base, base + view.len};
    double ts = 0;
    PyObject *events = NULL, *rank = NULL, *out = NULL;
    int rc = FALLBACK;
    Py_ssize_t n;
    if (need(&r, 1) && ((*r.p >= 0x90 && *r.p <= 0x9f) || *r.p == 0xdc || *r.p == 0xdd)) {
        if (rd_header(&r, 0, &n) != OK || n < 2 || n > 3) goto done;
        if ((rc = rd_ts(&r, &ts)) != OK || (rc = rd_events(&r, base, &build, merge, &events)) != OK) goto done;
        if (n == 3 && (rc = rd_opt_int(&r, &rank, 1, 0, 0)) != OK) goto done;
    } else {
        if (rd_header(&r, 1, &n) != OK) goto done;
        int have_ts = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const char *k;
            Py_ssize_t klen;
            rc = FALLBACK;
            if (rd_str(&r, &k, &klen) != OK) goto done;
            if (key_is(k, klen, "ts") && !have_ts) {
                have_ts = 1;
                rc = rd_ts(&r, &ts);
            } else if (key_is(k, klen, "events") && events == NULL) {
                rc = rd_events(&r, base, &build, merge, &events);
            } else if (key_is(k, klen, "data_parallel_rank") && rank == NULL) {
                rc = rd_opt_int(&r, &rank, 1, 0, 0);
            }
            if (rc != OK) goto done;
        }
        rc = FALLBACK;
        if (!have_ts || events == NULL) goto done;
    }
    rc = FALLBACK;
    if (r.p != r.end) goto done; /* trailing bytes */
    PyObject *fts = PyFloat_FromDouble(ts);
    if (fts != NULL) {
        PyObject *bargs[3] = {fts, events, rank == NULL ? Py_None : rank};
        out = PyObject_Vectorcall(build.cls[C_BATCH], bargs, 3, NULL);
        Py_DECREF(fts);
    }
    rc = out == NULL ? FAIL : OK;
done:
    PyBuffer_Release(&view);
    Py_DECREF(build.view);
    Py_XDECREF(events);
    Py_XDECREF(rank);
    if (rc == FAIL) return NULL;
    if (rc == FALLBACK) Py_RETURN_NONE;
    return out;
}

/* The tables kv_batch reads, filled once at module init. */
void kv_batch_init(void) {
    for (int b = 0; b < 256; b++) INT_SIZE[b] = (b <= 0x7f || b >= 0xe0) ? 1 : 0;
    INT_SIZE[0xcc] = INT_SIZE[0xd0] = 2;
    INT_SIZE[0xcd] = INT_SIZE[0xd1] = 3;
    INT_SIZE[0xce] = INT_SIZE[0xd2] = 5;
    INT_SIZE[0xcf] = INT_SIZE[0xd3] = 9;
    for (int j = 0; j < NF; j++) FIELD_LENS[j] = (Py_ssize_t)strlen(FIELD_NAMES[j]);
}
