/*
 * A batch frame joined straight from the memory-mapped dataset, compiled.
 *
 * The same bytes as `codec.encode_batch_pieces` of `Assembler.pieces` (a test
 * checks they agree), without a Python object per row: the frame is
 * allocated once at its final size and each row's tokens and mask are copied
 * into it, then padded. Every slice is checked against its source buffer
 * before anything is copied; the copying runs without the GIL. Python falls
 * back to the pieces path when this extension was not built. `build` also
 * takes columns of any other integer type (a mask of Python ints is int64 in
 * datasets; ids may be uint16, uint32 or int64) and converts them to the
 * wire's int32 ids and int8 mask as it copies; a value outside the wire's
 * type raises OverflowError, and the checked path names its row.
 *
 * `plan` works out, in one pass over a batch's rows, what `frame` needs of
 * each row (its length cut to the batch's width, the chunks and starts of its
 * tokens and mask) and checks every row lies in the dataset: what took a
 * dozen numpy calls a batch (a test checks the two agree).
 *
 * Every read of the mapped dataset here is guarded. A data file cut shorter while it is served
 * makes a read past its new end a SIGBUS, which would kill the server if the cut came between
 * its check of the files (a stat before each batch) and the copy. The read is abandoned instead
 * and the call raises MappedReadError (an OSError); the server then finds the change and
 * refuses the batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

/* one prefetch a page: the hardware prefetcher follows a slice within a page by itself */
#define PREFETCH_STRIDE 4096
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define PREFETCH(p) ((void)(p))
#endif

#define MAX_CHUNKS 65536

/* the conversion loops vectorized (gcc's -O2 leaves them scalar: uint16 ids 25 -> 19 us a batch) */
#if defined(__GNUC__) && !defined(__clang__)
#define VECTORIZED __attribute__((optimize("O3")))
#else
#define VECTORIZED
#endif

/* A column's integer type, as numpy spells it: 'i' or 'u' and the size in bytes (1, 2, 4 or 8). */
typedef struct {
    char sign;
    int size;
} Kind;

static const Kind IDS_WIRE = {'i', 4}, MASK_WIRE = {'i', 1};

static int same_kind(Kind a, Kind b) { return a.sign == b.sign && a.size == b.size; }

/* A mask kind may also be 'l' (a signed `labels` column: the mask is 1 where the label is not -100, the
   Hugging Face convention) or 'a' (no mask column: every token carries loss; the chunks given are the
   ids', so the size is theirs). Neither can hold a value outside the wire's int8. */
static int parse_kind(const char *text, Kind *kind, int mask) {
    int sign_ok = text[0] == 'i' || text[0] == 'u' || (mask && (text[0] == 'l' || text[0] == 'a'));
    if (sign_ok && text[1] && strchr("1248", text[1]) && !text[2]) {
        kind->sign = text[0];
        kind->size = text[1] - '0';
        return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "build: a column kind is 'i' or 'u' (a mask's also 'l' or 'a') and 1, 2, 4 or 8, got '%.20s'",
                 text);
    return -1;
}

#define LABELS_TO_MASK(SRC_T)                                                                 \
    for (Py_ssize_t i = 0; i < n; i++) {                                                      \
        SRC_T v;                                                                              \
        memcpy(&v, src + i * (Py_ssize_t)sizeof(SRC_T), sizeof(SRC_T));                       \
        dst[i] = (char)(v != -100);                                                           \
    }

/* n labels of `size` bytes at src as n mask bytes: 0 where the label is -100 (no loss), else 1. */
VECTORIZED static void labels_to_mask(char *dst, const char *src, int size, Py_ssize_t n) {
    switch (size) {
        case 1: LABELS_TO_MASK(int8_t) break;
        case 2: LABELS_TO_MASK(int16_t) break;
        case 4: LABELS_TO_MASK(int32_t) break;
        default: LABELS_TO_MASK(int64_t) break;
    }
}

/* n values of `kind` at src written to dst as DST_T; sets bad when one lies outside [LO, HI]
   (a check that a narrow type cannot fail is always false, and the compiler drops it). */
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wtype-limits"
#endif
#define NARROW_SIGNED(SRC_T, DST_T, LO, HI)                                                   \
    for (Py_ssize_t i = 0; i < n; i++) {                                                      \
        SRC_T v;                                                                              \
        memcpy(&v, src + i * (Py_ssize_t)sizeof(SRC_T), sizeof(SRC_T));                       \
        bad |= ((int64_t)v < (LO)) | ((int64_t)v > (HI));                                     \
        DST_T w = (DST_T)v;                                                                   \
        memcpy(dst + i * (Py_ssize_t)sizeof(DST_T), &w, sizeof(DST_T));                       \
    }
