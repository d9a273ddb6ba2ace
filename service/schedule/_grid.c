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

/* The most batches of one bucket that fit in `length` cells with runs of at most `cap`,
 * when the stream already ends in a run of `run` of them. Python's `_room`. */
static inline int64_t room(int64_t length, int64_t cap, int64_t run) {
    int64_t free_ = cap - run;
    if (length <= free_) return length;
    return length - (length - free_ + cap) / (cap + 1);
}

static inline int64_t bound_of(int64_t n, int64_t length) {
    if (n <= 0) return 0;
    int64_t gaps = length - n + 1;
    return (n + gaps - 1) / gaps;
}

static inline int64_t abs64(int64_t x) { return x < 0 ? -x : x; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

#define NCOST 4
typedef struct { int64_t v[NCOST]; } cost4;

static inline int less4(const cost4 *a, const cost4 *b) {
    for (int i = 0; i < NCOST; i++) {
        if (a->v[i] != b->v[i]) return a->v[i] < b->v[i];
    }
    return 0;
}

/* Per rank and bucket, over a stream but its last cell (see redeal_last_step). */
typedef struct {
    int64_t pre, cnt, longest, hi0, hi1, lo0, lo1;
} tally;

/* Python's `_redeal_last_step`: returns 0, or -1 with MemoryError set. */
static int redeal_last_step(int64_t *cells, int64_t steps, int64_t world, Py_ssize_t nb,
                            const Py_ssize_t *live, Py_ssize_t nlive, const int64_t *cap, int64_t *rank_count,
                            const int64_t *prev_last, const int64_t *prev_run) {
    int64_t *row = cells + (steps - 1) * world;
    int over = 0;
    for (int64_t r = 0; r < world && !over; r++) {
        int64_t z = row[r];
        int64_t end_run = z == prev_last[r] ? prev_run[r] + 1 : 1;
        if (end_run > bound_of(rank_count[r * nb + z], steps)) over = 1;
    }
    if (!over) return 0;

    int rc = -1;
    int64_t *greedy = malloc((size_t)world * sizeof(int64_t));
    Py_ssize_t *types = malloc((size_t)nb * sizeof(Py_ssize_t));
    Py_ssize_t *index = malloc((size_t)nb * sizeof(Py_ssize_t));
    tally *tab = malloc((size_t)(world * nb) * sizeof(tally));
    int64_t *dev0 = malloc((size_t)nb * sizeof(int64_t));
    int64_t *dev1 = malloc((size_t)nb * sizeof(int64_t));
    int64_t *exc0 = malloc((size_t)nb * sizeof(int64_t));
    int64_t *cur = malloc((size_t)world * sizeof(int64_t));
    int64_t *cur_b = malloc((size_t)world * sizeof(int64_t));
    int64_t *held = malloc((size_t)world * sizeof(int64_t));
    int64_t *beyond = NULL, *excess = NULL, *dev = NULL, *mover = NULL, *pred = NULL, *cycle = NULL;
    int64_t *move_rank = NULL, *move_to = NULL;
    cost4 *weight = NULL, *dist = NULL;
    unsigned char *has = NULL;
    if (!greedy || !types || !index || !tab || !dev0 || !dev1 || !exc0 || !held || !cur || !cur_b)
        goto fail;
    for (int64_t r = 0; r < world; r++) greedy[r] = row[r];
    Py_ssize_t nt = 0;
    for (Py_ssize_t b = 0; b < nb; b++) index[b] = -1;
    for (Py_ssize_t k = 0; k < nlive; k++) {
        Py_ssize_t b = live[k];
        for (int64_t r = 0; r < world; r++) {
            if (greedy[r] == b) {
                index[b] = nt;
                types[nt++] = b;
                break;
            }
        }
    }
    beyond = malloc((size_t)(world * nt) * sizeof(int64_t));
    excess = malloc((size_t)(world * nt) * sizeof(int64_t));
    dev = malloc((size_t)(world * nt) * sizeof(int64_t));
    weight = malloc((size_t)(nt * nt) * sizeof(cost4));
    has = malloc((size_t)(nt * nt));
    mover = malloc((size_t)(nt * nt) * sizeof(int64_t));
    dist = malloc((size_t)nt * sizeof(cost4));
    pred = malloc((size_t)nt * sizeof(int64_t));
    cycle = malloc((size_t)(nt + 1) * sizeof(int64_t));
    move_rank = malloc((size_t)(nt + 1) * sizeof(int64_t));
    move_to = malloc((size_t)(nt + 1) * sizeof(int64_t));
    if (!beyond || !excess || !dev || !weight || !has || !mover || !dist || !pred || !cycle || !move_rank || !move_to) goto fail;

    /* One row-major pass over every stream but its last cell (cache friendly) gives, for
     * each rank and bucket, the longest run and the extremes of f(k) = steps * count(k) -
     * k * n for a final count n of pre and of pre + 1: highs just after an item, lows just
     * before one and at the end, so the share deviation times `steps`, max over k of |f(k)|,
     * is max(high, -low). Python's `_stream_tables` computes the same with numpy. */
    int64_t m = steps - 1;
    for (int64_t r = 0; r < world; r++) {
        for (Py_ssize_t b = 0; b < nb; b++) {
            tally *tb = &tab[r * nb + b];
            tb->pre = rank_count[r * nb + b] - (b == greedy[r] ? 1 : 0);
            tb->cnt = tb->longest = 0;
            tb->hi0 = tb->hi1 = tb->lo0 = tb->lo1 = 0;
        }
        cur[r] = 0;
        cur_b[r] = -1;
    }
    for (int64_t k = 0; k < m; k++) {
        const int64_t *cells_k = cells + k * world;
        for (int64_t r = 0; r < world; r++) {
            int64_t b = cells_k[r];
            tally *tb = &tab[r * nb + b];
            cur[r] = b == cur_b[r] ? cur[r] + 1 : 1;
            cur_b[r] = b;
            if (cur[r] > tb->longest) tb->longest = cur[r];
            int64_t si = steps * ++tb->cnt;
            int64_t kn = (k + 1) * tb->pre;
            int64_t v = si - kn;
            if (v > tb->hi0) tb->hi0 = v;
            v -= k + 1;
            if (v > tb->hi1) tb->hi1 = v;
            if (k >= 1) {
                v = si - steps - k * tb->pre;
                if (v < tb->lo0) tb->lo0 = v;
                v -= k;
                if (v < tb->lo1) tb->lo1 = v;
            }
        }
    }
    for (int64_t r = 0; r < world; r++) {
        for (Py_ssize_t b = 0; b < nb; b++) {
            tally *tb = &tab[r * nb + b];
            int64_t end0 = 0, end1 = 0;
            if (m) {
                end0 = abs64(steps * tb->cnt - m * tb->pre);
                end1 = abs64(steps * tb->cnt - m * (tb->pre + 1));
            }
            dev0[b] = max64(max64(tb->hi0, -tb->lo0), end0);
            dev1[b] = max64(max64(tb->hi1, -tb->lo1), end1);
            exc0[b] = max64(0, tb->longest - bound_of(tb->pre, steps));
        }
        for (Py_ssize_t j = 0; j < nt; j++) {
            Py_ssize_t z = types[j];
            const tally *tz = &tab[r * nb + z];
            int64_t end_run = z == prev_last[r] ? prev_run[r] + 1 : 1;
            int64_t own = bound_of(tz->pre + 1, steps);
            beyond[r * nt + j] = max64(0, end_run - max64(cap[z], own));
            int64_t e = max64(0, max64(tz->longest, end_run) - own);
            int64_t d = dev1[z];
            for (Py_ssize_t k = 0; k < nlive; k++) {
                Py_ssize_t b = live[k];
                if (b != z) {
                    e = max64(e, exc0[b]);
                    d = max64(d, dev0[b]);
                }
            }
            excess[r * nt + j] = e;
            dev[r * nt + j] = d;
        }
    }
    int64_t theta = 0;
    for (int64_t r = 0; r < world; r++) {
        held[r] = index[greedy[r]];
        if (r == 0 || dev[r * nt + held[r]] > theta) theta = dev[r * nt + held[r]];
    }
#define COST(r, j, out)                                                      \
    do {                                                                     \
        (out).v[0] = beyond[(r) * nt + (j)];                                 \
        (out).v[1] = excess[(r) * nt + (j)];                                 \
        (out).v[2] = dev[(r) * nt + (j)] > theta ? 1 : 0;                    \
        (out).v[3] = types[(j)] == greedy[(r)] ? 0 : 1;                      \
    } while (0)
    for (;;) {
        memset(has, 0, (size_t)(nt * nt));
        for (int64_t r = 0; r < world; r++) {
            int64_t a = held[r];
            cost4 ca, cb, w;
            COST(r, a, ca);
            for (Py_ssize_t b = 0; b < nt; b++) {
                if (b == a) continue;
                COST(r, b, cb);
                for (int i = 0; i < NCOST; i++) w.v[i] = cb.v[i] - ca.v[i];
                Py_ssize_t ab = a * nt + b;
                if (!has[ab] || less4(&w, &weight[ab])) {
                    weight[ab] = w;
                    has[ab] = 1;
                    mover[ab] = r;
                }
            }
        }
        for (Py_ssize_t b = 0; b < nt; b++) {
            memset(&dist[b], 0, sizeof(cost4));
            pred[b] = -1;
        }
        int64_t hit = -1;
        for (Py_ssize_t it = 0; it < nt; it++) {
            hit = -1;
            for (Py_ssize_t a = 0; a < nt; a++) {
                for (Py_ssize_t b = 0; b < nt; b++) {
                    Py_ssize_t ab = a * nt + b;
                    if (!has[ab]) continue;
                    cost4 nd;
                    for (int i = 0; i < NCOST; i++) nd.v[i] = dist[a].v[i] + weight[ab].v[i];
                    if (less4(&nd, &dist[b])) {
                        dist[b] = nd;
                        pred[b] = a;
                        hit = b;
                    }
                }
            }
            if (hit < 0) break;
        }
        if (hit < 0) break;
        int64_t x = hit;
        for (Py_ssize_t it = 0; it < nt; it++) x = pred[x];
        /* the cycle, in the order of its edges cycle[i] -> cycle[i + 1] */
        Py_ssize_t n = 0;
        cycle[n++] = x;
        for (int64_t y = pred[x]; y != x; y = pred[y]) cycle[n++] = y;
        for (Py_ssize_t i = 0; i < n / 2; i++) {
            int64_t tmp = cycle[i];
            cycle[i] = cycle[n - 1 - i];
            cycle[n - 1 - i] = tmp;
        }
        cost4 gain = {{0, 0, 0, 0}};
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t ab = cycle[i] * nt + cycle[(i + 1) % n];
            for (int j = 0; j < NCOST; j++) gain.v[j] += weight[ab].v[j];
        }
        cost4 zero = {{0, 0, 0, 0}};
        if (!less4(&gain, &zero)) break;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t ab = cycle[i] * nt + cycle[(i + 1) % n];
            move_rank[i] = mover[ab];
            move_to[i] = cycle[(i + 1) % n];
        }
        for (Py_ssize_t i = 0; i < n; i++) held[move_rank[i]] = move_to[i];
    }
