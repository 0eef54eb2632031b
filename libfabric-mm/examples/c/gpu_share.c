/*
 * Two processes share GPU memory (HBM) through fabricd with libfabric-mm's CUDA C ABI. The
 * exporter allocates GPU memory, stores a pattern with fmm_gpu_write, adopts the allocation
 * into its session (a region on the GPU's HBM) and exports it; the importer (forked before
 * either process touches CUDA) imports the handle into its GPU, maps it, reads the pattern
 * back, copies it on the GPU into memory of its own and stores its own pattern, which the
 * exporter then reads. Last, revocation: the exporter frees the region and the importer's
 * fmm_gpu_import_check answers FMM_E_REVOKED.
 *
 * Usage: gpu_share SOCKET [fd|fabric]  (fabric: allocate with the fabric handle type and adopt
 *        by fabric handle, protocol 1.4 — needs an IMEX channel on NVIDIA's driver)
 * Exit: 0 every check passed; 3 no CUDA driver or GPU here ("CUDA not present: ..." on
 * stderr); 1 a check failed; 2 usage.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fabric_mm.h"

/* Not a multiple of the allocation granularity: the library rounds it up. */
#define ASK (3u << 20)
#define EXPORTER_SEED 0x5eed0001u
#define IMPORTER_SEED 0x5eed0002u

/* Share by fabric handle instead of a POSIX descriptor (argv[2] == "fabric"). */
static int share_fabric;

static uint32_t pattern(uint64_t i, uint32_t seed) { return (uint32_t)i * 0x9E3779B1u ^ seed; }

static void fill(uint32_t *w, uint64_t bytes, uint32_t seed) {
    for (uint64_t i = 0; i < bytes / 4; i++) w[i] = pattern(i, seed);
}

/* The first word that differs from the pattern, or -1. */
static long long mismatch(const uint32_t *w, uint64_t bytes, uint32_t seed) {
    for (uint64_t i = 0; i < bytes / 4; i++)
        if (w[i] != pattern(i, seed)) return (long long)i;
    return -1;
}

static int die(const char *who, const char *what, int rc) {
    fprintf(stderr, "%s: %s failed (%d): %s\n", who, what, rc, fmm_last_error());
    return 1;
}

/* Reads the whole mapping and checks it holds the pattern for `seed`. */
static int verify(const char *who, const fmm_gpu_mapping_t *m, uint32_t seed, uint32_t *buf) {
    uint64_t len = fmm_gpu_mapping_len(m);
    int rc = fmm_gpu_read(m, 0, buf, len);
    if (rc) return die(who, "fmm_gpu_read", rc);
    long long bad = mismatch(buf, len, seed);
    if (bad >= 0) {
        fprintf(stderr, "%s: word %lld is 0x%08x, expected 0x%08x\n", who, bad, buf[bad], pattern((uint64_t)bad, seed));
        return 1;
    }
    return 0;
}

static int read_byte(int fd, char want) {
    char c = 0;
    return read(fd, &c, 1) == 1 && c == want ? 0 : -1;
}

