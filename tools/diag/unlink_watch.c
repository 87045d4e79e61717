/* Diagnostic (issue 14 flake hunt), not part of the build: an LD_PRELOAD shim that logs every
   unlink/unlinkat/rename of a /dev/shm/cudasnap-*.arena file to /tmp/unl/log with pid, parent,
   command line, and a native backtrace for base arenas. See tools/diag/audit/sitecustomize.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <stdlib.h>
#include <execinfo.h>
static void logit(const char* op, int dirfd, const char* p) {
  if (!p) return;
  char full[4096]; full[0]=0;
  if (p[0] != '/' && dirfd != AT_FDCWD && dirfd >= 0) {
    char l[64]; snprintf(l, sizeof l, "/proc/self/fd/%d", dirfd);
    ssize_t n = readlink(l, full, sizeof full - 256); if (n < 0) n = 0; full[n] = 0;
    strncat(full, "/", 2); strncat(full, p, 200);
  } else { strncpy(full, p, sizeof full - 1); full[sizeof full -1]=0; }
  if (!strstr(full, "cudasnap-") || !strstr(full, ".arena")) return;
  char cmd[512]; int fd = open("/proc/self/cmdline", O_RDONLY); ssize_t n = fd >= 0 ? read(fd, cmd, 511) : 0; if (fd>=0) close(fd);
  if (n < 0) n = 0; cmd[n] = 0; for (ssize_t i = 0; i < n; i++) if (!cmd[i]) cmd[i] = ' ';
  FILE* f = fopen("/tmp/unl/log", "a"); if (!f) return;
  fprintf(f, "%s pid=%d ppid=%d tid=%ld path=%s cmd=%.300s\n", op, getpid(), getppid(), (long)gettid(), full, cmd);
  if (strstr(full, "-base")) { void* b[40]; int k = backtrace(b, 40); fflush(f); backtrace_symbols_fd(b, k, fileno(f)); }
  fclose(f);
}
int unlink(const char* p) { static int (*r)(const char*); if (!r) r = dlsym(RTLD_NEXT, "unlink"); logit("unlink", AT_FDCWD, p); return r(p); }
int unlinkat(int d, const char* p, int fl) { static int (*r)(int,const char*,int); if (!r) r = dlsym(RTLD_NEXT, "unlinkat"); logit("unlinkat", d, p); return r(d, p, fl); }
int rename(const char* a, const char* b) { static int (*r)(const char*,const char*); if (!r) r = dlsym(RTLD_NEXT, "rename"); logit("rename-from", AT_FDCWD, a); return r(a, b); }
int renameat(int d, const char* a, int d2, const char* b) { static int (*r)(int,const char*,int,const char*); if (!r) r = dlsym(RTLD_NEXT, "renameat"); logit("renameat-from", d, a); return r(d, a, d2, b); }
int renameat2(int d, const char* a, int d2, const char* b, unsigned fl) { static int (*r)(int,const char*,int,const char*,unsigned); if (!r) r = dlsym(RTLD_NEXT, "renameat2"); logit("renameat2-from", d, a); return r(d, a, d2, b, fl); }
