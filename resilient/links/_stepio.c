/* One step of a mesh call's messages, moved without the GIL (resilient.links.native_steps).
 *
 * exchange(fds, sends, recvs, timeout_ms, wake_fd) writes and reads framed messages on
 * nonblocking, connected sockets: each message is the SocketPair frame (a 24-byte
 * header: tag, payload bytes, digest, little-endian; then the payload). Sends and
 * receives are (fd index, tag, digest, address, bytes); each socket's come in the
 * order they go on its stream, which a mesh or ring step knows in advance. A
 * receive may add (fold address, kind): once whole, it is added into that address
 * at once (a sum of float32, float64, int32 or int64), while the rest still moves.
 *
 * A header-only hello of another tag (digest -1: a call that fell back to a full
 * exchange, resilient.collectives.digest_check) is read and skipped.
 *
 * Nothing here decides what a failure means. The first thing that is not the
 * expected frame (another tag, size or digest), a socket error, the end of a
 * stream, the deadline, or a byte on wake_fd (another thread needs the pairs; it
 * is left there, for every step watching it) stops the step, and the caller gets the exact place every
 * stream stopped at, to hand it back to the Python socket pair, which knows what
 * to do (resilient.links.native_steps.hand_back).
 *
 * Returns (code, news, states): code 0 done, 1 deadline, 2 another frame,
 * 3 socket error or end of stream; news: a received header carried the NEWS flag;
 * states (None when done): per fd (send index, bytes of it written, receive index,
 * bytes of it read, header bytes read so far). An index is -1 when nothing is left
 * on that side; bytes count the header's 24 too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HDR 24
#define MAX_FDS 64
#define MAX_MSGS 4096
#define NEWS_FLAG (1LL << 62)
#define HELLO (-1LL) /* the digest of a header-only hello (collectives.digest_check.FALLBACK) */
#define SLOT_SHIFT 53 /* a tag's slot: groups sharing a connection (links.ledger.GROUP_SHIFT) */

enum { DONE = 0, LATE = 1, OTHER = 2, BROKEN = 3 };

typedef struct {
    int fd;
    int64_t tag, digest;
    char *addr;
    int64_t len;
    char *fold;  /* a receive's: fold it into here once whole (kind below), or NULL */
    int kind;
    int after_recv, after_send;  /* may start once that receive / send is whole (-1: now) */
} msg_t;

/* Which messages are whole, for the messages that wait for them. */
typedef struct {
    unsigned char *sent, *got;
} done_t;

static int ready(const msg_t *x, const done_t *d) {
    return (x->after_recv < 0 || d->got[x->after_recv]) &&
           (x->after_send < 0 || d->sent[x->after_send]);
}

enum { ADD_F32 = 1, ADD_F64 = 2, ADD_I32 = 3, ADD_I64 = 4 };

/* dst += src elementwise, as torch's add_ does it bit for bit: IEEE adds (no
 * reassociation; the compiler's vector adds give the same bits), integers wrap. */
#define ADD_AS(T)                                                                  \
    do {                                                                           \
        T *d = (T *)dst;                                                           \
        const T *x = (const T *)src;                                               \
        for (int64_t i = 0, n = len / (int64_t)sizeof(T); i < n; i++) d[i] += x[i]; \
    } while (0)

static void fold_into(char *dst, const char *src, int64_t len, int kind) {
    switch (kind) {
        case ADD_F32: ADD_AS(float); break;
        case ADD_F64: ADD_AS(double); break;
        case ADD_I32: ADD_AS(uint32_t); break;
        case ADD_I64: ADD_AS(uint64_t); break;
    }
}

typedef struct {
    int si, ri;            /* current send / receive message, -1: none left */
    int64_t soff, roff;    /* bytes of it done, header included */
    unsigned char shdr[HDR], rhdr[HDR];
} stream_t;

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void put64(unsigned char *p, int64_t v) { memcpy(p, &v, 8); }
static int64_t get64(const unsigned char *p) { int64_t v; memcpy(&v, p, 8); return v; }

static int next_of(const msg_t *m, int n, int fd, int from) {
    for (int i = from; i < n; i++)
        if (m[i].fd == fd) return i;
    return -1;
}

