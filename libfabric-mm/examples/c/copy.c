/*
 * A copy by fabricd's copy engine from C: allocate two regions on the first GPU, map both
 * at their GFAs, store a pattern in the first, ask the engine to copy part of it into the
 * second (GFA to GFA), wait for the completion, and check the bytes with plain loads. The
 * caller's thread never moves the bytes. Refusals are typed (an empty copy is
 * FMM_E_BAD_REQUEST), and a copy can be polled.
 *
 * Then a completion callback (fmm_copy_on_complete): the library calls a C function with
 * the result on its own thread; the callback only records it and signals a condition
 * variable, and the main thread waits on that. The copy's handle may be freed before the
 * copy completes (the callback still runs), but never from inside the callback.
 *
 * Then register + copy: a host buffer (fmm_host_alloc) and the first region are registered
 * for DMA by the GPU, and the engine copies region → host buffer between the two
 * registrations (FMM_COPY_REGISTRATION endpoints name a registration by id); the bytes are
 * checked in the host buffer.
 *
 * Usage: copy SOCKET        (exit status 0 when every check passed)
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fabric_mm.h"

#define LEN (4u << 20)
#define OFF 4099u
#define COPY_LEN ((3u << 20) + 17u)

static unsigned char pattern(size_t i) { return (unsigned char)(i * 13u ^ (i >> 11)); }

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

/* What a completion callback hands to the thread that waits for it. */
struct done {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int calls, rc;
    uint64_t bytes;
    char message[256];
};

/* Runs on the library's thread (or at once, inside fmm_copy_on_complete, when the copy is
 * already done): record and signal; no blocking, no fmm_* calls on the session, and not
 * fmm_copy_free of this copy. */
static void on_done(void *user, int rc, uint64_t bytes, const char *message) {
    struct done *d = user;
    pthread_mutex_lock(&d->lock);
    d->calls++;
    d->rc = rc;
    d->bytes = bytes;
    snprintf(d->message, sizeof d->message, "%s", message ? message : "");
    pthread_cond_signal(&d->cond);
    pthread_mutex_unlock(&d->lock);
}

