/* Which ISA level this CPU and OS can run, probed once. Compiled WITHOUT arch flags: it must load and answer on
 * any x86-64 (and on other architectures, where it answers 0). A level needs both the CPU's feature bits
 * (cpuid) and the OS's consent to save the registers (xgetbv's XCR0); AMX tiles additionally need the
 * arch_prctl(ARCH_REQ_XCOMP_PERM) grant, which a VM may refuse although cpuid lists AMX. */
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* bit 0 avx2 level usable, bit 1 avx512 level usable, bit 2 AMX listed by cpuid, bit 3 AMX (with its int8
 * products) granted by the OS */
int kvq_cpu_features(void) {
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return 0;
    const uint64_t x = xcr0();
    if ((x & 6) != 6) return 0; /* the OS saves neither SSE nor AVX state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
              avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1, amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    int out = 0;
    if (avx2 && fma && f16c) out |= 1;
    if ((out & 1) && avx512f && avx512dq && avx512bw && avx512vl && vnni && (x & 0xe0) == 0xe0) out |= 2;
    if (amx_tile) {
        out |= 4;
        /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18; an error (EINVAL, EPERM...) just means no */
        /* (the kernels use the tiles' int8 products: a CPU with tiles but without them counts as not granted) */
        if (amx_int8 && syscall(SYS_arch_prctl, 0x1023, 18) == 0 && (xcr0() & (3u << 17)) == (3u << 17)) out |= 8;
    }
    return out;
}
#else
int kvq_cpu_features(void) { return 0; }
#endif