#define NARROW_UNSIGNED(SRC_T, DST_T, HI)                                                     \
    for (Py_ssize_t i = 0; i < n; i++) {                                                      \
        SRC_T v;                                                                              \
        memcpy(&v, src + i * (Py_ssize_t)sizeof(SRC_T), sizeof(SRC_T));                       \
        bad |= (uint64_t)v > (uint64_t)(HI);                                                  \
        DST_T w = (DST_T)v;                                                                   \
        memcpy(dst + i * (Py_ssize_t)sizeof(DST_T), &w, sizeof(DST_T));                       \
    }
#define NARROW_ANY(DST_T, LO, HI)                                                             \
    switch ((kind.sign == 'u' ? 16 : 0) + kind.size) {                                        \
        case 1: NARROW_SIGNED(int8_t, DST_T, LO, HI) break;                                   \
        case 2: NARROW_SIGNED(int16_t, DST_T, LO, HI) break;                                  \
        case 4: NARROW_SIGNED(int32_t, DST_T, LO, HI) break;                                  \
        case 8: NARROW_SIGNED(int64_t, DST_T, LO, HI) break;                                  \
        case 17: NARROW_UNSIGNED(uint8_t, DST_T, HI) break;                                   \
        case 18: NARROW_UNSIGNED(uint16_t, DST_T, HI) break;                                  \
        case 20: NARROW_UNSIGNED(uint32_t, DST_T, HI) break;                                  \
        default: NARROW_UNSIGNED(uint64_t, DST_T, HI) break;                                  \
    }

/* n values of `kind` copied to dst as the wire's type (int32 when wide, else int8): 1 if one does not fit. */
VECTORIZED static int narrow(char *dst, const char *src, Kind kind, Py_ssize_t n, int wide) {
    int bad = 0;
    if (wide) {
        NARROW_ANY(int32_t, INT32_MIN, INT32_MAX)
    } else {
        NARROW_ANY(int8_t, INT8_MIN, INT8_MAX)
    }
    return bad;
}

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

/* Check every row's slice against its chunk (before anything is copied); -1 with ValueError if one is outside. */
static int check_slices(const Py_buffer *ids_src, Py_ssize_t n_ids, const Py_buffer *mask_src, Py_ssize_t n_mask,
                        const int64_t *ic, const int64_t *mc, const int64_t *ia, const int64_t *ma,
                        const int64_t *n, Py_ssize_t rows, Py_ssize_t width, Kind ids_kind, Kind mask_kind) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (n[r] < 0 || n[r] > width || ic[r] < 0 || ic[r] >= n_ids || mc[r] < 0 || mc[r] >= n_mask ||
            ia[r] < 0 || ma[r] < 0 || ia[r] > ids_src[ic[r]].len / ids_kind.size - n[r] ||
            ma[r] > mask_src[mc[r]].len / mask_kind.size - n[r]) {
            PyErr_Format(PyExc_ValueError, "frame: row %zd's slice lies outside its data chunk", r);
            return -1;
        }
    }
    return 0;
}

/* ---- reads of the mapped dataset that fault (SIGBUS: a data file cut shorter under its mapping) ---- */

static PyObject *MappedReadError;            /* _frame.MappedReadError, an OSError */
/* set while this thread reads mapped pages; initial-exec: the handler reads it with no allocation */
#if defined(__GNUC__) || defined(__clang__)
static _Thread_local sigjmp_buf *fault_jump __attribute__((tls_model("initial-exec")));
#else
static _Thread_local sigjmp_buf *fault_jump;
#endif
static struct sigaction previous_bus;        /* what SIGBUS did before: every other SIGBUS goes there */
static int bus_guarded;

static void on_bus(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *jump = fault_jump;
    if (jump) { /* this thread's guarded read: abandon it (SA_NODEFER: no signal mask to restore) */
        fault_jump = NULL;
        siglongjmp(*jump, 1);
    }
    int sent = info->si_code <= 0; /* kill() or raise(), not a fault */
    if (sent && !(previous_bus.sa_flags & SA_SIGINFO) && previous_bus.sa_handler == SIG_IGN) return;
    /* not ours: the disposition from before takes it (a fault comes back at once, a signal is resent) */
    sigaction(SIGBUS, &previous_bus, NULL);
    if (sent) raise(sig);
    (void)context;
}

