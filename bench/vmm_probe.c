/* SPDX-License-Identifier: MIT */
/*
 * vmm_probe: what CUDA's virtual-memory calls cost, and whether they scale
 * with threads. The offload engine's fetch maps chunks and grants access;
 * its spill unmaps them: this says how far a second thread can take that.
 *
 *   cc -O2 bench/vmm_probe.c -I<cuda>/include -L<cuda>/lib64/stubs \
 *      -lcuda -lpthread -o vmm_probe && ./vmm_probe [MiB]
 *
 * Each thread owns MiB (default 256) of physical memory as chunks of the
 * granularity, 4x and 16x it, and a virtual range of its own; one round
 * maps every chunk, grants access (one call per chunk, or one call for
 * the whole range), unmaps them. Prints microseconds per 2 MiB for each
 * call (so chunk sizes compare), and the aggregate rate in GB/s mapped,
 * granted and unmapped.
 *
 * Then two questions for the allocator's design:
 *  - pieces: does a large handle mapped as 2 MiB pieces (cuMemMap with an
 *    offset, as a stitched range would map it) cost what whole 2 MiB
 *    handles cost, or what one large mapping costs? And may one unmap a
 *    2 MiB piece out of a larger mapping?
 *  - enqueue: how long a stream call (cuMemsetD8Async, standing in for a
 *    kernel launch) takes while another thread maps and unmaps: whether
 *    the offload engine's driver calls hold up the training thread.
 *  - runs: may one cuMemUnmap take a run of separately mapped handles
 *    (the whole range, or a run inside it), and what does it cost per
 *    2 MiB against one call per handle?
 *  - busy: does a mapping call wait for work queued on a stream? Each
 *    call kind is timed on a range of its own with about 50 ms of
 *    memsets queued, and the stream asked whether it is still busy.
 *  - export: do handles made exportable as POSIX file descriptors, and
 *    GPUDirect RDMA capable where supported (what libgmlake asks for, as
 *    PyTorch's expandable segments do), cost more to create, map, grant,
 *    unmap and release than plain ones?
 *    (`vmm_probe MiB export` runs only this one.)
 */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROUNDS 4

/* Every handle: pinned memory of device 0, read-write for it. */
static const CUmemAllocationProp prop = {
	.type = CU_MEM_ALLOCATION_TYPE_PINNED,
	.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
};
static const CUmemAccessDesc acc = {
	.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
	.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
};

static CUdevice dev;
static CUcontext cuctx;
static size_t gran, csize;
static int nchunks;
static int whole_range;

struct worker {
	pthread_t t;
	CUdeviceptr va;
	CUmemGenericAllocationHandle *h;
	double map_s, access_s, unmap_s;
	int err;
};

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
	const char *s_ = "?"; cuGetErrorString(r_, &s_); \
	fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, s_); \
	return 1; } } while (0)

static int setup(struct worker *w)
{
	CK(cuCtxSetCurrent(cuctx));
	w->h = calloc((size_t)nchunks, sizeof(*w->h));
	if (!w->h)
		return 1;
	CK(cuMemAddressReserve(&w->va, (size_t)nchunks * csize, 0, 0, 0));
	for (int i = 0; i < nchunks; i++)
		CK(cuMemCreate(&w->h[i], csize, &prop, 0));
	return 0;
}

static int rounds(struct worker *w)
{
	double t;

	CK(cuCtxSetCurrent(cuctx));
	for (int r = 0; r < ROUNDS; r++) {
		t = now();
		for (int i = 0; i < nchunks; i++)
			CK(cuMemMap(w->va + (size_t)i * csize, csize, 0,
				    w->h[i], 0));
		w->map_s += now() - t;
		t = now();
		if (whole_range)
			CK(cuMemSetAccess(w->va, (size_t)nchunks * csize, &acc,
					  1));
		else
			for (int i = 0; i < nchunks; i++)
				CK(cuMemSetAccess(w->va + (size_t)i * csize,
						  csize, &acc, 1));
		w->access_s += now() - t;
		t = now();
		for (int i = 0; i < nchunks; i++)
			CK(cuMemUnmap(w->va + (size_t)i * csize, csize));
		w->unmap_s += now() - t;
	}
	return 0;
}