#undef COST
    for (int64_t r = 0; r < world; r++) {
        int64_t z = types[held[r]];
        if (z != greedy[r]) {
            rank_count[r * nb + greedy[r]] -= 1;
            rank_count[r * nb + z] += 1;
            row[r] = z;
        }
    }
    rc = 0;
fail:
    if (rc) PyErr_NoMemory();
    free(greedy); free(types); free(index); free(tab); free(dev0); free(dev1);
    free(exc0); free(held); free(cur); free(cur_b); free(beyond); free(excess); free(dev); free(weight); free(has);
    free(mover); free(dist); free(pred); free(cycle); free(move_rank); free(move_to);
    return rc;
}

static PyObject *grid(PyObject *self, PyObject *args) {
    PyObject *counts_obj;
    long long world;
    long long end_steps;
    if (!PyArg_ParseTuple(args, "OLL", &counts_obj, &world, &end_steps)) return NULL;
    PyObject *seq = PySequence_Fast(counts_obj, "counts must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    if (world < 1 || nb < 1 || end_steps < 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "world_size and bucket count must be positive");
        return NULL;
    }
    int64_t *c = calloc((size_t)nb, sizeof(int64_t));
    int64_t *remaining = calloc((size_t)nb, sizeof(int64_t));
    int64_t *cap = calloc((size_t)nb, sizeof(int64_t));
    int64_t *job = calloc((size_t)nb, sizeof(int64_t));
    int64_t *adj = calloc((size_t)nb, sizeof(int64_t));
    int64_t *spare = calloc((size_t)nb, sizeof(int64_t));
    int64_t *rank_count = calloc((size_t)(nb * world), sizeof(int64_t));
    int64_t *last = malloc((size_t)world * sizeof(int64_t));
    int64_t *run = calloc((size_t)world, sizeof(int64_t));
    int64_t *prev_last = malloc((size_t)world * sizeof(int64_t));
    int64_t *prev_run = calloc((size_t)world, sizeof(int64_t));
    Py_ssize_t *live = malloc((size_t)nb * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (!c || !remaining || !cap || !job || !adj || !spare || !rank_count || !last || !run || !prev_last ||
        !prev_run || !live) {
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
    for (int64_t r = 0; r < world; r++) last[r] = prev_last[r] = -1;
    int64_t veto = 4 * total * total + 1;
    int64_t first = steps - end_steps;
    if (first < 0) first = 0;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total * (int64_t)sizeof(int64_t)));
    if (!out) goto done;
    int64_t *cells = (int64_t *)PyBytes_AS_STRING(out);
    for (int64_t t = 0; t < steps; t++) {
        int64_t base = t * world;
        int64_t left = steps - t;
        int look = t >= first && left > 1;
        if (t == first && look) {
            for (int64_t q = 0; q < world; q++) {
                if (last[q] >= 0) {
                    int64_t k = cap[last[q]];
                    adj[last[q]] += room(left, k, run[q]) - room(left, k, 0);
                }
            }
        }
        if (left == 1) {
            memcpy(prev_last, last, (size_t)world * sizeof(int64_t));
            memcpy(prev_run, run, (size_t)world * sizeof(int64_t));
        }
        int64_t unchecked = 0;
        for (int64_t i = 0; i < world; i++) {
            int64_t r = (i + t) % world;
            int64_t *counts_r = rank_count + r * nb;
            int64_t last_r = last[r];
            int64_t done_ = base + i + 1;
            Py_ssize_t best = -1;
            if (look) {
                if (unchecked > 0) {
                    unchecked--;
                } else {
                    int64_t least = total; /* more than any spare room */
                    for (Py_ssize_t k = 0; k < nlive; k++) {
                        Py_ssize_t b = live[k];
                        int64_t kb = cap[b];
                        int64_t s = (world - i) * room(left, kb, 0) + i * room(left - 1, kb, 0) + adj[b] -
                                    remaining[b];
                        spare[b] = s;
                        if (s < least) least = s;
                    }
                    if (least > 0) {
                        unchecked = least - 1;
                    } else {
                        for (Py_ssize_t k = 0; k < nlive; k++) {
                            Py_ssize_t b = live[k];
                            if (spare[b] <= 0 && remaining[b] > 0) {
                                int64_t kb = cap[b];
                                if (room(left, kb, b == last_r ? run[r] : 0) > room(left - 1, kb, 0)) {
                                    best = b;
                                    break;
                                }
                            }
                        }
                    }
                }
            }
            if (best < 0) {
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
            }
            if (look && last_r >= 0) {
                int64_t k = cap[last_r];
                adj[last_r] -= room(left, k, run[r]) - room(left, k, 0);
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
            if (look) {
                int64_t k = cap[best];
                adj[best] += room(left - 1, k, run[r]) - room(left - 1, k, 0);
            }
            cells[base + r] = best;
        }
    }
    if (steps > 0 && end_steps > 0 &&
        redeal_last_step(cells, steps, world, nb, live, nlive, cap, rank_count, prev_last, prev_run) < 0)
        goto done;
done:
    if (PyErr_Occurred()) Py_CLEAR(out);
    free(c); free(remaining); free(cap); free(job); free(adj); free(spare); free(rank_count);
    free(last); free(run); free(prev_last); free(prev_run); free(live);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"grid", grid, METH_VARARGS,
     "grid(counts, world_size, end_steps) -> bytes of int64 buckets, step-major"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_grid", NULL, -1, methods};

PyMODINIT_FUNC PyInit__grid(void) { return PyModule_Create(&module); }
