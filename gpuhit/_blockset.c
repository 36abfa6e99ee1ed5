/* gpuhit._speedups.BlockSet: the precise KV index's set of block hashes (part of the C speedups,
 * built with _speedups.c into one extension; gateway/kv_tiers.py ChainTier uses it).
 *
 * Why: the precise index takes every block an engine stores or evicts. Once an engine's cache is
 * full, each new 2k-token prompt is 128 hashes in and 128 out, in sets of hundreds of thousands to
 * millions of hashes. A Python set keeps a 16-byte slot and a 32-byte int object per hash: an insert
 * is one cache miss (and, in a VM, a nested page walk), a removal three (the slot, the stored int it
 * compares with, the free of that int), one after another; and it grows by rehashing everything while
 * the cache fills, then again to purge deleted slots while it churns. Here:
 *
 *   - a key is a bare uint64 in an open-addressing table (Fibonacci hashing, linear probing, load at
 *     most 1/2), one 8-byte slot per hash and no object;
 *   - deletion shifts the rest of the run back (no tombstones), so a full cache that churns never
 *     rehashes, and reserve() sizes the table for an engine's capacity up front;
 *   - the batch operations (update, difference_update, issuperset: what the index calls, a whole
 *     KV event at a time) convert a batch of keys, prefetch all their home slots, then probe: the
 *     misses overlap instead of queueing;
 *   - a table of 2 MiB or more is mapped with MADV_HUGEPAGE where the kernel offers transparent huge
 *     pages on request, so its random probes do not also miss the TLB (advice: the table works the
 *     same without it).
 *
 * Members are ints in [0, 2**64) (vLLM's block hashes as its KV events carry them, and the
 * gateway's own); for them every answer is a Python set's (tests/gateway/test_blockset.py holds the
 * two to that over random operations). Any other object is never a member; adding one raises
 * ValueError. Slot value 0 means empty: the key 0 lives in a flag. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define BS_MIN_CAPACITY 64
#define BS_FIB 0x9E3779B97F4A7C15ULL
#define BS_BATCH 32                 /* keys converted and prefetched together */
#define BS_HUGE_BYTES (2u << 20)    /* tables this large are mapped (huge-page advice), smaller ones calloc'd */

typedef struct {
    PyObject_HEAD
    uint64_t *keys;
    Py_ssize_t mask; /* capacity - 1 (capacity a power of two) */
    int shift;       /* 64 - log2(capacity): Fibonacci hashing keeps the product's top bits */
    int has_zero;
    Py_ssize_t used; /* non-zero keys stored */
} BlockSet;

static inline Py_ssize_t bs_home(const BlockSet *s, uint64_t k) {
    return (Py_ssize_t)((k * BS_FIB) >> s->shift);
}

/* 1 and the key in *out for an int in [0, 2**64); 0 (no error set) for anything else. */
static inline int bs_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) return 0;
#if PY_VERSION_HEX < 0x030C0000
    /* CPython 3.11's int layout: the sign in Py_SIZE, |size| digits of PyLong_SHIFT bits, least
     * significant first. PyLong_AsUnsignedLongLong takes a generic byte-array path for anything
     * above one digit (every real block hash), ~5x this loop. */
    Py_ssize_t n = Py_SIZE(o);
    if (n < 0) return 0;
    const digit *d = ((PyLongObject *)o)->ob_digit;
    uint64_t x = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (x >> (64 - PyLong_SHIFT)) return 0; /* the shift would overflow 64 bits */
        x = (x << PyLong_SHIFT) | d[i];
    }
    *out = x;
    return 1;
#else
    if (_PyLong_Sign(o) < 0) return 0;
    if ((uint64_t)_PyLong_NumBits(o) > 64) {
        PyErr_Clear(); /* an error here means "too large to count": not a key either */
        return 0;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    return 1;
#endif
}

static int bs_key_or_raise(PyObject *o, uint64_t *k) {
    if (bs_key(o, k)) return 0;
    PyErr_Format(PyExc_ValueError, "a block hash is an int in [0, 2**64), got %R", o);
    return -1;
}

/* ---------------------------------------------------------------- the table's memory */