static void *run(void *arg)
{
	struct worker *w = arg;

	w->err = rounds(w);
	return NULL;
}

static int measure(int nthreads)
{
	struct worker w[16] = { 0 };
	/* per 2 MiB moved, whatever the chunk size */
	double t0, wall, per = (double)ROUNDS * nchunks * csize / (2 << 20);
	double map = 0, access = 0, unmap = 0;

	for (int i = 0; i < nthreads; i++)
		if (setup(&w[i]))
			return 1;
	t0 = now();
	for (int i = 0; i < nthreads; i++)
		pthread_create(&w[i].t, NULL, run, &w[i]);
	for (int i = 0; i < nthreads; i++) {
		pthread_join(w[i].t, NULL);
		if (w[i].err)
			return 1;
		map += w[i].map_s;
		access += w[i].access_s;
		unmap += w[i].unmap_s;
	}
	wall = now() - t0;
	/* Per-chunk costs as each thread saw them; the aggregate is chunks
	 * mapped, granted and unmapped per second over all threads. */
	printf("%8zu %-6s %7d %9.1f %9.1f %9.1f %9.1f\n", csize >> 20,
	       whole_range ? "range" : "chunk", nthreads,
	       map / nthreads / per * 1e6, access / nthreads / per * 1e6,
	       unmap / nthreads / per * 1e6,
	       nthreads * per * (2 << 20) / wall / 1e9);
	for (int i = 0; i < nthreads; i++) {
		for (int c = 0; c < nchunks; c++)
			CK(cuMemRelease(w[i].h[c]));
		CK(cuMemAddressFree(w[i].va, (size_t)nchunks * csize));
		free(w[i].h);
	}
	return 0;
}

static const char *errname(CUresult r)
{
	const char *s = "?";

	cuGetErrorName(r, &s);
	return s;
}

/* One handle of 16 granules mapped whole, or as 16 pieces at offsets. */
static int pieces(void)
{
	enum { N = 16, REPS = 32 };
	size_t size = N * gran;
	CUmemGenericAllocationHandle h;
	CUdeviceptr va;
	CUresult r;
	double t, map = 0, access = 0, unmap = 0;

	CK(cuMemCreate(&h, size, &prop, 0));
	CK(cuMemAddressReserve(&va, size, 0, 0, 0));
	/* The header says the offset "currently must be zero": ask. */
	r = cuMemMap(va + gran, gran, gran, h, 0);
	printf("pieces: mapping a 2 MiB piece at an offset of a %zu MiB "
	       "handle: %s\n", size >> 20, errname(r));
	if (r == CUDA_SUCCESS)
		CK(cuMemUnmap(va + gran, gran));
	for (int k = 0; r == CUDA_SUCCESS && k < REPS; k++) {
		t = now();
		for (int i = 0; i < N; i++)
			CK(cuMemMap(va + i * gran, gran, i * gran, h, 0));
		map += now() - t;
		t = now();
		CK(cuMemSetAccess(va, size, &acc, 1));
		access += now() - t;
		t = now();
		for (int i = 0; i < N; i++)
			CK(cuMemUnmap(va + i * gran, gran));
		unmap += now() - t;
	}
	if (r == CUDA_SUCCESS)
		printf("pieces: a %zu MiB handle as %d mappings at offsets: "
		       "us per 2 MiB map %.1f access %.1f unmap %.1f\n",
		       size >> 20, N, map / REPS / N * 1e6 * (2 << 20) / gran,
		       access / REPS / N * 1e6 * (2 << 20) / gran,
		       unmap / REPS / N * 1e6 * (2 << 20) / gran);
	/* Only the first 2 MiB of the handle, at offset 0? */
	r = cuMemMap(va, gran, 0, h, 0);
	printf("pieces: mapping the first 2 MiB of a %zu MiB handle: %s\n",
	       size >> 20, errname(r));
	if (r == CUDA_SUCCESS)
		CK(cuMemUnmap(va, gran));
	/* A piece out of one whole mapping: allowed or refused? */
	CK(cuMemMap(va, size, 0, h, 0));
	CK(cuMemSetAccess(va, size, &acc, 1));
	r = cuMemUnmap(va + gran, gran);
	printf("pieces: unmapping 2 MiB out of a %zu MiB mapping: %s\n",
	       size >> 20, errname(r));
	if (r == CUDA_SUCCESS) {
		CK(cuMemUnmap(va, gran));
		CK(cuMemUnmap(va + 2 * gran, size - 2 * gran));
	} else {
		CK(cuMemUnmap(va, size));
	}
	CK(cuMemAddressFree(va, size));
	CK(cuMemRelease(h));
	return 0;
}

