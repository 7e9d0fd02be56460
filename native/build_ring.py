"""cffi API-mode build of the shared-memory ring (shm_engine._ring_cffi).

API mode (not ABI mode) so the C compiler checks the declarations and calls release the GIL.
No -march flags: the module must run on any x86-64.
"""

import pathlib

import cffi

HERE = pathlib.Path(__file__).resolve().parent

CDEF = """
#define RING_HDR_SIZE ...
#define RING_MIN_CAP ...
#define RING_OK ...
#define RING_EAGAIN ...
#define RING_ECLOSED ...
#define RING_ECORRUPT ...
#define RING_EINVAL ...
#define RING_EBROKEN ...
#define RING_W_SPIN ...
#define RING_W_FRESH ...
#define RING_K_WRAP ...
#define RING_K_DATA ...
#define RING_F_FRAME_END ...
#define RING_F_MSG_END ...
#define RING_F_LARGE ...
#define RING_ROLE_PRODUCER ...
#define RING_ROLE_CONSUMER ...

typedef struct ring_s ring_t;

int ring_region_init(uint8_t *base, uint64_t region_size, uint64_t cap);
ring_t *ring_open(uint8_t *base, uint64_t region_size, int role, int *err);
void ring_free(ring_t *r);
void ring_set_spin(ring_t *r, uint64_t min_ns, uint64_t max_ns);
int ring_write(ring_t *r, const char *blob, const char *const *ptrs, const uint64_t *lens,
               const uint32_t *nframes, uint32_t nmsgs, uint64_t slice_ns, int flags);
int ring_write1(ring_t *r, const char *buf, uint64_t len, uint64_t slice_ns, int flags);
uint32_t ring_write_progress(ring_t *r, int *mid_message);
void ring_write_abort(ring_t *r);
int ring_write_broken(ring_t *r);
int ring_read(ring_t *r, uint64_t *out, uint32_t max_entries, uint32_t max_msgs,
              uint64_t slice_ns, int spin);
int64_t ring_read1(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t slice_ns, int spin);
#define RING_BATCH_SIMPLE ...
int ring_read_batch(ring_t *r, uint64_t *out, uint32_t max_entries, uint64_t view_base,
                    uint64_t slice_ns, int spin);
void ring_release(ring_t *r);
uint64_t ring_unread(ring_t *r);
uint64_t ring_consumed(ring_t *r);
void ring_close(ring_t *r);
int ring_corrupt_detail(ring_t *r);
void ring_stats(ring_t *r, uint64_t *out, uint32_t n);
int ring_bench_sem_init(uint8_t *p);
int ring_bench_sem_post(uint8_t *p);
int ring_bench_sem_wait(uint8_t *p, uint64_t timeout_ns);
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "shm_engine._ring_cffi",
    '#include "ring.h"',
    # NOTE: setuptools wants paths relative to setup.py (the build runs from the repo root).
    sources=["native/ring.c"],
    include_dirs=["native"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
