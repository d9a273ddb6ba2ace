/*
 * A batch frame's header parsed and its rows checked in C: the receive path's fast case.
 *
 * `batch(frame)` reads a frame in exactly the form the server writes
 * (codec.encode_batch's layout, each header field at most once and in field
 * order, nothing unknown) and checks what codec.decode_frame checks of such a
 * frame: the version, the shape and counts, the canonical buffer layout, that
 * the frame ends where the payload does, every row length in [1, padded_len]
 * summing to real_tokens, and no negative sample id. It returns the fields
 * codec needs to make its views, or None for anything else (another kind of
 * frame, another encoding, or a frame that breaks the contract): the Python
 * decoder then reads it and names what is wrong. A test checks the two agree
 * on valid, mutated and random frames.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WIRE_VERSION 1
#define ALIGN 8
#define U32_MAX 0xffffffffULL
enum { DTYPE_INT8 = 1, DTYPE_INT32 = 2, DTYPE_INT64 = 3 };

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* A varint of at most 10 bytes that fits 64 bits; 0 if there is none. */
static int varint(Reader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && r->p < r->end; shift += 7) {
        uint8_t b = *r->p++;
        if (shift == 63 && b > 1) return 0;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

/*
 * The next field's number and wire type, if its number is above *last (fields in order, each once):
 * 1, or 0 at the end (*field = 0), or -1 for anything else.
 */
static int next_field(Reader *r, int *last, int *field, int *wire) {
    if (r->p == r->end) {
        *field = 0;
        return 0;
    }
    uint64_t key;
    if (!varint(r, &key) || key >> 3 > 64 || (int)(key >> 3) <= *last) return -1;
    *field = (int)(key >> 3);
    *wire = (int)(key & 7);
    *last = *field;
    return 1;
}

/* A length-delimited field's body. */
static int body(Reader *r, Reader *out) {
    uint64_t len;
    if (!varint(r, &len) || len > (uint64_t)(r->end - r->p)) return 0;
    out->p = r->p;
    out->end = r->p + len;
    r->p += len;
    return 1;
}

typedef struct {
    uint64_t dtype, offset, length;
} Buffer;

static int read_buffer(Reader *r, Buffer *b) {
    Reader m;
    if (!body(r, &m)) return 0;
    uint64_t *slots[4] = {NULL, &b->dtype, &b->offset, &b->length};
    int last = 0, field, wire, got;
    while ((got = next_field(&m, &last, &field, &wire)) == 1) {
        if (field > 3 || wire != 0 || !varint(&m, slots[field])) return 0;
    }
    return got == 0;
}

typedef struct {
    uint64_t v[11]; /* fields 1..10 by number (9, the fingerprint, unused here) */
    const uint8_t *fp;
    Py_ssize_t fp_len;
    Buffer buf[4]; /* fields 11..14 */
    int have_buf[4];
} Batch;

static int read_batch(Reader *r, Batch *h) {
    static const uint64_t top[11] = {0, ~0ULL, ~0ULL, U32_MAX, U32_MAX, U32_MAX, U32_MAX, ~0ULL, ~0ULL, 0, ~0ULL};
    int last = 0, field, wire, got;
    while ((got = next_field(r, &last, &field, &wire)) == 1) {
        if (field == 9) {
            Reader s;
            if (wire != 2 || !body(r, &s)) return 0;
            h->fp = s.p;
            h->fp_len = s.end - s.p;
        } else if (field <= 10) {
            if (wire != 0 || !varint(r, &h->v[field]) || h->v[field] > top[field]) return 0;
        } else if (field <= 14) {
            if (wire != 2 || !read_buffer(r, &h->buf[field - 11])) return 0;
            h->have_buf[field - 11] = 1;
        } else {
            return 0;
        }
    }
    return got == 0;
}

static uint64_t align8(uint64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

static int32_t read_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int64_t read_i64(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/*
 * batch(frame) -> (epoch, step, rank, bucket, rows, padded_len, real_tokens, fingerprint, start,
 *                  sample_at, lengths_at, mask_at) or None
 *
 * `start` is the payload's offset in the frame; the others are the buffers' offsets in the payload
 * (input_ids is at 0).
 */
static PyObject *batch(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL;
    const uint8_t *frame = view.buf;
    uint64_t size = (uint64_t)view.len;
    if (size < 4) goto fallback;
    uint64_t header_len = (uint64_t)frame[0] | (uint64_t)frame[1] << 8 | (uint64_t)frame[2] << 16 |
                          (uint64_t)frame[3] << 24;
    uint64_t head = 4 + header_len;
    if (head > size) goto fallback;
    Reader r = {frame + 4, frame + head};
    uint64_t version = 0;
    int last = 0, field, wire;
    /* FrameHeader: version (1), then batch (2), and nothing else */
    if (next_field(&r, &last, &field, &wire) != 1 || field != 1 || wire != 0 || !varint(&r, &version) ||
        version != WIRE_VERSION)
        goto fallback;
    Reader b;
    if (next_field(&r, &last, &field, &wire) != 1 || field != 2 || wire != 2 || !body(&r, &b) || r.p != r.end)
        goto fallback;
    Batch h;
    memset(&h, 0, sizeof h);
    if (!read_batch(&b, &h)) goto fallback;
    uint64_t rows = h.v[5], width = h.v[6];
    if (rows < 1 || width < 1 || h.v[8] != rows * width) goto fallback; /* both < 2**32: no overflow */
    uint64_t tokens = rows * width;
    uint64_t sample_at = align8(4 * tokens), lengths_at = sample_at + 8 * rows, mask_at = lengths_at + 4 * rows;
    uint64_t payload = mask_at + tokens, start = align8(head);
    static const int dtypes[4] = {DTYPE_INT32, DTYPE_INT8, DTYPE_INT32, DTYPE_INT64};
    const uint64_t offsets[4] = {0, mask_at, lengths_at, sample_at};
    const uint64_t lengths[4] = {4 * tokens, tokens, 4 * rows, 8 * rows};
    if (h.v[10] != payload || start > size || size - start != payload) goto fallback;
    for (int i = 0; i < 4; i++) {
        if (!h.have_buf[i] || h.buf[i].dtype != (uint64_t)dtypes[i] || h.buf[i].offset != offsets[i] ||
            h.buf[i].length != lengths[i])
            goto fallback;
    }
    const uint8_t *lens = frame + start + lengths_at, *samples = frame + start + sample_at;
    uint64_t real = 0;
    for (uint64_t i = 0; i < rows; i++) {
        int32_t n = read_i32(lens + 4 * i);
        if (n < 1 || (uint64_t)n > width || read_i64(samples + 8 * i) < 0) goto fallback;
        real += (uint64_t)n;
    }
    if (real != h.v[7]) goto fallback;
    PyObject *fp = PyUnicode_DecodeUTF8(h.fp ? (const char *)h.fp : "", h.fp_len, NULL);
    if (!fp) {
        PyErr_Clear(); /* not UTF-8: the Python decoder says so */
        goto fallback;
    }
    result = Py_BuildValue("(KKKKKKKNKKKK)", (unsigned long long)h.v[1], (unsigned long long)h.v[2],
                           (unsigned long long)h.v[3], (unsigned long long)h.v[4], (unsigned long long)rows,
                           (unsigned long long)width, (unsigned long long)real, fp, (unsigned long long)start,
                           (unsigned long long)sample_at, (unsigned long long)lengths_at,
                           (unsigned long long)mask_at);
    PyBuffer_Release(&view);
    return result;
fallback:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"batch", batch, METH_O,
     "batch(frame) -> (epoch, step, rank, bucket, rows, padded_len, real_tokens, fingerprint, start, "
     "sample_at, lengths_at, mask_at), or None where codec's Python decoder must read the frame"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&module); }