static void start_send(stream_t *s, const msg_t *m, int i) {
    s->si = i;
    s->soff = 0;
    if (i >= 0) {
        put64(s->shdr, m[i].tag);
        put64(s->shdr + 8, m[i].len);
        put64(s->shdr + 16, m[i].digest);
    }
}

/* Write what the socket takes; returns BROKEN, or DONE (nothing more now). */
static int write_some(int fd, stream_t *s, const msg_t *m, int n, int f, int *left, done_t *d) {
    while (s->si >= 0) {
        const msg_t *x = &m[s->si];
        if (s->soff == 0 && !ready(x, d)) return DONE;
        struct iovec iov[2];
        int k = 0;
        if (s->soff < HDR) {
            iov[k].iov_base = s->shdr + s->soff;
            iov[k++].iov_len = (size_t)(HDR - s->soff);
            iov[k].iov_base = x->addr;
            iov[k++].iov_len = (size_t)x->len;
        } else {
            iov[k].iov_base = x->addr + (s->soff - HDR);
            iov[k++].iov_len = (size_t)(x->len - (s->soff - HDR));
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)k;
        ssize_t w = sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? DONE : BROKEN;
        }
        s->soff += w;
        if (s->soff < HDR + x->len) return DONE;  /* the socket is full */
        d->sent[s->si] = 1;
        (*left)--;
        start_send(s, m, next_of(m, n, f, s->si + 1));
    }
    return DONE;
}

/* Read what the socket holds into the expected frames; DONE, OTHER or BROKEN. */
static int read_some(int fd, stream_t *s, const msg_t *m, int n, int f, int *left,
                     int *news, done_t *d) {
    while (s->ri >= 0) {
        const msg_t *x = &m[s->ri];
        if (s->roff == 0 && !ready(x, d)) return DONE;
        ssize_t g;
        if (s->roff < HDR)
            g = recv(fd, s->rhdr + s->roff, (size_t)(HDR - s->roff), MSG_DONTWAIT);
        else
            g = recv(fd, x->addr + (s->roff - HDR), (size_t)(x->len - (s->roff - HDR)),
                     MSG_DONTWAIT);
        if (g < 0) {
            if (errno == EINTR) continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? DONE : BROKEN;
        }
        if (g == 0) return BROKEN;
        int had_header = s->roff >= HDR;
        s->roff += g;
        if (!had_header && s->roff == HDR) {
            int64_t digest = get64(s->rhdr + 16);
            if (digest == HELLO && get64(s->rhdr + 8) == 0 && get64(s->rhdr) != x->tag &&
                (get64(s->rhdr) >> SLOT_SHIFT) == (x->tag >> SLOT_SHIFT)) {
                /* A hello of a call that fell back already (its tags are forgotten,
                 * and the Python reader would drop it): skip it. One under the
                 * expected tag stops the step below, for the gate to see; so does
                 * one of another group sharing the connection (another tag slot,
                 * resilient.links.ledger): its reader is the Python path. */
                s->roff = 0;
                continue;
            }
            if (get64(s->rhdr) != x->tag || get64(s->rhdr + 8) != x->len ||
                (x->digest && (digest & ~NEWS_FLAG) != x->digest))
                return OTHER;
            if (digest & NEWS_FLAG) *news = 1;
        }
        if (s->roff == HDR + x->len) {  /* else read on until the socket is empty */
            if (x->fold != NULL) fold_into(x->fold, x->addr, x->len, x->kind);
            d->got[s->ri] = 1;
            (*left)--;
            s->ri = next_of(m, n, f, s->ri + 1);
            s->roff = 0;
        }
    }
    return DONE;
}

