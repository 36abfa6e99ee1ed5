/* gpuhit._speedups.parse_uint_array: a completions body's token-id array, JSON text -> uint64 buffer
 * (part of the C speedups, built with _speedups.c into one extension; gateway/http/token_ids.py
 * TokenIdParser calls it).
 *
 * Why: a new 100k-token prompt is ~600 KB of JSON. The reference (numpy) validates the array with
 * about six whole-array passes and parses it with numpy's text reader; orjson would build a Python
 * int per id. Here one pass validates and converts, 64 bytes at a time where a block holds only
 * digits and commas, straight into the buffer the ids stay in.
 *
 * The language accepted is the reference's (gateway/http/token_ids.py validated): exactly
 *     ws* int ws* ("," ws* int ws*)*
 * every int a non-negative JSON integer (no sign, no leading zero, no fraction or exponent) of at
 * most 18 digits (every such integer is below 2**63: int64 and uint64 agree). Anything else answers
 * None, and the caller hands the body to the reference, which decides it (and any error) as it
 * would without this build: tests/gateway/test_token_ids.py holds the two to the same answers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIGITS 18

#define HIGH_NIBBLES 0xF0F0F0F0F0F0F0F0ULL
#define THREES 0x3030303030303030ULL
#define SIXES 0x0606060606060606ULL

/* 8 bytes read as a little-endian integer (the first byte lowest). */
static inline uint64_t load_le64(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    return x;
}

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Per byte of 8 (the first byte lowest), nonzero where it is not an ASCII digit. A byte is a digit
 * iff its high nibble is 3 and adding 6 keeps it so (a carry out of a non-digit byte can only mark
 * bytes above it, never the lowest non-digit one, which is the one read). */
static inline uint64_t non_digits(uint64_t chunk) {
    return ((chunk & HIGH_NIBBLES) ^ THREES) | (((chunk + SIXES) & HIGH_NIBBLES) ^ THREES);
}

/* The value of the first len (1..7) bytes of chunk, all digits, most significant first: the digits
 * moved to the top bytes, then pairs, quads and octets combined (three multiplies, no loop). */
static inline uint64_t digits_value(uint64_t chunk, int len) {
    uint64_t x = (chunk - THREES) << (8 * (8 - len));
    x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
    x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
    return (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
}

static Py_ssize_t count_commas_bytewise(const unsigned char *p, const unsigned char *end) {
    Py_ssize_t total = 0;
    for (; p < end; p++) total += *p == ',';
    return total;
}

#if defined(__SSE2__) && defined(__x86_64__)
#include <emmintrin.h>
#define HAVE_SSE2 1
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

/* How many bytes of [p, end) are ','. Per 16 bytes a compare subtracted (a match is -1) into 16
 * byte counters, summed (psadbw) before they can overflow. */
static Py_ssize_t count_commas(const unsigned char *p, const unsigned char *end) {
    const __m128i comma = _mm_set1_epi8(','), zero = _mm_setzero_si128();
    Py_ssize_t total = 0;
    while (end - p >= 16) {
        __m128i acc = zero;
        for (int k = 0; k < 255 && end - p >= 16; k++, p += 16)
            acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)p), comma));
        __m128i sums = _mm_sad_epu8(acc, zero);
        total += (Py_ssize_t)(_mm_cvtsi128_si64(sums) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(sums, sums)));
    }
    return total + count_commas_bytewise(p, end);
}
#else
#define HAVE_SSE2 0
#define count_commas count_commas_bytewise
#endif

/* The ids of [p, end) into dst (room for every one: commas + 1); their count, or -1 when the text
 * is outside the language above. Three loops, each leaving p at the start of a number it did not
 * take, so that together they accept exactly the language of the last one:
 *   1. 64 bytes at a time while 80 remain (SSE2), when a block holds only digits and commas: the
 *      commas' bit mask says where every number ends, so the numbers convert independently;
 *   2. while 16 bytes remain: a number of 1-7 digits then a comma, from one 8-byte load;
 *   3. the general loop: whitespace, long numbers, the last number, and every check. */
static Py_ssize_t parse_into(const unsigned char *p, const unsigned char *end, uint64_t *dst) {
    Py_ssize_t n = 0;
#if HAVE_SSE2
    while (end - p >= 80) {
        uint64_t commas, digits;
        classify64(p, &commas, &digits);
        if ((commas | digits) != ~0ULL || commas == 0) break;
        const unsigned char *s = p; /* the start of the next number */
        int stop = 0;
        do {
            const unsigned char *q = p + __builtin_ctzll(commas); /* its comma */
            Py_ssize_t len = q - s;
            if (len < 1 || len > 7 || (*s == '0' && len > 1)) {
                stop = 1; /* loop 3 decides it */
                break;
            }
            dst[n++] = digits_value(load_le64(s), (int)len); /* s + 8 <= p + 72 <= end */
            s = q + 1;
            commas &= commas - 1;
        } while (commas);
        p = s;
        if (stop) break;
    }
#endif
    while (end - p >= 16) {
        uint64_t chunk = load_le64(p);
        uint64_t other = non_digits(chunk);
        if ((other & 0xFF) || other == 0) break; /* no digit here, or 8 digits or more */
        int len = __builtin_ctzll(other) >> 3;   /* 1..7 */
        if (((chunk >> (8 * len)) & 0xFF) != ',' || ((chunk & 0xFF) == '0' && len > 1)) break;
        dst[n++] = digits_value(chunk, len);
        p += len + 1;
    }
    for (;;) {
        while (p < end && is_ws(*p)) p++;
        if (p == end || (unsigned)(*p - '0') > 9) return -1; /* a number must come here */
        const unsigned char *first = p;
        uint64_t v = (uint64_t)(*p++ - '0');
        if (v == 0 && p < end && (unsigned)(*p - '0') <= 9) return -1; /* a leading zero */
        while (p < end && (unsigned)(*p - '0') <= 9) {
            if (p - first >= MAX_DIGITS) return -1;
            v = v * 10 + (uint64_t)(*p++ - '0');
        }
        dst[n++] = v;
        while (p < end && is_ws(*p)) p++;
        if (p == end) return n;
        if (*p++ != ',') return -1;
    }
}

/* parse_uint_array(buf, start, stop) -> bytearray | None
 *
 * The ids of buf[start:stop] (the text between a JSON array's brackets) as native uint64 (a
 * bytearray, for numpy.frombuffer) when it is in the language above; else None. */
PyObject *parse_uint_array(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "parse_uint_array(buf, start, stop)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t stop = PyLong_AsSsize_t(args[2]);
    if (stop == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    if (start < 0 || stop < start || stop > view.len) {
        PyErr_Format(PyExc_ValueError, "range %zd:%zd outside a buffer of %zd bytes", start, stop, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + start, *end = (const unsigned char *)view.buf + stop;
    /* A valid array holds one number more than it has commas: the buffer is allocated once at the
     * size it keeps (an upper bound such as a number per two bytes makes a 100k-token prompt's
     * buffer 2.5 MB, above glibc's mmap threshold: fresh pages faulted in on every call). */
    Py_ssize_t cap = p < end ? count_commas(p, end) + 1 : 0;
    PyObject *out = NULL;
    if (cap == 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyByteArray_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) goto done;
    Py_ssize_t n = parse_into(p, end, (uint64_t *)PyByteArray_AS_STRING(out));
    if (n != cap) { /* -1, or fewer numbers than commas + 1 (cannot be: each comma ends one) */
        Py_SETREF(out, Py_NewRef(Py_None));
    }
done:
    PyBuffer_Release(&view);
    return out;
}
