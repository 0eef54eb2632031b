/* A stand-in libcuda.so.1 for CPU-only test machines: the CUDA driver calls the CUDA backend
 * makes, implemented on host memory, so that gpu_check's whole two-process path (allocate,
 * export a POSIX fd, pass it, import, map, kernels, copies, timing, unmap) runs where no GPU
 * is. "Device memory" is a memfd; a device address is a host address in a range reserved
 * with mmap(PROT_NONE) and mapped MAP_SHARED over the memfd, so an importer really sees the
 * exporter's bytes. The two PTX kernels (fill_u32, verify_u32) run on the CPU, reading their
 * parameters exactly as the PTX declares them (u64, u64, u32[, u64]).
 *
 * Devices: one, or FAKE_CUDA_DEVICES=N (1..8). Between distinct devices cuDeviceCanAccessPeer
 * answers 1; cuCtxEnablePeerAccess/cuCtxDisablePeerAccess keep a per-pair state and answer
 * as the driver documents (UNSUPPORTED, ALREADY_ENABLED, NOT_ENABLED, INVALID_CONTEXT,
 * INVALID_VALUE for flags). VMM access is per mapping, as on a GPU: cuMemSetAccess records
 * which devices each mapped range grants (by CUmemAccessDesc location.id) and a copy or
 * kernel of the current context's device touching a range not granted to it fails
 * (copies: INVALID_VALUE; kernels: ILLEGAL_ADDRESS, where a GPU would fault) — peer access
 * of the context does not open VMM mappings, as it does not on a GPU.
 *
 * It is a test double, not a model of a GPU: no dma-buf. Fabric handles only with
 * FAKE_CUDA_FABRIC=1 (else cuMemCreate refuses them, as a driver without an IMEX channel
 * does): the 64 bytes name the exporter's pid and descriptor, and an importer opens
 * /proc/PID/fd/N — the same host and uid only, unlike a real fabric handle.
 * Built by tests/fake_cuda.rs with `cc -shared -fPIC`. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
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
    OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101, INVALID_CONTEXT = 201,
    PEER_ACCESS_UNSUPPORTED = 217, INVALID_HANDLE = 400, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700,
    PEER_ACCESS_ALREADY_ENABLED = 704, PEER_ACCESS_NOT_ENABLED = 705, NOT_SUPPORTED = 801
};
enum { LOCATION_DEVICE = 1, PROT_NONE_ = 0, PROT_READ_ = 1, PROT_READWRITE_ = 3 };
#define MAX_DEVICES 8
#define MAX_MAPPINGS 256
enum { HANDLE_POSIX_FD = 1, HANDLE_FABRIC = 8 };
#define GRANULARITY (2u << 20)

typedef struct { int type; unsigned int handle_types; int loc_type; int loc_id; void *win32; unsigned char flags[8]; } Prop;
typedef struct { int fd; size_t size; int dev; } Alloc;
/* CUmemAccessDesc (CUDA 12.x): a CUmemLocation (type, id) and the protection flags. */
typedef struct { int loc_type; int loc_id; int flags; } AccessDesc;
/* A mapped range: which allocation's device it belongs to, which devices it grants. */
typedef struct { uintptr_t va; size_t size; int owner; unsigned access; int used; } Mapping;

