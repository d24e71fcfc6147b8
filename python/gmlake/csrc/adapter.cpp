// SPDX-License-Identifier: MIT
//
// libgmlake as PyTorch's CUDA allocator: an implementation of
// c10::cuda::CUDACachingAllocator::CUDAAllocator that forwards every call
// to libgmlake's C API (include/gmlake-torch.h, gmlake-snapshot.h) and
// turns its answers into PyTorch's types: a failed allocation into
// c10::OutOfMemoryError, the statistics into DeviceStats, snapshots and the
// allocation history into SnapshotInfo. It holds no allocator policy: the
// private pools of CUDA graphs, the statistics under PyTorch's names and
// the history ring are in the C library. What it keeps is what only C++
// can: PyTorch's routing filters (std::function) of beginAllocateToPool,
// the out-of-memory observers, the history's context recorder, and
// checkpoints as PyTorch's AllocatorState objects.
//
// gmlake.torch builds it once with torch.utils.cpp_extension against the
// installed torch (PyTorch 2.11's interface) and calls install(path) with
// the libgmlake.so that gmlake._lib loaded: the C functions are taken from
// that library with dlsym, so one library instance serves both this
// adapter and gmlake.stats().

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>

#include "gmlake-snapshot.h"
#include "gmlake-torch.h"
#include "gmlake.h"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using c10::CaptureId_t;
using c10::DeviceIndex;
using c10::MempoolId_t;

// The C functions used here, taken from the loaded libgmlake by name.
#define GML_ADAPTER_FUNCS(X)               \
  X(gmlake_version_major)                  \
  X(gmlake_version_minor)                  \
  X(gmlake_last_error)                     \
  X(gmlake_block_size)                     \
  X(gmlake_snapshot_take)                  \
  X(gmlake_snapshot_free)                  \
  X(gmlake_torch_alloc)                    \
  X(gmlake_torch_free)                     \
  X(gmlake_torch_raw_delete)               \
  X(gmlake_torch_init)                     \
  X(gmlake_torch_empty_cache)              \
  X(gmlake_torch_memory_fraction)          \
  X(gmlake_torch_memory_fraction_get)      \
  X(gmlake_torch_record_stream)            \
  X(gmlake_torch_ctx_get)                  \
  X(gmlake_torch_ipc_share)                \
  X(gmlake_torch_ipc_open)                 \
  X(gmlake_torch_ipc_close)                \
  X(gmlake_torch_set_fail_level)           \
  X(gmlake_torch_stats_get)                \
  X(gmlake_torch_stats_reset_peaks)        \
  X(gmlake_torch_stats_reset_accumulated)  \
  X(gmlake_torch_cache_info)               \
  X(gmlake_torch_pool_begin)               \
  X(gmlake_torch_pool_end)                 \
  X(gmlake_torch_pool_incref)              \
  X(gmlake_torch_pool_release)             \
  X(gmlake_torch_pool_use_count)           \
  X(gmlake_torch_pool_alloc)               \
  X(gmlake_torch_pool_check_live)          \
  X(gmlake_torch_pool_empty)               \
  X(gmlake_torch_pool_of)                  \
  X(gmlake_torch_pool_live)                \
  X(gmlake_torch_pool_restore)             \
  X(gmlake_torch_pool_routing)             \
  X(gmlake_torch_pool_set_source)          \
  X(gmlake_torch_peer_access)              \
  X(gmlake_torch_pool_segments)            \
  X(gmlake_torch_set_sync_hook)            \
  X(gmlake_torch_history_start)            \
  X(gmlake_torch_history_stop)             \
  X(gmlake_torch_history_enabled)          \
  X(gmlake_torch_history_read)

struct Api {
#define GML_API_FIELD(name) decltype(&::name) name = nullptr;
  GML_ADAPTER_FUNCS(GML_API_FIELD)
#undef GML_API_FIELD
};

// Filled once by install(); plain data, never destroyed, so deleters that
// run during interpreter shutdown still find it.
Api api;
std::string api_path;

constexpr int kMaxDevices = 128; // lib/torch.h GML_TORCH_MAX_DEVICES

std::string last_error() {
  const char* msg = api.gmlake_last_error();
  return msg && *msg ? msg : "no message";
}

// Messages with numbers are formatted here, never by inserting a number
// into a stream (c10::str, TORCH_CHECK's extra arguments): on the H200's
// toolchain the adapter's std::ostream number insertion crashed (SIGSEGV
// in num_put on a null facet), which is what turned every out-of-memory
// error into a crash. Strings alone go through c10::str safely.
std::string fmt(const char* format, ...)
    __attribute__((format(printf, 1, 2)));
std::string fmt(const char* format, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, format);
  int n = vsnprintf(buf, sizeof(buf), format, ap);
  va_end(ap);
  if (n < 0)
    return format;
  if (static_cast<size_t>(n) < sizeof(buf))
    return std::string(buf, n);
  std::string out(static_cast<size_t>(n) + 1, '\0');
  va_start(ap, format);
  vsnprintf(&out[0], out.size(), format, ap);
  va_end(ap);
  out.resize(n);
  return out;
}

