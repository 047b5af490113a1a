// Two threads pinned to vCPUs 0 and 1, each running 8 independent chains of 512-bit VPDPBUSD in registers: do the
// two vCPUs add compute (two cores) or share one core (SMT siblings)?  gcc -O2 -mavx512f -mavx512vnni -mavx512bw
// -pthread experiments/vnni_threads.c -o /tmp/vnni_threads && /tmp/vnni_threads
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static long N=4000000000L/16;
static void* work(void* arg){
  int cpu=(int)(long)arg; cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu,&s); pthread_setaffinity_np(pthread_self(),sizeof(s),&s);
  __m512i a0=_mm512_set1_epi32(1),a1=_mm512_set1_epi32(2),a2=_mm512_set1_epi32(3),a3=_mm512_set1_epi32(4),a4=a0,a5=a1,a6=a2,a7=a3;
  __m512i x=_mm512_set1_epi32(0x01010101), y=_mm512_set1_epi32(0x02020202);
  for(long i=0;i<N;i++){
    a0=_mm512_dpbusd_epi32(a0,x,y);a1=_mm512_dpbusd_epi32(a1,x,y);a2=_mm512_dpbusd_epi32(a2,x,y);a3=_mm512_dpbusd_epi32(a3,x,y);
    a4=_mm512_dpbusd_epi32(a4,x,y);a5=_mm512_dpbusd_epi32(a5,x,y);a6=_mm512_dpbusd_epi32(a6,x,y);a7=_mm512_dpbusd_epi32(a7,x,y);
  }
  __m512i r=_mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)),_mm512_add_epi32(_mm512_add_epi32(a4,a5),_mm512_add_epi32(a6,a7)));
  volatile int sink=_mm512_reduce_add_epi32(r); (void)sink; return 0;
}
int main(){
  double t=now(); work((void*)0L); double one=now()-t;
  printf("1 thread: %.3f s, %.1f G dpbusd/s\n", one, N*8/one/1e9);
  pthread_t a,b; t=now(); pthread_create(&a,0,work,(void*)0L); pthread_create(&b,0,work,(void*)1L); pthread_join(a,0); pthread_join(b,0); double two=now()-t;
  printf("2 threads (cpu0,cpu1): %.3f s, %.1f G dpbusd/s total, scaling %.2fx\n", two, 2*N*8/two/1e9, 2*one/two);
}
