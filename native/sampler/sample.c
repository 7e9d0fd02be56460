/* Native sampler: temperature, min-p, top-k, top-p and the inverse-CDF draw, one row at a time.
 *
 * The contract is the module docstring of shm_engine/model/sampler.py, whose torch functions
 * filtered_probs + sample_inverse_cdf stay the readable reference (the tests compare against them).
 * Everything here works on unnormalized weights e = exp(x - max), x = logit / temperature: every
 * filter is a threshold on e (or, for top-k, on x), so no row is sorted or normalized in full, and
 * the draw compares a running sum with u * (kept mass) instead of normalizing.
 *
 * The order is vLLM V1's: min-p (an argmax-invariant logits processor there) before top-k and
 * top-p.  Min-p is the threshold e >= min_p (e_max == 1: p >= min_p * p_max) on the tempered
 * distribution; top-k keeps x >= the k-th largest x.  Both keep a set of the largest logits, so
 * applying both at once in pass 3 is min-p then top-k among its survivors (their intersection);
 * top-p then weighs only what they kept, i.e. the distribution renormalised over the survivors.
 *
 * Per row, at most 5 streaming passes over the vocabulary (each vectorised on the AVX2 path):
 *   1. the max of the raw logits (division by T > 0 is monotone: max(x) = max(logits) / T exactly);
 *   2. top-k only: the k-th largest logit, keeping just the values above a rising threshold (see
 *      topk_t), divided by T: exactly the k-th largest x, as torch.topk would give;
 *   3. e = exp(x - max), 0 where x < the k-th largest or e < min_p, written out with per-block
 *      sums: the mass of the min-p / top-k survivors;
 *   4. top-p only: gather the candidates that can matter (the bound of _top_p_row, on the
 *      survivors' mass, so min-p shrinks it too) and find where their descending prefix reaches
 *      top_p by quickselect on the mass (select_desc);
 *   5. top-p only: per-block sums of the kept weights;
 * then the draw walks the block sums and scans a single block.
 *
 * Numerics: exp is a Cephes-style polynomial (< 2e-7 relative) that flushes weights below
 * exp(-87) ~ 1.6e-38 of the row's largest to 0 (such tokens cannot be drawn unless u is within
 * 1e-38 of 1; it also keeps slow subnormal arithmetic out of every later pass).  Sums are in double
 * (SIMD lanes add 4 floats <= 1 first: 2 roundings, below the exp error).  NaN logits are -inf
 * (weight 0, ranked last by top-k); a row without a finite or +inf logit draws token 0 (as argmax
 * would); a row with +inf logits draws uniformly among those.  A row whose finite max overflows
 * when divided by T (|max| / T > FLT_MAX: max / T is +-inf, every weight NaN, or every x +inf)
 * takes e = exp((logit - max) / T) instead (shifted_pass), which cannot overflow.
 *
 * No allocation and no mutable global state: the caller's `work` holds every per-row array, so
 * calls with separate buffers may run concurrently (the cffi wrapper releases the GIL). */
#include "sample.h"

#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <string.h>

#define BLOCK 256      /* elements per CDF block: the draw scans one block, not the row */
#define SMALL 32       /* select_desc insertion-sorts ranges this short */
#define EXP_MIN -87.0f /* below this exp(d) is flushed to 0 (exp(-87) is still a normal float) */
#define TARGET __attribute__((target("avx2,fma")))

/* exp(d) = 2^n * exp(r), n = round(d / ln 2), r = d - n ln 2 with ln 2 split in two (Cody-Waite,
 * Cephes' constants) so n * C1 is exact; exp(r) = 1 + r + r^2 Q(r), Q a cubic fitted for minimal
 * relative error on |r| <= ln 2 / 2: 1.1e-7 in exact arithmetic, 1.9e-7 measured in float (a
 * correctly rounded expf: 6e-8).  Two degrees less than Cephes' expf, whose extra accuracy float
 * cannot show: the exp is most of a row's cost. */
#define LOG2EF 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_Q0 0.499992311000824f
#define EXP_Q1 0.16667114198207855f
#define EXP_Q2 0.041890114545822144f
#define EXP_Q3 0.008312525227665901f
/* 1.5 * 2^23: floats in [2^23, 2^24) are spaced by 1, so adding it rounds to an integer (half to
 * even, no libm call: floorf/rintf are calls without SSE4.1) and leaves n in the low mantissa bits */
#define ROUND_MAGIC 12582912.0f

typedef struct kern_s kern_t;

/* Top-k without sorting or copying the row.  Invariant: `a` holds every value seen so far that is
 * > t, where t only rises and, once finite, is the k-th largest of a set of seen values.  Values <= t
 * then cannot be above the k-th largest of the row, so the scan appends only what beats t (one
 * vector compare per 8 logits); when the buffer passes `cap`, t jumps to the buffer's k-th largest
 * and the buffer shrinks below k.  At the end, the k-th largest is in the buffer if it holds k
 * values, else it is t itself (or -inf, when fewer than k values beat -inf: top-k keeps
 * everything).  O(v) overall.  For k > v / 2 the caller asks for the (v - k + 1)-th largest of the
 * negated logits instead, which keeps the buffer short there too. */
typedef struct {
    const kern_t *K;
    float *a;   /* [v]: appends never outnumber the values seen, so v always suffices */
    float *tmp; /* [v] scratch for the select */
    int64_t n, cap, k;
    float t;
} topk_t;

