/*
 * A batch frame joined straight from the memory-mapped dataset, compiled.
 *
 * The same bytes as `codec.encode_batch_pieces` of `Assembler.pieces` (a test
 * checks they agree), without a Python object per row: the frame is
 * allocated once at its final size and each row's tokens and mask are copied
 * into it, then padded. Every slice is checked against its source buffer
 * before anything is copied; the copying runs without the GIL. Python falls
 * back to the pieces path when this extension was not built.
 *
 * `plan` works out, in one pass over a batch's rows, what `frame` needs of
 * each row (its length cut to the batch's width, the chunks and starts of its
 * tokens and mask) and checks every row lies in the dataset: what took a
 * dozen numpy calls a batch (a test checks the two agree).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* one prefetch a page: the hardware prefetcher follows a slice within a page by itself */
#define PREFETCH_STRIDE 4096
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define PREFETCH(p) ((void)(p))
#endif

#define MAX_CHUNKS 65536

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* A contiguous buffer of every item of `list`, in *views (PyMem_Free it after release_all). */
static int take_all(PyObject *list, Py_buffer **views, Py_ssize_t *n, const char *what) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of buffers", what);
        return -1;
    }
    Py_ssize_t count = PyList_GET_SIZE(list);
    if (count < 1 || count > MAX_CHUNKS) {
        PyErr_Format(PyExc_ValueError, "%s must hold 1 to %d buffers", what, MAX_CHUNKS);
        return -1;
    }
    Py_buffer *taken = PyMem_Calloc((size_t)count, sizeof(Py_buffer));
    if (!taken) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(list, i), &taken[i], PyBUF_C_CONTIGUOUS) < 0) {
            release_all(taken, i);
            PyMem_Free(taken);
            return -1;
        }
    }
    *views = taken;
    *n = count;
    return 0;
}

static PyObject *frame(PyObject *self, PyObject *args) {
    Py_buffer head = {0}, gap = {0}, samples = {0}, lens = {0};
    Py_buffer ids_chunk = {0}, mask_chunk = {0}, ids_at = {0}, mask_at = {0}, cut = {0};
    PyObject *ids_list, *mask_list;
    Py_ssize_t width;
    int pad;
    if (!PyArg_ParseTuple(args, "y*y*y*y*OOy*y*y*y*y*ni", &head, &gap, &samples, &lens, &ids_list,
                          &mask_list, &ids_chunk, &mask_chunk, &ids_at, &mask_at, &cut, &width, &pad))
        return NULL;
    Py_buffer *ids_src = NULL, *mask_src = NULL;
    Py_ssize_t n_ids = 0, n_mask = 0;
    PyObject *out = NULL;
    Py_ssize_t rows = cut.len / 8;
    if (width < 1 || rows < 1 || cut.len != rows * 8 || ids_chunk.len != cut.len ||
        mask_chunk.len != cut.len || ids_at.len != cut.len || mask_at.len != cut.len ||
        samples.len != rows * 8 || lens.len != rows * 4 || width > PY_SSIZE_T_MAX / 5 / rows) {
        PyErr_SetString(PyExc_ValueError, "frame: the row arrays and widths do not agree");
        goto done;
    }
    if (take_all(ids_list, &ids_src, &n_ids, "ids_chunks") < 0) goto done;
    if (take_all(mask_list, &mask_src, &n_mask, "mask_chunks") < 0) goto done;
    const int64_t *ic = ids_chunk.buf, *mc = mask_chunk.buf, *ia = ids_at.buf, *ma = mask_at.buf,
                  *n = cut.buf;
    /* check every slice before copying anything */
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (n[r] < 0 || n[r] > width || ic[r] < 0 || ic[r] >= n_ids || mc[r] < 0 || mc[r] >= n_mask ||
            ia[r] < 0 || ma[r] < 0 || ia[r] > ids_src[ic[r]].len / 4 - n[r] ||
            ma[r] > mask_src[mc[r]].len - n[r]) {
            PyErr_Format(PyExc_ValueError, "frame: row %zd's slice lies outside its data chunk", r);
            goto done;
        }
    }
    Py_ssize_t tokens = rows * width;
    Py_ssize_t size = head.len + 4 * tokens + gap.len + samples.len + lens.len + tokens;
    out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) goto done;
    char *at = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    /* The rows sit in the page cache, 4 KiB pages scattered in physical memory, and the
       hardware prefetcher stops at every page boundary: ask for every page of every slice
       first, so their misses overlap, then copy (the frame 53 -> 43 us in one process, its
       assembly in the server 96-106 -> 87-90 us; docs/serving.md). */
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *src = (const char *)ids_src[ic[r]].buf + ia[r] * 4;
        for (Py_ssize_t o = 0; o < n[r] * 4; o += PREFETCH_STRIDE) PREFETCH(src + o);
        if (n[r]) PREFETCH(src + n[r] * 4 - 1); /* the last page, when the slice starts late in one */
        const char *msrc = (const char *)mask_src[mc[r]].buf + ma[r];
        for (Py_ssize_t o = 0; o < n[r]; o += PREFETCH_STRIDE) PREFETCH(msrc + o);
        if (n[r]) PREFETCH(msrc + n[r] - 1);
    }
    memcpy(at, head.buf, head.len);
    at += head.len;
    uint8_t padb[4] = {(uint8_t)(pad & 0xff), (uint8_t)((pad >> 8) & 0xff), (uint8_t)((pad >> 16) & 0xff),
                       (uint8_t)((pad >> 24) & 0xff)};  /* little-endian int32 */
    for (Py_ssize_t r = 0; r < rows; r++) {
        memcpy(at, (const char *)ids_src[ic[r]].buf + ia[r] * 4, (size_t)n[r] * 4);
        char *p = at + n[r] * 4, *end = at + width * 4;
        if (pad == 0) {
            memset(p, 0, (size_t)(end - p));
        } else {
            for (; p < end; p += 4) memcpy(p, padb, 4);
        }
        at = end;
    }
    memcpy(at, gap.buf, gap.len);
    at += gap.len;
    memcpy(at, samples.buf, samples.len);
    at += samples.len;
    memcpy(at, lens.buf, lens.len);
    at += lens.len;
    for (Py_ssize_t r = 0; r < rows; r++) {
        memcpy(at, (const char *)mask_src[mc[r]].buf + ma[r], (size_t)n[r]);
        memset(at + n[r], 0, (size_t)(width - n[r]));
        at += width;
    }
    Py_END_ALLOW_THREADS
