/* A stand-in libcuda.so.1 for CPU-only test machines: the CUDA driver calls the CUDA backend
 * makes, implemented on host memory, so that gpu_check's whole two-process path (allocate,
 * export a POSIX fd, pass it, import, map, kernels, copies, timing, unmap) runs where no GPU
 * is. "Device memory" is a memfd; a device address is a host address in a range reserved
 * with mmap(PROT_NONE) and mapped MAP_SHARED over the memfd, so an importer really sees the
 * exporter's bytes. The two PTX kernels (fill_u32, verify_u32) run on the CPU, reading their
 * parameters exactly as the PTX declares them (u64, u64, u32[, u64]).
 *
 * It is a test double, not a model of a GPU: no dma-buf, one device. Fabric handles only with
 * FAKE_CUDA_FABRIC=1 (else cuMemCreate refuses them, as a driver without an IMEX channel
 * does): the 64 bytes name the exporter's pid and descriptor, and an importer opens
 * /proc/PID/fd/N — the same host and uid only, unlike a real fabric handle.
 * Built by tests/fake_cuda.rs with `cc -shared -fPIC`. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101, INVALID_HANDLE = 400,
    NOT_FOUND = 500, NOT_SUPPORTED = 801
};
enum { HANDLE_POSIX_FD = 1, HANDLE_FABRIC = 8 };
#define GRANULARITY (2u << 20)

typedef struct { int type; unsigned int handle_types; int loc_type; int loc_id; void *win32; unsigned char flags[8]; } Prop;
typedef struct { int fd; size_t size; } Alloc;

static int ctx_token, stream_token;

CUresult cuInit(unsigned int flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal != 0) return INVALID_DEVICE; *d = 0; return OK; }

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)d;
    switch (attr) {
    case 75: *v = 9; break;   /* compute capability major */
    case 76: *v = 0; break;   /* minor */
    case 102: *v = 1; break;  /* virtual memory management */
    case 103: *v = 1; break;  /* POSIX fd handles */
    case 128: *v = 1; break;  /* fabric handles: claimed, then refused by cuMemCreate */
    default: *v = 0;
    }
    return OK;
}

CUresult cuDeviceCanAccessPeer(int *v, CUdevice a, CUdevice b) { (void)a; (void)b; *v = 0; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) { (void)d; *ctx = &ctx_token; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &ctx_token ? OK : INVALID_HANDLE; }
CUresult cuCtxSynchronize(void) { return OK; }
/* The device's UUID: FAKE_CUDA_UUID (32 hex digits) when set, so that a test can make this
 * "GPU" one a sim daemon knows; else all zero. */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) {
    static const unsigned char id[16] = {0};
    if (d != 0) return INVALID_DEVICE;
    const char *env = getenv("FAKE_CUDA_UUID");
    if (env && strlen(env) == 32) {
        for (int i = 0; i < 16; i++) {
            unsigned v;
            if (sscanf(env + 2 * i, "%2x", &v) != 1) return INVALID_VALUE;
            uuid[i] = (unsigned char)v;
        }
    } else {
        memcpy(uuid, id, 16);
    }
    return OK;
}
/* What fabricd's CUDA discovery asks of a device: name, PCI address, memory. */
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (d != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake CUDA device");
    return OK;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
    if (d != 0) return INVALID_DEVICE;
    snprintf(bus, (size_t)len, "0000:00:00.0");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (d != 0) return INVALID_DEVICE;
    *bytes = (size_t)16 << 30;
    return OK;
}
CUresult cuCtxEnablePeerAccess(void *p, unsigned int f) { (void)p; (void)f; return NOT_SUPPORTED; }
CUresult cuCtxDisablePeerAccess(void *p) { (void)p; return NOT_SUPPORTED; }

CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int option) {
    (void)p;
    *g = option == 1 ? 2 * GRANULARITY : GRANULARITY;
    return OK;
}

static int fabric_enabled(void) {
    const char *env = getenv("FAKE_CUDA_FABRIC");
    return env && !strcmp(env, "1");
}

