// A CUDA graph memory allocator on the driver VMM API, loaded by torch.cuda.memory.CUDAPluggableAllocator.
//
// Every captured shape gets its own virtual range (begin_range), and every range maps one shared, growing
// list of physical chunks at the same offsets: chunk i backs offset i*chunk of every range that reaches it.
// Graphs keep distinct addresses (torch's allocator never sees one pointer twice), while physical memory
// grows to max(shape), not sum(shape). Safe only because graphs of different shapes never run at once.
//
// Memory is held for the allocator's lifetime (the design does no fine-grained release): malloc bumps an
// offset in the current range, free only forgets the segment. Built with -DGMTOOL_FAKE_DRIVER the driver
// calls go to a recording fake, so the bookkeeping is tested on machines without a GPU.
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using u64 = unsigned long long;

// Every call returns 0 on success, else a driver error code that error_text() names.
struct Driver {
  int (*init)(int device);  // initialise the driver, make a context current
  int (*vmm_supported)(int device, int* out);
  int (*granularity)(int device, size_t* out);
  int (*create)(u64* handle, size_t size, int device);
  int (*release)(u64 handle);
  int (*reserve)(u64* va, size_t size, size_t align);
  int (*address_free)(u64 va, size_t size);
  int (*map)(u64 va, size_t size, u64 handle);
  int (*unmap)(u64 va, size_t size);
  int (*set_access)(u64 va, size_t size, int device);
  int (*exchange_capture_mode)(int* mode);  // this thread's stream-capture mode, swapped
  const char* (*error_text)(int code);
};

#ifndef GMTOOL_FAKE_DRIVER
}  // namespace
#include <cuda.h>
namespace {

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

int real_init(int device) {
  CUresult r = cuInit(0);
  if (r != CUDA_SUCCESS) return r;
  CUcontext ctx = nullptr;
  if ((r = cuCtxGetCurrent(&ctx)) != CUDA_SUCCESS) return r;
  if (ctx != nullptr) return CUDA_SUCCESS;  // torch's runtime made the primary context current already
  CUdevice dev;
  if ((r = cuDeviceGet(&dev, device)) != CUDA_SUCCESS) return r;
  if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) return r;
  return cuCtxSetCurrent(ctx);
}

