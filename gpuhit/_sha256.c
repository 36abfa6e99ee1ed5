/* gpuhit._speedups.sha256_blocks: vLLM's sha256 block-hash chain in one C call (built into the
 * _speedups extension, gpuhit/native.py).
 *
 * Why C: engines.hashing.BlockHasher.hash_array in Python lays out every block's pickle with numpy
 * (~0.5 us a block in whole-array passes) and runs the chain per block (a memoryview store, a
 * hashlib object, a digest: ~1 us), ~9 ms for a 100k-token prompt's 6,250 blocks, for ~120 bytes of
 * SHA-256 work a block. Here each pickle is written as the chain reaches it, and the compression
 * runs on the CPU's SHA extensions where it has them (x86-64 SHA-NI, detected at run time) and in
 * portable C otherwise (FIPS 180-4, section 6.2). tests/engines/test_hashing_accel.py holds both against
 * hashlib on every length around the block boundaries and against BlockHasher's Python chain.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

typedef void (*compress_fn)(uint32_t st[8], const uint8_t *p, size_t nblocks);

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* The portable compression function (FIPS 180-4 6.2.2) over nblocks 64-byte blocks. */
static void compress_generic(uint32_t st[8], const uint8_t *p, size_t nblocks) {
    uint32_t w[64];
    for (; nblocks; nblocks--, p += 64) {
        for (int t = 0; t < 16; t++) w[t] = load_be32(p + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

/* The same on the SHA extensions. The state lives as two vectors, ABEF and CDGH (the order
 * sha256rnds2 takes); each group of four rounds adds its four message words to K, runs two rounds
 * with the low half and two with the high half; the schedule's next four words come from
 * sha256msg1 (the sigma0 part), the words seven back (alignr) and sha256msg2 (the sigma1 part). */
__attribute__((target("sha,sse4.1,ssse3")))
static void compress_shani(uint32_t st[8], const uint8_t *p, size_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&st[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&st[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; nblocks; nblocks--, p += 64) {
        const __m128i abef0 = abef, cdgh0 = cdgh;
        __m128i m[4];
        for (int g = 0; g < 16; g++) {
            __m128i cur;
            if (g < 4) {
                cur = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), bswap);
            } else {
                /* W[t..t+3] from m[g-4] (W[t-16..t-13]), m[g-3], m[g-2] and m[g-1] */
                __m128i x = _mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
                cur = _mm_sha256msg2_epu32(x, m[(g + 3) & 3]);
            }
            m[g & 3] = cur;
            __m128i k = _mm_loadu_si128((const __m128i *)&K256[4 * g]);
            __m128i msg = _mm_add_epi32(cur, k);
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, msg);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(msg, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&st[0], _mm_blend_epi16(feba, dchg, 0xF0)); /* dcba */
    _mm_storeu_si128((__m128i *)&st[4], _mm_alignr_epi8(dchg, feba, 8));    /* hgfe */
}

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#endif

static compress_fn best = compress_generic; /* set at import (sha256_add_functions) */

/* SHA-256 of data[0:n] into out[32], with the compression function ``compress``. */
static void sha256(compress_fn compress, const uint8_t *data, size_t n, uint8_t out[32]) {
    uint32_t st[8];
    memcpy(st, H0, sizeof st);
    size_t full = n / 64;
    compress(st, data, full);
    uint8_t tail[128] = {0};
    size_t rest = n - 64 * full;
    memcpy(tail, data + 64 * full, rest);
    tail[rest] = 0x80;
    size_t blocks = rest + 9 <= 64 ? 1 : 2; /* 0x80 and the 64-bit bit length must fit */
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[64 * blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(st, tail, blocks);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(st[i] >> 24);
        out[4 * i + 1] = (uint8_t)(st[i] >> 16);
        out[4 * i + 2] = (uint8_t)(st[i] >> 8);
        out[4 * i + 3] = (uint8_t)st[i];
    }
}

/* sha256_blocks(tokens, block_size, parent) -> list[bytes] | None
 *
 * engines.hashing.BlockHasher.hash_blocks for sha256 (vLLM's ``sha256(pickle.dumps((parent,
 * tuple(block), None), protocol=5))`` chain) over a uint64 buffer of token ids: the digest of every
 * full block, each chained from the previous (``parent``, 32 bytes, for the first). Each block's
 * pickle is written into one buffer as pickle writes it (engines.hashing.pickled_blocks has the
 * layout: PROTO 5, FRAME, SHORT_BINBYTES parent, MEMOIZE, MARK, one BININT1 / BININT2 / BININT a
 * token, TUPLE MEMOIZE NONE TUPLE3 MEMOIZE STOP). None where that layout is not what pickle writes
 * (an id of 2**31 or more, a block of three tokens or fewer): the caller's Python path decides. */
static PyObject *sha256_blocks(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sha256_blocks(tokens, block_size, parent)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_buffer tok, parent;
    if (PyObject_GetBuffer(args[0], &tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &parent, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&tok);
        return NULL;
    }
    PyObject *out = NULL;
    uint8_t *msg = NULL;
    if (tok.itemsize != 8 || tok.format == NULL || (strcmp(tok.format, "Q") && strcmp(tok.format, "L")
                                                    && strcmp(tok.format, "<Q") && strcmp(tok.format, "=Q"))) {
        PyErr_SetString(PyExc_TypeError, "sha256_blocks: tokens must be a uint64 buffer");
        goto done;
    }
    if (parent.len != 32 || bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "sha256_blocks: parent must be 32 bytes, block_size positive");
        goto done;
    }
    const uint64_t *ids = (const uint64_t *)tok.buf;
    Py_ssize_t nb = tok.len / 8 / bs;
    if (bs <= 3) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nb * bs; i++) {
        if (ids[i] >= ((uint64_t)1 << 31)) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    enum { HEAD = 15 + 32, TAIL = 6 };
    msg = PyMem_Malloc((size_t)(HEAD + 5 * bs + TAIL));
    out = PyList_New(nb);
    if (msg == NULL || out == NULL) {
        Py_CLEAR(out);
        if (msg == NULL) PyErr_NoMemory();
        goto done;
    }
    static const uint8_t tail[TAIL] = {'t', 0x94, 'N', 0x87, 0x94, '.'};
    msg[0] = 0x80; msg[1] = 5; msg[2] = 0x95; /* PROTO 5, FRAME (8-byte length below) */
    msg[11] = 'C'; msg[12] = 32;              /* SHORT_BINBYTES, 32 bytes */
    memcpy(msg + 13, parent.buf, 32);
    msg[HEAD - 2] = 0x94; msg[HEAD - 1] = '('; /* MEMOIZE, MARK */
    for (Py_ssize_t k = 0; k < nb; k++) {
        uint8_t *w = msg + HEAD;
        for (const uint64_t *t = ids + k * bs, *end = t + bs; t < end; t++) {
            uint32_t v = (uint32_t)*t;
            if (v < 256) { *w++ = 'K'; *w++ = (uint8_t)v; }
            else if (v < 65536) { *w++ = 'M'; *w++ = (uint8_t)v; *w++ = (uint8_t)(v >> 8); }
            else { *w++ = 'J'; w[0] = (uint8_t)v; w[1] = (uint8_t)(v >> 8); w[2] = (uint8_t)(v >> 16); w[3] = (uint8_t)(v >> 24); w += 4; }
        }
        memcpy(w, tail, TAIL);
        size_t size = (size_t)(w + TAIL - msg);
        uint64_t frame = size - 11;
        for (int i = 0; i < 8; i++) msg[3 + i] = (uint8_t)(frame >> (8 * i));
        uint8_t digest[32];
        sha256(best, msg, size, digest);
        memcpy(msg + 13, digest, 32); /* the next block's parent */
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, 32);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, d);
    }
done:
    PyMem_Free(msg);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&parent);
    return out;
}

