/*
 * The kernel's cache of directory listings, for replies pyfuse3 does not let us shape
 * (overlayrec/dircache.py says when and why this library is loaded).
 *
 * Loaded with RTLD_GLOBAL before pyfuse3's extension module, this library comes first in the
 * global lookup scope, so pyfuse3's calls to the two libfuse functions defined here bind here.
 *
 * 1. Directories opened by the kernel alone.  fuse_session_new is given pyfuse3's table of
 *    request handlers; it passes on a copy in which READDIRPLUS and FSYNCDIR first put the
 *    directory's inode number (with BY_INODE, the top bit) into the request's file handle when
 *    it is 0, and INIT notes whether the kernel can open directories without asking
 *    (FUSE_CAP_NO_OPENDIR_SUPPORT).  When it can, the daemon answers the one OPENDIR it then
 *    gets with ENOSYS: the kernel sends no OPENDIR or RELEASEDIR again, keeps every listing it
 *    reads (as for FOPEN_CACHE_DIR | FOPEN_KEEP_CACHE), and each read names its directory by
 *    that inode number, which pyfuse3 would otherwise not pass on.
 * 2. Otherwise, listings kept through OPENDIR's reply.  pyfuse3 (3.5) answers OPENDIR with
 *    the fuse_file_info libfuse filled from the request and offers no way to set
 *    FOPEN_CACHE_DIR and FOPEN_KEEP_CACHE.  The daemon's opendir handler calls
 *    overlayrec_cache_next_dir() as its last step; pyfuse3 then replies with fuse_reply_open
 *    at once (a handler that returns has nothing to await), and that one reply carries them.
 *
 * Either way the kernel drops a kept listing when it changes the directory through the mount.
 * Every other call passes through unchanged to libfuse's own functions.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 31
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fuse3/fuse_lowlevel.h>

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);
typedef struct fuse_session *(*session_new_fn)(struct fuse_args *,
                                               const struct fuse_lowlevel_ops *, size_t, void *);

#define BY_INODE (1ULL << 63)

static reply_open_fn real_reply_open;
static session_new_fn real_session_new;
static int next_is_dir;

static struct fuse_lowlevel_ops ops;  /* pyfuse3's, with the three below in their place */
static void (*their_init)(void *, struct fuse_conn_info *);
static void (*their_readdirplus)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
static void (*their_fsyncdir)(fuse_req_t, fuse_ino_t, int, struct fuse_file_info *);
static int wrapped;     /* the session was made with our copy of the handlers */
static int no_opendir;  /* and the kernel can open directories without asking */

/* libfuse's own functions, found once libfuse is loaded (this library loads it itself, so
 * that it is there before pyfuse3 binds to us).  1 when found: only then may the caller
 * import pyfuse3 with this library in place. */
int overlayrec_dircache_ready(void)
{
    if (real_reply_open == NULL || real_session_new == NULL) {
        void *lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL) {
            real_reply_open = (reply_open_fn)dlsym(lib, "fuse_reply_open");
            real_session_new = (session_new_fn)dlsym(lib, "fuse_session_new");
        }
    }
    return real_reply_open != NULL && real_session_new != NULL;
}

/* 1 once the kernel's INIT has shown it opens directories itself when OPENDIR answers ENOSYS,
 * and READDIRPLUS and FSYNCDIR name their directory by inode then (BY_INODE). */
int overlayrec_dircache_by_inode(void)
{
    return wrapped && no_opendir;
}

static void init(void *userdata, struct fuse_conn_info *conn)
{
    no_opendir = (conn->capable & FUSE_CAP_NO_OPENDIR_SUPPORT) != 0;
    their_init(userdata, conn);
}

static void readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                        struct fuse_file_info *fi)
{
    if (fi->fh == 0)  /* not opened by the daemon: name the directory */
        fi->fh = BY_INODE | ino;
    their_readdirplus(req, ino, size, off, fi);
}

static void fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    if (fi->fh == 0)
        fi->fh = BY_INODE | ino;
    their_fsyncdir(req, ino, datasync, fi);
}

struct fuse_session *fuse_session_new(struct fuse_args *args, const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    if (!overlayrec_dircache_ready()) {
        fprintf(stderr, "overlayrec: _dircache: libfuse's fuse_session_new not found\n");
        abort();
    }
    if (wrapped || op_size != sizeof ops || op->init == NULL || op->readdirplus == NULL ||
            op->fsyncdir == NULL || op->readdir != NULL)
        return real_session_new(args, op, op_size, userdata);  /* not pyfuse3's: as it is */
    memcpy(&ops, op, sizeof ops);
    their_init = ops.init;
    their_readdirplus = ops.readdirplus;
    their_fsyncdir = ops.fsyncdir;
    ops.init = init;
    ops.readdirplus = readdirplus;
    ops.fsyncdir = fsyncdir;
    struct fuse_session *se = real_session_new(args, &ops, sizeof ops, userdata);
    wrapped = se != NULL;
    return se;
}

/* The next fuse_reply_open answers an OPENDIR: let the kernel cache the listing. */
void overlayrec_cache_next_dir(void)
{
    next_is_dir = 1;
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    if (!overlayrec_dircache_ready()) {
        /* cannot happen once dircache.py saw ready() succeed; never leave a request unanswered
         * in silence: the kernel would wait for this reply for ever */
        fprintf(stderr, "overlayrec: _dircache: libfuse's fuse_reply_open not found\n");
        abort();
    }
    if (next_is_dir) {
        struct fuse_file_info f = *fi;
        next_is_dir = 0;
        f.cache_readdir = 1;
        f.keep_cache = 1;
        return real_reply_open(req, &f);
    }
    return real_reply_open(req, fi);
}
