/* Shared-memory SPSC ring with spin-then-park (eventcount) waiting.  See ring.h, docs/ipc.md.
 *
 * Counters: `head` (bytes ever published by the producer) and `tail` (bytes ever released by the
 * consumer) are monotonic u64; offset = counter & (cap - 1).  Each side keeps a private copy of its
 * own counter and a cache of the other's, and touches the shared line only when the cache says it
 * must.  Nothing read from the shared region is trusted: counters, record lengths and kinds are
 * validated against private state, and a failed check poisons the ring (RING_ECORRUPT).
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING_MAGIC 0x474e495245524853ULL /* "SHRERING" little-endian */
#define RING_VERSION 1u
#define RING_MAX_CAP (1ULL << 30) /* keeps every record length inside u32 */
#define RING_PURE_SPIN_NS 5000u   /* pause-only polling before sched_yield() joins in */

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() atomic_signal_fence(memory_order_seq_cst)
#endif

typedef union {
    sem_t s;
    uint8_t pad[64];
} line_sem_t;

/* Shared header: one 64-byte line per independently written field, so the producer's head
 * stores never invalidate the consumer's tail line and vice versa. */
typedef struct {
    /* line 0: written once by the creator, read-only afterwards */
    uint64_t magic;
    uint32_t version;
    uint32_t hdr_size;
    uint64_t cap;
    uint64_t region_size;
    uint8_t pad0[32];
    _Atomic uint64_t head; /* producer-owned */
    uint8_t pad1[56];
    _Atomic uint64_t tail; /* consumer-owned */
    uint8_t pad2[56];
    _Atomic uint32_t cons_waiting; /* set by consumer, cleared (exchanged) by producer */
    uint8_t pad3[60];
    _Atomic uint32_t prod_waiting; /* set by producer, cleared (exchanged) by consumer */
    uint8_t pad4[60];
    _Atomic uint32_t prod_closed;
    _Atomic uint32_t cons_closed;
    uint8_t pad5[56];
    line_sem_t data_sem;  /* consumer sleeps here */
    line_sem_t space_sem; /* producer sleeps here */
} ring_hdr_t;

_Static_assert(sizeof(ring_hdr_t) == RING_HDR_SIZE, "header layout");
_Static_assert(offsetof(ring_hdr_t, head) == 64, "head line");
_Static_assert(offsetof(ring_hdr_t, tail) == 128, "tail line");
_Static_assert(sizeof(sem_t) <= 64, "sem_t fits a line");

enum { ST_IDLE = 0, ST_SMALL = 1, ST_LARGE = 2 };

struct ring_s {
    ring_hdr_t *h;
    uint8_t *data;
    uint64_t cap, mask;
    uint64_t max_small; /* messages whose records fit in cap/2 are published atomically */
    uint64_t frag;      /* payload bytes per fragment of a large message */
    int role;
    int corrupt;
    /* producer */
    uint64_t head, head_pub, tail_cache;
    uint32_t w_msg, w_frame0, w_frame; /* resumable write cursor (RING_EAGAIN mid-call) */
    uint64_t w_blob, w_off;
    int w_mid;    /* inside a large message: part of it is already published */
    int w_active; /* a write call owns the cursor: started (RING_W_FRESH), not finished/aborted */
    int w_broken; /* a large message was cut off mid-way: every later write fails */
    /* consumer */
    uint64_t rpos, tail_pub, head_cache;
    int r_state, r_state_pub; /* r_state_pub: the state at tail_pub, where ring_unread rewinds */
    /* waiting */
    uint64_t deadline;
    uint64_t spin_ns, spin_min, spin_max;
    uint64_t st_waits, st_parks, st_spin_hits, st_posts;
};

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t rec_size(uint64_t len) { return 8 + ((len + 7) & ~7ull); }

static int poison(ring_t *r, int detail)
{
    if (!r->corrupt)
        r->corrupt = detail;
    return RING_ECORRUPT;
}

