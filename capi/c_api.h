/* Spillway's C ABI: what torch.cuda.memory.CUDAPluggableAllocator loads from libspillway_alloc.so.
 *
 * The process-wide allocator is created on first use from SPILLWAY_ALLOC_CONF (device:cuda by
 * default; device:sim,capacity_mb:N for the simulated device). Functions never throw: on error
 * spillway_malloc returns NULL, the others do nothing, and spillway_last_error() returns the
 * message of the calling thread's last error ("" if none). */
#ifndef SPILLWAY_CAPI_C_API_H_
#define SPILLWAY_CAPI_C_API_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t without including CUDA headers: both are an opaque pointer. */
typedef void* spillway_stream_t;  // NOLINT(modernize-use-using): a C header

/* Signatures as CUDAPluggableAllocator expects them (alloc_fn_name / free_fn_name). */
void* spillway_malloc(size_t size, int device, spillway_stream_t stream);
void spillway_free(void* ptr, size_t size, int device, spillway_stream_t stream);
/* Optional hooks of the pluggable allocator (set_record_stream_fn, set_reset_fn,
 * set_memory_fraction_fn). */
void spillway_record_stream(void* ptr, spillway_stream_t stream);
void spillway_empty_cache(void);
void spillway_set_memory_fraction(double fraction, int device);
/* Statistics by PyTorch name ("allocated_bytes.all.current", ...). Returns 0 and sets
 * *value on success, -1 for an unknown name or device. */
int spillway_get_stat(int device, const char* name, long long* value);
const char* spillway_last_error(void);
/* Splits a PYTORCH_CUDA_ALLOC_CONF string into Spillway's items and PyTorch's (see
 * SplitPytorchConfig). Needs no device. Returns 0 on success, -1 for a bad Spillway item
 * (message in spillway_last_error), -2 when an output buffer is too small. */
int spillway_split_config(const char* text, char* spillway_out, size_t spillway_capacity,
                          char* pytorch_out, size_t pytorch_capacity);

#ifdef __cplusplus
}
#endif

#endif /* SPILLWAY_CAPI_C_API_H_ */