static volatile int churn_stop;

/* Map, grant and unmap 64 granules over and over, until told. */
static void *churn(void *arg)
{
	struct worker *w = arg;

	w->err = 1;
	if (cuCtxSetCurrent(cuctx) != CUDA_SUCCESS)
		return NULL;
	while (!churn_stop) {
		for (int i = 0; i < nchunks; i++)
			if (cuMemMap(w->va + (size_t)i * csize, csize, 0,
				     w->h[i], 0) != CUDA_SUCCESS)
				return NULL;
		if (cuMemSetAccess(w->va, (size_t)nchunks * csize, &acc, 1) !=
		    CUDA_SUCCESS)
			return NULL;
		for (int i = 0; i < nchunks; i++)
			if (cuMemUnmap(w->va + (size_t)i * csize, csize) !=
			    CUDA_SUCCESS)
				return NULL;
	}
	w->err = 0;
	return NULL;
}

/* Microseconds per cuMemsetD8Async, median of batches of 100. */
static int enqueue_us(CUstream s, CUdeviceptr buf, double *out)
{
	enum { BATCHES = 41, PER = 100 };
	double us[BATCHES], t;

	for (int b = 0; b < BATCHES; b++) {
		t = now();
		for (int i = 0; i < PER; i++)
			CK(cuMemsetD8Async(buf, 0, 256, s));
		us[b] = (now() - t) / PER * 1e6;
		CK(cuStreamSynchronize(s));
	}
	for (int i = 1; i < BATCHES; i++)	/* insertion sort: 41 items */
		for (int j = i; j > 0 && us[j - 1] > us[j]; j--) {
			t = us[j];
			us[j] = us[j - 1];
			us[j - 1] = t;
		}
	*out = us[BATCHES / 2];
	return 0;
}

static int enqueue(void)
{
	struct worker w = { 0 };
	CUstream s;
	CUdeviceptr buf;
	double alone, busy;

	csize = gran;
	nchunks = 64;
	CK(cuCtxSetCurrent(cuctx));
	CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	CK(cuMemAlloc(&buf, 4096));
	if (enqueue_us(s, buf, &alone) || setup(&w))
		return 1;
	churn_stop = 0;
	pthread_create(&w.t, NULL, churn, &w);
	if (enqueue_us(s, buf, &busy))
		return 1;
	churn_stop = 1;
	pthread_join(w.t, NULL);
	if (w.err)
		return 1;
	printf("enqueue: cuMemsetD8Async %.1f us alone, %.1f us while "
	       "another thread maps and unmaps\n", alone, busy);
	for (int c = 0; c < nchunks; c++)
		CK(cuMemRelease(w.h[c]));
	CK(cuMemAddressFree(w.va, (size_t)nchunks * csize));
	free(w.h);
	CK(cuMemFree(buf));
	CK(cuStreamDestroy(s));
	return 0;
}

