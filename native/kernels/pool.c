/* A small persistent thread pool for 1-few cores.
 *
 * Workers wait for a new "generation" of work: they spin briefly (bounded by the TSC, ~30 us, so
 * back-to-back GEMMs inside one decoder layer do not pay a futex wake-up; ~1 ms while a caller
 * holds the pool for a whole model forward, shmk_pool_hold) and then park on a futex.  The
 * caller bumps the generation, wakes sleepers only if there are any, runs tasks itself, and
 * waits (spin, then futex) for the workers to drain.  Tasks come from one atomic
 * counter, so a slow (preempted) thread simply takes fewer tasks. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include "common.h"

#define MAX_THREADS 64
#define SPIN_CYCLES 80000ULL        /* ~30 us at 2.5 GHz TSC */
#define HOLD_SPIN_CYCLES 2600000ULL /* ~1 ms, while a caller holds the pool (shmk_pool_hold) */

static void futex_wait(atomic_int *addr, int val) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void futex_wake(atomic_int *addr, int n) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static struct {
    pthread_mutex_t lock; /* serialises shmk_parallel callers and resizes */
    int nthreads;         /* including the caller */
    pthread_t tids[MAX_THREADS];
    atomic_int gen;       /* bumped for each job (futex word for parked workers) */
    atomic_int sleepers;  /* workers parked on gen */
    atomic_int done;      /* tasks finished in the current job (futex word for the caller) */
    atomic_int waiting;   /* caller parked on done */
    atomic_int stop;
    atomic_int hold; /* > 0: a caller has more parallel calls coming */
    /* claim word: job generation (high 32 bits) | tasks still unclaimed (low 32 bits).  A worker
     * that wakes late cannot claim a task of a finished job, and while it holds a claim the job
     * cannot finish, so fn/ctx/ntasks below are stable for it. */
    _Atomic uint64_t claim;
    shmk_task_fn fn;
    void *ctx;
    int64_t ntasks;
    int initialised;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Whether a waiter that started spinning at TSC t0 spins on rather than parks. */
static inline int keep_spinning(unsigned long long t0) {
    const unsigned long long spun = __rdtsc() - t0;
    return spun < SPIN_CYCLES || (spun < HOLD_SPIN_CYCLES && atomic_load(&P.hold) > 0);
}

/* Claim and run tasks of job generation g until none are left. */
static void run_tasks(uint32_t g, int tid) {
    uint64_t v = atomic_load(&P.claim);
    for (;;) {
        if ((uint32_t)(v >> 32) != g || (uint32_t)v == 0) return;
        if (!atomic_compare_exchange_weak(&P.claim, &v, v - 1)) continue;
        /* NOTE: the job's fields are read only while this claim is held, i.e. before the
         * fetch_add on done below: once done reaches ntasks the caller returns, and the next
         * shmk_parallel rewrites fn / ctx / ntasks (reading P.ntasks after the fetch_add raced
         * with that write; ThreadSanitizer reported it). */
        const int64_t ntasks = P.ntasks;
        P.fn(P.ctx, ntasks - (int64_t)(uint32_t)v, tid);
        int d = atomic_fetch_add(&P.done, 1) + 1;
        if (d == ntasks && atomic_load(&P.waiting)) futex_wake(&P.done, 1);
        v = atomic_load(&P.claim);
    }
}

static void scratch_free_all(void);

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg;
    int seen = atomic_load(&P.gen);
    for (;;) {
        unsigned long long t0 = __rdtsc();
        /* NOTE: also leave on `stop`: a worker that starts running only after stop_workers()
         * bumped gen reads the bumped value as `seen` and would otherwise wait forever (the
         * join in stop_workers then hangs; seen when set_num_threads runs twice quickly). */
        while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen && !atomic_load(&P.stop)) {
            if (keep_spinning(t0)) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&P.sleepers, 1);
            if (atomic_load(&P.gen) == seen && !atomic_load(&P.stop)) futex_wait(&P.gen, seen);
            atomic_fetch_sub(&P.sleepers, 1);
            t0 = __rdtsc();
        }
        seen = atomic_load(&P.gen);
        if (atomic_load(&P.stop)) {
            scratch_free_all(); /* its thread-local buffers would leak (MBs after a prefill) */
            return NULL;
        }
        run_tasks((uint32_t)seen, tid);
    }
}