/* Waits (at most 10 s) until the callback ran; how many times it did. */
static int wait_done(struct done *d) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 10;
    pthread_mutex_lock(&d->lock);
    while (d->calls == 0 && pthread_cond_timedwait(&d->cond, &d->lock, &deadline) == 0) {
    }
    int calls = d->calls;
    pthread_mutex_unlock(&d->lock);
    return calls;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    fmm_session_t *s = NULL;
    fmm_region_t *a = NULL, *b = NULL;
    fmm_mapping_t *ma = NULL, *mb = NULL;
    fmm_copy_t *c = NULL;
    char device[256];
    int rc = fmm_session_open(argv[1], 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);
    if ((rc = fmm_first_device(s, FMM_MEM_HBM, device, sizeof device))) return die("fmm_first_device", rc);
    if ((rc = fmm_alloc(s, device, FMM_MEM_HBM, LEN, &a))) return die("fmm_alloc", rc);
    if ((rc = fmm_alloc(s, device, FMM_MEM_HBM, LEN, &b))) return die("fmm_alloc", rc);
    if ((rc = fmm_map_region(s, a, &ma))) return die("fmm_map_region", rc);
    if ((rc = fmm_map_region(s, b, &mb))) return die("fmm_map_region", rc);
    unsigned char *pa = fmm_mapping_ptr(ma);
    for (size_t i = 0; i < LEN; i++) pa[i] = pattern(i);
    memset(fmm_mapping_ptr(mb), 0, LEN);

    fmm_copy_endpoint_t dst = {FMM_COPY_GFA, 0, fmm_mapping_gfa(mb) + 1};
    fmm_copy_endpoint_t src = {FMM_COPY_GFA, 0, fmm_mapping_gfa(ma) + OFF};
    if ((rc = fmm_copy_start(s, &dst, &src, COPY_LEN, &c))) return die("fmm_copy_start", rc);
    /* Poll once (pending or done), then wait for it. */
    uint64_t bytes = 0;
    rc = fmm_copy_poll(c, &bytes);
    if (rc != FMM_COPY_PENDING && rc != FMM_OK) return die("fmm_copy_poll", rc);
    if ((rc = fmm_copy_wait(c, -1, &bytes))) return die("fmm_copy_wait", rc);
    if (bytes != COPY_LEN) {
        fprintf(stderr, "copied %llu bytes, expected %u\n", (unsigned long long)bytes, COPY_LEN);
        return 1;
    }
    /* Done copies stay done. */
    if ((rc = fmm_copy_poll(c, &bytes)) != FMM_OK) return die("fmm_copy_poll after wait", rc);
    fmm_copy_free(c);
    const volatile unsigned char *pb = fmm_mapping_ptr(mb);
    if (pb[0] != 0 || pb[1 + COPY_LEN] != 0) {
        fprintf(stderr, "bytes outside the copied range changed\n");
        return 1;
    }
    for (size_t i = 0; i < COPY_LEN; i++) {
        if (pb[1 + i] != pattern(OFF + i)) {
            fprintf(stderr, "byte %zu is %u, expected %u\n", i, pb[1 + i], pattern(OFF + i));
            return 1;
        }
    }
    printf("copy: the engine copied %u bytes from GFA 0x%llx to 0x%llx on %s\n", COPY_LEN,
           (unsigned long long)src.offset, (unsigned long long)dst.offset, device);

    /* The same copy again, with a completion callback instead of a wait. */
    struct done d = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 1, 0, ""};
    memset(fmm_mapping_ptr(mb), 0, LEN);
    c = NULL;
    if ((rc = fmm_copy_start(s, &dst, &src, COPY_LEN, &c))) return die("fmm_copy_start (callback)", rc);
    if ((rc = fmm_copy_on_complete(c, NULL, &d)) != FMM_E_ARG) return die("NULL callback check", rc);
    if ((rc = fmm_copy_on_complete(NULL, on_done, &d)) != FMM_E_ARG) return die("NULL copy check", rc);
    if ((rc = fmm_copy_on_complete(c, on_done, &d))) return die("fmm_copy_on_complete", rc);
    if (wait_done(&d) != 1 || d.rc != FMM_OK || d.bytes != COPY_LEN || d.message[0]) {
        fprintf(stderr, "callback: %d calls, rc %d, %llu bytes, \"%s\"\n", d.calls, d.rc, (unsigned long long)d.bytes,
                d.message);
        return 1;
    }
    /* The result went to the callback: poll no longer reports it. */
    if ((rc = fmm_copy_poll(c, &bytes)) != FMM_E_ARG) return die("poll after callback check", rc);
    fmm_copy_free(c);
    for (size_t i = 0; i < COPY_LEN; i++) {
        if (pb[1 + i] != pattern(OFF + i)) {
            fprintf(stderr, "callback copy: byte %zu is %u, expected %u\n", i, pb[1 + i], pattern(OFF + i));
            return 1;
        }
    }
    /* Freed before it completes: the callback still runs, once. */
    struct done early = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 1, 0, ""};
    c = NULL;
    if ((rc = fmm_copy_start(s, &dst, &src, COPY_LEN, &c))) return die("fmm_copy_start (freed)", rc);
    if ((rc = fmm_copy_on_complete(c, on_done, &early))) return die("fmm_copy_on_complete (freed)", rc);
    fmm_copy_free(c);
    if (wait_done(&early) != 1 || early.rc != FMM_OK || early.bytes != COPY_LEN) {
        fprintf(stderr, "freed copy's callback: %d calls, rc %d\n", early.calls, early.rc);
        return 1;
    }
    printf("copy: completion callback got %llu bytes, also with the handle freed first\n",
           (unsigned long long)d.bytes);

    /* Refusals are typed: an empty copy, an unknown registration. */
    c = NULL;
    rc = fmm_copy_start(s, &dst, &src, 0, &c);
    if (rc != FMM_E_BAD_REQUEST || c != NULL) return die("empty copy check", rc);
    fmm_copy_endpoint_t nowhere = {FMM_COPY_REGISTRATION, 999999, 0};
    rc = fmm_copy_start(s, &dst, &nowhere, 16, &c);
    if (rc != FMM_E_NOT_FOUND) return die("unknown registration check", rc);
    fmm_copy_endpoint_t bad = {7, 0, 0};
    if ((rc = fmm_copy_start(s, &dst, &bad, 16, &c)) != FMM_E_ARG) return die("bad endpoint kind check", rc);
    fmm_copy_free(NULL);
    printf("copy: refusals are typed\n");

    /* Register + copy: the first region and a host buffer, registered for DMA by the GPU. */
    fmm_host_buffer_t *h = NULL;
    fmm_registration_t *rh = NULL, *ra = NULL;
    if ((rc = fmm_host_alloc(s, LEN, &h))) return die("fmm_host_alloc", rc);
    memset(fmm_host_ptr(h), 0, LEN);
    if ((rc = fmm_register_host(s, h, device, FMM_ACCESS_READ_WRITE, &rh))) return die("fmm_register_host", rc);
    if ((rc = fmm_register_region(s, a, device, FMM_ACCESS_READ_ONLY, &ra))) return die("fmm_register_region", rc);
    fmm_copy_endpoint_t to_host = {FMM_COPY_REGISTRATION, fmm_registration_id(rh), 8};
    fmm_copy_endpoint_t from_region = {FMM_COPY_REGISTRATION, fmm_registration_id(ra), OFF};
    c = NULL;
    if ((rc = fmm_copy_start(s, &to_host, &from_region, COPY_LEN, &c))) return die("fmm_copy_start (registrations)", rc);
    if ((rc = fmm_copy_wait(c, 10000, &bytes))) return die("fmm_copy_wait (registrations)", rc);
    fmm_copy_free(c);
    const volatile unsigned char *ph = fmm_host_ptr(h);
    for (size_t i = 0; i < COPY_LEN; i++) {
        if (ph[8 + i] != pattern(OFF + i)) {
            fprintf(stderr, "host byte %zu is %u, expected %u\n", i, ph[8 + i], pattern(OFF + i));
            return 1;
        }
    }
    if (ph[7] != 0 || ph[8 + COPY_LEN] != 0) {
        fprintf(stderr, "host bytes outside the copied range changed\n");
        return 1;
    }
    printf("copy: registered region (IOVA 0x%llx) to registered host buffer (IOVA 0x%llx): %u bytes\n",
           (unsigned long long)fmm_registration_iova(ra), (unsigned long long)fmm_registration_iova(rh), COPY_LEN);
    fmm_unregister(ra);
    fmm_unregister(rh);
    fmm_host_free(h);

    fmm_unmap(ma);
    fmm_unmap(mb);
    fmm_region_free(a);
    fmm_region_free(b);
    fmm_session_close(s);
    return 0;
}