static uint64_t *bs_table_alloc(Py_ssize_t capacity) {
    size_t bytes = (size_t)capacity * sizeof(uint64_t);
    if (bytes < BS_HUGE_BYTES) return PyMem_Calloc((size_t)capacity, sizeof(uint64_t));
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); /* zeroed */
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice only: refused (THP "never"), the table is the same */
#endif
    return (uint64_t *)p;
}

static void bs_table_free(uint64_t *keys, Py_ssize_t capacity) {
    size_t bytes = (size_t)capacity * sizeof(uint64_t);
    if (bytes < BS_HUGE_BYTES)
        PyMem_Free(keys);
    else
        munmap(keys, bytes);
}

/* Point s at a new empty table of capacity slots; -1 (MemoryError) leaves s as it was. */
static int bs_table_new(BlockSet *s, Py_ssize_t capacity) {
    uint64_t *keys = bs_table_alloc(capacity);
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int bits = 0;
    while (((Py_ssize_t)1 << bits) < capacity) bits++;
    s->keys = keys;
    s->mask = capacity - 1;
    s->shift = 64 - bits;
    s->used = 0;
    return 0;
}

/* The smallest capacity that holds n keys at a load of at most 1/2. */
static Py_ssize_t bs_capacity_for(Py_ssize_t n) {
    Py_ssize_t c = BS_MIN_CAPACITY;
    while (c / 2 < n) c <<= 1;
    return c;
}

/* ---------------------------------------------------------------- the probes (k != 0) */

static inline int bs_insert(BlockSet *s, uint64_t k) { /* 1 added, 0 present; the table has room */
    uint64_t *keys = s->keys;
    Py_ssize_t i = bs_home(s, k);
    for (;;) {
        uint64_t cur = keys[i];
        if (cur == 0) {
            keys[i] = k;
            s->used++;
            return 1;
        }
        if (cur == k) return 0;
        i = (i + 1) & s->mask;
    }
}

static inline int bs_has(const BlockSet *s, uint64_t k) {
    const uint64_t *keys = s->keys;
    Py_ssize_t i = bs_home(s, k);
    for (;;) {
        uint64_t cur = keys[i];
        if (cur == k) return 1;
        if (cur == 0) return 0;
        i = (i + 1) & s->mask;
    }
}

/* Remove k; 1 if it was there. Backward-shift deletion: each later key of the run moves into the
 * hole unless its home slot lies cyclically in (hole, its slot], so every lookup stays exact. */
static inline int bs_delete(BlockSet *s, uint64_t k) {
    uint64_t *keys = s->keys;
    Py_ssize_t mask = s->mask, i = bs_home(s, k);
    for (;;) {
        uint64_t cur = keys[i];
        if (cur == 0) return 0;
        if (cur == k) break;
        i = (i + 1) & mask;
    }
    Py_ssize_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t cur = keys[j];
        if (cur == 0) break;
        Py_ssize_t home = bs_home(s, cur);
        if (hole <= j ? (hole < home && home <= j) : (hole < home || home <= j)) continue;
        keys[hole] = cur;
        hole = j;
    }
    keys[hole] = 0;
    s->used--;
    return 1;
}

/* The same for any key, 0 included (kept in a flag, not the table). */
static inline int bs_has_key(const BlockSet *s, uint64_t k) { return k == 0 ? s->has_zero : bs_has(s, k); }

static inline void bs_put_key(BlockSet *s, uint64_t k) { /* the table has room */
    if (k == 0)
        s->has_zero = 1;
    else
        bs_insert(s, k);
}

static inline int bs_drop_key(BlockSet *s, uint64_t k) {
    if (k != 0) return bs_delete(s, k);
    int had = s->has_zero;
    s->has_zero = 0;
    return had;
}

/* Rehash into a table of capacity slots (larger than used * 2). */
static int bs_resize(BlockSet *s, Py_ssize_t capacity) {
    uint64_t *old = s->keys;
    Py_ssize_t old_cap = s->mask + 1, old_used = s->used;
    int old_shift = s->shift;
    if (bs_table_new(s, capacity) < 0) {
        s->keys = old;
        s->mask = old_cap - 1;
        s->shift = old_shift;
        s->used = old_used;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_cap; i++)
        if (old[i]) bs_insert(s, old[i]);
    bs_table_free(old, old_cap);
    return 0;
}

