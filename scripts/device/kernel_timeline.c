// A CUDA injection library (CUDA_INJECTION64_PATH) that records every kernel, copy and memset of
// a process through CUPTI's activity API and, at exit, writes where the GPU's time went: per
// kernel name (count, total), and busy against idle over the recorded span, in bins, so that a
// serving load's steps can be read as GPU work or host gaps. For machines without Nsight Systems.
//
//   gcc -O2 -shared -fPIC -I$CUPTI/include kernel_timeline.c -o kernel_timeline.so -L$CUPTI/lib -l:libcupti.so.13
//   KERNEL_TIMELINE_OUT=report.txt KERNEL_TIMELINE_BIN_MS=100 KERNEL_TIMELINE_LAST_MS=3000 CUDA_INJECTION64_PATH=$PWD/kernel_timeline.so prog
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    uint64_t start, end;
    int name;  // index into names; -1 copies, -2 memsets
} Span;

static Span* spans_all;
static size_t n_spans_all, cap_spans;
static char** names_all;
static size_t n_names_all, cap_names;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int name_id(const char* s) {
    for (size_t i = n_names_all; i-- > 0;)
        if (strcmp(names_all[i], s) == 0) return (int)i;
    if (n_names_all == cap_names) {
        cap_names = cap_names ? 2 * cap_names : 256;
        names_all = realloc(names_all, cap_names * sizeof *names_all);
    }
    names_all[n_names_all] = strdup(s);
    return (int)n_names_all++;
}

static void add(uint64_t start, uint64_t end, int name) {
    if (n_spans_all == cap_spans) {
        cap_spans = cap_spans ? 2 * cap_spans : 1 << 16;
        spans_all = realloc(spans_all, cap_spans * sizeof *spans_all);
    }
    spans_all[n_spans_all++] = (Span){start, end, name};
}

static void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 8 << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity* r = NULL;
    pthread_mutex_lock(&lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            CUpti_ActivityKernel11* k = (CUpti_ActivityKernel11*)r;
            add(k->start, k->end, name_id(k->name ? k->name : "?"));
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            CUpti_ActivityMemcpy6* m = (CUpti_ActivityMemcpy6*)r;
            add(m->start, m->end, -1);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            CUpti_ActivityMemset4* m = (CUpti_ActivityMemset4*)r;
            add(m->start, m->end, -2);
        }
    }
    pthread_mutex_unlock(&lock);
    free(buffer);
}

