/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend of the primitive layer (drv.h).
 *
 * libcuda is never linked. It is opened once with dlopen(); only cuInit,
 * cuDriverGetVersion and cuGetProcAddress_v2 come from dlsym(), and every
 * other entry point is fetched through cuGetProcAddress at an explicit ABI
 * version into the PFN_* types of cudaTypedefs.h, so the library keeps
 * working against newer drivers whose default symbols change. A machine
 * without the driver or without a device gets -ENODEV and a message from
 * open(), never a crash.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef GML_NO_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

#include "drv.h"
#include "error.h"

#ifndef GML_NO_CUDA

/* Oldest driver we accept: cuGetProcAddress_v2 (symbolStatus) is 12.0. */
#define GML_CU_MIN_DRIVER 12000

/*
 * Every driver entry point used past loading: its name, the ABI version
 * we ask for (the suffix of its PFN_ type, which the X-macro pastes, so
 * type and version cannot drift apart), and whether loading fails
 * without it. Stream-ordered calls are fetched in their legacy-stream
 * variants (see gml_cu_fetch()).
 */
#define GML_CU_FOREACH(X)					\
	X(cuGetErrorName, 6000, false)	/* first: see gml_cu_load() */	\
	X(cuDeviceGet, 2000, true)				\
	X(cuDeviceGetCount, 2000, true)				\
	X(cuDeviceGetAttribute, 2000, true)			\
	X(cuDeviceCanAccessPeer, 4000, true)			\
	X(cuDevicePrimaryCtxRetain, 7000, true)			\
	X(cuDevicePrimaryCtxRelease, 11000, true)		\
	X(cuCtxGetCurrent, 4000, true)				\
	X(cuCtxPushCurrent, 4000, true)				\
	X(cuCtxPopCurrent, 4000, true)				\
	X(cuMemGetInfo, 3020, true)				\
	X(cuMemGetAllocationGranularity, 10020, true)		\
	X(cuMemCreate, 10020, true)				\
	X(cuMemRelease, 10020, true)				\
	X(cuMemAddressReserve, 10020, true)			\
	X(cuMemAddressFree, 10020, true)			\
	X(cuMemMap, 10020, true)				\
	X(cuMemUnmap, 10020, true)				\
	X(cuMemSetAccess, 10020, true)				\
	X(cuStreamCreate, 2000, true)				\
	X(cuStreamDestroy, 4000, true)				\
	X(cuStreamSynchronize, 2000, true)			\
	X(cuEventCreate, 2000, true)				\
	X(cuEventDestroy, 4000, true)				\
	X(cuEventRecord, 2000, true)				\
	X(cuEventQuery, 2000, true)				\
	X(cuEventSynchronize, 2000, true)			\
	X(cuMemcpyHtoDAsync, 3020, true)			\
	X(cuMemcpyDtoHAsync, 3020, true)			\
	X(cuMemcpyDtoDAsync, 3020, true)			\
	X(cuStreamWaitEvent, 3020, true)			\
	X(cuLaunchHostFunc, 10000, true)			\
	X(cuMemHostRegister, 6050, true)			\
	X(cuMemHostUnregister, 4000, true)			\
	X(cuMemExportToShareableHandle, 10020, false)		\
	X(cuMemImportFromShareableHandle, 10020, false)

/*
 * The loaded driver. Field names carry a p_ prefix because cuda.h
 * #defines several cu* names to their _v2 spellings.
 */
struct gml_cu_api {
	PFN_cuInit_v2000 init;
	PFN_cuDriverGetVersion_v2020 driver_version;
	PFN_cuGetProcAddress_v12000 get_proc;
#define GML_CU_FIELD(name, ver, req) PFN_##name##_v##ver p_##name;
	GML_CU_FOREACH(GML_CU_FIELD)
#undef GML_CU_FIELD
};

static struct gml_cu_api gml_cu;

struct gml_cu_sym {
	const char *name;
	int version;
	bool required;
	void **pfn;
};

static const struct gml_cu_sym gml_cu_syms[] = {
#define GML_CU_SYM(name, ver, req) { #name, ver, req, (void **)&gml_cu.p_##name },
	GML_CU_FOREACH(GML_CU_SYM)
#undef GML_CU_SYM
};