static inline int magic_ok(ring_t *r)
{
    return *(volatile uint64_t *)&r->h->magic == RING_MAGIC;
}

int ring_region_init(uint8_t *base, uint64_t region_size, uint64_t cap)
{
    if (!base || ((uintptr_t)base & 63) || cap < RING_MIN_CAP || cap > RING_MAX_CAP ||
        (cap & (cap - 1)) || region_size < RING_HDR_SIZE + cap)
        return RING_EINVAL;
    ring_hdr_t *h = (ring_hdr_t *)base;
    memset(h, 0, sizeof(*h));
    h->version = RING_VERSION;
    h->hdr_size = RING_HDR_SIZE;
    h->cap = cap;
    h->region_size = region_size;
    if (sem_init(&h->data_sem.s, 1, 0) || sem_init(&h->space_sem.s, 1, 0))
        return -errno;
    atomic_store_explicit(&h->head, 0, memory_order_relaxed);
    atomic_store_explicit(&h->tail, 0, memory_order_relaxed);
    /* NOTE: release so that a peer which later sees the magic sees a fully initialised header
     * (the handshake over the socket already orders this; the fence documents the intent). */
    atomic_thread_fence(memory_order_release);
    *(volatile uint64_t *)&h->magic = RING_MAGIC;
    return RING_OK;
}

ring_t *ring_open(uint8_t *base, uint64_t region_size, int role, int *err)
{
    *err = RING_EINVAL;
    if (!base || ((uintptr_t)base & 63) || region_size < RING_HDR_SIZE + RING_MIN_CAP ||
        (role != RING_ROLE_PRODUCER && role != RING_ROLE_CONSUMER))
        return NULL;
    ring_hdr_t *h = (ring_hdr_t *)base;
    /* Copy everything we will trust into private memory, then validate the copies. */
    uint64_t magic = *(volatile uint64_t *)&h->magic;
    uint32_t version = *(volatile uint32_t *)&h->version;
    uint32_t hdr_size = *(volatile uint32_t *)&h->hdr_size;
    uint64_t cap = *(volatile uint64_t *)&h->cap;
    *err = RING_ECORRUPT;
    if (magic != RING_MAGIC || version != RING_VERSION || hdr_size != RING_HDR_SIZE)
        return NULL;
    if (cap < RING_MIN_CAP || cap > RING_MAX_CAP || (cap & (cap - 1)) ||
        RING_HDR_SIZE + cap > region_size)
        return NULL;
    uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    if (head - tail > cap || (head & 7) || (tail & 7))
        return NULL;
    ring_t *r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    r->h = h;
    r->data = base + RING_HDR_SIZE;
    r->cap = cap;
    r->mask = cap - 1;
    r->max_small = cap / 2;
    r->frag = cap / 4 - 8;
    r->role = role;
    r->head = r->head_pub = head;
    r->tail_cache = tail;
    r->rpos = r->tail_pub = tail;
    r->head_cache = tail;
    r->spin_min = 2000;
    r->spin_max = 50000;
    r->spin_ns = r->spin_max;
    *err = RING_OK;
    return r;
}

void ring_free(ring_t *r) { free(r); }

void ring_set_spin(ring_t *r, uint64_t min_ns, uint64_t max_ns)
{
    if (min_ns > max_ns)
        min_ns = max_ns;
    r->spin_min = min_ns;
    r->spin_max = max_ns;
    r->spin_ns = max_ns;
}

/* ---- counters and wake-ups -------------------------------------------------------------- */

static inline int prod_refresh_tail(ring_t *r)
{
    /* NOTE acquire: pairs with the consumer's release store of tail, so its reads of the records
     * it released happen-before we overwrite those bytes. */
    uint64_t t = atomic_load_explicit(&r->h->tail, memory_order_acquire);
    /* tail may only move forward, never past what we wrote. */
    if (t - r->tail_cache > r->head - r->tail_cache || (t & 7))
        return poison(r, RING_C_TAIL);
    r->tail_cache = t;
    return RING_OK;
}