/* Room for extra more keys without passing a load of 1/2. */
static int bs_make_room(BlockSet *s, Py_ssize_t extra) {
    if (2 * (s->used + extra) <= s->mask + 1) return 0;
    return bs_resize(s, bs_capacity_for(s->used + extra));
}

/* ---------------------------------------------------------------- batches */

enum { BS_ADD, BS_DISCARD, BS_HAS_ALL };

/* Apply op to every item of a sequence: BS_ADD (any non-key raises ValueError), BS_DISCARD (non-keys
 * ignored), BS_HAS_ALL (answers 1 when every item is a member, 0 at the first that is not). Keys
 * are converted and their home slots prefetched BS_BATCH at a time before any is probed. Answers
 * -1 on error. */
static int bs_batch(BlockSet *s, PyObject *items, int op) {
    PyObject *seq = PySequence_Fast(items, "a BlockSet batch takes an iterable of block hashes");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **it = PySequence_Fast_ITEMS(seq);
    int answer = 1;
    uint64_t ks[BS_BATCH];
    for (Py_ssize_t at = 0; at < n && answer == 1; at += BS_BATCH) {
        Py_ssize_t m = n - at < BS_BATCH ? n - at : BS_BATCH, got = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t k;
            if (!bs_key(it[at + j], &k)) {
                if (op == BS_ADD) {
                    (void)bs_key_or_raise(it[at + j], &k);
                    answer = -1;
                    break;
                }
                if (op == BS_HAS_ALL) {
                    answer = 0;
                    break;
                }
                continue; /* BS_DISCARD: never a member */
            }
            ks[got++] = k;
        }
        if (answer != 1) break;
        if (op == BS_ADD && bs_make_room(s, got) < 0) {
            answer = -1;
            break;
        }
        if (op == BS_HAS_ALL)
            for (Py_ssize_t j = 0; j < got; j++) __builtin_prefetch(&s->keys[bs_home(s, ks[j])], 0);
        else
            for (Py_ssize_t j = 0; j < got; j++) __builtin_prefetch(&s->keys[bs_home(s, ks[j])], 1);
        for (Py_ssize_t j = 0; j < got; j++) {
            if (op == BS_ADD)
                bs_put_key(s, ks[j]);
            else if (op == BS_DISCARD)
                bs_drop_key(s, ks[j]);
            else if (!bs_has_key(s, ks[j])) {
                answer = 0;
                break;
            }
        }
    }
    Py_DECREF(seq);
    return answer;
}

/* ---------------------------------------------------------------- the type */

