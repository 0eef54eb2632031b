/*
 * Interleaved CXL memory and address translation from C: allocate a region striped over an
 * interleave set (fmm_alloc_set), map it, store through the mapping, and ask where its GFAs
 * land (fmm_translate): consecutive granules alternate between the set's member devices,
 * each at an offset in that device's memory. An address nothing holds translates as
 * FMM_LOCATION_UNMAPPED; an unknown set is FMM_E_NOT_FOUND, and its message names the
 * sets there are. Each member byte found leads back to its GFA (fmm_reverse).
 *
 * Then a revocation callback (fmm_on_revocation): a second session imports the region and
 * registers a callback; the owner revokes the export; the callback (on the library's
 * thread) only records the revocation and signals, and the main thread acts on it.
 *
 * Usage: interleave SOCKET SET    (e.g. SET = cxl-region:hpa-0x1000000000 on the sim
 *                                  CXL pool, configs/sim/cxl-pool.toml; exit 0 when every
 *                                  check passed)
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fabric_mm.h"

#define LEN (5u << 20)
#define GRANULE 4096u

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

/* What the revocation callback hands to the main thread. */
struct revoked {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int seen;
    fmm_revocation_t r;
};

/* Runs on the library's thread: record and signal, nothing else (no fmm_* calls that talk
 * to the daemon, no blocking). */
static void on_revoked(void *user, const fmm_revocation_t *r) {
    struct revoked *rv = user;
    pthread_mutex_lock(&rv->lock);
    rv->r = *r;
    rv->seen++;
    pthread_cond_signal(&rv->cond);
    pthread_mutex_unlock(&rv->lock);
}

