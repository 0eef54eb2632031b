/*
 * Memory of one node of a domain reached from another, from C: nothing new to learn for a
 * remote handle. A session on the owner node allocates HBM, maps it, stores a pattern and
 * exports it; a session on the importer node imports the handle with the same
 * fmm_import. Then either:
 *
 *  - the nodes share a memory fabric: fmm_map_import places the import at its GFA in the
 *    importer's window (which gains the owner's node span); fmm_mapping_invalidate before
 *    loading the owner's bytes, a store, fmm_mapping_flush after it, and the owner
 *    (invalidating first) loads the importer's store — the calls memory shared across
 *    hosts without hardware coherence needs, no-ops where it is coherent; or
 *  - they do not (class NET): fmm_import_copy_only says so, fmm_map_import is refused
 *    FMM_E_COPY_ONLY, and the bytes move by fabricd's copy engine over the node link
 *    between a registered host buffer and the import's GFA (fmm_import_gfa), both ways.
 *
 * Usage: crossnode OWNER_SOCKET IMPORTER_SOCKET   (exit status 0 when every check passed;
 * it prints which path the domain gave)
 */
#include <stdio.h>
#include <string.h>

#include "fabric_mm.h"

#define LEN (4u << 20)
#define COPY_LEN ((3u << 20) + 5u)

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i * 31u + seed) ^ (i >> 12)); }

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

static int check(const volatile unsigned char *p, size_t n, unsigned seed, const char *who) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != pattern(i, seed)) {
            fprintf(stderr, "%s: byte %zu is %u, expected %u\n", who, i, p[i], pattern(i, seed));
            return 1;
        }
    }
    return 0;
}

/* Registers `h` for DMA by the first device of the importer's node that takes it (the
 * session lists the whole domain's devices; only its own node's can). */