/* Loading runs once; its result and message are kept for every open(). */
static pthread_once_t gml_cu_once = PTHREAD_ONCE_INIT;
static int gml_cu_load_err;
static char gml_cu_load_msg[256];

/* One open device. */
struct gml_cu_dev {
	CUdevice dev;
	CUcontext ctx;		/* the device's primary context, retained */
	int ordinal;
	int host_numa;		/* closest host NUMA node, -1 if unknown */
	/* Chunks are made exportable as POSIX file descriptors (for other
	 * processes, ipc.c), as PyTorch's expandable segments and
	 * ncclMemAlloc make theirs; cleared for good when the driver
	 * refuses that (a container without it, say). */
	atomic_bool exportable;
	/* Chunks are made GPUDirect RDMA capable (a NIC may read them, as
	 * NCCL's network transports need), where the device supports it
	 * with virtual memory, as PyTorch's expandable segments and
	 * ncclMemAlloc do; dropped with exportable. */
	bool rdma;
};

/*
 * Contexts pushed by enter(), per thread: nesting depth, and one bit per
 * level saying whether that level pushed (and so its leave() pops).
 */
#define GML_CU_MAX_DEPTH 64
static _Thread_local unsigned gml_cu_depth;
static _Thread_local uint64_t gml_cu_pushed;

/* The one mapping of driver results to errnos. */
static int gml_cu_errno(CUresult r)
{
	switch (r) {
	case CUDA_SUCCESS:
		return 0;
	case CUDA_ERROR_OUT_OF_MEMORY:
		return -ENOMEM;
	case CUDA_ERROR_INVALID_VALUE:
	case CUDA_ERROR_INVALID_HANDLE:
		return -EINVAL;
	case CUDA_ERROR_NO_DEVICE:
	case CUDA_ERROR_INVALID_DEVICE:
	case CUDA_ERROR_STUB_LIBRARY:
		return -ENODEV;
	case CUDA_ERROR_NOT_SUPPORTED:
		return -EOPNOTSUPP;
	case CUDA_ERROR_NOT_READY:
		return -EBUSY;
	default:
		return -EIO;
	}
}

/* The driver's name for r ("CUDA_ERROR_OUT_OF_MEMORY"), if it knows it. */
static const char *gml_cu_name(CUresult r)
{
	const char *s = NULL;

	if (gml_cu.p_cuGetErrorName &&
	    gml_cu.p_cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA error";
}

/*
 * Map r to 0 or -errno and, for a failure, store a message naming the
 * operation and the driver's code. CUDA_ERROR_NOT_READY (an event still
 * pending) is a state, not a failure: -EBUSY without a message.
 */
static int gml_cu_err(CUresult r, const char *op)
{
	int err = gml_cu_errno(r);

	if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY)
		return err;
	return gml_set_error(err, "%s: %s (%d)", op, gml_cu_name(r), (int)r);
}

/* Record why loading failed; open() repeats it in the caller's thread. */
__attribute__((format(printf, 2, 3)))
static int gml_cu_load_fail(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(gml_cu_load_msg, sizeof(gml_cu_load_msg), fmt, ap);
	va_end(ap);
	return err;
}

/* Fetch one entry point; NULL and a CUresult or status when it fails. */
static CUresult gml_cu_fetch_one(const struct gml_cu_sym *s,
				 CUdriverProcAddressQueryResult *status)
{
	CUresult r;

	*status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	r = gml_cu.get_proc(s->name, s->pfn, s->version,
			    CU_GET_PROC_ADDRESS_LEGACY_STREAM, status);
	if (r == CUDA_SUCCESS && *status == CU_GET_PROC_ADDRESS_SUCCESS && *s->pfn)
		return CUDA_SUCCESS;
	*s->pfn = NULL;
	return r;
}

/*
 * Fetch every entry point of GML_CU_FOREACH at its ABI version. The
 * legacy-stream flag makes the NULL stream the legacy default stream,
 * the one PyTorch and most CUDA programs use.
 */