/* One implementation per dispatch path of every loop that touches O(v) or O(candidates) data. */
struct kern_s {
    float (*max)(const float *l, int64_t v);
    void (*topk_scan)(topk_t *s, const float *l, int64_t v, int neg);
    double (*exp_pass)(const float *l, int64_t v, float t, int scale, float m, float kth,
                       float mp, float *e, double *bsum);
    int64_t (*gather)(const float *e, int64_t v, float c, float *dst);
    double (*block_sums)(const float *e, int64_t v, float thr, double *bsum);
    /* counts of a[i] > p and == p; returns the weight of those > p (count, or mass if by_mass) */
    double (*split)(const float *a, int64_t n, float p, int by_mass, int64_t *ng, int64_t *ne);
    /* keeps, in order and in place, the a[i] > p (gt) or < p (!gt); returns how many */
    int64_t (*keep)(float *a, int64_t n, float p, int gt);
};

typedef struct {
    float *e;     /* [v] weights exp(x - max), 0 where masked */
    float *cand;  /* [v] the top-k buffer, then the top-p candidates */
    double *bsum; /* [ceil(v / BLOCK)] per-block sums of the kept weights */
} ws_t;

static int64_t n_blocks(int64_t v) { return (v + BLOCK - 1) / BLOCK; }

static size_t round64(size_t x) { return (x + 63) & ~(size_t)63; }

size_t shms_work_bytes(int64_t v) {
    if (v < 1) return 0;
    /* + 64: the arrays are aligned to 64 here, whatever the caller's alignment */
    return 64 + 2 * round64((size_t)v * sizeof(float)) + (size_t)n_blocks(v) * sizeof(double);
}

static ws_t ws_layout(void *work, int64_t v) {
    char *p = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    ws_t w;
    w.e = (float *)p;
    p += round64((size_t)v * sizeof(float));
    w.cand = (float *)p;
    p += round64((size_t)v * sizeof(float));
    w.bsum = (double *)p;
    return w;
}

/* ------------------------------------------------------------------------------------ scalar */

/* x, or +0 where mask is 0.  Masks are integers: GCC sinks the arms of a float ?: into branches,
 * which keeps the portable loops from vectorising. */
static inline float and_mask_bits(uint32_t b, uint32_t mask) {
    float x;
    b &= mask;
    memcpy(&x, &b, sizeof x);
    return x;
}

static inline float and_mask(float x, uint32_t mask) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return and_mask_bits(b, mask);
}

/* exp(d) for d <= 0; 0 below EXP_MIN and for NaN.  Branch-free so the portable loops vectorise
 * (SSE2); also the scalar tail of the AVX2 loops (agrees with exp_neg8 up to FMA rounding). */
static inline float exp_neg(float d) {
    uint32_t ok = -(uint32_t)isgreaterequal(d, EXP_MIN); /* quiet compare: NaN gives 0 */
    d = and_mask(d, ok);
    float t = d * LOG2EF + ROUND_MAGIC;
    float n = t - ROUND_MAGIC;
    float r = d - n * EXP_C1;
    r = r - n * EXP_C2;
    float z = r * r;
    float q = (EXP_Q0 + EXP_Q1 * r) + z * (EXP_Q2 + EXP_Q3 * r);
    float y = q * z + r + 1.0f;
    uint32_t tb, yb;
    memcpy(&tb, &t, sizeof tb);
    memcpy(&yb, &y, sizeof yb);
    yb += tb << 23; /* adds n to y's exponent: t's low mantissa bits hold n (mod 2^9) */
    return and_mask_bits(yb, ok);
}

/* The weight of logit l: exp(x - m), 0 where x < kth (top-k) or, if minp, below mp (min-p). */
static inline float weight1(float l, float t, int scale, float m, float kth, int minp, float mp) {
    float x = scale ? l / t : l;
    float w = and_mask(exp_neg(x - m), -(uint32_t)isgreaterequal(x, kth));
    return minp ? and_mask(w, -(uint32_t)(w >= mp)) : w;
}

/* double sum of a[0..n) with 4 accumulators (one would serialise on the add latency) */
static double sum4(const float *a, int64_t n) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i];
        s1 += a[i + 1];
        s2 += a[i + 2];
        s3 += a[i + 3];
    }
    for (; i < n; i++) s0 += a[i];
    return (s0 + s1) + (s2 + s3);
}

static inline float median3(float a, float b, float c) {
    if (a > b) {
        float s = a;
        a = b;
        b = s;
    }
    if (b > c) b = c;
    return a > b ? a : b;
}

static void sift_min(float *a, int64_t n, int64_t i) {
    float x = a[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && a[c + 1] < a[c]) c++;
        if (!(a[c] < x)) break;
        a[i] = a[c];
        i = c;
    }
    a[i] = x;
}

/* A min-heap pops the smallest first, so popping to the back leaves a descending array. */
static void heapsort_desc(float *a, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--) sift_min(a, n, i);
    for (int64_t end = n - 1; end > 0; end--) {
        float s = a[0];
        a[0] = a[end];
        a[end] = s;
        sift_min(a, end, 0);
    }
}

static void insertion_sort_desc(float *a, int64_t n) {
    for (int64_t i = 1; i < n; i++) {
        float x = a[i];
        int64_t j = i;
        for (; j > 0 && a[j - 1] < x; j--) a[j] = a[j - 1];
        a[j] = x;
    }
}

/* The value at the first position, in descending order, where the running weight (1 per element,
 * or the element itself when by_mass) reaches target > 0; the smallest value if rounding keeps it
 * short.  That is the k-th largest (count) or the last value of top-p's prefix (mass); ties fall
 * on one side of every split, so the answer is the same whatever their order.  Only a value is
 * needed, so it is a quickselect where each step is two branch-free streaming passes (weigh the
 * side above the pivot, then compact the side that holds the answer to the front); a depth budget
 * bounds bad pivot luck by heapsorting what is left.  Destroys a[0..n), n >= 1, no NaN. */
