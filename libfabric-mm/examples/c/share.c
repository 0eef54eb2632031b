/*
 * Two processes share fabric memory through libfabric-mm: the parent allocates a region on
 * the first GPU, maps it at its GFA in the unified window, stores a pattern and exports it;
 * the child (forked before either opens a session) imports the handle, maps it, checks the
 * pattern with plain loads and stores a byte back, which the parent then sees. Each side
 * flushes what it stored and invalidates before it loads what the other stored: no-ops on
 * coherent memory (this one), the cache work a fabric without coherence needs (CXL.mem
 * shared across hosts).
 *
 * Usage: share SOCKET        (exit status 0 when every check passed)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fabric_mm.h"

#define LEN (4u << 20)

static unsigned char pattern(size_t i) { return (unsigned char)(i * 7u ^ (i >> 12)); }

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

static int importer(const char *socket, int rfd) {
    char handle[128] = {0};
    ssize_t n = read(rfd, handle, sizeof handle - 1);
    if (n <= 0) {
        fprintf(stderr, "no handle from the owner\n");
        return 1;
    }
    fmm_session_t *s = NULL;
    fmm_import_t *imp = NULL;
    fmm_mapping_t *m = NULL;
    int rc = fmm_session_open(socket, 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);
    if ((rc = fmm_import(s, handle, 1, &imp))) return die("fmm_import", rc);
    if ((rc = fmm_map_import(s, imp, &m))) return die("fmm_map_import", rc);
    volatile unsigned char *p = fmm_mapping_ptr(m);
    if ((rc = fmm_mapping_invalidate(m, 0, LEN))) return die("fmm_mapping_invalidate", rc);
    if (fmm_mapping_len(m) != LEN) {
        fprintf(stderr, "import is %llu bytes\n", (unsigned long long)fmm_mapping_len(m));
        return 1;
    }
    for (size_t i = 0; i < LEN; i++) {
        if (p[i] != pattern(i)) {
            fprintf(stderr, "byte %zu is %u, expected %u\n", i, p[i], pattern(i));
            return 1;
        }
    }
    p[LEN / 2] = 0xAB;
    if ((rc = fmm_mapping_flush(m, LEN / 2, 1))) return die("fmm_mapping_flush", rc);
    /* A range outside the mapping is a typed error. */
    if (fmm_mapping_flush(m, LEN, 1) != FMM_E_ARG) return die("out-of-range flush", -1);
    if (fmm_mapping_invalidate(m, LEN - 1, 2) != FMM_E_ARG) return die("out-of-range invalidate", -1);
    printf("importer: pattern seen at GFA 0x%llx, stored 0xAB\n", (unsigned long long)fmm_mapping_gfa(m));
    fmm_unmap(m);
    fmm_import_release(imp);
    fmm_session_close(s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    int fds[2];
    if (pipe(fds)) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(fds[1]);
        int rc = importer(argv[1], fds[0]);
        fflush(stdout);
        _exit(rc);
    }
    close(fds[0]);

    fmm_session_t *s = NULL;
    fmm_region_t *r = NULL;
    fmm_mapping_t *m = NULL;
    char device[256], handle[128];
    int rc = fmm_session_open(argv[1], 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);
    if ((rc = fmm_first_device(s, FMM_MEM_HBM, device, sizeof device))) return die("fmm_first_device", rc);
    if ((rc = fmm_alloc(s, device, FMM_MEM_HBM, LEN, &r))) return die("fmm_alloc", rc);
    if ((rc = fmm_map_region(s, r, &m))) return die("fmm_map_region", rc);
    unsigned char *p = fmm_mapping_ptr(m);
    for (size_t i = 0; i < LEN; i++) p[i] = pattern(i);
    if ((rc = fmm_mapping_flush(m, 0, LEN))) return die("fmm_mapping_flush", rc);
    /* A too-small buffer is a typed error, not an overflow. */
    if (fmm_export(s, r, (uint32_t)-1, 0, handle, 4) != FMM_E_BUFFER) return die("short-buffer export", -1);
    if ((rc = fmm_export(s, r, (uint32_t)-1, 0, handle, sizeof handle))) return die("fmm_export", rc);
    if (write(fds[1], handle, strlen(handle)) != (ssize_t)strlen(handle)) return 1;
    close(fds[1]);

    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "importer failed\n");
        return 1;
    }
    if ((rc = fmm_mapping_invalidate(m, LEN / 2, 1))) return die("fmm_mapping_invalidate", rc);
    if (((volatile unsigned char *)p)[LEN / 2] != 0xAB) {
        fprintf(stderr, "owner does not see the importer's store\n");
        return 1;
    }
    printf("owner: %s shared %u bytes with the importer; its store is visible\n", device, LEN);
    /* Errors are typed: importing garbage fails with a code and a message. */
    fmm_import_t *bad = NULL;
    rc = fmm_import(s, "not-a-handle", 0, &bad);
    if (rc != FMM_E_ARG || strlen(fmm_last_error()) == 0) return die("garbage import check", rc);
    fmm_unmap(m);
    fmm_region_free(r);
    fmm_session_close(s);
    return 0;
}
