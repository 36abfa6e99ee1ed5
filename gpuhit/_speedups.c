/* gpuhit._speedups: the gateway's hot parsers in C (optional; `make compile`, gpuhit/speedups.py).
 *
 * Why C: with a new prompt per request, a profile of the gateway spends most of its prompt-specific
 * time in two loops over numbers it mostly does not keep (analysis/results/router-speed.md):
 *
 *   parse_uint_array  a completions body's token-id array, JSON text -> uint64 buffer, validated
 *                     as it is parsed, 64 bytes at a time where it holds only digits and commas
 *                     (numpy needs ~6 whole-array passes to validate, orjson makes a Python int of
 *                     every id);
 *   kv_batch          a vLLM KV-event batch (msgpack) -> its records, BlockStored's token ids left
 *                     as bytes (msgspec walks them element by element to skip them);
 *   usage_object      the usage object of an engine's JSON answer, from its tail (orjson builds
 *                     the whole answer, choices and message included, to read five numbers);
 *   chunk_hashes      the approximate index's chained text-chunk hashes (BLAKE2b-64 from RFC 7693:
 *                     hashlib costs a Python call and an object per 64-byte chunk).
 *
 * And one type, in _blockset.c (built into this extension): BlockSet, the precise KV index's set of
 * block hashes; and vLLM's sha256 block-hash chain, in _sha256.c.
 *
 * The parsers accept a strict subset of their input and answer None for anything outside it, so the
 * pure-Python path (which they only speed up) keeps deciding every error and every unusual shape:
 * the result is, by construction and by differential tests (tests/gateway/test_speedups.py),
 * exactly what the Python path gives. SOURCE_SHA256 (the digest of this file and _blockset.c, set by
 * the build) lets the loader refuse a build older than its sources.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 ""
#endif

/* ------------------------------------------------------------------ JSON token-id array */

#define MAX_DIGITS 18 /* every 18-digit integer is below 2**63: int64 and uint64 agree */

#define HIGH_NIBBLES 0xF0F0F0F0F0F0F0F0ULL
#define THREES 0x3030303030303030ULL
#define SIXES 0x0606060606060606ULL

/* 8 bytes read as a little-endian integer (the first byte lowest). */
static inline uint64_t le64(uint64_t x) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(x);
#else
    return x;
#endif
}

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Per byte of 8 (little-endian: the first byte lowest), nonzero where it is not an ASCII digit. A
 * byte is a digit iff its high nibble is 3 and adding 6 keeps it so (a carry out of a non-digit
 * byte can only mark bytes above it, never the lowest non-digit one). */
static inline uint64_t non_digits(uint64_t chunk) {
    return ((chunk & HIGH_NIBBLES) ^ THREES) | (((chunk + SIXES) & HIGH_NIBBLES) ^ THREES);
}

/* The value of the first len (1..7) bytes of chunk, all digits, most significant first (SWAR). */
static inline uint64_t digits_value(uint64_t chunk, int len) {
    uint64_t x = (chunk - THREES) << (8 * (8 - len)); /* the digits in the top bytes, zeros below */
    x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
    x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
    return (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
}

/* How many bytes of [p, end) are ',', one at a time (below, SSE2 takes 16 at a time where it can). */
static Py_ssize_t count_commas_bytewise(const unsigned char *p, const unsigned char *end) {
    Py_ssize_t total = 0;
    for (; p < end; p++) total += *p == ',';
    return total;
}

#if defined(__SSE2__) && defined(__x86_64__)
#include <emmintrin.h>
#define HAVE_BLOCKS 1
/* The 64 bytes at p classified: bit i of *commas set where p[i] is ',', of *digits where it is an
 * ASCII digit ((p[i] - '0') as an unsigned byte is at most 9: min(x, 9) == x). SSE2, which every
 * x86-64 has. */
static inline void classify64(const unsigned char *p, uint64_t *commas, uint64_t *digits) {
    const __m128i comma = _mm_set1_epi8(','), zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9);
    uint64_t c = 0, d = 0;
    for (int k = 0; k < 4; k++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(p + 16 * k));
        __m128i t = _mm_sub_epi8(x, zero);
        c |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, comma)) << (16 * k);
        d |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(t, nine), t)) << (16 * k);
    }
    *commas = c;
    *digits = d;
}