/* Route SIGBUS through on_bus (once a process, with the GIL held); -1 with OSError set. */
static int guard_reads(void) {
    if (bus_guarded) return 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_bus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_bus) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    bus_guarded = 1;
    return 0;
}

static void mapped_read_failed(void) {
    PyErr_SetString(MappedReadError,
                    "a page of the memory-mapped dataset could not be read (SIGBUS): a data file was cut "
                    "shorter while it was served");
}

/* The frame's bytes: head, the padded tokens, gap, sample ids, lengths, the padded masks (checked slices). */
static PyObject *copy_frame(const char *head, Py_ssize_t head_len, const char *gap, Py_ssize_t gap_len,
                            const char *samples, const char *lens, const Py_buffer *ids_src,
                            const Py_buffer *mask_src, const int64_t *ic, const int64_t *mc, const int64_t *ia,
                            const int64_t *ma, const int64_t *n, Py_ssize_t rows, Py_ssize_t width, int pad,
                            Kind ids_kind, Kind mask_kind) {
    Py_ssize_t tokens = rows * width;
    Py_ssize_t size = head_len + 4 * tokens + gap_len + 8 * rows + 4 * rows + tokens;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) return NULL;
    char *at = PyBytes_AS_STRING(out);
    /* a value outside the wire's type (a column converted): the checked path names its row */
    Py_ssize_t bad_ids = -1, bad_mask = -1;
    const Py_ssize_t ids_size = ids_kind.size, mask_size = mask_kind.size;
    const int ids_copied = same_kind(ids_kind, IDS_WIRE), mask_copied = same_kind(mask_kind, MASK_WIRE);
    sigjmp_buf jump;
    volatile int faulted = 0;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(jump, 0)) {
        faulted = 1; /* a SIGBUS in the copy below: nothing of this frame is used */
        goto copied;
    }
    fault_jump = &jump;
    /* The rows sit in the page cache, 4 KiB pages scattered in physical memory, and the
       hardware prefetcher stops at every page boundary: ask for every page of every slice
       first, so their misses overlap, then copy (the frame 53 -> 43 us in one process, its
       assembly in the server 96-106 -> 87-90 us; docs/serving.md). */
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *src = (const char *)ids_src[ic[r]].buf + ia[r] * ids_size;
        for (Py_ssize_t o = 0; o < n[r] * ids_size; o += PREFETCH_STRIDE) PREFETCH(src + o);
        if (n[r]) PREFETCH(src + n[r] * ids_size - 1); /* the last page, when the slice starts late in one */
        if (mask_kind.sign == 'a') continue; /* no mask read: its "chunks" are the ids' */
        const char *msrc = (const char *)mask_src[mc[r]].buf + ma[r] * mask_size;
        for (Py_ssize_t o = 0; o < n[r] * mask_size; o += PREFETCH_STRIDE) PREFETCH(msrc + o);
        if (n[r]) PREFETCH(msrc + n[r] * mask_size - 1);
    }
    memcpy(at, head, (size_t)head_len);
    at += head_len;
    uint8_t padb[4] = {(uint8_t)(pad & 0xff), (uint8_t)((pad >> 8) & 0xff), (uint8_t)((pad >> 16) & 0xff),
                       (uint8_t)((pad >> 24) & 0xff)};  /* little-endian int32 */
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *src = (const char *)ids_src[ic[r]].buf + ia[r] * ids_size;
        if (ids_copied) {
            memcpy(at, src, (size_t)n[r] * 4);
        } else if (narrow(at, src, ids_kind, n[r], 1) && bad_ids < 0) {
            bad_ids = r;
        }
        char *p = at + n[r] * 4, *end = at + width * 4;
        if (pad == 0) {
            memset(p, 0, (size_t)(end - p));
        } else {
            for (; p < end; p += 4) memcpy(p, padb, 4);
        }
        at = end;
    }
    memcpy(at, gap, (size_t)gap_len);
    at += gap_len;
    memcpy(at, samples, (size_t)(8 * rows));
    at += 8 * rows;
    memcpy(at, lens, (size_t)(4 * rows));
    at += 4 * rows;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *msrc = (const char *)mask_src[mc[r]].buf + ma[r] * mask_size;
        if (mask_kind.sign == 'a') {
            memset(at, 1, (size_t)n[r]);
        } else if (mask_kind.sign == 'l') {
            labels_to_mask(at, msrc, mask_size, n[r]);
        } else if (mask_copied) {
            memcpy(at, msrc, (size_t)n[r]);
        } else if (narrow(at, msrc, mask_kind, n[r], 0) && bad_mask < 0) {
            bad_mask = r;
        }
        memset(at + n[r], 0, (size_t)(width - n[r]));
        at += width;
    }
