/* For cli/tests/signals.rs: the mask a program sets is the mask it reads
 * back, SIGTRAP included. It blocks SIGTRAP (and SIGUSR1) with
 * pthread_sigmask and sigprocmask in turn, and checks each query's old set;
 * it prints whether the thread's real mask (SigBlk in
 * /proc/thread-self/status) blocks SIGTRAP: "real-blocks-trap 1" bare,
 * "real-blocks-trap 0" under spulse's perf-event engine. A thread created
 * while SIGTRAP is blocked reads back SIGTRAP in its mask too, and a SIGTRAP
 * sent to it (tgkill) stays pending until it reads it with sigtimedwait.
 * Exit 0: every old set was as set; 4 (with the step) otherwise. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int step;

static void expect(int ok) {
    step++;
    if (!ok) { printf("step %d: wrong old set\n", step); exit(4); }
}

static int real_blocks_trap(void) {
    FILE *f = fopen("/proc/thread-self/status", "r");
    char line[256];
    unsigned long long m = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "SigBlk:", 7) == 0) m = strtoull(line + 7, NULL, 16);
    if (f) fclose(f);
    return (m >> (SIGTRAP - 1)) & 1;
}

static int has(const sigset_t *s, int sig) { return sigismember(s, sig) == 1; }

static volatile pid_t child_tid;
static volatile int sent;

static void *child(void *arg) {
    (void)arg;
    sigset_t old, trap;
    sigemptyset(&trap); sigaddset(&trap, SIGTRAP);
    int view = pthread_sigmask(SIG_BLOCK, NULL, &old) == 0 && has(&old, SIGTRAP);
    child_tid = syscall(SYS_gettid);
    /* Running, not waiting, when the signal comes. */
    while (!sent) {}
    struct timespec wait = {5, 0};
    siginfo_t si;
    int got = sigtimedwait(&trap, &si, &wait);
    int ok = view && got == SIGTRAP && si.si_code <= 0 && si.si_pid == getpid();
    if (!ok) printf("child: view %d, got %d, si_code %d\n", view, got, got > 0 ? si.si_code : 0);
    return (void *)(long)ok;
}

int main(void) {
    sigset_t trap, usr1, old, none;
    sigemptyset(&trap); sigaddset(&trap, SIGTRAP);
    sigemptyset(&usr1); sigaddset(&usr1, SIGUSR1);
    sigemptyset(&none);
    expect(pthread_sigmask(SIG_BLOCK, &trap, &old) == 0 && !has(&old, SIGTRAP));
    expect(pthread_sigmask(SIG_BLOCK, NULL, &old) == 0 && has(&old, SIGTRAP));
    printf("real-blocks-trap %d\n", real_blocks_trap());
    pthread_t t;
    void *ok;
    expect(pthread_create(&t, NULL, child, NULL) == 0);
    while (!child_tid) usleep(1000);
    syscall(SYS_tgkill, getpid(), child_tid, SIGTRAP);
    sent = 1;
    expect(pthread_join(t, &ok) == 0 && ok);
    expect(sigprocmask(SIG_BLOCK, &usr1, &old) == 0 && has(&old, SIGTRAP) && !has(&old, SIGUSR1));
    expect(sigprocmask(SIG_BLOCK, NULL, &old) == 0 && has(&old, SIGTRAP) && has(&old, SIGUSR1));
    expect(pthread_sigmask(SIG_UNBLOCK, &trap, &old) == 0 && has(&old, SIGTRAP));
    expect(pthread_sigmask(SIG_BLOCK, NULL, &old) == 0 && !has(&old, SIGTRAP) && has(&old, SIGUSR1));
    /* The same set as new and old. */
    sigset_t both = trap;
    expect(sigprocmask(SIG_SETMASK, &both, &both) == 0 && !has(&both, SIGTRAP) && has(&both, SIGUSR1));
    expect(pthread_sigmask(SIG_SETMASK, &none, &old) == 0 && has(&old, SIGTRAP) && !has(&old, SIGUSR1));
    /* An invalid `how` fails and changes nothing. */
    expect(pthread_sigmask(12345, &trap, NULL) != 0 && sigprocmask(12345, &trap, NULL) == -1);
    expect(pthread_sigmask(SIG_BLOCK, NULL, &old) == 0 && !has(&old, SIGTRAP));
    printf("ok %d steps\n", step);
    return 0;
}