static float select_desc(const kern_t *K, float *a, int64_t n, double target, int by_mass) {
    double above = 0.0; /* weight of the values already known to lie above a[0..n) */
    if (!(target > 0.0)) target = DBL_MIN; /* keeps above < target, and a[0..n) non-empty */
    int budget = 8;
    for (int64_t m = n; m > 1; m >>= 1) budget += 2;
    int sorted = 0;
    while (n > SMALL) {
        if (--budget < 0) {
            heapsort_desc(a, n);
            sorted = 1;
            break;
        }
        float p = median3(a[0], a[n / 2], a[n - 1]); /* an element: each step drops one at least */
        int64_t ng, ne;
        double wg = K->split(a, n, p, by_mass, &ng, &ne);
        if (above + wg >= target) { /* above < target, so ng > 0 */
            n = K->keep(a, n, p, 1);
            continue;
        }
        double weq = by_mass ? (double)p * (double)ne : (double)ne;
        if (above + wg + weq >= target) return p;
        above += wg + weq;
        n = K->keep(a, n, p, 0);
        if (n == 0) return p;
    }
    if (!sorted) insertion_sort_desc(a, n);
    for (int64_t i = 0; i < n; i++) {
        above += by_mass ? (double)a[i] : 1.0;
        if (above >= target) return a[i];
    }
    return a[n - 1];
}

/* t := the buffer's k-th largest; keep only the values above it (fewer than k) */
static void tk_compact(topk_t *s) {
    memcpy(s->tmp, s->a, (size_t)s->n * sizeof(float));
    s->t = select_desc(s->K, s->tmp, s->n, (double)s->k, 0);
    s->n = s->K->keep(s->a, s->n, s->t, 1);
}

/* The value top-k ranks for logit l: NaN counts as -inf, negated when neg. */
static inline float rank_value(float l, int neg) {
    if (isnan(l)) return neg ? INFINITY : -INFINITY;
    return neg ? -l : l;
}

static inline void tk_push(topk_t *s, float x) {
    if (x > s->t) {
        s->a[s->n++] = x;
        if (s->n >= s->cap && s->n >= s->k) tk_compact(s);
    }
}

/* The k-th largest value pushed (-inf when fewer than k of them beat -inf). */
static float tk_result(topk_t *s) {
    return s->n >= s->k ? select_desc(s->K, s->a, s->n, (double)s->k, 0) : s->t;
}

/* ------------------------------------------------------------------------- portable kernels */

static float max_portable(const float *l, int64_t v) {
    float m = -INFINITY;
    for (int64_t i = 0; i < v; i++)
        if (l[i] > m) m = l[i];
    return m;
}

static void topk_scan_portable(topk_t *s, const float *l, int64_t v, int neg) {
    for (int64_t i = 0; i < v; i++) tk_push(s, rank_value(l[i], neg));
}

static double exp_pass_portable(const float *l, int64_t v, float t, int scale, float m, float kth,
                                float mp, float *e, double *bsum) {
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v;
        /* constant flags, so each loop is branch-free (and vectorised) */
        if (scale && mp > 0.0f)
            for (int64_t i = b0; i < b1; i++) e[i] = weight1(l[i], t, 1, m, kth, 1, mp);
        else if (scale)
            for (int64_t i = b0; i < b1; i++) e[i] = weight1(l[i], t, 1, m, kth, 0, mp);
        else if (mp > 0.0f)
            for (int64_t i = b0; i < b1; i++) e[i] = weight1(l[i], t, 0, m, kth, 1, mp);
        else
            for (int64_t i = b0; i < b1; i++) e[i] = weight1(l[i], t, 0, m, kth, 0, mp);
        bsum[bi] = sum4(e + b0, b1 - b0);
        total += bsum[bi];
    }
    return total;
}

static int64_t gather_portable(const float *e, int64_t v, float c, float *dst) {
    int64_t n = 0;
    for (int64_t i = 0; i < v; i++) {
        dst[n] = e[i];
        n += e[i] >= c;
    }
    return n;
}

static double block_sums_portable(const float *e, int64_t v, float thr, double *bsum) {
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v;
        double s0 = 0.0, s1 = 0.0;
        int64_t i = b0;
        for (; i + 2 <= b1; i += 2) {
            s0 += e[i] >= thr ? e[i] : 0.0f;
            s1 += e[i + 1] >= thr ? e[i + 1] : 0.0f;
        }
        for (; i < b1; i++) s0 += e[i] >= thr ? e[i] : 0.0f;
        bsum[bi] = s0 + s1;
        total += bsum[bi];
    }
    return total;
}

static double split_portable(const float *a, int64_t n, float p, int by_mass, int64_t *ng,
                             int64_t *ne) {
    int64_t g = 0, q = 0;
    double w = 0.0;
    for (int64_t i = 0; i < n; i++) {
        g += a[i] > p;
        q += a[i] == p;
    }
    if (by_mass)
        for (int64_t i = 0; i < n; i++) w += a[i] > p ? a[i] : 0.0f;
    *ng = g;
    *ne = q;
    return by_mass ? w : (double)g;
}

static int64_t keep_portable(float *a, int64_t n, float p, int gt) {
    int64_t j = 0;
    for (int64_t i = 0; i < n; i++) {
        float x = a[i];
        a[j] = x;
        j += gt ? x > p : x < p;
    }
    return j;
}

/* ----------------------------------------------------------------------------- AVX2 kernels */