static int gml_cu_fetch(void)
{
	CUdriverProcAddressQueryResult status;
	const struct gml_cu_sym *s;
	CUresult r;
	size_t i;

	for (i = 0; i < sizeof(gml_cu_syms) / sizeof(gml_cu_syms[0]); i++) {
		s = &gml_cu_syms[i];
		r = gml_cu_fetch_one(s, &status);
		if (*s->pfn || !s->required)
			continue;
		if (r != CUDA_SUCCESS)
			return gml_cu_load_fail(-ENODEV, "cuGetProcAddress(%s, %d): error %d",
						s->name, s->version, (int)r);
		if (status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
			return gml_cu_load_fail(-EOPNOTSUPP,
						"CUDA driver lacks %s at ABI version %d",
						s->name, s->version);
		return gml_cu_load_fail(-ENODEV, "CUDA driver has no %s", s->name);
	}
	return 0;
}

/* dlopen libcuda and take the three entry points loading starts from. */
static int gml_cu_open_lib(void **libp)
{
	char why[160];
	void *lib;

	lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		/* The first error says most; the fallback's would name .so. */
		snprintf(why, sizeof(why), "%s", dlerror());
		lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
	}
	if (!lib)
		return gml_cu_load_fail(-ENODEV, "libcuda.so.1 not found: no NVIDIA driver (%s)",
					why);
	gml_cu.init = (PFN_cuInit_v2000)dlsym(lib, "cuInit");
	gml_cu.driver_version =
		(PFN_cuDriverGetVersion_v2020)dlsym(lib, "cuDriverGetVersion");
	gml_cu.get_proc = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
	if (!gml_cu.init || !gml_cu.driver_version) {
		dlclose(lib);
		return gml_cu_load_fail(-ENODEV,
					"libcuda has no cuInit or cuDriverGetVersion: not an NVIDIA driver");
	}
	*libp = lib;
	return 0;
}

/*
 * Record a driver call that failed while loading. cuGetErrorName may not
 * be fetched yet (nor fetchable before cuInit), so the common causes get
 * words of their own.
 */
static int gml_cu_load_failed(CUresult r, const char *op)
{
	const char *hint = "";

	if (r == CUDA_ERROR_NO_DEVICE)
		hint = ": no CUDA-capable device";
	else if (r == CUDA_ERROR_STUB_LIBRARY)
		hint = ": the toolkit's stub libcuda, no NVIDIA driver";
	return gml_cu_load_fail(gml_cu_errno(r), "%s: %s (%d)%s", op, gml_cu_name(r),
				(int)r, hint);
}

/*
 * Load the driver: open libcuda, check its version, cuInit, fetch the
 * entry points. After cuInit the library stays loaded for the life of
 * the process, as the driver may have started threads.
 */
static int gml_cu_load(void)
{
	const struct gml_cu_sym *errname = &gml_cu_syms[0];	/* cuGetErrorName */
	CUdriverProcAddressQueryResult status;
	void *lib = NULL;
	int ver = 0;
	CUresult r;
	int err;

	err = gml_cu_open_lib(&lib);
	if (err)
		return err;
	r = gml_cu.driver_version(&ver);
	if (r != CUDA_SUCCESS) {
		err = gml_cu_load_failed(r, "cuDriverGetVersion");
		goto out_dlclose;
	}
	if (ver < GML_CU_MIN_DRIVER) {
		err = gml_cu_load_fail(-EOPNOTSUPP,
				       "CUDA driver %d.%d is too old: 12.0 or newer needed",
				       ver / 1000, ver % 1000 / 10);
		goto out_dlclose;
	}
	if (!gml_cu.get_proc) {
		err = gml_cu_load_fail(-ENODEV, "libcuda has no cuGetProcAddress_v2");
		goto out_dlclose;
	}

	r = gml_cu.init(0);
	if (r != CUDA_SUCCESS) {
		/* For the message only; may not work before cuInit. */
		gml_cu_fetch_one(errname, &status);
		return gml_cu_load_failed(r, "cuInit");
	}
	err = gml_cu_fetch();
	if (err)
		return err;
	gml_log(GMLAKE_LOG_DEBUG, "cuda: driver %d.%d loaded",
		ver / 1000, ver % 1000 / 10);
	return 0;

out_dlclose:
	dlclose(lib);
	return err;
}

