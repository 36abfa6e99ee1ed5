/* gpuhit._speedups: the C speedups (optional; `make compile`, gpuhit/speedups.py).
 *
 *   sha256_blocks     vLLM's sha256 block-hash chain over a uint64 buffer of token ids, each block's
 *                     pickle written as the chain reaches it and hashed by OpenSSL (libcrypto's EVP
 *                     API, the library behind hashlib): the chain in Python costs a pickle, a hashlib
 *                     object and a digest per 16-token block, ~6 us, for ~120 bytes of SHA-256 work.
 *   parse_uint_array  (in _tokenids.c) a completions body's token-id array, JSON text -> uint64.
 *   kv_batch          (in _kvbatch.c) a vLLM KV-event batch (msgpack) -> its records.
 *   BlockSet          (in _blockset.c) the precise KV index's set of block hashes.
 *   usage_object      (in _usage.c) the usage object of a non-streamed JSON answer, from its tail;
 *                     openai_usage_of, an OpenAI answer's cached and completion tokens from it.
 *   RequestParts      (in _reqparts.c) a client request's target, header fields and body as httptools
 *                     hands them over.
 *   text_chunk_hashes the approximate chained hashes of a text's chunks (OpenSSL's BLAKE2b-512, each
 *                     digest cut to 8 bytes): in Python each chunk costs a hashlib object, a
 *                     digest, a slice and an int, about three times this loop's time for a chat
 *                     request's one chunk.
 *
 * No hashing is written here: the compression is the library's. sha256_blocks answers None where
 * its pickle layout is not what pickle writes (an id of 2**31 or more, blocks of three tokens or
 * fewer), and the reference chain (engines/hashing.py BlockHasher.hash_blocks) decides those:
 * tests/engines/test_hashing_accel.py holds the two to the same digests. SOURCE_SHA256 (the digest
 * of the sources, set by the build) lets the loader refuse a build older than its sources.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 ""
#endif

/* OpenSSL's SHA-256, fetched once (module init): with the legacy EVP_sha256() every digest
 * initialisation would look the algorithm up again (OpenSSL 3's implicit fetch), about as costly as
 * hashing a 16-token block's 100-byte pickle. */
static EVP_MD *SHA256_MD;
static EVP_MD *BLAKE2B_MD; /* the same for text_chunk_hashes */

/* sha256_blocks(tokens, block_size, parent) -> list[bytes] | None
 *
 * engines.hashing.BlockHasher.hash_blocks for sha256 (vLLM's ``sha256(pickle.dumps((parent,
 * tuple(block), None), protocol=5))`` chain) over a uint64 buffer of token ids: the digest of every
 * full block, each chained from the previous (``parent``, 32 bytes, for the first). Each block's
 * pickle is written as pickle writes it: PROTO 5, FRAME, SHORT_BINBYTES parent, MEMOIZE, MARK, one
 * BININT1 / BININT2 / BININT a token, TUPLE MEMOIZE NONE TUPLE3 MEMOIZE STOP. None where that is not
 * the layout (an id of 2**31 or more, a block of three tokens or fewer). */
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
    EVP_MD_CTX *ctx = NULL;
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
    ctx = EVP_MD_CTX_new();
    out = PyList_New(nb);
    if (msg == NULL || ctx == NULL || out == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    const EVP_MD *md = SHA256_MD;
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
        unsigned int dlen = 0;
        if (EVP_DigestInit_ex2(ctx, md, NULL) != 1 || EVP_DigestUpdate(ctx, msg, size) != 1
            || EVP_DigestFinal_ex(ctx, digest, &dlen) != 1 || dlen != 32) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_RuntimeError, "sha256_blocks: OpenSSL's SHA-256 failed");
            goto done;
        }
        memcpy(msg + 13, digest, 32); /* the next block's parent */
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, 32);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, d);
    }
done:
    EVP_MD_CTX_free(ctx);
    PyMem_Free(msg);
    PyBuffer_Release(&tok);
    PyBuffer_Release(&parent);
    return out;
}

/* text_chunk_hashes(text, chunk_bytes) -> list[int]
 *
 * gateway.http.prompt.text_chunk_hashes, its reference: over the UTF-8 bytes of ``text``
 * (surrogates passed through, as "surrogatepass" encodes them), for each full ``chunk_bytes``
 * chunk, BLAKE2b-512 of the previous digest (8 bytes; nothing before the first chunk) followed by
 * the chunk, the digest cut to its first 8 bytes, as their big-endian int. An ASCII str is read in
 * place (its bytes are its UTF-8); any other is encoded once. */
