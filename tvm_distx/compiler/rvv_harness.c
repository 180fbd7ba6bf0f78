/*
 * tvm-distx kernel harness: run one kernel of a TVM kernel library through the
 * tvm-ffi C ABI, with no TVM runtime. Built for riscv64 and run under qemu to
 * check RVV kernels against numpy (see tvm_distx/rvv.py).
 *
 *   harness LIBRARY KERNEL NARGS { CODE BITS NDIM DIM... in|out FILE }...
 *
 * Each argument is a dense CPU tensor; "in" tensors are read from FILE (raw
 * little-endian elements), "out" tensors are written to FILE after the call.
 * CODE is a DLPack type code (0 int, 1 uint, 2 float).
 *
 * A kernel library imports TVMFFIErrorSetRaisedFromCStrParts (defined here and
 * exported with -rdynamic) and holds weak pointers to the backend functions it
 * calls for parallel loops and scratch memory, which are filled here: parallel
 * loops run as one task, workspaces come from malloc.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tvm/ffi/c_api.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} ParallelEnv;
typedef int (*ParallelLambda)(int task_id, ParallelEnv* env, void* cdata);

static int parallel_launch(ParallelLambda body, void* cdata, int num_task) {
  ParallelEnv env = {NULL, 1};
  (void)num_task;
  return body(0, &env, cdata);
}

static void* alloc_workspace(int device_type, int device_id, uint64_t bytes, int code, int bits) {
  (void)device_type, (void)device_id, (void)code, (void)bits;
  return malloc(bytes ? bytes : 1);
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type, (void)device_id;
  free(ptr);
  return 0;
}

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t n) {
  fprintf(stderr, "kernel error: %s:", kind);
  for (int32_t i = 0; i < n; ++i) {
    if (parts[i]) fprintf(stderr, " %s", parts[i]);
  }
  fprintf(stderr, "\n");
}

static void fail(const char* what, const char* detail) {
  fprintf(stderr, "harness: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  exit(2);
}

static void set_pointer(void* lib, const char* name, void* value) {
  void** slot = (void**)dlsym(lib, name);
  if (slot) *slot = value; /* absent when the kernels never need it */
}

static size_t file_io(const char* path, void* data, size_t bytes, int writing) {
  FILE* f = fopen(path, writing ? "wb" : "rb");
  if (!f) fail("cannot open", path);
  size_t done = writing ? fwrite(data, 1, bytes, f) : fread(data, 1, bytes, f);
  fclose(f);
  if (done != bytes) fail(writing ? "short write" : "short read", path);
  return done;
}

int main(int argc, char** argv) {
  if (argc < 4) fail("usage: harness LIBRARY KERNEL NARGS {CODE BITS NDIM DIM... in|out FILE}...", NULL);
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) fail("dlopen failed", dlerror());
  set_pointer(lib, "__TVMBackendParallelLaunch", (void*)parallel_launch);
  set_pointer(lib, "__TVMBackendAllocWorkspace", (void*)alloc_workspace);
  set_pointer(lib, "__TVMBackendFreeWorkspace", (void*)free_workspace);

  char symbol[256];
  snprintf(symbol, sizeof(symbol), "__tvm_ffi_%s", argv[2]);
  TVMFFISafeCallType kernel = (TVMFFISafeCallType)dlsym(lib, symbol);
  if (!kernel) fail("no such kernel", symbol);

  int nargs = atoi(argv[3]);
  DLTensor* tensors = calloc(nargs, sizeof(DLTensor));
  TVMFFIAny* args = calloc(nargs, sizeof(TVMFFIAny));
  const char** outputs = calloc(nargs, sizeof(char*));
  size_t* sizes = calloc(nargs, sizeof(size_t));
  int at = 4;
  for (int i = 0; i < nargs; ++i) {
    if (at + 3 > argc) fail("missing argument description", NULL);
    DLTensor* t = &tensors[i];
    t->dtype.code = (uint8_t)atoi(argv[at++]);
    t->dtype.bits = (uint8_t)atoi(argv[at++]);
    t->dtype.lanes = 1;
    t->ndim = atoi(argv[at++]);
    t->shape = calloc(t->ndim > 0 ? t->ndim : 1, sizeof(int64_t));
    size_t count = 1;
    for (int d = 0; d < t->ndim; ++d) count *= (size_t)(t->shape[d] = atoll(argv[at++]));
    t->device.device_type = kDLCPU;
    sizes[i] = count * t->dtype.bits / 8;
    t->data = aligned_alloc(64, (sizes[i] + 63) / 64 * 64);
    if (at + 2 > argc) fail("missing in|out FILE", NULL);
    const char* role = argv[at++];
    const char* path = argv[at++];
    if (strcmp(role, "in") == 0) {
      file_io(path, t->data, sizes[i], 0);
    } else {
      memset(t->data, 0, sizes[i]);
      outputs[i] = path;
    }
    args[i].type_index = kTVMFFIDLTensorPtr;
    args[i].v_ptr = t;
  }

  TVMFFIAny result;
  memset(&result, 0, sizeof(result));
  if (kernel(NULL, args, nargs, &result) != 0) fail("the kernel failed", argv[2]);
  for (int i = 0; i < nargs; ++i) {
    if (outputs[i]) file_io(outputs[i], tensors[i].data, sizes[i], 1);
  }
  return 0;
}