std::string fmt_size(size_t n) {
  static const char* const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  char buf[64];
  if (u)
    snprintf(buf, sizeof(buf), "%.2f %s", v, unit[u]);
  else
    snprintf(buf, sizeof(buf), "%zu bytes", n);
  return buf;
}

// ---------------------------------------------------------------------------
// Frees. One deleter for every DataPtr, the one raw_deleter() returns:
// PyTorch compares them (CUDA graph trees assert _has_Standard_Deleter).

// Routings begun and not yet ended, on any device (beginAllocateToPool).
std::atomic<int> g_routes{0};

void delete_any(void* ptr) {
  if (!ptr)
    return;
  if (C10_UNLIKELY(g_routes.load(std::memory_order_relaxed) > 0)) {
    // Another thread may be capturing a graph in global mode.
    try {
      c10::cuda::CUDAStreamCaptureModeGuard g{cudaStreamCaptureModeRelaxed};
      api.gmlake_torch_raw_delete(ptr);
      return;
    } catch (...) {
    }
  }
  api.gmlake_torch_raw_delete(ptr);
}

// The device whose context holds ptr, or -1.
int device_of(const void* ptr) {
  int n = c10::cuda::device_count();
  for (int d = 0; d < n && d < kMaxDevices; d++) {
    gmlake_ctx* ctx = nullptr;
    size_t size = 0;
    if (!api.gmlake_torch_ctx_get(d, &ctx) &&
        !api.gmlake_block_size(ctx, ptr, &size))
      return d;
  }
  return -1;
}

// ---------------------------------------------------------------------------
// History hooks: PyTorch's clock and context recorder, called by the C ring.

std::atomic<cca::CreateContextFn> g_recorder{nullptr};
std::atomic<int> g_when{static_cast<int>(cca::RecordContext::NEVER)};

using ContextPtr = std::shared_ptr<c10::GatheredContext>;

uint64_t hook_clock() {
  return static_cast<uint64_t>(c10::getApproximateTime());
}

bool wants_context(int action) {
  auto when = static_cast<cca::RecordContext>(g_when.load());
  switch (action) {
    case GMLAKE_TORCH_ALLOC:
    case GMLAKE_TORCH_SEGMENT_ALLOC:
    case GMLAKE_TORCH_OOM:
      return when == cca::RecordContext::ALLOC ||
          when == cca::RecordContext::ALL;
    case GMLAKE_TORCH_FREE_REQUESTED:
    case GMLAKE_TORCH_FREE_COMPLETED:
    case GMLAKE_TORCH_SEGMENT_FREE:
      return when == cca::RecordContext::ALL;
    default:
      return false;
  }
}

void* hook_context(int action) {
  try {
    cca::CreateContextFn rec = g_recorder.load();
    if (!rec || !wants_context(action))
      return nullptr;
    ContextPtr c = rec();
    return c ? new ContextPtr(std::move(c)) : nullptr;
  } catch (...) {
    return nullptr;
  }
}

void* hook_context_dup(void* c) {
  return c ? new ContextPtr(*static_cast<ContextPtr*>(c)) : nullptr;
}

void hook_context_free(void* c) {
  delete static_cast<ContextPtr*>(c);
}

// Called by the C library before the parked blocks of a released pool go:
// a replay may still run on a stream it never saw.
int hook_sync(int device) {
  try {
    if (api.gmlake_torch_pool_routing(device))
      return -EBUSY; // a capture forbids a device sync
    c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  } catch (...) {
    return -EIO;
  }
}

uint32_t skip_mask(const std::vector<std::string>& skip) {
  static const char* const names[] = {
      "alloc",
      "free_requested",
      "free_completed",
      "segment_alloc",
      "segment_free",
      "segment_map",
      "segment_unmap",
      "snapshot",
      "oom"};
  uint32_t mask = 0;
  for (const auto& s : skip) {
    bool known = false;
    for (uint32_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
      if (s == names[i]) {
        mask |= 1u << i;
        known = true;
      }
    }
    TORCH_CHECK(known, "libgmlake: unknown trace action to skip: ", s);
  }
  return mask;
}

// ---------------------------------------------------------------------------
// Pools with an allocator of their own: torch.cuda.MemPool(allocator=...),
// as torch.distributed's NCCL backend makes them for buffers it registers
// (register_mem_pool). libgmlake keeps the pool (parking, reuse, its end);
// these only call the allocator, and tell the trace trackers (NCCL's
// registration hooks) of each segment after it came and before it goes.

std::mutex g_trackers_mutex;
std::vector<cda::AllocatorTraceTracker> g_trackers;

