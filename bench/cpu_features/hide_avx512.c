/* Run a program as if its CPU had AVX2 and no AVX-512: LD_PRELOAD this library.
 *
 * Libraries choose their kernels at run time from what the CPUID instruction reports (ONNX Runtime's
 * MLAS, NumPy, oneDNN...). Linux can make CPUID fault in a process (arch_prctl ARCH_SET_CPUID, where
 * the CPU has the "cpuid_fault" flag). This library turns that on when it is loaded and answers every
 * CPUID itself from a SIGSEGV handler: it executes the real instruction, clears the feature bits of
 * AVX-512 and of the VNNI/BF16 extensions an AVX2-only x86-64 (AMD Zen 3, Intel before Ice Lake) does
 * not have, and resumes after the instruction. The setting is per thread and inherited by the threads
 * and processes the program starts (execve resets it; LD_PRELOAD, inherited too, sets it again).
 *
 * Code compiled for AVX-512 ahead of time is unaffected: build such peers without it.
 * SPECTR_CPUID_LOG=1 prints each CPUID leaf answered (to stderr), for checking.
 * SPECTR_KEEP_AVX_VNNI=1 leaves AVX-VNNI (the VEX-encoded int8 dot product) visible: the instruction
 * sets of Intel's client cores since Alder Lake, which have AVX2 and AVX-VNNI and no AVX-512.
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction previous;
static int log_leaves, keep_avx_vnni;

static void clear(unsigned *reg, const int *bits, int n) {
    for (int i = 0; i < n; i++) *reg &= ~(1u << bits[i]);
}

/* leaf 7 subleaf 0: EBX AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31;
 * ECX VBMI 1, VBMI2 6, GFNI 8, VNNI 11, BITALG 12, VPOPCNTDQ 14;
 * EDX 4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX-BF16 22, AVX512_FP16 23, AMX-TILE 24, AMX-INT8 25.
 * leaf 7 subleaf 1: EAX AVX-VNNI 4, AVX512_BF16 5, AVX-IFMA 23; EDX AVX-VNNI-INT8 4, AVX10 19. */
static void mask(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
    if (leaf == 7 && sub == 0) {
        static const int ebx[] = {16, 17, 21, 26, 27, 28, 30, 31};
        static const int ecx[] = {1, 6, 8, 11, 12, 14};
        static const int edx[] = {2, 3, 8, 22, 23, 24, 25};
        clear(b, ebx, 8);
        clear(c, ecx, 6);
        clear(d, edx, 7);
    } else if (leaf == 7 && sub == 1) {
        static const int eax[] = {5, 23, 4};    /* AVX-VNNI last: kept with SPECTR_KEEP_AVX_VNNI=1 */
        static const int edx[] = {4, 19};
        clear(a, eax, keep_avx_vnni ? 2 : 3);
        clear(d, edx, 2);
    }
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *r = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)r[REG_RIP];
    /* a faulting CPUID raises #GP: SIGSEGV with si_code SI_KERNEL at the instruction (0F A2) */
    if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
        sigaction(SIGSEGV, &previous, NULL);   /* not ours: the fault repeats under the old handler */
        return;
    }
    unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __cpuid_count(leaf, sub, a, b, c, d);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    mask(leaf, sub, &a, &b, &c, &d);
    if (log_leaves) {
        char line[96];
        int n = snprintf(line, sizeof line, "cpuid %#x.%u -> %08x %08x %08x %08x\n", leaf, sub, a, b, c, d);
        if (n > 0) (void)!write(2, line, (size_t)n);
    }
    r[REG_RAX] = a;
    r[REG_RBX] = b;
    r[REG_RCX] = c;
    r[REG_RDX] = d;
    r[REG_RIP] += 2;
    (void)sig;
}

__attribute__((constructor)) static void hide_avx512(void) {
    const char *env = getenv("SPECTR_CPUID_LOG");
    log_leaves = env && *env == '1';
    const char *keep = getenv("SPECTR_KEEP_AVX_VNNI");
    keep_avx_vnni = keep && *keep == '1';
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, &previous) != 0 || syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        static const char msg[] = "hide_avx512: this CPU or kernel cannot make CPUID fault (no cpuid_fault); "
                                  "AVX-512 is NOT hidden\n";
        (void)!write(2, msg, sizeof msg - 1);
        _exit(3);
    }
}