static int run(const int *fds, int nfd, int wake, const msg_t *sends, int ns,
               const msg_t *recvs, int nr, int64_t timeout_ms, stream_t *st, int *news,
               done_t *d) {
    int left = ns + nr;
    int64_t deadline = now_ms() + timeout_ms;
    struct pollfd pf[MAX_FDS + 1];
    for (int f = 0; f < nfd; f++) {
        start_send(&st[f], sends, next_of(sends, ns, f, 0));
        st[f].ri = next_of(recvs, nr, f, 0);
        st[f].roff = 0;
    }
    int first = 1;
    while (left > 0) {
        int any = 0;
        for (int f = 0; f < nfd; f++) {
            int out = st[f].si >= 0 && (st[f].soff > 0 || ready(&sends[st[f].si], d));
            int in = st[f].ri >= 0 && (st[f].roff > 0 || ready(&recvs[st[f].ri], d));
            short ev = (short)((out ? POLLOUT : 0) | (in ? POLLIN : 0));
            any |= ev != 0;
            pf[f].fd = ev ? fds[f] : -1;
            pf[f].events = ev;
            pf[f].revents = first ? ev : 0;  /* the first round tries every socket */
        }
        if (!any) return LATE;  /* only messages that wait for nothing left to come */
        pf[nfd].fd = wake;
        pf[nfd].events = POLLIN;
        pf[nfd].revents = 0;
        if (!first) {
            int64_t rem = deadline - now_ms();
            if (rem <= 0) return LATE;
            int rc = poll(pf, (nfds_t)(nfd + 1), (int)rem);
            if (rc < 0 && errno != EINTR) return BROKEN;
            if (rc <= 0) continue;
            /* Another thread needs the pairs (to fail one). The byte is left for the
             * caller to drain: other steps (other rails) may be watching it too. */
            if (pf[nfd].revents) return LATE;
        }
        first = 0;
        for (int f = 0; f < nfd; f++) {
            short re = pf[f].revents;
            if (re & POLLNVAL) return BROKEN;
            if ((re & (POLLOUT | POLLERR | POLLHUP)) && st[f].si >= 0) {
                if (write_some(fds[f], &st[f], sends, ns, f, &left, d) != DONE) return BROKEN;
            }
            if ((re & (POLLIN | POLLERR | POLLHUP)) && st[f].ri >= 0) {
                int rc = read_some(fds[f], &st[f], recvs, nr, f, &left, news, d);
                if (rc != DONE) return rc;
            }
        }
    }
    return DONE;
}

static int parse(PyObject *seq, msg_t *out, int cap, int nfd, const char *what, int folds) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > cap) {
        PyErr_Format(PyExc_ValueError, "exchange: more than %d %s", cap, what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int f, kind = 0, after_recv = -1, after_send = -1;
        long long tag, digest, len;
        unsigned long long addr, fold = 0;
        if (folds ? !PyArg_ParseTuple(item, "iLLKL|Kiii", &f, &tag, &digest, &addr, &len, &fold,
                                      &kind, &after_recv, &after_send)
                  : !PyArg_ParseTuple(item, "iLLKL|ii", &f, &tag, &digest, &addr, &len,
                                      &after_recv, &after_send))
            return -1;
        if (kind < 0 || kind > ADD_I64 || (kind && fold == 0)) {
            PyErr_Format(PyExc_ValueError, "exchange: %s %zd has fold kind %d", what, i, kind);
            return -1;
        }
        if (f < 0 || f >= nfd || len < 0) {
            PyErr_Format(PyExc_ValueError, "exchange: %s %zd names fd index %d of %d",
                         what, i, f, nfd);
            return -1;
        }
        out[i].fd = f;
        out[i].tag = tag;
        out[i].digest = digest;
        out[i].addr = (char *)(uintptr_t)addr;
        out[i].len = len;
        out[i].fold = kind ? (char *)(uintptr_t)fold : NULL;
        out[i].kind = kind;
        out[i].after_recv = after_recv;
        out[i].after_send = after_send;
    }
    return (int)n;
}

/* Every message waits only for messages there are (indexes in range). */
static int deps_ok(const msg_t *sends, int ns, const msg_t *recvs, int nr) {
    for (int pass = 0; pass < 2; pass++) {
        const msg_t *m = pass ? recvs : sends;
        for (int i = 0, n = pass ? nr : ns; i < n; i++)
            if (m[i].after_recv >= nr || m[i].after_send >= ns) return 0;
    }
    return 1;
}