static int register_here(const fmm_session_t *s, const fmm_host_buffer_t *h, fmm_registration_t **out) {
    fmm_view_t *v = NULL;
    int rc = fmm_view_open(s, &v);
    if (rc) return rc;
    rc = FMM_E_NOT_FOUND;
    for (size_t i = 0; i < fmm_view_device_count(v) && rc; i++) {
        fmm_device_info_t d;
        if (fmm_view_device(v, i, &d) == FMM_OK && strcmp(d.kind, "gpu") == 0)
            rc = fmm_register_host(s, h, d.id, FMM_ACCESS_READ_WRITE, out);
    }
    fmm_view_close(v);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s OWNER_SOCKET IMPORTER_SOCKET\n", argv[0]);
        return 2;
    }
    fmm_session_t *owner = NULL, *importer = NULL;
    fmm_region_t *r = NULL;
    fmm_mapping_t *om = NULL;
    fmm_import_t *imp = NULL;
    char device[256], handle[96];
    /* Window 0: on a domain node, one aperture per node span the session places memory of. */
    int rc = fmm_session_open(argv[1], 0, 0, &owner);
    if (rc) return die("fmm_session_open (owner)", rc);
    if ((rc = fmm_first_device(owner, FMM_MEM_HBM, device, sizeof device))) return die("fmm_first_device", rc);
    if ((rc = fmm_alloc(owner, device, FMM_MEM_HBM, LEN, &r))) return die("fmm_alloc", rc);
    if ((rc = fmm_map_region(owner, r, &om))) return die("fmm_map_region", rc);
    unsigned char *po = fmm_mapping_ptr(om);
    for (size_t i = 0; i < LEN; i++) po[i] = pattern(i, 1);
    if ((rc = fmm_mapping_flush(om, 0, LEN))) return die("fmm_mapping_flush (owner)", rc);
    if ((rc = fmm_export(owner, r, (uint32_t)-1, 0, handle, sizeof handle))) return die("fmm_export", rc);

    if ((rc = fmm_session_open(argv[2], 0, 0, &importer))) return die("fmm_session_open (importer)", rc);
    if ((rc = fmm_import(importer, handle, 1, &imp))) return die("fmm_import", rc);
    uint64_t gfa = 0;
    if ((rc = fmm_import_gfa(imp, &gfa))) return die("fmm_import_gfa", rc);
    if (gfa != fmm_mapping_gfa(om)) {
        fprintf(stderr, "the import is at GFA 0x%llx, the region at 0x%llx\n", (unsigned long long)gfa,
                (unsigned long long)fmm_mapping_gfa(om));
        return 1;
    }
    if ((rc = fmm_import_copy_only(NULL)) != FMM_E_ARG) return die("fmm_import_copy_only(NULL) check", rc);
    int copy_only = fmm_import_copy_only(imp);
    if (copy_only < 0) return die("fmm_import_copy_only", copy_only);

    fmm_mapping_t *im = NULL;
    rc = fmm_map_import(importer, imp, &im);
    if (!copy_only) {
        if (rc) return die("fmm_map_import", rc);
        if (fmm_mapping_gfa(im) != gfa) return die("the mapping's GFA", 1);
        /* Another node's memory: invalidate before loading, flush after storing (no-ops
         * where the grant says the hardware keeps this host's caches coherent). */
        int coherent = fmm_mapping_coherent(im);
        if (coherent < 0) return die("fmm_mapping_coherent", coherent);
        if ((rc = fmm_mapping_coherent(NULL)) != FMM_E_ARG) return die("fmm_mapping_coherent(NULL) check", rc);
        if ((rc = fmm_mapping_invalidate(im, 0, LEN))) return die("fmm_mapping_invalidate", rc);
        unsigned char *pi = fmm_mapping_ptr(im);
        if (check(pi, LEN, 1, "importer")) return 1;
        for (size_t i = 0; i < LEN; i++) pi[i] = pattern(i, 2);
        if ((rc = fmm_mapping_flush(im, 0, LEN))) return die("fmm_mapping_flush (importer)", rc);
        if ((rc = fmm_mapping_invalidate(om, 0, LEN))) return die("fmm_mapping_invalidate (owner)", rc);
        if (check(po, LEN, 2, "owner")) return 1;
        printf("crossnode: mapped another node's region at GFA 0x%llx (%s); stores seen both ways\n",
               (unsigned long long)gfa, coherent ? "coherent" : "flush and invalidate needed");
        fmm_unmap(im);
    } else {
        if (rc != FMM_E_COPY_ONLY || im != NULL) return die("fmm_map_import of a copy-only import", rc);
        fmm_host_buffer_t *h = NULL;
        fmm_registration_t *reg = NULL;
        fmm_copy_t *c = NULL;
        uint64_t bytes = 0;
        if ((rc = fmm_host_alloc(importer, LEN, &h))) return die("fmm_host_alloc", rc);
        if ((rc = register_here(importer, h, &reg))) return die("fmm_register_host", rc);
        unsigned char *ph = fmm_host_ptr(h);
        /* Push: the host buffer into the owner's region, at GFA + 7. */
        for (size_t i = 0; i < COPY_LEN; i++) ph[i] = pattern(i, 3);
        fmm_copy_endpoint_t here = {FMM_COPY_REGISTRATION, fmm_registration_id(reg), 0};
        fmm_copy_endpoint_t there = {FMM_COPY_GFA, 0, gfa + 7};
        if ((rc = fmm_copy_start(importer, &there, &here, COPY_LEN, &c))) return die("fmm_copy_start (push)", rc);
        if ((rc = fmm_copy_wait(c, 30000, &bytes)) || bytes != COPY_LEN) return die("fmm_copy_wait (push)", rc);
        fmm_copy_free(c);
        if (check(po + 7, COPY_LEN, 3, "owner after the push")) return 1;
        /* Pull: the owner's first bytes back into the host buffer. */
        memset(ph, 0, LEN);
        there.offset = gfa;
        c = NULL;
        if ((rc = fmm_copy_start(importer, &here, &there, COPY_LEN, &c))) return die("fmm_copy_start (pull)", rc);
        if ((rc = fmm_copy_wait(c, 30000, &bytes)) || bytes != COPY_LEN) return die("fmm_copy_wait (pull)", rc);
        fmm_copy_free(c);
        if (check(ph, 7, 1, "importer after the pull") || check(ph + 7, COPY_LEN - 7, 3, "importer after the pull"))
            return 1;
        /* The pulled bytes: the owner's pattern up to GFA + 7, then what was pushed (which
         * starts its pattern again from 0 there). */
        printf("crossnode: copy-only import at GFA 0x%llx; pushed and pulled %u bytes over the node link\n",
               (unsigned long long)gfa, COPY_LEN);
        fmm_unregister(reg);
        fmm_host_free(h);
    }
    fmm_import_release(imp);
    fmm_session_close(importer);
    fmm_unmap(om);
    fmm_region_free(r);
    fmm_session_close(owner);
    return 0;
}