/* sha256_digest(data, portable=False) -> bytes: one SHA-256, on the SHA extensions where the CPU has
 * them unless ``portable`` (for the tests, which hold both compressions to hashlib). */
static PyObject *sha256_digest(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "sha256_digest(data, portable=False)");
        return NULL;
    }
    int portable = nargs == 2 ? PyObject_IsTrue(args[1]) : 0;
    if (portable < 0) return NULL;
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    uint8_t digest[32];
    sha256(portable ? compress_generic : best, (const uint8_t *)data.buf, (size_t)data.len, digest);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)digest, 32);
}

static PyMethodDef sha256_methods[] = {
    {"sha256_blocks", (PyCFunction)(void (*)(void))sha256_blocks, METH_FASTCALL,
     "sha256_blocks(tokens, block_size, parent) -> list[bytes] | None: vLLM's sha256 block-hash chain "
     "over a uint64 buffer of token ids (None: an id of 2**31 or more, or a block of 3 tokens or fewer)."},
    {"sha256_digest", (PyCFunction)(void (*)(void))sha256_digest, METH_FASTCALL,
     "sha256_digest(data, portable=False) -> bytes: one SHA-256 (portable: without the CPU's SHA extensions)."},
    {NULL, NULL, 0, NULL},
};

/* Adds the functions and SHA256_ACCELERATED (whether the SHA extensions are in use) to module. */
int sha256_add_functions(PyObject *module) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (cpu_has_sha()) best = compress_shani;
#endif
    if (PyModule_AddFunctions(module, sha256_methods) < 0) return -1;
    return PyModule_AddIntConstant(module, "SHA256_ACCELERATED", best != compress_generic);
}