done:
    if (ids_src) {
        release_all(ids_src, n_ids);
        PyMem_Free(ids_src);
    }
    if (mask_src) {
        release_all(mask_src, n_mask);
        PyMem_Free(mask_src);
    }
    PyBuffer_Release(&head);
    PyBuffer_Release(&gap);
    PyBuffer_Release(&samples);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&ids_chunk);
    PyBuffer_Release(&mask_chunk);
    PyBuffer_Release(&ids_at);
    PyBuffer_Release(&mask_at);
    PyBuffer_Release(&cut);
    return out;
}

/* The chunk a row lies in: the last c with first[c] <= row (first[0] == 0, ascending). */
static Py_ssize_t chunk_of(const int64_t *first, Py_ssize_t n, int64_t row) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/*
 * plan(rows, width, offsets, ids_first, ids_delta, mask_first, mask_delta) -> (bytes, real_tokens)
 *
 * What `frame` needs to know of each row, in one pass and without a numpy
 * call: five int64 arrays (each row's length cut to `width`, the chunks of
 * its tokens and mask, and where they start in those chunks' values) and the
 * int32 lengths, laid end to end, and the sum of the cut lengths. Every row
 * must lie in [0, len(offsets) - 1): the first one outside is named.
 */
static PyObject *plan(PyObject *self, PyObject *args) {
    Py_buffer rows = {0}, offsets = {0}, ids_first = {0}, ids_delta = {0}, mask_first = {0}, mask_delta = {0};
    Py_ssize_t width;
    PyObject *out = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*ny*y*y*y*y*", &rows, &width, &offsets, &ids_first, &ids_delta,
                          &mask_first, &mask_delta))
        return NULL;
    Py_ssize_t n = rows.len / 8, num_rows = offsets.len / 8 - 1;
    Py_ssize_t n_ids = ids_first.len / 8, n_mask = mask_first.len / 8;
    if (n < 1 || rows.len != n * 8 || num_rows < 1 || width < 1 || n_ids < 1 || n_mask < 1 ||
        ids_delta.len != ids_first.len || mask_delta.len != mask_first.len) {
        PyErr_SetString(PyExc_ValueError, "plan: the row, offset and chunk arrays do not agree");
        goto done;
    }
    const int64_t *r = rows.buf, *off = offsets.buf, *idf = ids_first.buf, *idd = ids_delta.buf,
                  *mf = mask_first.buf, *md = mask_delta.buf;
    int64_t low = r[0], high = r[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        if (r[i] < low) low = r[i];
        if (r[i] > high) high = r[i];
    }
    if (low < 0 || high >= num_rows) {
        PyErr_Format(PyExc_ValueError, "row %lld is outside the dataset's rows [0, %zd)",
                     (long long)(low < 0 ? low : high), num_rows);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * (5 * 8 + 4));
    if (!out) goto done;
    int64_t *cut = (int64_t *)PyBytes_AS_STRING(out), *ic = cut + n, *mc = ic + n, *ia = mc + n, *ma = ia + n;
    int32_t *lens = (int32_t *)(ma + n);
    long long real = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t start = off[r[i]], len = off[r[i] + 1] - start;
        cut[i] = len < width ? len : width;
        ic[i] = chunk_of(idf, n_ids, r[i]);
        mc[i] = chunk_of(mf, n_mask, r[i]);
        ia[i] = start + idd[ic[i]];
        ma[i] = start + md[mc[i]];
        lens[i] = (int32_t)cut[i];
        real += cut[i];
    }
    result = Py_BuildValue("(OL)", out, real);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&ids_first);
    PyBuffer_Release(&ids_delta);
    PyBuffer_Release(&mask_first);
    PyBuffer_Release(&mask_delta);
    return result;
}

static PyMethodDef methods[] = {
    {"frame", frame, METH_VARARGS,
     "frame(head, gap, samples, lengths, ids_chunks, mask_chunks, ids_chunk, mask_chunk, ids_at, mask_at, "
     "cut, width, pad) -> bytes: a batch frame joined from the dataset's buffers"},
    {"plan", plan, METH_VARARGS,
     "plan(rows, width, offsets, ids_first, ids_delta, mask_first, mask_delta) -> (bytes, real_tokens): "
     "each row's cut length, chunks and starts (five int64 arrays) and the int32 lengths, end to end"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frame", NULL, -1, methods};

PyMODINIT_FUNC PyInit__frame(void) { return PyModule_Create(&module); }
