// A fake CUDA driver and cuFile, for testing the driver layer on machines without a GPU.
//
// tests/fake_driver.rs compiles this into a shared library whose soname is libcuda.so and
// loads it before the loader first looks for the driver, so every cu* call the crate makes
// lands here (and cuFile's calls too, through FASTSAFETENSORS_CUFILE). Device memory is host
// memory the test registers with fake_device_memory(); copies happen at once.
//
// Every call checks the rules the real driver enforces, or that correct use of it depends on,
// and counts each breach as a violation with a description (fake_violation_text):
// - calls that need a context find one current on the calling thread, and the right one;
// - streams, events and pinned memory are destroyed while their context is still retained;
// - a copy is queued only on a stream that waits for the destination's previous work (the
//   "ready" event the test made with fake_ready_event, or an event recorded on torch's stream:
//   one from fake_torch_stream, or the null stream), and cuFile writes only after that event
//   was waited for on the host;
// - pinned memory is freed only once every copy out of it is known to have completed (an
//   event recorded after it, or its stream, was synchronized);
// - cuFile reads and registrations target memory of the current context's device.
// It also counts what tests assert on: device-wide synchronizations, pinned allocations,
// threads left with a context current.
//
// The virtual memory API (cuMemCreate and the rest) is backed by memory files: an allocation
// is a memfd (named after its device), its exported handle a descriptor of that file (so that
// another process can import and map it, as the real driver allows), a mapping a shared
// mapping of it in a range reserved with PROT_NONE, and cuMemSetAccess an mprotect (a write
// through a read-only mapping faults, as a kernel's would).
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
};

#define DEVICES 2
#define MAX_STACK 32
#define MAX_REGIONS 256

struct fake_context {
  int device;
  int primary;
  int retained;  // primary contexts: retain count; others: 1 until destroyed
};

// Streams are never freed (only marked), so that regions can keep pointing at them.
struct fake_stream {
  struct fake_context* ctx;
  int torch;  // made by fake_torch_stream: torch's current stream
  int waited_for_ready;
  int destroyed;
  unsigned long queued;     // copies queued so far
  unsigned long completed;  // copies known to have completed
  struct fake_stream* next;
};

struct fake_event {
  struct fake_context* ctx;
  int ready;  // made by fake_ready_event: stands for torch's stream
  struct fake_stream* stream;
  unsigned long covers;  // the stream's copies queued before the event was recorded
};

struct region {
  uintptr_t start;
  size_t len;
  int device;  // -1: pinned host memory
  struct fake_context* ctx;
  struct fake_stream* last_stream;  // of the last copy out of it
  unsigned long last_copy;
  int fresh;  // mapped from a new allocation: no earlier work to order copies after
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_context primaries[DEVICES] = {{0, 1, 0}, {1, 1, 0}};
static struct region regions[MAX_REGIONS];
static int region_count;
static int ready_host_waited;
static struct fake_stream* streams;
static int fail_event_record_at = -1;

static atomic_int violations;
static char violation_text[4096];
static atomic_int context_synchronizations;
static atomic_int pinned_allocations;
static atomic_int pinned_frees;
static atomic_int bound_threads;
static atomic_int copies;
static atomic_int cufile_reads;
static atomic_int compat_mode = 1;
static atomic_int refuse_read_only;  // a driver that will not map device memory read-only

static __thread struct fake_context* stack[MAX_STACK];
static __thread int depth;

static void violation(const char* fmt, const char* what) {
  atomic_fetch_add(&violations, 1);
  pthread_mutex_lock(&lock);
  size_t used = strlen(violation_text);
  if (used + 200 < sizeof violation_text) {
    snprintf(violation_text + used, sizeof violation_text - used, fmt, what);
    strcat(violation_text, "; ");
  }
  pthread_mutex_unlock(&lock);
}

static struct fake_context* current(void) { return depth ? stack[depth - 1] : NULL; }

static int alive(const struct fake_context* ctx) { return ctx && ctx->retained > 0; }

// A context must be current, alive, and (when `owner` is given) be `owner`.
static int need_context(const char* call, const struct fake_context* owner) {
  const struct fake_context* ctx = current();
  if (!ctx) {
    violation("%s without a current context", call);
    return 0;
  }
  if (!alive(ctx)) {
    violation("%s with a released context current", call);
    return 0;
  }
  if (owner && owner != ctx) {
    violation("%s with another context current than its object's", call);
    return 0;
  }
  return 1;
}

static void set_depth(int d) {
  if (depth == 0 && d > 0) atomic_fetch_add(&bound_threads, 1);
  if (depth > 0 && d == 0) atomic_fetch_sub(&bound_threads, 1);
  depth = d;
}

static struct region* find_region(uintptr_t p, size_t len) {
  for (int i = 0; i < region_count; i++) {
    if (p >= regions[i].start && p + len <= regions[i].start + regions[i].len) return &regions[i];
  }
  return NULL;
}

static void add_region(uintptr_t start, size_t len, int device, struct fake_context* ctx) {
  pthread_mutex_lock(&lock);
  if (region_count < MAX_REGIONS) regions[region_count++] = (struct region){start, len, device, ctx, NULL, 0, 0};
  pthread_mutex_unlock(&lock);
}

static int remove_region(uintptr_t start, struct region* out) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < region_count; i++) {
    if (regions[i].start == start) {
      if (out) *out = regions[i];
      regions[i] = regions[--region_count];
      pthread_mutex_unlock(&lock);
      return 1;
    }
  }
  pthread_mutex_unlock(&lock);
  return 0;
}