/* The stand-in fabric handle: magic, exporter pid, descriptor, size; the rest zero. */
typedef struct { char magic[8]; uint32_t pid; int32_t fd; uint64_t size; unsigned char pad[40]; } FakeFabric;
static const char FABRIC_MAGIC[8] = "fakefab1";

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const Prop *p, unsigned long long flags) {
    (void)flags;
    if ((p->handle_types & HANDLE_FABRIC) && !fabric_enabled()) return NOT_SUPPORTED;
    if (size == 0 || size % GRANULARITY) return INVALID_VALUE;
    int fd = memfd_create("fake-hbm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return OUT_OF_MEMORY;
    Alloc *a = malloc(sizeof *a);
    a->fd = fd;
    a->size = size;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)a;
    return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    Alloc *a = (Alloc *)(uintptr_t)h;
    if (!a) return INVALID_HANDLE;
    close(a->fd);
    free(a);
    return OK;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long f) {
    (void)f;
    Alloc *a = (Alloc *)(uintptr_t)h;
    if (type == HANDLE_FABRIC && fabric_enabled()) {
        FakeFabric ff;
        memset(&ff, 0, sizeof ff);
        memcpy(ff.magic, FABRIC_MAGIC, 8);
        ff.pid = (uint32_t)getpid();
        ff.fd = a->fd;
        ff.size = a->size;
        memcpy(out, &ff, sizeof ff);
        return OK;
    }
    if (type != HANDLE_POSIX_FD) return NOT_SUPPORTED;
    int fd = dup(a->fd);
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)out = fd;
    return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
    if (type == HANDLE_FABRIC && fabric_enabled()) {
        FakeFabric ff;
        memcpy(&ff, os, sizeof ff);
        if (memcmp(ff.magic, FABRIC_MAGIC, 8)) return INVALID_HANDLE;
        char path[64];
        snprintf(path, sizeof path, "/proc/%u/fd/%d", ff.pid, ff.fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0) return INVALID_HANDLE;
        Alloc *a = malloc(sizeof *a);
        a->fd = fd;
        a->size = (size_t)ff.size;
        *h = (CUmemGenericAllocationHandle)(uintptr_t)a;
        return OK;
    }
    if (type != HANDLE_POSIX_FD) return NOT_SUPPORTED;
    struct stat st;
    int fd = (int)(intptr_t)os;
    if (fstat(fd, &st) != 0) return INVALID_HANDLE;
    Alloc *a = malloc(sizeof *a);
    a->fd = dup(fd);
    a->size = (size_t)st.st_size;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)a;
    return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
    (void)align; (void)addr; (void)f;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    *va = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr va, size_t size) { return munmap((void *)(uintptr_t)va, size) ? INVALID_VALUE : OK; }

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) {
    (void)f;
    Alloc *a = (Alloc *)(uintptr_t)h;
    if (off + size > a->size) return INVALID_VALUE;
    /* Mapped without access until cuMemSetAccess, as on a GPU. */
    void *p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)off);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    void *p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void *desc, size_t count) {
    if (!desc || count == 0) return INVALID_VALUE;
    return mprotect((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE) ? INVALID_VALUE : OK;
}

CUresult cuMemGetHandleForAddressRange(void *h, CUdeviceptr va, size_t s, int t, unsigned long long f) {
    (void)h; (void)va; (void)s; (void)t; (void)f;
    return NOT_SUPPORTED;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int f) { (void)f; return p && n ? OK : INVALID_VALUE; }
CUresult cuMemHostUnregister(void *p) { return p ? OK : INVALID_VALUE; }

CUresult cuStreamCreate(void **s, unsigned int f) { (void)f; *s = &stream_token; return OK; }
CUresult cuStreamDestroy_v2(void *s) { return s == &stream_token ? OK : INVALID_HANDLE; }
CUresult cuStreamSynchronize(void *s) { (void)s; return OK; }

typedef struct { double t; int recorded; } Event;
CUresult cuEventCreate(void **e, unsigned int f) { (void)f; *e = calloc(1, sizeof(Event)); return OK; }
CUresult cuEventDestroy_v2(void *e) { free(e); return OK; }
CUresult cuEventRecord(void *e, void *s) {
    (void)s;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ((Event *)e)->t = ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
    ((Event *)e)->recorded = 1;
    return OK;
}
CUresult cuEventSynchronize(void *e) { return ((Event *)e)->recorded ? OK : INVALID_HANDLE; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
    if (!((Event *)a)->recorded || !((Event *)b)->recorded) return INVALID_HANDLE;
    *ms = (float)(((Event *)b)->t - ((Event *)a)->t);
    if (*ms <= 0) *ms = 1e-3f;
    return OK;
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return OK; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { (void)st; return cuMemcpyDtoD_v2(d, s, n); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { memcpy(d, (void *)(uintptr_t)s, n); return OK; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return OK; }

static int module_token;
enum { FILL = 1, VERIFY = 2 };
CUresult cuModuleLoadData(void **m, const void *image) {
    const char *ptx = image;
    if (!strstr(ptx, ".entry fill_u32(") || !strstr(ptx, ".entry verify_u32(")) return INVALID_VALUE;
    *m = &module_token;
    return OK;
}
CUresult cuModuleUnload(void *m) { return m == &module_token ? OK : INVALID_HANDLE; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    if (m != &module_token) return INVALID_HANDLE;
    if (!strcmp(name, "fill_u32")) *f = (void *)(uintptr_t)FILL;
    else if (!strcmp(name, "verify_u32")) *f = (void *)(uintptr_t)VERIFY;
    else return NOT_FOUND;
    return OK;
}

static uint32_t pattern(uint64_t i, uint32_t seed) { return (uint32_t)i * 0x9E3779B1u ^ seed; }

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
    uint32_t *buf = (uint32_t *)(uintptr_t)*(uint64_t *)params[0];
    uint64_t words = *(uint64_t *)params[1];
    uint32_t seed = *(uint32_t *)params[2];
    if ((uintptr_t)f == FILL) {
        for (uint64_t i = 0; i < words; i++) buf[i] = pattern(i, seed);
        return OK;
    }
    if ((uintptr_t)f == VERIFY) {
        uint32_t *errors = (uint32_t *)(uintptr_t)*(uint64_t *)params[3];
        for (uint64_t i = 0; i < words; i++) *errors += buf[i] != pattern(i, seed);
        return OK;
    }
    return INVALID_HANDLE;
}