struct PoolSource {
  std::shared_ptr<cca::CUDAAllocator> allocator;
  MempoolId_t pool;
};

void warn_quietly(const std::string& msg) {
  try {
    TORCH_WARN(msg);
  } catch (...) {
  }
}

void tell_trackers(
    cda::TraceEntry::Action action,
    int device,
    void* ptr,
    size_t size,
    cudaStream_t stream,
    MempoolId_t pool) {
  std::vector<cda::AllocatorTraceTracker> trackers;
  {
    std::lock_guard<std::mutex> lock(g_trackers_mutex);
    trackers = g_trackers;
  }
  if (trackers.empty())
    return;
  try {
    cda::TraceEntry te(
        action,
        static_cast<DeviceIndex>(device),
        reinterpret_cast<size_t>(ptr),
        size,
        static_cast<void*>(stream),
        pool,
        c10::getApproximateTime());
    for (auto& t : trackers)
      t(te);
  } catch (const std::exception& e) {
    // NCCL's registration failed: collectives still work, unregistered.
    warn_quietly(
        std::string("libgmlake: a trace tracker failed on a memory "
                    "pool's segment: ") +
        e.what());
  }
}

void* source_alloc(size_t size, int device, gmlake_stream_t stream,
                   void* user) {
  auto* src = static_cast<PoolSource*>(user);
  void* p = nullptr;
  try {
    c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
    p = src->allocator->raw_alloc_with_stream(size, stream);
  } catch (const std::exception& e) {
    warn_quietly(
        std::string("libgmlake: a memory pool's own allocator failed: ") +
        e.what());
    return nullptr;
  }
  if (p)
    tell_trackers(
        cda::TraceEntry::SEGMENT_ALLOC, device, p, size, stream, src->pool);
  return p;
}

void source_free(void* ptr, size_t size, int device, gmlake_stream_t stream,
                 void* user) {
  auto* src = static_cast<PoolSource*>(user);
  // Deregistered before the memory goes, as PyTorch's own allocator does.
  tell_trackers(
      cda::TraceEntry::SEGMENT_FREE, device, ptr, size, stream, src->pool);
  try {
    c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
    src->allocator->raw_delete(ptr);
  } catch (const std::exception& e) {
    warn_quietly(
        std::string("libgmlake: a memory pool's own allocator could not "
                    "free a segment: ") +
        e.what());
  }
}

void source_done(void* user) {
  delete static_cast<PoolSource*>(user);
}

// ---------------------------------------------------------------------------

void put_stat(cda::StatArray& a, const gmlake_torch_stat& s) {
  auto& t = a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  t.current = s.current;
  t.peak = s.peak;
  t.allocated = s.allocated;
  t.freed = s.freed;
}

// A checkpoint of a private pool: its live blocks (CUDA graph trees).
struct PoolState : cca::AllocatorState {
  DeviceIndex device = 0;
  MempoolId_t pool{0, 0};
  std::vector<void*> live;
};

std::vector<void*> pool_live(DeviceIndex device, MempoolId_t id) {
  for (;;) {
    int n = api.gmlake_torch_pool_live(device, id.first, id.second, nullptr, 0);
    TORCH_CHECK(n >= 0, "libgmlake: the pool's live blocks: ", last_error());
    std::vector<void*> v(static_cast<size_t>(n));
    int m = api.gmlake_torch_pool_live(
        device, id.first, id.second, v.data(), v.size());
    TORCH_CHECK(m >= 0, "libgmlake: the pool's live blocks: ", last_error());
    if (m <= n) {
      v.resize(static_cast<size_t>(m));
      return v;
    }
  }
}

struct Route {
  DeviceIndex device;
  MempoolId_t pool;
  std::function<bool(cudaStream_t)> filter;
};

class GmlakeAllocator final : public cca::CUDAAllocator {
 public:
  // -- allocation ----------------------------------------------------------