static void gml_cu_load_once(void)
{
	gml_cu_load_err = gml_cu_load();
}

/*
 * Open device cfg->device: load the driver (once per process), check
 * that the device exists and supports virtual memory management, and
 * retain its primary context, the one the CUDA runtime also uses, so
 * that our pointers and streams are the caller's too.
 */
static int gml_cu_open(const struct gmlake_config *cfg, void **priv)
{
	struct gml_cu_dev *d;
	int count = 0, vmm = 0;
	CUresult r;
	int err;

	pthread_once(&gml_cu_once, gml_cu_load_once);
	if (gml_cu_load_err)
		return gml_set_error(gml_cu_load_err, "%s", gml_cu_load_msg);
	if (!cfg || !priv)
		return gml_set_error(-EINVAL, "cuda: open without a config");

	r = gml_cu.p_cuDeviceGetCount(&count);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuDeviceGetCount");
	if (cfg->device < 0 || cfg->device >= count)
		return gml_set_error(-ENODEV, "cuda: no device %d (device count %d)",
				     cfg->device, count);

	d = calloc(1, sizeof(*d));
	if (!d)
		return gml_set_error(-ENOMEM, "cuda: out of host memory");
	d->ordinal = cfg->device;
	r = gml_cu.p_cuDeviceGet(&d->dev, cfg->device);
	if (r != CUDA_SUCCESS) {
		err = gml_cu_err(r, "cuDeviceGet");
		goto out_free;
	}
	r = gml_cu.p_cuDeviceGetAttribute(&vmm,
			CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev);
	if (r != CUDA_SUCCESS) {
		err = gml_cu_err(r, "cuDeviceGetAttribute");
		goto out_free;
	}
	if (!vmm) {
		err = gml_set_error(-EOPNOTSUPP, "cuda: device %d has no virtual memory management",
				    cfg->device);
		goto out_free;
	}
	d->host_numa = -1;
#if CUDA_VERSION >= 12020
	if (gml_cu.p_cuDeviceGetAttribute(&d->host_numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
					  d->dev) != CUDA_SUCCESS)
		d->host_numa = -1;
#endif
	{
		int fd = 0, rdma = 0;

		if (gml_cu.p_cuMemExportToShareableHandle &&
		    gml_cu.p_cuMemImportFromShareableHandle &&
		    gml_cu.p_cuDeviceGetAttribute(&fd,
				CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
				d->dev) != CUDA_SUCCESS)
			fd = 0;
		if (gml_cu.p_cuDeviceGetAttribute(&rdma,
				CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
				d->dev) != CUDA_SUCCESS)
			rdma = 0;
		atomic_init(&d->exportable, fd && cfg->exportable);
		d->rdma = rdma && cfg->exportable;
	}
	r = gml_cu.p_cuDevicePrimaryCtxRetain(&d->ctx, d->dev);
	if (r != CUDA_SUCCESS) {
		err = gml_cu_err(r, "cuDevicePrimaryCtxRetain");
		goto out_free;
	}
	gml_log(GMLAKE_LOG_DEBUG, "cuda: device %d open, host NUMA node %d",
		d->ordinal, d->host_numa);
	*priv = d;
	return 0;

out_free:
	free(d);
	return err;
}

/* Release the primary context retained by open(). */
static void gml_cu_close(void *priv)
{
	struct gml_cu_dev *d = priv;
	CUresult r;

	if (!d)
		return;
	r = gml_cu.p_cuDevicePrimaryCtxRelease(d->dev);
	if (r != CUDA_SUCCESS)
		gml_log(GMLAKE_LOG_WARN, "cuda: cuDevicePrimaryCtxRelease: %s (%d)",
			gml_cu_name(r), (int)r);
	free(d);
}

/*
 * Make the device's primary context current in this thread, unless it
 * already is; leave() pops only what enter() pushed. Calls nest. When
 * enter() fails nothing changed, and leave() must not be called.
 */
