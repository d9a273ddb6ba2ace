/*
 * The mixed-mode grid interleaver of interleave.py, compiled.
 *
 * Same algorithm, same integer arithmetic, same tie-breaking as the pure
 * Python `_grid_python` (a test checks they agree), so the schedule does not
 * depend on whether this extension was built. Python falls back to the pure
 * version when it is missing or when the numbers could overflow int64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static PyObject *grid(PyObject *self, PyObject *args) {
    PyObject *counts_obj;
    long long world;
    if (!PyArg_ParseTuple(args, "OL", &counts_obj, &world)) return NULL;
    PyObject *seq = PySequence_Fast(counts_obj, "counts must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    if (world < 1 || nb < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "world_size and bucket count must be positive");
        return NULL;
    }
    int64_t *c = calloc((size_t)nb, sizeof(int64_t));
    int64_t *remaining = calloc((size_t)nb, sizeof(int64_t));
    int64_t *cap = calloc((size_t)nb, sizeof(int64_t));
    int64_t *job = calloc((size_t)nb, sizeof(int64_t));
    int64_t *rank_count = calloc((size_t)(nb * world), sizeof(int64_t));
    int64_t *last = malloc((size_t)world * sizeof(int64_t));
    int64_t *run = calloc((size_t)world, sizeof(int64_t));
    Py_ssize_t *live = malloc((size_t)nb * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (!c || !remaining || !cap || !job || !rank_count || !last || !run || !live) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t total = 0;
    Py_ssize_t nlive = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, b));
        if (v == -1 && PyErr_Occurred()) goto done;
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "counts must be non-negative");
            goto done;
        }
        c[b] = v;
        remaining[b] = v;
        total += v;
        if (v > 0) live[nlive++] = b;
    }
    if (total % world) {
        PyErr_SetString(PyExc_ValueError, "total batches must be a multiple of world_size");
        goto done;
    }
    int64_t steps = total / world;
    for (Py_ssize_t b = 0; b < nb; b++) {
        int64_t per_rank = (c[b] + world - 1) / world;
        int64_t gaps = steps - per_rank + 1;
        if (gaps < 1) gaps = 1;
        int64_t bound = (per_rank + gaps - 1) / gaps;
        cap[b] = bound < 1 ? 1 : bound;
    }
    for (int64_t r = 0; r < world; r++) last[r] = -1;
    int64_t veto = 4 * total * total + 1;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total * (int64_t)sizeof(int64_t)));
    if (!out) goto done;
    int64_t *cells = (int64_t *)PyBytes_AS_STRING(out);
    for (int64_t t = 0; t < steps; t++) {
        int64_t base = t * world;
        for (int64_t i = 0; i < world; i++) {
            int64_t r = (i + t) % world;
            int64_t *counts_r = rank_count + r * nb;
            int64_t last_r = last[r];
            int64_t done_ = base + i + 1;
            Py_ssize_t best = -1;
            int64_t best_score = 0;
            for (Py_ssize_t k = 0; k < nlive; k++) {
                Py_ssize_t b = live[k];
                if (remaining[b] == 0) continue;
                int64_t score = (2 * (t + 1) + done_) * c[b] - (2 * counts_r[b] + job[b]) * total;
                if (b == last_r && run[r] >= cap[b]) score -= veto;
                if (best < 0 || score > best_score) {
                    best_score = score;
                    best = b;
                }
            }
            remaining[best] -= 1;
            counts_r[best] += 1;
            job[best] += 1;
            if (best == last_r) {
                run[r] += 1;
            } else {
                last[r] = best;
                run[r] = 1;
            }
            cells[base + r] = best;
        }
    }
done:
    if (PyErr_Occurred()) Py_CLEAR(out);
    free(c); free(remaining); free(cap); free(job); free(rank_count); free(last); free(run); free(live);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"grid", grid, METH_VARARGS, "grid(counts, world_size) -> bytes of int64 buckets, step-major"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_grid", NULL, -1, methods};

PyMODINIT_FUNC PyInit__grid(void) { return PyModule_Create(&module); }