/* One cuMemUnmap over handles mapped one by one: a run inside, the whole. */
static int runs(void)
{
	enum { N = 64, SUB = 16, REPS = 16 };
	CUmemGenericAllocationHandle h[N];
	CUdeviceptr va;
	CUresult r, whole;
	double t, one = 0, each = 0;

	CK(cuMemAddressReserve(&va, N * gran, 0, 0, 0));
	for (int i = 0; i < N; i++)
		CK(cuMemCreate(&h[i], gran, &prop, 0));
	for (int i = 0; i < N; i++)
		CK(cuMemMap(va + i * gran, gran, 0, h[i], 0));
	CK(cuMemSetAccess(va, N * gran, &acc, 1));
	r = cuMemUnmap(va + 8 * gran, SUB * gran);
	printf("runs: one unmap of %d handles inside %d mapped one by one: "
	       "%s\n", SUB, N, errname(r));
	if (r == CUDA_SUCCESS) {
		for (int i = 8; i < 8 + SUB; i++)
			CK(cuMemMap(va + i * gran, gran, 0, h[i], 0));
		CK(cuMemSetAccess(va + 8 * gran, SUB * gran, &acc, 1));
	}
	whole = cuMemUnmap(va, N * gran);
	printf("runs: one unmap of all %d: %s\n", N, errname(whole));
	if (whole != CUDA_SUCCESS)
		for (int i = 0; i < N; i++)
			CK(cuMemUnmap(va + i * gran, gran));
	for (int k = 0; k < REPS; k++) {
		for (int i = 0; i < N; i++)
			CK(cuMemMap(va + i * gran, gran, 0, h[i], 0));
		CK(cuMemSetAccess(va, N * gran, &acc, 1));
		t = now();
		if (whole == CUDA_SUCCESS && k % 2) {
			CK(cuMemUnmap(va, N * gran));
			one += now() - t;
		} else {
			for (int i = 0; i < N; i++)
				CK(cuMemUnmap(va + i * gran, gran));
			each += now() - t;
		}
	}
	printf("runs: unmap us per 2 MiB: one call per handle %.1f, one call "
	       "for all %.1f\n", each / (REPS - REPS / 2 * (whole == 0)) / N *
	       1e6 * (2 << 20) / gran,
	       whole == CUDA_SUCCESS ? one / (REPS / 2) / N * 1e6 *
	       (2 << 20) / gran : -1.0);
	for (int i = 0; i < N; i++)
		CK(cuMemRelease(h[i]));
	CK(cuMemAddressFree(va, N * gran));
	return 0;
}

/* Queue about ms milliseconds of 1 GiB memsets on s (per: one's time). */
static int queue_ms(CUstream s, CUdeviceptr buf, size_t n, double per,
		    double ms)
{
	for (int i = 0; i < (int)(ms / per) + 1; i++)
		CK(cuMemsetD8Async(buf, (unsigned char)i, n, s));
	return 0;
}

static int busy(void)
{
	static const char *const kind[] = { "cuMemCreate", "cuMemMap",
		"cuMemSetAccess", "cuMemUnmap", "cuMemRelease" };
	enum { K = 5, N = 16 };
	size_t n = (size_t)1 << 30;
	CUmemGenericAllocationHandle h[N];
	CUdeviceptr buf, va;
	CUstream s;
	double t, per, us[K], idle[K];

	CK(cuCtxSetCurrent(cuctx));
	CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	CK(cuMemAlloc(&buf, n));
	CK(cuMemAddressReserve(&va, N * gran, 0, 0, 0));
	CK(cuMemsetD8Async(buf, 0, n, s));
	CK(cuStreamSynchronize(s));
	t = now();
	for (int i = 0; i < 10; i++)
		CK(cuMemsetD8Async(buf, 1, n, s));
	CK(cuStreamSynchronize(s));
	per = (now() - t) / 10 * 1e3;
	for (int pass = 0; pass < 2; pass++) {
		for (int k = 0; k < K; k++) {
			CUresult q;

			if (pass && queue_ms(s, buf, n, per, 50.0))
				return 1;
			t = now();
			for (int i = 0; i < N; i++) {
				CUdeviceptr p = va + i * gran;

				if (k == 0)
					CK(cuMemCreate(&h[i], gran, &prop, 0));
				else if (k == 1)
					CK(cuMemMap(p, gran, 0, h[i], 0));
				else if (k == 2)
					CK(cuMemSetAccess(p, gran, &acc, 1));
				else if (k == 3)
					CK(cuMemUnmap(p, gran));
				else
					CK(cuMemRelease(h[i]));
			}
			(pass ? us : idle)[k] = (now() - t) / N * 1e6;
			q = cuStreamQuery(s);
			if (pass)
				printf("busy: %-14s %8.1f us a call with 50 ms "
				       "queued (%.1f idle); the stream %s "
				       "after %d calls\n", kind[k], us[k],
				       idle[k], q == CUDA_SUCCESS ?
				       "had drained" : "was still busy", N);
			CK(cuStreamSynchronize(s));
		}
	}
	CK(cuMemAddressFree(va, N * gran));
	CK(cuMemFree(buf));
	CK(cuStreamDestroy(s));
	return 0;
}