static int gml_cu_enter(void *priv)
{
	struct gml_cu_dev *d = priv;
	CUcontext cur = NULL;
	CUresult r;

	if (gml_cu_depth >= GML_CU_MAX_DEPTH)
		return gml_set_error(-EOVERFLOW, "cuda: enter nested deeper than %d",
				     GML_CU_MAX_DEPTH);
	r = gml_cu.p_cuCtxGetCurrent(&cur);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuCtxGetCurrent");
	if (cur != d->ctx) {
		r = gml_cu.p_cuCtxPushCurrent(d->ctx);
		if (r != CUDA_SUCCESS)
			return gml_cu_err(r, "cuCtxPushCurrent");
		gml_cu_pushed |= UINT64_C(1) << gml_cu_depth;
	}
	gml_cu_depth++;
	return 0;
}

static void gml_cu_leave(void *priv)
{
	struct gml_cu_dev *d = priv;
	CUcontext popped = NULL;
	uint64_t bit;
	CUresult r;

	if (!gml_cu_depth) {
		gml_log(GMLAKE_LOG_WARN, "cuda: leave without enter");
		return;
	}
	gml_cu_depth--;
	bit = UINT64_C(1) << gml_cu_depth;
	if (!(gml_cu_pushed & bit))
		return;
	gml_cu_pushed &= ~bit;
	r = gml_cu.p_cuCtxPopCurrent(&popped);
	if (r != CUDA_SUCCESS || popped != d->ctx)
		gml_log(GMLAKE_LOG_WARN, "cuda: leave popped %s context (%d)",
			r == CUDA_SUCCESS ? "a foreign" : "no", (int)r);
}

/* Properties of our chunks: pinned device memory on this device. */
static void gml_cu_prop(const struct gml_cu_dev *d, CUmemAllocationProp *prop)
{
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = d->dev;
}

/*
 * Called by gml_dev_open() before any enter(): enter here, so that the
 * query runs with the primary context current even in a thread that has
 * none (an autograd thread, say).
 */
static int gml_cu_granularity(void *priv, size_t *gran)
{
	CUmemAllocationProp prop;
	CUresult r;
	int err;

	err = gml_cu_enter(priv);
	if (err)
		return err;
	gml_cu_prop(priv, &prop);
	r = gml_cu.p_cuMemGetAllocationGranularity(gran, &prop,
						   CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	gml_cu_leave(priv);
	return gml_cu_err(r, "cuMemGetAllocationGranularity");
}

static int gml_cu_mem_info(void *priv, size_t *avail, size_t *total)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuMemGetInfo(avail, total), "cuMemGetInfo");
}

static int gml_cu_mem_create(void *priv, size_t size, gml_handle *h)
{
	struct gml_cu_dev *d = priv;
	CUmemGenericAllocationHandle handle;
	CUmemAllocationProp prop;
	CUresult r, fd_r = CUDA_SUCCESS;

	gml_cu_prop(d, &prop);
	if (atomic_load_explicit(&d->exportable, memory_order_relaxed)) {
		prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
		prop.allocFlags.gpuDirectRDMACapable = d->rdma;
		r = gml_cu.p_cuMemCreate(&handle, size, &prop, 0);
		if (r != CUDA_ERROR_NOT_SUPPORTED &&
		    r != CUDA_ERROR_NOT_PERMITTED &&
		    r != CUDA_ERROR_INVALID_VALUE)
			goto out;
		fd_r = r;
		prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
		prop.allocFlags.gpuDirectRDMACapable = 0;
	}
	r = gml_cu.p_cuMemCreate(&handle, size, &prop, 0);
	/* Refused for the handle type, not the memory: say so once, and
	 * make the rest unshareable too. */
	if (r == CUDA_SUCCESS && fd_r != CUDA_SUCCESS &&
	    atomic_exchange(&d->exportable, false))
		gml_log(GMLAKE_LOG_INFO, "cuda: device %d refuses exportable "
			"memory (%s): blocks cannot be shared with other "
			"processes", d->ordinal, gml_cu_name(fd_r));
out:
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuMemCreate");
	*h = handle;
	return 0;
}