/* How many bytes of [p, end) are ','. SSE2: per 16 bytes a compare and a byte-wise subtract (a
 * match is -1) into 16 byte counters, summed (psadbw) before they can overflow. */
static Py_ssize_t count_commas(const unsigned char *p, const unsigned char *end) {
    const __m128i comma = _mm_set1_epi8(','), zero = _mm_setzero_si128();
    Py_ssize_t total = 0;
    while (end - p >= 16) {
        __m128i acc = zero;
        for (int k = 0; k < 255 && end - p >= 16; k++, p += 16)
            acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)p), comma));
        __m128i sums = _mm_sad_epu8(acc, zero); /* two 64-bit lane sums */
        total += (Py_ssize_t)(_mm_cvtsi128_si64(sums) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums)));
    }
    return total + count_commas_bytewise(p, end);
}
#else
#define HAVE_BLOCKS 0
#define count_commas count_commas_bytewise
#endif

/* parse_uint_array(buf, start, stop) -> bytearray | None
 *
 * buf[start:stop] is the text between a JSON array's brackets. When it is exactly
 * ws* int ws* ("," ws* int ws*)*, every int a non-negative JSON integer (no sign, no leading zero,
 * no fraction or exponent) of at most 18 digits, answer the integers as native uint64 (a bytearray
 * for numpy.frombuffer); else None. The same language as gateway.http.prompt._validated. */