/* exp_neg for 8 lanes.  The rounding trick leaves n in the low bits of t, so shifting them into
 * the exponent field and adding scales by 2^n without a multiply (the result is a normal float for
 * d >= EXP_MIN); lanes out of range (d < EXP_MIN, -inf, NaN) compute garbage that the mask zeroes.
 * Q is evaluated as (q0 + q1 r) + r^2 (q2 + q3 r): a shorter chain than Horner, so more
 * iterations overlap. */
TARGET static inline __m256 exp_neg8(__m256 d) {
    const __m256 magic = _mm256_set1_ps(ROUND_MAGIC);
    __m256 ok = _mm256_cmp_ps(d, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ); /* false for NaN too */
    __m256 t = _mm256_fmadd_ps(d, _mm256_set1_ps(LOG2EF), magic);
    __m256 n = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), d);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 z = _mm256_mul_ps(r, r);
    __m256 q01 = _mm256_fmadd_ps(_mm256_set1_ps(EXP_Q1), r, _mm256_set1_ps(EXP_Q0));
    __m256 q23 = _mm256_fmadd_ps(_mm256_set1_ps(EXP_Q3), r, _mm256_set1_ps(EXP_Q2));
    __m256 y = _mm256_fmadd_ps(_mm256_fmadd_ps(q23, z, q01), z, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i yb = _mm256_add_epi32(_mm256_castps_si256(y),
                                  _mm256_slli_epi32(_mm256_castps_si256(t), 23));
    return _mm256_and_ps(_mm256_castsi256_ps(yb), ok);
}

/* adds the 8 floats of w to two double accumulators */
TARGET static inline void acc8(__m256d *a0, __m256d *a1, __m256 w) {
    *a0 = _mm256_add_pd(*a0, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
    *a1 = _mm256_add_pd(*a1, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
}

TARGET static inline double hsum_pd(__m256d a0, __m256d a1) {
    __m256d a = _mm256_add_pd(a0, a1);
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* For each 8-bit mask, the indices of its set bits packed as nibbles (low first): the permutation
 * that moves the selected lanes to the front (AVX2 has no compress instruction). */
static const uint32_t COMPRESS_LUT[256] = {
    0x00000000u, 0x00000000u, 0x00000001u, 0x00000010u, 0x00000002u, 0x00000020u, 0x00000021u, 0x00000210u,
    0x00000003u, 0x00000030u, 0x00000031u, 0x00000310u, 0x00000032u, 0x00000320u, 0x00000321u, 0x00003210u,
    0x00000004u, 0x00000040u, 0x00000041u, 0x00000410u, 0x00000042u, 0x00000420u, 0x00000421u, 0x00004210u,
    0x00000043u, 0x00000430u, 0x00000431u, 0x00004310u, 0x00000432u, 0x00004320u, 0x00004321u, 0x00043210u,
    0x00000005u, 0x00000050u, 0x00000051u, 0x00000510u, 0x00000052u, 0x00000520u, 0x00000521u, 0x00005210u,
    0x00000053u, 0x00000530u, 0x00000531u, 0x00005310u, 0x00000532u, 0x00005320u, 0x00005321u, 0x00053210u,
    0x00000054u, 0x00000540u, 0x00000541u, 0x00005410u, 0x00000542u, 0x00005420u, 0x00005421u, 0x00054210u,
    0x00000543u, 0x00005430u, 0x00005431u, 0x00054310u, 0x00005432u, 0x00054320u, 0x00054321u, 0x00543210u,
    0x00000006u, 0x00000060u, 0x00000061u, 0x00000610u, 0x00000062u, 0x00000620u, 0x00000621u, 0x00006210u,
    0x00000063u, 0x00000630u, 0x00000631u, 0x00006310u, 0x00000632u, 0x00006320u, 0x00006321u, 0x00063210u,
    0x00000064u, 0x00000640u, 0x00000641u, 0x00006410u, 0x00000642u, 0x00006420u, 0x00006421u, 0x00064210u,
    0x00000643u, 0x00006430u, 0x00006431u, 0x00064310u, 0x00006432u, 0x00064320u, 0x00064321u, 0x00643210u,
    0x00000065u, 0x00000650u, 0x00000651u, 0x00006510u, 0x00000652u, 0x00006520u, 0x00006521u, 0x00065210u,
    0x00000653u, 0x00006530u, 0x00006531u, 0x00065310u, 0x00006532u, 0x00065320u, 0x00065321u, 0x00653210u,
    0x00000654u, 0x00006540u, 0x00006541u, 0x00065410u, 0x00006542u, 0x00065420u, 0x00065421u, 0x00654210u,
    0x00006543u, 0x00065430u, 0x00065431u, 0x00654310u, 0x00065432u, 0x00654320u, 0x00654321u, 0x06543210u,
    0x00000007u, 0x00000070u, 0x00000071u, 0x00000710u, 0x00000072u, 0x00000720u, 0x00000721u, 0x00007210u,
    0x00000073u, 0x00000730u, 0x00000731u, 0x00007310u, 0x00000732u, 0x00007320u, 0x00007321u, 0x00073210u,
    0x00000074u, 0x00000740u, 0x00000741u, 0x00007410u, 0x00000742u, 0x00007420u, 0x00007421u, 0x00074210u,
    0x00000743u, 0x00007430u, 0x00007431u, 0x00074310u, 0x00007432u, 0x00074320u, 0x00074321u, 0x00743210u,
    0x00000075u, 0x00000750u, 0x00000751u, 0x00007510u, 0x00000752u, 0x00007520u, 0x00007521u, 0x00075210u,
    0x00000753u, 0x00007530u, 0x00007531u, 0x00075310u, 0x00007532u, 0x00075320u, 0x00075321u, 0x00753210u,
    0x00000754u, 0x00007540u, 0x00007541u, 0x00075410u, 0x00007542u, 0x00075420u, 0x00075421u, 0x00754210u,
    0x00007543u, 0x00075430u, 0x00075431u, 0x00754310u, 0x00075432u, 0x00754320u, 0x00754321u, 0x07543210u,
    0x00000076u, 0x00000760u, 0x00000761u, 0x00007610u, 0x00000762u, 0x00007620u, 0x00007621u, 0x00076210u,
    0x00000763u, 0x00007630u, 0x00007631u, 0x00076310u, 0x00007632u, 0x00076320u, 0x00076321u, 0x00763210u,
    0x00000764u, 0x00007640u, 0x00007641u, 0x00076410u, 0x00007642u, 0x00076420u, 0x00076421u, 0x00764210u,
    0x00007643u, 0x00076430u, 0x00076431u, 0x00764310u, 0x00076432u, 0x00764320u, 0x00764321u, 0x07643210u,
    0x00000765u, 0x00007650u, 0x00007651u, 0x00076510u, 0x00007652u, 0x00076520u, 0x00076521u, 0x00765210u,
    0x00007653u, 0x00076530u, 0x00076531u, 0x00765310u, 0x00076532u, 0x00765320u, 0x00765321u, 0x07653210u,
    0x00007654u, 0x00076540u, 0x00076541u, 0x00765410u, 0x00076542u, 0x00765420u, 0x00765421u, 0x07654210u,
    0x00076543u, 0x00765430u, 0x00765431u, 0x07654310u, 0x00765432u, 0x07654320u, 0x07654321u, 0x76543210u,
};

TARGET static inline __m256i compress_idx(int mask) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)COMPRESS_LUT[mask]), shifts),
                            _mm256_set1_epi32(15));
}