copied:
    fault_jump = NULL;
    Py_END_ALLOW_THREADS
    if (faulted) {
        Py_DECREF(out);
        mapped_read_failed();
        return NULL;
    }
    if (bad_ids >= 0 || bad_mask >= 0) {
        Py_DECREF(out);
        if (bad_ids >= 0)
            PyErr_Format(PyExc_OverflowError, "frame: row %zd's input_ids hold a value outside int32", bad_ids);
        else
            PyErr_Format(PyExc_OverflowError, "frame: row %zd's loss_mask holds a value outside int8", bad_mask);
        return NULL;
    }
    return out;
}

static void release_chunks(Py_buffer *ids_src, Py_ssize_t n_ids, Py_buffer *mask_src, Py_ssize_t n_mask) {
    if (ids_src) {
        release_all(ids_src, n_ids);
        PyMem_Free(ids_src);
    }
    if (mask_src) {
        release_all(mask_src, n_mask);
        PyMem_Free(mask_src);
    }
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
    if (guard_reads() < 0) goto done;
    if (take_all(ids_list, &ids_src, &n_ids, "ids_chunks") < 0) goto done;
    if (take_all(mask_list, &mask_src, &n_mask, "mask_chunks") < 0) goto done;
    const int64_t *ic = ids_chunk.buf, *mc = mask_chunk.buf, *ia = ids_at.buf, *ma = mask_at.buf,
                  *n = cut.buf;
    if (check_slices(ids_src, n_ids, mask_src, n_mask, ic, mc, ia, ma, n, rows, width, IDS_WIRE, MASK_WIRE) < 0)
        goto done;
    out = copy_frame(head.buf, head.len, gap.buf, gap.len, samples.buf, lens.buf, ids_src, mask_src, ic, mc,
                     ia, ma, n, rows, width, pad, IDS_WIRE, MASK_WIRE);
done:
    release_chunks(ids_src, n_ids, mask_src, n_mask);
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

/* The plan's arrays of a batch of `n` rows, laid end to end in one buffer of n * PLAN_ROW bytes. */
#define PLAN_ROW (5 * 8 + 4)

/* Entry i of a chunk's list offsets: int32 (list<>) or int64 (large_list<>), as its buffer's itemsize says. */
static inline int64_t offset_at(const Py_buffer *offsets, Py_ssize_t i) {
    return offsets->itemsize == 4 ? (int64_t)((const int32_t *)offsets->buf)[i] : ((const int64_t *)offsets->buf)[i];
}

/* The dataset's tables as `plan` and `build` take them, checked to agree: the rows' range; for the
   ids and the mask, each chunk's first row and token shift (int64; first rows ascending); and the
   ids' chunks' list offsets (its rows + 1 entries, int32 or int64: the dataset's own buffers, read
   from the mapping). */
typedef struct {
    Py_ssize_t num_rows;
    Py_buffer ids_first, ids_shift, mask_first, mask_shift;
    PyObject *ids_list;
    Py_buffer *ids_off;
    Py_ssize_t n_ids_off;
} Tables;

static void release_tables(Tables *t) {
    PyBuffer_Release(&t->ids_first);
    PyBuffer_Release(&t->ids_shift);
    PyBuffer_Release(&t->mask_first);
    PyBuffer_Release(&t->mask_shift);
    release_chunks(t->ids_off, t->n_ids_off, NULL, 0);
    t->ids_off = NULL;
}

static int offsets_usable(const Py_buffer *offsets, Py_ssize_t n) {
    for (Py_ssize_t c = 0; c < n; c++) {
        Py_ssize_t size = offsets[c].itemsize;
        if ((size != 4 && size != 8) || offsets[c].len % size || offsets[c].len / size < 2) return 0;
    }
    return 1;
}

/* Take the offsets lists' buffers; 0 if the tables agree, else -1 with ValueError (or TypeError). */
static int take_tables(Tables *t, const char *caller) {
    if (take_all(t->ids_list, &t->ids_off, &t->n_ids_off, "ids_offsets") < 0) return -1;
    if (t->num_rows < 1 || t->ids_first.len != t->n_ids_off * 8 || t->ids_shift.len != t->ids_first.len ||
        t->mask_first.len < 8 || t->mask_first.len % 8 || t->mask_shift.len != t->mask_first.len ||
        !offsets_usable(t->ids_off, t->n_ids_off)) {
        PyErr_Format(PyExc_ValueError, "%s: the row, offset and chunk arrays do not agree", caller);
        return -1;
    }
    return 0;
}

/*
 * Each row's length cut to `limit`, the chunks of its tokens and mask and where they start (its
 * ids chunk's list offsets; its mask as many tokens into the mask column), and the int32 lengths, into `out` (n * PLAN_ROW bytes); the sum of the
 * cut lengths, or -1 with ValueError naming the first row outside [0, num_rows).
 */
static long long plan_rows(const int64_t *r, Py_ssize_t n, Py_ssize_t limit, const Tables *t, char *out) {
    int64_t low = r[0], high = r[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        if (r[i] < low) low = r[i];
        if (r[i] > high) high = r[i];
    }
    if (low < 0 || high >= t->num_rows) {
        PyErr_Format(PyExc_ValueError, "row %lld is outside the dataset's rows [0, %zd)",
                     (long long)(low < 0 ? low : high), t->num_rows);
        return -1;
    }
    const int64_t *idf = t->ids_first.buf, *ids_shift = t->ids_shift.buf, *mf = t->mask_first.buf,
                  *mask_shift = t->mask_shift.buf;
    Py_ssize_t n_mask = t->mask_first.len / 8;
    int64_t *cut = (int64_t *)out, *ic = cut + n, *mc = ic + n, *ia = mc + n, *ma = ia + n;
    int32_t *lens = (int32_t *)(ma + n);
    /* each row's chunks first, asking for its offsets as they are found: the rows' misses in the
       mapped offsets (4 KiB pages, a TLB miss each) overlap instead of coming one after another */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t c = chunk_of(idf, t->n_ids_off, r[i]);
        const Py_buffer *ids = &t->ids_off[c];
        int64_t at = r[i] - idf[c];
        /* the row's entries must lie in its chunk's offsets (the tables given are a batch's chunks) */
        if (at < 0 || at + 1 >= ids->len / ids->itemsize) {
            PyErr_Format(PyExc_ValueError, "plan: row %lld lies outside the offsets of the chunks given",
                         (long long)r[i]);
            return -1;
        }
        PREFETCH((const char *)ids->buf + at * ids->itemsize);
        ic[i] = c;
        mc[i] = chunk_of(mf, n_mask, r[i]);
    }
    long long real = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_buffer *ids = &t->ids_off[ic[i]];
        int64_t at = r[i] - idf[ic[i]];
        int64_t start = offset_at(ids, at), len = offset_at(ids, at + 1) - start;
        cut[i] = len < limit ? len : limit;
        ia[i] = start;
        ma[i] = start - ids_shift[ic[i]] + mask_shift[mc[i]];
        lens[i] = (int32_t)cut[i];
        real += cut[i];
    }
    return real;
}