static void stop_workers(void) {
    if (P.nthreads <= 1) return;
    atomic_store(&P.stop, 1);
    atomic_fetch_add(&P.gen, 1);
    futex_wake(&P.gen, INT_MAX);
    for (int i = 1; i < P.nthreads; i++) pthread_join(P.tids[i], NULL);
    atomic_store(&P.stop, 0);
    P.nthreads = 1;
}

static int start_workers(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    P.nthreads = 1;
    /* NOTE: workers are created with asynchronous signals blocked (a thread inherits its
     * creator's mask), so the kernel delivers SIGINT / SIGTERM to a Python thread: one taken by
     * a worker does not interrupt a blocking call of Python's main thread (input()).
     * Fault signals stay deliverable (blocked, a fault would kill the process silently). */
    sigset_t async_signals, old;
    sigfillset(&async_signals);
    const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
    for (size_t k = 0; k < sizeof faults / sizeof faults[0]; k++) sigdelset(&async_signals, faults[k]);
    pthread_sigmask(SIG_BLOCK, &async_signals, &old);
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.tids[i], NULL, worker, (void *)(intptr_t)i) != 0) break;
        pthread_setname_np(P.tids[i], "shmk-worker");
        P.nthreads = i + 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return P.nthreads;
}

static int default_threads(void) {
    const char *env = getenv("SHMK_NUM_THREADS");
    if (env && atoi(env) > 0) return atoi(env);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* A forked child has none of the parent's workers: forget them and start a fresh pool lazily
 * (without this the child would still work, the caller running every task itself). */
static void atfork_child(void) {
    pthread_mutex_init(&P.lock, NULL);
    P.nthreads = 1;
    P.initialised = 0;
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.waiting, 0);
    atomic_store(&P.stop, 0);
    atomic_store(&P.hold, 0);
}

static void ensure_init(void) {
    static int atfork_registered;
    if (!atfork_registered) {
        atfork_registered = 1;
        pthread_atfork(NULL, NULL, atfork_child);
    }
    if (!P.initialised) {
        P.initialised = 1;
        start_workers(default_threads());
    }
}

int shmk_set_num_threads(int n) {
    pthread_mutex_lock(&P.lock);
    ensure_init();
    stop_workers();
    int r = start_workers(n);
    pthread_mutex_unlock(&P.lock);
    return r;
}

int shmk_get_num_threads(void) {
    pthread_mutex_lock(&P.lock);
    ensure_init();
    int n = P.nthreads;
    pthread_mutex_unlock(&P.lock);
    return n;
}

int shmk_threads(void) { return shmk_get_num_threads(); }

void shmk_pool_hold(int on) { atomic_fetch_add(&P.hold, on ? 1 : -1); }

int shmk_pool_holds(void) { return atomic_load(&P.hold); }

void shmk_parallel(shmk_task_fn fn, void *ctx, int64_t ntasks) {
    if (ntasks <= 0) return;
    pthread_mutex_lock(&P.lock);
    ensure_init();
    if (ntasks == 1 || P.nthreads == 1) {
        pthread_mutex_unlock(&P.lock);
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t, 0);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.ntasks = ntasks;
    atomic_store(&P.done, 0);
    uint32_t g = (uint32_t)atomic_load(&P.gen) + 1;
    atomic_store(&P.claim, ((uint64_t)g << 32) | (uint64_t)ntasks);
    atomic_store(&P.gen, (int)g); /* seq_cst: pairs with the sleepers check in worker() */
    if (atomic_load(&P.sleepers) > 0) futex_wake(&P.gen, INT_MAX);
    run_tasks(g, 0);
    /* Only tasks a worker already claimed can still be running: wait for those. */
    unsigned long long t0 = __rdtsc();
    int d;
    while ((d = atomic_load_explicit(&P.done, memory_order_acquire)) != ntasks) {
        if (keep_spinning(t0)) {
            _mm_pause();
            continue;
        }
        atomic_store(&P.waiting, 1);
        if (atomic_load(&P.done) == d) futex_wait(&P.done, d);
        atomic_store(&P.waiting, 0);
    }
    pthread_mutex_unlock(&P.lock);
}