static int importer(const char *socket, int from_exporter, int to_exporter) {
    const char *who = "importer";
    char handle[128];
    size_t n = 0;
    /* The handle's text, up to its NUL; nothing (EOF) when the exporter gave up. */
    while (n < sizeof handle && read(from_exporter, &handle[n], 1) == 1 && handle[n] != '\0') n++;
    if (n == 0 || n == sizeof handle || handle[n] != '\0') return 1;

    fmm_gpu_t *g = NULL;
    fmm_session_t *s = NULL;
    fmm_gpu_import_t *imp = NULL;
    fmm_gpu_mapping_t *m = NULL, *lm = NULL;
    fmm_gpu_memory_t *local = NULL;
    int rc = fmm_gpu_open(0, &g);
    if (rc) return die(who, "fmm_gpu_open", rc);
    if ((rc = fmm_session_open(socket, 0, 0, &s))) return die(who, "fmm_session_open", rc);
    if ((rc = fmm_gpu_import(s, handle, g, &imp))) return die(who, "fmm_gpu_import", rc);
    uint64_t size = fmm_gpu_import_size(imp);
    /* Peers: the importing GPU itself, to show the list (a GPU always reaches its own). */
    const fmm_gpu_t *peers[1] = {g};
    if ((rc = fmm_gpu_map_import(imp, peers, 1, &m))) return die(who, "fmm_gpu_map_import", rc);
    uint32_t *buf = malloc(size);
    if (!buf || fmm_gpu_mapping_len(m) != size) return 1;
    if (verify(who, m, EXPORTER_SEED, buf)) return 1;
    printf("importer: %llu bytes imported, mapped at device address 0x%llx, exporter's pattern seen\n",
           (unsigned long long)size, (unsigned long long)fmm_gpu_mapping_ptr(m));

    /* A copy on the GPU, from the exporter's memory into memory of this process. */
    if ((rc = fmm_gpu_alloc(g, size, 0, &local))) return die(who, "fmm_gpu_alloc", rc);
    if ((rc = fmm_gpu_map(local, NULL, 0, &lm))) return die(who, "fmm_gpu_map", rc);
    if ((rc = fmm_gpu_copy(lm, 0, m, 0, size))) return die(who, "fmm_gpu_copy", rc);
    if (verify(who, lm, EXPORTER_SEED, buf)) return 1;
    if (fmm_gpu_copy(lm, 4096, m, 0, size) != FMM_E_ARG) return die(who, "out-of-range copy check", -1);
    printf("importer: device-to-device copy verified\n");

    fill(buf, size, IMPORTER_SEED);
    if ((rc = fmm_gpu_write(m, 0, buf, size))) return die(who, "fmm_gpu_write", rc);
    if (write(to_exporter, "S", 1) != 1) return 1;

    /* The exporter frees its region: this session hears of it. */
    if (read_byte(from_exporter, 'F')) return 1;
    rc = 0;
    for (int i = 0; i < 1000 && (rc = fmm_gpu_import_check(imp)) == 0; i++) {
        struct timespec ms10 = {0, 10 * 1000 * 1000};
        nanosleep(&ms10, NULL);
    }
    if (rc != FMM_E_REVOKED) return die(who, "waiting for the revocation", rc);
    printf("importer: revoked (%d): %s\n", rc, fmm_last_error());

    /* The mapping keeps the import alive: released first, it still reads (the driver's
     * reference keeps the memory; a revoked import must stop using it, as here). */
    fmm_gpu_import_release(imp);
    if (verify(who, m, IMPORTER_SEED, buf)) return 1;
    fmm_gpu_unmap(m);
    fmm_gpu_unmap(lm);
    fmm_gpu_free(local);
    free(buf);
    fmm_session_close(s);
    fmm_gpu_close(g);
    printf("importer: done\n");
    return 0;
}

