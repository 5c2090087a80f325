/* Stub libcuda.so.1 for running the PyPI `mooncake-transfer-engine` (CUDA build) on a machine with no GPU driver.
 *
 * Mooncake's .so files link libcuda.so.1 directly for the cu* driver calls below; over the TCP transport with host
 * memory none of them does useful work, so every entry point reports CUDA_ERROR_NO_DEVICE (100).  The list is the
 * union of `nm -D --undefined-only mooncake/*.so | grep ' cu[A-Z]'` for mooncake-transfer-engine 0.3.13.post1;
 * experiments/transfer_mooncake.py re-runs nm at prepare time and appends any symbol a newer wheel adds.
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_stub.c
 */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100
#define STUB(name) int name() { return CUDA_ERROR_NO_DEVICE; }

int cuGetErrorName(int err, const char **out) { (void)err; if (out) *out = "CUDA_ERROR_NO_DEVICE"; return 0; }
int cuGetErrorString(int err, const char **out) { (void)err; if (out) *out = "no CUDA driver (stub libcuda)"; return 0; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return CUDA_ERROR_NO_DEVICE; }
int cuDeviceGetCount(int *n) { if (n) *n = 0; return CUDA_ERROR_NO_DEVICE; }

STUB(cuInit)
STUB(cuCtxGetDevice)
STUB(cuCtxSetCurrent)
STUB(cuDeviceGet)
STUB(cuDeviceGetAttribute)
STUB(cuDevicePrimaryCtxRelease_v2)
STUB(cuDevicePrimaryCtxRetain)
STUB(cuMemAddressFree)
STUB(cuMemAddressReserve)
STUB(cuMemCreate)
STUB(cuMemExportToShareableHandle)
STUB(cuMemGetAddressRange_v2)
STUB(cuMemGetAllocationGranularity)
STUB(cuMemGetHandleForAddressRange)
STUB(cuMemImportFromShareableHandle)
STUB(cuMemMap)
STUB(cuMemRelease)
STUB(cuMemRetainAllocationHandle)
STUB(cuMemSetAccess)
STUB(cuMemUnmap)
STUB(cuPointerGetAttribute)
STUB(cuPointerSetAttribute)
/* extra symbols found by nm at prepare time are appended below this line */