/* plan_rows over the tables (the offsets are read from the mapping: guarded); -1 with an error set. */
static long long plan_with(const Tables *t, const int64_t *rows, Py_ssize_t n, Py_ssize_t limit, char *out) {
    sigjmp_buf jump;
    if (guard_reads() < 0) return -1;
    if (sigsetjmp(jump, 0)) {
        fault_jump = NULL;
        mapped_read_failed();
        return -1;
    }
    fault_jump = &jump;
    long long real = plan_rows(rows, n, limit, t, out);
    fault_jump = NULL;
    return real;
}

/*
 * plan(rows, limit, num_rows, ids_first, ids_shift, mask_first, mask_shift, ids_offsets) -> (bytes, real_tokens)
 *
 * What `frame` needs to know of each row, in one pass and without a numpy
 * call: five int64 arrays (each row's length cut to `limit`, at most the
 * batch's width, the chunks of
 * its tokens and mask, and where they start in those chunks' values) and the
 * int32 lengths, laid end to end, and the sum of the cut lengths. A row's
 * start and length are its ids chunk's list offsets (`ids_offsets`: a list
 * of int32 or int64 buffers, one a chunk, beside the chunks' first rows);
 * a row starting t tokens into a column starts at t + shift[c] in chunk c's
 * values, so its mask is found from its ids' start. Every row must lie in
 * [0, num_rows): the first one outside is named.
 */