/* Per fd: (send index, bytes of it written, receive index, bytes of it read, header). */
static PyObject *states_of(const stream_t *st, Py_ssize_t nfd) {
    PyObject *states = PyTuple_New(nfd);
    if (states == NULL) return NULL;
    for (Py_ssize_t f = 0; f < nfd; f++) {
        int hdr = st[f].ri >= 0 ? (int)(st[f].roff < HDR ? st[f].roff : HDR) : 0;
        PyObject *one = Py_BuildValue("iLiLy#", st[f].si, (long long)st[f].soff, st[f].ri,
                                      (long long)st[f].roff, (const char *)st[f].rhdr,
                                      (Py_ssize_t)hdr);
        if (one == NULL) {
            Py_DECREF(states);
            return NULL;
        }
        PyTuple_SET_ITEM(states, f, one);
    }
    return states;
}

static PyObject *exchange(PyObject *self, PyObject *args) {
    PyObject *fds_in, *sends_in, *recvs_in;
    long long timeout_ms;
    int wake;
    if (!PyArg_ParseTuple(args, "OOOLi", &fds_in, &sends_in, &recvs_in, &timeout_ms, &wake))
        return NULL;
    int fds[MAX_FDS];
    stream_t st[MAX_FDS];
    PyObject *fseq = PySequence_Fast(fds_in, "exchange: fds must be a sequence");
    if (fseq == NULL) return NULL;
    Py_ssize_t nfd = PySequence_Fast_GET_SIZE(fseq);
    if (nfd > MAX_FDS) {
        Py_DECREF(fseq);
        return PyErr_Format(PyExc_ValueError, "exchange: more than %d sockets", MAX_FDS);
    }
    for (Py_ssize_t f = 0; f < nfd; f++)
        fds[f] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fseq, f));
    Py_DECREF(fseq);
    if (PyErr_Occurred()) return NULL;
    PyObject *sseq = PySequence_Fast(sends_in, "exchange: sends must be a sequence");
    PyObject *rseq = PySequence_Fast(recvs_in, "exchange: recvs must be a sequence");
    msg_t *sends = NULL, *recvs = NULL;
    int ns = -1, nr = -1, code = DONE, news = 0;
    if (sseq != NULL && rseq != NULL) {
        /* Each call has its own tables: several groups' threads may run steps at once. */
        Py_ssize_t cs = PySequence_Fast_GET_SIZE(sseq), cr = PySequence_Fast_GET_SIZE(rseq);
        sends = PyMem_Malloc(sizeof(msg_t) * (size_t)(cs ? cs : 1));
        recvs = PyMem_Malloc(sizeof(msg_t) * (size_t)(cr ? cr : 1));
        if (sends == NULL || recvs == NULL) PyErr_NoMemory();
        else {
            ns = parse(sseq, sends, MAX_MSGS, (int)nfd, "sends", 0);
            nr = ns < 0 ? -1 : parse(rseq, recvs, MAX_MSGS, (int)nfd, "receives", 1);
        }
    }
    Py_XDECREF(sseq);
    Py_XDECREF(rseq);
    done_t d = {NULL, NULL};
    if (nr >= 0) {
        d.sent = PyMem_Calloc((size_t)(ns ? ns : 1), 1);
        d.got = PyMem_Calloc((size_t)(nr ? nr : 1), 1);
        if (d.sent == NULL || d.got == NULL) {
            PyErr_NoMemory();
            nr = -1;
        } else if (!deps_ok(sends, ns, recvs, nr)) {
            PyErr_SetString(PyExc_ValueError, "exchange: a message waits for one out of range");
            nr = -1;
        }
    }
    if (nr >= 0) {
        Py_BEGIN_ALLOW_THREADS
        code = run(fds, (int)nfd, wake, sends, ns, recvs, nr, timeout_ms, st, &news, &d);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(d.sent);
    PyMem_Free(d.got);
    PyMem_Free(sends);
    PyMem_Free(recvs);
    if (nr < 0) return NULL;
    if (code == DONE) return Py_BuildValue("iiO", code, news, Py_None);
    PyObject *states = states_of(st, nfd);
    return states == NULL ? NULL : Py_BuildValue("iiN", code, news, states);
}

static PyMethodDef methods[] = {
    {"exchange", exchange, METH_VARARGS,
     "exchange(fds, sends, recvs, timeout_ms, wake_fd) -> (code, news, states): see the "
     "source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "resilient.links._stepio",
    "Mesh steps moved without the GIL (see resilient.links.native_steps).", -1, methods,
};

PyMODINIT_FUNC PyInit__stepio(void) { return PyModule_Create(&module); }