  c10::DataPtr allocate(size_t size) override {
    DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
    TORCH_CHECK(
        device >= 0 && device < kMaxDevices,
        fmt("libgmlake serves CUDA devices 0 to %d, not %d",
            kMaxDevices - 1,
            static_cast<int>(device)));
    void* p = malloc(size, device, stream);
    return {p, p, &delete_any, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_any;
  }

  void* raw_alloc(size_t nbytes) override {
    DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device));
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override {
    delete_any(ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count)
      const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // -- setup and the cache -------------------------------------------------

  void init(int device_count) override {
    api.gmlake_torch_init(device_count);
    initialized_ = true;
  }

  bool initialized() override {
    return initialized_;
  }

  double getMemoryFraction(DeviceIndex device) override {
    double f = 1.0;
    TORCH_CHECK(
        api.gmlake_torch_memory_fraction_get(device, &f) == 0,
        "libgmlake: ",
        last_error());
    return f;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    api.gmlake_torch_memory_fraction(fraction, device);
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(
      DeviceIndex /*device*/) override {
    return {}; // libgmlake has no expandable segments
  }

  void enable(bool /*value*/) override {}
  bool isEnabled() const override {
    return true;
  }

  void emptyCache(MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      api.gmlake_torch_empty_cache();
      return;
    }
    DeviceIndex device = c10::cuda::current_device();
    api.gmlake_torch_pool_empty(device, mempool_id.first, mempool_id.second);
  }

  void cacheInfo(DeviceIndex device, size_t* largestBlock) override {
    size_t largest = 0;
    TORCH_CHECK(
        api.gmlake_torch_cache_info(device, &largest) == 0,
        "libgmlake: ",
        last_error());
    *largestBlock = largest;
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    // Every block is its own base: libgmlake blocks are not carved out of
    // a segment the caller could address.
    int d = device_of(ptr);
    gmlake_ctx* ctx = nullptr;
    if (size) {
      *size = 0;
      if (d >= 0 && !api.gmlake_torch_ctx_get(d, &ctx))
        api.gmlake_block_size(ctx, ptr, size);
    }
    return ptr;
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream)
      override {
    if (!ptr.get() || ptr.get_deleter() != &delete_any)
      return; // not ours (a tensor shared from another process)
    api.gmlake_torch_record_stream(ptr.get(), stream.stream());
  }

  // -- statistics ----------------------------------------------------------

  cda::DeviceStats getDeviceStats(DeviceIndex device) override {
    gmlake_torch_stats st{};
    st.version = GMLAKE_TORCH_STATS_VERSION;
    st.size = sizeof(st);
    TORCH_CHECK(
        api.gmlake_torch_stats_get(device, &st) == 0,
        "libgmlake: memory statistics: ",
        last_error());
    cda::DeviceStats s;
    put_stat(s.allocation, st.allocation);
    put_stat(s.segment, st.segment);
    put_stat(s.active, st.active);
    put_stat(s.inactive_split, st.inactive_split);
    put_stat(s.allocated_bytes, st.allocated_bytes);
    put_stat(s.reserved_bytes, st.reserved_bytes);
    put_stat(s.active_bytes, st.active_bytes);
    put_stat(s.inactive_split_bytes, st.inactive_split_bytes);
    put_stat(s.requested_bytes, st.requested_bytes);
    s.num_alloc_retries = st.num_alloc_retries;
    s.num_ooms = st.num_ooms;
    s.num_sync_all_streams = st.num_sync_all_streams;
    s.num_device_alloc = st.num_device_alloc;
    s.num_device_free = st.num_device_free;
    s.max_split_size =
        static_cast<int64_t>(std::numeric_limits<size_t>::max());
    return s;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    TORCH_CHECK(
        api.gmlake_torch_stats_reset_accumulated(device) == 0,
        "libgmlake: ",
        last_error());
  }

  void resetPeakStats(DeviceIndex device) override {
    TORCH_CHECK(
        api.gmlake_torch_stats_reset_peaks(device) == 0,
        "libgmlake: ",
        last_error());
  }

  // -- snapshots and history -----------------------------------------------

  cca::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces)
      override {
    cca::SnapshotInfo info;
    int n = std::min<int>(c10::cuda::device_count(), kMaxDevices);
    bool filter = mempool_id.first != 0 || mempool_id.second != 0;

    for (int d = 0; d < n; d++)
      add_segments(info, d, filter, mempool_id);
    if (include_traces) {
      info.device_traces.resize(n);
      for (int d = 0; d < n; d++)
        add_trace(info.device_traces[d], d);
    }
    info.config_metadata.garbage_collection_threshold = 0;
    info.config_metadata.max_split_size = std::numeric_limits<size_t>::max();
    info.config_metadata.pinned_num_register_threads = 0;
    info.config_metadata.expandable_segments = false;
    info.config_metadata.release_lock_on_malloc = false;
    info.config_metadata.pinned_use_host_register = false;
    info.config_metadata.graph_capture_record_stream_reuse = false;
    info.config_metadata.last_allocator_settings = "libgmlake";
    return info;
  }

  bool isHistoryEnabled() override {
    return api.gmlake_torch_history_enabled();
  }