/* Stores the lanes of x selected by mask at dst, packed; returns how many.  Writes all 8 lanes:
 * callers guarantee dst + 8 is in bounds (their dst never runs ahead of their source). */
TARGET static inline int compress_store(float *dst, __m256 x, int mask) {
    _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(x, compress_idx(mask)));
    return __builtin_popcount((unsigned)mask);
}

TARGET static float max_avx2(const float *l, int64_t v) {
    __m256 acc = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    /* maxps returns its second operand when the first is NaN: NaN never enters acc */
    for (; i + 8 <= v; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(l + i), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float m = -INFINITY;
    for (int j = 0; j < 8; j++)
        if (lanes[j] > m) m = lanes[j];
    for (; i < v; i++)
        if (l[i] > m) m = l[i];
    return m;
}

TARGET static void topk_scan_avx2(topk_t *s, const float *l, int64_t v, int neg) {
    const __m256 flip = _mm256_set1_ps(neg ? -0.0f : 0.0f);
    const __m256 nan_rank = _mm256_set1_ps(neg ? INFINITY : -INFINITY);
    __m256 tv = _mm256_set1_ps(s->t);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        __m256 x = _mm256_xor_ps(_mm256_loadu_ps(l + i), flip);
        x = _mm256_blendv_ps(x, nan_rank, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); /* rank_value */
        int gt = _mm256_movemask_ps(_mm256_cmp_ps(x, tv, _CMP_GT_OQ));
        if (!gt) continue;
        s->n += compress_store(s->a + s->n, x, gt); /* s->n <= i: stays inside a[0..v) */
        if (s->n + 8 > s->cap && s->n >= s->k) {
            tk_compact(s);
            tv = _mm256_set1_ps(s->t);
        }
    }
    for (; i < v; i++) tk_push(s, rank_value(l[i], neg));
}

TARGET static inline __m256 weight8(const float *l, __m256 tv, __m256 mv, __m256 kv, __m256 pv,
                                    int scale, int topk, int minp) {
    __m256 x = _mm256_loadu_ps(l);
    if (scale) x = _mm256_div_ps(x, tv); /* a true division, as torch does: the same x */
    __m256 w = exp_neg8(_mm256_sub_ps(x, mv));
    if (topk) w = _mm256_and_ps(w, _mm256_cmp_ps(x, kv, _CMP_GE_OQ));
    if (minp) w = _mm256_and_ps(w, _mm256_cmp_ps(w, pv, _CMP_GE_OQ));
    return w;
}

/* Inlined with constant scale / topk / minp, so each of the 8 variants is a branch-free loop. */
TARGET static inline __attribute__((always_inline)) double
exp_pass_body(const float *l, int64_t v, float t, int scale, float m, float kth, int topk,
              float mp, int minp, float *e, double *bsum) {
    const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m), kv = _mm256_set1_ps(kth);
    const __m256 pv = _mm256_set1_ps(mp);
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v, i = b0;
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
        for (; i + 32 <= b1; i += 32) {
            __m256 w0 = weight8(l + i, tv, mv, kv, pv, scale, topk, minp);
            __m256 w1 = weight8(l + i + 8, tv, mv, kv, pv, scale, topk, minp);
            __m256 w2 = weight8(l + i + 16, tv, mv, kv, pv, scale, topk, minp);
            __m256 w3 = weight8(l + i + 24, tv, mv, kv, pv, scale, topk, minp);
            _mm256_storeu_ps(e + i, w0);
            _mm256_storeu_ps(e + i + 8, w1);
            _mm256_storeu_ps(e + i + 16, w2);
            _mm256_storeu_ps(e + i + 24, w3);
            acc8(&a0, &a1, _mm256_add_ps(_mm256_add_ps(w0, w1), _mm256_add_ps(w2, w3)));
        }
        for (; i + 8 <= b1; i += 8) {
            __m256 w = weight8(l + i, tv, mv, kv, pv, scale, topk, minp);
            _mm256_storeu_ps(e + i, w);
            acc8(&a0, &a1, w);
        }
        double s = hsum_pd(a0, a1);
        for (; i < b1; i++) {
            e[i] = weight1(l[i], t, scale, m, kth, minp, mp);
            s += e[i];
        }
        bsum[bi] = s;
        total += s;
    }
    return total;
}