static inline int cons_refresh_head(ring_t *r)
{
    /* NOTE acquire: pairs with the producer's release store of head, making the record bytes
     * written before that store visible to our reads. */
    uint64_t hd = atomic_load_explicit(&r->h->head, memory_order_acquire);
    /* head must lie in [rpos, tail_pub + cap] and stay 8-aligned. */
    if (hd - r->tail_pub > r->cap || hd - r->tail_pub < r->rpos - r->tail_pub || (hd & 7))
        return poison(r, RING_C_HEAD);
    r->head_cache = hd;
    return RING_OK;
}

static void publish(ring_t *r)
{
    ring_hdr_t *h = r->h;
    if (r->head == r->head_pub)
        return;
    /* NOTE release: orders the record bytes before the new head for an acquiring consumer. */
    atomic_store_explicit(&h->head, r->head, memory_order_release);
    r->head_pub = r->head;
    /* NOTE seq_cst fence: the head store must be globally visible before we read cons_waiting
     * (store->load order needs a full fence).  Pairs with the consumer's fence between setting
     * cons_waiting and re-reading head: one of the two sides always sees the other's write, so a
     * wake-up cannot be lost. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&h->cons_waiting, memory_order_relaxed) &&
        atomic_exchange_explicit(&h->cons_waiting, 0, memory_order_relaxed)) {
        sem_post(&h->data_sem.s);
        r->st_posts++;
    }
}

static void release(ring_t *r)
{
    ring_hdr_t *h = r->h;
    r->r_state_pub = r->r_state;
    if (r->rpos == r->tail_pub)
        return;
    /* NOTE release: our reads of the released records complete before the producer (acquiring
     * tail) can reuse their bytes. */
    atomic_store_explicit(&h->tail, r->rpos, memory_order_release);
    r->tail_pub = r->rpos;
    /* NOTE seq_cst fence: same Dekker pairing as publish(), with prod_waiting. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&h->prod_waiting, memory_order_relaxed) &&
        atomic_exchange_explicit(&h->prod_waiting, 0, memory_order_relaxed)) {
        sem_post(&h->space_sem.s);
        r->st_posts++;
    }
}

/* 1 = ready, 0 = not yet, <0 = error.  need: producer's bytes of free space wanted. */
static int check_ready(ring_t *r, uint64_t need)
{
    int e;
    if (r->role == RING_ROLE_PRODUCER) {
        if (r->head + need - r->tail_cache <= r->cap)
            return 1;
        if ((e = prod_refresh_tail(r)))
            return e;
        if (r->head + need - r->tail_cache <= r->cap)
            return 1;
        if (atomic_load_explicit(&r->h->cons_closed, memory_order_acquire) ||
            atomic_load_explicit(&r->h->prod_closed, memory_order_relaxed))
            return RING_ECLOSED; /* peer gone, or closed locally by another thread */
        return 0;
    }
    if (atomic_load_explicit(&r->h->cons_closed, memory_order_relaxed))
        return RING_ECLOSED; /* closed locally (possibly by another thread while we waited) */
    if (r->head_cache != r->rpos)
        return 1;
    if ((e = cons_refresh_head(r)))
        return e;
    if (r->head_cache != r->rpos)
        return 1;
    if (atomic_load_explicit(&r->h->prod_closed, memory_order_acquire)) {
        /* NOTE: the producer publishes head before it release-stores prod_closed, so after our
         * acquire of prod_closed this re-load sees the final head: nothing is lost at close. */
        if ((e = cons_refresh_head(r)))
            return e;
        return r->head_cache != r->rpos ? 1 : RING_ECLOSED;
    }
    return 0;
}

static void adapt_spin(ring_t *r, uint64_t waited, int parked)
{
    if (!parked) {
        r->st_spin_hits++;
        return;
    }
    if (waited < 2 * r->spin_max) {
        /* The peer answered soon after we gave up spinning: a longer spin would have won. */
        uint64_t s = r->spin_ns < 500 ? 1000 : r->spin_ns * 2; /* from 0 too (spin_min 0) */
        r->spin_ns = s > r->spin_max ? r->spin_max : s;
    } else {
        /* A real idle gap: spinning only burned CPU the engine could use. */
        uint64_t s = r->spin_ns / 2;
        r->spin_ns = s < r->spin_min ? r->spin_min : s;
    }
}

/* Wait until check_ready() holds or r->deadline passes.  Spin (bounded, adaptive) then park. */
static int wait_ready(ring_t *r, uint64_t need, int spin)
{
    int c = check_ready(r, need);
    if (c)
        return c < 0 ? c : RING_OK;
    uint64_t t0 = now_ns();
    r->st_waits++;
    if (spin && r->spin_ns) {
        uint64_t end = t0 + r->spin_ns;
        if (end > r->deadline)
            end = r->deadline;
        uint64_t yield_from = t0 + RING_PURE_SPIN_NS;
        for (;;) {
            for (int i = 0; i < 16; i++) {
                cpu_relax();
                c = check_ready(r, need);
                if (c) {
                    if (c > 0)
                        adapt_spin(r, 0, 0);
                    return c < 0 ? c : RING_OK;
                }
            }
            uint64_t now = now_ns();
            if (now >= end)
                break;
            /* Past the first few microseconds, offer the core between polls: on a 2-core box
             * the peer we wait for may be queued behind us on this very core, and a pure spin
             * would then delay the answer it spins for.  Costs ~1 us when nobody else runs. */
            if (now >= yield_from)
                sched_yield();
        }
    }
    ring_hdr_t *h = r->h;
    _Atomic uint32_t *flag = r->role == RING_ROLE_CONSUMER ? &h->cons_waiting : &h->prod_waiting;
    sem_t *sem = r->role == RING_ROLE_CONSUMER ? &h->data_sem.s : &h->space_sem.s;
    for (;;) {
        atomic_store_explicit(flag, 1, memory_order_relaxed);
        /* NOTE seq_cst fence: flag store before the re-check load; pairs with publish()/release().
         */
        atomic_thread_fence(memory_order_seq_cst);
        c = check_ready(r, need);
        if (c) {
            atomic_store_explicit(flag, 0, memory_order_relaxed);
            if (c > 0)
                adapt_spin(r, now_ns() - t0, 1);
            return c < 0 ? c : RING_OK;
        }
        uint64_t now = now_ns();
        if (now >= r->deadline) {
            atomic_store_explicit(flag, 0, memory_order_relaxed);
            if (now - t0 >= 2 * r->spin_max)
                adapt_spin(r, now - t0, 1);
            return RING_EAGAIN;
        }
        struct timespec ts = {(time_t)(r->deadline / 1000000000ull),
                              (long)(r->deadline % 1000000000ull)};
        r->st_parks++;
        if (sem_clockwait(sem, CLOCK_MONOTONIC, &ts) != 0 && errno == EINTR) {
            /* Let Python run its signal handlers (KeyboardInterrupt), then retry. */
            atomic_store_explicit(flag, 0, memory_order_relaxed);
            return RING_EAGAIN;
        }
    }
}

static inline void set_deadline(ring_t *r, uint64_t slice_ns)
{
    uint64_t now = now_ns();
    r->deadline = slice_ns > UINT64_MAX - now ? UINT64_MAX : now + slice_ns;
}

/* ---- producer ------------------------------------------------------------------------------ */

static inline void put_hdr(ring_t *r, uint64_t off, uint32_t len, uint32_t kind)
{
    uint32_t hd[2] = {len, kind};
    memcpy(r->data + off, hd, 8);
}

/* Make room for a record of `rec` bytes at head (plus the WRAP filler if it must wrap). */
static int reserve(ring_t *r, uint64_t rec, int spin, uint64_t *off_out)
{
    uint64_t off = r->head & r->mask;
    uint64_t room = r->cap - off;
    uint64_t need = rec + (room < rec ? room : 0);
    if (r->head + need - r->tail_cache > r->cap) {
        int c = check_ready(r, need);
        if (c <= 0) {
            /* Blocked: make what we wrote visible first, or the consumer could never free room. */
            publish(r);
            int e = c < 0 ? c : wait_ready(r, need, spin);
            if (e)
                return e;
        }
    }
    if (room < rec) {
        put_hdr(r, off, (uint32_t)(room - 8), RING_K_WRAP);
        r->head += room;
        off = 0;
    }
    *off_out = off;
    return RING_OK;
}

static void reset_cursor(ring_t *r)
{
    r->w_msg = r->w_frame0 = r->w_frame = 0;
    r->w_blob = r->w_off = 0;
    r->w_mid = 0;
    r->w_active = 0;
}

int ring_write(ring_t *r, const char *blob, const char *const *ptrs, const uint64_t *lens,
               const uint32_t *nframes, uint32_t nmsgs, uint64_t slice_ns, int flags)
{
    if (r->corrupt)
        return RING_ECORRUPT;
    if (r->role != RING_ROLE_PRODUCER || (!blob && !ptrs) || !lens)
        return RING_EINVAL;
    if (!magic_ok(r))
        return poison(r, RING_C_MAGIC);
    if (atomic_load_explicit(&r->h->prod_closed, memory_order_relaxed) ||
        atomic_load_explicit(&r->h->cons_closed, memory_order_acquire))
        return RING_ECLOSED;
    if (r->w_broken)
        return RING_EBROKEN;
    /* NOTE: the cursor's owner.  A fresh call takes it over; a resume (no RING_W_FRESH) is only
     * ever made by the call that left it (channel.py keeps that call pending).  Python's
     * bookkeeping of this can be cut short by a second signal (an exception raised inside the
     * handler of the first), so the C side does not trust it: a fresh call over a half-published
     * large message breaks the send side instead of splicing its own bytes onto that message,
     * and a resume of a call that already finished or was aborted writes nothing again. */
    if (flags & RING_W_FRESH) {
        if (r->w_mid) {
            reset_cursor(r);
            r->w_broken = 1;
            return RING_EBROKEN;
        }
        reset_cursor(r); /* at a message boundary: what the lost call had not sent is dropped */
        r->w_active = 1;
    } else if (!r->w_active) {
        return RING_OK;
    }
    if (r->w_msg || r->w_mid) {
        /* Resuming: the offsets are re-derived from this call's own arrays, so even a wrong
         * resume never reads outside them. */
        if (r->w_msg >= nmsgs)
            return RING_EINVAL;
        uint64_t f0 = 0, boff = 0;
        for (uint32_t m = 0; m < r->w_msg; m++)
            f0 += nframes ? nframes[m] : 1;
        if (!ptrs)
            for (uint64_t i = 0; i < f0; i++)
                boff += lens[i];
        r->w_frame0 = (uint32_t)f0;
        r->w_blob = boff;
    }
    set_deadline(r, slice_ns);
    const int spin = flags & RING_W_SPIN;
    const uint64_t batch_pub = r->cap / 8 < 65536 ? r->cap / 8 : 65536;
    int rc;
    while (r->w_msg < nmsgs) {
        uint32_t nf = nframes ? nframes[r->w_msg] : 1;
        uint32_t f0 = r->w_frame0;
        if (nf == 0)
            return RING_EINVAL;
        if (!r->w_mid) {
            uint64_t foot = 0;
            for (uint32_t i = 0; i < nf && foot <= r->max_small; i++)
                foot += lens[f0 + i] > r->max_small ? r->max_small + 1 : rec_size(lens[f0 + i]);
            if (foot <= r->max_small) {
                /* Small message: wait for room for all of it, then publish it in one store, so a
                 * timeout never leaves half a message and the reader can check completeness. */
                uint64_t pos = r->head;
                for (uint32_t i = 0; i < nf; i++) {
                    uint64_t rec = rec_size(lens[f0 + i]), room = r->cap - (pos & r->mask);
                    pos += (room < rec ? room : 0) + rec;
                }
                uint64_t need = pos - r->head;
                if (r->head + need - r->tail_cache > r->cap) {
                    rc = check_ready(r, need);
                    if (rc <= 0) {
                        publish(r);
                        if (rc < 0 || (rc = wait_ready(r, need, spin)))
                            return rc;
                    }
                }
                uint64_t boff = r->w_blob;
                for (uint32_t i = 0; i < nf; i++) {
                    uint64_t len = lens[f0 + i], off;
                    const char *src = ptrs ? ptrs[f0 + i] : blob + boff;
                    reserve(r, rec_size(len), 0, &off); /* cannot block: room was checked */
                    uint32_t kind = RING_K_DATA | RING_F_FRAME_END | (i + 1 == nf ? RING_F_MSG_END : 0);
                    put_hdr(r, off, (uint32_t)len, kind);
                    if (len)
                        memcpy(r->data + off + 8, src, len);
                    r->head += rec_size(len);
                    boff += len;
                }
                r->w_blob = boff;
                r->w_frame0 += nf;
                r->w_msg++;
                if (r->head - r->head_pub >= batch_pub)
                    publish(r);
                continue;
            }
            r->w_mid = 1;
            r->w_frame = 0;
            r->w_off = 0;
        }
        /* Large message: fragments of <= cap/4, each published as soon as it is written so the
         * consumer copies one while we fill the next.  Resumable after RING_EAGAIN. */
        if (r->w_frame >= nf)
            return RING_EINVAL; /* a resume with fewer frames than the call that started it */
        while (r->w_frame < nf) {
            uint64_t len = lens[f0 + r->w_frame];
            if (r->w_off > len)
                return RING_EINVAL; /* a resume with a shorter frame: never read before src */
            uint64_t boff = r->w_blob;
            if (!ptrs)
                for (uint32_t i = 0; i < r->w_frame; i++)
                    boff += lens[f0 + i];
            const char *src = ptrs ? ptrs[f0 + r->w_frame] : blob + boff;
            do {
                uint64_t chunk = len - r->w_off, off;
                if (chunk > r->frag)
                    chunk = r->frag;
                if ((rc = reserve(r, rec_size(chunk), spin, &off)))
                    return rc;
                int frame_end = r->w_off + chunk == len;
                uint32_t kind = RING_K_DATA | RING_F_LARGE;
                if (frame_end)
                    kind |= RING_F_FRAME_END | (r->w_frame + 1 == nf ? RING_F_MSG_END : 0);
                put_hdr(r, off, (uint32_t)chunk, kind);
                if (chunk)
                    memcpy(r->data + off + 8, src + r->w_off, chunk);
                r->head += rec_size(chunk);
                r->w_off += chunk;
                publish(r);
            } while (r->w_off < len);
            r->w_frame++;
            r->w_off = 0;
        }
        for (uint32_t i = 0; i < nf; i++)
            r->w_blob += lens[f0 + i];
        r->w_mid = 0;
        r->w_frame0 += nf;
        r->w_msg++;
    }
    publish(r);
    reset_cursor(r);
    return RING_OK;
}

int ring_write1(ring_t *r, const char *buf, uint64_t len, uint64_t slice_ns, int flags)
{
    return ring_write(r, buf, NULL, &len, NULL, 1, slice_ns, flags);
}

uint32_t ring_write_progress(ring_t *r, int *mid_message)
{
    *mid_message = r->w_mid;
    return r->w_msg;
}

void ring_write_abort(ring_t *r)
{
    /* Inside a large message the consumer already holds its head and waits for a rest that will
     * never come: anything written after it would be read as that rest. */
    if (r->w_mid)
        r->w_broken = 1;
    reset_cursor(r);
}

int ring_write_broken(ring_t *r) { return r->w_broken; }

/* ---- consumer ------------------------------------------------------------------------------ */

void ring_release(ring_t *r)
{
    if (r->role == RING_ROLE_CONSUMER && !r->corrupt)
        release(r);
}

uint64_t ring_unread(ring_t *r)
{
    if (r->role != RING_ROLE_CONSUMER || r->corrupt)
        return UINT64_MAX;
    /* The records between tail_pub and rpos are still ours (the producer reuses nothing past the
     * published tail), so handing them out again is safe. */
    r->rpos = r->tail_pub;
    r->r_state = r->r_state_pub;
    return r->tail_pub;
}

uint64_t ring_consumed(ring_t *r) { return r->tail_pub; }

/* Scan available records into out[2*i] = payload offset from the region base,
 * out[2*i+1] = len | kind << 32.  Returns the entry count (0 = only WRAPs seen), or <0. */
static int scan(ring_t *r, uint64_t *out, uint32_t max_entries, uint32_t max_msgs)
{
    uint32_t n = 0, msgs = 0, msg_n = 0;
    uint64_t msg_pos = r->rpos;
    int e;
    while (msgs < max_msgs) {
        if (r->rpos == r->head_cache) {
            if ((e = cons_refresh_head(r)))
                return e;
            if (r->rpos == r->head_cache) {
                /* Small messages are published whole: running dry inside one is corruption. */
                if (r->r_state == ST_SMALL)
                    return poison(r, RING_C_PARTIAL);
                break;
            }
        }
        uint64_t off = r->rpos & r->mask, room = r->cap - off, avail = r->head_cache - r->rpos;
        /* NOTE: one volatile read of the header into locals; we validate and use only the copies,
         * so a concurrent scribble cannot change a value between its check and its use. */
        volatile const uint32_t *p = (volatile const uint32_t *)(r->data + off);
        uint32_t len = p[0], kind = p[1];
        if (kind == RING_K_WRAP) {
            if ((uint64_t)len + 8 != room || room > avail)
                return poison(r, RING_C_WRAP);
            r->rpos += room;
            continue;
        }
        if ((kind & ~0x700u) != RING_K_DATA)
            return poison(r, RING_C_KIND);
        /* Small-message frames are never split; MSG_END implies FRAME_END. */
        if ((!(kind & RING_F_LARGE) && !(kind & RING_F_FRAME_END)) ||
            ((kind & RING_F_MSG_END) && !(kind & RING_F_FRAME_END)))
            return poison(r, RING_C_KIND);
        int large = (kind & RING_F_LARGE) != 0;
        if ((r->r_state == ST_SMALL && large) || (r->r_state == ST_LARGE && !large))
            return poison(r, RING_C_KIND);
        uint64_t rec = rec_size(len);
        if (rec > room || rec > avail || (!large && rec > r->max_small))
            return poison(r, RING_C_RECLEN);
        if (r->r_state == ST_IDLE) {
            /* A large message is returned alone (the caller copies it out and calls again, which
             * releases the fragments), so never start one behind other entries. */
            if (large && n > 0)
                break;
            msg_pos = r->rpos;
            msg_n = n;
        }
        if (n == max_entries) {
            if (r->r_state == ST_SMALL || (r->r_state == ST_IDLE && !large)) {
                /* Out of entries inside a small message: roll back to its start. */
                r->rpos = msg_pos;
                r->r_state = ST_IDLE;
                n = msg_n;
                if (n == 0)
                    return -105; /* ENOBUFS: the caller must pass a bigger array */
            }
            break;
        }
        out[2 * n] = RING_HDR_SIZE + off + 8;
        out[2 * n + 1] = (uint64_t)len | ((uint64_t)kind << 32);
        n++;
        r->rpos += rec;
        if (kind & RING_F_MSG_END) {
            r->r_state = ST_IDLE;
            msgs++;
            if (large)
                break;
        } else {
            r->r_state = large ? ST_LARGE : ST_SMALL;
        }
    }
    return (int)n;
}

int ring_read(ring_t *r, uint64_t *out, uint32_t max_entries, uint32_t max_msgs,
              uint64_t slice_ns, int spin)
{
    if (r->corrupt)
        return RING_ECORRUPT;
    if (r->role != RING_ROLE_CONSUMER || !out || max_entries == 0 || max_entries > 0x3fffffff ||
        max_msgs == 0)
        return RING_EINVAL;
    if (!magic_ok(r))
        return poison(r, RING_C_MAGIC);
    if (atomic_load_explicit(&r->h->cons_closed, memory_order_relaxed))
        return RING_ECLOSED; /* closed locally */
    /* Everything handed out by the previous call is done with now (the lifetime rule). */
    release(r);
    set_deadline(r, slice_ns);
    for (;;) {
        int e = wait_ready(r, 0, spin);
        if (e)
            return e;
        int n = scan(r, out, max_entries, max_msgs);
        if (n != 0)
            return n;
        /* Only WRAP records were pending: give their space back and wait again. */
        release(r);
    }
}

/* ---- misc ---------------------------------------------------------------------------------- */

void ring_close(ring_t *r)
{
    /* May run on another thread than the one blocked in this ring, so it touches only the shared
     * flags, never the private counters (a write call always publishes before it returns or
     * waits, so nothing is left unpublished).  It wakes both the peer and our own waiter. */
    ring_hdr_t *h = r->h;
    _Atomic uint32_t *mine = r->role == RING_ROLE_PRODUCER ? &h->prod_closed : &h->cons_closed;
    /* NOTE release: everything published before is ordered before closed; see check_ready. */
    atomic_store_explicit(mine, 1, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_exchange_explicit(&h->cons_waiting, 0, memory_order_relaxed))
        sem_post(&h->data_sem.s);
    if (atomic_exchange_explicit(&h->prod_waiting, 0, memory_order_relaxed))
        sem_post(&h->space_sem.s);
}

int ring_corrupt_detail(ring_t *r) { return r->corrupt; }

void ring_stats(ring_t *r, uint64_t *out, uint32_t n)
{
    uint64_t v[5] = {r->st_waits, r->st_parks, r->st_spin_hits, r->st_posts, r->spin_ns};
    for (uint32_t i = 0; i < n && i < 5; i++)
        out[i] = v[i];
}

int ring_bench_sem_init(uint8_t *p) { return sem_init((sem_t *)p, 1, 0) ? -errno : 0; }

int ring_bench_sem_post(uint8_t *p) { return sem_post((sem_t *)p) ? -errno : 0; }

int ring_bench_sem_wait(uint8_t *p, uint64_t timeout_ns)
{
    uint64_t d = now_ns() + timeout_ns;
    struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
    while (sem_clockwait((sem_t *)p, CLOCK_MONOTONIC, &ts) != 0) {
        if (errno != EINTR)
            return -errno;
    }
    return 0;
}

int64_t ring_read1(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t slice_ns, int spin)
{
    int n = ring_read(r, out, max_entries, 1, slice_ns, spin);
    if (n == 1 && (out[1] >> 32) == (RING_K_DATA | RING_F_FRAME_END | RING_F_MSG_END))
        return (int64_t)((out[0] << 32) | (out[1] & 0xffffffffu)); /* >= 2^32: offset >= 520 */
    return n;
}

int ring_read_batch(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t view_base,
                    uint64_t slice_ns, int spin)
{
    int n = ring_read(r, out, max_entries, 0xffffffffu, slice_ns, spin);
    if (n <= 0)
        return n;
    int simple = 1;
    for (int i = 0; i < n; i++) {
        simple &= (out[2 * i + 1] >> 32) == (RING_K_DATA | RING_F_FRAME_END | RING_F_MSG_END);
        out[2 * i] += view_base;
    }
    return simple ? (n | RING_BATCH_SIMPLE) : n;
}
