// The KV write for XLA:CPU, through the XLA FFI: the CPU path of
// `pallas_kernels.ragged_paged_attention.write_slots` (same result; that scatter is its
// oracle), for caches XLA:CPU cannot update in place. XLA:CPU scatters (and
// dynamic-update-slices) bfloat16 by converting the whole cache to float32 and back:
// twice the cache's bytes written per layer per step (a 0.5B model's 16-row bfloat16
// decode step took 213 ms, 113 in float32). Here each new row is copied into its slot.
//
//   cache [P, S, ...] (any dtype), rows [T, ...] (the same dtype), slots [T] int32
//   (page * S + offset; padding rows name the null page) -> the cache, aliased to its
//   input: in place when the caller donates the cache (the engine's steps do),
//   otherwise XLA copies it first, as for any in-place update.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteSlots(ffi::AnyBuffer cache, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto cache_dims = cache.dimensions();
  const auto row_dims = rows.dimensions();
  const int64_t t = static_cast<int64_t>(slots.element_count());
  bool ok = rows.element_type() == cache.element_type() && cache_dims.size() >= 2 &&
            row_dims.size() == cache_dims.size() - 1 && row_dims[0] == t &&
            out->size_bytes() == cache.size_bytes();
  for (size_t i = 1; ok && i < row_dims.size(); ++i) ok = row_dims[i] == cache_dims[i + 1];
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "write_slots: rows must be [T, ...] of the cache's dtype and row shape");
  }
  if (t == 0) return ffi::Error::Success();
  const size_t row_bytes = rows.size_bytes() / t;
  const int64_t num_slots = cache_dims[0] * cache_dims[1];
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < t; ++i) {  // all checked before any is written
    if (slot[i] < 0 || slot[i] >= num_slots) {
      return ffi::Error::InvalidArgument("write_slots: a slot is outside the cache");
    }
  }
  auto* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) {  // not aliased (XLA aliases them: a safeguard)
    std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  }
  const auto* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(dst + slot[i] * row_bytes, src + i * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteSlots, WriteSlots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