static PyObject *text_chunk_hashes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "text_chunk_hashes(text: str, chunk_bytes: int)");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "text_chunk_hashes: chunk_bytes must be positive");
        return NULL;
    }
    PyObject *text = args[0], *encoded = NULL, *out = NULL;
    const uint8_t *s;
    Py_ssize_t n;
    if (PyUnicode_IS_ASCII(text)) {
        s = PyUnicode_1BYTE_DATA(text);
        n = PyUnicode_GET_LENGTH(text);
    } else {
        if ((encoded = PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass")) == NULL) return NULL;
        s = (const uint8_t *)PyBytes_AS_STRING(encoded);
        n = PyBytes_GET_SIZE(encoded);
    }
    Py_ssize_t k = n / step;
    EVP_MD_CTX *ctx = NULL;
    if ((out = PyList_New(k)) == NULL) goto done;
    if (k == 0) goto done;
    if ((ctx = EVP_MD_CTX_new()) == NULL) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    uint8_t digest[EVP_MAX_MD_SIZE];
    for (Py_ssize_t c = 0; c < k; c++) {
        unsigned int dlen = 0;
        if (EVP_DigestInit_ex2(ctx, BLAKE2B_MD, NULL) != 1 || (c > 0 && EVP_DigestUpdate(ctx, digest, 8) != 1)
            || EVP_DigestUpdate(ctx, s + c * step, (size_t)step) != 1 || EVP_DigestFinal_ex(ctx, digest, &dlen) != 1
            || dlen != 64) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_RuntimeError, "text_chunk_hashes: OpenSSL's BLAKE2b-512 failed");
            goto done;
        }
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v = (v << 8) | digest[j]; /* int.from_bytes(digest[:8], "big") */
        PyObject *h = PyLong_FromUnsignedLongLong(v);
        if (h == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, c, h);
    }
done:
    EVP_MD_CTX_free(ctx);
    Py_XDECREF(encoded);
    return out;
}

PyObject *parse_uint_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs); /* _tokenids.c */
PyObject *kv_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);         /* _kvbatch.c */
void kv_batch_init(void);                                                              /* _kvbatch.c */
PyObject *usage_object(PyObject *self, PyObject *arg);                                 /* _usage.c */
PyObject *openai_usage_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs);   /* _usage.c */

static PyMethodDef methods[] = {
    {"parse_uint_array", (PyCFunction)(void (*)(void))parse_uint_array, METH_FASTCALL,
     "parse_uint_array(buf, start, stop) -> bytearray | None: the ids of a JSON array's text as native uint64 "
     "(None: outside the strict shape the reference then decides)."},
    {"kv_batch", (PyCFunction)(void (*)(void))kv_batch, METH_FASTCALL,
     "kv_batch(payload, classes, merge) -> KVEventBatch | None: a vLLM KV-event batch's records "
     "(None: outside vLLM's current shape; merge: runs of removals as one)."},
    {"sha256_blocks", (PyCFunction)(void (*)(void))sha256_blocks, METH_FASTCALL,
     "sha256_blocks(tokens, block_size, parent) -> list[bytes] | None: vLLM's sha256 block-hash chain "
     "over a uint64 buffer of token ids (None: an id of 2**31 or more, or a block of 3 tokens or fewer)."},
    {"text_chunk_hashes", (PyCFunction)(void (*)(void))text_chunk_hashes, METH_FASTCALL,
     "text_chunk_hashes(text, chunk_bytes) -> list[int]: the approximate chained hashes of a text's full "
     "chunk_bytes chunks of UTF-8 (blake2b-512 of the previous 8-byte digest and the chunk, cut to 8 bytes)."},
    {"usage_object", usage_object, METH_O,
     "usage_object(tail) -> dict | None: the usage object of a JSON answer's tail, in its common compact shape "
     "(None: anything else, which the reference then decides)."},
    {"openai_usage_of", (PyCFunction)(void (*)(void))openai_usage_of, METH_FASTCALL,
     "openai_usage_of(tail, usage_type) -> Usage | None: usage_type(cached_tokens, completion_tokens) of an OpenAI "
     "answer's usage object, read as usage_object reads it (None: anything else, which the reference then decides)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuhit._speedups", NULL, -1, methods, NULL, NULL, NULL, NULL};

int blockset_add_type(PyObject *module); /* _blockset.c */
int reqparts_add_type(PyObject *module); /* _reqparts.c */

PyMODINIT_FUNC PyInit__speedups(void) {
    if (SHA256_MD == NULL && (SHA256_MD = EVP_MD_fetch(NULL, "SHA256", NULL)) == NULL) {
        PyErr_SetString(PyExc_ImportError, "gpuhit._speedups: OpenSSL has no SHA256");
        return NULL;
    }
    if (BLAKE2B_MD == NULL && (BLAKE2B_MD = EVP_MD_fetch(NULL, "BLAKE2B-512", NULL)) == NULL) {
        PyErr_SetString(PyExc_ImportError, "gpuhit._speedups: OpenSSL has no BLAKE2B-512");
        return NULL;
    }
    kv_batch_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0 || blockset_add_type(m) < 0
                      || reqparts_add_type(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
