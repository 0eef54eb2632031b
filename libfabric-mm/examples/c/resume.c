/*
 * Taking a session back by its resume token, from C. Needs a fabricd that keeps detached
 * sessions ([memory] detach_grace_s > 0).
 *
 * The owner (a forked child) allocates a region on the first GPU, maps it and stores a
 * pattern, exports it, prints its resume token, and closes its connection on purpose
 * (fmm_session_disconnect) without freeing anything: the daemon keeps the session's region
 * and export for the grace period. A second process (the parent, which never opened a
 * session before) opens a session with the token (fmm_session_resume), which takes the
 * region and the export back, imports the export and finds the pattern, then revokes the
 * export as its new owner. A token resumes once; a malformed one is refused.
 *
 * Usage: resume SOCKET        (exit status 0 when every check passed)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fabric_mm.h"

#define LEN (1u << 20)

static unsigned char pattern(size_t i) { return (unsigned char)(i * 13u ^ (i >> 9)); }

static int die(const char *what, int rc) {
    fprintf(stderr, "%s failed (%d): %s\n", what, rc, fmm_last_error());
    return 1;
}

/* The owner: runs in the child; `wfd` carries "TOKEN HANDLE" to the parent, `go` tells it
 * when the parent has taken the session back (the daemon keeps a detached session only
 * if its process is alive when it notices the closed connection). */
static int owner(const char *socket, int wfd, int go) {
    fmm_session_t *s = NULL;
    fmm_region_t *r = NULL;
    fmm_mapping_t *m = NULL;
    char device[256], handle[128], token[FMM_TOKEN_LEN], msg[256];
    int rc = fmm_session_open(socket, 0, 0, &s);
    if (rc) return die("fmm_session_open", rc);
    if ((rc = fmm_first_device(s, FMM_MEM_HBM, device, sizeof device))) return die("fmm_first_device", rc);
    if ((rc = fmm_alloc(s, device, FMM_MEM_HBM, LEN, &r))) return die("fmm_alloc", rc);
    if ((rc = fmm_map_region(s, r, &m))) return die("fmm_map_region", rc);
    unsigned char *p = fmm_mapping_ptr(m);
    for (size_t i = 0; i < LEN; i++) p[i] = pattern(i);
    if ((rc = fmm_export(s, r, (uint32_t)-1, 1, handle, sizeof handle))) return die("fmm_export", rc);
    /* A too-small buffer is a typed error, not an overflow. */
    if (fmm_session_token(s, token, 8) != FMM_E_BUFFER) return die("short-buffer token", -1);
    if ((rc = fmm_session_token(s, token, sizeof token))) return die("fmm_session_token", rc);
    printf("owner: token %s, export %s\n", token, handle);

    if ((rc = fmm_session_disconnect(s))) return die("fmm_session_disconnect", rc);
    if ((rc = fmm_session_ping(s)) != FMM_E_DISCONNECTED) return die("ping after disconnect", rc);
    /* This process's mapping stays valid: it holds the memory. */
    for (size_t i = 0; i < LEN; i += 4096)
        if (((volatile unsigned char *)p)[i] != pattern(i)) return die("mapping after disconnect", -1);
    printf("owner: connection closed, region not freed\n");
    fflush(stdout);

    int n = snprintf(msg, sizeof msg, "%s %s", token, handle);
    if (write(wfd, msg, (size_t)n) != n) return 1;
    close(wfd);
    char c;
    if (read(go, &c, 1) < 0) return 1; /* EOF: the parent has resumed */
    /* The handles belong to the closed connection: freeing them only frees this process's
     * side (the daemon's region now belongs to the resumed session). */
    fmm_unmap(m);
    fmm_region_free(r);
    fmm_session_close(s);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    int up[2], go[2];
    if (pipe(up) || pipe(go)) return 1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(up[0]);
        close(go[1]);
        int rc = owner(argv[1], up[1], go[0]);
        fflush(stdout);
        _exit(rc);
    }
    close(up[1]);
    close(go[0]);

    char msg[256] = {0}, token[FMM_TOKEN_LEN], handle[128], again[FMM_TOKEN_LEN];
    size_t got = 0;
    ssize_t n;
    while (got < sizeof msg - 1 && (n = read(up[0], msg + got, sizeof msg - 1 - got)) > 0) got += (size_t)n;
    close(up[0]);
    if (sscanf(msg, "%32s %127s", token, handle) != 2) {
        fprintf(stderr, "no token and handle from the owner\n");
        return 1;
    }

    /* The daemon notices the closed connection asynchronously: until it has, the token
     * names a session that is still connected, and the open is refused with NOT_FOUND. */
    fmm_session_t *s = NULL;
    int rc = FMM_E_NOT_FOUND;
    for (int i = 0; i < 250 && rc == FMM_E_NOT_FOUND; i++) {
        rc = fmm_session_resume(argv[1], 0, 0, token, &s);
        if (rc == FMM_E_NOT_FOUND) nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    }
    if (rc) return die("fmm_session_resume", rc);
    close(go[1]); /* the owner process may go now */
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "owner failed\n");
        return 1;
    }
    if ((rc = fmm_session_token(s, again, sizeof again))) return die("fmm_session_token", rc);
    if (strcmp(token, again) != 0) {
        fprintf(stderr, "the resumed session has token %s, not %s\n", again, token);
        return 1;
    }

    /* The region outlived its owner's connection and process: import it and look. */
    fmm_import_t *imp = NULL;
    fmm_mapping_t *m = NULL;
    if ((rc = fmm_import(s, handle, 0, &imp))) return die("fmm_import", rc);
    if ((rc = fmm_map_import(s, imp, &m))) return die("fmm_map_import", rc);
    const volatile unsigned char *p = fmm_mapping_ptr(m);
    if (fmm_mapping_len(m) < LEN) {
        fprintf(stderr, "the import is %llu bytes\n", (unsigned long long)fmm_mapping_len(m));
        return 1;
    }
    for (size_t i = 0; i < LEN; i++) {
        if (p[i] != pattern(i)) {
            fprintf(stderr, "byte %zu is %u, expected %u\n", i, p[i], pattern(i));
            return 1;
        }
    }
    printf("resumed: token kept, pattern seen at GFA 0x%llx\n", (unsigned long long)fmm_mapping_gfa(m));
    fmm_unmap(m);
    fmm_import_release(imp);

    /* The resumed session owns the export: it can revoke it. */
    if ((rc = fmm_revoke(s, handle))) return die("fmm_revoke", rc);
    if (fmm_import(s, handle, 0, &imp) == FMM_OK) return die("import after revoke", 0);
    /* A token resumes once; a malformed one is an argument error. */
    fmm_session_t *twice = NULL;
    if ((rc = fmm_session_resume(argv[1], 0, 0, token, &twice)) != FMM_E_NOT_FOUND)
        return die("second resume", rc);
    if ((rc = fmm_session_resume(argv[1], 0, 0, "not-a-token", &twice)) != FMM_E_ARG)
        return die("malformed token", rc);
    printf("resumed: export revoked by the new owner; the token resumes once\n");
    fmm_session_close(s);
    return 0;
}
