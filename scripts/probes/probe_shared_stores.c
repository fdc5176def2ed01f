// Probe of the cost of storing over cache lines another CPU read (docs/performance.md, "The >= 1 MB slow mode").
//   gcc -O2 -pthread -o /tmp/probe_shared_stores scripts/probes/probe_shared_stores.c && /tmp/probe_shared_stores SECONDS MODE
// MODE 0: glibc memcpy, 1: AVX2 stores, 2: non-temporal (streaming) stores.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <immintrin.h>
__attribute__((target("avx2"))) static void vcopy(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=128){__m256i a=_mm256_loadu_si256((const __m256i*)(s+i)),b=_mm256_loadu_si256((const __m256i*)(s+i+32)),c=_mm256_loadu_si256((const __m256i*)(s+i+64)),e=_mm256_loadu_si256((const __m256i*)(s+i+96));_mm256_storeu_si256((__m256i*)(d+i),a);_mm256_storeu_si256((__m256i*)(d+i+32),b);_mm256_storeu_si256((__m256i*)(d+i+64),c);_mm256_storeu_si256((__m256i*)(d+i+96),e);}}
__attribute__((target("avx2"))) static void ntcopy(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=128){__m256i a=_mm256_loadu_si256((const __m256i*)(s+i)),b=_mm256_loadu_si256((const __m256i*)(s+i+32)),c=_mm256_loadu_si256((const __m256i*)(s+i+64)),e=_mm256_loadu_si256((const __m256i*)(s+i+96));_mm256_stream_si256((__m256i*)(d+i),a);_mm256_stream_si256((__m256i*)(d+i+32),b);_mm256_stream_si256((__m256i*)(d+i+64),c);_mm256_stream_si256((__m256i*)(d+i+96),e);}_mm_sfence();}
static int MODE;
// Each second, 20 times: the thread on cpu0 reads a 256 KB buffer (its lines end up cached there), then the thread on
// cpu1 overwrites it (memcpy from a private buffer) -- the store pattern of tdx's copy-in into a half the peer read.
// Prints the median time of the cpu1 store pass, and of the same store pass when cpu0 did not read the buffer.
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
enum{N=262144}; static char *X,*P; static volatile int turn; static volatile long sink;
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static void* reader(void*a){pin(0);for(;;){while(turn==0)sched_yield(); if(turn==2)return 0; long s=0;for(int i=0;i<N;i+=64)s+=X[i];sink=s;__atomic_store_n(&turn,0,__ATOMIC_SEQ_CST);}}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){int secs=atoi(argv[1]);MODE=atoi(argv[2]);X=aligned_alloc(4096,N);P=aligned_alloc(4096,N);memset(X,1,N);memset(P,2,N);pin(1);pthread_t t;pthread_create(&t,0,reader,0);
 for(int s=0;s<secs;s++){double a[20],b[20];
  for(int i=0;i<20;i++){__atomic_store_n(&turn,1,__ATOMIC_SEQ_CST);while(turn!=0)sched_yield();double t0=now();if(MODE==0)memcpy(X,P,N);else if(MODE==1)vcopy(X,P,N);else ntcopy(X,P,N);a[i]=(now()-t0)*1e6;}
  for(int i=0;i<20;i++){double t0=now();memcpy(X,P,N);b[i]=(now()-t0)*1e6;}
  qsort(a,20,8,cmp);qsort(b,20,8,cmp);FILE*f=fopen("/proc/loadavg","r");char la[64];fgets(la,64,f);fclose(f);la[4]=0;
  printf("%3d store 256K over lines the other vCPU read: %6.1f us   over lines only this vCPU holds: %5.1f us  load %s\n",s,a[10],b[10],la);fflush(stdout);usleep(500000);}
 turn=2;pthread_join(t,0);}
