/* A daemon-style program for cli/tests/signals.rs: before making any thread
 * it blocks every signal (sigfillset + pthread_sigmask), so every thread
 * blocks them all; three threads burn 0.6 s of CPU each and read signals on
 * the full set meanwhile, by sigtimedwait (argv[1] "sigtimedwait") or
 * signalfd ("signalfd"). With argv[2] "kill" it first sends itself one
 * SIGTRAP (kill: SI_USER), which it must read back.
 * Exit 0: as without spulse; 3: it read a SIGTRAP it did not send (spulse's,
 * si_code TRAP_PERF = 6) or not the one it sent. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
static int use_signalfd;
static int traps, others, last_code, foreign;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void got(int sig, int code) {
    pthread_mutex_lock(&mu);
    if (sig == SIGTRAP && code == SI_USER)
        foreign++;
    else if (sig == SIGTRAP) {
        traps++;
        last_code = code;
    } else
        others++;
    pthread_mutex_unlock(&mu);
}

static void *worker(void *arg) {
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    int sfd = -1;
    if (use_signalfd) {
        sfd = signalfd(-1, &all, SFD_NONBLOCK | SFD_CLOEXEC);
        if (sfd < 0) { perror("signalfd"); exit(2); }
    }
    double t0 = cpu_now();
    while (cpu_now() - t0 < 0.6) {
        for (int i = 0; i < 200000; i++) sink += i * 7;
        if (use_signalfd) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) got(si.ssi_signo, si.ssi_code);
        } else {
            struct timespec zero = {0, 0};
            siginfo_t si;
            int s;
            while ((s = sigtimedwait(&all, &si, &zero)) > 0) got(s, si.si_code);
        }
    }
    if (sfd >= 0) close(sfd);
    return NULL;
}

int main(int argc, char **argv) {
    use_signalfd = argc > 1 && strcmp(argv[1], "signalfd") == 0;
    int send = argc > 2 && strcmp(argv[2], "kill") == 0;
    sigset_t all;
    sigfillset(&all);
    if (pthread_sigmask(SIG_BLOCK, &all, NULL) != 0) { perror("pthread_sigmask"); return 2; }
    if (send) kill(getpid(), SIGTRAP);
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, worker, NULL);
    worker(NULL);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    struct timespec zero = {0, 0};
    siginfo_t si;
    int s;
    while ((s = sigtimedwait(&all, &si, &zero)) > 0) got(s, si.si_code);
    printf("sigtraps not its own %d (last si_code %d), its own %d of %d, other signals %d\n", traps, last_code,
           foreign, send, others);
    return traps || foreign != send ? 3 : 0;
}