static int exporter(const char *socket, int to_importer, int from_importer) {
    const char *who = "exporter";
    fmm_gpu_t *g = NULL;
    fmm_gpu_memory_t *mem = NULL, *bad = NULL;
    fmm_gpu_mapping_t *m = NULL;
    fmm_session_t *s = NULL;
    fmm_gpu_region_t *r = NULL, *bad_region = NULL;
    int rc = fmm_gpu_open(0, &g);
    if (rc == FMM_E_DEVICE && strncmp(fmm_last_error(), "CUDA not present", 16) == 0) {
        fprintf(stderr, "exporter: no GPU here (%d): %s\n", rc, fmm_last_error());
        return 3;
    }
    if (rc) return die(who, "fmm_gpu_open", rc);
    char device[128], uuid[64];
    fmm_gpu_properties_t props;
    if ((rc = fmm_gpu_device(g, device, sizeof device))) return die(who, "fmm_gpu_device", rc);
    if ((rc = fmm_gpu_uuid(g, uuid, sizeof uuid))) return die(who, "fmm_gpu_uuid", rc);
    if ((rc = fmm_gpu_properties(g, &props))) return die(who, "fmm_gpu_properties", rc);
    printf("exporter: GPU %d %s (%s), compute %d.%d, granularity %llu\n", props.ordinal, uuid, device,
           props.compute_major, props.compute_minor, (unsigned long long)props.granularity);
    if (strcmp(device + strlen("uuid:"), uuid) != 0) return die(who, "device name check", -1);

    /* Typed refusals: an unknown flag, a range outside the mapping. */
    if (fmm_gpu_alloc(g, ASK, 0x80, &bad) != FMM_E_ARG) return die(who, "unknown-flag check", -1);
    uint32_t flags = props.gpu_direct_rdma_with_vmm ? FMM_GPU_ALLOC_GPU_DIRECT_RDMA : 0;
    if (share_fabric) flags |= FMM_GPU_ALLOC_FABRIC;
    if ((rc = fmm_gpu_alloc(g, ASK, flags, &mem))) return die(who, "fmm_gpu_alloc", rc);
    uint64_t size = fmm_gpu_memory_size(mem);
    if (size < ASK || props.granularity == 0 || size % props.granularity) {
        fprintf(stderr, "exporter: %u bytes asked, %llu given\n", ASK, (unsigned long long)size);
        return 1;
    }
    if ((rc = fmm_gpu_map(mem, NULL, 0, &m))) return die(who, "fmm_gpu_map", rc);
    uint32_t *buf = malloc(size);
    if (!buf) return 1;
    if (fmm_gpu_read(m, size - 2, buf, 4) != FMM_E_ARG) return die(who, "out-of-range read check", -1);
    fill(buf, size, EXPORTER_SEED);
    if ((rc = fmm_gpu_write(m, 0, buf, size))) return die(who, "fmm_gpu_write", rc);
    memset(buf, 0, size);
    if (verify(who, m, EXPORTER_SEED, buf)) return 1;
    int dmabuf = -1;
    rc = fmm_gpu_dma_buf(m, &dmabuf);
    if (rc == 0) {
        printf("exporter: dma-buf descriptor %d for a NIC\n", dmabuf);
        close(dmabuf);
    } else if (rc == FMM_E_DEVICE) {
        printf("exporter: no dma-buf here: %s\n", fmm_last_error());
    } else {
        return die(who, "fmm_gpu_dma_buf", rc);
    }
    printf("exporter: %llu bytes (%u asked) at device address 0x%llx hold the pattern\n", (unsigned long long)size,
           ASK, (unsigned long long)fmm_gpu_mapping_ptr(m));

    if ((rc = fmm_session_open(socket, 0, 0, &s))) return die(who, "fmm_session_open", rc);
    if (fmm_gpu_adopt(s, mem, NULL, 0x80, &bad_region) != FMM_E_ARG) return die(who, "unknown adopt flag check", -1);
    if ((rc = fmm_gpu_adopt(s, mem, NULL, share_fabric ? FMM_GPU_ADOPT_FABRIC : 0, &r)))
        return die(who, "fmm_gpu_adopt", rc);
    if (share_fabric) printf("exporter: handed over as a fabric handle\n");
    uint64_t gfa = 0;
    rc = fmm_gpu_region_gfa(r, &gfa);
    if (rc && rc != FMM_E_NO_GFA) return die(who, "fmm_gpu_region_gfa", rc);
    if (rc) printf("exporter: adopted as a region of %llu bytes on %s, not in the address map\n",
                   (unsigned long long)fmm_gpu_region_size(r), device);
    else printf("exporter: adopted as a region of %llu bytes on %s at GFA 0x%llx\n",
                (unsigned long long)fmm_gpu_region_size(r), device, (unsigned long long)gfa);
    char handle[128];
    if (fmm_gpu_export(r, (uint32_t)-1, 0, handle, 4) != FMM_E_BUFFER) return die(who, "short-buffer export", -1);
    if ((rc = fmm_gpu_export(r, (uint32_t)-1, 0, handle, sizeof handle))) return die(who, "fmm_gpu_export", rc);
    if (write(to_importer, handle, strlen(handle) + 1) != (ssize_t)(strlen(handle) + 1)) return 1;

    if (read_byte(from_importer, 'S')) {
        fprintf(stderr, "exporter: the importer stopped before storing its pattern\n");
        return 1;
    }
    if (verify(who, m, IMPORTER_SEED, buf)) return 1;
    printf("exporter: the importer's stores are in this GPU's memory\n");

    fmm_gpu_region_free(r);
    if (write(to_importer, "F", 1) != 1) return 1;
    /* The memory is still this process's: the mapping keeps it after fmm_gpu_free. */
    fmm_gpu_free(mem);
    if (verify(who, m, IMPORTER_SEED, buf)) return 1;
    fmm_gpu_unmap(m);
    free(buf);
    fmm_session_close(s);
    fmm_gpu_close(g);
    printf("exporter: region freed\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "fd") && strcmp(argv[2], "fabric"))) {
        fprintf(stderr, "usage: %s SOCKET [fd|fabric]\n", argv[0]);
        return 2;
    }
    share_fabric = argc == 3 && !strcmp(argv[2], "fabric");
    int down[2], up[2];
    if (pipe(down) || pipe(up)) return 1;
    /* Fork before CUDA is touched: a CUDA context does not survive into a child. */
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        int rc = importer(argv[1], down[0], up[1]);
        fflush(stdout);
        _exit(rc);
    }
    close(down[0]);
    close(up[1]);
    int rc = exporter(argv[1], down[1], up[0]);
    /* EOF tells an importer still waiting that the exporter is done (or gave up). */
    close(down[1]);
    close(up[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (rc) return rc;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "the importer failed\n");
        return 1;
    }
    printf("gpu_share: passed\n");
    return 0;
}
