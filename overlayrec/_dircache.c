/*
 * The kernel's cache of directory listings, for a reply pyfuse3 does not let us shape
 * (overlayrec/dircache.py says when and why this library is loaded).
 *
 * FUSE lets a filesystem answer OPENDIR with FOPEN_CACHE_DIR and FOPEN_KEEP_CACHE: the kernel
 * then keeps the listing it read in its page cache and serves the next opendir/readdir of an
 * unchanged directory itself, with no READDIRPLUS request.  Any change the kernel makes to the
 * directory (create, unlink, rename, link, mkdir, ... through the mount) drops the cached
 * listing.  pyfuse3 (3.5) answers OPENDIR with the fuse_file_info libfuse filled from the
 * request, and offers no way to set those two bits.
 *
 * Loaded with RTLD_GLOBAL before pyfuse3's extension module, this library's fuse_reply_open
 * comes first in the global lookup scope, so pyfuse3's calls bind here.  The daemon's opendir
 * handler calls overlayrec_cache_next_dir() as its last step; pyfuse3 then replies with
 * fuse_reply_open at once (a handler that returns has nothing to await), and that one reply
 * carries the two bits.  Every other call passes through unchanged to libfuse's own function.
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 31
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <fuse3/fuse_lowlevel.h>

typedef int (*reply_open_fn)(fuse_req_t, const struct fuse_file_info *);

static reply_open_fn real_reply_open;
static int next_is_dir;

/* libfuse's own fuse_reply_open, found once libfuse is loaded (this library loads it itself,
 * so that it is there before pyfuse3 binds to us).  1 when found: only then may the caller
 * import pyfuse3 with this library in place. */
int overlayrec_dircache_ready(void)
{
    if (real_reply_open == NULL) {
        void *lib = dlopen("libfuse3.so.3", RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL)
            real_reply_open = (reply_open_fn)dlsym(lib, "fuse_reply_open");
    }
    return real_reply_open != NULL;
}

/* The next fuse_reply_open answers an OPENDIR: let the kernel cache the listing. */
void overlayrec_cache_next_dir(void)
{
    next_is_dir = 1;
}

int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *fi)
{
    if (real_reply_open == NULL && !overlayrec_dircache_ready()) {
        /* cannot happen once dircache.py saw ready() succeed; never leave a request unanswered
         * in silence: the kernel would wait for this reply for ever */
        real_reply_open = (reply_open_fn)dlsym(RTLD_NEXT, "fuse_reply_open");
        if (real_reply_open == NULL) {
            fprintf(stderr, "overlayrec: _dircache: libfuse's fuse_reply_open not found\n");
            abort();
        }
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
