/* RequestParts (one of gpuhit._speedups' types, gpuhit/_speedups.c): the parts of one client request
 * as httptools' parser hands them over (target, header fields, body), each bounded as it arrives.
 * The reference is gateway.http.request_parts.RequestParts, with the same fields and answers
 * (tests/gateway/test_request_parts.py holds the two to each other). Why in C: the parser calls back
 * once per header field, six or more for a chat request from a common client, and a Python method
 * costs a frame and ~50 bytecodes each; these are C methods the parser calls without a frame. The
 * common header names are made once (their strings and cached hashes reused, as usage_object's keys). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *url;     /* bytes */
    PyObject *headers; /* dict[str, str] */
    PyObject *body;    /* list[bytes] */
    PyObject *error;   /* None, "url", "headers" or "body" */
    Py_ssize_t header_bytes, size, max_line, max_header_bytes, max_headers, max_body;
    char partial;
} RequestParts;

static const char *const NAMES[] = {"host", "user-agent", "accept", "accept-encoding", "content-type",
                                    "content-length", "connection", "authorization", "x-request-id",
                                    "x-session-id", "traceparent", "tracestate", "expect", "transfer-encoding"};
#define N_NAMES (sizeof(NAMES) / sizeof(NAMES[0]))
static PyObject *names[N_NAMES];
static PyObject *empty_bytes, *s_url, *s_headers, *s_body;

static int set_fresh(RequestParts *self) {
    PyObject *h = PyDict_New(), *b = PyList_New(0);
    if (h == NULL || b == NULL) {
        Py_XDECREF(h);
        Py_XDECREF(b);
        return -1;
    }
    Py_XSETREF(self->headers, h);
    Py_XSETREF(self->body, b);
    Py_XSETREF(self->url, Py_NewRef(empty_bytes));
    Py_XSETREF(self->error, Py_NewRef(Py_None));
    self->header_bytes = self->size = 0;
    return 0;
}

static int rp_init(RequestParts *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"max_line", "max_header_bytes", "max_headers", "max_body", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnnn", kw, &self->max_line, &self->max_header_bytes,
                                     &self->max_headers, &self->max_body))
        return -1;
    self->partial = 0;
    return set_fresh(self);
}