/* A file descriptor for h; only chunks made while d->exportable was on
 * have one (the driver says CUDA_ERROR_INVALID_VALUE for the others). */
static int gml_cu_mem_export(void *priv, gml_handle h, int *fd, uint64_t *off)
{
	struct gml_cu_dev *d = priv;
	int got = -1;
	CUresult r;

	if (!gml_cu.p_cuMemExportToShareableHandle)
		return gml_set_error(-EOPNOTSUPP, "cuda: the driver cannot "
				     "export memory");
	r = gml_cu.p_cuMemExportToShareableHandle(&got, h,
			CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (r != CUDA_SUCCESS) {
		if (!atomic_load(&d->exportable))
			return gml_set_error(-EOPNOTSUPP, "cuda: device %d "
				"makes unexportable memory (GMLAKE_EXPORTABLE "
				"off, or the driver refused POSIX file "
				"descriptor handles): "
				"cuMemExportToShareableHandle: %s", d->ordinal,
				gml_cu_name(r));
		return gml_cu_err(r, "cuMemExportToShareableHandle");
	}
	*fd = got;
	*off = 0;
	return 0;
}

static int gml_cu_mem_import(void *priv, int fd, uint64_t off, size_t size,
			     gml_handle *h)
{
	CUmemGenericAllocationHandle handle;
	CUresult r;

	(void)priv;
	(void)size;
	if (!gml_cu.p_cuMemImportFromShareableHandle)
		return gml_set_error(-EOPNOTSUPP, "cuda: the driver cannot "
				     "import memory");
	if (off)
		return gml_set_error(-EINVAL, "cuda: an exported handle "
				     "starts at offset 0, not %llu",
				     (unsigned long long)off);
	r = gml_cu.p_cuMemImportFromShareableHandle(&handle,
			(void *)(uintptr_t)fd,
			CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuMemImportFromShareableHandle");
	*h = handle;
	return 0;
}

static int gml_cu_mem_release(void *priv, gml_handle h)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuMemRelease(h), "cuMemRelease");
}

static int gml_cu_va_reserve(void *priv, size_t size, size_t align, gml_va *va)
{
	CUdeviceptr ptr;
	CUresult r;

	(void)priv;
	r = gml_cu.p_cuMemAddressReserve(&ptr, size, align, 0, 0);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuMemAddressReserve");
	*va = ptr;
	return 0;
}

static int gml_cu_va_free(void *priv, gml_va va, size_t size)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuMemAddressFree(va, size), "cuMemAddressFree");
}

static int gml_cu_mem_map(void *priv, gml_va va, size_t size, gml_handle h)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuMemMap(va, size, 0, h, 0), "cuMemMap");
}

static int gml_cu_mem_unmap(void *priv, gml_va va, size_t size)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuMemUnmap(va, size), "cuMemUnmap");
}

/* One call for the whole range, however many chunks back it: a
 * descriptor for the device and one per peer. */
