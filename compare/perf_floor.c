// What a perf task-clock sampler costs before any profiler code runs: a gap
// meter (as in compare/src/main.rs --gaps) in one thread, under
//   mode 0: nothing;
//   mode 2: a task-clock event of the thread overflowing every 1 ms of user
//           CPU, no signal (the kernel's sampling interrupt alone);
//   mode 1: the same event with sigtrap = 1 and a no-op SIGTRAP handler (the
//           mechanism spulse's perf engine uses, with an empty handler).
// Prints: mode, stolen share of the thread's running time (%), interruptions,
// signals. Build and run (see BENCHMARKS.md, "Overhead"):
//   gcc -O2 -o /tmp/perf_floor compare/perf_floor.c
//   for i in 1 2 3 4 5; do for m in 0 2 1; do taskset -c 0 /tmp/perf_floor $m; done; done
#define _GNU_SOURCE
#include <linux/perf_event.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>
static volatile long nsig;
static void h(int s, siginfo_t *i, void *c){ nsig++; }
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int mode = atoi(argv[1]);
  if (mode) {
    struct sigaction sa; memset(&sa,0,sizeof sa); sa.sa_sigaction=h; sa.sa_flags=SA_SIGINFO|SA_RESTART; sigaction(SIGTRAP,&sa,0);
    struct perf_event_attr a; memset(&a,0,sizeof a); a.type=PERF_TYPE_SOFTWARE; a.size=sizeof a; a.config=PERF_COUNT_SW_TASK_CLOCK;
    a.sample_period=1000000; a.exclude_kernel=1; a.exclude_hv=1; a.remove_on_exec=1; a.sigtrap=1; a.sig_data=42;
    if (mode==2) { a.sigtrap=0; a.remove_on_exec=0; } // counting with overflow but no signal
    int fd = syscall(SYS_perf_event_open,&a,0,-1,-1,PERF_FLAG_FD_CLOEXEC); if(fd<0){perror("perf");return 1;}
  }
  unsigned long long prev=__rdtsc(), run=0, stolen=0, gaps=0; double end=now()+3;
  while(now()<end){ for(int k=0;k<100000;k++){ unsigned long long t=__rdtsc(), d=t-prev; prev=t; if(d<1000) run+=d; else if(d<200000){run+=d; stolen+=d; gaps++;} } prev=__rdtsc(); }
  printf("%d %.4f %llu %ld\n", mode, 100.0*stolen/run, gaps, nsig);
}