/* ---- work split for the GEMMs (common.h) ---- */
shmk_split_plan shmk_split_units(int64_t m, int64_t nunits, int nth) {
    shmk_split_plan p = {.m = m, .nunits = nunits};
    /* rows: up to 128 a task, so a unit's weights are prepared (widened or rearranged) once per
     * 128 rows; 64 measured 10-15% slower at M >= 256 (prefill 512 -3%), 256 left 9 tasks for
     * 2 threads on the 576-channel matrices at M = 256 */
    p.rows_per_task = m <= 128 ? m : 128;
    p.mtasks = shmk_cdiv(m, p.rows_per_task);
    /* unit ranges: up to 8 * nth tasks in all, sized so that the busiest thread's share (tasks
     * claimed in turn, equal speeds) is smallest; with one row range, the fewest tasks among
     * equal shares.  NOTE: a fixed 8 * nth split left one thread 5 tasks and the other 4 on the
     * 18-unit matrices (o, down) at 2 threads: 10 units against 8.  And each task starts on cold
     * weights (a unit prefetches the next one only within its task): one task a thread took
     * batch-16 qkv from 54-55 to 47-51 us, gate_up from 131-140 to 118-129. */
    const int64_t max_chunks = nth == 1 ? 1 : shmk_cdiv(8 * nth, p.mtasks);
    int64_t best_load = -1;
    for (int64_t chunks = max_chunks; chunks >= 1; chunks--) {
        const int64_t upt = shmk_cdiv(nunits, chunks), tasks = shmk_cdiv(nunits, upt) * p.mtasks;
        const int64_t load = shmk_cdiv(tasks, nth) * upt;
        if (best_load < 0 || load < best_load || (load == best_load && p.mtasks == 1))
            best_load = load, p.units_per_task = upt;
    }
    p.ntasks = shmk_cdiv(nunits, p.units_per_task) * p.mtasks;
    return p;
}

shmk_split_plan shmk_split_tiles(int64_t m, int64_t nunits, int nth, int64_t mtile) {
    if (m <= mtile) return shmk_split_units(m, nunits, nth);
    shmk_split_plan p = {.m = m, .nunits = nunits, .rows_per_task = mtile};
    p.mtasks = shmk_cdiv(m, mtile);
    int64_t nchunks = nth == 1 ? 1 : shmk_cdiv(8 * nth, p.mtasks);
    if (nchunks < 1) nchunks = 1;
    p.units_per_task = shmk_cdiv(nunits, nchunks);
    p.ntasks = shmk_cdiv(nunits, p.units_per_task) * p.mtasks;
    return p;
}

/* ---- thread-local scratch ---- */
#define NSLOTS 10
static _Thread_local struct {
    void *p;
    size_t n;
} scratch[NSLOTS];

void *shmk_scratch(int slot, size_t bytes) {
    if (scratch[slot].n < bytes) {
        free(scratch[slot].p);
        size_t n = bytes + bytes / 4 + 4096;
        n = (n + 63) & ~(size_t)63;
        scratch[slot].p = aligned_alloc(64, n);
        scratch[slot].n = scratch[slot].p ? n : 0;
    }
    return scratch[slot].p;
}

/* Frees the calling thread's scratch (a pool worker, as it exits: thread-local storage is not
 * freed with the thread, so each shmk_set_num_threads leaked the old workers' buffers). */
static void scratch_free_all(void) {
    for (int i = 0; i < NSLOTS; i++) {
        free(scratch[i].p);
        scratch[i].p = NULL;
        scratch[i].n = 0;
    }
}