static int gml_cu_set_access(void *priv, gml_va va, size_t size,
			     const int *peers, int npeers)
{
	const struct gml_cu_dev *d = priv;
	CUmemAccessDesc desc[1 + GML_MAX_PEERS];

	if (npeers < 0 || npeers > GML_MAX_PEERS)
		return gml_set_error(-EINVAL, "cuda: set_access: %d peers",
				     npeers);
	memset(desc, 0, sizeof(desc));
	for (int i = 0; i <= npeers; i++) {
		desc[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		desc[i].location.id = i ? peers[i - 1] : d->dev;
		desc[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	}
	return gml_cu_err(gml_cu.p_cuMemSetAccess(va, size, desc,
						  (size_t)npeers + 1),
			  "cuMemSetAccess");
}

static int gml_cu_peer_check(void *priv, int peer)
{
	const struct gml_cu_dev *d = priv;
	CUdevice pd;
	int count = 0, can = 0, ret;

	if (peer == d->ordinal)
		return gml_set_error(-EINVAL, "cuda: device %d is no peer of "
				     "itself", peer);
	ret = gml_cu_err(gml_cu.p_cuDeviceGetCount(&count),
			 "cuDeviceGetCount");
	if (ret)
		return ret;
	if (peer < 0 || peer >= count)
		return gml_set_error(-EINVAL, "cuda: no device %d (%d devices)",
				     peer, count);
	ret = gml_cu_err(gml_cu.p_cuDeviceGet(&pd, peer), "cuDeviceGet");
	if (!ret)
		ret = gml_cu_err(gml_cu.p_cuDeviceCanAccessPeer(&can, pd,
								 d->dev),
				 "cuDeviceCanAccessPeer");
	if (!ret && !can)
		ret = gml_set_error(-ENODEV, "cuda: device %d cannot access "
				    "device %d's memory", peer, d->ordinal);
	return ret;
}

static int gml_cu_stream_create(void *priv, gmlake_stream_t *s)
{
	CUstream stream;
	CUresult r;

	(void)priv;
	r = gml_cu.p_cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuStreamCreate");
	*s = stream;
	return 0;
}

static int gml_cu_stream_destroy(void *priv, gmlake_stream_t s)
{
	(void)priv;
	if (!s)
		return gml_set_error(-EINVAL, "cuda: cannot destroy the default stream");
	return gml_cu_err(gml_cu.p_cuStreamDestroy(s), "cuStreamDestroy");
}

/* s may be NULL: the legacy default stream. */
static int gml_cu_stream_sync(void *priv, gmlake_stream_t s)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuStreamSynchronize(s), "cuStreamSynchronize");
}

static int gml_cu_event_create(void *priv, gml_event *e)
{
	CUevent event;
	CUresult r;

	(void)priv;
	r = gml_cu.p_cuEventCreate(&event, CU_EVENT_DISABLE_TIMING);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuEventCreate");
	*e = event;
	return 0;
}

static int gml_cu_event_destroy(void *priv, gml_event e)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuEventDestroy((CUevent)e), "cuEventDestroy");
}

static int gml_cu_event_record(void *priv, gml_event e, gmlake_stream_t s)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuEventRecord((CUevent)e, s), "cuEventRecord");
}

/* 0 when the event's work is complete, -EBUSY while it is pending. */
static int gml_cu_event_query(void *priv, gml_event e)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuEventQuery((CUevent)e), "cuEventQuery");
}

static int gml_cu_event_sync(void *priv, gml_event e)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuEventSynchronize((CUevent)e), "cuEventSynchronize");
}

static int gml_cu_memcpy_async(void *priv, void *dst, const void *src, size_t size,
			       enum gml_copy_kind kind, gmlake_stream_t s)
{
	CUdeviceptr ddst = (CUdeviceptr)(uintptr_t)dst;
	CUdeviceptr dsrc = (CUdeviceptr)(uintptr_t)src;

	(void)priv;
	switch (kind) {
	case GML_COPY_HTOD:
		return gml_cu_err(gml_cu.p_cuMemcpyHtoDAsync(ddst, src, size, s),
				  "cuMemcpyHtoDAsync");
	case GML_COPY_DTOH:
		return gml_cu_err(gml_cu.p_cuMemcpyDtoHAsync(dst, dsrc, size, s),
				  "cuMemcpyDtoHAsync");
	case GML_COPY_DTOD:
		return gml_cu_err(gml_cu.p_cuMemcpyDtoDAsync(ddst, dsrc, size, s),
				  "cuMemcpyDtoDAsync");
	}
	return gml_set_error(-EINVAL, "cuda: unknown copy kind %d", (int)kind);
}

static int gml_cu_stream_wait(void *priv, gmlake_stream_t s, gml_event e)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuStreamWaitEvent(s, (CUevent)e, 0),
			  "cuStreamWaitEvent");
}

/* fn runs on a driver thread and must not call the driver. */
static int gml_cu_host_func(void *priv, gmlake_stream_t s, void (*fn)(void *),
			    void *arg)
{
	(void)priv;
	return gml_cu_err(gml_cu.p_cuLaunchHostFunc(s, fn, arg),
			  "cuLaunchHostFunc");
}