static void rp_dealloc(RequestParts *self) {
    Py_XDECREF(self->url);
    Py_XDECREF(self->headers);
    Py_XDECREF(self->body);
    Py_XDECREF(self->error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *over(RequestParts *self, PyObject *what, const char *msg) {
    Py_SETREF(self->error, Py_NewRef(what));
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static PyObject *on_message_begin(RequestParts *self, PyObject *Py_UNUSED(ignored)) {
    if (set_fresh(self) < 0) return NULL;
    self->partial = 1;
    Py_RETURN_NONE;
}

static PyObject *on_url(RequestParts *self, PyObject *url) {
    if (!PyBytes_Check(url)) {
        PyErr_SetString(PyExc_TypeError, "on_url(bytes)");
        return NULL;
    }
    if (PyBytes_GET_SIZE(self->url) == 0) {
        Py_SETREF(self->url, Py_NewRef(url));
    } else { /* a target split across reads */
        PyObject *u = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(self->url) + PyBytes_GET_SIZE(url));
        if (u == NULL) return NULL;
        memcpy(PyBytes_AS_STRING(u), PyBytes_AS_STRING(self->url), PyBytes_GET_SIZE(self->url));
        memcpy(PyBytes_AS_STRING(u) + PyBytes_GET_SIZE(self->url), PyBytes_AS_STRING(url), PyBytes_GET_SIZE(url));
        Py_SETREF(self->url, u);
    }
    if (PyBytes_GET_SIZE(self->url) > self->max_line) return over(self, s_url, "request target over the limit");
    Py_RETURN_NONE;
}

/* name.decode("latin-1").lower(): str.lower of a latin-1 character is +0x20 for A-Z and for
 * 0xC0-0xDE but 0xD7 (the multiplication sign); a common name answers its string made once. */
static PyObject *lower_name(const char *p, Py_ssize_t n) {
    char stack[64];
    char *buf = n <= (Py_ssize_t)sizeof(stack) ? stack : PyMem_Malloc(n);
    if (buf == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        buf[i] = (char)(((c >= 'A' && c <= 'Z') || (c >= 0xC0 && c <= 0xDE && c != 0xD7)) ? c + 0x20 : c);
    }
    PyObject *out = NULL;
    for (size_t k = 0; k < N_NAMES; k++) {
        if ((Py_ssize_t)strlen(NAMES[k]) == n && memcmp(NAMES[k], buf, n) == 0) {
            out = Py_NewRef(names[k]);
            break;
        }
    }
    if (out == NULL) out = PyUnicode_DecodeLatin1(buf, n, NULL);
    if (buf != stack) PyMem_Free(buf);
    return out;
}

static PyObject *on_header(RequestParts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "on_header(name: bytes, value: bytes)");
        return NULL;
    }
    Py_ssize_t nlen = PyBytes_GET_SIZE(args[0]), vlen = PyBytes_GET_SIZE(args[1]);
    self->header_bytes += nlen + vlen;
    if (self->header_bytes > self->max_header_bytes || PyDict_GET_SIZE(self->headers) >= self->max_headers)
        return over(self, s_headers, "request header fields over the limit");
    PyObject *key = lower_name(PyBytes_AS_STRING(args[0]), nlen);
    if (key == NULL) return NULL;
    PyObject *value = PyUnicode_DecodeLatin1(PyBytes_AS_STRING(args[1]), vlen, NULL);
    if (value == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *old = PyDict_GetItemWithError(self->headers, key); /* borrowed */
    if (old != NULL) { /* a repeated field: its values joined, as one field */
        PyObject *joined = PyUnicode_FromFormat("%U, %U", old, value);
        Py_SETREF(value, joined);
    } else if (PyErr_Occurred()) {
        Py_CLEAR(value);
    }
    int rc = value == NULL ? -1 : PyDict_SetItem(self->headers, key, value);
    Py_DECREF(key);
    Py_XDECREF(value);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *on_body(RequestParts *self, PyObject *body) {
    if (!PyBytes_Check(body)) {
        PyErr_SetString(PyExc_TypeError, "on_body(bytes)");
        return NULL;
    }
    self->size += PyBytes_GET_SIZE(body);
    if (self->size > self->max_body) return over(self, s_body, "request body over the limit");
    if (PyList_Append(self->body, body) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef rp_methods[] = {
    {"on_message_begin", (PyCFunction)on_message_begin, METH_NOARGS, "A new request: every part empty, partial."},
    {"on_url", (PyCFunction)on_url, METH_O, "More of the request target."},
    {"on_header", (PyCFunction)(void (*)(void))on_header, METH_FASTCALL, "One header field."},
    {"on_body", (PyCFunction)on_body, METH_O, "A chunk of the body."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef rp_members[] = {
    {"url", T_OBJECT_EX, offsetof(RequestParts, url), READONLY, "the request target's bytes"},
    {"headers", T_OBJECT_EX, offsetof(RequestParts, headers), READONLY, "the header fields"},
    {"body", T_OBJECT_EX, offsetof(RequestParts, body), READONLY, "the body's chunks"},
    {"error", T_OBJECT_EX, offsetof(RequestParts, error), READONLY, "the part over its limit, or None"},
    {"header_bytes", T_PYSSIZET, offsetof(RequestParts, header_bytes), READONLY, NULL},
    {"size", T_PYSSIZET, offsetof(RequestParts, size), READONLY, NULL},
    {"max_line", T_PYSSIZET, offsetof(RequestParts, max_line), READONLY, NULL},
    {"max_header_bytes", T_PYSSIZET, offsetof(RequestParts, max_header_bytes), READONLY, NULL},
    {"max_headers", T_PYSSIZET, offsetof(RequestParts, max_headers), READONLY, NULL},
    {"max_body", T_PYSSIZET, offsetof(RequestParts, max_body), READONLY, NULL},
    {"partial", T_BOOL, offsetof(RequestParts, partial), 0, "a request has begun and is not complete"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RequestPartsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuhit._speedups.RequestParts",
    .tp_basicsize = sizeof(RequestParts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RequestParts(max_line, max_header_bytes, max_headers, max_body): one connection's request in "
              "progress (gateway.http.request_parts.RequestParts in C).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rp_init,
    .tp_dealloc = (destructor)rp_dealloc,
    .tp_methods = rp_methods,
    .tp_members = rp_members,
};

int reqparts_add_type(PyObject *module) {
    for (size_t k = 0; k < N_NAMES; k++)
        if (names[k] == NULL && (names[k] = PyUnicode_InternFromString(NAMES[k])) == NULL) return -1;
    if (empty_bytes == NULL && (empty_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL) return -1;
    if (s_url == NULL && (s_url = PyUnicode_InternFromString("url")) == NULL) return -1;
    if (s_headers == NULL && (s_headers = PyUnicode_InternFromString("headers")) == NULL) return -1;
    if (s_body == NULL && (s_body = PyUnicode_InternFromString("body")) == NULL) return -1;
    if (PyType_Ready(&RequestPartsType) < 0) return -1;
    return PyModule_AddObjectRef(module, "RequestParts", (PyObject *)&RequestPartsType);
}