static int by_start(const void* a, const void* b) {
    const Span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

typedef struct {
    const char* name;
    size_t count;
    double ms;
} Total;

static int by_ms(const void* a, const void* b) {
    const Total *x = a, *y = b;
    return x->ms < y->ms ? 1 : x->ms > y->ms ? -1 : 0;
}

// Writes the report over a copy of what is recorded so far (to KERNEL_TIMELINE_OUT.<pid>).
static void report(void) {
    pthread_mutex_lock(&lock);
    size_t n_spans = n_spans_all;
    Span* spans = malloc((n_spans + 1) * sizeof *spans);
    memcpy(spans, spans_all, n_spans * sizeof *spans);
    const size_t n_names = n_names_all;
    char** names = malloc((n_names + 1) * sizeof *names);
    memcpy(names, names_all, n_names * sizeof *names);
    pthread_mutex_unlock(&lock);
    const char* out = getenv("KERNEL_TIMELINE_OUT");
    // Written to a temporary name and renamed: a process killed mid-write keeps the last report.
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s.%d", out ? out : "kernel_timeline", (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "w");
    if (!f) f = stderr;
    if (n_spans == 0) {
        fprintf(f, "no GPU activity recorded\n");
        goto done;
    }
    qsort(spans, n_spans, sizeof *spans, by_start);
    // KERNEL_TIMELINE_LAST_MS: only what starts in the recorded span's last N ms (the load that
    // ran last), not the model's loading and warm-up before it.
    const char* last = getenv("KERNEL_TIMELINE_LAST_MS");
    if (last) {
        uint64_t end = 0;
        for (size_t i = 0; i < n_spans; i++)
            if (spans[i].end > end) end = spans[i].end;
        const uint64_t from = end - (uint64_t)(atof(last) * 1e6);
        size_t k = 0;
        while (k < n_spans && spans[k].start < from) k++;
        memmove(spans, spans + k, (n_spans - k) * sizeof *spans);
        n_spans -= k;
        if (n_spans == 0) {
            fprintf(f, "no GPU activity in the last %s ms\n", last);
            goto done;
        }
    }
    // Totals per name (copies and memsets as two names).
    Total* t = calloc(n_names + 2, sizeof *t);
    for (size_t i = 0; i < n_names; i++) t[i].name = names[i];
    t[n_names].name = "[memcpy]";
    t[n_names + 1].name = "[memset]";
    double all = 0;
    for (size_t i = 0; i < n_spans; i++) {
        const int j = spans[i].name >= 0 ? spans[i].name : spans[i].name == -1 ? (int)n_names : (int)n_names + 1;
        const double ms = (spans[i].end - spans[i].start) / 1e6;
        t[j].count++;
        t[j].ms += ms;
        all += ms;
    }
    // Busy time (the union of the spans) in bins from the first start.
    const uint64_t t0 = spans[0].start;
    uint64_t t1 = 0;
    for (size_t i = 0; i < n_spans; i++)
        if (spans[i].end > t1) t1 = spans[i].end;
    const char* b = getenv("KERNEL_TIMELINE_BIN_MS");
    const uint64_t bin = (uint64_t)((b ? atof(b) : 100.0) * 1e6);
    const size_t nbins = (size_t)((t1 - t0) / bin + 1);
    double* busy = calloc(nbins, sizeof *busy);
    size_t* launches = calloc(nbins, sizeof *launches);
    uint64_t cs = spans[0].start, ce = spans[0].end, gaps = 0, gap_ns = 0, big = 0, big_ns = 0;
    double total_busy = 0;
    for (size_t i = 0; i <= n_spans; i++) {
        if (i < n_spans) launches[(spans[i].start - t0) / bin]++;
        if (i < n_spans && spans[i].start <= ce) {
            if (spans[i].end > ce) ce = spans[i].end;
            continue;
        }
        // [cs, ce) is one busy interval: spread it over its bins.
        total_busy += (ce - cs) / 1e6;
        for (uint64_t s = cs; s < ce;) {
            const uint64_t k = (s - t0) / bin, e = t0 + (k + 1) * bin < ce ? t0 + (k + 1) * bin : ce;
            busy[k] += (e - s) / 1e6;
            s = e;
        }
        if (i < n_spans) {
            const uint64_t g = spans[i].start - ce;
            gaps++;
            gap_ns += g;
            if (g > 1000000) {
                big++;
                big_ns += g;
            }
            cs = spans[i].start;
            ce = spans[i].end;
        }
    }
    fprintf(f, "span %.1f ms, GPU busy %.1f ms (%.0f%%), %zu records, %.1f ms of work summed over streams\n",
            (t1 - t0) / 1e6, total_busy, 100 * total_busy * 1e6 / (double)(t1 - t0), n_spans, all);
    fprintf(f, "idle gaps: %llu, %.1f ms; over 1 ms: %llu, %.1f ms\n", (unsigned long long)gaps, gap_ns / 1e6,
            (unsigned long long)big, big_ns / 1e6);
    fprintf(f, "\nbins of %.0f ms: start ms, busy %%, records\n", bin / 1e6);
    for (size_t k = 0; k < nbins; k++)
        fprintf(f, "%8.0f %5.1f %7zu\n", k * bin / 1e6, 100 * busy[k] / (bin / 1e6), launches[k]);
    qsort(t, n_names + 2, sizeof *t, by_ms);
    fprintf(f, "\nper name: total ms, share of summed work, count, mean us\n");
    for (size_t i = 0; i < n_names + 2 && t[i].count; i++)
        fprintf(f, "%10.2f %5.1f%% %8zu %9.1f  %.110s\n", t[i].ms, 100 * t[i].ms / all, t[i].count,
                1e3 * t[i].ms / t[i].count, t[i].name);
done:
    if (f != stderr) {
        fclose(f);
        rename(tmp, path);
    }
    free(spans);
    free(names);
}

// The process may end by SIGKILL (a benchmark stopping its server), so the report is rewritten
// whenever a periodic flush brought new records, not only at exit.
static void* flusher(void* arg) {
    (void)arg;
    size_t seen = 0;
    for (;;) {
        usleep(100000);
        cuptiActivityFlushAll(0);
        pthread_mutex_lock(&lock);
        const size_t n = n_spans_all;
        pthread_mutex_unlock(&lock);
        if (n != seen) {
            seen = n;
            report();
        }
    }
    return NULL;
}

static void at_exit(void) {
    cuptiActivityFlushAll(1);
    report();
}

int InitializeInjection(void) {
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS) return 0;
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    atexit(at_exit);
    pthread_t t;
    pthread_create(&t, NULL, flusher, NULL);
    pthread_detach(t);
    return 1;
}