/*
 * Portable: the pages serve copies on every context. The offload engine
 * pins from its own thread, outside any context operation, so these make
 * the primary context current themselves.
 */
static int gml_cu_host_register(void *priv, void *p, size_t size)
{
	CUresult r;
	int err;

	err = gml_cu_enter(priv);
	if (err)
		return err;
	r = gml_cu.p_cuMemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE);
	gml_cu_leave(priv);
	return gml_cu_err(r, "cuMemHostRegister");
}

static int gml_cu_host_unregister(void *priv, void *p)
{
	CUresult r;
	int err;

	err = gml_cu_enter(priv);
	if (err)
		return err;
	r = gml_cu.p_cuMemHostUnregister(p);
	gml_cu_leave(priv);
	return gml_cu_err(r, "cuMemHostUnregister");
}

static int gml_cu_host_numa(void *priv, int *node)
{
	const struct gml_cu_dev *d = priv;

	*node = d->host_numa;
	return 0;
}

/*
 * Host memory on a NUMA node that maps into device ranges like a chunk
 * (CUDA 12.2 and later): a spilled block mapped at its own address reads
 * the right bytes over the bus instead of faulting.
 */
static int gml_cu_mem_create_host(void *priv, size_t size, int numa,
				  gml_handle *h)
{
#if CUDA_VERSION >= 12020
	const struct gml_cu_dev *d = priv;
	CUmemGenericAllocationHandle handle;
	CUmemAllocationProp prop;
	CUresult r;

	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
	prop.location.id = numa >= 0 ? numa : (d->host_numa >= 0 ? d->host_numa : 0);
	r = gml_cu.p_cuMemCreate(&handle, size, &prop, 0);
	if (r != CUDA_SUCCESS)
		return gml_cu_err(r, "cuMemCreate(HOST_NUMA)");
	*h = handle;
	return 0;
#else
	return gml_set_error(-EOPNOTSUPP, "cuda: host NUMA memory needs CUDA 12.2 headers");
#endif
}

const struct gml_drv_ops gml_drv_cuda = {
	.name = "cuda",
	.open = gml_cu_open,
	.close = gml_cu_close,
	.enter = gml_cu_enter,
	.leave = gml_cu_leave,
	.granularity = gml_cu_granularity,
	.mem_info = gml_cu_mem_info,
	.mem_create = gml_cu_mem_create,
	.mem_release = gml_cu_mem_release,
	.va_reserve = gml_cu_va_reserve,
	.va_free = gml_cu_va_free,
	.mem_map = gml_cu_mem_map,
	.mem_unmap = gml_cu_mem_unmap,
	.set_access = gml_cu_set_access,
	.peer_check = gml_cu_peer_check,
	.stream_create = gml_cu_stream_create,
	.stream_destroy = gml_cu_stream_destroy,
	.stream_sync = gml_cu_stream_sync,
	.event_create = gml_cu_event_create,
	.event_destroy = gml_cu_event_destroy,
	.event_record = gml_cu_event_record,
	.event_query = gml_cu_event_query,
	.event_sync = gml_cu_event_sync,
	.memcpy_async = gml_cu_memcpy_async,
	.stream_wait = gml_cu_stream_wait,
	.host_func = gml_cu_host_func,
	.host_register = gml_cu_host_register,
	.host_unregister = gml_cu_host_unregister,
	.host_numa = gml_cu_host_numa,
	.mem_create_host = gml_cu_mem_create_host,
	.mem_export = gml_cu_mem_export,
	.mem_import = gml_cu_mem_import,
};

#else /* GML_NO_CUDA */

/*
 * Built without the CUDA headers: the backend exists, so selecting it gives
 * a clear error rather than a silent fall back to the emulated device.
 */
static int no_cuda_open(const struct gmlake_config *cfg, void **priv)
{
	return gml_set_error(-ENODEV, "this libgmlake was built without the "
			     "CUDA headers: reconfigure with --with-cuda=DIR "
			     "to use a GPU");
}

const struct gml_drv_ops gml_drv_cuda = {
	.name = "cuda",
	.open = no_cuda_open,
};

#endif /* GML_NO_CUDA */