int real_vmm_supported(int device, int* out) {
  CUdevice dev;
  CUresult r = cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return r;
  return cuDeviceGetAttribute(out, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
}

int real_granularity(int device, size_t* out) {
  CUmemAllocationProp prop = device_prop(device);
  return cuMemGetAllocationGranularity(out, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

int real_create(u64* handle, size_t size, int device) {
  CUmemAllocationProp prop = device_prop(device);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = cuMemCreate(&h, size, &prop, 0);
  *handle = h;
  return r;
}

int real_release(u64 handle) { return cuMemRelease(handle); }

int real_reserve(u64* va, size_t size, size_t align) {
  CUdeviceptr p = 0;
  CUresult r = cuMemAddressReserve(&p, size, align, 0, 0);
  *va = p;
  return r;
}

int real_address_free(u64 va, size_t size) { return cuMemAddressFree(va, size); }
int real_map(u64 va, size_t size, u64 handle) { return cuMemMap(va, size, 0, handle, 0); }
int real_unmap(u64 va, size_t size) { return cuMemUnmap(va, size); }

int real_set_access(u64 va, size_t size, int device) {
  CUmemAccessDesc desc = {};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return cuMemSetAccess(va, size, &desc, 1);
}

int real_exchange_capture_mode(int* mode) {
  CUstreamCaptureMode m = static_cast<CUstreamCaptureMode>(*mode);
  CUresult r = cuThreadExchangeStreamCaptureMode(&m);
  *mode = m;
  return r;
}

const char* real_error_text(int code) {
  const char* s = nullptr;
  if (cuGetErrorString(static_cast<CUresult>(code), &s) != CUDA_SUCCESS || s == nullptr) return "unknown CUDA error";
  return s;
}

const Driver DRIVER = {real_init,        real_vmm_supported, real_granularity, real_create,
                       real_release,     real_reserve,       real_address_free, real_map,
                       real_unmap,       real_set_access,    real_exchange_capture_mode, real_error_text};
const int RELAXED = CU_STREAM_CAPTURE_MODE_RELAXED;

#else  // GMTOOL_FAKE_DRIVER: a driver that checks how it is called and logs every call

const int FAKE_INVALID = 1, FAKE_OOM = 2;

struct Fake {
  std::string log;
  size_t gran = 2u << 20;
  int supported = 1;
  int fail_create_at = 0, creates = 0;  // fail the Nth cuMemCreate (1-based; 0: never)
  int fail_map_at = 0, maps = 0;
  u64 next_va = 0x7f0000000000ull, next_handle = 1;
  std::map<u64, size_t> reserved;              // base -> size
  std::map<u64, std::pair<size_t, u64>> maps_; // va -> (size, handle)
  std::map<u64, size_t> handles;               // live handle -> size
} F;

void flog(const char* fmt, u64 a, u64 b = 0, u64 c = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, fmt, a, b, c);
  F.log += buf;
  F.log += '\n';
}

bool inside_reservation(u64 va, size_t size) {
  auto it = F.reserved.upper_bound(va);
  if (it == F.reserved.begin()) return false;
  --it;
  return va >= it->first && va + size <= it->first + it->second;
}

int fake_init(int) { return 0; }
int fake_vmm_supported(int, int* out) { *out = F.supported; return 0; }
int fake_granularity(int, size_t* out) { *out = F.gran; return 0; }

int fake_create(u64* handle, size_t size, int) {
  if (++F.creates == F.fail_create_at) { flog("create FAIL size=%llu", size); return FAKE_OOM; }
  if (size == 0 || size % F.gran) return FAKE_INVALID;
  *handle = F.next_handle++;
  F.handles[*handle] = size;
  flog("create h=%llu size=%llu", *handle, size);
  return 0;
}

int fake_release(u64 handle) {
  if (!F.handles.erase(handle)) return FAKE_INVALID;
  flog("release h=%llu", handle);
  return 0;
}

int fake_reserve(u64* va, size_t size, size_t align) {
  if (size == 0 || size % F.gran || (align && align % F.gran)) return FAKE_INVALID;
  *va = F.next_va;
  F.next_va += ((size + (1ull << 30) - 1) >> 30 << 30) + (1ull << 30);  // a guard gap between ranges
  F.reserved[*va] = size;
  flog("reserve va=0x%llx size=%llu", *va, size);
  return 0;
}

int fake_address_free(u64 va, size_t size) {
  auto it = F.reserved.find(va);
  if (it == F.reserved.end() || it->second != size) return FAKE_INVALID;
  for (auto& m : F.maps_)
    if (m.first >= va && m.first < va + size) return FAKE_INVALID;  // still mapped
  F.reserved.erase(it);
  flog("free_va va=0x%llx size=%llu", va, size);
  return 0;
}

int fake_map(u64 va, size_t size, u64 handle) {
  if (++F.maps == F.fail_map_at) { flog("map FAIL va=0x%llx", va); return FAKE_OOM; }
  auto h = F.handles.find(handle);
  if (h == F.handles.end() || h->second != size || va % F.gran || !inside_reservation(va, size)) return FAKE_INVALID;
  auto next = F.maps_.lower_bound(va);
  if (next != F.maps_.end() && next->first < va + size) return FAKE_INVALID;  // overlaps a mapping
  if (next != F.maps_.begin() && std::prev(next)->first + std::prev(next)->second.first > va) return FAKE_INVALID;
  F.maps_[va] = {size, handle};
  flog("map va=0x%llx size=%llu h=%llu", va, size, handle);
  return 0;
}

int fake_unmap(u64 va, size_t size) {
  auto it = F.maps_.find(va);
  if (it == F.maps_.end() || it->second.first != size) return FAKE_INVALID;
  F.maps_.erase(it);
  flog("unmap va=0x%llx size=%llu", va, size);
  return 0;
}

int fake_set_access(u64 va, size_t size, int device) {
  auto it = F.maps_.find(va);
  if (it == F.maps_.end() || it->second.first != size) return FAKE_INVALID;
  flog("access va=0x%llx size=%llu dev=%llu", va, size, static_cast<u64>(device));
  return 0;
}

int fake_exchange_capture_mode(int* mode) {
  static int current = 0;  // global, as a fresh thread's mode is
  flog("capture_mode set=%llu", static_cast<u64>(*mode));
  int old = current;
  current = *mode;
  *mode = old;
  return 0;
}

const char* fake_error_text(int code) {
  return code == FAKE_OOM ? "CUDA_ERROR_OUT_OF_MEMORY (fake driver)" : "CUDA_ERROR_INVALID_VALUE (fake driver)";
}

const Driver DRIVER = {fake_init,        fake_vmm_supported, fake_granularity,  fake_create,
                       fake_release,     fake_reserve,       fake_address_free, fake_map,
                       fake_unmap,       fake_set_access,    fake_exchange_capture_mode, fake_error_text};
const int RELAXED = 2;
#endif

const size_t ALIGN = 512;

struct Range {
  u64 base;
  size_t mapped;  // chunks mapped into this range
  size_t used;    // bump offset
};

struct State {
  std::mutex mu;
  bool ready = false;
  int device = -1;
  size_t gran = 0, chunk = 0, range_bytes = 0;
  std::vector<u64> chunks;  // physical memory, shared by every range
  std::vector<Range> ranges;
  std::unordered_map<u64, size_t> live;  // segments torch holds
  u64 mallocs = 0, frees = 0;
  std::string error;
} S;

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

bool fail(const std::string& what, int code = 0) {
  S.error = code ? what + ": " + DRIVER.error_text(code) + " (" + std::to_string(code) + ")" : what;
  return false;
}

// Map chunk i into range r (creating it if no range reached it before). Undone on failure.
bool map_chunk(Range& r, size_t i) {
  bool created = false;
  if (i == S.chunks.size()) {
    u64 h = 0;
    if (int e = DRIVER.create(&h, S.chunk, S.device))
      return fail("cuMemCreate of a " + std::to_string(S.chunk) + "-byte chunk failed", e);
    S.chunks.push_back(h);
    created = true;
  }
  u64 va = r.base + i * S.chunk;
  int e = DRIVER.map(va, S.chunk, S.chunks[i]);
  if (e == 0) {
    if ((e = DRIVER.set_access(va, S.chunk, S.device)) == 0) {
      r.mapped = i + 1;
      return true;
    }
    DRIVER.unmap(va, S.chunk);
    fail("cuMemSetAccess failed", e);
  } else {
    fail("cuMemMap failed", e);
  }
  if (created) {
    DRIVER.release(S.chunks.back());
    S.chunks.pop_back();
  }
  return false;
}

void unmap_range(Range& r) {
  for (size_t i = r.mapped; i-- > 0;) {
    if (int e = DRIVER.unmap(r.base + i * S.chunk, S.chunk)) fail("cuMemUnmap failed", e);
  }
  r.mapped = 0;
}

// torch calls malloc while a graph capture is under way. In the global capture mode the driver may refuse
// calls it deems unsafe during capture; torch's own cudaMalloc runs relaxed for the same reason.
struct RelaxedCapture {
  int saved = RELAXED;
  bool swapped;
  RelaxedCapture() : swapped(DRIVER.exchange_capture_mode(&saved) == 0) {}
  ~RelaxedCapture() {
    if (swapped) DRIVER.exchange_capture_mode(&saved);
  }
};

int begin_range_locked() {
  if (!S.ready) return fail("the VMM allocator is not initialised"), -1;
  Range r = {0, 0, 0};
  if (int e = DRIVER.reserve(&r.base, S.range_bytes, S.chunk))
    return fail("cuMemAddressReserve of " + std::to_string(S.range_bytes) + " bytes failed", e), -1;
  for (size_t i = 0; i < S.chunks.size(); ++i) {
    if (!map_chunk(r, i)) {
      std::string why = S.error;
      unmap_range(r);
      DRIVER.address_free(r.base, S.range_bytes);
      S.error = why;
      return -1;
    }
  }
  S.ranges.push_back(r);
  return static_cast<int>(S.ranges.size()) - 1;
}

}  // namespace

extern "C" {

// device: CUDA ordinal; range_bytes: virtual size of each range (a shape may use up to that much);
// chunk_bytes: physical growth step (0: the driver's granularity), rounded up to the granularity.
int gmtool_vmm_init(int device, size_t range_bytes, size_t chunk_bytes) {
  std::lock_guard<std::mutex> g(S.mu);
  if (S.ready) return fail("the VMM allocator is already initialised (one per process)"), -1;
  int supported = 0;
  if (int e = DRIVER.init(device)) return fail("cuInit / context setup failed", e), -1;
  if (int e = DRIVER.vmm_supported(device, &supported)) return fail("cuDeviceGetAttribute failed", e), -1;
  if (!supported)
    return fail("device " + std::to_string(device) + " does not support CUDA virtual memory management"), -1;
  size_t gran = 0;
  if (int e = DRIVER.granularity(device, &gran)) return fail("cuMemGetAllocationGranularity failed", e), -1;
  if (gran == 0) return fail("the driver reported a zero allocation granularity"), -1;
  S.device = device;
  S.gran = gran;
  S.chunk = round_up(chunk_bytes ? chunk_bytes : gran, gran);
  S.range_bytes = round_up(range_bytes ? range_bytes : S.chunk, S.chunk);
  S.chunks.clear();
  S.ranges.clear();
  S.live.clear();
  S.mallocs = S.frees = 0;
  S.error.clear();
  S.ready = true;
  return 0;
}

// A fresh virtual range for the next shape, with every existing chunk mapped in. Returns its index or -1.
int gmtool_vmm_begin_range(void) {
  std::lock_guard<std::mutex> g(S.mu);
  return begin_range_locked();
}

void* gmtool_vmm_malloc(ssize_t size, int device, void* /*stream*/) {
  std::lock_guard<std::mutex> g(S.mu);
  if (!S.ready) return fail("gmtool_vmm_malloc before gmtool_vmm_init"), nullptr;
  if (device != S.device)
    return fail("allocator serves device " + std::to_string(S.device) + ", not " + std::to_string(device)), nullptr;
  if (size < 0) return fail("negative allocation size"), nullptr;
  if (S.ranges.empty()) {
    RelaxedCapture relaxed;
    if (begin_range_locked() < 0) return nullptr;
  }
  Range& r = S.ranges.back();
  size_t off = round_up(r.used, ALIGN);
  size_t end = off + (size ? static_cast<size_t>(size) : 1);
  if (end > S.range_bytes)
    return fail("a shape needs more than the " + std::to_string(S.range_bytes) + "-byte virtual range"), nullptr;
  size_t need = (end + S.chunk - 1) / S.chunk;
  if (r.mapped < need) {
    RelaxedCapture relaxed;
    while (r.mapped < need)
      if (!map_chunk(r, r.mapped)) return nullptr;
  }
  r.used = end;
  u64 p = r.base + off;
  S.live[p] = static_cast<size_t>(size);
  ++S.mallocs;
  return reinterpret_cast<void*>(p);
}

// The memory stays mapped for the allocator's lifetime: ranges alias one another, nothing is reused.
void gmtool_vmm_free(void* ptr, ssize_t /*size*/, int /*device*/, void* /*stream*/) {
  std::lock_guard<std::mutex> g(S.mu);
  S.live.erase(reinterpret_cast<u64>(ptr));
  ++S.frees;
}

// Unmap and release everything. Refused while torch still holds segments (unless force): unmapping them
// would turn the next access into a fault. Returns 0, or -1 with the reason in gmtool_vmm_last_error().
int gmtool_vmm_shutdown(int force) {
  std::lock_guard<std::mutex> g(S.mu);
  if (!S.ready) return 0;
  if (!S.live.empty() && !force)
    return fail(std::to_string(S.live.size()) + " segments are still held by torch: memory left mapped"), -1;
  S.error.clear();
  for (auto& r : S.ranges) {
    unmap_range(r);
    if (int e = DRIVER.address_free(r.base, S.range_bytes)) fail("cuMemAddressFree failed", e);
  }
  for (u64 h : S.chunks)
    if (int e = DRIVER.release(h)) fail("cuMemRelease failed", e);
  S.ranges.clear();
  S.chunks.clear();
  S.live.clear();
  S.ready = false;
  return S.error.empty() ? 0 : -1;
}

const char* gmtool_vmm_last_error(void) { return S.error.c_str(); }
size_t gmtool_vmm_granularity(void) { return S.gran; }
size_t gmtool_vmm_chunk_bytes(void) { return S.chunk; }
size_t gmtool_vmm_range_bytes(void) { return S.range_bytes; }
size_t gmtool_vmm_physical_bytes(void) { return S.chunks.size() * S.chunk; }
size_t gmtool_vmm_virtual_reserved_bytes(void) { return S.ranges.size() * S.range_bytes; }
int gmtool_vmm_num_ranges(void) { return static_cast<int>(S.ranges.size()); }
size_t gmtool_vmm_live_segments(void) { return S.live.size(); }
u64 gmtool_vmm_num_mallocs(void) { return S.mallocs; }
u64 gmtool_vmm_num_frees(void) { return S.frees; }

size_t gmtool_vmm_virtual_mapped_bytes(void) {
  std::lock_guard<std::mutex> g(S.mu);
  size_t n = 0;
  for (auto& r : S.ranges) n += r.mapped * S.chunk;
  return n;
}

size_t gmtool_vmm_current_used(void) {
  std::lock_guard<std::mutex> g(S.mu);
  return S.ranges.empty() ? 0 : S.ranges.back().used;
}

// Per range i: bytes handed out, bytes mapped, base address (0 for an index out of range).
size_t gmtool_vmm_range_used(int i) {
  std::lock_guard<std::mutex> g(S.mu);
  return i >= 0 && static_cast<size_t>(i) < S.ranges.size() ? S.ranges[i].used : 0;
}

size_t gmtool_vmm_range_mapped(int i) {
  std::lock_guard<std::mutex> g(S.mu);
  return i >= 0 && static_cast<size_t>(i) < S.ranges.size() ? S.ranges[i].mapped * S.chunk : 0;
}

u64 gmtool_vmm_range_base(int i) {
  std::lock_guard<std::mutex> g(S.mu);
  return i >= 0 && static_cast<size_t>(i) < S.ranges.size() ? S.ranges[i].base : 0;
}

#ifdef GMTOOL_FAKE_DRIVER
// Test controls. configure() resets the log and counters, not the allocator.
void gmtool_fake_configure(size_t gran, int supported, int fail_create_at, int fail_map_at) {
  F.gran = gran;
  F.supported = supported;
  F.fail_create_at = fail_create_at;
  F.fail_map_at = fail_map_at;
  F.creates = F.maps = 0;
  F.log.clear();
}
const char* gmtool_fake_log(void) { return F.log.c_str(); }
size_t gmtool_fake_live_mappings(void) { return F.maps_.size(); }
size_t gmtool_fake_live_handles(void) { return F.handles.size(); }
size_t gmtool_fake_live_reservations(void) { return F.reserved.size(); }
#endif

}  // extern "C"
