/*
 * The fabric as a C runtime sees it, from one snapshot: the GPUs, the GPU-to-GPU matrix of
 * hop classes and bottleneck bandwidths (what `nvidia-smi topo -m` prints, and what a
 * collectives library orders its rings by), and the memory nearest to the first GPU.
 * One fmm_view_open is one round trip; every query after it answers from the snapshot.
 *
 * Usage: topology SOCKET        (exit status 0 when every query answered)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fabric_mm.h"

#define MAX_GPUS 64

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    fmm_session_t *s = NULL;
    fmm_view_t *v = NULL;
    int rc;
    if ((rc = fmm_session_open(argv[1], 0, 0, &s))) return die("fmm_session_open", rc);
    if ((rc = fmm_view_open(s, &v))) return die("fmm_view_open", rc);

    static char gpus[MAX_GPUS][256];
    size_t n = 0, devices = fmm_view_device_count(v);
    for (size_t i = 0; i < devices && n < MAX_GPUS; i++) {
        fmm_device_info_t d;
        if ((rc = fmm_view_device(v, i, &d))) return die("fmm_view_device", rc);
        if (strcmp(d.kind, "gpu") == 0) {
            memcpy(gpus[n++], d.id, sizeof d.id);
            printf("GPU%zu %s, %llu GiB\n", n - 1, d.id, (unsigned long long)(d.memory_bytes >> 30));
        }
    }
    printf("%zu devices, %zu GPUs\n", devices, n);

    printf("      ");
    for (size_t b = 0; b < n; b++) printf(" GPU%-4zu", b);
    printf("\n");
    for (size_t a = 0; a < n; a++) {
        printf("GPU%-3zu", a);
        for (size_t b = 0; b < n; b++) {
            fmm_path_t p;
            if ((rc = fmm_view_path(v, gpus[a], gpus[b], &p))) return die("fmm_view_path", rc);
            printf(" %-7s", p.class_);
        }
        printf("\n");
    }
    if (n >= 2) {
        fmm_path_t p;
        if ((rc = fmm_view_path(v, gpus[0], gpus[1], &p))) return die("fmm_view_path", rc);
        printf("GPU0 -> GPU1: %s, %llu MB/s, %u hops\n", p.class_, (unsigned long long)p.bandwidth_mbps, p.hops);
    }

    if (n >= 1) {
        size_t count = 0;
        if ((rc = fmm_view_nearest_memory(v, gpus[0], FMM_MEM_ANY, NULL, 0, &count)))
            return die("fmm_view_nearest_memory (size)", rc);
        fmm_near_memory_t *near = calloc(count ? count : 1, sizeof *near);
        if (!near) return 1;
        if ((rc = fmm_view_nearest_memory(v, gpus[0], FMM_MEM_ANY, near, count, &count)))
            return die("fmm_view_nearest_memory", rc);
        for (size_t i = 0; i < count && i < 3; i++)
            printf("nearest %zu: %s class %d, %s\n", i, near[i].device, near[i].memory_class, near[i].path.class_);
        free(near);
    }
    fmm_device_info_t past;
    if (fmm_view_device(v, devices, &past) != FMM_E_ARG) return die("past-the-end check", -1);
    fmm_view_close(v);
    fmm_session_close(s);
    printf("topology: done\n");
    return 0;
}
