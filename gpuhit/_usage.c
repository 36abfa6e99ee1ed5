/* usage_object (one of gpuhit._speedups' functions, gpuhit/_speedups.c): the usage object of an
 * engine's non-streamed JSON answer, read from its tail. The reference is
 * gateway.http.usage.usage_from_tail(tail, sse=False): its rfind / find / count / strip calls and
 * orjson.loads of the object cost more per chat request than the rest of the answer's handling in
 * C; this reads the common compact shape and answers None for anything else, which the reference
 * then decides (gateway.http.usage.UsageReader counts those). tests/gateway/test_usage_c.py holds
 * the two to the same objects. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

enum { OK = 0, FALLBACK = 1, FAIL = -1 };

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

static PyObject *tail_usage(PyObject *arg);

/* usage_object(tail) -> dict | None
 *
 * gateway.http.usage.usage_from_tail(tail, sse=False) for the common shape: the last `"usage"` in
 * ``tail``, then `:` and `{` (whitespace around the colon as bytes.strip() takes it), a compact
 * object as usage_obj reads it, and a '}' after it (the answer closes). None for anything else,
 * which the Python function then decides: the answers are the same with or without this build. */
PyObject *usage_object(PyObject *Py_UNUSED(self), PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "usage_object takes bytes");
        return NULL;
    }
    return tail_usage(arg);
}

static PyObject *tail_usage(PyObject *arg) {
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

/* d[USAGE_KEYS[i]], borrowed; NULL when absent (a key never read yet has no string: it is absent) or on error */
static PyObject *usage_get(PyObject *d, int i) {
    return usage_keys[i] == NULL ? NULL : PyDict_GetItemWithError(d, usage_keys[i]);
}

/* openai_usage_of(tail, usage_type) -> Usage | None
 *
 * gateway.http.usage.openai_usage(usage_object(tail)) without its Python call: the usage object
 * read as usage_object reads it, then its prompt_tokens_details.cached_tokens (an int, else 0; 0
 * without the details object) and completion_tokens (an int, else 0 for null, absent or an empty
 * object), as usage_type(cached, completion). None where usage_object answers None, and for a
 * non-empty object as completion_tokens (where the reference raises): the reference decides those. */
PyObject *openai_usage_of(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "openai_usage_of(tail: bytes, usage_type)");
        return NULL;
    }
    PyObject *u = tail_usage(args[0]);
    if (u == NULL || u == Py_None) return u;
    PyObject *out = NULL;
    long long cached = 0, completion = 0;
    PyObject *details = usage_get(u, 3); /* prompt_tokens_details */
    if (details == NULL && PyErr_Occurred()) goto done;
    if (details != NULL && PyDict_CheckExact(details)) {
        PyObject *c = usage_get(details, 4); /* cached_tokens */
        if (c == NULL && PyErr_Occurred()) goto done;
        if (c != NULL && PyLong_CheckExact(c) && (cached = PyLong_AsLongLong(c)) == -1 && PyErr_Occurred()) goto done;
    }
    PyObject *n = usage_get(u, 2); /* completion_tokens */
    if (n == NULL && PyErr_Occurred()) goto done;
    if (n != NULL && PyLong_CheckExact(n)) {
        if ((completion = PyLong_AsLongLong(n)) == -1 && PyErr_Occurred()) goto done;
    } else if (n != NULL && PyDict_CheckExact(n) && PyDict_GET_SIZE(n) > 0) {
        out = Py_NewRef(Py_None); /* int() of an object: the reference's error */
        goto done;
    }
    out = PyObject_CallFunction(args[1], "LL", cached, completion);
done:
    Py_DECREF(u);
    return out;
}