#define EXP_PASS_BODY(scale, topk, minp) \
    exp_pass_body(l, v, t, scale, m, kth, topk, mp, minp, e, bsum)

TARGET static double exp_pass_avx2(const float *l, int64_t v, float t, int scale, float m,
                                   float kth, float mp, float *e, double *bsum) {
    int topk = kth != -INFINITY; /* x >= -inf holds for every lane that is not NaN (weight 0) */
    int minp = mp > 0.0f;        /* mp == 0 would keep every lane (w >= 0): no compare */
    switch (scale << 2 | topk << 1 | minp) {
    case 0: return EXP_PASS_BODY(0, 0, 0);
    case 1: return EXP_PASS_BODY(0, 0, 1);
    case 2: return EXP_PASS_BODY(0, 1, 0);
    case 3: return EXP_PASS_BODY(0, 1, 1);
    case 4: return EXP_PASS_BODY(1, 0, 0);
    case 5: return EXP_PASS_BODY(1, 0, 1);
    case 6: return EXP_PASS_BODY(1, 1, 0);
    default: return EXP_PASS_BODY(1, 1, 1);
    }
}
#undef EXP_PASS_BODY

TARGET static int64_t gather_avx2(const float *e, int64_t v, float c, float *dst) {
    const __m256 cv = _mm256_set1_ps(c);
    int64_t n = 0, i = 0;
    for (; i + 8 <= v; i += 8) {
        __m256 x = _mm256_loadu_ps(e + i);
        /* no test for an empty mask: a third of them are, at random, and the branch would cost
         * more in mispredictions than the useless store */
        n += compress_store(dst + n, x, _mm256_movemask_ps(_mm256_cmp_ps(x, cv, _CMP_GE_OQ)));
    }
    for (; i < v; i++) {
        dst[n] = e[i];
        n += e[i] >= c;
    }
    return n;
}

TARGET static inline __m256 kept8(const float *e, __m256 tv) {
    __m256 x = _mm256_loadu_ps(e);
    return _mm256_and_ps(x, _mm256_cmp_ps(x, tv, _CMP_GE_OQ));
}

TARGET static double block_sums_avx2(const float *e, int64_t v, float thr, double *bsum) {
    const __m256 tv = _mm256_set1_ps(thr);
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v, i = b0;
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
        for (; i + 32 <= b1; i += 32)
            acc8(&a0, &a1,
                 _mm256_add_ps(_mm256_add_ps(kept8(e + i, tv), kept8(e + i + 8, tv)),
                               _mm256_add_ps(kept8(e + i + 16, tv), kept8(e + i + 24, tv))));
        for (; i + 8 <= b1; i += 8) acc8(&a0, &a1, kept8(e + i, tv));
        double s = hsum_pd(a0, a1);
        for (; i < b1; i++) s += e[i] >= thr ? e[i] : 0.0f;
        bsum[bi] = s;
        total += s;
    }
    return total;
}

TARGET static double split_avx2(const float *a, int64_t n, float p, int by_mass, int64_t *ng,
                                int64_t *ne) {
    const __m256 pv = _mm256_set1_ps(p);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t g = 0, q = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 gt = _mm256_cmp_ps(x, pv, _CMP_GT_OQ);
        g += __builtin_popcount((unsigned)_mm256_movemask_ps(gt));
        q += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, pv, _CMP_EQ_OQ)));
        if (by_mass) acc8(&a0, &a1, _mm256_and_ps(x, gt));
    }
    double w = hsum_pd(a0, a1);
    for (; i < n; i++) {
        g += a[i] > p;
        q += a[i] == p;
        w += a[i] > p ? a[i] : 0.0f;
    }
    *ng = g;
    *ne = q;
    return by_mass ? w : (double)g;
}

TARGET static int64_t keep_avx2(float *a, int64_t n, float p, int gt) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t j = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 c = gt ? _mm256_cmp_ps(x, pv, _CMP_GT_OQ) : _mm256_cmp_ps(x, pv, _CMP_LT_OQ);
        j += compress_store(a + j, x, _mm256_movemask_ps(c)); /* j <= i: x is already loaded */
    }
    for (; i < n; i++) {
        float x = a[i];
        a[j] = x;
        j += gt ? x > p : x < p;
    }
    return j;
}

/* --------------------------------------------------------------------------------- the row */

static const kern_t KERN_PORTABLE = {max_portable,        topk_scan_portable, exp_pass_portable,
                                     gather_portable,     block_sums_portable, split_portable,
                                     keep_portable};
static const kern_t KERN_AVX2 = {max_avx2,        topk_scan_avx2, exp_pass_avx2, gather_avx2,
                                 block_sums_avx2, split_avx2,     keep_avx2};

/* Rows whose max logit is +inf: the +inf logits share the mass (exp(x - max) would be NaN).
 * NOTE: the logit is tested, not x = logit / T, which is +inf for large finite logits too at a
 * small T.  Top-k and min-p keep every +inf logit (the k-th largest is <= +inf; each weighs 1). */