  void recordHistory(
      bool enabled,
      cca::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      cca::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    if (!enabled) {
      // PyTorch's allocator drops its trace when recording stops,
      // whatever clearHistory says: a later recording starts empty.
      api.gmlake_torch_history_stop(true);
      g_recorder.store(nullptr);
      return;
    }
    g_recorder.store(context_recorder);
    g_when.store(static_cast<int>(when));
    gmlake_torch_history_hooks hooks{};
    hooks.clock = &hook_clock;
    hooks.context = &hook_context;
    hooks.context_dup = &hook_context_dup;
    hooks.context_free = &hook_context_free;
    TORCH_CHECK(
        api.gmlake_torch_history_start(
            std::max<size_t>(alloc_trace_max_entries, 1),
            skip_mask(skip_actions),
            &hooks,
            clearHistory) == 0,
        "libgmlake: recording the allocation history: ",
        last_error());
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  // Trackers hear of the segments of pools with their own allocator
  // (NCCL's register_mem_pool); libgmlake's own ranges span many handles,
  // which a registration of the range cannot take whole.
  void attachAllocatorTraceTracker(cda::AllocatorTraceTracker tracker)
      override {
    const char* all =
        std::getenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK");
    if (all && std::strcmp(all, "0") != 0)
      TORCH_WARN_ONCE(
          "libgmlake registers with NCCL only the memory of pools with "
          "their own allocator (torch.cuda.MemPool(backend.mem_allocator) "
          "and register_mem_pool), not every tensor as "
          "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK asks: its ranges "
          "span many physical handles. Collectives on other tensors run "
          "unregistered.");
    std::lock_guard<std::mutex> lock(g_trackers_mutex);
    g_trackers.push_back(std::move(tracker));
  }

  // -- CUDA graphs and memory pools ----------------------------------------

  void beginAllocateToPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    TORCH_CHECK(
        api.gmlake_torch_pool_begin(
            device, mempool_id.first, mempool_id.second) == 0,
        "libgmlake: beginAllocateToPool: ",
        last_error());
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.push_back({device, mempool_id, std::move(filter)});
    g_routes.fetch_add(1);
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t mempool_id)
      override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = std::find_if(routes_.begin(), routes_.end(), [&](auto& r) {
        return r.device == device && r.pool == mempool_id;
      });
      if (it != routes_.end()) {
        routes_.erase(it);
        g_routes.fetch_sub(1);
      }
    }
    TORCH_CHECK(
        api.gmlake_torch_pool_end(
            device, mempool_id.first, mempool_id.second) == 0,
        "libgmlake: endAllocateToPool: ",
        last_error());
  }

  void releasePool(DeviceIndex device, MempoolId_t mempool_id) override {
    // Called from CUDAGraph's destructor: warn, never throw.
    if (api.gmlake_torch_pool_release(
            device, mempool_id.first, mempool_id.second) < 0)
      TORCH_WARN("libgmlake: releasePool: ", last_error());
  }

  int getPoolUseCount(DeviceIndex device, MempoolId_t mempool_id) override {
    int n = api.gmlake_torch_pool_use_count(
        device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(n >= 0, "libgmlake: getPoolUseCount: ", last_error());
    return n;
  }

  void createOrIncrefPool(
      DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(
        api.gmlake_torch_pool_incref(
            device, mempool_id.first, mempool_id.second) == 0,
        "libgmlake: createOrIncrefPool: ",
        last_error());
    // libgmlake's own allocator as the pool's is a plain private pool.
    if (!allocator || dynamic_cast<GmlakeAllocator*>(allocator.get()))
      return;
    auto* src = new PoolSource{std::move(allocator), mempool_id};
    gmlake_torch_pool_source s{source_alloc, source_free, source_done, src};
    int r = api.gmlake_torch_pool_set_source(
        device, mempool_id.first, mempool_id.second, &s);
    if (r == 0)
      return;
    delete src;
    if (r > 0)
      return; // the pool has its allocator already
    std::string why = last_error();
    api.gmlake_torch_pool_release(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(false, "libgmlake: torch.cuda.MemPool(allocator=...): ", why);
  }

  void setUseOnOOM(DeviceIndex, MempoolId_t, bool) override {
    // Accepted: a pool's parked blocks are not lent to other allocations
    // on out of memory; the allocation fails as without the flag.
  }

  void setNoSplit(DeviceIndex, MempoolId_t) override {
    // Accepted: libgmlake never cuts a block out of a larger free block
    // of another size class, so there is nothing to turn off.
  }

  bool checkPoolLiveAllocations(
      DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::vector<void*> v(
        expected_live_allocations.begin(), expected_live_allocations.end());
    int r = api.gmlake_torch_pool_check_live(
        device, mempool_id.first, mempool_id.second, v.data(), v.size());
    TORCH_CHECK(r >= 0, "libgmlake: checkPoolLiveAllocations: ", last_error());
    return r == 1;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(
      DeviceIndex device,
      MempoolId_t id) override {
    auto st = std::make_shared<PoolState>();
    st->device = device;
    st->pool = id;
    st->live = pool_live(device, id);
    return st;
  }

  // Back to a checkpoint: every live block of the pool is parked (freed
  // into the pool) and the checkpoint's blocks are live again, at the
  // same addresses, with this allocator's deleter.
  cca::CheckpointDelta setCheckpointPoolState(
      DeviceIndex device,
      std::shared_ptr<cca::AllocatorState> pps) override {
    auto st = std::dynamic_pointer_cast<PoolState>(pps);
    TORCH_CHECK(
        st && st->device == device,
        "libgmlake: setCheckpointPoolState needs a checkpoint libgmlake "
        "took on this device");
    cca::CheckpointDelta delta;
    for (;;) {
      std::vector<void*> freed(pool_live(device, st->pool).size() + 8);
      int n = api.gmlake_torch_pool_restore(
          device,
          st->pool.first,
          st->pool.second,
          st->live.data(),
          st->live.size(),
          freed.data(),
          freed.size());
      if (n == -ENOSPC)
        continue; // the pool grew meanwhile
      TORCH_CHECK(n >= 0, "libgmlake: setCheckpointPoolState: ", last_error());
      freed.resize(static_cast<size_t>(n));
      delta.ptrs_freed = std::move(freed);
      break;
    }
    for (void* p : st->live)
      delta.dataptrs_allocd.emplace_back(
          p, p, &delete_any, c10::Device(c10::DeviceType::CUDA, device));
    return delta;
  }

  // -- IPC and peers -------------------------------------------------------

  // Shared blocks travel as libgmlake's own handle (lib/torch_ipc.c): the
  // sender's pid and the descriptors of the block's physical memory, which
  // the receiver copies with pidfd_getfd and maps at an address of its
  // own. Both processes must run libgmlake.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    int d = device_of(ptr);
    TORCH_CHECK(d >= 0, "libgmlake: cannot share a CUDA tensor: no "
                "device's context holds its block");
    std::string h(256, '\0');
    size_t len = 0;
    int ret = api.gmlake_torch_ipc_share(d, ptr, &h[0], h.size(), &len);
    if (ret == -ENOSPC) {
      h.resize(len);
      ret = api.gmlake_torch_ipc_share(d, ptr, &h[0], h.size(), &len);
    }
    TORCH_CHECK(ret == 0, "libgmlake: cannot share a CUDA tensor with "
                "another process: " + last_error());
    h.resize(len);
    return cca::ShareableHandle{0, std::move(h)};
  }

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    int d = static_cast<int>(device);
    void* p = nullptr;
    int ret = api.gmlake_torch_ipc_open(d, handle.data(), handle.size(), &p);
    TORCH_CHECK(ret == 0, "libgmlake: cannot open a CUDA tensor shared by "
                "another process: " + last_error());
    return std::shared_ptr<void>(p, [d](void* q) {
      if (api.gmlake_torch_ipc_close(d, q))
        TORCH_WARN("libgmlake: unmapping a shared CUDA tensor failed: ",
                   last_error());
    });
  }

  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access)
      override {
    c10::cuda::CUDAGuard device_guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled)
      (void)cudaGetLastError();
    else
      C10_CUDA_CHECK(err);
    // That covers cudaMalloc's memory only: libgmlake's mappings name the
    // devices that may access them, so dev joins dev_to_access's.
    TORCH_CHECK(
        api.gmlake_torch_peer_access(dev_to_access, dev) == 0,
        "libgmlake: giving device ",
        static_cast<int>(dev),
        " access to device ",
        static_cast<int>(dev_to_access),
        "'s memory: ",
        last_error());
  }

  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    // Without P2P the mappings carry no peer access (enablePeerAccess
    // grants it): across devices only the Peer copy works then, as for
    // expandable segments.
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(
          dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override {
    return "gmlake";
  }

 private:
  void* malloc(size_t size, DeviceIndex device, cudaStream_t stream) {
    void* p;

    if (!size)
      return nullptr;
    if (C10_UNLIKELY(api.gmlake_torch_pool_routing(device))) {
      MempoolId_t pool{0, 0};
      bool routed = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& r : routes_) {
          if (r.device == device && r.filter(stream)) {
            pool = r.pool;
            routed = true;
            break;
          }
        }
      }
      // Graph capture (global mode) forbids what the allocator may do
      // (event queries, driver allocations); PyTorch relaxes it likewise
      // around cudaMalloc.
      c10::cuda::CUDAStreamCaptureModeGuard g{cudaStreamCaptureModeRelaxed};
      p = routed ? api.gmlake_torch_pool_alloc(
                       size, device, stream, pool.first, pool.second)
                 : api.gmlake_torch_alloc(size, device, stream);
    } else {
      p = api.gmlake_torch_alloc(size, device, stream);
    }
    if (C10_UNLIKELY(!p))
      fail(size, device);
    return p;
  }

  // The allocation failed: observers, then PyTorch's OutOfMemoryError with
  // libgmlake's message (request, allocated, reserved, limit, cause). A
  // NULL pointer never reaches a tensor.
  [[noreturn]] void fail(size_t size, DeviceIndex device) {
    std::string why = last_error();
    if (why.find("out of memory") == std::string::npos) {
      TORCH_CHECK(
          false,
          fmt("libgmlake could not allocate %s on CUDA device %d: %s",
              fmt_size(size).c_str(),
              static_cast<int>(device),
              why.c_str()));
    }
    size_t dev_free = 0, dev_total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&dev_free, &dev_total) != cudaSuccess)
        (void)cudaGetLastError();
    }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = oom_observers_;
    }
    if (!observers.empty()) {
      gmlake_torch_stats st{};
      st.version = GMLAKE_TORCH_STATS_VERSION;
      st.size = sizeof(st);
      api.gmlake_torch_stats_get(device, &st);
      for (auto& obs : observers)
        obs(device,
            static_cast<size_t>(st.allocated_bytes.current),
            dev_total,
            dev_free);
    }
    // PyTorch's own wording first: accelerate's and Lightning's
    // batch-size finders look for "CUDA out of memory." as well as the type.
    const std::string msg = fmt(
        "CUDA out of memory. Tried to allocate %s. GPU %d has a total "
        "capacity of %s of which %s is free. libgmlake: %s. (libgmlake "
        "serves this process's CUDA memory; PYTORCH_CUDA_ALLOC_CONF does "
        "not apply. gmlake.memory_summary() shows its state.)",
        fmt_size(size).c_str(),
        static_cast<int>(device),
        fmt_size(dev_total).c_str(),
        fmt_size(dev_free).c_str(),
        why.c_str());
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }

  void add_segments(
      cca::SnapshotInfo& info,
      int device,
      bool filter,
      MempoolId_t pool_id) {
    gmlake_ctx* ctx = nullptr;
    gmlake_snapshot* snap = nullptr;
    add_source_segments(info, device, filter, pool_id);
    if (api.gmlake_torch_ctx_get(device, &ctx))
      return; // nothing allocated on it yet
    TORCH_CHECK(
        api.gmlake_snapshot_take(ctx, &snap) == 0,
        "libgmlake: snapshot: ",
        last_error());
    try {
      for (size_t i = 0; i < snap->nranges; i++) {
        cda::SegmentInfo seg = segment(device, snap, snap->ranges[i]);
        if (filter && seg.owner_private_pool_id != pool_id)
          continue;
        info.segments.push_back(std::move(seg));
      }
    } catch (...) {
      api.gmlake_snapshot_free(snap);
      throw;
    }
    api.gmlake_snapshot_free(snap);
  }

  // The segments pools' own allocators gave: one block each.
  void add_source_segments(
      cca::SnapshotInfo& info,
      int device,
      bool filter,
      MempoolId_t pool_id) {
    uint64_t a = filter ? pool_id.first : 0, b = filter ? pool_id.second : 0;
    int n = api.gmlake_torch_pool_segments(device, a, b, nullptr, 0);
    TORCH_CHECK(n >= 0, "libgmlake: snapshot: ", last_error());
    if (!n)
      return;
    std::vector<gmlake_torch_pool_segment> v(static_cast<size_t>(n));
    n = api.gmlake_torch_pool_segments(device, a, b, v.data(), v.size());
    TORCH_CHECK(n >= 0, "libgmlake: snapshot: ", last_error());
    for (size_t i = 0; i < std::min(v.size(), static_cast<size_t>(n)); i++) {
      const gmlake_torch_pool_segment& s = v[i];
      cda::SegmentInfo seg =
          segment_head(device, s.address, s.size, s.stream, false);
      seg.owner_private_pool_id = {s.pool_id[0], s.pool_id[1]};
      cda::BlockInfo blk;
      blk.size = s.size;
      blk.requested_size = s.requested;
      blk.allocated = blk.active = !s.parked;
      if (blk.allocated) {
        seg.allocated_size = s.size;
        seg.requested_size = s.requested;
        seg.active_size = s.size;
      }
      seg.blocks.push_back(std::move(blk));
      info.segments.push_back(std::move(seg));
    }
  }

  static cda::SegmentInfo segment_head(
      int device,
      uint64_t address,
      uint64_t size,
      void* stream,
      bool expandable) {
    cda::SegmentInfo seg;
    seg.device = static_cast<DeviceIndex>(device);
    seg.address = address;
    seg.total_size = size;
    seg.stream = stream;
    seg.is_large = true;
    seg.is_expandable = expandable;
    return seg;
  }

  cda::SegmentInfo segment(
      int device,
      const gmlake_snapshot* snap,
      const gmlake_snap_range& r) {
    cda::SegmentInfo seg = segment_head(
        device, r.address, r.size, r.stream, r.kind == GMLAKE_RANGE_STITCHED);
    bool pool_known = false;
    for (uint32_t j = 0; j < r.count; j++) {
      const gmlake_snap_piece& p = snap->pieces[r.first + j];
      cda::BlockInfo b;
      b.size = p.size;
      b.requested_size = p.requested;
      b.allocated = p.state == GMLAKE_PIECE_ALLOCATED ||
          p.state == GMLAKE_PIECE_SPILLED;
      b.active = b.allocated || p.state == GMLAKE_PIECE_PENDING_FREE ||
          p.state == GMLAKE_PIECE_ELSEWHERE;
      if (b.allocated) {
        uint64_t id[2] = {0, 0};
        int in_pool = api.gmlake_torch_pool_of(
            device, reinterpret_cast<void*>(p.address), id);
        if (in_pool == 2) // parked: free to PyTorch's eyes
          b.allocated = b.active = false;
        if (in_pool > 0 && !pool_known) {
          seg.owner_private_pool_id = {id[0], id[1]};
          pool_known = true;
        }
      }
      if (b.allocated) {
        seg.allocated_size += b.size;
        seg.requested_size += b.requested_size;
      }
      if (b.active)
        seg.active_size += b.size;
      seg.blocks.push_back(std::move(b));
    }
    return seg;
  }

  void add_trace(std::vector<cda::TraceEntry>& out, int device) {
    int n = api.gmlake_torch_history_read(device, nullptr, 0);
    if (n <= 0)
      return;
    std::vector<gmlake_torch_event> ev(static_cast<size_t>(n));
    n = api.gmlake_torch_history_read(device, ev.data(), ev.size());
    out.reserve(static_cast<size_t>(std::max(n, 0)));
    for (int i = 0; i < n; i++) {
      const gmlake_torch_event& e = ev[i];
      ContextPtr ctx;
      if (e.context) {
        ctx = *static_cast<ContextPtr*>(e.context);
        hook_context_free(e.context);
      }
      out.emplace_back(
          static_cast<cda::TraceEntry::Action>(e.action),
          static_cast<DeviceIndex>(e.device),
          static_cast<size_t>(e.addr),
          static_cast<size_t>(e.size),
          static_cast<void*>(e.stream),
          MempoolId_t{e.pool_id[0], e.pool_id[1]},
          static_cast<c10::approx_time_t>(e.time),
          std::move(ctx));
    }
  }

  bool initialized_ = false;
  std::mutex mutex_;
  std::vector<Route> routes_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
};