// ------------------------------------------------------------------ test interface

void fake_reset(void) {
  pthread_mutex_lock(&lock);
  violation_text[0] = 0;
  ready_host_waited = 0;
  fail_event_record_at = -1;
  pthread_mutex_unlock(&lock);
  atomic_store(&violations, 0);
  atomic_store(&context_synchronizations, 0);
  atomic_store(&pinned_allocations, 0);
  atomic_store(&pinned_frees, 0);
  atomic_store(&copies, 0);
  atomic_store(&cufile_reads, 0);
  atomic_store(&refuse_read_only, 0);
}

int fake_violations(void) { return atomic_load(&violations); }
const char* fake_violation_text(void) { return violation_text; }
int fake_context_synchronizations(void) { return atomic_load(&context_synchronizations); }
int fake_pinned_allocations(void) { return atomic_load(&pinned_allocations); }
int fake_pinned_frees(void) { return atomic_load(&pinned_frees); }
int fake_bound_threads(void) { return atomic_load(&bound_threads); }
int fake_copies(void) { return atomic_load(&copies); }
int fake_cufile_reads(void) { return atomic_load(&cufile_reads); }
int fake_primary_retained(int device) { return primaries[device].retained; }
void fake_set_compat_mode(int on) { atomic_store(&compat_mode, on); }
void fake_refuse_read_only(int on) { atomic_store(&refuse_read_only, on); }

// The n-th cuEventRecord from now (0-based) fails.
void fake_fail_event_record_at(int n) {
  pthread_mutex_lock(&lock);
  fail_event_record_at = n;
  pthread_mutex_unlock(&lock);
}

// Copies queued on live streams and not known to have completed.
unsigned long fake_unfinished_copies(void) {
  unsigned long n = 0;
  pthread_mutex_lock(&lock);
  for (struct fake_stream* s = streams; s; s = s->next) n += s->queued - s->completed;
  pthread_mutex_unlock(&lock);
  return n;
}

// Declares [start, start+len) to be memory of `device` (allocated by "torch").
void fake_device_memory(uintptr_t start, size_t len, int device) { add_region(start, len, device, NULL); }
void fake_forget_memory(uintptr_t start) { remove_region(start, NULL); }

// A context of the caller's own on `device` (as CuPy or PyCUDA would make), not primary.
void* fake_user_context(int device) {
  struct fake_context* ctx = calloc(1, sizeof *ctx);
  ctx->device = device;
  ctx->retained = 1;
  return ctx;
}