static PyObject *parse_uint_array(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "parse_uint_array(buf, start, stop) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t stop = PyLong_AsSsize_t(args[2]);
    if (stop == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    if (start < 0 || stop < start || stop > view.len) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "range %zd:%zd outside a buffer of %zd bytes", start, stop, view.len);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + start;
    const unsigned char *end = (const unsigned char *)view.buf + stop;
    /* A valid array holds one number more than it has commas: its exact size, so that the buffer
     * is allocated once at the size it keeps. (An upper bound such as one number per two bytes
     * makes a 100k-token prompt's buffer 2.5 MB, always above glibc's adaptive mmap threshold:
     * every call then maps fresh pages and faults them in, ~40% of the parse.) */
    Py_ssize_t cap = p < end ? count_commas(p, end) + 1 : 0;
    if (cap == 0) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t *dst = (uint64_t *)PyByteArray_AS_STRING(out);
    Py_ssize_t n = 0;
    int ok = 0;
#if HAVE_BLOCKS
    /* The common shape, 64 bytes at a time while 80 remain: when a block holds only digits and
     * commas, its commas' bit mask says where every number in it ends, so each number's length is
     * known without reading the one before it and the numbers are converted independently (the
     * 8-byte loop below must find each length before it can read the next number: a chain of
     * dependent loads). A number of 1-7 digits without a leading zero is taken; the block's last
     * number, cut by its end, starts the next block. Anything else (whitespace, a long number, a
     * leading zero, no comma in 64 bytes) leaves p at the start of a number not yet taken, for the
     * loops below, so all of them accept exactly the same language. */
    while (end - p >= 80) {
        uint64_t commas, digits;
        classify64(p, &commas, &digits);
        if ((commas | digits) != ~0ULL || commas == 0) break;
        const unsigned char *s = p; /* the start of the next number */
        int bad = 0;
        do {
            const unsigned char *q = p + __builtin_ctzll(commas); /* its comma */
            Py_ssize_t len = q - s;
            if (len < 1 || len > 7 || (*s == '0' && len > 1)) {
                bad = 1;
                break;
            }
            uint64_t chunk; /* s + 8 <= p + 72 <= end */
            memcpy(&chunk, s, 8);
            dst[n++] = digits_value(le64(chunk), (int)len);
            s = q + 1;
            commas &= commas - 1;
        } while (commas);
        p = s;
        if (bad) break;
    }
#endif
    /* The common shape again, while 16 bytes remain: a number of 1-7 digits right at p, then a
     * comma. No bound checks inside (its 8 bytes and the comma lie before end), the digit run and
     * the separator read from one 8-byte load. Anything else (whitespace, a long number, a leading
     * zero, the last number) leaves this loop at the start of a number, for the general loop below
     * to take from there, so both loops accept exactly the same language. */
    while (end - p >= 16) {
        uint64_t chunk;
        memcpy(&chunk, p, 8);
        chunk = le64(chunk);
        uint64_t other = non_digits(chunk);
        if ((other & 0xFF) || other == 0) break; /* not a digit here, or 8+ digits */
        int len = __builtin_ctzll(other) >> 3;   /* 1..7 */
        if (((chunk >> (8 * len)) & 0xFF) != ',' || ((chunk & 0xFF) == '0' && len > 1)) break;
        dst[n++] = digits_value(chunk, len);
        p += len + 1;
    }
    for (;;) {
        while (p < end && is_ws(*p)) p++;
        if (p == end || (unsigned)(*p - '0') > 9) break; /* a number must come here */
        uint64_t v;
        int len = 0;
        if (end - p >= 8) {
            /* 8 bytes at once (SWAR): the digit run's length, then its value, without a branch per
             * digit. */
            uint64_t chunk;
            memcpy(&chunk, p, 8);
            chunk = le64(chunk);
            uint64_t other = non_digits(chunk);
            len = other ? __builtin_ctzll(other) / 8 : 8; /* >= 1: the first byte is a digit */
            if (len < 8) {
                v = digits_value(chunk, len);
                if (*p == '0' && len > 1) break; /* a leading zero */
                p += len;
            }
        }
        if (len == 0 || len == 8) { /* near the end, or a long number: digit by digit */
            const unsigned char *first = p;
            v = (uint64_t)(*p++ - '0');
            if (v == 0 && p < end && (unsigned)(*p - '0') <= 9) break; /* a leading zero */
            while (p < end && (unsigned)(*p - '0') <= 9) v = v * 10 + (uint64_t)(*p++ - '0');
            if (p - first > MAX_DIGITS) break;
        }
        dst[n++] = v;
        if (p < end && *p == ',') { /* the common case: no whitespace */
            p++;
            continue;
        }
        while (p < end && is_ws(*p)) p++;
        if (p == end) {
            ok = 1;
            break;
        }
        if (*p != ',') break;
        p++;
    }
    PyBuffer_Release(&view);
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (PyByteArray_Resize(out, n * (Py_ssize_t)sizeof(uint64_t)) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* ------------------------------------------------------------------ msgpack KV-event batch */

/* Every reader returns OK, FALLBACK (the input is outside the subset handled here, or malformed:
 * the caller answers None and the Python decoder decides) or FAIL (a Python exception is set). */
enum { OK = 0, FALLBACK = 1, FAIL = -1 };

typedef struct {
    const unsigned char *p, *end;
} Rd;

static inline int need(Rd *r, Py_ssize_t k) { return r->end - r->p >= k; }

static inline uint64_t be(const unsigned char *p, int k) {
    uint64_t v = 0;
    for (int i = 0; i < k; i++) v = (v << 8) | p[i];
    return v;
}

/* A msgpack integer: *neg = 1 with the value in *s when negative, else *u. */
static int rd_int(Rd *r, int *neg, uint64_t *u, int64_t *s) {
    if (!need(r, 1)) return FALLBACK;
    unsigned b = *r->p;
    int k;
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
    switch (b) {
    case 0xcc: k = 1; break;
    case 0xcd: k = 2; break;
    case 0xce: k = 4; break;
    case 0xcf: k = 8; break;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        k = 1 << (b - 0xd0);
        if (!need(r, 1 + k)) return FALLBACK;
        uint64_t raw = be(r->p + 1, k);
        int64_t v;
        if (k == 1) v = (int8_t)raw;
        else if (k == 2) v = (int16_t)raw;
        else if (k == 4) v = (int32_t)raw;
        else v = (int64_t)raw;
        r->p += 1 + k;
        if (v < 0) {
            *neg = 1;
            *s = v;
        } else {
            *u = (uint64_t)v;
        }
        return OK;
    }
    default: return FALLBACK;
    }
    if (!need(r, 1 + k)) return FALLBACK;
    *u = be(r->p + 1, k);
    r->p += 1 + k;
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
    } else if (b == 0xd9 || b == 0xda || b == 0xdb) {
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

/* nil -> None; an int -> a Python int (non-negative only when nonneg, positive only when positive). */
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

/* The last few short strings decoded (an event's medium: "GPU" / "CPU", its lora_name), kept: each
 * of vLLM's one-block BlockRemoved events carries its medium, which then costs no new string. */
#define STR_CACHE 4
#define STR_CACHE_MAX 16
static char str_cache_bytes[STR_CACHE][STR_CACHE_MAX];
static Py_ssize_t str_cache_len[STR_CACHE];
static PyObject *str_cache_obj[STR_CACHE];
static int str_cache_next;

static PyObject *cached_str(const char *s, Py_ssize_t len) {
    if (len > STR_CACHE_MAX) return PyUnicode_DecodeUTF8(s, len, NULL);
    for (int i = 0; i < STR_CACHE; i++)
        if (str_cache_obj[i] != NULL && str_cache_len[i] == len && memcmp(str_cache_bytes[i], s, (size_t)len) == 0)
            return Py_NewRef(str_cache_obj[i]);
    PyObject *o = PyUnicode_DecodeUTF8(s, len, NULL);
    if (o == NULL) return NULL;
    int i = str_cache_next;
    str_cache_next = (i + 1) % STR_CACHE;
    Py_XSETREF(str_cache_obj[i], Py_NewRef(o));
    memcpy(str_cache_bytes[i], s, (size_t)len);
    str_cache_len[i] = len;
    return o;
}

static int rd_opt_str(Rd *r, PyObject **out) {
    if (rd_nil(r)) {
        *out = Py_NewRef(Py_None);
        return OK;
    }
    const char *s;
    Py_ssize_t len;
    if (rd_str(r, &s, &len) != OK) return FALLBACK;
    *out = cached_str(s, len);
    if (*out == NULL) { /* not UTF-8: the Python decoder says what is wrong */
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

/* The encoded size of a msgpack int by its first byte; 0: not an int. */
static unsigned char INT_SIZE[256];

static void init_int_size(void) {
    for (int b = 0; b < 256; b++) INT_SIZE[b] = (b <= 0x7f || b >= 0xe0) ? 1 : 0;
    INT_SIZE[0xcc] = INT_SIZE[0xd0] = 2;
    INT_SIZE[0xcd] = INT_SIZE[0xd1] = 3;
    INT_SIZE[0xce] = INT_SIZE[0xd2] = 5;
    INT_SIZE[0xcf] = INT_SIZE[0xd3] = 9;
}

/* Skip an array of ints (BlockStored.token_ids): (offset of its header, offset past it). */
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

/* The event fields this decoder reads, and which each event type may carry (vLLM 0.32's structs,
 * vllm/distributed/kv_events.py). The last five the Python decoder ignores, as msgspec ignores fields
 * its structs lack; here they are skipped when their value is nil, an int or a string. */
enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX,
    F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, NF
};
static const char *const FIELD_NAMES[NF] = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                            "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                                            "ownership", "session_id"};
/* A key's field, or -1: its length first (one compare rules out most names), then its bytes. */
static int field_of(const char *k, Py_ssize_t klen) {
    static Py_ssize_t lens[NF];
    if (lens[0] == 0)
        for (int j = 0; j < NF; j++) lens[j] = (Py_ssize_t)strlen(FIELD_NAMES[j]);
    for (int j = 0; j < NF; j++)
        if (lens[j] == klen && memcmp(k, FIELD_NAMES[j], (size_t)klen) == 0) return j;
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

/* kv_batch's classes: the records (engines/kv_events.py) are built here with their fields in order,
 * not by a Python loop (~0.4 us an event: vLLM sends a BlockRemoved per evicted block, so a full
 * cache takes as many events as blocks stored). */
enum { C_BATCH, C_STORED, C_REMOVED, C_CLEARED, C_RAW_IDS, N_CLASSES };
typedef struct {
    PyObject *cls[N_CLASSES];
    PyObject *view; /* a memoryview of the payload: token ids are RawTokenIds over a slice of it */
} Build;

static PyObject *raw_token_ids(const Build *b, Py_ssize_t from, Py_ssize_t to) {
    PyObject *lo = PyLong_FromSsize_t(from), *hi = PyLong_FromSsize_t(to);
    PyObject *slice = (lo && hi) ? PySlice_New(lo, hi, NULL) : NULL;
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

static PyObject *call_positional(PyObject *cls, PyObject *const *args, size_t n) {
    return PyObject_Vectorcall(cls, args, n, NULL);
}

/* A BlockRemoved's fields, handed back unbuilt when rd_events merges runs of removals. */
typedef struct {
    PyObject *hashes, *medium, *group;
} Removed;

/* One event map -> its record (b's classes, fields in their declared order; token ids as RawTokenIds
 * over the payload), or with rem a BlockRemoved's fields unbuilt (rd_events merges runs of them).
 * Absent optional fields are None (the defaults of vLLM's structs); extra_keys only when it holds no key. */
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
        if (f < 0 || (seen & BIT(f))) goto done; /* an unknown or repeated key: not the common shape */
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
        default: got = skip_scalar(r); break; /* a field the Python decoder ignores */
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
    if (rem != NULL && kind == T_REMOVED) { /* merged by the caller: no record yet */
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
        *out = call_positional(b->cls[C_STORED], args, 8);
        Py_DECREF(ids);
    } else if (kind == T_REMOVED) {
        PyObject *args[3] = {v[F_HASHES], v[F_MEDIUM], v[F_GROUP_IDX]};
        *out = call_positional(b->cls[C_REMOVED], args, 3);
    } else {
        *out = call_positional(b->cls[C_CLEARED], &v[F_MEDIUM], 1);
    }
    rc = *out == NULL ? FAIL : OK;
done:
    for (int j = 0; j < NF; j++) Py_XDECREF(v[j]);
    return rc;
}

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
        ev = call_positional(b->cls[C_REMOVED], args, 3);
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
 * medium and group as one record, their hashes in order (vLLM sends one per evicted block: a full
 * cache's evictions then cost a record a run, not a record a block). */
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

/* kv_batch(payload, classes[, merge]) -> KVEventBatch | None
 *
 * vLLM's current wire shape, [ts, [event maps], rank?] (what vLLM 0.32 sends) or
 * {"ts", "events", "data_parallel_rank"?} (each key once, no others), with plain non-negative int
 * block hashes, int token ids and nil extra_keys; None for anything else. classes: (KVEventBatch,
 * BlockStored, BlockRemoved, AllBlocksCleared, RawTokenIds), the records built as
 * engines/kv_event_codec.py's decoders build them (rd_event); merge: runs of removals merged as
 * engines/kv_event_codec.py merge_removed does. */
static PyObject *kv_batch(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "kv_batch(payload, classes[, merge])");
        return NULL;
    }
    PyObject *arg = args[0];
    int merge = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (merge < 0) return NULL;
    if (!PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != N_CLASSES) {
        PyErr_SetString(PyExc_TypeError, "kv_batch's classes: (KVEventBatch, BlockStored, BlockRemoved, "
                                         "AllBlocksCleared, RawTokenIds)");
        return NULL;
    }
    Build build, *b = &build;
    for (int i = 0; i < N_CLASSES; i++) build.cls[i] = PyTuple_GET_ITEM(args[1], i);
    if ((build.view = PyMemoryView_FromObject(arg)) == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
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
        if ((rc = rd_ts(&r, &ts)) != OK || (rc = rd_events(&r, base, b, merge, &events)) != OK) goto done;
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
                rc = rd_events(&r, base, b, merge, &events);
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
    {
        PyObject *fts = PyFloat_FromDouble(ts);
        if (fts != NULL) {
            PyObject *bargs[3] = {fts, events, rank == NULL ? Py_None : rank};
            out = call_positional(build.cls[C_BATCH], bargs, 3);
            Py_DECREF(fts);
        }
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

/* ----------------------------------------------------------------------------- usage objects */

/* The usage object's usual keys, made once: a key of these reuses its string (and its cached
 * hash) instead of building one per answer. */
static const char *const USAGE_KEYS[] = {"prompt_tokens", "total_tokens", "completion_tokens",
                                         "prompt_tokens_details", "cached_tokens"};
#define N_USAGE_KEYS 5
static PyObject *usage_keys[N_USAGE_KEYS];

static PyObject *usage_key(const char *k, Py_ssize_t klen) {
    for (int i = 0; i < N_USAGE_KEYS; i++) {
        if ((Py_ssize_t)strlen(USAGE_KEYS[i]) == klen && memcmp(USAGE_KEYS[i], k, klen) == 0) {
            if (usage_keys[i] == NULL && (usage_keys[i] = PyUnicode_InternFromString(USAGE_KEYS[i])) == NULL)
                return NULL;
            return Py_NewRef(usage_keys[i]);
        }
    }
    return PyUnicode_FromStringAndSize(k, klen);
}

/* One compact JSON object of "key":value pairs at p (at its '{'): keys of [A-Za-z0-9_], values
 * non-negative integers of at most 18 digits (no leading zero), null, or (nest > 0) such an object.
 * OK with the dict in *out and *pp past its '}'; FALLBACK for anything else (strings, floats,
 * whitespace, deeper nesting: Python decides those); FAIL with an exception set. */
static int usage_obj(const char **pp, const char *end, int nest, PyObject **out) {
    const char *p = *pp;
    if (p >= end || *p != '{') return FALLBACK;
    PyObject *d = PyDict_New();
    if (d == NULL) return FAIL;
    int rc = FALLBACK;
    p++;
    if (p < end && *p == '}') {
        p++;
        goto ok;
    }
    for (;;) {
        if (p >= end || *p != '"') goto done;
        const char *k = ++p;
        while (p < end && ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_')) p++;
        if (p == k || p + 1 >= end || p[0] != '"' || p[1] != ':') goto done;
        Py_ssize_t klen = p - k;
        p += 2;
        PyObject *v = NULL;
        if (p < end && *p >= '0' && *p <= '9') {
            const char *q = p;
            long long x = 0;
            while (p < end && *p >= '0' && *p <= '9' && p - q < 18) x = x * 10 + (*p++ - '0');
            if ((p - q > 1 && *q == '0') || (p < end && ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E')))
                goto done; /* a leading zero (not JSON), a longer or a non-integer number */
            v = PyLong_FromLongLong(x);
        } else if (end - p >= 4 && memcmp(p, "null", 4) == 0) {
            p += 4;
            v = Py_NewRef(Py_None);
        } else if (nest > 0 && p < end && *p == '{') {
            rc = usage_obj(&p, end, nest - 1, &v);
            if (rc != OK) goto done;
            rc = FALLBACK;
        } else {
            goto done;
        }
        if (v == NULL) {
            rc = FAIL;
            goto done;
        }
        PyObject *key = usage_key(k, klen);
        int bad = key == NULL || PyDict_SetItem(d, key, v) < 0;
        Py_XDECREF(key);
        Py_DECREF(v);
        if (bad) {
            rc = FAIL;
            goto done;
        }
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') {
            p++;
            break;
        }
        goto done;
    }
ok:
    *pp = p;
    *out = d;
    return OK;
done:
    Py_DECREF(d);
    return rc;
}

/* bytes.strip()'s whitespace (is_ws's JSON four, and \v \f): what usage_from_tail skips around the colon. */
static int strip_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

/* usage_object(tail) -> dict | None
 *
 * gateway.http.usage.usage_from_tail(tail, sse=False) for the common shape: the last `"usage"` in
 * ``tail``, then `:` and `{` (whitespace around the colon as bytes.strip() takes it), a compact
 * object as usage_obj reads it, and a '}' after it (the answer closes). None for anything else,
 * which the Python function then decides: the answers are the same with or without this build. */
static PyObject *usage_object(PyObject *Py_UNUSED(self), PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "usage_object takes bytes");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(arg);
    const char *end = s + PyBytes_GET_SIZE(arg);
    const char *at = NULL;
    for (const char *q = end - 7; q >= s; q--) {
        if (*q == '"' && memcmp(q, "\"usage\"", 7) == 0) {
            at = q;
            break;
        }
    }
    if (at == NULL) Py_RETURN_NONE;
    const char *p = at + 7;
    while (p < end && strip_ws(*p)) p++;
    if (p >= end || *p != ':') Py_RETURN_NONE;
    p++;
    while (p < end && strip_ws(*p)) p++;
    PyObject *u = NULL;
    int rc = usage_obj(&p, end, 3, &u);
    if (rc == FAIL) return NULL;
    if (rc != OK) Py_RETURN_NONE;
    if (memchr(p, '}', end - p) == NULL) { /* cut off after the usage object */
        Py_DECREF(u);
        Py_RETURN_NONE;
    }
    return u;
}

/* ----------------------------------------------------------------------------- text chunk hashes */

/* BLAKE2b (RFC 7693), unkeyed, 8-byte digests: what hashlib.blake2b(data, digest_size=8) computes,
 * written from the RFC for the approximate index's chained text-chunk hashes (one Python call and
 * one hashlib object per 64-byte chunk cost ~0.7 us; a 100k-token chat prompt has ~6,000 chunks). */
static const uint64_t B2_IV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                                  0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                                  0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(a, b, c, d, x, y)                                                                                 \
    do {                                                                                                       \
        v[a] = v[a] + v[b] + (x);                                                                              \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                                        \
        v[c] = v[c] + v[d];                                                                                    \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                                        \
        v[a] = v[a] + v[b] + (y);                                                                              \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                                        \
        v[c] = v[c] + v[d];                                                                                    \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                                        \
    } while (0)

/* One 128-byte block into h; t: message bytes so far, this block included; last: the final block. */
static void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(m, block, sizeof m); /* the message words are little-endian */
#else
    for (int i = 0; i < 16; i++) {
        uint64_t w = 0;
        for (int j = 7; j >= 0; j--) w = (w << 8) | block[8 * i + j];
        m[i] = w;
    }
#endif
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= t; /* the counter's high word stays 0: messages here are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Bytes [from, from + len) of the message a (alen bytes) followed by b, into dst. */
static void b2_take(uint8_t *dst, const uint8_t *a, Py_ssize_t alen, const uint8_t *b, Py_ssize_t from, Py_ssize_t len) {
    if (from < alen) {
        Py_ssize_t x = alen - from < len ? alen - from : len;
        memcpy(dst, a + from, (size_t)x);
        dst += x;
        from += x;
        len -= x;
    }
    if (len > 0) memcpy(dst, b + (from - alen), (size_t)len);
}

/* BLAKE2b-64 of a (alen bytes: 0 or 8) followed by b (blen bytes): the digest's first word. */
static uint64_t b2_64(const uint8_t *a, Py_ssize_t alen, const uint8_t *b, Py_ssize_t blen) {
    uint64_t h[8];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* digest length 8, no key, fanout 1, depth 1 */
    Py_ssize_t total = alen + blen, pos = 0;
    uint8_t block[128];
    while (total - pos > 128) { /* every block but the last, which is final even when full */
        b2_take(block, a, alen, b, pos, 128);
        pos += 128;
        b2_compress(h, block, (uint64_t)pos, 0);
    }
    memset(block, 0, sizeof block); /* zero padding (an empty message: one zero block) */
    b2_take(block, a, alen, b, pos, total - pos);
    b2_compress(h, block, (uint64_t)total, 1);
    return h[0];
}

/* chunk_hashes(data, step) -> list[int]
 *
 * gateway.http.prompt.text_chunk_hashes on the encoded text: for each full ``step``-byte chunk,
 * blake2b-64(previous digest + chunk) (the first chunk alone), as the big-endian int of the digest. */
static PyObject *chunk_hashes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "chunk_hashes(data: bytes, step: int)");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk_hashes: step must be positive");
        return NULL;
    }
    const uint8_t *s = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t k = n / step;
    PyObject *out = PyList_New(k);
    if (out == NULL) return NULL;
    uint8_t prev[8];
    for (Py_ssize_t c = 0; c < k; c++) {
        uint64_t w = b2_64(prev, c > 0 ? 8 : 0, s + c * step, step);
        for (int j = 0; j < 8; j++) prev[j] = (uint8_t)(w >> (8 * j)); /* the digest's bytes */
        PyObject *v = PyLong_FromUnsignedLongLong(__builtin_bswap64(w)); /* int.from_bytes(digest, "big") */
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, c, v);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"parse_uint_array", (PyCFunction)(void (*)(void))parse_uint_array, METH_FASTCALL,
     "parse_uint_array(buf, start, stop) -> bytearray | None: a JSON array body's ids as native uint64."},
    {"kv_batch", (PyCFunction)(void (*)(void))kv_batch, METH_FASTCALL,
     "kv_batch(payload, classes[, merge]) -> KVEventBatch | None: a vLLM KV-event batch's records "
     "(merge: runs of removals as one)."},
    {"chunk_hashes", (PyCFunction)(void (*)(void))chunk_hashes, METH_FASTCALL,
     "chunk_hashes(data, step) -> list[int]: the approximate index's chained blake2b-64 hashes of full step-byte chunks."},
    {"usage_object", usage_object, METH_O,
     "usage_object(tail) -> dict | None: the usage object of a JSON answer's tail, in its common compact shape."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuhit._speedups", NULL, -1, methods, NULL, NULL, NULL, NULL};

int blockset_add_type(PyObject *module); /* _blockset.c */
int sha256_add_functions(PyObject *module); /* _sha256.c */

PyMODINIT_FUNC PyInit__speedups(void) {
    init_int_size();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0 || blockset_add_type(m) < 0
                      || sha256_add_functions(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