// ---------------------------------------------------------------------------
// Installation

std::mutex install_mutex;
std::shared_ptr<GmlakeAllocator>* installed_allocator = nullptr;

void load_api(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h)
    h = dlopen(path.c_str(), RTLD_NOW);
  TORCH_CHECK(
      h,
      "libgmlake: cannot load ",
      path,
      " for the PyTorch adapter: ",
      dlerror());
  Api a;
#define GML_API_LOAD(name)                                         \
  a.name = reinterpret_cast<decltype(a.name)>(dlsym(h, #name));    \
  TORCH_CHECK(                                                     \
      a.name,                                                      \
      "libgmlake: ",                                               \
      path,                                                        \
      " lacks ",                                                   \
      #name,                                                       \
      ": it is older than this adapter; rebuild libgmlake from "   \
      "the same source as the gmlake Python package");
  GML_ADAPTER_FUNCS(GML_API_LOAD)
#undef GML_API_LOAD
  int major = a.gmlake_version_major(), minor = a.gmlake_version_minor();
  TORCH_CHECK(
      major == GMLAKE_VERSION_MAJOR && minor >= GMLAKE_VERSION_MINOR,
      fmt("libgmlake: %s is version %d.%d; this adapter was built for %d.%d",
          path.c_str(),
          major,
          minor,
          GMLAKE_VERSION_MAJOR,
          GMLAKE_VERSION_MINOR));
  api = a;
  api_path = path;
}

// Make libgmlake PyTorch's CUDA allocator; before CUDA is initialized.
void install(const std::string& path) {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed_allocator) {
    TORCH_CHECK(
        path == api_path,
        "libgmlake: the adapter already uses ",
        api_path,
        ", not ",
        path);
    return;
  }
  TORCH_CHECK(
      !cca::allocator.load()->initialized(),
      "libgmlake: PyTorch's CUDA allocator is initialized already (CUDA "
      "was used in this process); it can only be replaced before that.");
  load_api(path);
  // Failures become exceptions here; the C library need not print them.
  api.gmlake_torch_set_fail_level(GMLAKE_LOG_DEBUG);
  api.gmlake_torch_set_sync_hook(&hook_sync);
  auto alloc = std::make_shared<GmlakeAllocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(alloc);
  // Code that asks for the CUDA device allocator by type
  // (c10::GetAllocator, c10::getDeviceAllocator) gets it too; PyTorch's
  // own registers at priority 0.
  c10::SetAllocator(c10::DeviceType::CUDA, alloc.get(), 1);
  // Kept for the life of the process: tensors are freed until the end.
  installed_allocator = new std::shared_ptr<GmlakeAllocator>(alloc);
}

bool installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return installed_allocator != nullptr;
}

std::string library() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return api_path;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "libgmlake's PyTorch CUDA allocator (gmlake.torch)";
  m.def("install", &install, "Make libgmlake PyTorch's CUDA allocator");
  m.def("installed", &installed, "Whether install() ran");
  m.def("library", &library, "The libgmlake.so in use");
}