static PyObject *plan(PyObject *self, PyObject *args) {
    Py_buffer rows = {0};
    Tables t = {0};
    Py_ssize_t limit;
    PyObject *out = NULL, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*nny*y*y*y*O", &rows, &limit, &t.num_rows, &t.ids_first, &t.ids_shift,
                          &t.mask_first, &t.mask_shift, &t.ids_list))
        return NULL;
    Py_ssize_t n = rows.len / 8;
    if (n < 1 || rows.len != n * 8 || limit < 1) {
        PyErr_SetString(PyExc_ValueError, "plan: the row, offset and chunk arrays do not agree");
        goto done;
    }
    if (take_tables(&t, "plan") < 0) goto done;
    out = PyBytes_FromStringAndSize(NULL, n * PLAN_ROW);
    if (!out) goto done;
    long long real = plan_with(&t, rows.buf, n, limit, PyBytes_AS_STRING(out));
    if (real >= 0) result = Py_BuildValue("(OL)", out, real);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&rows);
    release_tables(&t);
    return result;
}

/* ---- the frame header (ladle.proto's FrameHeader with a BatchHeader), as protobuf writes it ---- */

#define WIRE_VERSION 1
#define ALIGN 8
#define MAX_FINGERPRINT 64
#define U32_MAX 0xffffffffULL
/* FrameHeader: prefix (4), version (2), batch tag (1) and length (2), a BatchHeader of at most
   8 varints of 11 bytes, the fingerprint (2 + 64) and 4 Buffers of (2 + 3 x 11): 351, padded */
#define MAX_HEAD 368
enum { DTYPE_INT8 = 1, DTYPE_INT32 = 2, DTYPE_INT64 = 3 };

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* A varint field (wire type 0), left out when 0 as proto3 does; fields here are all < 16. */
static uint8_t *put_field(uint8_t *p, int field, uint64_t v) {
    if (!v) return p;
    *p++ = (uint8_t)(field << 3);
    return put_varint(p, v);
}

/* A length-delimited field (wire type 2) whose body is the `len` bytes at `body`. */
static uint8_t *put_bytes(uint8_t *p, int field, const uint8_t *body, size_t len) {
    *p++ = (uint8_t)(field << 3 | 2);
    p = put_varint(p, len);
    memcpy(p, body, len);
    return p + len;
}

static uint8_t *put_buffer(uint8_t *p, int field, int dtype, uint64_t offset, uint64_t length) {
    uint8_t body[3 * 11], *q = body;
    q = put_field(q, 1, (uint64_t)dtype);
    q = put_field(q, 2, offset);
    q = put_field(q, 3, length);
    return put_bytes(p, field, body, (size_t)(q - body));
}

static Py_ssize_t align8(Py_ssize_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/*
 * The frame's bytes before input_ids into `head` (prefix, header, zero pad to 8; its length
 * returned) and the zero gap before sample_ids (*gap_len): codec.batch_frame_head's bytes.
 */
static Py_ssize_t encode_head(uint8_t *head, Py_ssize_t *gap_len, uint64_t epoch, uint64_t step, uint64_t rank,
                              uint64_t bucket, const char *fp, Py_ssize_t fp_len, Py_ssize_t rows,
                              Py_ssize_t width, long long real) {
    uint64_t tokens = (uint64_t)rows * (uint64_t)width;
    uint64_t sample_at = (uint64_t)align8((Py_ssize_t)(4 * tokens));
    uint64_t lengths_at = sample_at + 8 * (uint64_t)rows, mask_at = lengths_at + 4 * (uint64_t)rows;
    uint8_t batch[MAX_HEAD], *b = batch;
    b = put_field(b, 1, epoch);
    b = put_field(b, 2, step);
    b = put_field(b, 3, rank);
    b = put_field(b, 4, bucket);
    b = put_field(b, 5, (uint64_t)rows);
    b = put_field(b, 6, (uint64_t)width);
    b = put_field(b, 7, (uint64_t)real);
    b = put_field(b, 8, tokens);
    if (fp_len) b = put_bytes(b, 9, (const uint8_t *)fp, (size_t)fp_len);
    b = put_field(b, 10, mask_at + tokens);
    b = put_buffer(b, 11, DTYPE_INT32, 0, 4 * tokens);
    b = put_buffer(b, 12, DTYPE_INT8, mask_at, tokens);
    b = put_buffer(b, 13, DTYPE_INT32, lengths_at, 4 * (uint64_t)rows);
    b = put_buffer(b, 14, DTYPE_INT64, sample_at, 8 * (uint64_t)rows);
    uint8_t *p = head + 4;
    p = put_field(p, 1, WIRE_VERSION);
    p = put_bytes(p, 2, batch, (size_t)(b - batch));
    uint32_t header_len = (uint32_t)(p - head - 4);
    head[0] = (uint8_t)header_len; /* the prefix: little-endian uint32 */
    head[1] = (uint8_t)(header_len >> 8);
    head[2] = (uint8_t)(header_len >> 16);
    head[3] = (uint8_t)(header_len >> 24);
    Py_ssize_t used = p - head, total = align8(used);
    memset(p, 0, (size_t)(total - used));
    *gap_len = (Py_ssize_t)(sample_at - 4 * tokens);
    return total;
}

/* `obj` (a Python int, not a bool) as an integer in [low, high]; -1 with an exception if not. Other
   integer types (numpy's) are the checked path's to convert. */
static int as_int(PyObject *obj, long long low, unsigned long long high, long long *out) {
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "not a Python int");
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow > 0 && high > (unsigned long long)LLONG_MAX) { /* above 2**63 - 1: a uint64 field */
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *out = (long long)u; /* the caller reads it back as uint64 */
        return 0;
    }
    if (overflow || (v == -1 && PyErr_Occurred()) || v < low || (v >= 0 && (unsigned long long)v > high)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "field out of range");
        return -1;
    }
    *out = v;
    return 0;
}

