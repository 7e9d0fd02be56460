/* Shared-memory SPSC ring: the frontend <-> engine transport (see docs/ipc.md).
 *
 * One ring region = a header (own cache lines for head, tail, waiting flags, closed flags and two
 * process-shared semaphores) followed by a power-of-two data area holding 8-byte aligned records
 * [u32 len][u32 kind][payload padded to 8].  Only the owning process's ring_t (malloc'd, private)
 * holds trusted state; everything read from the shared region is validated before use.
 */
#ifndef SHM_ENGINE_RING_H
#define SHM_ENGINE_RING_H

#include <stdint.h>

#define RING_HDR_SIZE 512u
#define RING_MIN_CAP 4096u

/* Return codes (negative = error). */
#define RING_OK 0
#define RING_EAGAIN (-11)  /* the wait slice expired (or a signal arrived): poll liveness, retry */
#define RING_ECLOSED (-32) /* the peer closed its end (consumer: only after draining) */
#define RING_ECORRUPT (-74) /* a bounds/format check on shared memory failed; ring is poisoned */
#define RING_EINVAL (-22)  /* bad argument from the local caller */
#define RING_EBROKEN (-71) /* a large message was cut off mid-way: the send side is unusable */

/* Record kinds (low byte) and flags. */
#define RING_K_WRAP 1u
#define RING_K_DATA 2u
#define RING_F_FRAME_END 0x100u /* last record of a frame */
#define RING_F_MSG_END 0x200u   /* last record of a message */
#define RING_F_LARGE 0x400u     /* message was fragmented: consumer must copy it out */

/* Corruption detail codes (ring_corrupt_detail). */
#define RING_C_MAGIC 1
#define RING_C_HEAD 2
#define RING_C_TAIL 3
#define RING_C_RECLEN 4
#define RING_C_KIND 5
#define RING_C_WRAP 6
#define RING_C_PARTIAL 7

#define RING_ROLE_PRODUCER 0
#define RING_ROLE_CONSUMER 1

typedef struct ring_s ring_t;

int ring_region_init(uint8_t *base, uint64_t region_size, uint64_t cap);
ring_t *ring_open(uint8_t *base, uint64_t region_size, int role, int *err);
void ring_free(ring_t *r);
void ring_set_spin(ring_t *r, uint64_t min_ns, uint64_t max_ns);

/* Write flags.  RING_W_FRESH starts a new call (the first attempt of a send); without it the
 * call resumes the cursor the same call left after RING_EAGAIN, and is a no-op when that call
 * already finished or was aborted.  RING_W_SPIN spins briefly before parking on the semaphore. */
#define RING_W_SPIN 1
#define RING_W_FRESH 2
int ring_write(ring_t *r, const char *blob, const char *const *ptrs, const uint64_t *lens,
               const uint32_t *nframes, uint32_t nmsgs, uint64_t slice_ns, int flags);
int ring_write1(ring_t *r, const char *buf, uint64_t len, uint64_t slice_ns, int flags);
uint32_t ring_write_progress(ring_t *r, int *mid_message);
/* Drop the cursor (a write ended early for good); inside a large message this breaks the send
 * side: every later write returns RING_EBROKEN. */
void ring_write_abort(ring_t *r);
int ring_write_broken(ring_t *r);

int ring_read(ring_t *r, uint64_t *out, uint32_t max_entries, uint32_t max_msgs,
              uint64_t slice_ns, int spin);
/* One message.  A single-frame message comes back packed as (offset << 32 | len), always
 * >= 2^32, saving the caller from reading `out`; otherwise the entry count (as ring_read). */
int64_t ring_read1(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t slice_ns, int spin);
/* Everything available (ring_read with no message limit), offsets shifted by view_base (the
 * region's offset in the caller's mapping); RING_BATCH_SIMPLE is or-ed into the count when every
 * message is a single frame, so the caller can take a tight loop. */
#define RING_BATCH_SIMPLE 0x40000000
int ring_read_batch(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t view_base,
                    uint64_t slice_ns, int spin);
void ring_release(ring_t *r);
/* Hand the entries of the last read out again on the next one (rewinds to the last release):
 * for a caller that could not deliver them, e.g. an exception a signal handler raised as the read
 * returned.  Returns the released position, as ring_consumed (UINT64_MAX if poisoned). */
uint64_t ring_unread(ring_t *r);
/* Bytes released so far: moves exactly when a read (or ring_release) gives entries back. */
uint64_t ring_consumed(ring_t *r);

void ring_close(ring_t *r);
int ring_corrupt_detail(ring_t *r);
void ring_stats(ring_t *r, uint64_t *out, uint32_t n);

/* Bare semaphore helpers: the benchmark's reference wake-up (same sem_t kind as the ring's). */
int ring_bench_sem_init(uint8_t *p);
int ring_bench_sem_post(uint8_t *p);
int ring_bench_sem_wait(uint8_t *p, uint64_t timeout_ns);

#endif
