/*
 * Registers memory for DMA by the first GPU through libfabric-mm and prints the IOVAs:
 * a library host buffer (pinned by the daemon), the same buffer again (answered by the
 * registration cache: same registration), a region of the GPU's HBM, and a plain
 * malloc'd buffer (locked by the library), then the cache's statistics.
 *
 * Usage: register SOCKET        (exit status 0 when every check passed)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fabric_mm.h"

#define LEN (1u << 20)

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
    fmm_host_buffer_t *buf = NULL;
    fmm_region_t *region = NULL;
    fmm_registration_t *r1 = NULL, *r2 = NULL, *r3 = NULL, *r4 = NULL;
    char gpu[256];
    int rc = fmm_session_open(argv[1], 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);
    if ((rc = fmm_first_device(s, FMM_MEM_HBM, gpu, sizeof gpu))) return die("fmm_first_device", rc);

    if ((rc = fmm_host_alloc(s, LEN, &buf))) return die("fmm_host_alloc", rc);
    memset(fmm_host_ptr(buf), 0x5a, fmm_host_len(buf));
    if ((rc = fmm_register_host(s, buf, gpu, FMM_ACCESS_READ_WRITE, &r1))) return die("fmm_register_host", rc);
    printf("host buffer: %llu bytes at IOVA 0x%llx (registration %llu) for %s\n",
           (unsigned long long)fmm_registration_len(r1), (unsigned long long)fmm_registration_iova(r1),
           (unsigned long long)fmm_registration_id(r1), gpu);
    if ((rc = fmm_register_host(s, buf, gpu, FMM_ACCESS_READ_WRITE, &r2))) return die("fmm_register_host", rc);
    if (fmm_registration_id(r2) != fmm_registration_id(r1)) {
        fprintf(stderr, "the second registration of the same buffer missed the cache\n");
        return 1;
    }
    printf("again: cache hit, same registration\n");

    if ((rc = fmm_alloc(s, gpu, FMM_MEM_HBM, 2u << 20, &region))) return die("fmm_alloc", rc);
    if ((rc = fmm_register_region(s, region, gpu, FMM_ACCESS_READ_ONLY, &r3))) return die("fmm_register_region", rc);
    printf("HBM region: %llu bytes at IOVA 0x%llx\n", (unsigned long long)fmm_registration_len(r3),
           (unsigned long long)fmm_registration_iova(r3));

    unsigned char *plain = malloc(LEN);
    if (!plain) return 1;
    memset(plain, 1, LEN);
    if ((rc = fmm_register_ptr(s, plain + 3, LEN - 3, gpu, FMM_ACCESS_READ_WRITE, &r4)))
        return die("fmm_register_ptr", rc);
    printf("malloc'd buffer: %llu bytes at IOVA 0x%llx\n", (unsigned long long)fmm_registration_len(r4),
           (unsigned long long)fmm_registration_iova(r4));
    if (fmm_registration_iova(r4) % 4096 != ((uintptr_t)(plain + 3)) % 4096) {
        fprintf(stderr, "the IOVA does not keep the pointer's offset in its page\n");
        return 1;
    }

    /* Errors are codes plus text: an unknown access mode. */
    fmm_registration_t *bad = NULL;
    rc = fmm_register_host(s, buf, gpu, 7, &bad);
    if (rc != FMM_E_ARG || bad) return die("rejecting access 7", rc);
    printf("access 7 refused: %s\n", fmm_last_error());

    fmm_registration_stats_t st;
    if ((rc = fmm_registration_stats(s, &st))) return die("fmm_registration_stats", rc);
    printf("cache: %llu hits, %llu misses, %llu entries; %llu live registrations\n", (unsigned long long)st.hits,
           (unsigned long long)st.misses, (unsigned long long)st.entries, (unsigned long long)st.live);
    if (st.hits != 1 || st.misses != 2 || st.live != 3) return 1;

    fmm_unregister(r4); /* unlocks the malloc'd pages before they are freed */
    free(plain);
    fmm_unregister(r3);
    fmm_unregister(r2);
    fmm_unregister(r1);
    fmm_unregister(NULL);
    fmm_region_free(region);
    fmm_host_free(buf);
    fmm_session_close(s);
    printf("register: done\n");
    return 0;
}