static double inf_pass(const float *l, int64_t v, float *e, double *bsum) {
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v;
        double s = 0.0;
        for (int64_t i = b0; i < b1; i++) {
            e[i] = l[i] == INFINITY ? 1.0f : 0.0f;
            s += e[i];
        }
        bsum[bi] = s;
        total += s;
    }
    return total;
}

/* Rows whose finite max logit ml overflows when divided by T (|ml| / T > FLT_MAX, so m = ml / T
 * is +-inf and exp(x - m) is NaN or every x is +inf): e = exp((l - ml) / T), top-k on the same
 * (l - ml) / T, which is <= 0 (no +inf) and 0 at the max (weight 1), monotone in l like x.
 * Equal to exp(x - m) up to rounding wherever that is defined; values that overflow to -inf
 * weigh 0, as they would have.  Scalar and shared by both paths (such rows need |logits| >
 * 3.4e33 at the smallest T, 1e-5: the common case keeps its vectorised pass untouched). */
static double shifted_pass(const float *l, int64_t v, float t, float ml, float kl, float mp,
                           float *e, double *bsum) {
    const float kd = (kl - ml) / t; /* -inf without top-k: every non-NaN logit passes */
    double total = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v;
        double s = 0.0;
        for (int64_t i = b0; i < b1; i++) {
            float d = (l[i] - ml) / t; /* NaN logits: NaN, weight 0 (both masks below fail) */
            float w = isgreaterequal(d, kd) ? exp_neg(d) : 0.0f;
            e[i] = mp > 0.0f && !(w >= mp) ? 0.0f : w;
            s += e[i];
        }
        bsum[bi] = s;
        total += s;
    }
    return total;
}

/* First kept token where the running sum (vocab order) exceeds target, walking block sums and
 * then one block.  The walk repeats the additions that made the total, in the same order, so a
 * target < total always enters some block; when rounding inside that block still falls short, the
 * walk goes on, and past the end it takes the last kept token, like sample_inverse_cdf.  A token
 * of weight 0 cannot be the first to exceed target: it does not move the sum. */
static int64_t draw(const float *e, int64_t v, float thr, const double *bsum, double target) {
    double cum = 0.0;
    for (int64_t b0 = 0, bi = 0; b0 < v; b0 += BLOCK, bi++) {
        if (!(cum + bsum[bi] > target)) {
            cum += bsum[bi];
            continue;
        }
        int64_t b1 = b0 + BLOCK < v ? b0 + BLOCK : v;
        for (int64_t i = b0; i < b1; i++) {
            if (e[i] >= thr) {
                cum += e[i];
                if (cum > target) return i;
            }
        }
    }
    for (int64_t i = v - 1; i >= 0; i--)
        if (e[i] > 0.0f && e[i] >= thr) return i;
    return 0; /* not reached: the row's max always has weight 1 */
}

static int64_t sample_row(const kern_t *K, const ws_t *w, const float *l, int64_t v, float t,
                          int64_t top_k, float top_p, float min_p, double u, float *probs) {
    float ml = K->max(l, v);
    if (!(ml > -INFINITY)) { /* all -inf / NaN: nothing to draw from */
        if (probs) {
            memset(probs, 0, (size_t)v * sizeof(float));
            probs[0] = 1.0f;
        }
        return 0;
    }
    int scale = t != 1.0f;
    float m = scale ? ml / t : ml;

    float kl = -INFINITY, kth = -INFINITY;
    if (top_k > 0 && top_k < v) {
        int neg = top_k > v / 2;
        int64_t k = neg ? v - top_k + 1 : top_k;
        /* compacting at 4k keeps t close behind the running k-th largest, so few values are
         * appended, and each compaction short (measured best among 2k..8k and floors of 64..1024) */
        int64_t cap = 4 * k > 64 ? 4 * k : 64;
        topk_t s = {K, w->cand, w->e, 0, cap < v ? cap : v, k, -INFINITY};
        K->topk_scan(&s, l, v, neg);
        kl = tk_result(&s);
        if (neg) kl = -kl;
        kth = scale ? kl / t : kl; /* division is monotone: the k-th largest x itself */
    }

    /* min-p and top-k zero their tokens' weights here (+inf rows: the e == 1 tokens pass any min_p
     * <= 1, the others already weigh 0), so total is the mass of their survivors */
    double total;
    if (ml == INFINITY)
        total = inf_pass(l, v, w->e, w->bsum);
    else if (m == INFINITY || m == -INFINITY) /* finite ml, but ml / T overflows */
        total = shifted_pass(l, v, t, ml, kl, min_p, w->e, w->bsum);
    else
        total = K->exp_pass(l, v, t, scale, m, kth, min_p, w->e, w->bsum);

    /* top-p is "keep e >= thr"; the row's max has e == 1 and is always kept */
    float thr = 0.0f;
    if (top_p < 1.0f) {
        /* Tokens below (1 - top_p) / v of the mass weigh < 1 - top_p together, so the prefix that
         * reaches top_p lies among the others (_top_p_row); the bound is shaved by 1e-3 so that
         * rounding cannot make it cut into that prefix.  It is > 0: tokens min-p or top-k
         * dropped (weight 0) are never candidates. */
        float c = (float)((1.0 - (double)top_p) / (double)v * total * (1.0 - 1e-3));
        int64_t nc = K->gather(w->e, v, c, w->cand);
        thr = select_desc(K, w->cand, nc, (double)top_p * total, 1);
        total = K->block_sums(w->e, v, thr, w->bsum);
    }

    int64_t tok = draw(w->e, v, thr, w->bsum, u * total);
    if (probs)
        for (int64_t i = 0; i < v; i++)
            probs[i] = w->e[i] >= thr ? (float)((double)w->e[i] / total) : 0.0f;
    return tok;
}