/* One round of every call over n handles of prop p; us per handle. */
static int export_round(const CUmemAllocationProp *p, int n, double us[5])
{
	CUmemGenericAllocationHandle *h = calloc((size_t)n, sizeof(*h));
	CUdeviceptr va;
	double t;

	if (!h)
		return 1;
	CK(cuMemAddressReserve(&va, (size_t)n * gran, 0, 0, 0));
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuMemCreate(&h[i], gran, p, 0));
	us[0] += (now() - t) * 1e6 / n;
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuMemMap(va + (size_t)i * gran, gran, 0, h[i], 0));
	us[1] += (now() - t) * 1e6 / n;
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuMemSetAccess(va + (size_t)i * gran, gran, &acc, 1));
	us[2] += (now() - t) * 1e6 / n;
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuMemUnmap(va + (size_t)i * gran, gran));
	us[3] += (now() - t) * 1e6 / n;
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuMemRelease(h[i]));
	us[4] += (now() - t) * 1e6 / n;
	CK(cuMemAddressFree(va, (size_t)n * gran));
	free(h);
	return 0;
}

static int export_cost(size_t total)
{
	static const char *const name[] = { "create", "map", "access",
					    "unmap", "release" };
	CUmemAllocationProp fd = prop, both;
	double us[3][5] = { { 0 } };
	int n = (int)(total / gran), rdma = 0;
	size_t rec = 0;

	fd.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	both = fd;
	CK(cuDeviceGetAttribute(&rdma,
		CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev));
	both.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
	/* ncclMemAlloc sizes its handles by the recommended granularity. */
	CK(cuMemGetAllocationGranularity(&rec, &both,
					 CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
	/* Alternating, so drift in the driver's state hits all alike. */
	for (int r = 0; r < ROUNDS; r++)
		if (export_round(&prop, n, us[0]) ||
		    export_round(&fd, n, us[1]) ||
		    export_round(&both, n, us[2]))
			return 1;
	printf("\nexport: %d handles of %zu KiB (recommended granularity %zu "
	       "KiB), %d rounds alternating; us per handle (RDMA capable: %s)"
	       "\n%-8s %9s %9s %9s %7s\n", n, gran >> 10, rec >> 10, ROUNDS,
	       rdma ? "supported" : "not supported",
	       "call", "plain", "posix-fd", "fd+rdma", "ratio");
	for (int k = 0; k < 5; k++)
		printf("%-8s %9.2f %9.2f %9.2f %6.2fx\n", name[k],
		       us[0][k] / ROUNDS, us[1][k] / ROUNDS, us[2][k] / ROUNDS,
		       us[2][k] / us[0][k]);
	return 0;
}

int main(int argc, char **argv)
{
	static const int threads[] = { 1, 2, 4 };
	static const int mult[] = { 1, 4, 16 };
	size_t total = (size_t)256 << 20;

	if (argc > 1)
		total = strtoull(argv[1], NULL, 10) << 20;
	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	CK(cuDevicePrimaryCtxRetain(&cuctx, dev));
	CK(cuMemGetAllocationGranularity(&gran, &prop,
					 CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	if (argc > 2 && !strcmp(argv[2], "export"))
		return export_cost(total);
	printf("%zu MiB per thread, %d rounds; us per 2 MiB\n", total >> 20,
	       ROUNDS);
	printf("%8s %-6s %7s %9s %9s %9s %9s\n", "chunkMiB", "access",
	       "threads", "map", "access", "unmap", "GB/s");
	for (size_t m = 0; m < sizeof(mult) / sizeof(*mult); m++) {
		csize = gran * (size_t)mult[m];
		nchunks = (int)(total / csize);
		if (nchunks < 1)
			return 2;
		for (whole_range = 0; whole_range < 2; whole_range++)
			for (size_t i = 0; i < sizeof(threads) / sizeof(*threads);
			     i++)
				if (measure(threads[i]))
					return 1;
	}
	return pieces() || enqueue() || runs() || busy() || export_cost(total);
}
