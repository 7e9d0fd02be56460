/* AVX-512 intrinsics on any x86 CPU: SIMDe's portable emulation (Debian: libsimde-dev), plus the
 * few that SIMDe 0.7.4 lacks, lane by lane (fmadd fused, as the hardware's). For
 * the drivers here only. */
#ifndef SIMDE_SHIM_H
#define SIMDE_SHIM_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>
#include <math.h>
#include <stdint.h>
typedef simde__mmask16 __mmask16;
typedef simde__mmask8 __mmask8;
#define LANES_F(v) float v##_[16]; memcpy(v##_, &v, 64)
#define LANES_I(v) int32_t v##_[16]; memcpy(v##_, &v, 64)
static inline __m512 shim_fromf(const float *a) { __m512 r; memcpy(&r, a, 64); return r; }
static inline __m512i shim_fromi(const int32_t *a) { __m512i r; memcpy(&r, a, 64); return r; }
static inline float _mm512_reduce_max_ps(__m512 v) {
    LANES_F(v); float m = v_[0];
    for (int i = 1; i < 16; i++) m = v_[i] > m ? v_[i] : m; /* vmaxps tree: no NaN here */
    return m;
}
static inline int _mm512_reduce_add_epi32(__m512i v) {
    LANES_I(v); int32_t t = 0;
    for (int i = 0; i < 16; i++) t += v_[i];
    return t;
}
static inline __m512i _mm512_maskz_cvtps_epi32(__mmask16 k, __m512 v) {
    LANES_F(v); int32_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (k >> i & 1) ? (int32_t)nearbyintf(v_[i]) : 0;
    return shim_fromi(r);
}
static inline __m128i _mm512_cvtepi32_epi8(__m512i v) {
    LANES_I(v); int8_t r[16];
    for (int i = 0; i < 16; i++) r[i] = (int8_t)v_[i];
    __m128i o; memcpy(&o, r, 16); return o;
}
static inline float shim_h2f(uint16_t h) {
    const uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 0) { f = ldexpf((float)m, -24); return s ? -f : f; }
    if (e == 31) { uint32_t b = s | 0x7f800000u | (m << 13); memcpy(&f, &b, 4); return f; }
    uint32_t b = s | ((e + 112) << 23) | (m << 13); memcpy(&f, &b, 4); return f;
}
static inline __m512 _mm512_cvtph_ps(__m256i v) {
    uint16_t h[16]; memcpy(h, &v, 32); float r[16];
    for (int i = 0; i < 16; i++) r[i] = shim_h2f(h[i]);
    return shim_fromf(r);
}
static inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void *p) {
    float r[16];
    for (int i = 0; i < 16; i++) r[i] = (k >> i & 1) ? ((const float *)p)[i] : 0.f;
    return shim_fromf(r);
}
static inline void _mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 v) {
    LANES_F(v);
    for (int i = 0; i < 16; i++) if (k >> i & 1) ((float *)p)[i] = v_[i];
}
static inline __m512 shim_cvtepi32_ps(__m512i v) {
    LANES_I(v); float r[16];
    for (int i = 0; i < 16; i++) r[i] = (float)v_[i];
    return shim_fromf(r);
}
#ifndef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps shim_cvtepi32_ps
#endif
static inline __m512 shim_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    LANES_F(a); LANES_F(b); LANES_F(c); float r[16];
    for (int i = 0; i < 16; i++) r[i] = fmaf(a_[i], b_[i], c_[i]);
    return shim_fromf(r);
}
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps shim_fmadd_ps
static inline __m512i _mm512_cvtepu8_epi16(__m256i v) {
    uint8_t a[32]; int16_t r[32]; __m512i o;
    memcpy(a, &v, 32);
    for (int i = 0; i < 32; i++) r[i] = a[i];
    memcpy(&o, r, 64);
    return o;
}
#endif
