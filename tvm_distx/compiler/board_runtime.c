/* The board runtime's C part: the kernels' backend hooks and error reporter, with no TVM.
 *
 * A kernel library made by TVM calls three hook variables (__TVMBackendAllocWorkspace,
 * __TVMBackendFreeWorkspace, __TVMBackendParallelLaunch) and imports TVM's error reporter
 * (TVMFFIErrorSetRaisedFromCStrParts). Kernels allocate workspace inside their parallel
 * loops thousands of times per decode step, which a Python callback cannot serve fast, so
 * tvm_distx.runtime.board.executor points the hooks at these functions when this library is there.
 * It is compiled on the build machine (tvm_distx.compiler.board_plan.build_board_runtime, with
 * the target's C compiler) and travels in the bundle: the board needs no compiler.
 * Standard C only: malloc, one task per parallel region (a rank is one core).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} tvm_distx_parallel_env;

typedef int (*tvm_distx_parallel_body)(int task_id, tvm_distx_parallel_env* env, void* cdata);

void* tvm_distx_alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code,
                                int bits) {
  void* pointer = NULL;
  (void)device_type, (void)device_id, (void)code, (void)bits;
  if (posix_memalign(&pointer, 64, nbytes ? (size_t)nbytes : 1) != 0) return NULL;
  return pointer;
}

int tvm_distx_free_workspace(int device_type, int device_id, void* pointer) {
  (void)device_type, (void)device_id;
  free(pointer);
  return 0;
}

int tvm_distx_parallel_launch(tvm_distx_parallel_body body, void* cdata, int num_task) {
  tvm_distx_parallel_env env = {NULL, 1};
  (void)num_task;
  return body(0, &env, cdata);
}

static __thread char last_error[4096];

void tvm_distx_error_parts(const char* kind, const char** parts, int32_t count) {
  size_t used = (size_t)snprintf(last_error, sizeof last_error, "%s: ", kind ? kind : "Error");
  for (int32_t i = 0; i < count && used < sizeof last_error - 1; ++i) {
    if (parts[i] == NULL) continue;
    size_t length = strlen(parts[i]);
    if (length > sizeof last_error - 1 - used) length = sizeof last_error - 1 - used;
    memcpy(last_error + used, parts[i], length);
    used += length;
  }
  last_error[used < sizeof last_error ? used : sizeof last_error - 1] = '\0';
}

void tvm_distx_error(const char* kind, const char* message) {
  const char* parts[1] = {message};
  tvm_distx_error_parts(kind, parts, 1);
}

/* The message of the last failure in this thread ("" if none), then forgotten. */
int tvm_distx_last_error(char* out, int32_t size) {
  int32_t length = (int32_t)strlen(last_error);
  if (size > 0) {
    snprintf(out, (size_t)size, "%s", last_error);
  }
  last_error[0] = '\0';
  return length;
}