static int ctx_token[MAX_DEVICES], stream_token;
static __thread int current = -1; /* the calling thread's current context's device */
static int peer_enabled[MAX_DEVICES][MAX_DEVICES]; /* [from][to]: cuCtxEnablePeerAccess done */
static Mapping mappings[MAX_MAPPINGS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int devices(void) {
    const char *env = getenv("FAKE_CUDA_DEVICES");
    int n = env ? atoi(env) : 1;
    return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}
static int valid(CUdevice d) { return d >= 0 && d < devices(); }
static int ctx_device(void *ctx) {
    for (int d = 0; d < devices(); d++)
        if (ctx == &ctx_token[d]) return d;
    return -1;
}

/* Whether the current device may touch [p, p+n): inside one mapped range that grants it. */
static int accessible(uintptr_t p, size_t n) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS && !ok; i++) {
        Mapping *m = &mappings[i];
        ok = m->used && p >= m->va && p + n <= m->va + m->size && current >= 0 && (m->access >> current & 1);
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

CUresult cuInit(unsigned int flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = devices(); return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (!valid(ordinal)) return INVALID_DEVICE; *d = ordinal; return OK; }

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    if (!valid(d)) return INVALID_DEVICE;
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

/* Every pair of distinct devices is peer capable; a device is not its own peer (the real
 * driver answers 0 for dev == peerDev). */
CUresult cuDeviceCanAccessPeer(int *v, CUdevice a, CUdevice b) {
    if (!valid(a) || !valid(b)) return INVALID_DEVICE;
    *v = a != b;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    if (!valid(d)) return INVALID_DEVICE;
    *ctx = &ctx_token[d];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return valid(d) ? OK : INVALID_DEVICE; }
CUresult cuCtxSetCurrent(void *ctx) {
    int d = ctx_device(ctx);
    if (d < 0) return INVALID_CONTEXT;
    current = d;
    return OK;
}
CUresult cuCtxSynchronize(void) { return current < 0 ? INVALID_CONTEXT : OK; }
/* The device's UUID: FAKE_CUDA_UUID (32 hex digits) when set, so that a test can make this
 * "GPU" one a sim daemon knows; else all zero. */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) {
    static const unsigned char id[16] = {0};
    if (!valid(d)) return INVALID_DEVICE;
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
    uuid[15] ^= (unsigned char)d; /* device 0 keeps the UUID asked for; the others differ */
    return OK;
}
/* What fabricd's CUDA discovery asks of a device: name, PCI address, memory. */
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (!valid(d)) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake CUDA device");
    return OK;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid_v2(uuid, d); }
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
    if (!valid(d)) return INVALID_DEVICE;
    snprintf(bus, (size_t)len, "0000:%02x:00.0", d);
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (!valid(d)) return INVALID_DEVICE;
    *bytes = (size_t)16 << 30;
    return OK;
}
/* As the driver API documents them: access is one way, from the current context to peer. */
CUresult cuCtxEnablePeerAccess(void *p, unsigned int f) {
    int to = ctx_device(p);
    if (current < 0 || to < 0 || to == current) return INVALID_CONTEXT;
    if (f != 0) return INVALID_VALUE;
    int can = 0;
    cuDeviceCanAccessPeer(&can, current, to);
    if (!can) return PEER_ACCESS_UNSUPPORTED;
    if (peer_enabled[current][to]) return PEER_ACCESS_ALREADY_ENABLED;
    peer_enabled[current][to] = 1;
    return OK;
}
CUresult cuCtxDisablePeerAccess(void *p) {
    int to = ctx_device(p);
    if (current < 0 || to < 0) return INVALID_CONTEXT;
    if (!peer_enabled[current][to]) return PEER_ACCESS_NOT_ENABLED;
    peer_enabled[current][to] = 0;
    return OK;
}

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
    if (p->loc_type != LOCATION_DEVICE || !valid(p->loc_id)) return INVALID_DEVICE;
    int fd = memfd_create("fake-hbm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return OUT_OF_MEMORY;
    Alloc *a = malloc(sizeof *a);
    a->fd = fd;
    a->size = size;
    a->dev = p->loc_id;
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
        a->dev = current < 0 ? 0 : current;
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
    a->dev = current < 0 ? 0 : current;
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
    if (p == MAP_FAILED) return INVALID_VALUE;
    CUresult r = OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (!mappings[i].used) {
            mappings[i] = (Mapping){ .va = (uintptr_t)va, .size = size, .owner = a->dev, .access = 0, .used = 1 };
            r = OK;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (mappings[i].used && mappings[i].va == (uintptr_t)va) mappings[i].used = 0;
    pthread_mutex_unlock(&lock);
    void *p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? INVALID_VALUE : OK;
}

/* The range must be one whole mapping; each descriptor sets (or, with PROT_NONE, takes
 * away) one device's access and leaves the others as they were. A location that is no
 * device is INVALID_DEVICE; a device that cannot reach the owner's memory, NOT_SUPPORTED. */
CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void *desc, size_t count) {
    if (!desc || count == 0) return INVALID_VALUE;
    const AccessDesc *d = desc;
    Mapping *m = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_MAPPINGS && !m; i++)
        if (mappings[i].used && mappings[i].va == (uintptr_t)va && mappings[i].size == size) m = &mappings[i];
    CUresult r = m ? OK : INVALID_VALUE;
    unsigned access = m ? m->access : 0;
    for (size_t i = 0; i < count && r == OK; i++) {
        int can = 0;
        if (d[i].loc_type != LOCATION_DEVICE || !valid(d[i].loc_id)) r = INVALID_DEVICE;
        else if (d[i].flags != PROT_NONE_ && d[i].flags != PROT_READ_ && d[i].flags != PROT_READWRITE_) r = INVALID_VALUE;
        else if (d[i].loc_id != m->owner && (cuDeviceCanAccessPeer(&can, d[i].loc_id, m->owner), !can)) r = NOT_SUPPORTED;
        else if (d[i].flags == PROT_NONE_) access &= ~(1u << d[i].loc_id);
        else access |= 1u << d[i].loc_id;
    }
    if (r == OK) {
        m->access = access;
        r = mprotect((void *)(uintptr_t)va, size, access ? PROT_READ | PROT_WRITE : PROT_NONE) ? INVALID_VALUE : OK;
    }
    pthread_mutex_unlock(&lock);
    return r;
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

/* Copies run on the current context's device: every device range must be granted to it. */
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (current < 0) return INVALID_CONTEXT;
    if (!accessible(d, n) || !accessible(s, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return OK;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { (void)st; return cuMemcpyDtoD_v2(d, s, n); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) {
    if (current < 0) return INVALID_CONTEXT;
    if (!accessible(s, n)) return INVALID_VALUE;
    memcpy(d, (void *)(uintptr_t)s, n);
    return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) {
    if (current < 0) return INVALID_CONTEXT;
    if (!accessible(d, n)) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)d, s, n);
    return OK;
}

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
    if (current < 0) return INVALID_CONTEXT;
    /* A GPU faults on an address its device was not granted; the stand-in refuses it. */
    if (!accessible((uintptr_t)buf, words * 4)) return ILLEGAL_ADDRESS;
    if ((uintptr_t)f == VERIFY && !accessible((uintptr_t)*(uint64_t *)params[3], 4)) return ILLEGAL_ADDRESS;
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