int shms_best_path(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

int shms_sample_rows(const float *logits, int64_t stride, int64_t v, int64_t n,
                     const int64_t *rows, const float *temperature, const int64_t *top_k,
                     const float *top_p, const float *min_p, const double *u, int64_t *out,
                     float *probs, void *work, int path) {
    if (!logits || !temperature || !top_k || !top_p || !min_p || !u || !out || !work || v < 1 ||
        n < 0 || stride < 0)
        return -1;
    for (int64_t j = 0; j < n; j++) { /* check every row before writing anything */
        if (!(temperature[j] >= 0.0f && temperature[j] <= 3.4e38f) || top_k[j] < -1 ||
            !(top_p[j] > 0.0f && top_p[j] <= 1.0f) || !(min_p[j] >= 0.0f && min_p[j] <= 1.0f) ||
            !(u[j] >= 0.0 && u[j] < 1.0) || (rows && rows[j] < 0))
            return -1;
    }
    const kern_t *K;
    if (path == 0)
        K = &KERN_PORTABLE;
    else if (path == 1)
        K = &KERN_AVX2;
    else
        return -1;
    if (path > shms_best_path()) return -2;
    ws_t w = ws_layout(work, v);
    for (int64_t j = 0; j < n; j++) {
        const float *l = logits + (rows ? rows[j] : j) * stride;
        float t = temperature[j] > 1e-5f ? temperature[j] : 1e-5f; /* filtered_probs' clamp */
        int64_t k = top_k[j] > 0 && top_k[j] < v ? top_k[j] : 0;
        out[j] = sample_row(K, &w, l, v, t, k, top_p[j], min_p[j], u[j],
                            probs ? probs + j * v : NULL);
    }
    return 0;
}

/* One word (32 tokens) a step: a word of all-allowed tokens (most of them inside a JSON string)
 * costs a compare; otherwise each token's logit is kept or replaced without a branch (a mask
 * from a tokenizer's trie mixes allowed and refused tokens unpredictably), 8 at a time on AVX2. */
static void mask_row_portable(float *x, const uint32_t *m, int64_t v) {
    const uint32_t neg_inf = 0xFF800000u; /* -inf's bits */
    for (int64_t w = 0; w * 32 < v; w++) {
        uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        int64_t base = w * 32, lim = v - base < 32 ? v - base : 32;
        for (int64_t b = 0; b < lim; b++) {
            /* select on the float's bits with an all-ones / all-zeros word: no branch */
            uint32_t keep = 0u - ((bits >> b) & 1u), xb;
            memcpy(&xb, x + base + b, 4);
            xb = (xb & keep) | (neg_inf & ~keep);
            memcpy(x + base + b, &xb, 4);
        }
    }
}

TARGET static void mask_row_avx2(float *x, const uint32_t *m, int64_t v) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    int64_t full = v / 32;
    for (int64_t w = 0; w < full; w++) {
        uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        for (int q = 0; q < 4; q++) {
            /* lane i of the byte's 8 tokens: allowed iff its bit is set */
            __m256i byte = _mm256_set1_epi32((int)((bits >> (8 * q)) & 0xFFu));
            __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
            float *p = x + w * 32 + 8 * q;
            _mm256_storeu_ps(p, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(p), _mm256_castsi256_ps(on)));
        }
    }
    if (full * 32 < v) mask_row_portable(x + full * 32, m + full, v - full * 32);
}

/* First index of the row's largest value, NaN as -inf (0 if none is above -inf): what
 * argmax_rows gives, read while the masked row is still in L1/L2. */
static int64_t argmax_portable(const float *x, int64_t v) {
    int64_t best_i = 0;
    float best = -INFINITY;
    for (int64_t i = 0; i < v; i++)
        if (x[i] > best) best = x[i], best_i = i; /* NaN compares false */
    return best_i;
}

TARGET static int64_t argmax_avx2(const float *x, int64_t v) {
    /* per lane: the largest value and the first index holding it; then the lanes' largest,
     * and the smallest index among the lanes that hold it */
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_i = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        __m256 gt = _mm256_cmp_ps(xv, best, _CMP_GT_OQ); /* false for NaN */
        best = _mm256_blendv_ps(best, xv, gt);
        best_i = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(best_i), _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, step);
    }
    float bv[8];
    int32_t bi[8];
    _mm256_storeu_ps(bv, best);
    _mm256_storeu_si256((__m256i *)bi, best_i);
    float top = -INFINITY;
    int64_t top_i = 0;
    for (int l = 0; l < 8; l++)
        if (bv[l] > top || (bv[l] == top && bv[l] > -INFINITY && bi[l] < top_i))
            top = bv[l], top_i = bi[l];
    for (; i < v; i++)
        if (x[i] > top) top = x[i], top_i = i;
    return top_i;
}

int shms_mask_rows(float *logits, int64_t stride, int64_t v, int64_t n, const int64_t *rows,
                   const uint32_t *masks, int64_t words, int64_t *argmax, int path) {
    if (!logits || !rows || !masks || v < 1 || n < 0 || words < (v + 31) / 32 || stride < v ||
        path < 0 || path > 1)
        return -1;
    if (path > shms_best_path()) return -2;
    for (int64_t j = 0; j < n; j++)
        if (rows[j] < 0) return -1;
    for (int64_t j = 0; j < n; j++) {
        float *x = logits + rows[j] * stride;
        if (path == 1)
            mask_row_avx2(x, masks + j * words, v);
        else
            mask_row_portable(x, masks + j * words, v);
        if (argmax) argmax[j] = path == 1 ? argmax_avx2(x, v) : argmax_portable(x, v);
    }
    return 0;
}