// An event standing for the work torch queued on its stream before the load.
void* fake_ready_event(int device) {
  struct fake_event* ev = calloc(1, sizeof *ev);
  ev->ctx = &primaries[device];
  ev->ready = 1;
  pthread_mutex_lock(&lock);
  ready_host_waited = 0;
  pthread_mutex_unlock(&lock);
  return ev;
}

// Torch's current stream on `device`, as the extension lends it: an event recorded on it
// stands for the work torch queued there, as fake_ready_event's does. Not on the list of
// streams: no copy of the loader's goes there.
void* fake_torch_stream(int device) {
  struct fake_stream* s = calloc(1, sizeof *s);
  s->ctx = &primaries[device];
  s->torch = 1;
  return s;
}

// ------------------------------------------------------------------ driver

CUresult cuInit(unsigned flags) { (void)flags; return CUDA_SUCCESS; }

CUresult cuDeviceGetCount(int* count) {
  *count = DEVICES;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  *name = error == CUDA_ERROR_INVALID_CONTEXT ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** text) { return cuGetErrorName(error, text); }

CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device < 0 || device >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&lock);
  primaries[device].retained++;
  pthread_mutex_unlock(&lock);
  *ctx = &primaries[device];
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  if (device < 0 || device >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&lock);
  int was = primaries[device].retained--;
  pthread_mutex_unlock(&lock);
  if (was <= 0) violation("%s released more often than retained", "cuDevicePrimaryCtxRelease");
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = current();
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void* ctx) {
  if (ctx == NULL) {
    if (depth) set_depth(depth - 1);
  } else if (depth) {
    stack[depth - 1] = ctx;
  } else {
    stack[0] = ctx;
    set_depth(1);
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(void* ctx) {
  if (!ctx || depth == MAX_STACK) return CUDA_ERROR_INVALID_VALUE;
  stack[depth] = ctx;
  set_depth(depth + 1);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (!depth) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx) *ctx = stack[depth - 1];
  set_depth(depth - 1);
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  atomic_fetch_add(&context_synchronizations, 1);
  return need_context("cuCtxSynchronize", NULL) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuStreamCreate(void** stream, unsigned flags) {
  (void)flags;
  if (!need_context("cuStreamCreate", NULL)) return CUDA_ERROR_INVALID_CONTEXT;
  struct fake_stream* s = calloc(1, sizeof *s);
  s->ctx = current();
  pthread_mutex_lock(&lock);
  s->next = streams;
  streams = s;
  pthread_mutex_unlock(&lock);
  *stream = s;
  return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(void* stream) {
  struct fake_stream* s = stream;
  if (!s || s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
  if (!alive(s->ctx)) violation("%s after its context was released", "cuStreamDestroy");
  s->destroyed = 1;
  return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(void* stream) {
  struct fake_stream* s = stream;
  if (!s || s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
  if (!alive(s->ctx)) violation("%s after its context was released", "cuStreamSynchronize");
  pthread_mutex_lock(&lock);
  s->completed = s->queued;
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
  (void)flags;
  struct fake_stream* s = stream;
  struct fake_event* e = event;
  if (!s || !e) return CUDA_ERROR_INVALID_HANDLE;
  if (!need_context("cuStreamWaitEvent", s->ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  if (e->ready) s->waited_for_ready = 1;
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(void** event, unsigned flags) {
  (void)flags;
  if (!need_context("cuEventCreate", NULL)) return CUDA_ERROR_INVALID_CONTEXT;
  struct fake_event* e = calloc(1, sizeof *e);
  e->ctx = current();
  *event = e;
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(void* event, void* stream) {
  struct fake_event* e = event;
  struct fake_stream* s = stream;
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (!s || s->torch) {
    // Torch's stream; the null stream is the current context's legacy default stream, torch's
    // default current stream.
    if (!need_context("cuEventRecord", s ? s->ctx : e->ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (s && e->ctx != s->ctx) violation("%s on a stream of another context", "cuEventRecord");
    pthread_mutex_lock(&lock);
    e->ready = 1;
    ready_host_waited = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
  }
  if (!need_context("cuEventRecord", s->ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  if (e->ctx != s->ctx) violation("%s on a stream of another context", "cuEventRecord");
  pthread_mutex_lock(&lock);
  int fail = fail_event_record_at == 0;
  if (fail_event_record_at >= 0) fail_event_record_at--;
  if (!fail) {
    e->stream = s;
    e->covers = s->queued;
  }
  pthread_mutex_unlock(&lock);
  return fail ? 999 : CUDA_SUCCESS;  // CUDA_ERROR_UNKNOWN
}

CUresult cuEventSynchronize(void* event) {
  struct fake_event* e = event;
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (e->ready) {
    pthread_mutex_lock(&lock);
    ready_host_waited = 1;
    pthread_mutex_unlock(&lock);
  } else if (!alive(e->ctx)) {
    violation("%s after its context was released", "cuEventSynchronize");
  } else if (e->stream) {
    pthread_mutex_lock(&lock);
    if (e->stream->completed < e->covers) e->stream->completed = e->covers;
    pthread_mutex_unlock(&lock);
  }
  return CUDA_SUCCESS;
}

CUresult cuEventQuery(void* event) { return event ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuEventDestroy_v2(void* event) {
  struct fake_event* e = event;
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (!e->ready && !alive(e->ctx)) violation("%s after its context was released", "cuEventDestroy");
  free(e);
  return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** ptr, size_t len, unsigned flags) {
  (void)flags;
  if (!need_context("cuMemHostAlloc", NULL)) return CUDA_ERROR_INVALID_CONTEXT;
  void* p = NULL;
  if (posix_memalign(&p, 4096, len ? len : 1)) return CUDA_ERROR_OUT_OF_MEMORY;
  add_region((uintptr_t)p, len, -1, current());
  atomic_fetch_add(&pinned_allocations, 1);
  *ptr = p;
  return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void* ptr) {
  struct region r;
  if (!remove_region((uintptr_t)ptr, &r)) return CUDA_ERROR_INVALID_VALUE;
  if (!alive(r.ctx)) violation("%s after its context was released", "cuMemFreeHost");
  else need_context("cuMemFreeHost", NULL);
  pthread_mutex_lock(&lock);
  int busy = r.last_stream && r.last_stream->completed < r.last_copy;
  pthread_mutex_unlock(&lock);
  if (busy) violation("%s under a copy that may still be running", "cuMemFreeHost");
  atomic_fetch_add(&pinned_frees, 1);
  free(ptr);
  return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t len, void* stream) {
  struct fake_stream* s = stream;
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  if (!need_context("cuMemcpyHtoDAsync", s->ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&lock);
  struct region* from = find_region((uintptr_t)src, len);
  struct region* to = find_region((uintptr_t)dst, len);
  int unordered = !s->waited_for_ready && !(to && to->fresh);
  int from_ok = from && from->device == -1;
  int to_ok = to && to->device == s->ctx->device;
  if (from_ok && to_ok) {
    s->queued++;
    from->last_stream = s;
    from->last_copy = s->queued;
  }
  pthread_mutex_unlock(&lock);
  if (unordered) violation("%s on a stream not ordered after the destination's previous work", "cuMemcpyHtoDAsync");
  if (!from_ok) violation("%s from memory that is not pinned", "cuMemcpyHtoDAsync");
  if (!to_ok) violation("%s to memory that is not the stream's device's", "cuMemcpyHtoDAsync");
  if (!from_ok || !to_ok) return CUDA_ERROR_INVALID_VALUE;
  memcpy((void*)(uintptr_t)dst, src, len);
  atomic_fetch_add(&copies, 1);
  return CUDA_SUCCESS;
}

// ------------------------------------------------------------------ virtual memory management

#define GRANULARITY ((size_t)2 << 20)
#define HANDLE_TYPE_POSIX_FD 1
#define ACCESS_READ 1
#define ACCESS_READWRITE 3

typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
  int type;
  int id;
} CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;
typedef struct {
  char bytes[16];
} CUuuid;

struct fake_allocation {
  int fd;
  size_t len;
  int device;
};

static atomic_int vmm_live;  // allocation handles not released, in this process

int fake_vmm_live(void) { return atomic_load(&vmm_live); }

CUresult cuDeviceGetUuid_v2(CUuuid* uuid, int device) {
  if (device < 0 || device >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  memset(uuid->bytes, 0, sizeof uuid->bytes);
  uuid->bytes[0] = (char)0xfa;
  uuid->bytes[15] = (char)device;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop, int option) {
  (void)prop;
  (void)option;
  *granularity = GRANULARITY;
  return CUDA_SUCCESS;
}

static struct fake_allocation* allocation(int fd, size_t len, int device) {
  struct fake_allocation* a = calloc(1, sizeof *a);
  a->fd = fd;
  a->len = len;
  a->device = device;
  atomic_fetch_add(&vmm_live, 1);
  return a;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t len, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  (void)flags;
  if (len == 0 || len % GRANULARITY) {
    violation("%s of a size that is not a multiple of the granularity", "cuMemCreate");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (prop->requestedHandleTypes != HANDLE_TYPE_POSIX_FD || prop->location.id < 0 || prop->location.id >= DEVICES)
    return CUDA_ERROR_INVALID_VALUE;
  char name[32];
  snprintf(name, sizeof name, "fake-vmm-%d", prop->location.id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)len) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *handle = (uintptr_t)allocation(fd, len, prop->location.id);
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  struct fake_allocation* a = (struct fake_allocation*)(uintptr_t)handle;
  if (!a) return CUDA_ERROR_INVALID_HANDLE;
  close(a->fd);
  free(a);
  atomic_fetch_sub(&vmm_live, 1);
  return CUDA_SUCCESS;
}

CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle handle, int type,
                                      unsigned long long flags) {
  (void)flags;
  struct fake_allocation* a = (struct fake_allocation*)(uintptr_t)handle;
  if (!a || type != HANDLE_TYPE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
  *(int*)out = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
  return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os_handle, int type) {
  int fd = (int)(uintptr_t)os_handle;
  char link[64], target[256];
  struct stat st;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  int device = -1;
  if (n > 0) {
    target[n] = 0;
    sscanf(target, "/memfd:fake-vmm-%d", &device);
  }
  if (type != HANDLE_TYPE_POSIX_FD || device < 0 || fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
  *handle = (uintptr_t)allocation(fcntl(fd, F_DUPFD_CLOEXEC, 0), (size_t)st.st_size, device);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(uint64_t* ptr, size_t len, size_t alignment, uint64_t addr, unsigned long long flags) {
  (void)alignment;
  (void)addr;
  (void)flags;
  void* p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (uintptr_t)p;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(uint64_t ptr, size_t len) {
  pthread_mutex_lock(&lock);
  int mapped = find_region((uintptr_t)ptr, 1) != NULL;
  pthread_mutex_unlock(&lock);
  if (mapped) violation("%s of a range still mapped", "cuMemAddressFree");
  return munmap((void*)(uintptr_t)ptr, len) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemMap(uint64_t ptr, size_t len, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  (void)flags;
  struct fake_allocation* a = (struct fake_allocation*)(uintptr_t)handle;
  if (!a || offset + len > a->len) return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap((void*)(uintptr_t)ptr, len, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)offset);
  if (p == MAP_FAILED) return CUDA_ERROR_INVALID_VALUE;
  add_region((uintptr_t)ptr, len, a->device, NULL);
  pthread_mutex_lock(&lock);
  find_region((uintptr_t)ptr, len)->fresh = 1;
  pthread_mutex_unlock(&lock);
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(uint64_t ptr, size_t len, const CUmemAccessDesc* desc, size_t count) {
  if (count != 1) return CUDA_ERROR_INVALID_VALUE;
  if (desc->flags == ACCESS_READ && atomic_load(&refuse_read_only)) return CUDA_ERROR_INVALID_VALUE;
  int prot = desc->flags == ACCESS_READWRITE ? PROT_READ | PROT_WRITE : desc->flags == ACCESS_READ ? PROT_READ : PROT_NONE;
  pthread_mutex_lock(&lock);
  struct region* r = find_region((uintptr_t)ptr, len);
  int ok = r && r->device == desc->location.id;
  pthread_mutex_unlock(&lock);
  if (!ok) violation("%s on a range not mapped for the device given", "cuMemSetAccess");
  return ok && mprotect((void*)(uintptr_t)ptr, len, prot) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(uint64_t ptr, size_t len) {
  if (!remove_region((uintptr_t)ptr, NULL)) return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap((void*)(uintptr_t)ptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

// ------------------------------------------------------------------ cuFile

typedef struct {
  int err;
  int cu_err;
} CUfileError_t;

static const CUfileError_t cufile_ok = {0, 0};
static const CUfileError_t cufile_invalid = {5022, 0};

struct fake_handle {
  int fd;
};

CUfileError_t cuFileDriverOpen(void) { return cufile_ok; }

typedef struct {
  struct {
    unsigned major_version;
    unsigned minor_version;
    size_t poll_thresh_size;
    size_t max_direct_io_size;
    unsigned dstatusflags;
    unsigned dcontrolflags;
  } nvfs;
  unsigned fflags;
  unsigned max_device_cache_size;
  unsigned per_buffer_cache_size;
  unsigned max_device_pinned_mem_size;
  unsigned max_batch_io_size;
  unsigned max_batch_io_timeout_msecs;
} CUfileDrvProps_t;

CUfileError_t cuFileDriverGetProperties(CUfileDrvProps_t* props) {
  memset(props, 0, sizeof *props);
  if (!atomic_load(&compat_mode)) props->nvfs.major_version = 2;
  return cufile_ok;
}

CUfileError_t cuFileGetParameterBool(int param, _Bool* value) {
  // 2: CUFILE_PARAM_FORCE_COMPAT_MODE
  *value = param == 2 && atomic_load(&compat_mode);
  return cufile_ok;
}

typedef struct {
  int type;
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
} CUfileDescr_t;

CUfileError_t cuFileHandleRegister(void** handle, CUfileDescr_t* descr) {
  struct fake_handle* h = calloc(1, sizeof *h);
  h->fd = descr->handle.fd;
  *handle = h;
  return cufile_ok;
}

void cuFileHandleDeregister(void* handle) { free(handle); }

// Memory of the current context's device, or a violation.
static int cufile_target(const char* call, uintptr_t p, size_t len) {
  if (!need_context(call, NULL)) return 0;
  pthread_mutex_lock(&lock);
  struct region* r = find_region(p, len);
  int ok = r && r->device == current()->device;
  pthread_mutex_unlock(&lock);
  if (!ok) violation("%s into memory of another device than the current context's", call);
  return ok;
}

CUfileError_t cuFileBufRegister(const void* ptr, size_t len, int flags) {
  (void)flags;
  return cufile_target("cuFileBufRegister", (uintptr_t)ptr, len) ? cufile_ok : cufile_invalid;
}

CUfileError_t cuFileBufDeregister(const void* ptr) {
  (void)ptr;
  return cufile_ok;
}

ssize_t cuFileRead(void* handle, void* base, size_t len, int64_t file_offset, int64_t base_offset) {
  struct fake_handle* h = handle;
  char* dst = (char*)base + base_offset;
  if (!cufile_target("cuFileRead", (uintptr_t)dst, len)) return -5022;
  pthread_mutex_lock(&lock);
  int waited = ready_host_waited;
  pthread_mutex_unlock(&lock);
  if (!waited) violation("%s before the destination's previous work was waited for", "cuFileRead");
  atomic_fetch_add(&cufile_reads, 1);
  return pread(h->fd, dst, len, file_offset);
}