static const char *class_name(int c) {
    switch (c) {
    case FMM_MEM_HBM: return "hbm";
    case FMM_MEM_DRAM: return "dram";
    case FMM_MEM_CXL_VOLATILE: return "cxl_volatile";
    case FMM_MEM_CXL_PERSISTENT: return "cxl_persistent";
    case FMM_MEM_CXL_DYNAMIC: return "cxl_dynamic";
    case FMM_MEM_HOST_EXPORTED: return "host_exported";
    default: return "?";
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOCKET SET\n", argv[0]);
        return 2;
    }
    fmm_session_t *s = NULL, *t = NULL;
    fmm_region_t *r = NULL, *none = NULL;
    fmm_mapping_t *m = NULL;
    int rc = fmm_session_open(argv[1], 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);

    rc = fmm_alloc_set(s, "no-such-set", LEN, &none);
    if (rc != FMM_E_NOT_FOUND || none != NULL) return die("unknown set check", rc);
    printf("interleave: unknown set refused (%d): %s\n", rc, fmm_last_error());
    if ((rc = fmm_alloc_set(s, NULL, LEN, &none)) != FMM_E_ARG) return die("NULL set check", rc);

    if ((rc = fmm_alloc_set(s, argv[2], LEN, &r))) return die("fmm_alloc_set", rc);
    if ((rc = fmm_map_region(s, r, &m))) return die("fmm_map_region", rc);
    unsigned char *p = fmm_mapping_ptr(m);
    uint64_t gfa = fmm_mapping_gfa(m), len = fmm_mapping_len(m);
    for (uint64_t i = 0; i < len; i += GRANULE) p[i] = (unsigned char)(i / GRANULE);
    printf("interleave: %llu bytes (%u asked) on %s at GFA 0x%llx\n", (unsigned long long)len, LEN, argv[2],
           (unsigned long long)gfa);

    /* The first two granules, a byte inside the third, the last byte; and past the end of
     * the address space, where nothing is. */
    uint64_t gfas[5] = {gfa, gfa + GRANULE, gfa + 2 * GRANULE + 5, gfa + len - 1, UINT64_MAX - 7};
    fmm_location_t loc[5];
    if ((rc = fmm_translate(s, gfas, 5, loc))) return die("fmm_translate", rc);
    for (int i = 0; i < 4; i++) {
        if (loc[i].kind != FMM_LOCATION_RESOURCE || strcmp(loc[i].set, argv[2]) != 0) {
            fprintf(stderr, "GFA 0x%llx: kind %d, set \"%s\"\n", (unsigned long long)gfas[i], loc[i].kind, loc[i].set);
            return 1;
        }
        printf("interleave: GFA 0x%llx -> %s %s#%u + 0x%llx (set %s)\n", (unsigned long long)gfas[i], loc[i].device,
               class_name(loc[i].memory_class), (unsigned)loc[i].ordinal, (unsigned long long)loc[i].offset,
               loc[i].set);
    }
    if (strcmp(loc[0].device, loc[1].device) == 0 || strcmp(loc[0].device, loc[2].device) != 0) {
        fprintf(stderr, "granules do not alternate between the members\n");
        return 1;
    }
    if (loc[4].kind != FMM_LOCATION_UNMAPPED) {
        fprintf(stderr, "GFA 0x%llx: kind %d, not unmapped\n", (unsigned long long)gfas[4], loc[4].kind);
        return 1;
    }
    printf("interleave: granules alternate between %s and %s; the top of the address space is unmapped\n",
           loc[0].device, loc[1].device);
    if ((rc = fmm_translate(s, NULL, 0, NULL))) return die("empty fmm_translate", rc);
    if ((rc = fmm_translate(s, NULL, 1, loc)) != FMM_E_ARG) return die("NULL gfas check", rc);

    /* And back: each member's byte leads to the GFA it came from. */
    fmm_resource_offset_t bytes[4];
    uint64_t back[4];
    for (int i = 0; i < 4; i++) {
        fmm_resource_offset_t b = {loc[i].device, loc[i].memory_class, loc[i].ordinal, loc[i].offset};
        bytes[i] = b;
    }
    if ((rc = fmm_reverse(s, bytes, 4, back))) return die("fmm_reverse", rc);
    for (int i = 0; i < 4; i++) {
        if (back[i] != gfas[i]) {
            fprintf(stderr, "reverse of %s + 0x%llx: 0x%llx, not 0x%llx\n", loc[i].device,
                    (unsigned long long)loc[i].offset, (unsigned long long)back[i], (unsigned long long)gfas[i]);
            return 1;
        }
    }
    printf("interleave: every member byte reverses to its GFA\n");

    /* A second session imports the region with a revocation callback; the owner revokes. */
    char handle[128];
    if ((rc = fmm_export(s, r, (uint32_t)-1, 1, handle, sizeof handle))) return die("fmm_export", rc);
    struct revoked rv = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0, 0, 0, 0}};
    fmm_import_t *imp = NULL;
    fmm_mapping_t *mi = NULL;
    if ((rc = fmm_session_open(argv[1], 0, 0, &t))) return die("fmm_session_open (importer)", rc);
    if ((rc = fmm_on_revocation(t, on_revoked, &rv))) return die("fmm_on_revocation", rc);
    if ((rc = fmm_import(t, handle, 0, &imp))) return die("fmm_import", rc);
    if ((rc = fmm_map_import(t, imp, &mi))) return die("fmm_map_import", rc);
    const volatile unsigned char *q = fmm_mapping_ptr(mi);
    if (q[GRANULE] != 1) {
        fprintf(stderr, "the importer sees %u, not the owner's store\n", q[GRANULE]);
        return 1;
    }
    if ((rc = fmm_revoke(s, handle))) return die("fmm_revoke", rc);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 10;
    pthread_mutex_lock(&rv.lock);
    while (rv.seen == 0 && pthread_cond_timedwait(&rv.cond, &rv.lock, &deadline) == 0) {
    }
    int seen = rv.seen;
    fmm_revocation_t got = rv.r;
    pthread_mutex_unlock(&rv.lock);
    if (seen != 1 || got.reason != FMM_REVOKED_BY_OWNER) {
        fprintf(stderr, "revocation callback: seen %d times, reason %d\n", seen, got.reason);
        return 1;
    }
    /* On this thread, not in the callback: act on it. */
    if ((rc = fmm_import_check(imp)) != FMM_E_REVOKED) return die("fmm_import_check after revocation", rc);
    printf("interleave: revocation callback: region %llu import %llu revoked by its owner; import check %d\n",
           (unsigned long long)got.region, (unsigned long long)got.import, rc);
    /* Removing the callback (NULL) is fine; rv may go away after it. */
    if ((rc = fmm_on_revocation(t, NULL, NULL))) return die("fmm_on_revocation (remove)", rc);
    if ((rc = fmm_on_revocation(NULL, on_revoked, &rv)) != FMM_E_ARG) return die("NULL session check", rc);

    fmm_unmap(mi);
    fmm_import_release(imp);
    fmm_session_close(t);
    fmm_unmap(m);
    fmm_region_free(r);
    fmm_region_free(NULL);
    fmm_session_close(s);
    printf("interleave: done\n");
    return 0;
}