static PyObject *BlockSet_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t reserve = 0;
    static char *kwlist[] = {"reserve", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:BlockSet", kwlist, &reserve)) return NULL;
    if (reserve < 0) {
        PyErr_Format(PyExc_ValueError, "reserve takes a count of hashes >= 0, got %zd", reserve);
        return NULL;
    }
    BlockSet *s = (BlockSet *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    if (bs_table_new(s, bs_capacity_for(reserve)) < 0) {
        s->keys = NULL;
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void BlockSet_dealloc(BlockSet *s) {
    if (s->keys != NULL) bs_table_free(s->keys, s->mask + 1);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static Py_ssize_t BlockSet_len(BlockSet *s) { return s->used + s->has_zero; }

static int BlockSet_contains(BlockSet *s, PyObject *o) {
    uint64_t k;
    return bs_key(o, &k) && bs_has_key(s, k);
}

static PyObject *BlockSet_add(BlockSet *s, PyObject *o) {
    uint64_t k;
    if (bs_key_or_raise(o, &k) < 0 || bs_make_room(s, 1) < 0) return NULL;
    bs_put_key(s, k);
    Py_RETURN_NONE;
}

static PyObject *BlockSet_remove(BlockSet *s, PyObject *o) {
    uint64_t k;
    if (!bs_key(o, &k) || !bs_drop_key(s, k)) {
        PyErr_SetObject(PyExc_KeyError, o);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *BlockSet_discard(BlockSet *s, PyObject *o) {
    uint64_t k;
    if (bs_key(o, &k)) bs_drop_key(s, k);
    Py_RETURN_NONE;
}

static PyObject *BlockSet_update(BlockSet *s, PyObject *items) {
    if (bs_batch(s, items, BS_ADD) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *BlockSet_difference_update(BlockSet *s, PyObject *items) {
    if (bs_batch(s, items, BS_DISCARD) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *BlockSet_issuperset(BlockSet *s, PyObject *items) {
    int r = bs_batch(s, items, BS_HAS_ALL);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *BlockSet_clear(BlockSet *s, PyObject *Py_UNUSED(ignored)) {
    memset(s->keys, 0, (size_t)(s->mask + 1) * sizeof(uint64_t)); /* the capacity stays: a cache refills */
    s->used = 0;
    s->has_zero = 0;
    Py_RETURN_NONE;
}

static PyObject *BlockSet_reserve(BlockSet *s, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "reserve takes a count of hashes >= 0, got %zd", n);
        return NULL;
    }
    Py_ssize_t cap = bs_capacity_for(n);
    if (cap > s->mask + 1 && bs_resize(s, cap) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *BlockSet_capacity(BlockSet *s, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(s->mask + 1);
}

/* Iteration (tests, debugging, KVIndex.cached): over a list of the keys taken now, so the set may
 * change while it is iterated. */
static PyObject *BlockSet_iter(BlockSet *s) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = -1; i <= s->mask; i++) {
        uint64_t k;
        if (i < 0) {
            if (!s->has_zero) continue;
            k = 0;
        } else if ((k = s->keys[i]) == 0) {
            continue;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(k);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyObject *iter = PyObject_GetIter(out);
    Py_DECREF(out);
    return iter;
}

static PySequenceMethods BlockSet_as_sequence = {
    .sq_length = (lenfunc)BlockSet_len,
    .sq_contains = (objobjproc)BlockSet_contains,
};

static PyMethodDef BlockSet_methods[] = {
    {"add", (PyCFunction)BlockSet_add, METH_O, "add(h): store block hash h (an int in [0, 2**64))."},
    {"remove", (PyCFunction)BlockSet_remove, METH_O, "remove(h): drop h; KeyError if absent."},
    {"discard", (PyCFunction)BlockSet_discard, METH_O, "discard(h): drop h if present."},
    {"update", (PyCFunction)BlockSet_update, METH_O, "update(hashes): store each hash."},
    {"difference_update", (PyCFunction)BlockSet_difference_update, METH_O,
     "difference_update(hashes): drop each hash present."},
    {"issuperset", (PyCFunction)BlockSet_issuperset, METH_O, "issuperset(items): every item is stored."},
    {"clear", (PyCFunction)BlockSet_clear, METH_NOARGS, "clear(): drop every hash (the capacity stays)."},
    {"reserve", (PyCFunction)BlockSet_reserve, METH_O,
     "reserve(n): size the table for n hashes now (no rehash while it fills up to n)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockSet_getset[] = {
    {"capacity", (getter)BlockSet_capacity, NULL, "slots in the table (kept at a load of at most 1/2)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BlockSetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuhit._speedups.BlockSet",
    .tp_basicsize = sizeof(BlockSet),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockSet(reserve=0): a set of uint64 block hashes (the precise KV index's tiers).",
    .tp_new = BlockSet_new,
    .tp_dealloc = (destructor)BlockSet_dealloc,
    .tp_as_sequence = &BlockSet_as_sequence,
    .tp_iter = (getiterfunc)BlockSet_iter,
    .tp_methods = BlockSet_methods,
    .tp_getset = BlockSet_getset,
};

/* Called by PyInit__speedups: BlockSet into the module. */
int blockset_add_type(PyObject *module) {
    if (PyType_Ready(&BlockSetType) < 0) return -1;
    Py_INCREF(&BlockSetType);
    if (PyModule_AddObject(module, "BlockSet", (PyObject *)&BlockSetType) < 0) {
        Py_DECREF(&BlockSetType);
        return -1;
    }
    return 0;
}
