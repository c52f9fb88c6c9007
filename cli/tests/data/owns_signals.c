/* A program that owns signals, for cli/tests/signals.rs: it installs handlers
 * (by signal, sigaction or signalfd, chosen by argv[1]), burns CPU, then
 * checks that exactly its own signals reached it. Exit 0: as without spulse;
 * 2: a signal it did not send reached a handler; 3: its own did not arrive. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t got;

static void h(int s) { (void)s; got++; }
static void hi(int s, siginfo_t *i, void *c) { (void)s; (void)i; (void)c; got++; }

static double cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double burn(double secs) {
    volatile double x = 0;
    double end = cpu() + secs;
    while (cpu() < end)
        for (int i = 0; i < 100000; i++) x += i * 0.5;
    return x;
}

static int by_sigaction(int sig) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = hi;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    return sigaction(sig, &sa, 0);
}

static int check(int want) {
    if (got > want) { fprintf(stderr, "%d signals it did not send reached it\n", got - want); return 2; }
    if (got < want) { fprintf(stderr, "%d of its %d signals did not arrive\n", want - got, want); return 3; }
    return 0;
}

int main(int argc, char **argv) {
    const char *how = argc > 1 ? argv[1] : "";
    double secs = 0.6;
    if (!strcmp(how, "sigtrap-signal")) {
        signal(SIGTRAP, h);
        burn(secs);
        if (got) return check(0);
        raise(SIGTRAP);
        return check(1);
    }
    if (!strcmp(how, "sigtrap-sigaction")) {
        by_sigaction(SIGTRAP);
        struct sigaction back;
        sigaction(SIGTRAP, 0, &back);
        if (back.sa_sigaction != hi) { fprintf(stderr, "reads back another handler\n"); return 4; }
        burn(secs);
        if (got) return check(0);
        raise(SIGTRAP);
        raise(SIGTRAP);
        return check(2);
    }
    if (!strcmp(how, "sigtrap-oneshot")) {
        /* SA_RESETHAND: its handler once, then the default action. */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = h;
        sa.sa_flags = SA_RESETHAND;
        sigaction(SIGTRAP, &sa, 0);
        burn(secs);
        raise(SIGTRAP);
        struct sigaction back;
        sigaction(SIGTRAP, 0, &back);
        if (back.sa_handler != SIG_DFL) { fprintf(stderr, "one-shot handler still installed\n"); return 5; }
        return check(1);
    }
    if (!strcmp(how, "sigprof") || !strcmp(how, "sigurg") || !strcmp(how, "sigrt")) {
        int sig = !strcmp(how, "sigprof") ? SIGPROF : !strcmp(how, "sigurg") ? SIGURG : SIGRTMIN + 3;
        by_sigaction(sig);
        burn(secs);
        if (got) return check(0);
        raise(sig);
        return check(1);
    }
    if (!strcmp(how, "sigalrm")) {
        /* An interval timer of its own, as event loops and old code keep. */
        signal(SIGALRM, h);
        struct itimerval it = {{0, 50000}, {0, 50000}};
        setitimer(ITIMER_REAL, &it, 0);
        double t0 = cpu();
        while (got < 5 && cpu() - t0 < 5) burn(0.01);
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, 0);
        /* The rest of its CPU time after the alarms, so that what is
           sampled does not depend on how busy the machine is. */
        double used = cpu() - t0;
        if (used < secs) burn(secs - used);
        return got >= 5 ? 0 : 3;
    }
    if (!strcmp(how, "signalfd")) {
        /* SIGURG, SIGPROF and a real-time signal taken by a signalfd. */
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGURG);
        sigaddset(&set, SIGPROF);
        sigaddset(&set, SIGRTMIN + 2);
        sigprocmask(SIG_BLOCK, &set, 0);
        int fd = signalfd(-1, &set, SFD_NONBLOCK);
        if (fd < 0) return 6;
        burn(secs);
        struct signalfd_siginfo si;
        if (read(fd, &si, sizeof si) > 0) { fprintf(stderr, "signal %u it did not send\n", si.ssi_signo); return 2; }
        raise(SIGURG);
        raise(SIGPROF);
        raise(SIGRTMIN + 2);
        int n = 0;
        while (read(fd, &si, sizeof si) == sizeof si) n++;
        if (n != 3) { fprintf(stderr, "read %d of its 3 signals\n", n); return 3; }
        return 0;
    }
    fprintf(stderr, "usage: owns_signals sigtrap-signal|sigtrap-sigaction|sigtrap-oneshot|sigprof|sigurg|sigrt|sigalrm|signalfd\n");
    return 64;
}