/* A 1-D C-contiguous int64 array of at least one row, or -1 with TypeError / ValueError. */
static int take_rows(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* a list, a strided view (BufferError): the checked path converts them */
        PyErr_SetString(PyExc_TypeError, "rows must be a 1-D int64 array");
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->ndim != 1 || view->itemsize != 8 || !((f[0] == 'l' || f[0] == 'q') && f[1] == 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "rows must be a 1-D int64 array");
        return -1;
    }
    if (view->len < 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a batch needs at least one row");
        return -1;
    }
    return 0;
}

/*
 * build(epoch, step, rank, bucket, fingerprint, rows, width, limit, pad, num_rows, ids_first, ids_shift,
 *       mask_first, mask_shift, ids_offsets, ids_chunks, mask_chunks[, ids_kind, mask_kind])
 *       -> (frame, real_tokens, rows)
 *
 * `plan`, codec.batch_frame_head and `frame` in one call: the whole batch frame of `rows` (a 1-D
 * int64 array) with no Python in between; the tables are `plan`'s. Rows are cut to `limit` (>= 1; one above `width` is
 * `width`) and padded to `width`. Raises TypeError, ValueError or OverflowError for
 * anything the checked path would refuse (Assembler.frame then takes that path, which names what
 * is wrong); the bytes are the checked path's (tested). The kinds name the chunks' integer type
 * ("i4" ids and "i1" masks by default, copied as they are; any other is converted, and a value
 * outside the wire's int32 or int8 raises OverflowError). A mask kind "l<size>" reads a labels
 * column (mask 1 where the label is not -100), "a<size>" writes ones (pass the ids' chunks).
 */
