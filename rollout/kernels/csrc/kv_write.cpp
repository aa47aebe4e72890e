// A step's new keys and values into the paged cache in one call (CPU), for every layer's attention.
//
// `k_cache.index_copy_(1, slots, key)` and the same for values cost ~15-20 us each through TensorIterator at
// decode sizes (a few rows of Hkv x D), 24 calls a step on a 12-layer model; this is one loop of row copies.

#include <torch/extension.h>

#include <cstring>

// k_cache, v_cache [Hkv, S, D]; key, value [Hkv, T, D] (any strides, D contiguous) of the caches' dtype;
// slots [T] int64: key[h, t] -> k_cache[h, slots[t]]
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& key,
              const at::Tensor& value) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "write_kv: contiguous caches [Hkv, S, D] of one shape");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(0) == k_cache.size(0) &&
                  key.size(2) == k_cache.size(2) && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv: key and value [Hkv, T, D] with D contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "write_kv: key and value in the caches' dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == key.size(1) &&
                  slots.is_contiguous(),
              "write_kv: int64 slots [T]");
  const int64_t H = key.size(0), T = key.size(1), D = key.size(2), S = k_cache.size(1);
  const int64_t es = key.element_size(), row = D * es;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv: slot out of range");
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t dst = (h * S + sp[t]) * row;
      std::memcpy(kc + dst, kp + (h * key.stride(0) + t * key.stride(1)) * es, row);
      std::memcpy(vc + dst, vp + (h * value.stride(0) + t * value.stride(1)) * es, row);
    }
  }
}
