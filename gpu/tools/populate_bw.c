// How fast a 256 MiB shared memfd mapping (a session's data area) is faulted in with
// MADV_POPULATE_WRITE from N threads at once: what `prefault` in
// crates/server/src/backend/cuda/mod.rs relies on before page-locking a whole area.
//
//   cc -O2 -pthread -o populate_bw gpu/tools/populate_bw.c && ./populate_bw THREADS
//
// Prints "N threads: T ms". Needs no GPU.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
typedef struct {char*p;size_t n;} job;
static void*run(void*a){job*j=a; if(madvise(j->p,j->n,MADV_POPULATE_WRITE)) perror("madvise"); return 0;}
int main(int c,char**v){size_t len=256ul<<20;int th=atoi(v[1]);
 int fd=memfd_create("a",0); ftruncate(fd,len); char*p=mmap(0,len,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0);
 double t=now(); pthread_t ts[64]; job js[64]; size_t per=len/th;
 for(int i=0;i<th;i++){js[i].p=p+i*per;js[i].n=per;pthread_create(&ts[i],0,run,&js[i]);}
 for(int i=0;i<th;i++)pthread_join(ts[i],0);
 printf("%d threads: %.1f ms\n",th,now()-t);return 0;}