static PyObject *build(PyObject *self, PyObject *args) {
    PyObject *epoch_o, *step_o, *rank_o, *bucket_o, *fp_o, *rows_o, *width_o, *limit_o, *pad_o, *ids_list,
        *mask_list;
    Tables t = {0};
    const char *ids_text = "i4", *mask_text = "i1";
    Kind ids_kind, mask_kind;
    if (!PyArg_ParseTuple(args, "OOOOUOOOOny*y*y*y*OOO|ss", &epoch_o, &step_o, &rank_o, &bucket_o, &fp_o,
                          &rows_o, &width_o, &limit_o, &pad_o, &t.num_rows, &t.ids_first, &t.ids_shift,
                          &t.mask_first, &t.mask_shift, &t.ids_list, &ids_list, &mask_list, &ids_text, &mask_text))
        return NULL;
    if (parse_kind(ids_text, &ids_kind, 0) < 0 || parse_kind(mask_text, &mask_kind, 1) < 0) {
        release_tables(&t);
        return NULL;
    }
    Py_buffer rows = {0};
    Py_buffer *ids_src = NULL, *mask_src = NULL;
    Py_ssize_t n_ids = 0, n_mask = 0;
    char *plan_buf = NULL;
    PyObject *out = NULL, *result = NULL;
    long long epoch, step, rank, bucket, width_ll, limit_ll, pad_ll;
    if (as_int(epoch_o, 0, ~0ULL, &epoch) < 0 || as_int(step_o, 0, ~0ULL, &step) < 0 ||
        as_int(rank_o, 0, U32_MAX, &rank) < 0 || as_int(bucket_o, 0, U32_MAX, &bucket) < 0 ||
        as_int(width_o, 1, U32_MAX, &width_ll) < 0 || as_int(limit_o, 1, ~0ULL, &limit_ll) < 0 ||
        as_int(pad_o, INT32_MIN, INT32_MAX, &pad_ll) < 0)
        goto done;
    Py_ssize_t width = (Py_ssize_t)width_ll;
    if (limit_ll < 0 || limit_ll > width_ll) limit_ll = width_ll; /* none of a row is cut past the width */
    int pad = (int)pad_ll;
    Py_ssize_t fp_len;
    const char *fp = PyUnicode_AsUTF8AndSize(fp_o, &fp_len);
    if (!fp) goto done;
    if (fp_len > MAX_FINGERPRINT) {
        PyErr_SetString(PyExc_ValueError, "schedule_fingerprint too long");
        goto done;
    }
    if (take_rows(rows_o, &rows) < 0) goto done;
    Py_ssize_t n = rows.len / 8;
    if ((unsigned long long)n > U32_MAX || width > PY_SSIZE_T_MAX / 5 / n) {
        PyErr_SetString(PyExc_ValueError, "build: the rows, width and tables do not agree");
        goto done;
    }
    if (take_tables(&t, "build") < 0) goto done;
    plan_buf = PyMem_Malloc((size_t)(n * PLAN_ROW));
    if (!plan_buf) {
        PyErr_NoMemory();
        goto done;
    }
    long long real = plan_with(&t, rows.buf, n, (Py_ssize_t)limit_ll, plan_buf);
    if (real < 0) goto done;
    if (take_all(ids_list, &ids_src, &n_ids, "ids_chunks") < 0) goto done;
    if (take_all(mask_list, &mask_src, &n_mask, "mask_chunks") < 0) goto done;
    const int64_t *cut = (const int64_t *)plan_buf, *ic = cut + n, *mc = ic + n, *ia = mc + n, *ma = ia + n;
    const char *lens = (const char *)(ma + n);
    if (check_slices(ids_src, n_ids, mask_src, n_mask, ic, mc, ia, ma, cut, n, width, ids_kind, mask_kind) < 0)
        goto done;
    uint8_t head[MAX_HEAD];
    static const char zeros[ALIGN] = {0};
    Py_ssize_t gap_len, head_len = encode_head(head, &gap_len, (uint64_t)epoch, (uint64_t)step, (uint64_t)rank, (uint64_t)bucket, fp, fp_len, n, width, real);
    out = copy_frame((const char *)head, head_len, zeros, gap_len, rows.buf, lens, ids_src, mask_src, ic, mc, ia,
                     ma, cut, n, width, pad, ids_kind, mask_kind);
    if (out) result = Py_BuildValue("(OLn)", out, real, n);
done:
    Py_XDECREF(out);
    PyMem_Free(plan_buf);
    release_chunks(ids_src, n_ids, mask_src, n_mask);
    if (rows.obj) PyBuffer_Release(&rows);
    release_tables(&t);
    return result;
}

static PyMethodDef methods[] = {
    {"frame", frame, METH_VARARGS,
     "frame(head, gap, samples, lengths, ids_chunks, mask_chunks, ids_chunk, mask_chunk, ids_at, mask_at, "
     "cut, width, pad) -> bytes: a batch frame joined from the dataset's buffers"},
    {"plan", plan, METH_VARARGS,
     "plan(rows, limit, num_rows, ids_first, ids_shift, mask_first, mask_shift, ids_offsets) -> (bytes, "
     "real_tokens): "
     "each row's cut length, chunks and starts (five int64 arrays) and the int32 lengths, end to end"},
    {"build", build, METH_VARARGS,
     "build(epoch, step, rank, bucket, fingerprint, rows, width, limit, pad, num_rows, ids_first, ids_shift, "
     "mask_first, mask_shift, ids_offsets, ids_chunks, mask_chunks) -> (frame, real_tokens, rows): plan, header and "
     "frame in one call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frame", NULL, -1, methods};

PyMODINIT_FUNC PyInit__frame(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    MappedReadError = PyErr_NewExceptionWithDoc(
        "ladle.service._frame.MappedReadError",
        "A read of the memory-mapped dataset faulted (SIGBUS): a data file was cut shorter while served.",
        PyExc_OSError, NULL);
    if (!MappedReadError || PyModule_AddObjectRef(m, "MappedReadError", MappedReadError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
